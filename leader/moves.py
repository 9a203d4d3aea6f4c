"""Replies that outlive their stage (issue 53): a request whose stage died mid-reply goes on elsewhere.

When a replica that had started a request is lost (its stage process died and its fellow restarts it,
or it failed), the gateway reads the request's frames back from SWARM_TOKENS and publishes the request
again on its load's queue with a ``Resume`` (events.moves): the reply's token ids so far, the seq its
next stage's start frame takes (one past the last frame stored) and the stream sequence that frame must
follow (so of two stages only one claims it). Another replica, or the restarted stage, prefills prompt +
reply and sends frames from there: the client's reply goes on with nothing repeated or missing. A request
of a load that failed (a ring's stage died, a one-stage process died twice) waits for the load that heals
it (leader.serving.heal) and goes on there the same way, started or still queued. What the
next tokens depend on besides prompt + reply is rebuilt there from the reply's ids (fellow.runtime.server
.moved): the text held back while it may start a stop string, a grammar's state, the counts presence and
frequency penalties take. Each move is a RequestMoved event; after ``MAX_MOVES`` the next loss fails the
request as before, and so does a request that asked for its prompt's logprobs (they are sent once, first).
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.errors import Error as NatsError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from core.bus import publish_event, publish_struct
from events import subjects
from events.base import new_id
from events.frames import AnyFrame, DoneFrame, ErrorFrame, TokenFrame
from events.loads import LoadFailed, ReplicaLost
from events.moves import MAX_MOVES, RequestMoved, Resume, move_id
from events.requests import ChatRequest
from leader.errors import ApiError
from leader.frames_in import read_frame
from leader.verdicts import load_failed, replica_lost

log = logging.getLogger(__name__)


def unmovable(chat: ChatRequest | None) -> str:
    """Why a request cannot go on at another stage; "" where it can."""
    if chat is None:
        return "the gateway does not hold it"
    s = chat.sampling
    reasons = [why for why, on in (
        ("its prompt's logprobs", s.prompt_logprobs is not None),
        (f"it moved {MAX_MOVES} times already", chat.resume is not None and chat.resume.moves >= MAX_MOVES)) if on]
    return reasons[0] if reasons else ""


def unmovable_to(chat: ChatRequest, stages: int) -> str:
    """Why a request cannot go on at a load of ``stages`` stages; "" where it can. A ring's last stage
    samples, and it does not replay a reply made elsewhere through a grammar or penalties."""
    s = chat.sampling
    if stages > 1 and chat.resume is not None and chat.resume.reply_ids and (
            s.grammar or s.presence_penalty or s.frequency_penalty):
        return "its grammar or penalties over the reply so far, on a ring"
    return ""


async def stored_frames(js, subject: str, key: str) -> list[tuple[int, AnyFrame]]:
    """(stream sequence, frame) of every frame of a request SWARM_TOKENS holds, signed by its stage."""
    cfg = ConsumerConfig(name="move-" + new_id(), filter_subject=subject, deliver_policy=DeliverPolicy.ALL,
                         ack_policy=AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True, num_replicas=1)
    info = await js.add_consumer(subjects.TOKENS_STREAM, cfg)
    try:
        if not info.num_pending:
            return []
        psub = await js.pull_subscribe_bind(stream=subjects.TOKENS_STREAM, consumer=info.name)
        try:
            msgs = await psub.fetch(info.num_pending, timeout=2.0)
        finally:
            await psub.unsubscribe()
        return [(m.metadata.sequence.stream, f) for m in msgs if (f := read_frame(m, key)) is not None]
    finally:
        await js.delete_consumer(subjects.TOKENS_STREAM, info.name)


def resume_of(chat: ChatRequest, frames: list[tuple[int, AnyFrame]]) -> Resume | str:
    """Where the request goes on from its stored frames, or why it cannot (ended, a gap, nothing left)."""
    by_seq: dict[int, AnyFrame] = {}
    for _, frame in frames:
        by_seq.setdefault(frame.seq, frame)
    seq, ids, texts = 0, [], []
    while seq in by_seq:
        frame = by_seq[seq]
        if isinstance(frame, (DoneFrame, ErrorFrame)):
            return "its reply has ended"
        if isinstance(frame, TokenFrame):
            ids.extend(frame.token_ids)
            texts.extend(frame.texts[:len(frame.token_ids)])
        seq += 1
    if not by_seq:  # still queued when its load failed: it starts afresh
        return Resume(seq=0, after=0, reply_ids=[], moves=(chat.resume.moves if chat.resume else 0) + 1)
    if not seq or any(s > seq for s in by_seq):
        return "its frames on the stream have a gap"
    if len(ids) >= chat.max_tokens:
        return "its reply has all its tokens"
    return Resume(seq=seq, after=max(s for s, _ in frames), reply_ids=ids, text_sent=sum(map(len, texts)),
                  moves=(chat.resume.moves if chat.resume else 0) + 1)


class Mover:
    """The gateway's side of moves: told of a lost replica's started request, or of a failed load's request,
    it publishes its continuation (at the same load, or at the load that heals the failed one)."""

    def __init__(self, hub) -> None:
        self.hub = hub  # leader.token_stream.TokenStreams: js, keys, tasks, heal_wait

    def take(self, stream, evt: ReplicaLost) -> None:
        """The request of ``stream`` moves (its reader waits for the next stage's frames), or fails saying why
        it could not."""
        why = unmovable(stream.chat)
        if why:
            log.info("request %s does not move (%s): it fails with its replica", stream.request_id, why)
            self._fail(stream, replica_lost(stream, evt), why)
            return
        self.hub.spawn(self._move(stream, replica_lost(stream, evt), stream.load_id, 1, evt.fellow_id, evt.reason,
                                  evt.replica))

    def rehome(self, stream, evt: LoadFailed) -> bool:
        """The request of ``stream``, whose load failed, waits for the load that heals it and goes on there;
        False where it cannot wait (nothing heals here, or it cannot move): it fails with its load."""
        if self.hub.heal_wait is None or unmovable(stream.chat):
            return False
        if not stream.rehoming:  # once, however many copies of the failure come (the leader's, a fellow's)
            stream.rehoming = True
            self.hub.spawn(self._rehome(stream, evt))
        return True

    @staticmethod
    def _fail(stream, verdict: ErrorFrame, why) -> None:
        stream.fail(msgspec.structs.replace(verdict, message=f"{verdict.message}; it could not move: {why}"))

    async def _rehome(self, stream, evt: LoadFailed) -> None:
        verdict, why = load_failed(stream, evt), "no load heals it"
        try:
            try:
                ready = await self.hub.heal_wait(evt.model_id)
            except ApiError as exc:  # past the bound of a heal's wait
                ready, why = None, exc.detail
            except Exception as exc:  # the database, say: the request fails rather than waits for nothing
                log.warning("waiting for the heal of load %s failed: %s", evt.load_id, exc)
                ready, why = None, exc
            if ready is None or ready.load_id == evt.load_id:
                self._fail(stream, verdict, why)
                return
            log.info("request %s of failed load %s goes on at %s", stream.request_id, evt.load_id, ready.load_id)
            await self._move(stream, verdict, ready.load_id, ready.stages, evt.fellow_id, evt.reason)
        finally:
            stream.rehoming = False

    async def _move(self, stream, verdict: ErrorFrame, load_id: str, stages: int, fellow_id: str, reason: str,
                    replica: int = 0) -> None:
        """Publish the request's continuation on ``load_id``'s queue, from its stored frames; ``verdict``
        (why) where it cannot go on."""
        chat: ChatRequest = stream.chat
        try:
            resume = resume_of(chat, await stored_frames(self.hub.js, stream.subject, stream.key))
            if isinstance(resume, str):
                if resume == "its reply has ended":
                    return  # the reader gets its done or error frame from the stream
                raise ValueError(resume)
            moved = msgspec.structs.replace(chat, load_id=load_id, resume=resume)
            if why := unmovable_to(moved, stages):
                raise ValueError(why)
            stream.chat, stream.replica = moved, None  # the next stage's start frame says who serves it now
            if load_id != stream.load_id:
                self.hub.rewatch(stream, load_id)
            rid, mid = chat.request_id, move_id(chat.request_id, resume.moves)
            await publish_struct(self.hub.js, subjects.request(load_id), self.hub.keyed(moved), msg_id=mid)
            await publish_event(self.hub.js, RequestMoved(
                id=mid, request_id=rid, model_id=chat.model_id, load_id=load_id, fellow_id=fellow_id,
                replica=replica, seq=resume.seq, tokens=len(resume.reply_ids), moves=resume.moves, reason=reason))
            log.warning("request %s moves off fellow %s after %d tokens (move %d): %s", rid, fellow_id,
                        len(resume.reply_ids), resume.moves, reason)
        except (ValueError, NatsError, asyncio.TimeoutError) as exc:
            self._fail(stream, verdict, exc)
