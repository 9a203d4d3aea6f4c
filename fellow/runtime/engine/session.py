"""One request's life inside a stage: its prompt, cache, sampling, output so far and timing."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from events.requests import Sampling
from fellow.runtime.engine.drafting import DraftGuard, PromptLookup
from fellow.runtime.model.kv_cache import KVCache


@dataclass(eq=False)
class Session:
    """What the serving loop hands the engine; the engine fills in the rest as the session runs.

    ``stop_ids`` are the end-of-turn ids (tokenizer and generation config). A stop id ends the
    session with finish_reason "stop" and is not part of ``output_ids``; stop strings are the
    caller's to spot, and it ends the session with ``Scheduler.cancel(session_id, "stop")``. A moved
    request's reply so far ends its prompt and is its ``earlier_ids`` too: penalties count it as output.
    """

    session_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: frozenset[int] = frozenset()
    earlier_ids: list[int] = field(default_factory=list)  # a moved reply's ids so far: the end of the prompt

    output_ids: list[int] = field(default_factory=list, init=False)
    finish_reason: str | None = field(default=None, init=False)
    cache: KVCache | None = field(default=None, init=False, repr=False)
    generator: torch.Generator | None = field(default=None, init=False, repr=False)
    prefilled: int = field(default=0, init=False)
    cached_tokens: int = field(default=0, init=False)  # prompt positions copied from the prefix cache
    forked: bool = field(default=False, init=False)  # its prompt's positions copied from a twin's (engine.forks)
    next_input: int | None = field(default=None, init=False)  # the token the next decode position feeds
    added_at: float = field(default=0.0, init=False)
    prefill_started_at: float | None = field(default=None, init=False)
    first_token_at: float | None = field(default=None, init=False)
    decode_s: float = field(default=0.0, init=False)  # wall time of the decode steps it took part in
    decode_steps: int = field(default=0, init=False)
    error: Exception | None = field(default=None, init=False)  # why it failed (finish_reason "error")
    pending_logprob: tuple | None = field(default=None, init=False)  # the sampler's, for the token it drew
    logprobs: list[tuple] = field(default_factory=list, init=False)  # one per output id, when asked for
    # the prompt's (Sampling.prompt_logprobs): None for the first position, then (id, logprob, best, rank)
    prompt_logprobs: list[tuple | None] = field(default_factory=list, init=False)
    constraint: object | None = field(default=None, init=False, repr=False)  # processors.Constraint, if any
    # speculative decoding (fellow.runtime.engine.drafting): tokens drafted per pass (0: none) and
    # what its verify passes did
    spec_k: int = field(default=0, init=False)
    lookup: PromptLookup | None = field(default=None, init=False, repr=False)
    guard: DraftGuard = field(default_factory=DraftGuard, init=False, repr=False)
    spec_passes: int = field(default=0, init=False)  # passes that carried drafts
    spec_tokens: int = field(default=0, init=False)  # tokens those passes gained
    spec_drafted: int = field(default=0, init=False)
    spec_accepted: int = field(default=0, init=False)  # drafts that stood
    model_drafting: bool = field(default=False, init=False)  # this pass's drafts are the draft model's
    spec_model_drafted: int = field(default=0, init=False)  # of spec_drafted, the draft model's
    spec_model_accepted: int = field(default=0, init=False)  # of spec_accepted, the draft model's

    def __post_init__(self) -> None:
        self.prompt_ids = _ids(self.prompt_ids)
        if not self.prompt_ids:
            raise ValueError("a session needs at least one prompt token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        self.stop_ids = frozenset(self.stop_ids)
        self.sampling.check()

    @property
    def reserved_tokens(self) -> int:
        """The most its cache grows to, reserved from admission to its end."""
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt_ids)

    def accept(self, token: int, now: float) -> bool:
        """Take one sampled token; True when it ends the session (a stop id, or max_new_tokens reached)."""
        if self.first_token_at is None:
            self.first_token_at = now
        logprob, self.pending_logprob = self.pending_logprob, None
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return True
        self.output_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        self.next_input = token
        if len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
            return True
        return False

    def record_pass(self, drafted: int, gained: int) -> None:
        """A verify pass that carried ``drafted`` tokens gained ``gained`` (the drafts that stood plus one of
        the model's own): its guard sizes the next drafts by it, and its counters go into timing."""
        accepted = min(gained - 1, drafted)
        self.guard.record(drafted, accepted)
        self.spec_passes += 1
        self.spec_tokens += gained
        self.spec_drafted += drafted
        self.spec_accepted += accepted
        if self.model_drafting:
            self.spec_model_drafted += drafted
            self.spec_model_accepted += accepted

    def timing(self, now: float | None = None) -> dict:
        """The numbers a done frame carries: the whole prompt's wall time, time to first token, decode pace."""
        now = time.perf_counter() if now is None else now
        timing: dict = {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.output_ids),
                        "cached_tokens": self.cached_tokens}
        if self.forked:
            timing["forked"] = True
        if self.first_token_at is not None and self.prefill_started_at is not None:
            timing["prefill_ms"] = round((self.first_token_at - self.prefill_started_at) * 1e3, 3)
            timing["ttft_ms"] = round((self.first_token_at - self.added_at) * 1e3, 3)
            timing["queue_ms"] = round(max(0.0, self.prefill_started_at - self.added_at) * 1e3, 3)
            elapsed = now - self.first_token_at
            if len(self.output_ids) > 1 and elapsed > 0:
                timing["tokens_per_s"] = round((len(self.output_ids) - 1) / elapsed, 3)
        if self.decode_steps:
            timing["decode_ms"] = round(self.decode_s * 1e3 / self.decode_steps, 3)
        if self.spec_k:
            timing.update(spec_k=self.spec_k, spec_passes=self.spec_passes, spec_tokens=self.spec_tokens,
                          spec_drafted=self.spec_drafted, spec_accepted=self.spec_accepted,
                          decode_passes=self.decode_steps)  # decode_ms is per pass, and a pass may gain several
            if self.spec_model_drafted:
                timing.update(spec_model_drafted=self.spec_model_drafted,
                              spec_model_accepted=self.spec_model_accepted)
        return timing


def _ids(ids: Iterable[int] | torch.Tensor) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
