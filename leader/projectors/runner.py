"""Runs the projectors: one reader fetches and decodes each batch once, every projector applies it
(apply + checkpoint in one transaction) in its own task."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.tasks import cancel_and_wait
from events.subjects import EVENTS_ALL, EVENTS_STREAM
from leader.projectors.authority import Authority
from leader.projectors.batch import Entry, apply_batch, decode_batch, read_checkpoint, record_dead_letters
from leader.projectors.projector import Projector

log = logging.getLogger(__name__)

FETCH_BATCH = 256
QUEUED_BATCHES = 8  # per projector: the reader waits when one is this far behind
LINGER_MOST = 4 * FETCH_BATCH  # events one lingering transaction takes at most
FAILURE_LOOP = 3  # consecutive failed tries of one batch: the projector is stuck
STUCK_AFTER_S = 10.0  # holding one batch this long: the projector is stuck
RETRY_S = 0.2
FETCH_TIMEOUT_S = 5.0


class ProjectionLagging(TimeoutError):
    """A projection did not reach a sequence within the bounded wait."""


class ProjectorState:
    """Whether a projector (or the reader) is stuck: what /healthz reports besides the position."""

    def __init__(self) -> None:
        self.failures = 0  # consecutive failed tries of its current batch
        self.busy_since: float | None = None  # monotonic time it took its current batch

    def stuck(self, now: float, after_s: float) -> bool:
        return self.failures >= FAILURE_LOOP or (self.busy_since is not None and now - self.busy_since > after_s)


class ProjectionRunner:
    """The reader and one task per projector; `wait_for` lets an endpoint read its own writes.

    The checkpoint in SQL is the truth: the reader starts from the lowest one + 1 on an ephemeral
    consumer, and each projector skips what is at or below its own.
    """

    def __init__(self, js: JetStreamContext, sessions: async_sessionmaker, projectors: list[Projector],
                 stuck_after_s: float = STUCK_AFTER_S, fetch_timeout_s: float = FETCH_TIMEOUT_S):
        self.js = js
        self.sessions = sessions
        self.projectors = {p.name: p for p in projectors}
        self.positions: dict[str, int] = {}
        self.states = {name: ProjectorState() for name in self.projectors}
        self.stuck_after_s = stuck_after_s
        self.fetch_timeout_s = fetch_timeout_s
        self.empty_fetches = 0  # a normal answer of an idle stream, counted, not an error
        self.reader = ProjectorState()  # busy: waiting on a full queue; failures: reads that failed
        self._queues = {name: asyncio.Queue(QUEUED_BATCHES) for name in self.projectors}
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        # name -> callables(events) told after a batch is committed. They run in the projector's task:
        # one that publishes must hand the events to a task of its own.
        self.listeners: dict[str, list] = {}
        self.authority = Authority(sessions)  # who may report what: the reader screens every batch

    async def start(self) -> None:
        async with self.sessions() as session:
            for name in self.projectors:
                self.positions[name] = await read_checkpoint(session, name)
        self._tasks.append(asyncio.create_task(self._read(min(self.positions.values(), default=0)),
                                               name="projections-reader"))
        for p in self.projectors.values():
            self._tasks.append(asyncio.create_task(self._run(p), name=f"projector-{p.name}"))

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks.clear()

    # --- the reader --------------------------------------------------------------------------

    async def _subscribe(self, start: int):
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start,
                             ack_policy=AckPolicy.NONE, inactive_threshold=60.0)
        return await self.js.pull_subscribe(EVENTS_ALL, stream=EVENTS_STREAM, config=cfg)

    async def _read(self, read_to: int) -> None:
        """Fetch, decode once, screen (leader.projectors.authority), record dead letters, hand the batch to
        every projector."""
        sub = None
        try:
            while True:
                try:
                    if sub is None:
                        sub = await self._subscribe(read_to + 1)
                    try:
                        msgs = await sub.fetch(FETCH_BATCH, timeout=self.fetch_timeout_s)
                    except (NatsTimeout, asyncio.TimeoutError):
                        self.reader.failures = 0
                        continue  # nothing new within the timeout
                    self.reader.failures = 0
                    if not msgs:  # the server's answer to a pull that expired: normal when idle
                        self.empty_fetches += 1
                        continue
                    batch = await self.authority.screen(decode_batch(msgs))
                    if any(e.poison for e in batch):
                        async with self.sessions() as session, session.begin():
                            await record_dead_letters(session, batch)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # resume after what was handed on
                    self.reader.failures += 1
                    log.warning("projections: reading the log failed (%s); resuming after %d", exc, read_to)
                    sub = await _drop(sub)
                    await asyncio.sleep(RETRY_S)
                    continue
                await self._hand(batch)
                read_to = batch[-1].seq
        finally:
            await _drop(sub)

    async def _hand(self, batch: list[Entry]) -> None:
        for queue in self._queues.values():
            if queue.full():
                self.reader.busy_since = self.reader.busy_since or time.monotonic()
            await queue.put(batch)
        self.reader.busy_since = None

    # --- one projector -----------------------------------------------------------------------

    async def _run(self, p: Projector) -> None:
        queue, state = self._queues[p.name], self.states[p.name]
        while True:
            batch = await queue.get()
            if p.linger_s:
                batch = await _gather(queue, batch, p.linger_s)
            state.busy_since = time.monotonic()
            while True:
                try:
                    applied = await self._apply(p, batch)
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # not applied: try the same batch again
                    state.failures += 1
                    away = isinstance(exc, (OperationalError, OSError))  # the database away for a while
                    level = logging.WARNING if away else logging.ERROR
                    log.log(level, "projector %s: batch not applied (%s); trying again", p.name, exc,
                            exc_info=level == logging.ERROR and state.failures == 1)
                    await asyncio.sleep(RETRY_S)
            state.failures, state.busy_since = 0, None
            await self._advance(p.name, batch[-1].seq)
            await self._tell(p.name, applied)

    async def _apply(self, p: Projector, batch: list[Entry]) -> list:
        """Apply the batch; returns the events this leader had not seen yet, for its listeners: also
        those another leader on the same database applied first (apply_batch then skips them), so
        each leader's own state (its ready view) follows every event."""
        position = self.positions.get(p.name, 0)
        if not any(e.seq > position and p.wants(e.event) for e in batch):
            return []  # nothing here for this projector: no SQL write. Its stored checkpoint lags until
            # its next own event, and a restart re-reads these as the no-ops they are.
        async with self.sessions() as session, session.begin():
            await apply_batch(session, p, batch)
        for e in batch:
            if e.seq > position and p.wants(e.event):
                p.committed(e.event, e.seq)
        return [e.event for e in batch if e.seq > position and e.event is not None]

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

    # --- readers of the positions ------------------------------------------------------------

    def health(self, last_seq: int) -> dict[str, dict]:
        """Per projector: its checkpoint, the stream's last sequence, the lag, and whether it is stuck."""
        now = time.monotonic()
        reader_stuck = self.reader.stuck(now, self.stuck_after_s)  # then every projector behind is
        out = {}
        for name, state in self.states.items():
            seq = self.positions.get(name, 0)
            lag = max(0, last_seq - seq)
            out[name] = {"checkpoint": seq, "last_seq": last_seq, "lag": lag,
                         "stuck": state.stuck(now, self.stuck_after_s) or (reader_stuck and lag > 0),
                         "failures": state.failures}
        return out

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
                try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that races a notify
                    async with asyncio.timeout(left):
                        await self._changed.wait()
                except TimeoutError:
                    pass


async def _gather(queue: asyncio.Queue, batch: list[Entry], linger_s: float) -> list[Entry]:
    """``batch`` and what else comes within ``linger_s`` (up to LINGER_MOST events), in order: the queue
    is emptied as batches come, so the reader never waits on it meanwhile."""
    merged = list(batch)
    deadline = time.monotonic() + linger_s
    while len(merged) < LINGER_MOST and (left := deadline - time.monotonic()) > 0:
        try:
            async with asyncio.timeout(left):
                merged += await queue.get()
        except TimeoutError:
            break
    return merged


async def _drop(sub) -> None:
    if sub is not None:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
    return None
