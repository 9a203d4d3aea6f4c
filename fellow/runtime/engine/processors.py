"""What a request adds around the sampler: logits processors before it, logprobs beside it.

Processors, in vLLM's order: ``logit_bias`` is added to the logits; ``min_tokens`` bars the
end-of-turn ids until that many tokens came; ``repetition_penalty`` (vLLM's) divides the positive
logits of every token in the prompt or the output so far and multiplies the negative ones;
``frequency_penalty`` and ``presence_penalty`` (OpenAI's) subtract ``count * frequency +
(count > 0) * presence`` for every token of the output so far (a moved reply's ``earlier_ids`` included).

Logprobs come from the distribution the sampler draws from before it truncates: the processed
logits over the temperature (greedy rows: the processed logits as they are), log-softmaxed
(vLLM's ``processed_logprobs``). top-k, top-p and min-p do not change them.

A grammar (structured outputs, constrained tool calls) is the last processor: a row's
``constraint`` (a Constraint, built from ``sampling.grammar`` by whoever samples the row) bars
every token its llguidance matcher does not allow next, and takes the token drawn. The masks of
a batch's constrained rows are computed together, beside unconstrained rows that pay nothing.

A row is anything with ``sampling``, ``generator``, ``prompt_ids``, ``output_ids``, ``stop_ids``,
``pending_logprob`` and ``constraint`` (a Session, or a ring's last stage's held session).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from fellow.runtime.engine.sampling import sample

log = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0  # what a barred token's logprob shows as (JSON has no -inf), as OpenAI does

# (token id, logprob, [(candidate id, logprob), ...] best first)
Logprob = tuple[int, float, list[tuple[int, float]]]


def sample_next(logits: torch.Tensor, rows: Sequence) -> list[int]:
    """Each row's next token from logits [B, V]; a row that asked for logprobs gets ``pending_logprob``."""
    logits = processed(logits, rows)
    tokens = sample(logits, [r.sampling for r in rows], [r.generator for r in rows]).tolist()
    for i, (row, token) in enumerate(zip(rows, tokens)):
        if row.sampling.logprobs is not None:
            row.pending_logprob = logprob_of(logits[i], token, row.sampling.temperature, row.sampling.logprobs)
        constraint = getattr(row, "constraint", None)
        if constraint is not None:
            constraint.take(token)
    return tokens


def processed(logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
    """The logits with each row's processors applied (the same tensor when no row has any)."""
    which = [i for i, row in enumerate(rows) if row.sampling.adjusts]
    bound = [i for i, row in enumerate(rows) if getattr(row, "constraint", None) is not None]
    if not which and not bound:
        return logits
    logits = logits.float().clone()
    for i in which:
        _process_row(logits[i], rows[i])
    if bound:
        allowed = allowed_tokens([rows[i].constraint for i in bound], logits.shape[-1]).to(logits.device)
        index = torch.tensor(bound, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def _process_row(scores: torch.Tensor, row) -> None:
    p = row.sampling
    device, vocab = scores.device, scores.shape[-1]
    if p.logit_bias:
        bias = [(i, b) for i, b in p.logit_bias.items() if 0 <= i < vocab]
        ids = torch.tensor([i for i, _ in bias], device=device, dtype=torch.long)
        scores[ids] += torch.tensor([b for _, b in bias], device=device)
    if p.min_tokens and len(row.output_ids) < p.min_tokens and row.stop_ids:
        scores[torch.tensor(sorted(row.stop_ids), device=device, dtype=torch.long)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), device=device, dtype=torch.long)
        values = scores[seen]
        scores[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    output = [*getattr(row, "earlier_ids", ()), *row.output_ids]  # a moved reply's earlier ids count too
    if (p.frequency_penalty or p.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=device), minlength=vocab)[:vocab].float()
        scores -= counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty


def logprob_of(scores: torch.Tensor, token: int, temperature: float, top: int) -> Logprob:
    """The token's logprob and the ``top`` best candidates' from one row of processed logits [V]."""
    scores = scores.float()
    if temperature > 0:
        scores = scores / temperature
    logprobs = torch.log_softmax(scores, dim=-1).clamp(min=MIN_LOGPROB)
    best: list[tuple[int, float]] = []
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        best = list(zip(ids.tolist(), values.tolist()))
    return token, float(logprobs[token]), best


# --- grammars (structured outputs and constrained tool calls) -------------------------------------

_tokenizers: dict[tuple[int, frozenset[int]], object] = {}
_tokenizers_lock = threading.Lock()
_executor = None
MASK_THREADS = max(1, min(16, (os.cpu_count() or 2) // 2))  # half the cores: torch's threads run beside them


class Constraint:
    """One row's grammar: an llguidance matcher over the model's tokenizer, advanced by every token drawn.

    The row's stop ids are the grammar's end tokens: they are allowed only where the grammar may
    end, and once it must end nothing else is. A matcher that errs (it cannot, short of a bug) lets
    only the stop ids through, and its error goes to the log.
    """

    def __init__(self, matcher, grammar: str, vocab: int):
        self.matcher = matcher
        self.grammar = grammar
        self.vocab = vocab  # the tokenizer's ids, which the bitmask covers
        self.logged = False

    def take(self, token: int) -> None:
        if not self.matcher.is_error():
            self.matcher.consume_token(token)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error() and not self.logged:
            self.logged = True
            log.warning("a grammar-constrained reply left its grammar: %s", self.matcher.get_error())


def ll_tokenizer(tokenizer, stop_ids: frozenset[int]):
    """llguidance's view of a transformers tokenizer, built once per tokenizer (it takes about a second)."""
    key = (id(tokenizer), frozenset(stop_ids))
    with _tokenizers_lock:
        found = _tokenizers.get(key)
        if found is None:
            import llguidance.hf

            found = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer),
                                                 eos_token=sorted(stop_ids) or None)
            _tokenizers[key] = found
        return found


def constraint_for(tokenizer, grammar: str, stop_ids: frozenset[int],
                   output_ids: Sequence[int] = ()) -> Constraint | None:
    """A row constraint for an llguidance grammar (None for no grammar), advanced past ``output_ids`` (a
    replayed reply so far); ValueError if it does not compile or the ids do not follow it."""
    if not grammar:
        return None
    from llguidance import LLMatcher

    ll = ll_tokenizer(tokenizer, stop_ids)
    matcher = LLMatcher(ll, grammar, log_level=0)
    if output_ids and not matcher.is_error():
        matcher.consume_tokens(list(output_ids))
    if matcher.is_error():
        raise ValueError(f"the grammar does not compile or its reply so far left it: {matcher.get_error()}")
    return Constraint(matcher, grammar, ll.vocab_size)


def allowed_tokens(constraints: Sequence[Constraint], vocab: int) -> torch.Tensor:
    """[R, vocab] booleans: the tokens each constraint allows next (ids past its tokenizer: none).

    The masks are computed together on llguidance's thread pool (one at a time where the pool would
    have one thread), into one bitmask, unpacked with numpy: small tensor ops would wake torch's
    intra-op threads, which costs more than the masks on a busy CPU."""
    global _executor
    from llguidance import LLExecutor

    words = max((c.vocab + 31) // 32 for c in constraints)
    bitmask = np.zeros((len(constraints), words), dtype=np.int32)
    if len(constraints) == 1 or MASK_THREADS == 1:  # no pool to hand the work to and back
        for i, c in enumerate(constraints):
            c.matcher.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, words * 4)
    else:
        if _executor is None:
            _executor = LLExecutor(num_threads=MASK_THREADS)
        _executor.unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(constraints)],
                                          bitmask.ctypes.data, words * 4, len(constraints))
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)  # [R, 32 * words]
    allowed = np.zeros((len(constraints), vocab), dtype=bool)
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = bits[:, :width]
    return torch.from_numpy(allowed)
