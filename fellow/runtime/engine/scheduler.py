"""Admission, the waiting line, cancels and ends over one token budget: what every engine of a stage shares."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from fellow.runtime.engine.budget import AdmissionFailed, TokenBudget
from fellow.runtime.engine.drafting import DraftGuard, PromptLookup
from fellow.runtime.engine.session import Session

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step produced: new tokens per session id, and the sessions that ended (finish_reason set)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: list[Session] = field(default_factory=list)

    def emit(self, session: Session, token: int) -> None:
        self.tokens.setdefault(session.session_id, []).append(token)


class Scheduler:
    """Which sessions run, and the KV tokens they hold; the engines built on it compute (cf. vLLM v1's
    SchedulerInterface).

    Contract:
    - ``add(session, reserved=False)`` queues a session. It raises ContextTooLong if the session can
      never fit and ValueError if its id is in already; then nothing changed. ``reserved=True`` says
      the caller (the stage's intake) already took the session's ``reserved_tokens`` from ``budget``:
      once ``add`` returns they are the scheduler's to give back; if it raises, still the caller's.
    - ``cancel(session_id, reason)`` ends a session at the next step: an admitted one finishes with
      ``reason``, a waiting one leaves the line. An unknown id is ignored.
    - ``step()`` (the engine's) applies the cancels, admits (``_admit``), computes, and hands every
      sampled token to ``_accept``. Admission is first come, first served: the head of the line waits
      until its tokens fit, and nobody passes it.
    - Every session that leaves, however, shows once in a step's ``finished``, its cache and tokens
      given back; one with ``error`` set failed, and failed alone: an error while admitting a session
      (``_start``) ends that session only.
    - ``busy`` is whether a step has anything to do. One thread steps the scheduler; only ``budget``
      is safe from other threads.
    """

    def __init__(self, kv_tokens: int, *, max_batch: int = 0, prefill_chunk: int = 256) -> None:
        if max_batch < 0 or prefill_chunk < 0:
            raise ValueError("max_batch and prefill_chunk must be >= 0")
        self.budget = TokenBudget(kv_tokens)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Session] = deque()
        self.sessions: dict[str, Session] = {}  # admitted, in admission order
        self._cancels: dict[str, str] = {}
        self.last_batches: list[int] = []  # the decode batch sizes of the latest step, for stats
        self.prefix_limit = 0  # the most tokens kept sessions and finished ones' prefixes hold (0: kv_tokens)

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

    def can_admit(self, tokens: int) -> bool:
        """Whether a request reserving ``tokens`` would be admitted now, behind any already waiting."""
        queued = sum(s.reserved_tokens for s in self.waiting if not s.holds_tokens)
        return tokens + queued <= self.budget.free

    def add(self, session: Session, reserved: bool = False) -> None:
        self.budget.check(len(session.prompt_ids), session.max_new_tokens)
        if session.session_id in self.sessions or any(s.session_id == session.session_id for s in self.waiting):
            raise ValueError(f"session {session.session_id!r} is already in the engine")
        session.holds_tokens = reserved
        session.added_at = time.perf_counter()
        self.waiting.append(session)

    def cancel(self, session_id: str, reason: str = "cancelled") -> None:
        self._cancels[session_id] = reason

    def stats(self) -> dict:
        caches = [s.cache for s in list(self.sessions.values()) if s.cache is not None]
        return {"kv_tokens": self.kv_tokens, "reserved_tokens": self.budget.reserved,
                "cached_tokens": sum(c.length for c in caches), "kv_bytes": sum(c.bytes for c in caches),
                "in_flight": len(self.sessions), "waiting": len(self.waiting),
                "decode_batches": list(self.last_batches)}

    def _start(self, session: Session) -> None:
        """Give an admitted session what it runs with (its cache, ...); raising fails it alone."""
        raise NotImplementedError

    def _open(self, session: Session) -> None:
        """What every ``_start`` gives a session: a cache from the subclass's ``stage``, prompt lookup's
        drafting state when its ``speculative`` k > 0, and the longest prefix its ``prefix`` cache holds."""
        session.cache = self.stage.new_cache()
        if self.speculative:
            session.spec_k = self.speculative
            session.guard = DraftGuard(self.speculative)
            session.lookup = PromptLookup(session.prompt_ids)
        if self.prefix is not None:
            self.prefix.fit(self.budget.reserved, self.prefix_room)  # the reservation is in: blocks make room
            session.prefilled = session.cached_tokens = self.prefix.start(session.cache, session.prompt_ids)

    def _apply_cancels(self, result: StepResult) -> None:
        for session_id, reason in self._cancels.items():
            session = self.sessions.get(session_id)
            if session is None:
                session = next((s for s in self.waiting if s.session_id == session_id), None)
                if session is None:
                    continue
                self.waiting.remove(session)
            self._finish(session, reason, result)
        self._cancels.clear()

    def _admit(self, result: StepResult) -> None:
        while self.waiting:
            session = self.waiting[0]
            if not session.holds_tokens:
                if not self.budget.try_reserve(session.reserved_tokens):
                    return
                session.holds_tokens = True
            self.waiting.popleft()
            try:
                self._start(session)
            except Exception as exc:
                log.warning("session %s not admitted: %s: %s", session.session_id, type(exc).__name__, exc)
                session.error = AdmissionFailed(f"the request could not be admitted: {type(exc).__name__}: {exc}")
                session.error.__cause__ = exc
                self._finish(session, "error", result)
                continue
            self.sessions[session.session_id] = session

    def _finish(self, session: Session, reason: str | None, result: StepResult) -> None:
        """The session leaves (admitted or waiting): its tokens and cache go back."""
        if reason is not None:
            session.finish_reason = reason
        self.sessions.pop(session.session_id, None)
        if session.holds_tokens:
            session.holds_tokens = False
            self.budget.release(session.reserved_tokens)
        if session.cache is not None:
            session.cache.release()
            session.cache = None
        result.finished.append(session)

    def _accept(self, session: Session, token: int, now: float, result: StepResult) -> bool:
        """Take a sampled token into the session (and the step's result); True when it ended the session."""
        ended = session.accept(token, now)
        if session.finish_reason != "stop":  # an end-of-turn id is not part of the reply
            result.emit(session, token)
        if ended:
            self._finish(session, None, result)
        return ended
