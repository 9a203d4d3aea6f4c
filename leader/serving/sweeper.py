"""The request sweeper: ends the rows of requests that can no longer finish (issue 21 item 5).

A request row stays ``accepted`` until a stage or its gateway reports how it ended. When neither
can any more (the gateway's leader died, or the load ended with the request still queued), this
task ends it, as an event like any other (never an SQL write behind the projector):

- a request whose load ended, or whose gateway is gone, and whose token stream already has a done or
  error frame gets that outcome (a stage that stopped may not have published it);
- one accepted before this leader started, whose load is no longer active, fails at once:
  ``model_not_loaded`` when no stage started it, ``leader_restarted`` when one had;
- one with no frame for the gateway's frame timeout fails: when its load is no longer active,
  ``model_not_loaded`` (never started) or ``load_failed``; else ``leader_restarted`` when its gateway
  was a previous leader, or ``timeout``.

Event ids are the request's own (request_failed_id / request_finished_id), so a stage or gateway
that reports too is deduplicated, and the requests projection keeps the first outcome anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.logs import for_request
from core.tasks import cancel_and_wait
from events import subjects
from events.frames import AnyFrame, DoneFrame, ErrorFrame, frame_decoder, frame_key, frame_signed
from events.requests import RequestFailed, RequestFinished, request_failed_id, request_finished_id
from leader.db.tables import Load, Request
from leader.projectors.runner import ProjectionRunner
from leader.services import Publish
from leader.serving.reactions import purge_queue
from leader.serving.rows import ACTIVE

log = logging.getLogger(__name__)

QUIET_S = 600.0  # as the gateway's FRAME_TIMEOUT_S: a request silent this long is not coming back
EVERY_S = 30.0


class RequestSweeper:
    def __init__(self, js: JetStreamContext, sessions: async_sessionmaker, projections: ProjectionRunner,
                 publish: Publish, frame_secret: bytes, quiet_s: float = QUIET_S, every_s: float = EVERY_S,
                 clock=time.time):
        self.js = js
        self.sessions = sessions
        self.projections = projections
        self.publish = publish
        self.frame_secret = frame_secret  # checks the last frame's signature (events.frames.frame_key)
        self.quiet_s = quiet_s
        self.every_s = every_s
        self.clock = clock
        self.started_at = clock()  # rows accepted before this had their gateway in an earlier leader
        self._poked = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="request-sweeper")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    def poke(self) -> None:
        """Sweep now rather than at the next tick (a load ended: its requests' last frames are final)."""
        self._poked.set()

    async def _run(self) -> None:
        while True:
            self._poked.clear()
            try:
                await self._caught_up()
                await self.sweep()
            except Exception:
                log.exception("request sweeper: a sweep failed")
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel (stop would hang)
                async with asyncio.timeout(self.every_s):
                    await self._poked.wait()
            except TimeoutError:
                pass

    async def _caught_up(self) -> None:
        """Wait until the projections have applied the log as it is now: an outcome already published
        is not a row to end."""
        info = await self.js.stream_info(subjects.EVENTS_STREAM)
        await self.projections.wait_for(info.state.last_seq, ["loads", "requests"], timeout=60.0)

    async def sweep(self) -> int:
        """End what can no longer finish; returns how many rows it ended."""
        now = self.clock()
        async with self.sessions() as session:
            rows = (await session.execute(
                select(Request.request_id, Request.model_id, Request.load_id, Request.accepted_at, Load.state)
                .outerjoin(Load, Load.load_id == Request.load_id)
                .where(Request.status == "accepted",
                       (Request.accepted_at < self.started_at) | (Request.accepted_at < now - self.quiet_s)
                       | Load.state.is_(None) | Load.state.not_in(ACTIVE)))).all()
        ended = 0
        purged: set[str] = set()
        for rid, model_id, load_id, accepted_at, load_state in rows:
            try:
                frame, frame_at = await self._last_frame(rid)
            except (NatsError, asyncio.TimeoutError) as exc:
                log.warning("request sweeper: reading the frames of %s failed: %s", rid, exc, extra=for_request(rid))
                continue  # look again next sweep
            evt = self._outcome(rid, model_id, load_id, accepted_at, load_state in ACTIVE, frame, frame_at, now)
            if evt is None:
                continue
            if isinstance(evt, RequestFailed) and load_state not in ACTIVE and load_id not in purged:
                purged.add(load_id)
                await purge_queue(self.js, load_id)  # a late request still queued for it
            await self.publish(evt)
            log.info("request sweeper: ended %s as %s", rid, getattr(evt, "code", "finished"), extra=for_request(rid))
            ended += 1
        return ended

    def _outcome(self, rid: str, model_id: str, load_id: str, accepted_at: float, active: bool,
                 frame: AnyFrame | None, frame_at: float | None, now: float):
        if isinstance(frame, DoneFrame):
            return RequestFinished(id=request_finished_id(rid), request_id=rid, model_id=model_id, load_id=load_id,
                                   prompt_tokens=frame.prompt_tokens, completion_tokens=frame.completion_tokens,
                                   finish_reason=frame.finish_reason, timing=dict(frame.timing))
        if isinstance(frame, ErrorFrame):
            return self._failed(rid, model_id, load_id, frame.code, frame.message)
        orphan = accepted_at < self.started_at
        quiet = now - (frame_at or accepted_at) > self.quiet_s
        if not active and (orphan or quiet):
            if frame is None:
                return self._failed(rid, model_id, load_id, "model_not_loaded",
                                    "the model was unloaded before this request was served")
            if orphan:
                return self._failed(rid, model_id, load_id, "leader_restarted",
                                    "the leader restarted while this request was served, and its model is gone")
            return self._failed(rid, model_id, load_id, "load_failed",
                                "the model stopped serving while this request was served")
        if quiet:
            if orphan:
                return self._failed(rid, model_id, load_id, "leader_restarted",
                                    f"the leader restarted, and the request sent nothing for {self.quiet_s:g}s")
            return self._failed(rid, model_id, load_id, "timeout",
                                f"the model '{model_id}' sent nothing for {self.quiet_s:g}s")
        return None

    @staticmethod
    def _failed(rid: str, model_id: str, load_id: str, code: str, message: str) -> RequestFailed:
        return RequestFailed(id=request_failed_id(rid), request_id=rid, model_id=model_id, load_id=load_id, code=code,
                             message=message)

    async def _last_frame(self, rid: str) -> tuple[AnyFrame | None, float | None]:
        """The request's last frame in SWARM_TOKENS and when it was stored; (None, None) if it has none."""
        try:
            msg = await self.js.get_last_msg(subjects.TOKENS_STREAM, subjects.tokens(rid))
        except NotFoundError:
            return None, None
        try:  # a frame another fellow forged is no frame of this request's
            key = frame_key(self.frame_secret, rid)
            frame = frame_decoder.decode(msg.data) if frame_signed(key, msg.data, msg.headers) else None
        except msgspec.DecodeError:
            frame = None
        return frame, msg.time.timestamp() if msg.time else None
