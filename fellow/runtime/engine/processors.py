"""What a request adds around the sampler: logits processors before it, logprobs beside it.

Processors, in vLLM's order: ``logit_bias`` is added to the logits; ``min_tokens`` bars the
end-of-turn ids until that many tokens came; ``repetition_penalty`` (vLLM's) divides the positive
logits of every token in the prompt or the output so far and multiplies the negative ones;
``frequency_penalty`` and ``presence_penalty`` (OpenAI's) subtract ``count * frequency +
(count > 0) * presence`` for every token of the output so far.

Logprobs come from the distribution the sampler draws from before it truncates: the processed
logits over the temperature (greedy rows: the processed logits as they are), log-softmaxed
(vLLM's ``processed_logprobs``). top-k, top-p and min-p do not change them.

A row is anything with ``sampling``, ``generator``, ``prompt_ids``, ``output_ids``, ``stop_ids``
and ``pending_logprob`` (a Session, or a ring's last stage's held session).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fellow.runtime.engine.sampling import sample

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
    return tokens


def processed(logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
    """The logits with each row's processors applied (the same tensor when no row has any)."""
    which = [i for i, row in enumerate(rows) if row.sampling.adjusts]
    if not which:
        return logits
    logits = logits.float().clone()
    for i in which:
        _process_row(logits[i], rows[i])
    return logits


def _process_row(scores: torch.Tensor, row) -> None:
    p = row.sampling
    device, vocab = scores.device, scores.shape[-1]
    if p.logit_bias:
        ids = torch.tensor([i for i, _ in p.logit_bias if 0 <= i < vocab], device=device, dtype=torch.long)
        scores[ids] += torch.tensor([b for i, b in p.logit_bias if 0 <= i < vocab], device=device)
    if p.min_tokens and len(row.output_ids) < p.min_tokens and row.stop_ids:
        scores[torch.tensor(sorted(row.stop_ids), device=device, dtype=torch.long)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), device=device, dtype=torch.long)
        values = scores[seen]
        scores[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and row.output_ids:
        counts = torch.bincount(torch.tensor(row.output_ids, device=device), minlength=vocab)[:vocab].float()
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
