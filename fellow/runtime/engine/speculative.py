"""Checking a pass's drafted tokens against the model: ``verify_drafts`` (the spec's TS1-TS2).

A verify pass ran ``[last, *drafts]`` and has logits at every position: position j gives the
distribution of the token after ``drafts[:j]``. The drafts stand from the first on while the model
agrees, and the pass adds one token of the model's own: at the first draft that falls, or after the
last one.

- Greedy: a draft stands while it is the argmax of its position's processed logits.
- Sampled: standard speculative sampling with a point-mass draft. A draft stands with the
  probability the request's distribution (its processors, temperature, top-k, top-p, min-p) gives
  it; a fallen draft's position is drawn from that distribution without it (the normalised
  ``max(0, p - q)``). Every token then has exactly the distribution it has without drafts. Draws
  come from the request's own generator, so a seeded request repeats itself with speculation as it
  does without (its tokens differ from a run without drafts: the draws are spent differently).

Processors that depend on the reply so far (penalties, min_tokens) see, at position j, the reply
extended by ``drafts[:j]``: each position is processed as it would be had the drafts before it
been sampled one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fellow.runtime.engine.processors import logprob_of, processed
from fellow.runtime.engine.sampling import _draw, filtered_probs, sample


@dataclass(frozen=True, slots=True)
class _Ahead:
    """A row as the processors see it at a later position of a verify pass: its reply extended by
    the drafts before that position."""

    sampling: object
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: frozenset[int]
    earlier_ids: list[int]  # a moved reply's ids before this stage's (Session.earlier_ids)


def verify_drafts(logits: torch.Tensor, drafts: list[int], row) -> list[tuple[int, tuple | None]]:
    """The tokens a pass gains for one row, [(token, logprob or None), ...]: the drafts that stand,
    then one of the model's own. ``logits`` [len(drafts) + 1, V] are the pass's for that row; ``row``
    is a Session (sampling, generator, prompt_ids, output_ids, stop_ids, constraint).

    A row with a grammar (``constraint``) drafts nothing (drafting.draft_limit): its one position is masked
    by the processors, and the token it gains advances its grammar."""
    gained = _verify(logits, drafts, row)
    constraint = getattr(row, "constraint", None)
    if constraint is not None:
        for token, _ in gained:
            constraint.take(token)
    return gained


def _verify(logits: torch.Tensor, drafts: list[int], row) -> list[tuple[int, tuple | None]]:
    params = row.sampling
    wants_logprobs = params.logprobs is not None
    gained: list[tuple[int, tuple | None]] = []
    if params.greedy and not params.adjusts and not wants_logprobs:  # the common case, one argmax for all
        best = logits.argmax(dim=-1).tolist()
        for j, draft in enumerate(drafts):
            gained.append((best[j], None))
            if best[j] != draft:
                return gained
        gained.append((best[len(drafts)], None))
        return gained
    for j in range(len(drafts) + 1):
        ahead = row if j == 0 else _Ahead(params, row.prompt_ids, row.output_ids + drafts[:j], row.stop_ids,
                                          getattr(row, "earlier_ids", []))
        scores = processed(logits[j : j + 1], [ahead])[0]
        if j == len(drafts):
            token = int(sample(scores[None], [params], [row.generator])[0])
        elif params.greedy:
            token = int(torch.argmax(scores))
        else:
            token = _check_sampled(scores, drafts[j], params, row.generator)
        logprob = logprob_of(scores, token, params.temperature, params.logprobs) if wants_logprobs else None
        gained.append((token, logprob))
        if j < len(drafts) and token != drafts[j]:
            break
    return gained


def _check_sampled(scores: torch.Tensor, draft: int, params, generator: torch.Generator | None) -> int:
    """The draft if it stands (with its probability under the request's distribution), else a token
    drawn from that distribution without the draft."""
    probs, ids = filtered_probs(scores[None], params)  # [1, K] unnormalised, candidate ids or None
    probs = probs[0] / probs[0].sum()
    where = (ids[0] == draft) if ids is not None else None
    if ids is None:
        p = probs[draft]
    else:
        p = probs[where].sum()  # 0 when the draft is not a candidate
    u = torch.rand((), generator=generator, device=probs.device)
    if u < p:
        return draft
    rest = probs.clone()
    if ids is None:
        rest[draft] = 0.0
    else:
        rest[where] = 0.0
    if not bool(rest.sum() > 0):  # the draft held all the mass but for rounding: it stands
        return draft
    pick = int(_draw(rest[None], [generator])[0])
    return pick if ids is None else int(ids[0, pick])
