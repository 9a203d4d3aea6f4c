"""A stage's side of the ring: its input lane into the inbox, an ordered sender, lane counts, and the
direct link to the next stage where one is faster than the relay (fellow.runtime.ring.direct)."""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
import uuid

from nats.aio.client import Client

from core.tasks import cancel_and_wait
from events import subjects
from events.ring import STATS_LANE, Ack, Hop, LaneStats, Ping, Probe, decode_frame, encode_frame, recv_lane, send_lane
from fellow.runtime.ring.direct import PROBE_ROUNDS, DirectIn, DirectOut, Sequencer, dial
from fellow.runtime.ring.inbox import Inbox

log = logging.getLogger(__name__)

STATS_S = 1.0
PROBE_EVERY_S = 0.5
RELAY_MARGIN, RELAY_SLACK_MS = 1.25, 0.2  # a direct link stays unless the relay's median beats it by more
DIAL_GIVE_UP_S = 600.0  # the next stage may still be loading; the hop stays on the relay meanwhile


class RingLink:
    """Frames go out in the order the compute thread hands them over, from any thread.

    Every stage connects outbound to NATS, so a ring works behind NAT; NATS is the relay. A frame
    that does not decode is dropped and logged, never passed on: a stranger on the subject cannot
    crash a stage.

    With ``links="direct"`` the stage also listens on ``host:port`` (0: an ephemeral port) and dials
    the next stage; ``route`` is then "d" while the direct link carries this stage's frames, else "r".
    """

    def __init__(self, nc: Client, load_id: str, stage: int, num_stages: int, inbox: Inbox, *,
                 links: str = "relay", host: str = "127.0.0.1", port: int = 0, advertise: str = "",
                 replica: int = 0):
        if links not in ("direct", "relay"):
            raise ValueError(f"links must be direct or relay, not {links!r}")
        self.nc = nc
        self.load_id = load_id
        self.stage = stage
        self.num_stages = num_stages
        self.replica = replica
        self.prefix = f"r{replica}-" if replica else ""  # a ring replica's lanes: r1-act, r1-tok ...
        self.lane = self.prefix + send_lane(stage, num_stages)
        self.listen = self.prefix + recv_lane(stage, num_stages)
        self.inbox = inbox
        self.links, self.host, self.port = links, host, port
        self.advertise = advertise  # the address the predecessor dials, where it differs from host:port
        self.max_payload = nc.max_payload
        self.route = "?" if links == "direct" else "r"  # "?": still dialing the next stage
        self.address: tuple[str, int] | None = None  # where this stage listens, once it does
        self.probe_ms: dict[str, float] | None = None  # the link probe's medians, direct and relay
        self.ring_kv: list[int] = []  # stage 0: each later stage's KV tokens, from the last probe round
        self.ring_step_ms: list[float] = []  # stage 0: each later stage's decode step (0.0: not measured)
        self.ring_drafter = ""  # stage 0: the last stage's draft model, where it has one
        self.ring_routes = ""  # stage 0: how each hop sent the last probe ("d" direct, "r" relay)
        self.fallbacks = 0
        self._epoch = random.getrandbits(62)
        self._seq = 0
        self._direct: DirectOut | None = None
        self._direct_in: DirectIn | None = None
        self._sequencer = Sequencer()
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
                       asyncio.create_task(self._publish_stats(), name="ring-stats"),
                       asyncio.create_task(self._overdue(), name="ring-gaps")]
        self._where = await self.nc.subscribe(subjects.ring(self.load_id, f"{self.prefix}where{self.stage}"),
                                              cb=self._on_where)
        if self.links == "direct":
            predecessor = (self.stage - 1) % self.num_stages
            self._direct_in = DirectIn(self.load_id, predecessor, self._on_hop, self.max_payload + 1024)
            self.address = await self._direct_in.start(self.host, self.port)
            self._tasks.append(asyncio.create_task(self._dial_next(), name="ring-dial"))

    async def close(self) -> None:
        await cancel_and_wait(*self._tasks)
        if self._direct is not None:
            self._direct.close()
        if self._direct_in is not None:
            await self._direct_in.close()
        for sub in (self._sub, getattr(self, "_where", None)):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass

    def send(self, frame, lane: str | None = None) -> None:
        """Queue a frame on this stage's lane (or ``lane``); safe from the compute thread."""
        data = encode_frame(frame)
        self.loop.call_soon_threadsafe(self._outbox.put_nowait, (self.prefix + lane if lane else self.lane, data))

    async def settle(self, timeout: float) -> str:
        """Stage 0: probe rounds until every hop has chosen its route (or ``timeout`` s); the routes."""
        deadline = self.loop.time() + timeout
        while True:
            routes = await self.probe(timeout)
            if "?" not in routes or self.loop.time() > deadline:
                return routes
            await asyncio.sleep(0.1)

    async def probe(self, timeout: float) -> str:
        """Stage 0: send a probe round until it comes back (TimeoutError after ``timeout`` s); how each
        hop sent it.

        Frames on core NATS reach only who listens now, so a ring serves only once a probe has gone
        all the way round it: every later stage, and the last stage's hop back, are up.
        """
        nonce = uuid.uuid4().hex
        back = self._probes[nonce] = self.loop.create_future()
        deadline = self.loop.time() + timeout
        try:
            while True:
                self.send(Probe(nonce=nonce, routes=self.route))
                left = deadline - self.loop.time()
                if left <= 0:
                    raise asyncio.TimeoutError
                try:
                    probe = await asyncio.wait_for(asyncio.shield(back), min(PROBE_EVERY_S, left))
                except asyncio.TimeoutError:
                    continue
                self.ring_kv = list(probe.kv)
                self.ring_step_ms = list(probe.step_ms)
                self.ring_drafter = probe.drafter
                self.ring_routes = probe.routes
                return probe.routes
        finally:
            self._probes.pop(nonce, None)

    async def transit_ms(self, rounds: int = 5, timeout: float = 30.0) -> float:
        """Stage 0: the median of ``rounds`` probe trips round the ring, in ms: every hop's one-way delay
        by the route it takes now, plus each stage's handling, with no compute on the way."""
        return statistics.median(await self.trips_ms(rounds, timeout))

    async def trips_ms(self, rounds: int, timeout: float = 30.0) -> list[float]:
        """Stage 0: ``rounds`` probe trips round the ring, each in ms."""
        trips = []
        for _ in range(rounds):
            started = time.perf_counter()
            await self.probe(timeout)
            trips.append((time.perf_counter() - started) * 1e3)
        return trips

    async def link_probe(self, rounds: int = 10) -> dict:
        """Stage 0, the spec's ``[stage0 link-probe]``: ``rounds`` round trips of the frames' path without
        compute (round the ring: on two stages, to the stage it dials and back), by the routes they take now."""
        trips = sorted(await self.trips_ms(rounds))
        return {"trips": rounds, "min_ms": round(trips[0], 3), "median_ms": round(statistics.median(trips), 3),
                "max_ms": round(trips[-1], 3), "routes": self.ring_routes}

    async def _on_msg(self, msg) -> None:
        try:
            frame = decode_frame(msg.data)
        except Exception as exc:  # not a frame, or nested too deep (RecursionError)
            self.dropped += 1
            log.warning("dropped a malformed frame on %s (%d bytes): %s", msg.subject, len(msg.data), exc)
            return
        if isinstance(frame, Hop):
            self._on_hop(frame)
        else:
            self._take(frame, msg.subject)

    def _on_hop(self, hop: Hop) -> None:
        """A numbered frame from the stage before, by either route: in order, each once."""
        try:
            frame = decode_frame(hop.data)
        except Exception as exc:
            self.dropped += 1
            log.warning("dropped a malformed frame inside hop #%d: %s", hop.seq, exc)
            frame = None
        for ready in self._sequencer.accept(hop.epoch, hop.seq, frame):
            if ready is not None:
                self._take(ready, self.listen)

    async def _overdue(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for ready in self._sequencer.overdue(time.monotonic()):
                if ready is not None:
                    self._take(ready, self.listen)

    def _take(self, frame, subject: str) -> None:
        if isinstance(frame, (Hop, Ack, Ping)):
            self.dropped += 1
            log.warning("dropped a link frame inside a hop on %s", subject)
            return
        if isinstance(frame, Probe) and frame.nonce in self._probes:
            if not self._probes[frame.nonce].done():
                self._probes[frame.nonce].set_result(frame)
            return
        if isinstance(frame, LaneStats):
            self.dropped += 1
            log.warning("dropped a stats frame on ring lane %s", subject)
            return
        self.inbox.put(frame)

    async def _send_in_order(self) -> None:
        while True:
            lane, data = await self._outbox.get()
            if lane == self.lane:  # our own lane: numbered, direct where the link is up
                self._seq += 1
                data = encode_frame(Hop(epoch=self._epoch, seq=self._seq, data=data))
                if self._direct is not None:
                    try:
                        self._direct.write(self._seq, data)
                        self._count(lane, data)  # the hop's traffic, by either route
                        continue
                    except Exception as exc:
                        await self._fall_back(f"{type(exc).__name__}: {exc}")
            try:
                await self.nc.publish(subjects.ring(self.load_id, lane), data)
            except Exception:
                log.exception("a frame on %s was not sent", lane)
                continue
            self._count(lane, data)

    def _count(self, lane: str, data: bytes) -> None:
        count = self.counts.setdefault(lane, [0, 0])
        count[0] += len(data)
        count[1] += 1

    # --- the direct link to the next stage ---------------------------------------------------------

    async def _on_where(self, msg) -> None:
        """The predecessor asks where to dial (or times the relay's round trip): this stage's address."""
        if msg.reply:
            address = self.advertise or (f"{self.address[0]}:{self.address[1]}" if self.address else "")
            await self.nc.publish(msg.reply, address.encode())

    async def _dial_next(self) -> None:
        """Find the next stage's port over the relay, dial it, probe both routes, keep the faster."""
        nxt = (self.stage + 1) % self.num_stages
        subject = subjects.ring(self.load_id, f"{self.prefix}where{nxt}")
        deadline = time.monotonic() + DIAL_GIVE_UP_S
        address = ""
        while not address:
            try:
                address = (await self.nc.request(subject, b"", timeout=1.0)).data.decode()
            except Exception:
                if time.monotonic() > deadline:
                    log.warning("[stage%d link-probe] stage %d never answered where it listens: relay", self.stage, nxt)
                    self.route = "r"
                    return
                await asyncio.sleep(0.2)
                continue
            if not address:  # it relays only
                log.info("[stage%d link-probe] stage %d takes no direct link: relay", self.stage, nxt)
                self.route = "r"
                return
        host, _, port = address.rpartition(":")
        try:
            out = await dial(host, int(port), self.load_id, self.stage, self.max_payload + 1024)
        except Exception as exc:
            log.warning("[stage%d link-probe] dialing stage %d at %s failed (%s: %s): relay", self.stage, nxt,
                        address, type(exc).__name__, exc)
            self.route = "r"
            return
        acks = asyncio.create_task(out.run_acks(), name="ring-acks")
        try:
            direct, relay = [], []
            for i in range(PROBE_ROUNDS):
                direct.append(await out.round_trip(i, 5.0) * 1e3)
                started = time.perf_counter()
                await self.nc.request(subject, b"", timeout=5.0)
                relay.append((time.perf_counter() - started) * 1e3)
        except Exception as exc:
            acks.cancel()
            out.close()
            log.warning("[stage%d link-probe] probing stage %d failed (%s): relay", self.stage, nxt, exc)
            self.route = "r"
            return
        self.probe_ms = {"direct": round(statistics.median(direct), 3), "relay": round(statistics.median(relay), 3)}
        # the relay only where it is clearly faster: on one host the two are close, and a busy core's jitter
        # in ten round trips would otherwise send a ring through nats-server by chance
        faster = self.probe_ms["direct"] <= self.probe_ms["relay"] * RELAY_MARGIN + RELAY_SLACK_MS
        log.info("[stage%d link-probe] to stage %d at %s: direct %.3f ms (min %.3f, max %.3f), relay %.3f ms, "
                 "%d round trips each: %s", self.stage, nxt, address, self.probe_ms["direct"], min(direct), max(direct),
                 self.probe_ms["relay"], PROBE_ROUNDS, "direct" if faster else "relay (slower direct)")
        if not faster:
            acks.cancel()
            out.close()
            self.route = "r"
            return
        self._direct, self.route = out, "d"
        self._tasks.append(asyncio.create_task(self._watch(out, acks), name="ring-link-watch"))

    async def _watch(self, out: DirectOut, acks: asyncio.Task) -> None:
        try:
            await acks
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._direct is out:
                await self._fall_back(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

    async def _fall_back(self, why: str) -> None:
        """The direct link broke: whatever it did not ack goes again over the relay, and so does the rest."""
        out, self._direct, self.route = self._direct, None, "r"
        if out is None:
            return
        self.fallbacks += 1
        out.close()
        log.warning("[stage%d link] the direct link to stage %d broke (%s): %d unacked frame(s) go again over "
                    "the relay, and the hop stays there", self.stage, (self.stage + 1) % self.num_stages, why,
                    len(out.unacked))
        for _, data in list(out.unacked):
            await self.nc.publish(subjects.ring(self.load_id, self.lane), data)
            self._count(self.lane, data)

    async def _publish_stats(self) -> None:
        last = None
        while True:
            await asyncio.sleep(STATS_S)
            now = ({k: list(v) for k, v in self.counts.items()}, self.dropped)
            if now == last:
                continue
            last = now
            try:
                stats = LaneStats(stage=self.stage, lanes=now[0], dropped=now[1], replica=self.replica)
                await self.nc.publish(subjects.ring(self.load_id, STATS_LANE), encode_frame(stats))
            except Exception:
                log.warning("lane stats not published", exc_info=True)
