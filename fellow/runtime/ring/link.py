"""A stage's side of the relay: its input lane into the inbox, an ordered sender, and lane counts."""

from __future__ import annotations

import asyncio
import logging
import uuid

from nats.aio.client import Client

from core.tasks import cancel_and_wait
from events import subjects
from events.ring import STATS_LANE, LaneStats, Probe, decode_frame, encode_frame, recv_lane, send_lane
from fellow.runtime.ring.inbox import Inbox

log = logging.getLogger(__name__)

STATS_S = 1.0
PROBE_EVERY_S = 0.5


class RingLink:
    """Frames go out in the order the compute thread hands them over, from any thread.

    Every stage connects outbound to NATS, so a ring works behind NAT; NATS is the relay. A frame
    that does not decode is dropped and logged, never passed on: a stranger on the subject cannot
    crash a stage.
    """

    def __init__(self, nc: Client, load_id: str, stage: int, num_stages: int, inbox: Inbox):
        self.nc = nc
        self.load_id = load_id
        self.stage = stage
        self.lane = send_lane(stage, num_stages)
        self.listen = recv_lane(stage, num_stages)
        self.inbox = inbox
        self.max_payload = nc.max_payload
        self.counts: dict[str, list[int]] = {}  # lane -> [bytes, frames] sent
        self.dropped = 0
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._sub = None
        self._probes: dict[str, asyncio.Future] = {}

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._sub = await self.nc.subscribe(subjects.ring(self.load_id, self.listen), cb=self._on_msg)
        self._tasks = [asyncio.create_task(self._send_in_order(), name="ring-sender"),
                       asyncio.create_task(self._publish_stats(), name="ring-stats")]

    async def close(self) -> None:
        await cancel_and_wait(*self._tasks)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass

    def send(self, frame, lane: str | None = None) -> None:
        """Queue a frame on this stage's lane (or ``lane``); safe from the compute thread."""
        data = encode_frame(frame)
        self.loop.call_soon_threadsafe(self._outbox.put_nowait, (lane or self.lane, data))

    async def probe(self, timeout: float) -> None:
        """Stage 0: send a probe round until it comes back (TimeoutError after ``timeout`` s).

        Frames on core NATS reach only who listens now, so a ring serves only once a probe has gone
        all the way round it: every later stage, and the last stage's hop back, are up.
        """
        nonce = uuid.uuid4().hex
        back = self._probes[nonce] = self.loop.create_future()
        deadline = self.loop.time() + timeout
        try:
            while True:
                self.send(Probe(nonce=nonce))
                left = deadline - self.loop.time()
                if left <= 0:
                    raise asyncio.TimeoutError
                try:
                    await asyncio.wait_for(asyncio.shield(back), min(PROBE_EVERY_S, left))
                    return
                except asyncio.TimeoutError:
                    continue
        finally:
            self._probes.pop(nonce, None)

    async def _on_msg(self, msg) -> None:
        try:
            frame = decode_frame(msg.data)
        except Exception as exc:  # not a frame, or nested too deep (RecursionError)
            self.dropped += 1
            log.warning("dropped a malformed frame on %s (%d bytes): %s", msg.subject, len(msg.data), exc)
            return
        if isinstance(frame, Probe) and frame.nonce in self._probes:
            if not self._probes[frame.nonce].done():
                self._probes[frame.nonce].set_result(True)
            return
        if isinstance(frame, LaneStats):
            self.dropped += 1
            log.warning("dropped a stats frame on ring lane %s", msg.subject)
            return
        self.inbox.put(frame)

    async def _send_in_order(self) -> None:
        while True:
            lane, data = await self._outbox.get()
            try:
                await self.nc.publish(subjects.ring(self.load_id, lane), data)
            except Exception:
                log.exception("a frame on %s was not sent", lane)
                continue
            count = self.counts.setdefault(lane, [0, 0])
            count[0] += len(data)
            count[1] += 1

    async def _publish_stats(self) -> None:
        last = None
        while True:
            await asyncio.sleep(STATS_S)
            now = ({k: list(v) for k, v in self.counts.items()}, self.dropped)
            if now == last:
                continue
            last = now
            try:
                stats = LaneStats(stage=self.stage, lanes=now[0], dropped=now[1])
                await self.nc.publish(subjects.ring(self.load_id, STATS_LANE), encode_frame(stats))
            except Exception:
                log.warning("lane stats not published", exc_info=True)
