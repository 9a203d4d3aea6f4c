"""The fellow's model manager: load and unload stage processes, eviction, the idle reaper, stop paths."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tarfile
import time

from core.bus import publish_event
from core.quantization import QuantizationError, method_of
from core.servable import ServableError
from core.settings import Settings
from events.commands import LoadStage, StopFellow, UnloadStage, UpdateFellow
from events.fellow import LoadedModel
from events.loads import (
    STAGE_RESTARTING,
    LoadFailed,
    ModelUnloaded,
    ReplicaLost,
    StageReady,
    TransportPlan,
    load_failed_id,
    replica_lost_id,
    replica_part,
    stage_restart_id,
)
from events.stage import FailedReport, MetricsReport, ReadyReport, StageConfig, StageOptions, StageReport
from fellow.base_fetch import ensure_base
from fellow.fetch import FetchError, draft_model_dir, fetch_model, local_model_dir
from fellow.stage_process import StageProcess

log = logging.getLogger(__name__)

RESTART_WINDOW_S = 60.0  # a load's stage is restarted at most once in this long


def stage_options(settings: Settings, cmd: LoadStage, draft_dir: str = "") -> StageOptions:
    """How a stage of ``cmd`` serves, built once here and sent whole to its process: this fellow's serving
    settings of the same names, under what placement planned (``cmd.transport``); where the plan left a
    choice open (0, off) the fellow's own stands, and a one-stage load cuts prompts into the fellow's own
    pieces and holds its own number of requests where it set them; a ring's stage 0 takes the lower of the
    plan's and its own (``ring_head_bounds``), its later stages the plan's, which they reserve memory for.
    A drafting load's last stage drafts with ``draft_dir`` (the leader's draft model, transport.draft_model,
    found or fetched here: ``ModelManager._draft_dir``), else with this fellow's own SWARM_SERVE_DRAFT_MODEL.
    QuantizationError where no load serves the plan's quantization, FileNotFoundError where the fellow's
    draft model is not there."""
    t, serving = cmd.transport, settings.serving
    speculative = t.speculative or serving.speculative  # rings draft on stage 0
    last = cmd.assignment.stage == cmd.num_stages - 1  # a ring's draft model drafts on its last stage
    if speculative and last and not draft_dir and not t.draft_asked and serving.draft_model not in ("", "auto"):
        draft_dir = str(draft_model_dir(settings))  # the fellow's own ("auto" is the leader's to resolve)
    own = {name: getattr(serving, name) for name in StageOptions.__struct_fields__ if hasattr(serving, name)}
    ring = cmd.num_stages > 1
    chunk = t.prefill_chunk if serving.prefill_chunk is None or ring else serving.prefill_chunk
    in_flight = t.max_in_flight if serving.max_in_flight is None or ring else serving.max_in_flight
    ceiling = t.in_flight_max if ring else 0
    if ring and cmd.assignment.stage == 0:
        in_flight, ceiling, chunk, _ = ring_head_bounds(serving, t)
    return StageOptions(**{**own, "max_in_flight": in_flight, "kv_tokens": t.kv_tokens,
                           "max_batch": t.max_batch or (serving.max_batch or 0), "prefill_chunk": chunk,
                           "step_costs": t.step_costs or serving.step_costs != "off",
                           "step_profile": t.step_profile or serving.step_costs == "profile",
                           "speculative": speculative,
                           "kv_tokens_max": t.kv_tokens_max,
                           "in_flight_max": ceiling,
                           "quantization": method_of(cmd.quantization),
                           "draft_model_dir": draft_dir if speculative and last else ""})


def ring_head_bounds(serving, t: TransportPlan) -> tuple[int, int, int, list[str]]:
    """(in flight, its ceiling, prompt piece, why each differs from the plan) for stage 0 of a ring: its
    fellow's SWARM_SERVE_MAX_IN_FLIGHT and SWARM_SERVE_PREFILL_CHUNK bound its intake and its pieces, the
    lower of the plan's and the fellow's (a piece of 0, the whole prompt, is the longest); fewer in flight
    than planned stay fixed. Where the plan lets stage 0 size the ring (``in_flight_max``) a fellow's own
    above the plan is the ceiling instead: it asks for more than four a stage. The later stages keep the
    plan's, which they reserve memory for."""
    in_flight, ceiling, chunk, why = t.max_in_flight, t.in_flight_max, t.prefill_chunk, []
    if (own := serving.max_in_flight) is not None:
        in_flight = min(in_flight, own)
        ceiling = 0 if own < t.max_in_flight else own if ceiling else 0
        if own < t.max_in_flight:
            why.append(f"max_in_flight {own}, not the plan's {t.max_in_flight}: SWARM_SERVE_MAX_IN_FLIGHT={own} "
                       f"on stage 0's fellow")
        elif ceiling > t.in_flight_max:
            why.append(f"in flight sized up to {own}, past the plan's {t.in_flight_max}: SWARM_SERVE_MAX_IN_FLIGHT="
                       f"{own} on stage 0's fellow")
    if (own := serving.prefill_chunk) is not None and own and (not chunk or own < chunk):
        chunk = own
        why.append(f"prefill_chunk {own}, not the plan's {t.prefill_chunk or 'whole prompt'}: "
                   f"SWARM_SERVE_PREFILL_CHUNK={own} on stage 0's fellow")
    return in_flight, ceiling, chunk, why


class ModelManager:
    """Owns every serving subprocess of this fellow; no path that ends the fellow leaves one behind."""

    def __init__(self, agent):
        self.agent = agent
        self.settings = agent.settings
        self.procs: dict[str, StageProcess] = {}  # load_id -> process, oldest first
        self._reaper: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._restarted: dict[str, float] = {}  # load_id -> when its stage was last restarted
        self._bounds: dict[str, list[str]] = {}  # load_id -> where this fellow's own settings bounded its plan
        agent.handlers.update({LoadStage: self.on_load, UnloadStage: self.on_unload,
                               StopFellow: self.on_stop, UpdateFellow: self.on_update})
        agent.loaded_models = self.loaded_models
        agent.on_stop.append(self.stop_all)

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_idle(), name="idle-reaper")

    def loaded_models(self) -> list[LoadedModel]:
        out = []
        for p in self.procs.values():
            m, ready = p.metrics or MetricsReport(), p.ready
            out.append(LoadedModel(
                load_id=p.load_id, model_id=p.model_id, stage=p.stage, replica=p.replica, pid=p.pid, state=p.state,
                tokens_per_s=m.tokens_per_s, last_ttft_s=m.last_ttft_s, requests=m.requests, idle_s=m.idle_s,
                vram_bytes=m.vram_bytes or (ready.vram_bytes if ready else 0), in_flight=m.in_flight,
                waiting=m.waiting, kv_tokens=ready.kv_tokens if ready else 0, kv_tokens_used=m.kv_tokens_used,
                kv_tokens_planned=ready.kv_tokens_planned if ready else 0,
                prefix_cached_tokens=m.prefix_cached_tokens, prefix_hit_rate=m.prefix_hit_rate, compiled=m.compiled))
        return out

    async def on_load(self, cmd: LoadStage) -> None:
        async with self._lock:
            if cmd.load_id in self.procs:
                return
            model_dir = local_model_dir(self.settings, cmd.model_id, cmd.model_path, cmd.manifest_sha256)
            if model_dir is None:
                try:
                    model_dir = await asyncio.to_thread(fetch_model, self.settings, cmd.model_id, cmd.manifest_sha256)
                except (FetchError, OSError, tarfile.TarError) as exc:
                    await self._fail(cmd.load_id, cmd.model_id, f"servable not on this fellow and not fetched: {exc}",
                                     replica=cmd.assignment.replica, replicas=cmd.replicas)
                    return
            try:  # an adapters export needs its base here too
                await asyncio.to_thread(ensure_base, self.settings, cmd.model_id, model_dir,
                                        stage=cmd.assignment.stage, num_stages=cmd.num_stages)
            except (FetchError, ServableError, OSError, tarfile.TarError) as exc:
                await self._fail(cmd.load_id, cmd.model_id,
                                 f"base checkpoint not on this fellow and not fetched: {exc}",
                                 replica=cmd.assignment.replica, replicas=cmd.replicas)
                return
            while len(self.procs) >= self.settings.fellow.max_loaded_models:
                oldest = next(iter(self.procs.values()))
                log.info("evicting %s (%s) to load %s", oldest.model_id, oldest.load_id, cmd.model_id)
                await self._stop(oldest, "evicted")
            try:
                draft_dir = await self._draft_dir(cmd)
            except (FetchError, OSError, tarfile.TarError) as exc:
                await self._fail(cmd.load_id, cmd.model_id, f"draft model {cmd.transport.draft_model} not on this "
                                 f"fellow and not fetched: {exc}", cmd.assignment.replica, cmd.replicas)
                return
            try:
                options = stage_options(self.settings, cmd, draft_dir)
            except (QuantizationError, FileNotFoundError) as exc:
                await self._fail(cmd.load_id, cmd.model_id, str(exc), cmd.assignment.replica, cmd.replicas)
                return
            head = cmd.num_stages > 1 and cmd.assignment.stage == 0
            self._bounds[cmd.load_id] = ring_head_bounds(self.settings.serving, cmd.transport)[3] if head else []
            cfg = StageConfig(load_id=cmd.load_id, model_id=cmd.model_id, model_dir=str(model_dir),
                              nats_url=self.settings.nats.url or "nats://127.0.0.1:4222",
                              fellow_id=self.agent.fellow_id, stage=cmd.assignment.stage, num_stages=cmd.num_stages,
                              replica=cmd.assignment.replica, replicas=cmd.replicas,
                              options=options,
                              report_s=min(1.0, self.settings.fellow.heartbeat_s))
            logs = self.settings.data_dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            creds = self.settings.nats.credentials  # the stage logs in to NATS as its fellow
            env = {**os.environ, **creds.env()} if creds else None
            if self.settings.serving.compile != () and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
                # inductor's cache under the data dir: a model compiled once compiles again from it
                env = {**(env or os.environ), "TORCHINDUCTOR_CACHE_DIR": str(self.settings.data_dir / "inductor")}
            proc = StageProcess(cfg, self._on_report, self._on_exit,
                                log_path=logs / f"{cmd.load_id}-stage{cmd.assignment.stage}.log", env=env)
            self.procs[cmd.load_id] = proc
            try:
                await proc.start()
            except Exception as exc:  # nothing started: no entry left behind, and the leader hears of it
                self.procs.pop(cmd.load_id, None)
                await self._fail(cmd.load_id, cmd.model_id, f"the stage process did not start: {exc}",
                                 cmd.assignment.replica, cmd.replicas)
                raise
            log.info("loading %s as %s (pid %d)", cmd.model_id, cmd.load_id, proc.pid)

    async def _draft_dir(self, cmd: LoadStage) -> str:
        """The folder of the draft model the leader named for a drafting load's last stage (transport.draft_model):
        where the leader has it or this fellow's cache does, else fetched from the leader; "" for other stages."""
        t = cmd.transport
        if not (t.draft_model and (t.speculative or self.settings.serving.speculative)
                and cmd.assignment.stage == cmd.num_stages - 1):
            return ""
        found = local_model_dir(self.settings, t.draft_model, cmd.draft_path, cmd.draft_sha256)
        if found is None:
            found = await asyncio.to_thread(fetch_model, self.settings, t.draft_model, cmd.draft_sha256)
        return str(found)

    async def _on_report(self, proc: StageProcess, report: StageReport) -> None:
        if isinstance(report, ReadyReport):
            await publish_event(self.agent.js, StageReady(
                # the fellow in the id: a ring stage re-placed on another fellow is ready anew (StageReplaced)
                id=stage_restart_id(f"ready-{proc.load_id}-{proc.stage}{replica_part(proc.replica)}"
                                    f"-{self.agent.fellow_id}", proc.restarts),
                load_id=proc.load_id,
                stage=proc.stage, replica=proc.replica, fellow_id=self.agent.fellow_id, pid=proc.pid,
                kv_tokens=report.kv_tokens, kv_tokens_planned=report.kv_tokens_planned,
                max_in_flight=report.max_in_flight, vram_bytes=report.vram_bytes, load_s=report.load_s,
                kernels=report.kernels, weights=report.weights, bounds=self._bounds.get(proc.load_id, [])))
            await self.agent.beat()
        elif isinstance(report, FailedReport):
            proc.stop_reason = "failed"
            await self._fail(proc.load_id, proc.model_id, report.reason, proc.replica, proc.replicas)

    async def _on_exit(self, proc: StageProcess, code: int) -> None:
        if self.procs.get(proc.load_id) is proc:
            self.procs.pop(proc.load_id)
            self._bounds.pop(proc.load_id, None)
        if proc.stop_reason is None:
            last = proc.last_log_line()
            reason = f"the stage process exited unexpectedly (code {code})" + (
                f"; the last line of its log: {last}" if last else "")
            if not await self._restart(proc, reason):
                await self._fail(proc.load_id, proc.model_id, reason, proc.replica, proc.replicas)
        elif proc.stop_reason not in ("failed", "requested") and proc.replicas > 1:
            # one replica went (idle, evicted, stopped); the leader decides whether the load did
            await publish_event(self.agent.js, ReplicaLost(
                id=replica_lost_id(proc.load_id, proc.replica), load_id=proc.load_id, model_id=proc.model_id,
                replica=proc.replica, fellow_id=self.agent.fellow_id, code=proc.stop_reason,
                reason=f"fellow {self.agent.fellow_id} stopped it ({proc.stop_reason})"))
        elif proc.stop_reason != "failed":
            await publish_event(self.agent.js, ModelUnloaded(
                id=f"unloaded-{proc.load_id}-{proc.stage}{replica_part(proc.replica)}",
                load_id=proc.load_id, model_id=proc.model_id, reason=proc.stop_reason,
                fellow_id=self.agent.fellow_id))
        try:
            await self.agent.beat()
        except Exception:
            pass

    async def _restart(self, proc: StageProcess, reason: str) -> bool:
        """Start a serving one-stage process again that died, once per load per RESTART_WINDOW_S.

        The leader hears a ReplicaLost (STAGE_RESTARTING): the requests it had started fail, the others
        stay queued for the new process, whose StageReady makes its stage row ready again.
        """
        now = time.monotonic()
        if (proc.cfg.num_stages != 1 or proc.ready is None or self.agent.stopped.is_set()
                or now - self._restarted.get(proc.load_id, -RESTART_WINDOW_S) < RESTART_WINDOW_S):
            return False
        self._restarted = {k: t for k, t in self._restarted.items() if now - t < RESTART_WINDOW_S}
        self._restarted[proc.load_id] = now
        again = StageProcess(proc.cfg, self._on_report, self._on_exit, log_path=proc.log_path,
                             restarts=proc.restarts + 1, env=proc.env)
        self.procs[proc.load_id] = again
        log.error("load %s: %s; restarting it", proc.load_id, reason)
        try:
            await publish_event(self.agent.js, ReplicaLost(
                id=stage_restart_id(replica_lost_id(proc.load_id, proc.replica), again.restarts),
                load_id=proc.load_id, model_id=proc.model_id, replica=proc.replica, fellow_id=self.agent.fellow_id,
                code=STAGE_RESTARTING, reason=f"{reason}; fellow {self.agent.fellow_id} restarts it"))
            await again.start()
        except Exception as exc:  # the leader could not hear of it, or it did not start: the load fails
            self.procs.pop(proc.load_id, None)
            await self._fail(proc.load_id, proc.model_id, f"{reason}; it did not start again: {exc}",
                             proc.replica, proc.replicas)
        return True

    async def _fail(self, load_id: str, model_id: str, reason: str, replica: int = 0, replicas: int = 1) -> None:
        log.error("load %s failed: %s", load_id, reason)
        if replicas > 1:  # one replica of several: the leader ends the load only with the last
            await publish_event(self.agent.js, ReplicaLost(
                id=replica_lost_id(load_id, replica), load_id=load_id, model_id=model_id, replica=replica,
                fellow_id=self.agent.fellow_id, reason=reason, code="load_failed"))
            return
        await publish_event(self.agent.js, LoadFailed(id=load_failed_id(load_id), load_id=load_id, model_id=model_id,
                                                      reason=reason, fellow_id=self.agent.fellow_id))

    async def _stop(self, proc: StageProcess, reason: str) -> None:
        await proc.stop(reason)
        self.procs.pop(proc.load_id, None)

    async def on_unload(self, cmd: UnloadStage) -> None:
        """The agent applies one load's commands in order, so an unload after a load finds its process."""
        proc = self.procs.get(cmd.load_id)
        if proc is not None:
            await self._stop(proc, cmd.reason or "requested")

    async def stop_all(self, reason: str = "stopped") -> None:
        await asyncio.gather(*(self._stop(p, reason) for p in list(self.procs.values())))
        if self._reaper:
            self._reaper.cancel()

    async def on_stop(self, cmd: StopFellow) -> None:
        await self.stop_all("stopped")
        if cmd.purge:
            shutil.rmtree(self.settings.fellow.model_cache, ignore_errors=True)
        self.agent.stopped.set()

    async def on_update(self, cmd: UpdateFellow) -> None:
        """Stop every subprocess first, then re-exec this agent in place."""
        await self.stop_all("stopped")
        await self.agent.stop()
        os.execv(sys.executable, [sys.executable, *sys.argv])

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.settings.fellow.heartbeat_s))
            ttl = self.settings.fellow.model_idle_unload_s
            if ttl <= 0:
                continue
            for proc in list(self.procs.values()):
                m = proc.metrics
                if proc.state == "ready" and m is not None and m.in_flight == 0 and m.idle_s >= ttl:
                    log.info("unloading %s: idle for %.0fs", proc.model_id, m.idle_s)
                    await self._stop(proc, "idle")
