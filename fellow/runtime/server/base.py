"""What every stage process does, once for a local stage and a ring's stages: load and warm up, connect,
report to its agent, and stop on a signal; it exits non-zero when its bus side dies."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time

import torch

from core.bus import close_quietly, connect
from core.settings import NatsSettings
from core.tasks import cancel_and_wait
from events.stage import MetricsReport, ReadyReport, Report, StageConfig, StageOptions, encode
from fellow.runtime.engine.draft_model import DraftModel, load_draft_model
from fellow.runtime.model.load.kernels import lora_costs, step_costs
from fellow.runtime.model.load.kv_budget import held_tokens, measured_kv_tokens
from fellow.runtime.model.load.step_report import measure
from fellow.runtime.model.quant.report import stage_weights
from fellow.runtime.model.recurrent import recurrent_reason
from fellow.runtime.model.stage import StageModel

log = logging.getLogger("swarm.serve")


class CannotServe(Exception):
    """The stage cannot serve what placement planned; the reason names it."""


class StageFailed(Exception):
    """The stage cannot serve; it reported why (a FailedReport) and exits with 1."""


def report(msg: Report) -> None:
    """One JSON line to the agent, on the process's own stdout (a compile on another thread sends what
    inductor prints to stderr for its while, ``compiled._quiet_compile``)."""
    sys.__stdout__.buffer.write(encode(msg) + b"\n")
    sys.__stdout__.flush()


def kv_budget(stage: StageModel, options: StageOptions, planned: int | None = None,
              memory_limit: int = 0, keep_bytes: int = 0) -> tuple[int, int]:
    """(held, planned): what the stage measures it holds (kv_budget.held_tokens: grown past placement's
    plan, ``planned`` where the stage plans more itself, up to its ``kv_tokens_max``). A stage with
    recurrent layers keeps the states of as many sessions as may be in flight free first
    (kv_budget.session_state_bytes). ``memory_limit``: a CPU stage's limit, where its caller sets one.
    The stage's ``kernels.kv`` says what it measured, planned and holds, for its status."""
    measured = measured_kv_tokens(stage, options.prefill_chunk or 256,
                                  sessions=max(options.max_in_flight, options.in_flight_max),
                                  memory_limit=memory_limit, keep_bytes=keep_bytes)
    planned = options.kv_tokens if planned is None else planned
    held = held_tokens(measured, planned, options.kv_tokens_max)
    stage.note(kv={"measured": measured, "planned": planned, "most": options.kv_tokens_max, "held": held})
    if planned and held < planned:
        log.info("KV budget %d tokens, lower than the %d planned: that is what the devices hold", held, planned)
    return held, (planned or measured)


@torch.inference_mode()
def warm_up(stage: StageModel) -> None:
    """One piece and one decode position, so the first request pays no one-off start-up costs."""
    cache = stage.new_cache()
    if stage.is_first:
        stage.forward_piece(cache, torch.tensor([1, 2, 3, 4], device=stage.input_device))
        stage.decode([cache], torch.tensor([5], device=stage.input_device))
    else:
        hidden = torch.zeros(1, 4, stage.config.hidden_size, dtype=stage.dtype, device=stage.input_device)
        stage.forward_piece(cache, hidden)
        stage.decode([cache], hidden[:, :1])
    cache.release()


class StageServerBase:
    """One stage process: ``load()``, then ``serve()`` until SIGTERM or SIGINT.

    Compute keeps the main thread and the bus runs on an event loop in another: torch's CPU kernels
    ran a batch-8 decode about 25 % slower called from a second thread than from the main one
    (bench/bench_serving.py's model, 2 cores). A subclass loads its model (``_load``), builds what
    computes (``_build``), runs it (``compute``, ``stop_compute``), and serves the bus (``_start``,
    ``_serve_bus``, ``_shutdown``).
    """

    stage: StageModel
    device: torch.device
    draft: DraftModel | None = None  # the draft model, on a drafting load's last stage

    def _link_options(self) -> dict:
        """A ring stage's link settings (fellow.runtime.ring.link.RingLink)."""
        o = self.cfg.options
        return {"links": o.links, "host": o.link_host, "port": o.link_port, "replica": self.cfg.replica}

    def __init__(self, cfg: StageConfig):
        self.cfg = cfg
        self.load_id = cfg.load_id
        self.stopping = asyncio.Event()
        self.failed = False
        self._tasks: set[asyncio.Task] = set()

    # --- what a subclass gives -----------------------------------------------------------------

    def _load(self) -> None:
        """Load the model: set ``stage`` and ``device``."""
        raise NotImplementedError

    def _build(self) -> None:
        """Build what computes, with ``kv_tokens`` known."""

    def _load_draft(self) -> None:
        """The draft model (SWARM_SERVE_DRAFT_MODEL) on a drafting load's last stage (a one-stage load's only one):
        never beside a model with recurrent layers, which does not draft (fellow.runtime.model.recurrent)."""
        if self.cfg.options.draft_model_dir and self.cfg.options.speculative and recurrent_reason(self.stage.config):
            log.info("[stage%d draft] no draft model: %s", self.cfg.stage, recurrent_reason(self.stage.config))
        elif self.cfg.options.draft_model_dir and self.cfg.options.speculative:
            self.draft = load_draft_model(self.cfg.options.draft_model_dir, self.stage, self.tokenizer, self.device,
                                          packed=self.cfg.options.packed_linear, batch_cap=self.batch_cap)
            warm_up(self.draft.stage)
            self.stage.note(draft_decoder=self.draft.decoder_label, draft_upcast=self.draft.upcast or None)
            log.info("[stage%d draft] %s drafts here: %d bytes a position (%.3f of the "
                     "served model's), steps %s", self.cfg.stage, self.draft.name, self.draft.position_bytes,
                     self.draft.ratio, self.draft.decoder_label)

    def after_ready(self) -> None:
        """Right after the ready report (the bus thread): what may start once the load is ready."""

    def compute(self) -> None:
        """Compute on this, the main, thread until ``stop_compute``."""
        raise NotImplementedError

    def stop_compute(self) -> None:
        raise NotImplementedError

    async def _start(self) -> None:
        """Connected, not ready yet."""

    async def _serve_bus(self) -> None:
        await self.stopping.wait()

    async def _shutdown(self) -> None:
        """Stopping: before the bus connection closes."""

    def metrics(self) -> MetricsReport:
        raise NotImplementedError

    def cache_bytes(self) -> int:
        raise NotImplementedError

    # --- the shared part -----------------------------------------------------------------------

    def session_tokens(self) -> int:
        """The KV tokens placement planned for each request in flight: a stage that cannot hold that
        many cannot hold one session."""
        t = self.cfg.options
        return t.kv_tokens // max(1, t.max_in_flight) if t.kv_tokens else 1

    def fitting_in_flight(self, wanted: int | None = None) -> int:
        """The planned requests in flight (or ``wanted``), lowered until each has its planned share of
        ``kv_tokens``."""
        t = self.cfg.options
        wanted = t.max_in_flight if wanted is None else wanted
        return max(1, min(max(1, wanted), self.kv_tokens // self.session_tokens()))

    def planned_kv(self) -> int:
        """The KV tokens placement planned; for a ring whose stage 0 may raise its in flight
        (``in_flight_max``), enough for that many planned shares, so the raise is not refused here."""
        t = self.cfg.options
        if t.in_flight_max and t.kv_tokens:
            return max(t.kv_tokens, t.in_flight_max * self.session_tokens())
        return t.kv_tokens

    def prefix_tokens(self) -> int:
        """The KV tokens a stage keeps for finished sessions' prefixes and the sessions in flight together:
        what it holds, at most what placement planned. A ring stage that plans room for more sessions in
        flight (``planned_kv``) keeps no more finished prefixes for it, so every stage of a ring keeps to the
        same plan, and none holds memory the leader did not plan for past its sessions' own."""
        t = self.cfg.options
        return min(self.kv_tokens, t.kv_tokens) if t.kv_tokens else self.kv_tokens

    @property
    def per_group(self) -> int:
        """A ring's sessions per decode group: the planned in flight over its stages (at most the batch cap)."""
        t = self.cfg.options
        rows = max(1, t.max_in_flight // max(1, self.cfg.num_stages))
        return min(rows, t.max_batch) if t.max_batch > 0 else rows

    @property
    def batch_cap(self) -> int:
        """The most sessions one decode step runs: the batch cap, else everything in flight."""
        t = self.cfg.options
        return t.max_batch if t.max_batch > 0 else max(1, t.max_in_flight)

    def load(self) -> None:
        started = time.perf_counter()
        self._load()
        warm_up(self.stage)  # before measuring: what the first forwards leave cached counts as taken
        # a decode step still to compile in the background (model.background_compile) will hold about its
        # weights again: kept out of the KV budget now
        compiling = stage_weights(self.stage)[0] if self.stage.plain_weights is not None else 0
        self.kv_tokens, self.kv_planned = kv_budget(self.stage, self.cfg.options, self.planned_kv(),
                                                    keep_bytes=compiling)
        session = self.session_tokens()
        if self.kv_tokens < session:
            raise CannotServe(f"stage {self.cfg.stage} on fellow {self.cfg.fellow_id} holds {self.kv_tokens} KV "
                              f"tokens, less than one session ({session} planned a request)")
        self.in_flight = self.fitting_in_flight()
        self._build()
        if self.cfg.options.step_costs:
            costs = step_costs(self.stage, sorted({1, self.batch_cap}))
            self.stage.note(step_ms=costs)
            log.info("[stage%d step-costs] path=%s decode step %s", self.cfg.stage, self.stage.kernels.path,
                     " ".join(f"batch {rows}: {ms:.2f} ms" for rows, ms in costs.items()))
            if (lora := lora_costs(self.stage)) is not None:  # adapters kept apart: what they cost a step
                self.stage.note(lora={**self.stage.kernels.lora, "step_ms": lora})
                log.info("[stage%d lora-cost] %s", self.cfg.stage, " ".join(f"{k}={v:.2f}" for k, v in lora.items()))
            self.stage.note(step_costs=measure(self.stage, self.cfg.stage, self.cfg.options.step_profile))
        self.group_ms = 0.0  # a ring stage's decode step at a group's rows: stage 0 sizes in flight by it
        if self.cfg.options.in_flight_max:
            self.group_ms = step_costs(self.stage, [self.per_group])[str(self.per_group)]
        self.load_s = time.perf_counter() - started

    def vram_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return stage_weights(self.stage)[0] + self.cache_bytes()

    def serve(self) -> int:
        """Serve until stopped; the exit code: 0 after a clean stop, 1 when the bus side failed."""
        self.aloop = asyncio.new_event_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.aloop.call_soon_threadsafe(self.stop))
        bus = threading.Thread(target=self._bus, name="bus", daemon=True)
        bus.start()
        self.compute()  # until _bus stops it
        bus.join(30)
        return 1 if self.failed else 0

    def stop(self) -> None:
        self.stopping.set()

    def spawn(self, coro, name: str) -> asyncio.Task:
        """A task of the bus loop, cancelled at shutdown."""
        task = self.aloop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _bus(self) -> None:
        try:
            self.aloop.run_until_complete(self._run())
        except StageFailed:
            self.failed = True
        except BaseException:
            log.exception("the stage's bus loop failed")
            self.failed = True
        finally:
            self.stop_compute()

    async def _run(self) -> None:
        self.nc = await connect(self.cfg.nats_url, name=f"swarm-stage{self.cfg.stage}-{self.load_id}",
                                credentials=NatsSettings.from_env(lenient=True).credentials)  # its fellow's, in its env
        self.js = self.nc.jetstream()
        try:
            await self._start()
            report(ReadyReport(kv_tokens=self.kv_tokens, kv_tokens_planned=self.kv_planned,
                               max_in_flight=self.in_flight, vram_bytes=self.vram_bytes(),
                               load_s=round(self.load_s, 3), kernels=self.stage.kernels,
                               weights=self.stage.weights))
            self.after_ready()
            self.spawn(self._report_metrics(), "metrics")
            await self._serve_bus()
        finally:
            try:
                await self._shutdown()
            finally:
                await cancel_and_wait(*self._tasks)
                await close_quietly(self.nc)

    async def _report_metrics(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.report_s)
            try:
                report(self.metrics())
            except Exception:
                log.exception("metrics not reported")
