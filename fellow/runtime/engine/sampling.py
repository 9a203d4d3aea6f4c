"""The one token sampler every serving path uses: temperature, top-k, top-p, min-p, seeded per request.

The logits processors a request may add (penalties, logit_bias, min_tokens) and its logprobs run
before it, in fellow.runtime.engine.processors.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # top candidates a request may ask for (OpenAI's top_logprobs bound)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """A request's sampling; temperature 0 is greedy argmax, and 0 / 1.0 switch the other filters off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k candidates'
    grammar: str = ""  # an llguidance grammar the reply must follow (processors.Constraint); "" for none

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs={self.logprobs} must be in [0, {MAX_LOGPROBS}]")

    @property
    def adjusts(self) -> bool:
        """Whether a logits processor changes this request's logits before it samples."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.grammar)

    @property
    def greedy(self) -> bool:
        # top_k 1 keeps only the argmax, so it needs no random draw either
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def of(cls, sampling) -> "SamplingParams":
        """From any object with the same fields (events.requests.Sampling, say)."""
        if isinstance(sampling, cls):
            return sampling
        bias = getattr(sampling, "logit_bias", None) or {}
        pairs = bias.items() if isinstance(bias, dict) else bias
        logprobs = getattr(sampling, "logprobs", None)
        return cls(
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=int(sampling.top_k),
            min_p=float(sampling.min_p),
            seed=sampling.seed,
            presence_penalty=float(getattr(sampling, "presence_penalty", 0.0)),
            frequency_penalty=float(getattr(sampling, "frequency_penalty", 0.0)),
            repetition_penalty=float(getattr(sampling, "repetition_penalty", 1.0)),
            logit_bias=tuple(sorted((int(k), float(v)) for k, v in pairs)),
            min_tokens=int(getattr(sampling, "min_tokens", 0)),
            logprobs=None if logprobs is None or logprobs < 0 else int(logprobs),
            grammar=str(getattr(sampling, "grammar", "") or ""),
        )


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator of the request's own, so one request's draws never shift another's; None when greedy."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return generator


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    params: Sequence[SamplingParams],
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


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id (a 0-d tensor) from one row of logits [V]."""
    return sample(logits[None], [params], [generator])[0]
