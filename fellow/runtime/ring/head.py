"""Stage 0 of a ring: admits sessions by tokens, sends prompt pieces and decode groups, takes tokens back."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Callable

import torch

from events.ring import DECODE, LAST_PIECE, NO_TOKEN, PIECE, PREFIX_MISSING, VERIFY, End, Hidden, RingSampling, Token
from fellow.runtime.engine.draft_model import LOOKUP_FIRST_RUN, DraftModel
from fellow.runtime.engine.drafting import caught_up, check_speculative, draft_limit, next_drafts
from fellow.runtime.engine.prefix_cache import PrefixCache
from fellow.runtime.engine.scheduler import Scheduler, StepResult
from fellow.runtime.ring.codec import WireCodec
from fellow.runtime.ring.inbox import Inbox
from fellow.runtime.ring.session import RingFailure, RingSession
from fellow.runtime.engine.session import Session
from fellow.runtime.model.recurrent import recurrent_reason, without_rollback
from fellow.runtime.model.stage import StageModel

WAIT_S = 0.02  # longest wait for a token before the serving loop looks at new jobs again
REPLY_TIMEOUT_S = 120.0  # a frame unanswered this long means the ring lost it
WAKE = ("wake",)
# Stage 0 drafts only while at most this many sessions a stage are in the ring: in a fuller ring every
# stage has work queued, and a drafted position would cost another session its turn.
SPEC_MAX_ACTIVE_PER_STAGE = 1

log = logging.getLogger(__name__)


class RingHead(Scheduler):
    """The engine of a ring's stage 0, on the Scheduler like the one-stage Engine.

    Each ``step`` takes the tokens that came back and computes one unit: a decode group or a prompt
    piece, sent at once so the next stage starts while this one computes the next unit. Decode
    groups hold ceil(in flight / groups) sessions (at most max_batch), so while a later stage runs
    one group stage 0 runs another. ``groups`` is the number of stages unless stage 0 sized it from the
    ring's measured steps and links (fellow.runtime.ring.sizing): over slow links, more groups than
    stages keep the slowest stage busy while the others are on the wire. A prompt goes in pieces of at most prefill_chunk positions, up
    to one piece per stage of a session in the ring at once (prefill_ahead).

    With ``prefix_cache`` on, every stage keeps its own finished sessions' positions, and this one
    decides the reuse: a new session takes the longest prefix of its prompt from stage 0's cache, and
    its first frame names those ids, so each later stage copies the same positions from its own. That
    first piece goes alone; a later stage that no longer holds the prefix answers PREFIX_MISSING,
    and the session starts over from position 0 with no reuse (never a wrong reply).

    With ``speculative`` k > 0 a ready session drafts up to k tokens by prompt lookup and goes round
    as a VERIFY frame of its last token and the drafts, computed here as one piece. The last stage
    verifies (exactly, as the one-stage engine does) and answers every token the pass gained; each
    stage crops its cache to the positions that stood (the later ones when the session's next frame
    comes, at the position it names). Sessions without drafts go in the decode groups as before.

    With a ``draft`` model too (fellow.runtime.engine.draft_model, the one-stage engine's), prompt
    lookup still drafts first where it has a full run of LOOKUP_FIRST_RUN or more; the group's other
    drafting sessions ask the draft model, in one batch, beside this stage. Its caches are this
    stage's alone: the later stages only ever see the VERIFY frames.

    A model with recurrent layers on any stage (fellow.runtime.model.recurrent) cannot roll a session
    back nor start one from cached positions: speculative decoding, a draft model and prefix reuse are
    off for the whole ring, and stage 0's ``kernels["recurrent"]`` says so and why.
    """

    def __init__(self, stage: StageModel, codec: WireCodec, send: Callable[[object], None], inbox: Inbox, *,
                 num_stages: int, kv_tokens: int, max_batch: int = 0, prefill_chunk: int = 256,
                 max_payload: int = 1 << 20, prefix_cache: bool = True,
                 route: Callable[[], str] | None = None, speculative: int = 0,
                 draft: DraftModel | None = None) -> None:
        if not stage.is_first or stage.is_last:
            raise ValueError("a ring's head holds the embeddings and not the head")
        if recurrent_reason(stage.config) is not None:  # on any stage: stage 0 decides for the ring
            speculative, draft, prefix_cache = without_rollback(stage, speculative, draft, prefix_cache, model=True)
        if draft is not None:
            if not speculative:
                raise ValueError("a draft model drafts only with speculative k > 0")
            kv_tokens = draft.budget_tokens(kv_tokens)  # each budget token holds a position of both models here
        super().__init__(kv_tokens, max_batch=max_batch, prefill_chunk=prefill_chunk)
        self.draft = draft
        self.stage, self.codec, self.send, self.inbox = stage, codec, send, inbox
        self.num_stages = num_stages
        self.groups = num_stages  # decode groups in the ring at once (fellow.runtime.ring.sizing)
        self.max_piece = max(1, (max_payload - 1024) // codec.bytes_per_position)
        self.ready: deque[RingSession] = deque()  # tokens back, in the order they came
        self.broken: RingFailure | None = None
        self._step_no = 0
        self._prefill_turn = False
        self.prefix = PrefixCache() if prefix_cache else None
        self.prefix_fallbacks = 0  # sessions a later stage could not give their reused prefix
        self.route = route or (lambda: "r")  # how this stage's frames leave now: "d" direct, "r" relay
        self.paused: str | None = None  # why the ring is paused (a stage is being re-placed)
        self.speculative = check_speculative(speculative)  # tokens a session drafts per pass (0: none)
        self.spec_max_active_per_stage = SPEC_MAX_ACTIVE_PER_STAGE
        self.replays = 0

    def add(self, session: Session, reserved: bool = False) -> None:
        if self.broken is not None:
            raise self.broken
        super().add(RingSession.adopt(session), reserved)

    def fail_all(self, message: str, code: str = "ring_failed") -> None:
        """From any thread: the ring is gone; every session fails now, and new ones are refused."""
        self.inbox.put(("fail", message, code))

    def pause(self, why: str) -> None:
        """From any thread: a later stage is lost and being re-placed; nothing goes into the ring."""
        self.inbox.put(("pause", why))

    def resume(self) -> None:
        """From any thread: the ring is whole again; every session that had frames in it replays."""
        self.inbox.put(("resume",))

    def step(self) -> StepResult:
        result = StepResult()
        self._apply_cancels(result)
        self._admit(result)
        for item in self.inbox.take(0 if self._has_work() else WAIT_S):
            self._take(item, result)
        self._admit(result)
        if self.paused is None:
            self._expire(result)
            self._compute_one()
        return result

    # --- tokens back -------------------------------------------------------------------------

    def _take(self, item, result: StepResult) -> None:
        if isinstance(item, Token):
            session = self.sessions.get(item.session)
            if session is None or self.paused is not None or item.attempt != session.attempt:
                return  # ended already; or it replays on resume; or an answer to a try that was given up
            if item.error and item.code == PREFIX_MISSING and session.confirming:
                self._start_over(session, item.error)
                return
            if item.error:
                self._fail(session, RingFailure(f"a later stage failed on this request: {item.error}",
                                                item.code or "stage_failed"), result)
                return
            session.in_ring -= 1
            session.confirming = False
            if item.tokens:  # a verify pass's answer
                self._take_verified(session, item, result)
                return
            if item.token == NO_TOKEN:  # a piece went through; only the last one is answered
                return
            now = time.perf_counter()
            session.routes = item.routes or session.routes
            session.answered(item.compute_ms, now)
            session.pending_logprob = item.logprob
            self._accept(session, item.token, now, result)
        elif isinstance(item, tuple) and item[0] == "pause":
            self._pause(item[1])
        elif isinstance(item, tuple) and item[0] == "resume":
            self._resume()
        elif isinstance(item, tuple) and item[0] == "fail":
            self.broken = RingFailure(item[1], item[2])
            for session in list(self.sessions.values()):
                self._fail(session, self.broken, result)
            while self.waiting:
                self._fail(self.waiting.popleft(), self.broken, result)

    def _take_verified(self, session: RingSession, item: Token, result: StepResult) -> None:
        """Every token a VERIFY pass gained: the drafts that stood and one of the model's own. This
        stage's cache keeps the last token and the drafts that stood."""
        now = time.perf_counter()
        session.routes = item.routes or session.routes
        session.answered(item.compute_ms, now)
        drafted, gained = session.verify_drafted, list(item.tokens)
        session.cache.crop_to(session.verify_pos + len(gained))
        accepted = min(len(gained) - 1, drafted)
        session.guard.record(drafted, accepted)
        session.spec_passes += 1
        session.spec_tokens += len(gained)
        session.spec_drafted += drafted
        session.spec_accepted += accepted
        if session.model_drafting:
            session.spec_model_drafted += drafted
            session.spec_model_accepted += accepted
        for i, token in enumerate(gained):
            session.pending_logprob = item.logprobs[i] if i < len(item.logprobs) else None
            if Scheduler._accept(self, session, token, now, result):
                return
        session.ready = True
        self.ready.append(session)

    def _accept(self, session: RingSession, token: int, now: float, result: StepResult) -> bool:
        ended = super()._accept(session, token, now, result)
        if not ended:  # still going: ready for its next position
            session.ready = True
            self.ready.append(session)
        return ended

    def _pause(self, why: str) -> None:
        self.paused = why
        self.ready.clear()
        for s in self.sessions.values():
            s.ready, s.in_ring, s.confirming, s.decode_sent_at = False, 0, False, None
            s.must_replay = s.must_replay or s.prefilled > s.first_pos or bool(s.output_ids)
        log.warning("ring paused (%s): %d session(s) replay when it is whole again", why,
                    sum(s.must_replay for s in self.sessions.values()))

    def _resume(self) -> None:
        """Every session that had frames in the ring prefills its prompt and its reply so far again,
        from position 0 on every stage; the last piece's token is its next one."""
        self.paused = None
        for s in self.sessions.values():
            if s.must_replay:
                s.must_replay = False
                s.cache.release()
                s.cache = self.stage.new_cache()
                s.history = s.prompt_ids + s.output_ids
                s.prefilled = s.first_pos = 0
                s.attempt += 1
                s.replays += 1
                self.replays += 1
        log.info("ring resumed: %d session(s) replay", sum(s.history is not None for s in self.sessions.values()))

    def _expire(self, result: StepResult) -> None:
        now = time.perf_counter()
        for session in list(self.sessions.values()):
            if session.in_ring and now - session.last_sent_at > REPLY_TIMEOUT_S:
                self._fail(session, RingFailure(f"no answer from the ring for {REPLY_TIMEOUT_S:.0f}s",
                                                "ring_timeout"), result)

    # --- admission and ends ------------------------------------------------------------------

    def _start(self, session: RingSession) -> None:
        self._open(session)
        session.first_pos = session.cached_tokens

    def _start_over(self, session: RingSession, why: str) -> None:
        """A later stage lacks the prefix this session reused: prefill its whole prompt instead. Its
        first piece was the only frame in the ring, and the new first frame resets every stage."""
        log.info("session %s starts over without its cached prefix: %s", session.session_id, why)
        self.prefix_fallbacks += 1
        session.in_ring = 0
        session.confirming = False
        session.cache.release()
        session.cache = self.stage.new_cache()
        session.prefilled = session.cached_tokens = session.first_pos = 0
        session.attempt += 1

    def _fail(self, session: RingSession, error: RingFailure, result: StepResult) -> None:
        session.error = error
        self._finish(session, "error", result)

    def _finish(self, session: RingSession, reason: str | None, result: StepResult) -> None:
        if session.ready:
            self.ready.remove(session)
            session.ready = False
        keep = (self.prefix is not None and session.cache is not None and session.error is None
                and reason != "error")
        if keep:
            self.prefix.insert(session.prompt_ids + session.output_ids, session.cache)
        if session.prefilled > session.first_pos:  # the later stages hold a cache for it
            length = session.cache.length if session.cache is not None else -1
            self.send(End(session=session.session_id, keep=keep, length=length))
        if self.draft is not None:
            self.draft.release(session.session_id)
        super()._finish(session, reason, result)
        if self.prefix is not None:
            self.prefix.fit(self.budget.reserved, self.prefix_room)

    def stats(self) -> dict:
        stats = super().stats()
        if self.prefix is not None:
            stats.update(self.prefix.stats(), prefix_fallbacks=self.prefix_fallbacks)
        if self.draft is not None:
            stats["draft_positions"] = self.draft.positions
        return stats

    # --- compute -----------------------------------------------------------------------------

    def _has_work(self) -> bool:
        if self.paused is not None:
            return False
        return bool(self.ready) or any(self._can_piece(s) for s in self.sessions.values())

    def _can_piece(self, session: RingSession) -> bool:
        ahead = 1 if session.confirming else self.num_stages  # a reused prefix's first piece goes alone
        return session.prefilling and session.in_ring < ahead  # prefill_ahead

    def _compute_one(self) -> None:
        units = [self._decode_group, self._prefill_piece]
        if self._prefill_turn:
            units.reverse()
        for unit in units:
            if unit():
                self._prefill_turn = unit == self._decode_group  # the other kind goes first next time
                return

    def _group_size(self) -> int:
        size = math.ceil(len(self.sessions) / self.groups)
        return max(1, min(size, self.max_batch) if self.max_batch else size)

    def _decode_group(self) -> bool:
        if not self.ready:
            return False
        size = self._group_size()
        group = [self.ready.popleft() for _ in range(min(size, len(self.ready)))]
        if self.speculative and len(self.sessions) <= self.num_stages * self.spec_max_active_per_stage:
            plain = []
            drafted = self._group_drafts(group)
            for session in group:
                drafts = drafted.get(session.session_id)
                if drafts:
                    self._verify_pass(session, drafts)
                else:
                    plain.append(session)
            if not plain:
                return True
            group = plain
        started = time.perf_counter()
        positions = [s.cache.length for s in group]
        ids = torch.tensor([s.next_input for s in group], device=self.stage.input_device)
        rows = self.codec.encode(self.stage.decode([s.cache for s in group], ids))  # [B, 1, H] -> bytes
        now = time.perf_counter()
        self._step_no += 1
        self.last_batches = [len(group)]
        for session, pos, (data, scale) in zip(group, positions, rows):
            session.ready = False
            session.stage0_s += now - started
            session.stage0_steps += 1
            self.send(Hidden(session=session.session_id, pos=pos, positions=1, data=data, scale=scale,
                             kind=DECODE, batch=len(group), step=self._step_no, routes=self.route(),
                             attempt=session.attempt,
                             ids=[session.next_input] if self.prefix is not None else []))
            session.sent(len(data) + len(scale), 1, now)
            session.decode_sent_at = now
        return True

    def _group_drafts(self, group: list[RingSession]) -> dict[str, list[int]]:
        """Each session's drafts for its next pass: prompt lookup's, else (with a draft model) the draft
        model's, asked for every such session of the group at once."""
        if self.draft is None:
            return {s.session_id: next_drafts(s) for s in group}
        drafts, asks = {}, []
        for session in group:
            limit = draft_limit(session)
            if limit <= 0:
                continue
            lookup = caught_up(session)
            found, run = lookup.draft_run(limit)
            session.model_drafting = not (run >= LOOKUP_FIRST_RUN and len(found) == limit)
            if session.model_drafting:
                asks.append((session.session_id, lookup.ids, limit, session.stop_ids))
            else:
                drafts[session.session_id] = found
        if asks:
            drafts.update(self.draft.propose(asks))
        return drafts

    def _verify_pass(self, session: RingSession, drafts: list[int]) -> None:
        """The session's last token and its drafts as one piece here, sent on as a VERIFY frame."""
        started = time.perf_counter()
        pos = session.cache.length
        inputs = [session.next_input, *drafts]
        piece = torch.tensor(inputs, device=self.stage.input_device)
        (data, scale), = self.codec.encode(self.stage.forward_piece(session.cache, piece))  # [1, q, H]
        now = time.perf_counter()
        self._step_no += 1
        session.ready = False
        session.verify_pos, session.verify_drafted = pos, len(drafts)
        session.stage0_s += now - started
        session.stage0_steps += 1
        self.send(Hidden(session=session.session_id, pos=pos, positions=len(inputs), data=data, scale=scale,
                         kind=VERIFY, step=self._step_no, routes=self.route(), attempt=session.attempt,
                         draft=drafts, ids=inputs if self.prefix is not None else []))
        session.sent(len(data) + len(scale), len(inputs), now)
        session.decode_sent_at = now

    def _prefill_piece(self) -> bool:
        session = next((s for s in self.sessions.values() if self._can_piece(s)), None)
        if session is None:
            return False
        start = session.prefilled
        feed = session.feed
        left = len(feed) - start
        size = min(left, self.prefill_chunk or left, self.max_piece)
        if session.prefill_started_at is None:
            session.prefill_started_at = time.perf_counter()
        piece = torch.tensor(feed[start : start + size], device=self.stage.input_device)
        (data, scale), = self.codec.encode(self.stage.forward_piece(session.cache, piece))  # [1, q, H]
        session.prefilled += size
        first = start == session.first_pos
        reuse = feed[:start] if first else []
        session.confirming = bool(reuse)
        self.send(Hidden(session=session.session_id, pos=start, positions=size, data=data, scale=scale,
                         kind=PIECE if session.prefilling else LAST_PIECE,
                         sampling=ring_sampling(session) if first else None,
                         ids=feed[start : start + size] if self.prefix is not None else [],
                         reuse=reuse, reserve=session.reserved_tokens if first else 0, routes=self.route(),
                         attempt=session.attempt))
        session.sent(len(data) + len(scale), size, time.perf_counter())
        return True


def ring_sampling(session: Session) -> RingSampling:
    """A session's sampling for the last stage, with the ids its processors need."""
    s = session.sampling
    return RingSampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
                        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                        repetition_penalty=s.repetition_penalty, logit_bias=list(s.logit_bias),
                        min_tokens=s.min_tokens, logprobs=s.logprobs,
                        stop_ids=sorted(session.stop_ids) if s.min_tokens else [],
                        prompt_ids=session.prompt_ids if s.repetition_penalty != 1.0 else [],
                        output_ids=list(session.output_ids), grammar=s.grammar)
