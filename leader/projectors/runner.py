"""Runs projectors on durable pull consumers: apply + checkpoint in one transaction, then ack."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from events.base import decode_event
from events.subjects import EVENTS_ALL, EVENTS_STREAM
from leader.db.tables import ProjectorCheckpoint
from leader.projectors.projector import Projector

log = logging.getLogger(__name__)

FETCH_BATCH = 256


class ProjectionLagging(TimeoutError):
    """A projection did not reach a sequence within the bounded wait."""


async def read_checkpoint(session: AsyncSession, name: str) -> int:
    row = await session.get(ProjectorCheckpoint, name)
    return row.seq if row else 0


async def apply_batch(session: AsyncSession, projector: Projector, msgs: list,
                      applied: list | None = None) -> int:
    """Apply every message above the checkpoint and advance it; returns the new checkpoint.

    Events applied are appended to `applied` when given (for reactions after the commit).
    """
    row = await session.get(ProjectorCheckpoint, projector.name)
    if row is None:
        row = ProjectorCheckpoint(name=projector.name, seq=0)
        session.add(row)
    checkpoint = row.seq
    for msg in msgs:
        seq = msg.metadata.sequence.stream
        if seq <= checkpoint:
            continue  # a redelivery or an overlap with a replay: already applied
        evt = decode_event(msg.data)
        if evt is not None:
            await projector.apply(session, evt, seq)
            if applied is not None:
                applied.append(evt)
        checkpoint = seq
    row.seq = checkpoint
    return checkpoint


class ProjectionRunner:
    """One task per projector; `wait_for` lets an endpoint read its own writes."""

    def __init__(self, js: JetStreamContext, sessions: async_sessionmaker, projectors: list[Projector]):
        self.js = js
        self.sessions = sessions
        self.projectors = {p.name: p for p in projectors}
        self.positions: dict[str, int] = {}
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        # name -> async callables(events) run after a batch is committed: reactions that publish
        # further events (ids derived from the cause, so a repeat after a crash is deduplicated)
        self.listeners: dict[str, list] = {}

    async def start(self) -> None:
        async with self.sessions() as session:
            for name in self.projectors:
                self.positions[name] = await read_checkpoint(session, name)
        for p in self.projectors.values():
            self._tasks.append(asyncio.create_task(self._run(p), name=f"projector-{p.name}"))

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _subscribe(self, p: Projector):
        """A durable consumer positioned at the SQL checkpoint + 1.

        The checkpoint in SQL is the truth. A consumer left from before a crash would redeliver its
        unacked messages only after ack_wait, behind newer ones, and skipping "at or below the
        checkpoint" would then lose them; so it is recreated from the checkpoint on every (re)start.
        """
        durable = f"proj-{p.name}"
        async with self.sessions() as session:
            start = await read_checkpoint(session, p.name) + 1
        try:
            await self.js.delete_consumer(EVENTS_STREAM, durable)
        except NotFoundError:
            pass
        cfg = ConsumerConfig(
            durable_name=durable, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start,
            ack_policy=AckPolicy.EXPLICIT, ack_wait=60, max_ack_pending=FETCH_BATCH * 4,
        )
        return await self.js.pull_subscribe(EVENTS_ALL, durable=durable, stream=EVENTS_STREAM, config=cfg)

    async def _run(self, p: Projector) -> None:
        sub = None
        while not self._stopping:
            try:
                if sub is None:
                    sub = await self._subscribe(p)
                try:
                    msgs = await sub.fetch(FETCH_BATCH, timeout=5)
                except (NatsTimeout, asyncio.TimeoutError):
                    continue
                applied: list = []
                if any(p.wants(decode_event(m.data)) for m in msgs):
                    async with self.sessions() as session, session.begin():
                        seq = await apply_batch(session, p, msgs, applied)
                else:
                    # Nothing here for this projector: no SQL write. Its stored checkpoint lags until
                    # its next own event, and a restart re-reads these as the no-ops they are.
                    seq = max(self.positions.get(p.name, 0), msgs[-1].metadata.sequence.stream)
                for msg in msgs:
                    await msg.ack()
                await self._advance(p.name, seq)
                await self._tell(p.name, applied)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # not applied, not acked: resume from the checkpoint
                level = logging.WARNING if isinstance(exc, OperationalError) else logging.ERROR
                log.log(level, "projector %s: batch not applied (%s); resuming from checkpoint",
                        p.name, exc, exc_info=level == logging.ERROR)
                sub = await self._drop(sub)
                await asyncio.sleep(0.2)

    async def _drop(self, sub) -> None:
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        return None

    async def _tell(self, name: str, applied: list) -> None:
        for listener in self.listeners.get(name, ()):
            try:
                await listener(applied)
            except Exception:
                log.exception("listener on projection %s failed", name)

    async def _advance(self, name: str, seq: int) -> None:
        async with self._changed:
            if seq > self.positions.get(name, 0):
                self.positions[name] = seq
            self._changed.notify_all()

    async def wait_for(self, seq: int, names: list[str] | None = None, timeout: float = 5.0) -> None:
        """Wait until every named projection (all by default) has applied stream sequence `seq`."""
        names = names or list(self.projectors)
        deadline = time.monotonic() + timeout

        def caught_up() -> bool:
            return all(self.positions.get(n, 0) >= seq for n in names)

        async with self._changed:
            while not caught_up():
                left = deadline - time.monotonic()
                if left <= 0:
                    lag = {n: self.positions.get(n, 0) for n in names if self.positions.get(n, 0) < seq}
                    raise ProjectionLagging(f"projections {lag} have not reached sequence {seq}")
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
