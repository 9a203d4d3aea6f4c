"""Admission, the waiting line, cancels, drafts and ends over one token ledger; a runner computes the steps."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from fellow.runtime.engine.budget import AdmissionFailed, TokenBudget
from fellow.runtime.engine.draft_model import LOOKUP_FIRST_RUN, DraftModel
from fellow.runtime.engine.drafting import DraftGuard, PromptLookup, caught_up, check_speculative, draft_limit
from fellow.runtime.engine.prefix_cache import PrefixCache
from fellow.runtime.engine.session import Session
from fellow.runtime.model.recurrent import without_rollback

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step produced: new tokens per session id, and the sessions that ended (finish_reason set)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: list[Session] = field(default_factory=list)

    def emit(self, session: Session, token: int) -> None:
        self.tokens.setdefault(session.session_id, []).append(token)


class Runner(Protocol):
    """What computes a scheduler's steps: fellow.runtime.engine.engine.LocalRunner on a whole-model stage,
    fellow.runtime.ring.head.RingRunner on a ring's stage 0. It runs steps and nothing else: sessions come,
    go and hold tokens through the scheduler it is attached to."""

    stage: object  # the StageModel whose caches the sessions hold
    rolls_back: bool  # False where recurrent layers cannot crop a cache nor start from cached positions

    def attach(self, scheduler: "Scheduler") -> None: ...
    def adopt(self, session: Session) -> Session: ...  # the session as this runner keeps it; raising refuses it
    def start(self, session: Session) -> None: ...  # an admitted session, its cache opened; raising fails it
    def run(self, result: StepResult) -> None: ...  # one step's compute over the scheduler's sessions
    def ended(self, session: Session, kept: bool) -> None: ...  # it leaves (kept: positions went to the prefix cache)
    def stats(self) -> dict: ...


class Scheduler:
    """Which sessions run, and the KV tokens they hold (cf. nano-vllm's Scheduler, vLLM v1's SchedulerInterface).

    Contract:
    - ``offer(session_id, prompt_tokens, max_new_tokens)`` (any thread) reserves a request's tokens now
      if they are free: True; False when busy; ContextTooLong when it can never fit. ``withdraw`` gives an
      offered reservation back before its session is added.
    - ``add(session)`` queues a session (with the reservation its id was offered, or one taken at
      admission). It raises ContextTooLong if the session can never fit and ValueError if its id is in
      already; then its offered reservation went back (unless the id is in already: that one holds it).
    - ``cancel(session_id, reason)`` ends a session at the next step: an admitted one finishes with
      ``reason``, a waiting one leaves the line. An unknown id is ignored.
    - ``step()`` applies the cancels, admits, and has the runner compute; every sampled token goes
      through ``accept``. Admission is first come, first served: the head of the line waits until its
      tokens fit, and nobody passes it.
    - Every session that leaves, however, shows once in a step's ``finished``, its cache and tokens
      given back; one with ``error`` set failed, and failed alone: an error while admitting a session
      ends that session only.
    - ``busy`` is whether a step has anything to do. One thread steps the scheduler; ``offer``,
      ``withdraw`` and ``can_admit`` are safe from others.

    With ``prefix_cache`` on, a session that ends leaves its positions in the PrefixCache, and a new one
    starts from the longest cached prefix of its prompt. The cache's tokens count beside the
    reservations, and are evicted whenever a reservation needs their room (within ``prefix_limit``).
    With ``speculative`` k > 0 sessions draft up to k tokens a pass (``drafts``: prompt lookup, then the
    ``draft`` model where lookup has no full run); the budget's tokens then each hold a position of both
    models. A runner that cannot roll back (recurrent layers) serves with all three off, saying so in its
    stage's kernels (fellow.runtime.model.recurrent).
    """

    def __init__(self, runner: Runner, *, kv_tokens: int, max_batch: int = 0, prefill_chunk: int = 256,
                 prefix_cache: bool = True, speculative: int = 0, draft: DraftModel | None = None) -> None:
        if max_batch < 0 or prefill_chunk < 0:
            raise ValueError("max_batch and prefill_chunk must be >= 0")
        if not runner.rolls_back:
            # the note speaks for the whole model: a ring's stage 0 decides for every stage
            speculative, draft, prefix_cache = without_rollback(runner.stage, speculative, draft, prefix_cache,
                                                                model=True)
        if draft is not None:
            if not speculative:
                raise ValueError("a draft model drafts only with speculative k > 0")
            kv_tokens = draft.budget_tokens(kv_tokens)  # each budget token holds a position of both models
        self.budget = TokenBudget(kv_tokens)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.speculative = check_speculative(speculative)
        self.draft = draft
        self.prefix = PrefixCache() if prefix_cache else None
        self.prefix_limit = 0  # the most tokens kept sessions and finished ones' prefixes hold (0: kv_tokens)
        self.waiting: deque[Session] = deque()
        self.sessions: dict[str, Session] = {}  # admitted, in admission order
        self._cancels: dict[str, str] = {}
        self.last_batches: list[int] = []  # the decode batch sizes of the latest step, for stats
        self.runner = runner
        runner.attach(self)

    @property
    def kv_tokens(self) -> int:
        return self.budget.kv_tokens

    @property
    def prefix_room(self) -> int:
        """What reservations and the prefix cache share: kv_tokens, or less where ``prefix_limit`` says."""
        return min(self.kv_tokens, self.prefix_limit) if self.prefix_limit else self.kv_tokens

    @property
    def busy(self) -> bool:
        return bool(self.sessions or self.waiting or self._cancels)

    # --- the ledger, from any thread -----------------------------------------------------------

    def offer(self, session_id: str, prompt_tokens: int, max_new_tokens: int) -> bool:
        tokens = self.budget.check(prompt_tokens, max_new_tokens)
        return self.budget.reserve(session_id, tokens)

    def withdraw(self, session_id: str) -> None:
        self.budget.release(session_id)

    def can_admit(self, tokens: int) -> bool:
        """Whether a request reserving ``tokens`` would be admitted now, behind any already waiting."""
        queued = sum(s.reserved_tokens for s in self.waiting if not self.budget.holds(s.session_id))
        return tokens + queued <= self.budget.free

    def resize(self, kv_tokens: int) -> None:
        """Admit by ``kv_tokens`` from now on (a ring holds every session to its smallest stage's KV)."""
        self.budget.resize(kv_tokens)

    # --- the engine thread ---------------------------------------------------------------------

    def add(self, session: Session) -> None:
        sid = session.session_id
        if sid in self.sessions or any(s.session_id == sid for s in self.waiting):
            raise ValueError(f"session {sid!r} is already in the engine")
        try:
            self.budget.check(len(session.prompt_ids), session.max_new_tokens)
            session = self.runner.adopt(session)
        except Exception:
            self.budget.release(sid)
            raise
        session.added_at = time.perf_counter()
        self.waiting.append(session)

    def cancel(self, session_id: str, reason: str = "cancelled") -> None:
        self._cancels[session_id] = reason

    def step(self) -> StepResult:
        result = StepResult()
        self.apply_cancels(result)
        self.admit(result)
        self.runner.run(result)
        return result

    def apply_cancels(self, result: StepResult) -> None:
        for session_id, reason in self._cancels.items():
            session = self.sessions.get(session_id)
            if session is None:
                session = next((s for s in self.waiting if s.session_id == session_id), None)
                if session is None:
                    continue
                self.waiting.remove(session)
            self.finish(session, reason, result)
        self._cancels.clear()

    def admit(self, result: StepResult) -> None:
        while self.waiting:
            session = self.waiting[0]
            if not self.budget.holds(session.session_id):
                if not self.budget.reserve(session.session_id, session.reserved_tokens):
                    return
            self.waiting.popleft()
            try:
                self._open(session)
                self.runner.start(session)
            except Exception as exc:
                log.warning("session %s not admitted: %s: %s", session.session_id, type(exc).__name__, exc)
                session.error = AdmissionFailed(f"the request could not be admitted: {type(exc).__name__}: {exc}")
                session.error.__cause__ = exc
                self.finish(session, "error", result)
                continue
            self.sessions[session.session_id] = session

    def _open(self, session: Session) -> None:
        """What every admitted session runs with: a cache, prompt lookup's drafting state when k > 0, and
        the longest prefix the prefix cache holds."""
        session.cache = self.runner.stage.new_cache()
        if self.speculative:
            session.spec_k = self.speculative
            session.guard = DraftGuard(self.speculative)
            session.lookup = PromptLookup(session.prompt_ids)
        if self.prefix is not None and session.sampling.prompt_logprobs is None:  # scored prompts run whole
            self.prefix.fit(self.budget.reserved, self.prefix_room)  # the reservation is in: blocks make room
            session.prefilled = session.cached_tokens = self.prefix.start(session.cache, session.prompt_ids)

    def accept(self, session: Session, token: int, now: float, result: StepResult) -> bool:
        """Take a sampled token into the session (and the step's result); True when it ended the session."""
        ended = session.accept(token, now)
        if session.finish_reason != "stop":  # an end-of-turn id is not part of the reply
            result.emit(session, token)
        if ended:
            self.finish(session, None, result)
        return ended

    def fail(self, session: Session, error: Exception, result: StepResult) -> None:
        session.error = error
        self.finish(session, "error", result)

    def fail_all(self, error: Exception, result: StepResult) -> None:
        """Every session fails with ``error``, admitted and waiting (a ring that is gone)."""
        for session in list(self.sessions.values()):
            self.fail(session, error, result)
        while self.waiting:
            self.fail(self.waiting.popleft(), error, result)

    def finish(self, session: Session, reason: str | None, result: StepResult) -> None:
        """The session leaves (admitted or waiting): its positions may stay in the prefix cache, and its
        tokens and cache go back."""
        if reason is not None:
            session.finish_reason = reason
        kept = (self.prefix is not None and session.cache is not None and session.error is None
                and reason != "error")
        if kept:
            self.prefix.insert(session.prompt_ids + session.output_ids, session.cache)
        self.runner.ended(session, kept)
        self.sessions.pop(session.session_id, None)
        self.budget.release(session.session_id)
        if session.cache is not None:
            session.cache.release()
            session.cache = None
        if self.draft is not None:
            self.draft.release(session.session_id)
        if self.prefix is not None:
            self.prefix.fit(self.budget.reserved, self.prefix_room)
        result.finished.append(session)

    def drafts(self, sessions: list[Session]) -> dict[str, list[int]]:
        """Each session's drafts for its next pass: prompt lookup's, else (with a draft model, where lookup
        has no full run of LOOKUP_FIRST_RUN or more) the draft model's, asked for all such at once."""
        found_all: dict[str, list[int]] = {}
        asks = []
        for session in sessions:
            limit = draft_limit(session)
            if limit <= 0:
                continue
            lookup = caught_up(session)
            found, run = lookup.draft_run(limit)
            session.model_drafting = self.draft is not None and not (run >= LOOKUP_FIRST_RUN and len(found) == limit)
            if session.model_drafting:
                asks.append((session.session_id, lookup.ids, limit, session.stop_ids))
            else:
                found_all[session.session_id] = found
        if asks:
            found_all.update(self.draft.propose(asks))
        return found_all

    def stats(self) -> dict:
        caches = [s.cache for s in list(self.sessions.values()) if s.cache is not None]
        stats = {"kv_tokens": self.kv_tokens, "reserved_tokens": self.budget.reserved,
                 "cached_tokens": sum(c.length for c in caches), "kv_bytes": sum(c.bytes for c in caches),
                 "in_flight": len(self.sessions), "waiting": len(self.waiting),
                 "decode_batches": list(self.last_batches)}
        if self.prefix is not None:
            stats.update(self.prefix.stats())
        if self.draft is not None:
            stats["draft_positions"] = self.draft.positions
        stats.update(self.runner.stats())
        return stats


class Follower:
    """A later ring stage's share of the ledger: it holds what stage 0 admitted for each session (named in
    the session's first frame) until the session ends, so its kept prefixes make room by the same
    reservations stage 0's scheduler admitted."""

    def __init__(self, kv_tokens: int) -> None:
        self.budget = TokenBudget(max(1, kv_tokens))

    @property
    def reserved(self) -> int:
        return self.budget.reserved

    def hold(self, session_id: str, tokens: int) -> None:
        self.budget.release(session_id)  # a session that starts over holds its new first frame's tokens
        self.budget.reserve(session_id, tokens, over=True)  # stage 0 admitted it: never refused here

    def drop(self, session_id: str) -> None:
        self.budget.release(session_id)
