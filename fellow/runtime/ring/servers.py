"""A ring's stage processes: stage 0 serves requests like a one-stage load; later stages run frames."""

from __future__ import annotations

import asyncio
import logging
import time

from events import subjects
from events.loads import LoadFailed, StageReady, StageReplaced
from events.stage import FailedReport, MetricsReport
from events.union import decode_event
from fellow.runtime.engine.serving_loop import ServingLoop
from fellow.runtime.ring.drafts import LastStageDrafter
from fellow.runtime.ring.head import WAKE, RingRunner, ring_engine
from fellow.runtime.ring.inbox import Inbox
from fellow.runtime.ring.link import RingLink
from fellow.runtime.ring.loader import load_ring_stage
from fellow.runtime.ring.session import route_name
from fellow.runtime.ring.sizing import RingSizing, groups_for, size_ring
from fellow.runtime.ring.worker import RingWorker
from fellow.runtime.server.base import StageFailed, StageServerBase, report
from fellow.runtime.server.stage import StageServer

log = logging.getLogger("swarm.ring")

PROBE_TIMEOUT_S = 600.0  # the later stages may still be loading (or fetching their shards)
SETTLE_S = 30.0  # how long stage 0 waits for the hops to choose direct or relay before it serves anyway


class RingHeadServer(StageServer):
    """Stage 0: pulls requests by KV room, tokenizes, runs its blocks, and streams the frames."""

    runner: RingRunner
    link: RingLink | None = None

    def _load(self) -> None:
        self.ring = load_ring_stage(self.cfg.model_dir, 0, self.cfg.num_stages, options=self.cfg.options)
        self.stage, self.device = self.ring.stage, self.ring.device
        self.tokenizer, self.stop_ids = self.ring.tokenizer, self.ring.stop_ids

    def _build(self) -> None:
        t = self.cfg.options
        self.inbox = Inbox()
        self.engine = ring_engine(self.stage, self.ring.sender, lambda frame: self.link.send(frame), self.inbox,
                                  num_stages=self.cfg.num_stages, kv_tokens=self.kv_tokens, max_batch=t.max_batch,
                                  prefill_chunk=t.prefill_chunk, prefix_cache=t.prefix_cache,
                                  route=lambda: self.link.route if self.link is not None else "r",
                                  speculative=t.speculative)
        self.runner = self.engine.runner
        # stage 0's own; the ring's is the smallest of every stage's (a last stage with a draft model says
        # what it holds beside the draft model's positions)
        self.kv_own = self.kv_tokens = self.engine.kv_tokens
        # finished sessions' prefixes keep to the plan's KV, as on every later stage (RingStageServer), even
        # where the ring holds more sessions in flight than the plan did
        self.engine.prefix_limit = self.prefix_tokens()
        self.serving = self.make_loop()

    def make_loop(self) -> ServingLoop:
        # the ring's last stage samples, and holds the request's grammar; a new job wakes the runner's wait
        return ServingLoop(self.engine, self.tokenizer, self.stop_ids, self._deliver, stage=self.cfg.stage,
                           samples_here=False, wake=lambda: self.inbox.put(WAKE))

    async def _start(self) -> None:
        self.link = RingLink(self.nc, self.load_id, 0, self.cfg.num_stages, self.inbox, **self._link_options())
        await self.link.start()
        self.runner.units.max_piece = max(1, (self.link.max_payload - 1024) // self.ring.sender.bytes_per_position)
        await self.nc.subscribe(subjects.event(LoadFailed.__struct_config__.tag), cb=self._on_load_failed)
        self._replacing: dict[int, str] = {}  # later stages being re-placed -> their new fellow; the ring pauses
        for kind in (StageReplaced, StageReady):  # the leader's placement, the new fellow's report (its subject)
            for subject in subjects.event_watch(kind.__struct_config__.tag):
                await self.nc.subscribe(subject, cb=self._on_stage_event)
        started = time.perf_counter()
        try:
            await self.link.probe(PROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            report(FailedReport(reason=f"the ring's later stages did not answer within "
                                       f"{time.perf_counter() - started:.0f}s"))
            raise StageFailed from None
        routes = await self.link.settle(SETTLE_S)  # each hop dialed its next stage, or stays on the relay
        log.info("ring of %d stages answered a probe in %.3fs; hops: %s", self.cfg.num_stages,
                 time.perf_counter() - started, route_name(routes.replace("?", "r")))
        await self._fit_ring()
        if self.cfg.options.step_costs:  # the spec's link-probe, with the other step costs it asks for
            probe = await self.link.link_probe()
            self.stage.note(link_probe=probe)
            log.info("[stage0 link-probe] %d trips round the ring (%s): min %.3f median %.3f max %.3f ms",
                     probe["trips"], route_name(probe["routes"]), probe["min_ms"], probe["median_ms"], probe["max_ms"])
        await super()._start()

    async def _fit_ring(self) -> None:
        """Size the ring from the last probe: with ``in_flight_max``, time probe trips round it and size
        in flight and the decode groups from them and every stage's step (fellow.runtime.ring.sizing);
        then hold it to the KV every stage has room for."""
        t = self.cfg.options
        self.runner.drafts_from(self.link.ring_drafter)
        sizing = None
        if t.in_flight_max:
            transit = await self.link.transit_ms()
            steps = [self.group_ms, *[ms or self.group_ms for ms in self.link.ring_step_ms]]  # 0.0: not measured
            sizing = size_ring(steps, transit, self.per_group, t.in_flight_max)
        self._fit_ring_kv(self.link.ring_kv, sizing)

    def _fit_ring_kv(self, kv: list[int], sizing: RingSizing | None = None) -> None:
        """Hold every session to the KV tokens of the stage that holds fewest (each later stage says its
        own on the probe), and lower the requests in flight (the plan's, or ``sizing``'s) to what that
        leaves room for."""
        t = self.cfg.options
        own = self.kv_own
        smallest = min([own, *kv])
        if smallest < own:
            log.info("[stage0 kv] stage %d holds %d KV tokens, stage 0 %d: the ring admits by %d",
                     1 + kv.index(smallest), smallest, own, smallest)
        wanted = sizing.in_flight if sizing is not None else t.max_in_flight
        planned = max(t.kv_tokens, t.kv_tokens_max, wanted * self.session_tokens()) if t.kv_tokens else smallest
        self.kv_tokens = min(smallest, planned)
        self.engine.resize(self.kv_tokens)
        self.in_flight = self.fitting_in_flight(wanted)
        if self.intake is not None:
            self.intake.max_in_flight = self.in_flight
        if sizing is not None:
            self.runner.units.groups = groups_for(self.in_flight, sizing.per_group, self.cfg.num_stages)
            self.stage.note(ring={**sizing.as_dict(), "in_flight": self.in_flight, "groups": self.runner.units.groups})
            log.info("[stage0 in-flight] steps %s ms at %d rows, links %.2f ms round the ring: %d in flight in %d "
                     "groups%s", " ".join(f"{ms:.2f}" for ms in sizing.step_ms), sizing.per_group,
                     sizing.transit_ms, self.in_flight, self.runner.units.groups,
                     f" (KV room for {self.in_flight} of {sizing.in_flight})"
                     if self.in_flight < sizing.in_flight else "")

    async def _on_load_failed(self, msg) -> None:
        try:
            evt = decode_event(msg.data)
        except Exception as exc:  # not an event, or nested too deep
            log.warning("dropped a message on %s that is not an event: %s", msg.subject, type(exc).__name__)
            return
        if isinstance(evt, LoadFailed) and evt.load_id == self.load_id:
            log.warning("load failed (%s): its requests are the gateway's to move or fail", evt.reason)
            if self.intake is not None:  # before the ring's sessions fail here, so nothing of theirs goes out
                self.intake.let_go()
            self.runner.fail_all(f"the ring serving this model failed: {evt.reason}", evt.code or "ring_failed")

    async def _on_stage_event(self, msg) -> None:
        """A later stage of this ring moved to another fellow: pause until it is ready and a probe has
        gone round the ring again, then the sessions replay (fellow.runtime.ring.head)."""
        try:
            evt = decode_event(msg.data)
        except Exception as exc:
            log.warning("dropped a message on %s that is not an event: %s", msg.subject, type(exc).__name__)
            return
        if getattr(evt, "load_id", None) != self.load_id or getattr(evt, "replica", 0) != self.cfg.replica:
            return
        sender = subjects.event_sender(msg.subject, evt.type)  # "": the leader; else the fellow that sent it
        if isinstance(evt, StageReplaced) and sender == "":
            self._replacing[evt.stage] = evt.fellow_id
            self.runner.pause(f"stage {evt.stage} moves from {evt.lost_fellow_id} to {evt.fellow_id}")
        elif (isinstance(evt, StageReady) and sender in ("", evt.fellow_id)
              and self._replacing.get(evt.stage) == evt.fellow_id):  # only the fellow the leader placed it on
            del self._replacing[evt.stage]
            if not self._replacing:
                await self.link.probe(PROBE_TIMEOUT_S)
                await self._fit_ring()  # the new stage may hold less, step slower, or be farther
                log.info("stage %d is back on %s: the ring resumes", evt.stage, evt.fellow_id)
                self.runner.resume()

    async def _shutdown(self) -> None:
        await super()._shutdown()  # errors the requests in flight
        if self.link is not None:
            await self.link.close()


class RingStageServer(StageServerBase):
    """A middle or last stage: no intake; frames in on its lane, frames out on the next."""

    link: RingLink | None = None

    def _load(self) -> None:
        self.ring = load_ring_stage(self.cfg.model_dir, self.cfg.stage, self.cfg.num_stages, options=self.cfg.options)
        self.stage, self.device = self.ring.stage, self.ring.device
        if self.ring.plan.is_last:  # the ring's draft model drafts here (fellow.runtime.ring.drafts)
            self.tokenizer, self.stop_ids = self.ring.grammar_tokenizer()
            self._load_draft()

    def _build(self) -> None:
        self.inbox = Inbox()
        t = self.cfg.options
        drafter = None
        if self.draft is not None:  # each of its budget's tokens holds a position of both models
            self.kv_tokens = self.draft.budget_tokens(self.kv_tokens)
            drafter = LastStageDrafter(self.draft, self.stop_ids)
        self.worker = RingWorker(self.ring, self.inbox, lambda frame, lane=None: self.link.send(frame, lane),
                                 max_batch=t.max_batch, prefix_tokens=self.prefix_tokens() if t.prefix_cache else 0,
                                 route=lambda: self.link.route if self.link is not None else "r",
                                 kv_tokens=self.kv_tokens, drafter=drafter)

    def compute(self) -> None:
        self.worker.run()

    def stop_compute(self) -> None:
        self.worker.stop()

    def load(self) -> None:
        super().load()
        self.worker.step_ms = self.group_ms  # told to stage 0 on every probe

    async def _start(self) -> None:
        self.link = RingLink(self.nc, self.load_id, self.cfg.stage, self.cfg.num_stages, self.inbox,
                             **self._link_options())
        await self.link.start()

    async def _shutdown(self) -> None:
        if self.link is not None:
            await self.link.close()

    def cache_bytes(self) -> int:
        return sum(h.cache.bytes for h in list(self.worker.held.values()))

    def metrics(self) -> MetricsReport:
        held = list(self.worker.held.values())
        prefix = self.worker.prefix
        return MetricsReport(idle_s=0.0 if held else round(time.monotonic() - self.worker.last_active, 3),
                             vram_bytes=self.vram_bytes(), in_flight=len(held),
                             prefix_cached_tokens=prefix.tokens if prefix is not None else 0)
