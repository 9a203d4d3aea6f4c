"""Loads on the leader: request, place, command, react to stages ready and fellows lost; resolve chat models."""

from __future__ import annotations

import asyncio
import logging
import uuid

import msgspec
from sqlalchemy import select

from core.bus import publish_struct
from core.servable import ServableError, load_manifest
from core.servable_plan import plan_stage, serving_ranges
from events import subjects
from events.commands import LoadStage, UnloadStage
from events.fellow import FellowLost
from events.loads import (LoadFailed, LoadPlaced, LoadRequested, ModelLoaded, ModelUnloaded, ReplicaLost,
                          StageReady, TransportPlan, UnloadRequested, load_failed_id, replica_lost_id,
                          replica_part)
from leader.db.tables import Load, LoadStage as LoadStageRow, Model
from leader.errors import ApiError
from leader.placement import PlacementError, place_replicas, place_ring, ring_needs, ring_plan, ring_stage_count
from leader.registry import Registry
from leader.relay_stats import RelayStats

log = logging.getLogger(__name__)

ACTIVE = ("requested", "loading", "ready")
SERVING = ("loading", "ready")  # a stage row that still counts
UNLOADED_CODES = ("idle", "evicted", "stopped")  # a replica that went away without failing
AUTOLOAD_WAIT_S = 600.0


class ReadyLoad(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway needs to send a chat request to a loaded model."""

    load_id: str
    model_id: str
    generation: dict
    context_tokens: int
    kv_tokens: int = 0


def one_stage_plan(s) -> TransportPlan:
    """In flight: SWARM_SERVE_IN_FLIGHT, else what a fellow holds. KV tokens: a typical chat per
    request in flight, never below one whole SWARM_SERVE_CONTEXT_TOKENS conversation; the stage
    lowers it to what it measures it can hold."""
    in_flight = s.serve_in_flight or s.serve_max_in_flight
    return TransportPlan(max_in_flight=in_flight,
                         kv_tokens=max(s.serve_context_tokens, in_flight * s.serve_typical_tokens),
                         max_batch=s.serve_max_batch or 0, speculative=s.serve_speculative,
                         prefill_chunk=s.serve_prefill_chunk)


def load_msg_id(load_id: str, a) -> str:
    return f"{load_id}-{a.stage}-load{replica_part(a.replica)}"


def unload_msg_id(stage) -> str:
    return f"{stage.load_id}-{stage.stage}-unload{replica_part(stage.replica)}"


def model_not_found(model_id: str) -> ApiError:
    return ApiError(404, f"The model '{model_id}' does not exist", code="model_not_found", param="model")


class Serving:
    def __init__(self, leader):
        self.leader = leader
        self.registry = Registry(leader)
        self.ready: dict[str, ReadyLoad] = {}  # model_id -> its ready load (the hot path's view)
        self._changed = asyncio.Condition()
        self._loading: dict[str, asyncio.Lock] = {}
        self.relay = RelayStats()  # bytes and frames per lane of every ring, for the performance view

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.leader.projections.listeners.setdefault("loads", []).append(self._on_loads)
        self.leader.fellows.listeners.append(self._on_fellow)
        await self.relay.start(self.leader.nc)
        await self._sweep()

    async def _sweep(self) -> None:
        """After a restart: finish what a crash interrupted, and rebuild the ready view."""
        async with self.leader.sessions() as session:
            loads = list(await session.scalars(select(Load).where(Load.state.in_(ACTIVE))))
        for load in loads:
            await self._check_loaded(load.load_id)
        await self._refresh_ready()

    async def _on_loads(self, events: list) -> None:
        for evt in events:
            if isinstance(evt, StageReady):
                await self._check_loaded(evt.load_id)
            elif isinstance(evt, ReplicaLost):
                await self._replica_lost(evt)
            elif isinstance(evt, (LoadFailed, ModelUnloaded)):
                await self._release_stages(evt.load_id, "failed" if isinstance(evt, LoadFailed) else evt.reason)
        if any(isinstance(e, (ModelLoaded, LoadFailed, ModelUnloaded, ReplicaLost)) for e in events):
            await self._refresh_ready()
        async with self._changed:
            self._changed.notify_all()

    async def _on_fellow(self, evt) -> None:
        if not isinstance(evt, FellowLost):
            return
        async with self.leader.sessions() as session:
            rows = await session.execute(
                select(Load.load_id, Load.model_id, LoadStageRow.replica)
                .join(LoadStageRow, LoadStageRow.load_id == Load.load_id)
                .where(LoadStageRow.fellow_id == evt.fellow_id, Load.state.in_(ACTIVE)))
            hit = sorted(set(rows.all()))
        for load_id, model_id, replica in hit:
            if len({s.replica for s in await self.stages(load_id)}) > 1:  # the others keep serving
                await self.leader.publish(ReplicaLost(
                    id=replica_lost_id(load_id, replica), load_id=load_id, model_id=model_id, replica=replica,
                    fellow_id=evt.fellow_id, code="fellow_lost",
                    reason=f"fellow {evt.fellow_id} was lost ({evt.reason})"))
                continue
            await self.leader.publish(LoadFailed(
                id=load_failed_id(load_id), load_id=load_id, model_id=model_id, code="fellow_lost",
                fellow_id=evt.fellow_id, reason=f"fellow {evt.fellow_id} was lost ({evt.reason})"))

    async def _release_stages(self, load_id: str, reason: str) -> None:
        """A load that ended on one stage or replica cannot serve: every other one is told to stop and
        free its memory."""
        stages = await self.stages(load_id)
        if len(stages) < 2:
            return
        for stage in stages:
            await publish_struct(self.leader.js, subjects.command(stage.fellow_id, "unload"),
                                 UnloadStage(load_id=load_id, reason=reason), msg_id=unload_msg_id(stage))
        self.relay.forget(load_id)

    async def _replica_lost(self, evt: ReplicaLost) -> None:
        """One replica went away: the load serves on with the others, or ends with the last one."""
        load = await self.get_load(evt.load_id)
        if load is None or load.state not in ACTIVE:
            return
        if any(s.state in SERVING for s in await self.stages(evt.load_id)):
            await self._check_loaded(evt.load_id)  # the replicas still loading may be all it waits for
            return
        if evt.code in UNLOADED_CODES:
            await self.leader.publish(ModelUnloaded(id=f"unloaded-{evt.load_id}", load_id=evt.load_id,
                                                    model_id=evt.model_id, reason=evt.code, fellow_id=evt.fellow_id))
        else:
            await self.leader.publish(LoadFailed(
                id=load_failed_id(evt.load_id), load_id=evt.load_id, model_id=evt.model_id, code=evt.code,
                fellow_id=evt.fellow_id, reason=f"no replica is left; the last: {evt.reason}"))

    async def _check_loaded(self, load_id: str) -> None:
        async with self.leader.sessions() as session:
            load = await session.get(Load, load_id)
            stages = list(await session.scalars(select(LoadStageRow).where(LoadStageRow.load_id == load_id)))
        if load is None or load.state != "loading" or not stages:
            return
        live = [s for s in stages if s.state in SERVING]
        replicas = {s.replica for s in live}
        whole = all(sum(s.replica == r for s in live) == load.num_stages for r in replicas)
        if live and whole and all(s.state == "ready" for s in live):
            await self.leader.publish(ModelLoaded(id=f"loaded-{load_id}", load_id=load_id,
                                                  model_id=load.model_id))

    async def _refresh_ready(self) -> None:
        async with self.leader.sessions() as session:
            rows = await session.execute(select(Load, Model).join(Model, Model.model_id == Load.model_id)
                                         .where(Load.state == "ready"))
            pairs = rows.all()
            stages: dict[str, LoadStageRow] = {}  # stage 0 admits; of several replicas the smallest budget
            for s in await session.scalars(
                    select(LoadStageRow).where(LoadStageRow.load_id.in_([l.load_id for l, _ in pairs]),
                                               LoadStageRow.stage == 0, LoadStageRow.state == "ready")):
                if s.load_id not in stages or s.kv_tokens < stages[s.load_id].kv_tokens:
                    stages[s.load_id] = s
        ready = {}
        for load, model in sorted(pairs, key=lambda p: p[0].ready_at or 0):
            try:
                gen = load_manifest(model.path).generation
            except (ServableError, OSError):
                continue
            kv = stages[load.load_id].kv_tokens if load.load_id in stages else 0
            ready[model.model_id] = ReadyLoad(
                load_id=load.load_id, model_id=model.model_id, generation=msgspec.to_builtins(gen),
                context_tokens=kv or self.leader.settings.serve_context_tokens, kv_tokens=kv)
        self.ready = ready

    # --- API ---------------------------------------------------------------------------------

    async def active_load(self, model_id: str) -> Load | None:
        async with self.leader.sessions() as session:
            return (await session.scalars(select(Load).where(Load.model_id == model_id, Load.state.in_(ACTIVE))
                                          .order_by(Load.requested_at.desc()))).first()

    async def load(self, model_id: str, num_stages: int | None = None, fellow_id: str | None = None,
                   quantization: dict | None = None, requested_by: str = "",
                   fellow_ids: list[str] | None = None, replicas: int = 1) -> Load:
        """Request a load (or return the model's active one) and place it; returns the load's row.

        Stages: ``num_stages`` when given, else one per pinned ``fellow_ids``, else one with
        ``fellow_id``, else the servable's own count when enough fellows can form that ring.
        ``replicas`` > 1: that many one-stage copies on as many fellows (``fellow_ids`` pins them),
        sharing one request queue.
        """
        # One load at a time per model: concurrent first requests (autoload) share the load the
        # first one placed instead of each placing its own.
        async with self._loading.setdefault(model_id, asyncio.Lock()):
            return await self._load(model_id, num_stages, fellow_id, quantization, requested_by, fellow_ids,
                                    replicas)

    async def _load(self, model_id: str, num_stages: int | None, fellow_id: str | None, quantization: dict | None,
                    requested_by: str, fellow_ids: list[str] | None, replicas: int = 1) -> Load:
        model = await self.registry.get(model_id)
        if model is None:
            raise model_not_found(model_id)
        if not model.available:
            raise ApiError(409, f"The model '{model_id}' is not servable: {model.reason}", code="model_unavailable")
        existing = await self.active_load(model_id)
        if existing is not None:
            return existing
        monitor = self.leader.fellows
        if replicas > 1:
            if num_stages is not None and num_stages > 1:
                raise ApiError(400, "replicas are served on one stage each; a ring of several stages has one "
                                    "replica", code="unsupported_replicas", param="replicas")
            num_stages = 1
        if num_stages is None:
            num_stages = (len(fellow_ids) if fellow_ids else 1 if fellow_id else
                          ring_stage_count(model.num_stages, monitor.latest, set(monitor.online)))
        if num_stages > 1:
            return await self._load_ring(model, num_stages, fellow_ids or ([fellow_id] if fellow_id else []),
                                         quantization, requested_by)
        if replicas > 1:
            pinned = fellow_ids or ([fellow_id] if fellow_id else [])
        else:
            fellow_id = fellow_id or (fellow_ids[0] if fellow_ids else None)
            pinned = [fellow_id] if fellow_id else []
        load_id = "ld-" + uuid.uuid4().hex[:16]
        await self.leader.publish(LoadRequested(load_id=load_id, model_id=model_id, num_stages=1,
                                                fellow_ids=pinned, quantization=quantization,
                                                requested_by=requested_by, replicas=replicas),
                                  wait=["loads"])
        try:
            assignments = place_replicas(model.parameters, model.num_layers, replicas, monitor.latest,
                                         set(monitor.online), pinned or None, quantization)
        except PlacementError as exc:
            await self.leader.publish(LoadFailed(id=load_failed_id(load_id), load_id=load_id, model_id=model_id,
                                                 reason=str(exc), code="placement_failed"), wait=["loads"])
            raise ApiError(409, f"Cannot load '{model_id}': {exc}", code="placement_failed") from None
        transport = one_stage_plan(self.leader.settings)
        await self.leader.publish(LoadPlaced(load_id=load_id, model_id=model_id, stages=assignments,
                                             transport=transport, quantization=quantization), wait=["loads"])
        for a in assignments:
            cmd = LoadStage(load_id=load_id, model_id=model_id, assignment=a, num_stages=1,
                            stage_fellows=[a.fellow_id], transport=transport, quantization=quantization,
                            model_path=model.path, manifest_sha256=model.manifest_sha256, replicas=replicas)
            await publish_struct(self.leader.js, subjects.command(a.fellow_id, "load"), cmd,
                                 msg_id=load_msg_id(load_id, a))
        return await self.get_load(load_id)

    async def _load_ring(self, model: Model, n: int, pinned: list[str], quantization: dict | None,
                         requested_by: str) -> Load:
        """Place a ring of ``n`` stages, one fellow each, and command every stage's fellow."""
        try:
            manifest = load_manifest(model.path)
            ranges = serving_ranges(manifest, n)
            shards = [plan_stage(manifest, i, n).shards for i in range(n)]
        except ServableError as exc:
            raise ApiError(409, f"Cannot serve '{model.model_id}' over {n} stages: {exc}",
                           code="unsupported_num_stages", param="num_stages") from None
        load_id = "ld-" + uuid.uuid4().hex[:16]
        await self.leader.publish(LoadRequested(load_id=load_id, model_id=model.model_id, num_stages=n,
                                                fellow_ids=pinned, quantization=quantization,
                                                requested_by=requested_by))
        transport = ring_plan(self.leader.settings, n)
        monitor = self.leader.fellows
        try:
            assignments = place_ring(model.parameters, ranges, shards, monitor.latest, set(monitor.online),
                                     pinned or None, quantization, ring_needs(transport.max_in_flight))
        except PlacementError as exc:
            await self.leader.publish(LoadFailed(id=load_failed_id(load_id), load_id=load_id, model_id=model.model_id,
                                                 reason=str(exc), code="placement_failed"), wait=["loads"])
            raise ApiError(409, f"Cannot load '{model.model_id}': {exc}", code="placement_failed") from None
        await self.leader.publish(LoadPlaced(load_id=load_id, model_id=model.model_id, stages=assignments,
                                             transport=transport, quantization=quantization), wait=["loads"])
        for a in assignments:
            cmd = LoadStage(load_id=load_id, model_id=model.model_id, assignment=a, num_stages=n,
                            stage_fellows=[x.fellow_id for x in assignments], transport=transport,
                            quantization=quantization, model_path=model.path, manifest_sha256=model.manifest_sha256)
            await publish_struct(self.leader.js, subjects.command(a.fellow_id, "load"), cmd,
                                 msg_id=load_msg_id(load_id, a))
        return await self.get_load(load_id)

    async def get_load(self, load_id: str) -> Load | None:
        async with self.leader.sessions() as session:
            return await session.get(Load, load_id)

    async def stages(self, load_id: str) -> list[LoadStageRow]:
        async with self.leader.sessions() as session:
            return list(await session.scalars(select(LoadStageRow).where(LoadStageRow.load_id == load_id)
                                              .order_by(LoadStageRow.replica, LoadStageRow.stage)))

    async def wait_settled(self, load_id: str, timeout: float) -> Load:
        """Wait until the load is ready or ended; returns its row (TimeoutError past `timeout`)."""
        async def settled() -> Load:
            async with self._changed:
                while True:
                    load = await self.get_load(load_id)
                    if load is not None and load.state not in ("requested", "loading"):
                        return load
                    await self._changed.wait()

        return await asyncio.wait_for(settled(), timeout)

    async def unload(self, model_id: str, requested_by: str = "") -> Load:
        load = await self.active_load(model_id)
        if load is None:
            if await self.registry.get(model_id) is None:
                raise model_not_found(model_id)
            raise ApiError(409, f"The model '{model_id}' is not loaded", code="model_not_loaded")
        await self.leader.publish(UnloadRequested(load_id=load.load_id, model_id=model_id,
                                                  requested_by=requested_by), wait=["loads"])
        for stage in await self.stages(load.load_id):
            await publish_struct(self.leader.js, subjects.command(stage.fellow_id, "unload"),
                                 UnloadStage(load_id=load.load_id), msg_id=unload_msg_id(stage))
        return await self.get_load(load.load_id)

    async def ready_load(self, model_id: str, autoload: bool | None = None) -> ReadyLoad:
        """The model's ready load for a chat request; 404 unknown, 409 not loaded (unless autoload)."""
        ready = self.ready.get(model_id)
        if ready is not None:
            return ready
        model = await self.registry.get(model_id)
        if model is None:
            raise model_not_found(model_id)
        autoload = self.leader.settings.autoload if autoload is None else autoload
        if not autoload:
            raise ApiError(409, f"The model '{model_id}' is not loaded. Load it with `swarm model-load {model_id} "
                                f"--wait` or POST /api/v1/models/{model_id}/load", code="model_not_loaded")
        load = await self.load(model_id, num_stages=1, requested_by="autoload")  # the spec: on one stage
        try:
            load = await self.wait_settled(load.load_id, AUTOLOAD_WAIT_S)
        except asyncio.TimeoutError:
            raise ApiError(503, f"The model '{model_id}' did not finish loading in {AUTOLOAD_WAIT_S:.0f}s",
                           code="model_loading") from None
        if load.state == "ready" and model_id not in self.ready:
            await self._refresh_ready()  # the row is ready; the listener that refreshes the view may lag it
        if load.state != "ready" or model_id not in self.ready:
            raise ApiError(503, f"The model '{model_id}' failed to load: {load.reason or load.state}",
                           code="load_failed")
        return self.ready[model_id]
