"""The one token sampler every serving path uses: temperature, top-k, top-p, min-p, seeded per request.

The logits processors a request may add (penalties, logit_bias, min_tokens) and its logprobs run
before it, in fellow.runtime.engine.processors.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from events.requests import Sampling  # the one declaration of a request's sampling


def make_generator(params: Sampling, device: torch.device | str = "cpu", vocab: int = 0) -> torch.Generator | None:
    """A generator of the request's own, so one request's draws never shift another's; None when greedy.

    A moved request's (``params.drawn``: tokens sampled on the stage that died) then draws and drops the noise
    of those tokens, each as wide as ``_draw`` drew it over ``vocab`` logits, so it stands where the earlier
    stage's stood and a seeded reply goes on as it would have (one draw a token: not with speculative
    decoding, whose checks draw more)."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    if params.drawn and vocab:
        width = min(params.top_k, vocab) if params.top_k > 0 else vocab
        for _ in range(params.drawn):
            torch.empty(width, device=device).exponential_(generator=generator)
    return generator


def filtered_probs(logits: torch.Tensor, params: Sampling) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Candidate probabilities ([..., K], unnormalised) and their token ids ([..., K]; None means all ids).

    Rows (the leading dimensions) are filtered independently, all with the same ``params``, in the
    order transformers applies them: temperature, top-k, top-p, min-p.
    """
    scores = logits.float() / params.temperature
    ids = None
    if params.top_k > 0 or params.top_p < 1.0:
        k = min(params.top_k, scores.shape[-1]) if params.top_k > 0 else scores.shape[-1]
        scores, ids = torch.topk(scores, k)  # sorted, highest first
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        # keep the smallest head whose mass reaches top_p; the first candidate always stays
        before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs, ids


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One candidate index per row [R], each row drawn with its own generator.

    argmax(p / E) with E ~ Exp(1) draws from p (the exponential race); only the noise is per row,
    so a row's draw does not depend on the rows beside it.
    """
    noise = torch.stack([torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=g)
                         for g in generators])
    return torch.argmax(probs / noise, dim=-1)


def sample(
    logits: torch.Tensor,
    params: Sequence[Sampling],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Token ids [B] from logits [B, V], each row with its own params and generator.

    Greedy rows take one argmax together; sampled rows are filtered together where their params
    match, and each draws from its own generator.
    """
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(params)} params, {len(generators)} generators")
    tokens = torch.argmax(logits, dim=-1)  # [B]
    alike: dict[tuple, list[int]] = {}
    for row, row_params in enumerate(params):
        if not row_params.greedy:
            key = (row_params.temperature, row_params.top_p, row_params.top_k, row_params.min_p)
            alike.setdefault(key, []).append(row)
    for rows in alike.values():
        selected = logits if len(rows) == logits.shape[0] else logits[rows]
        probs, ids = filtered_probs(selected, params[rows[0]])
        picks = _draw(probs, [generators[row] for row in rows])
        chosen = picks if ids is None else ids.gather(-1, picks[:, None])[:, 0]
        if len(rows) == logits.shape[0]:
            tokens = chosen
        else:
            tokens[rows] = chosen
    return tokens


def sample_row(logits: torch.Tensor, params: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """One token id (a 0-d tensor) from one row of logits [V]."""
    return sample(logits[None], [params], [generator])[0]
