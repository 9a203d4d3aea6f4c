"""What stage 0 of a ring computes and sends: decode groups, prompt pieces and VERIFY frames."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

import torch

from events.ring import DECODE, LAST_PIECE, PIECE, VERIFY, Hidden, RingSampling
from fellow.runtime.engine.padded import fits_padded, padded_layers
from fellow.runtime.engine.scheduler import Scheduler
from fellow.runtime.engine.session import Session
from fellow.runtime.model.stage import StageModel
from fellow.runtime.ring.codec import WireCodec
from fellow.runtime.ring.drafts import RingDrafts
from fellow.runtime.ring.session import RingSession

# Stage 0 drafts only while at most this many sessions a stage are in the ring: in a fuller ring every
# stage has work queued, and a drafted position would cost another session its turn.
SPEC_MAX_ACTIVE_PER_STAGE = 1


class RingUnits:
    """One unit a step: a decode group of the sessions whose tokens are back (``ready``), or a prompt
    piece, taking turns; each is sent on at once, so the next stage starts while this one computes.

    Decode groups hold ceil(in flight / groups) sessions (at most max_batch, and fewer where their padded
    copy would pass the KV budget), so while a later stage runs one group stage 0 runs another; ``groups``
    is the number of stages unless stage 0 sized it from the ring's measured steps and links
    (fellow.runtime.ring.sizing). A prompt goes in pieces of at most
    prefill_chunk positions (and ``max_piece``, what a frame carries), up to one piece per stage of a
    session in the ring at once (prefill_ahead); a first piece that reuses a cached prefix goes alone.
    A ready session with drafts (``Scheduler.drafts``) goes round as a VERIFY frame of its last token
    and the drafts, computed here as one piece, while the ring is nearly empty; then, where the last stage
    drafts with a draft model (fellow.runtime.ring.drafts), every frame asks it for its guesses (draft_k).
    """

    def __init__(self, stage: StageModel, codec: WireCodec, send: Callable[[object], None], *, num_stages: int,
                 max_payload: int, route: Callable[[], str]) -> None:
        self.stage, self.codec, self.send, self.route = stage, codec, send, route
        self.num_stages = num_stages
        self.groups = num_stages  # decode groups in the ring at once (fellow.runtime.ring.sizing)
        self.padded_layers = padded_layers(stage)  # what a group's padded copy counts over (engine.padded)
        self.max_piece = max(1, (max_payload - 1024) // codec.bytes_per_position)
        self.spec_max_active_per_stage = SPEC_MAX_ACTIVE_PER_STAGE
        self.ready: deque[RingSession] = deque()  # tokens back, in the order they came
        self._step_no = 0
        self._prefill_turn = False

    def has_work(self, sched: Scheduler) -> bool:
        return bool(self.ready) or any(self._can_piece(s) for s in sched.sessions.values())

    def _can_piece(self, session: RingSession) -> bool:
        ahead = 1 if session.confirming else self.num_stages  # a reused prefix's first piece goes alone
        return session.prefilling and session.in_ring < ahead  # prefill_ahead

    def compute_one(self, sched: Scheduler) -> None:
        units = [self._decode_group, self._prefill_piece]
        if self._prefill_turn:
            units.reverse()
        for unit in units:
            if unit(sched):
                self._prefill_turn = unit == self._decode_group  # the other kind goes first next time
                return

    def _group_size(self, sched: Scheduler) -> int:
        size = math.ceil(len(sched.sessions) / self.groups)
        return max(1, min(size, sched.max_batch) if sched.max_batch else size)

    def _take_group(self, sched: Scheduler) -> list[RingSession]:
        """The next decode group from ``ready`` in the order the tokens came: ``_group_size`` sessions, fewer
        where the group's padded copy would pass the KV budget (fellow.runtime.engine.padded)."""
        size, room = self._group_size(sched), sched.budget.free + (sched.prefill_chunk or 256)
        group: list[RingSession] = [self.ready.popleft()]
        while self.ready and len(group) < size and fits_padded(
                self.padded_layers, len(group) + 1, max(s.cache.length for s in [*group, self.ready[0]]), room):
            group.append(self.ready.popleft())
        return group

    def _decode_group(self, sched: Scheduler) -> bool:
        if not self.ready:
            return False
        group = self._take_group(sched)
        if self._has_room(sched):
            drafted = sched.drafts(group)
            for session in [s for s in group if drafted.get(s.session_id)]:
                self._send_piece(sched, session, [session.next_input, *drafted[session.session_id]], VERIFY)
            group = [s for s in group if not drafted.get(s.session_id)]
            if not group:
                return True
        started = time.perf_counter()
        positions = [s.cache.length for s in group]
        ids = torch.tensor([s.next_input for s in group], device=self.stage.input_device)
        rows = self.codec.encode(self.stage.decode([s.cache for s in group], ids))  # [B, 1, H] -> bytes
        now = time.perf_counter()
        self._step_no += 1
        sched.last_batches = [len(group)]
        keep_ids = sched.prefix is not None
        draft_k = self._draft_k(sched)
        for session, pos, (data, scale) in zip(group, positions, rows):
            session.ready = False
            session.stage0_s += now - started
            session.stage0_steps += 1
            self.send(Hidden(session=session.session_id, pos=pos, positions=1, data=data, scale=scale,
                             kind=DECODE, batch=len(group), step=self._step_no, routes=self.route(),
                             attempt=session.attempt, ids=[session.next_input] if keep_ids else [],
                             draft_k=draft_k))
            session.sent(len(data) + len(scale), 1, now)
            session.decode_sent_at = now
        return True

    def _prefill_piece(self, sched: Scheduler) -> bool:
        session = next((s for s in sched.sessions.values() if self._can_piece(s)), None)
        if session is None:
            return False
        start, feed = session.prefilled, session.feed
        size = min(len(feed) - start, sched.prefill_chunk or len(feed), self.max_piece)
        if session.prefill_started_at is None:
            session.prefill_started_at = time.perf_counter()
        self._send_piece(sched, session, feed[start : start + size], PIECE)
        return True

    def _send_piece(self, sched: Scheduler, session: RingSession, inputs: list[int], kind: int) -> None:
        """``inputs`` through this stage's blocks as one piece, sent on: a prompt piece (the last one of
        its feed as LAST_PIECE), or a VERIFY frame of the session's last token and its drafts."""
        started = time.perf_counter()
        pos = session.cache.length if kind == VERIFY else session.prefilled
        piece = torch.tensor(inputs, device=self.stage.input_device)
        (data, scale), = self.codec.encode(self.stage.forward_piece(session.cache, piece))  # [1, q, H]
        now = time.perf_counter()
        keep_ids = inputs if sched.prefix is not None else []
        if kind == VERIFY:
            self._step_no += 1
            session.ready = False
            session.verify_pos, session.verify_drafted = pos, len(inputs) - 1
            session.stage0_s += now - started
            session.stage0_steps += 1
            session.decode_sent_at = now
            frame = Hidden(session=session.session_id, pos=pos, positions=len(inputs), data=data, scale=scale,
                           kind=VERIFY, step=self._step_no, routes=self.route(), attempt=session.attempt,
                           draft=inputs[1:], ids=keep_ids, draft_k=self._draft_k(sched))
        else:
            session.prefilled += len(inputs)
            first = pos == session.first_pos
            reuse = session.feed[:pos] if first else []
            session.confirming = bool(reuse)
            frame = Hidden(session=session.session_id, pos=pos, positions=len(inputs), data=data, scale=scale,
                           kind=PIECE if session.prefilling else LAST_PIECE,
                           sampling=ring_sampling(session, isinstance(sched.draft, RingDrafts)) if first else None,
                           ids=keep_ids, reuse=reuse, reserve=session.reserved_tokens if first else 0,
                           routes=self.route(), attempt=session.attempt,
                           draft_k=0 if session.prefilling else self._draft_k(sched))
        self.send(frame)
        session.sent(len(data) + len(scale), len(inputs), now)


    def _has_room(self, sched: Scheduler) -> bool:
        """Whether passes may carry drafts now: the load drafts and the ring is nearly empty."""
        return bool(sched.speculative) and len(sched.sessions) <= self.num_stages * self.spec_max_active_per_stage

    def _draft_k(self, sched: Scheduler) -> int:
        """The guesses a frame asks of the last stage's draft model: k while the ring has room, else none."""
        return sched.speculative if isinstance(sched.draft, RingDrafts) and self._has_room(sched) else 0


def ring_sampling(session: Session, drafting: bool = False) -> RingSampling:
    """A session's sampling for the last stage, with the ids its processors need (and, where its draft
    model guesses from the whole sequence, ``drafting``, the prompt's)."""
    s = session.sampling
    wants_prompt = drafting or s.repetition_penalty != 1.0 or s.prompt_logprobs is not None
    return RingSampling(sampling=s, stop_ids=sorted(session.stop_ids) if s.min_tokens else [],
                        prompt_ids=session.prompt_ids if wants_prompt else [],
                        output_ids=list(session.output_ids))
