"""One request's token frames, in order: live from core NATS, gaps filled from SWARM_TOKENS.

The gateway subscribes to ``swarm.tok.<rid>`` before it publishes the request, so normally every frame arrives live
and in order. A frame the subscription missed (slow consumer, reconnect) shows as a gap in ``seq``, or, when it was
the last frame, as silence; either way the missing frames are read back from the stream with a short-lived consumer.
One shared subscription on ``load.failed`` ends every request of a load whose fellow was lost; one on
``load.replica_lost`` moves the requests that replica had started (its start frame said so) to another stage
(leader.moves), or ends them where they cannot move, while those it had not started stay queued for the replicas
left. One on ``load.unloaded`` ends the requests of that load no stage had
started: their queued messages are purged (leader.serving.reactions), so no frame would ever come. A request opened
on a load that already ended fails at once.

A streaming client that hangs up before the end cancels its request only after a grace (SWARM_STREAM_RESUME_S);
reconnecting with the Last-Event-ID of its last chunk (`event_id`) resumes the frames after it, read back from
SWARM_TOKENS (`TokenStreams.resume`, leader.resume).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from events import subjects
from events.base import new_id
from events.frames import AnyFrame, DoneFrame, ErrorFrame, StartFrame, TokenFrame, frame_key
from events.loads import LoadFailed, ModelUnloaded, ReplicaLost
from events.requests import ChatRequest
from events.union import decode_event
from leader.frames_in import read_frame
from leader.moves import Mover
from leader.projectors.authority import Authority
from leader.verdicts import ended, load_failed, not_loaded

log = logging.getLogger(__name__)

PROBE_S = 2.0  # silence this long makes the receiver look in the stream (a lost last frame)
GAP_WAIT_S = 0.05  # a gap this old is filled from the stream rather than awaited live
ENDED_KEPT = 1024  # ended loads remembered, for requests opened on one just after it ended


class FrameTimeout(Exception):
    """No frame for longer than the caller's bound."""


class TokenStream:
    """The frames of one request; `next()` returns them by seq, ending with a done or error frame."""

    def __init__(self, hub: "TokenStreams", request_id: str, load_id: str):
        self.hub = hub
        self.request_id = request_id
        self.load_id = load_id
        self.subject = subjects.tokens(request_id)
        self.next_seq = 0
        self.ended = False
        self.replica: int | None = None  # which replica took the request, once its start frame came
        self.fellow_id = ""
        self.chat: ChatRequest | None = None  # as published, where the gateway can move it (leader.moves)
        self.rehoming = False  # its load failed and it waits for the heal (leader.moves.Mover.rehome)
        self.key = hub.key(request_id)
        self._held: dict[int, AnyFrame] = {}
        self._queue: asyncio.Queue[AnyFrame | None] = asyncio.Queue()
        self._failure: ErrorFrame | None = None
        self._sub = None
        self._start_seq = 1  # stream sequence the next fill starts at

    async def open(self) -> "TokenStream":
        self._sub = await self.hub.nc.subscribe(self.subject, cb=self._on_msg)
        self.hub.watch(self)
        return self

    async def _on_msg(self, msg) -> None:
        frame = read_frame(msg, self.key)
        if frame is None:
            return
        self._started(frame)  # at once: a replica's loss may come before the reader gets here
        self._queue.put_nowait(frame)

    def _started(self, frame: AnyFrame) -> None:
        # the first start frame is the one JetStream stored; a later one (a replica that lost the
        # claim) is only seen live, and that replica does not serve the request
        if isinstance(frame, StartFrame) and self.replica is None:
            self.replica, self.fellow_id = frame.replica, frame.fellow_id

    def fail(self, frame: ErrorFrame) -> None:
        """End the request from outside (its load failed); the reader sees `frame` next."""
        self._failure = frame
        self._queue.put_nowait(None)

    def _hold(self, frame: AnyFrame | None) -> None:
        if frame is not None and frame.seq >= self.next_seq:
            self._held.setdefault(frame.seq, frame)

    async def next(self, timeout: float) -> AnyFrame:
        """The next frame in seq order; FrameTimeout after `timeout` seconds without one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        gap_wait = self.hub.gap_wait_s
        while True:
            frame = self._held.pop(self.next_seq, None)
            if frame is not None:
                self.next_seq += 1
                if isinstance(frame, StartFrame):  # the gateway's to know, not the reader's
                    self._started(frame)
                    continue
                self.ended = not isinstance(frame, TokenFrame)
                return frame
            if self._failure is not None:
                self.ended = True
                return self._failure
            try:
                self._hold(self._queue.get_nowait())
                continue
            except asyncio.QueueEmpty:
                pass
            if (left := deadline - loop.time()) <= 0:
                raise FrameTimeout(f"no frame for {timeout:g}s")
            wait = min(left, gap_wait if self._held else self.hub.probe_s)
            try:
                async with asyncio.timeout(wait):
                    self._hold(await self._queue.get())
            except TimeoutError:
                await self._fill()
                if self._held:
                    gap_wait = min(gap_wait * 2, self.hub.probe_s)

    async def _fill(self) -> None:
        """Read this request's frames from SWARM_TOKENS, from where the last fill stopped."""
        js = self.hub.js
        cfg = ConsumerConfig(
            name="fill-" + new_id(), filter_subject=self.subject,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._start_seq,
            ack_policy=AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True, num_replicas=1)
        try:
            info = await js.add_consumer(subjects.TOKENS_STREAM, cfg)
            try:
                if info.num_pending:
                    psub = await js.pull_subscribe_bind(stream=subjects.TOKENS_STREAM, consumer=info.name)
                    try:
                        msgs = await psub.fetch(info.num_pending, timeout=2.0)
                    finally:
                        await psub.unsubscribe()
                    for msg in msgs:
                        self._start_seq = max(self._start_seq, msg.metadata.sequence.stream + 1)
                        if (frame := read_frame(msg, self.key)) is not None:
                            self._started(frame)
                            self._hold(frame)
                            if isinstance(frame, (DoneFrame, ErrorFrame)) and frame.seq < self.next_seq:
                                self.ended = True  # a resume after the last chunk: nothing is left
            finally:
                await js.delete_consumer(subjects.TOKENS_STREAM, info.name)
        except (NatsError, asyncio.TimeoutError) as exc:
            log.warning("reading %s back from the stream failed: %s", self.subject, exc)

    def close(self, cancel: bool, grace_s: float = 0.0) -> None:
        """Stop receiving; with `cancel` (client gone before the end) tell the serving stage to stop, after
        `grace_s` seconds unless the client resumed the stream by then (TokenStreams.resume). In a task of its
        own: the caller may be a cancelled task, where an await would be cancelled before the cancel is sent."""
        self.hub.unwatch(self)
        self.hub.spawn(self._close(cancel and not self.ended, grace_s))

    async def _close(self, cancel: bool, grace_s: float) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        if cancel:
            await self.hub.cancel(self.load_id, self.request_id, grace_s)


class TokenStreams:
    """The gateway's receivers: opens one per request and watches their loads for failure."""

    def __init__(self, nc: Client, js: JetStreamContext, probe_s: float = PROBE_S, gap_wait_s: float = GAP_WAIT_S,
                 secret: bytes = b"", authority: Authority | None = None):
        self.nc = nc
        self.js = js
        self.authority = authority or Authority()  # a fellow's report about a load not placed on it is ignored
        self.secret = secret  # the leader's NATS password: b"" without NATS auth, where frames go unsigned
        self.probe_s = probe_s
        self.gap_wait_s = gap_wait_s
        self._graces: dict[str, asyncio.Future] = {}  # request_id -> resolved True on resume, False on stop
        self._by_load: dict[str, set[TokenStream]] = {}
        self._ended: dict[str, ModelUnloaded | LoadFailed] = {}  # load_id -> how it ended, oldest first
        self.on_ended: list[Callable[[str], object]] = []  # told each ended load_id (the ready view drops it)
        self._tasks: set[asyncio.Task] = set()
        self._subs: list = []
        self._started: asyncio.Task | None = None
        self.mover = Mover(self)  # a started request of a lost replica goes on elsewhere
        self.heal_wait: Callable[[str], Awaitable] | None = None  # a model's healed load (leader.serving.heal)

    def key(self, request_id: str) -> str:
        """The request's frame key (events.frames.frame_key); "" without a secret."""
        return frame_key(self.secret, request_id)

    def keyed(self, chat: ChatRequest) -> ChatRequest:
        """The request as published: with its frame key, which the stage that takes it signs frames with."""
        return msgspec.structs.replace(chat, frame_key=self.key(chat.request_id))

    async def start(self) -> "TokenStreams":
        """Subscribe to load failures once, however many requests ask at the same moment."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._subscribe())
        await asyncio.shield(self._started)
        return self

    async def _subscribe(self) -> None:
        for kind, cb in (("load.failed", self._on_load_failed), ("load.replica_lost", self._on_replica_lost),
                         ("load.unloaded", self._on_unloaded)):
            for subject in subjects.event_watch(kind):  # the leader's and the fellows'
                self._subs.append(await self.nc.subscribe(subject, cb=cb))

    async def stop(self) -> None:
        for grace in list(self._graces.values()):  # the cancels waiting out a grace go now
            if not grace.done():
                grace.set_result(False)
        if not self.nc.is_closed:
            for sub in self._subs:
                await sub.unsubscribe()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def open(self, request_id: str, load_id: str, chat: ChatRequest | None = None) -> TokenStream:
        """A request's frames; with its ``chat``, a stage lost mid-reply moves it (leader.moves)."""
        stream = TokenStream(self, request_id, load_id)
        stream.chat = chat
        return await stream.open()

    async def resume(self, request_id: str, load_id: str, next_seq: int) -> TokenStream:
        """The frames of a request from `next_seq` on, for a client that reconnected; a cancel waiting out
        its grace is called off. What was sent meanwhile is read back from SWARM_TOKENS at once."""
        grace = self._graces.pop(request_id, None)
        if grace is not None and not grace.done():
            grace.set_result(True)
        stream = TokenStream(self, request_id, load_id)
        stream.next_seq = next_seq
        await stream.open()
        await stream._fill()
        return stream

    async def cancel(self, load_id: str, request_id: str, grace_s: float = 0.0) -> None:
        """Tell the stage serving the request to stop, after `grace_s` unless it is resumed first."""
        if grace_s > 0:
            grace = self._graces[request_id] = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(grace_s):
                    if await grace:
                        return  # resumed
            except TimeoutError:
                pass
            finally:
                if self._graces.get(request_id) is grace:
                    del self._graces[request_id]
        await self.nc.publish(subjects.cancel(load_id, request_id), b"")

    def watch(self, stream: TokenStream) -> None:
        self._by_load.setdefault(stream.load_id, set()).add(stream)
        how = self._ended.get(stream.load_id)  # a request accepted from a view a moment old: its load ended
        if how is not None and not (isinstance(how, LoadFailed) and self.mover.rehome(stream, how)):
            stream.fail(ended(stream, how))

    def rewatch(self, stream: TokenStream, load_id: str) -> None:
        """The request goes on at another load (leader.moves: the one that heals its failed load)."""
        self.unwatch(stream)
        stream.load_id = load_id
        self._by_load.setdefault(load_id, set()).add(stream)

    def unwatch(self, stream: TokenStream) -> None:
        waiting = self._by_load.get(stream.load_id)
        if waiting is not None:
            waiting.discard(stream)
            if not waiting:
                del self._by_load[stream.load_id]

    async def _on_load_failed(self, msg) -> None:
        evt = await self._event(msg)
        if not isinstance(evt, LoadFailed):
            return
        self._remember(evt)
        for stream in list(self._by_load.get(evt.load_id, ())):
            if not self.mover.rehome(stream, evt):  # it waits for the load that heals this one, or fails
                stream.fail(load_failed(stream, evt))

    async def _on_unloaded(self, msg) -> None:
        evt = await self._event(msg)
        if not isinstance(evt, ModelUnloaded):
            return
        self._remember(evt)
        for stream in list(self._by_load.get(evt.load_id, ())):
            if stream.replica is None:  # not started: still queued, and the queue is purged
                stream.fail(not_loaded(stream, evt))

    def _remember(self, evt: ModelUnloaded | LoadFailed) -> None:
        """A request opened on this load later (accepted just before the leader's view changed) fails at
        once: no stage will take it, its queue was purged."""
        self._ended[evt.load_id] = evt
        while len(self._ended) > ENDED_KEPT:
            del self._ended[next(iter(self._ended))]
        for hook in self.on_ended:
            hook(evt.load_id)

    async def _on_replica_lost(self, msg) -> None:
        evt = await self._event(msg)
        if not isinstance(evt, ReplicaLost):
            return
        for stream in list(self._by_load.get(evt.load_id, ())):
            if stream.replica == evt.replica:  # it moves to another stage, or fails saying why not
                self.mover.take(stream, evt)

    async def _event(self, msg):
        """The event in ``msg``, or None for one no reader can decode (the projections keep it as a dead
        letter) or one its sender may not publish (likewise)."""
        try:
            evt = decode_event(msg.data)
        except (ValueError, RecursionError):  # PoisonEvent is a ValueError
            log.warning("undecodable event on %s dropped", msg.subject)
            return None
        return None if await self.authority.refusal(msg.subject, evt) else evt

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("closing a token stream failed: %s", task.exception())
