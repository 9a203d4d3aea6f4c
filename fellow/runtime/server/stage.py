"""A stage that takes requests: a one-stage load here, a ring's stage 0 in fellow.runtime.ring.servers.
It pulls requests from the bus when it has room and publishes their token frames."""

from __future__ import annotations

import time

from events import subjects
from events.stage import MetricsReport
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.scheduler import Scheduler
from fellow.runtime.engine.serving_loop import ServingLoop
from fellow.runtime.model.forms.background_compile import BackgroundCompile
from fellow.runtime.model.forms.plan_steps import background_for
from fellow.runtime.model.load.loader import load_one_stage
from fellow.runtime.server.base import StageServerBase
from fellow.runtime.server.intake import Intake

PREFIX_METRICS = ("prefix_cached_tokens", "prefix_hit_rate")


class StageServer(StageServerBase):
    """The engine steps on the main thread (the serving loop); intake, frames and events on the bus's."""

    engine: Scheduler
    tokenizer: object
    stop_ids: frozenset[int]
    intake: Intake | None = None
    background: BackgroundCompile | None = None  # SWARM_SERVE_COMPILE=auto: the decode step compiling beside it

    def _load(self) -> None:
        loaded = load_one_stage(self.cfg.model_dir, options=self.cfg.options)
        self.stage, self.device = loaded.stage, loaded.device
        self.tokenizer, self.stop_ids = loaded.tokenizer, loaded.stop_ids
        self._load_draft()

    def _build(self) -> None:
        t = self.cfg.options
        self.engine = local_engine(self.stage, kv_tokens=self.kv_tokens, max_batch=t.max_batch,
                             prefill_chunk=t.prefill_chunk, prefix_cache=t.prefix_cache,
                             speculative=t.speculative, draft=self.draft)
        self.kv_tokens = self.engine.kv_tokens  # with a draft model, each token holds a position of both
        self.serving = self.make_loop()
        self.background = background_for(self.stage, t)  # where plan_steps kept the plain weights for it
        if self.background is not None:
            self.serving.between = self.background.poll

    def make_loop(self) -> ServingLoop:
        return ServingLoop(self.engine, self.tokenizer, self.stop_ids, self._deliver, stage=self.cfg.stage)

    def _deliver(self, outputs) -> None:  # on the serving loop's thread
        self.aloop.call_soon_threadsafe(self.intake.deliver, outputs)

    def compute(self) -> None:
        self.serving.run_here()

    def stop_compute(self) -> None:
        self.serving.stop()

    def after_ready(self) -> None:
        if self.background is not None:  # the load is ready: it compiles beside the serving, nobody waits
            self.background.start()

    async def _start(self) -> None:
        self.intake = Intake(self.cfg, self.nc, self.js, self.tokenizer, self.engine, self.serving,
                             max_in_flight=self.in_flight)
        await self.nc.subscribe(subjects.cancels_of(self.load_id), cb=self.intake.on_cancel)

    def stop(self) -> None:
        super().stop()
        if self.intake is not None:
            self.intake.stop()

    async def _serve_bus(self) -> None:
        if not self.stopping.is_set():
            await self.intake.run()

    async def _shutdown(self) -> None:
        if self.intake is not None:
            await self.intake.shutdown()

    def cache_bytes(self) -> int:
        return self.engine.stats()["kv_bytes"]

    def metrics(self) -> MetricsReport:
        intake = self.intake
        idle = 0.0 if intake.active else time.monotonic() - self.serving.last_active
        return MetricsReport(tokens_per_s=intake.metrics.tokens_per_s(), last_ttft_s=intake.metrics.last_ttft_s,
                             requests=intake.metrics.requests, idle_s=round(idle, 3), vram_bytes=self.vram_bytes(),
                             in_flight=len(intake.active), waiting=len(self.engine.waiting),
                             kv_tokens_used=self.engine.budget.reserved,
                             compiled=self.background.status_line() if self.background is not None else "",
                             **{k: v for k, v in self.engine.stats().items() if k in PREFIX_METRICS})
