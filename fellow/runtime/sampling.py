"""The one token sampler every serving path uses: temperature, top-k, top-p, min-p, seeded per request."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """A request's sampling; temperature 0 is greedy argmax, and 0 / 1.0 switch the other filters off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")

    @property
    def greedy(self) -> bool:
        # top_k 1 keeps only the argmax, so it needs no random draw either
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def of(cls, sampling) -> "SamplingParams":
        """From any object with the same fields (events.requests.Sampling, say)."""
        if isinstance(sampling, cls):
            return sampling
        return cls(
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=int(sampling.top_k),
            min_p=float(sampling.min_p),
            seed=sampling.seed,
        )


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator of the request's own, so one request's draws never shift another's; None when greedy."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return generator


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One row's candidate probabilities ([K], unnormalised) and their token ids ([K]; None means all ids).

    The filters run in the order transformers applies them: temperature, top-k, top-p, min-p.
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
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs, ids


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id (a 0-d tensor) from one row of logits [V]."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    probs, ids = filtered_probs(logits, params)
    pick = torch.multinomial(probs, 1, generator=generator)[0]
    return pick if ids is None else ids[pick]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Token ids [B] from logits [B, V], each row with its own params and generator.

    Sampled rows are drawn one at a time on their own slice, so a row's token does not depend on
    which other rows share the batch; greedy rows take one argmax together.
    """
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(params)} params, {len(generators)} generators")
    tokens = torch.argmax(logits, dim=-1)  # [B]
    for row, (row_params, generator) in enumerate(zip(params, generators)):
        if not row_params.greedy:
            tokens[row] = sample_row(logits[row], row_params, generator)
    return tokens
