"""A session as a later ring stage holds it (fellow.runtime.ring.worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from events.requests import Sampling
from fellow.runtime.model.kv_cache import KVCache


@dataclass(eq=False)
class Held:
    """A session as a later stage holds it: its cache and, on the last stage, its sampling and the
    ids its logits processors need (the tokens it sampled so far among them)."""

    cache: KVCache
    sampling: Sampling
    generator: torch.Generator | None
    prompt_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    pending_logprob: tuple | None = None
    ids: list[int] = field(default_factory=list)  # the token ids of its cache's positions, when frames carry them
    attempt: int = 0  # the session's try whose frames it runs (events.ring.Hidden.attempt)
    unverified: int = 0  # positions of its last VERIFY frame that may not stand: its next frame says
    constraint: object | None = None  # processors.Constraint of the request's grammar, if any

    def sampled(self, token: int) -> tuple | None:
        """Take the token this stage drew; its logprob, if the request asked for them."""
        self.output_ids.append(token)
        logprob, self.pending_logprob = self.pending_logprob, None
        return logprob
