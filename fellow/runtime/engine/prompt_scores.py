"""A prompt's own logprobs (Sampling.prompt_logprobs; OpenAI's ``echo`` with ``logprobs``, vLLM's
``prompt_logprobs``): for each prompt position after the first, the logprob the model gave that token
after the ones before it, its rank, and the ``top`` likeliest candidates, from the raw logits of a
teacher-forced pass (no temperature, penalties or bias: what a perplexity or an evaluation harness reads).

The stage that holds the head computes them while it runs the prompt: each piece's logits at every
position (``StageModel.piece_logits``) instead of the last one's only. A request that asks for them
runs its prompt alone and from the start (no fresh batch, no prefix reuse), so every position is its own.
"""

from __future__ import annotations

import torch

from fellow.runtime.engine.processors import MIN_LOGPROB


def scored_piece(stage, cache, inputs: torch.Tensor, prompt_ids: list[int], start: int,
                 top: int) -> tuple[torch.Tensor, list[tuple | None]]:
    """Run a prompt piece (ids, or hidden states on a ring's last stage) that starts at prompt position
    ``start`` with the head on every position: (its last position's logits, the entries it scores, led by
    None for the prompt's first position)."""
    rows = stage.piece_logits(cache, inputs)
    return rows[-1], ([None] if start == 0 else []) + piece_scores(rows, prompt_ids, start, top)


def piece_scores(rows: torch.Tensor, prompt_ids: list[int], start: int, top: int) -> list[tuple]:
    """(token id, logprob, [(id, logprob) x top], rank) for the prompt tokens that follow the positions
    ``start`` .. ``start + len(rows) - 1`` of a piece whose logits are ``rows`` [q, V]: the prompt's
    token at position p + 1 scored by row p. The prompt's last position scores nothing (its row samples
    the reply's first token)."""
    targets = prompt_ids[start + 1 : start + 1 + rows.shape[0]]
    if not targets:
        return []
    logprobs = torch.log_softmax(rows[: len(targets)].float(), dim=-1).clamp(min=MIN_LOGPROB)
    ids = torch.tensor(targets, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, ids)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    best: list[list[tuple[int, float]]] = [[] for _ in targets]
    if top:
        values, indices = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        best = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return [(t, lp, b, r) for t, lp, b, r in zip(targets, chosen, best, ranks)]
