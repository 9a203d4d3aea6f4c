"""Stage 0 of a ring: sends prompt pieces and decode groups round the ring and takes tokens back."""

from __future__ import annotations

import logging
import time
from typing import Callable

from events.ring import NO_TOKEN, PREFIX_MISSING, End, Token
from fellow.runtime.engine.draft_model import DraftModel
from fellow.runtime.engine.scheduler import Scheduler, StepResult
from fellow.runtime.engine.session import Session
from fellow.runtime.model.recurrent import recurrent_reason
from fellow.runtime.model.stage import StageModel
from fellow.runtime.ring.codec import WireCodec
from fellow.runtime.ring.drafts import RingDrafts
from fellow.runtime.ring.inbox import Inbox
from fellow.runtime.ring.session import RingFailure, RingSession
from fellow.runtime.ring.units import RingUnits

WAIT_S = 0.02  # longest wait for a token before the serving loop looks at new jobs again
REPLY_TIMEOUT_S = 120.0  # a frame unanswered this long means the ring lost it
WAKE = ("wake",)

log = logging.getLogger(__name__)


def ring_engine(stage: StageModel, codec: WireCodec, send: Callable[[object], None], inbox: Inbox, *,
                num_stages: int, kv_tokens: int, max_batch: int = 0, prefill_chunk: int = 256,
                max_payload: int = 1 << 20, prefix_cache: bool = True, route: Callable[[], str] | None = None,
                speculative: int = 0, draft: DraftModel | None = None) -> Scheduler:
    """A scheduler over a RingRunner: what serves a ring's stage 0."""
    runner = RingRunner(stage, codec, send, inbox, num_stages=num_stages, max_payload=max_payload, route=route)
    return Scheduler(runner, kv_tokens=kv_tokens, max_batch=max_batch, prefill_chunk=prefill_chunk,
                     prefix_cache=prefix_cache, speculative=speculative, draft=draft)


class RingRunner:
    """Computes the steps of a ring's stage 0 for its scheduler: takes the tokens that came back, then
    has its RingUnits compute and send one unit (a decode group or a prompt piece).

    Prefix reuse: a new session takes the longest prefix of its prompt from stage 0's cache, and its
    first frame names those ids, so each later stage copies the same positions from its own. A later
    stage that no longer holds the prefix answers PREFIX_MISSING, and the session starts over from
    position 0 with no reuse (never a wrong reply). A VERIFY frame's answer carries every token the
    pass gained; this stage crops its cache to what stood. A ring whose later stage is being re-placed
    pauses, and its sessions replay from position 0 when it resumes. Recurrent layers on any stage turn
    reuse and drafts off for the whole ring (the scheduler does, by ``rolls_back``).
    """

    def __init__(self, stage: StageModel, codec: WireCodec, send: Callable[[object], None], inbox: Inbox, *,
                 num_stages: int, max_payload: int = 1 << 20, route: Callable[[], str] | None = None) -> None:
        if not stage.is_first or stage.is_last:
            raise ValueError("a ring's head holds the embeddings and not the head")
        self.stage, self.send, self.inbox = stage, send, inbox
        self.rolls_back = recurrent_reason(stage.config) is None  # on any stage: stage 0 decides for the ring
        self.units = RingUnits(stage, codec, lambda frame: self.send(frame), num_stages=num_stages,
                               max_payload=max_payload,
                               route=route or (lambda: "r"))  # how frames leave now: "d" direct, "r" relay
        self.ready = self.units.ready
        self.broken: RingFailure | None = None
        self.prefix_fallbacks = 0  # sessions a later stage could not give their reused prefix
        self.paused: str | None = None  # why the ring is paused (a stage is being re-placed)
        self.replays = 0

    # --- the scheduler's hooks -----------------------------------------------------------------

    def attach(self, scheduler: Scheduler) -> None:
        self.sched = scheduler

    def adopt(self, session: Session) -> RingSession:
        if self.broken is not None:
            raise self.broken
        return RingSession.adopt(session)

    def start(self, session: RingSession) -> None:
        session.first_pos = session.cached_tokens

    def ended(self, session: RingSession, kept: bool) -> None:
        if session.ready:
            self.ready.remove(session)
            session.ready = False
        if session.prefilled > session.first_pos:  # the later stages hold a cache for it
            length = session.cache.length if session.cache is not None else -1
            self.send(End(session=session.session_id, keep=kept, length=length))

    def stats(self) -> dict:
        return {"prefix_fallbacks": self.prefix_fallbacks} if self.sched.prefix is not None else {}

    def drafts_from(self, drafter: str) -> None:
        """The last stage drafts with the draft model ``drafter`` (said on the probe; "": none): a drafting
        ring's passes take its guesses (fellow.runtime.ring.drafts)."""
        if drafter and self.sched.speculative:
            if not isinstance(self.sched.draft, RingDrafts) or self.sched.draft.name != drafter:
                self.sched.draft = RingDrafts(drafter)
        elif isinstance(self.sched.draft, RingDrafts):
            self.sched.draft = None

    def run(self, result: StepResult) -> None:
        busy = self.paused is None and self.units.has_work(self.sched)
        for item in self.inbox.take(0 if busy else WAIT_S):
            self._take(item, result)
        self.sched.admit(result)  # what ended frees tokens for the line
        if self.paused is None:
            self._expire(result)
            self.units.compute_one(self.sched)

    # --- from any thread -----------------------------------------------------------------------

    def fail_all(self, message: str, code: str = "ring_failed") -> None:
        """The ring is gone; every session fails now, and new ones are refused."""
        self.inbox.put(("fail", message, code))

    def pause(self, why: str) -> None:
        """A later stage is lost and being re-placed; nothing goes into the ring."""
        self.inbox.put(("pause", why))

    def resume(self) -> None:
        """The ring is whole again; every session that had frames in it replays."""
        self.inbox.put(("resume",))

    # --- tokens back ---------------------------------------------------------------------------

    def _take(self, item, result: StepResult) -> None:
        if isinstance(item, Token):
            session = self.sched.sessions.get(item.session)
            if session is None or self.paused is not None or item.attempt != session.attempt:
                return  # ended already; or it replays on resume; or an answer to a try that was given up
            if item.error and item.code == PREFIX_MISSING and session.confirming:
                self._start_over(session, item.error)
            elif item.error:
                self.sched.fail(session, RingFailure(f"a later stage failed on this request: {item.error}",
                                                     item.code or "stage_failed"), result)
            else:
                session.in_ring -= 1
                session.confirming = False
                if item.prompt:  # a scored prompt's piece (a replay's overwrites its own positions)
                    pos = item.prompt_pos
                    session.prompt_logprobs[pos : pos + len(item.prompt)] = [tuple(e) if e is not None else None
                                                                             for e in item.prompt]
                if item.tokens or item.token != NO_TOKEN:  # a verify pass's answer, or a position's token
                    self._answered(session, item, result)
        elif isinstance(item, tuple) and item[0] == "pause":
            self._pause(item[1])
        elif isinstance(item, tuple) and item[0] == "resume":
            self._resume()
        elif isinstance(item, tuple) and item[0] == "fail":
            self.broken = RingFailure(item[1], item[2])
            self.sched.fail_all(self.broken, result)

    def _answered(self, session: RingSession, item: Token, result: StepResult) -> None:
        """The tokens a frame gained: one position's, or a VERIFY pass's (the drafts that stood and one of
        the model's own; this stage's cache keeps the last token and the drafts that stood)."""
        now = time.perf_counter()
        session.routes = item.routes or session.routes
        session.answered(item.compute_ms, now)
        gained = list(item.tokens) or [item.token]
        if isinstance(self.sched.draft, RingDrafts):  # the last stage's draft model's guesses, for the next pass
            self.sched.draft.took(session.session_id, item.draft)
        logprobs = list(item.logprobs) if item.tokens else [item.logprob]
        if item.tokens:
            session.cache.crop_to(session.verify_pos + len(gained))
            session.record_pass(session.verify_drafted, len(gained))
        for i, token in enumerate(gained):
            session.pending_logprob = logprobs[i] if i < len(logprobs) else None
            if self.sched.accept(session, token, now, result):
                return
        session.ready = True  # still going: ready for its next position
        self.ready.append(session)

    def _pause(self, why: str) -> None:
        self.paused = why
        self.ready.clear()
        for s in self.sched.sessions.values():
            s.ready, s.in_ring, s.confirming, s.decode_sent_at = False, 0, False, None
            s.must_replay = s.must_replay or s.prefilled > s.first_pos or bool(s.output_ids)
        log.warning("ring paused (%s): %d session(s) replay when it is whole again", why,
                    sum(s.must_replay for s in self.sched.sessions.values()))

    def _resume(self) -> None:
        """Every session that had frames in the ring prefills its prompt and its reply so far again,
        from position 0 on every stage; the last piece's token is its next one."""
        self.paused = None
        for s in self.sched.sessions.values():
            if s.must_replay:
                s.must_replay = False
                s.history = s.prompt_ids + s.output_ids
                self._restart(s)
                s.replays += 1
                self.replays += 1
        log.info("ring resumed: %d session(s) replay",
                 sum(s.history is not None for s in self.sched.sessions.values()))

    def _start_over(self, session: RingSession, why: str) -> None:
        """A later stage lacks the prefix this session reused: prefill its whole prompt instead. Its
        first piece was the only frame in the ring, and the new first frame resets every stage."""
        log.info("session %s starts over without its cached prefix: %s", session.session_id, why)
        self.prefix_fallbacks += 1
        session.in_ring = 0
        session.confirming = False
        session.cached_tokens = 0
        self._restart(session)

    def _restart(self, session: RingSession) -> None:
        """A fresh cache from position 0, and a new try whose frames the old try's answers cannot touch."""
        session.cache.release()
        session.cache = self.stage.new_cache()
        session.prefilled = session.first_pos = 0
        session.attempt += 1

    def _expire(self, result: StepResult) -> None:
        now = time.perf_counter()
        for session in list(self.sched.sessions.values()):
            if session.in_ring and now - session.last_sent_at > REPLY_TIMEOUT_S:
                self.sched.fail(session, RingFailure(f"no answer from the ring for {REPLY_TIMEOUT_S:.0f}s",
                                                     "ring_timeout"), result)
