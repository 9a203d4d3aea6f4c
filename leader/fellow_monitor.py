"""Watches heartbeats: keeps each fellow's latest, and publishes `fellow joined` / `fellow lost`."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.bus import publish_event
from core.tasks import cancel_and_wait
from events.fellow import FellowJoined, FellowLost, Heartbeat
from events.subjects import HEARTBEATS_ALL, HEARTBEATS_STREAM
from leader.db.tables import Fellow

log = logging.getLogger(__name__)

MISSED_BEATS = 3
_decode = msgspec.json.Decoder(Heartbeat).decode


class FellowMonitor:
    """A fellow is lost after `timeout_s` (SWARM_FELLOW_TIMEOUT_S) without a heartbeat; with 0, after
    MISSED_BEATS of its own heartbeat intervals.

    Event ids are derived from the fellow's start time and heartbeat sequence, so a retried
    publish of the same join or loss is deduplicated by JetStream.
    """

    def __init__(self, js: JetStreamContext, sessions: async_sessionmaker, clock=time.time, timeout_s: float = 0.0):
        self.js = js
        self.sessions = sessions
        self.clock = clock
        self.timeout_s = timeout_s
        self.latest: dict[str, Heartbeat] = {}
        self.online: dict[str, float] = {}  # fellow_id -> started_at of its announced join
        self._seen_at: dict[str, float] = {}
        self._sub = None
        self._task: asyncio.Task | None = None
        self.listeners: list = []  # async callables(evt) told of joins and losses
        self.beat_listeners: list = []  # callables(hb) told of each live heartbeat, after the join it caused

    async def start(self) -> None:
        started = self.clock()
        async with self.sessions() as session:
            for row in await session.scalars(select(Fellow).where(Fellow.status == "online")):
                self.online[row.fellow_id] = row.started_at
                self._seen_at[row.fellow_id] = started  # a grace period after our own restart
        self._sub = await self.js.subscribe(
            HEARTBEATS_ALL, stream=HEARTBEATS_STREAM, cb=self._on_heartbeat, manual_ack=False,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                                  ack_policy=AckPolicy.NONE, inactive_threshold=30.0),
        )
        self._task = asyncio.create_task(self._watch(), name="fellow-monitor")

    async def stop(self) -> None:
        if self._task:
            await cancel_and_wait(self._task)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass

    async def _on_heartbeat(self, msg) -> None:
        try:
            hb = _decode(msg.data)
        except (msgspec.DecodeError, RecursionError):  # not a heartbeat, or nested too deep
            log.warning("dropped a malformed heartbeat on %s", msg.subject)
            return
        prev = self.latest.get(hb.fellow_id)
        if prev is not None and prev.started_at == hb.started_at and prev.seq >= hb.seq:
            return
        seen = self._seen_at.get(hb.fellow_id, 0.0)
        self.latest[hb.fellow_id] = hb
        self._seen_at[hb.fellow_id] = max(hb.at, seen)
        if self.clock() - hb.at > self._timeout(hb):
            return  # an old heartbeat replayed from the stream: not a sign of life
        was = self.online.get(hb.fellow_id)
        if was is not None and was < hb.started_at:  # restarted before its timeout: its stages went with it
            await self._lost(hb.fellow_id, was, seen, "restarted", prev)
        if self.online.get(hb.fellow_id) != hb.started_at:
            await self._joined(hb)
        for listener in self.beat_listeners:
            listener(hb)

    def _timeout(self, hb: Heartbeat | None) -> float:
        return self.timeout_s or MISSED_BEATS * (hb.interval_s if hb else 2.0)

    async def _joined(self, hb: Heartbeat) -> None:
        evt = FellowJoined(id=f"joined-{hb.fellow_id}-{hb.started_at!r}-{hb.seq}", fellow_id=hb.fellow_id,
                           hostname=hb.hostname, version=hb.version, gpus=hb.gpus,
                           memory_total_bytes=hb.memory_total_bytes,
                           capabilities=hb.capabilities, started_at=hb.started_at)
        await publish_event(self.js, evt)
        self.online[hb.fellow_id] = hb.started_at
        log.info("fellow %s joined", hb.fellow_id)
        await self._tell(evt)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._tick())
            now = self.clock()
            for fellow_id, started_at in list(self.online.items()):
                seen = self._seen_at.get(fellow_id, 0.0)
                if now - seen > self._timeout(self.latest.get(fellow_id)):
                    await self._lost(fellow_id, started_at, seen)

    def _tick(self) -> float:
        bounds = [self._timeout(hb) for hb in self.latest.values()] or [self._timeout(None)]
        return max(0.05, min(bounds) / (4 * MISSED_BEATS))

    async def _lost(self, fellow_id: str, started_at: float, seen: float, reason: str = "",
                    hb: Heartbeat | None = None) -> None:
        hb = hb or self.latest.get(fellow_id)
        evt = FellowLost(id=f"lost-{fellow_id}-{started_at!r}-{hb.seq if hb else 0}",
                         fellow_id=fellow_id, last_seen=seen,
                         reason=reason or f"no heartbeat for {self._timeout(hb):g}s")
        try:
            await publish_event(self.js, evt)
        except Exception:
            log.exception("could not publish the loss of fellow %s", fellow_id)
            return
        self.online.pop(fellow_id, None)
        log.warning("fellow %s lost (last heartbeat %.1fs ago)", fellow_id, self.clock() - seen)
        await self._tell(evt)

    async def _tell(self, evt) -> None:
        for listener in self.listeners:
            try:
                await listener(evt)
            except Exception:
                log.exception("fellow listener failed on %s", evt.type)
