"""Loads projection: each load's state and, per stage, its fellow, layers and KV budget."""

from __future__ import annotations

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from core.quantization import method_of
from events.base import Event
from events.loads import (
    STAGE_RESTARTING,
    LoadFailed,
    LoadPlaced,
    LoadRequested,
    ModelLoaded,
    ModelUnloaded,
    ReplicaLost,
    StageReady,
    StageReplaced,
    UnloadRequested,
)
from events.stage_kernels import as_json
from leader.db.tables import Load, LoadStage
from leader.projectors.projector import Projector

ENDED = ("failed", "unloaded")


class LoadsProjector(Projector):
    name = "loads"
    tables = (LoadStage, Load)
    handles = (LoadRequested, LoadPlaced, StageReady, ModelLoaded, UnloadRequested, LoadFailed, ModelUnloaded,
               ReplicaLost, StageReplaced)

    async def apply(self, session: AsyncSession, evt: Event, seq: int) -> None:
        match evt:
            case LoadRequested():
                if await session.get(Load, evt.load_id) is None:
                    session.add(Load(load_id=evt.load_id, model_id=evt.model_id, state="requested",
                                     num_stages=evt.num_stages, requested_at=evt.at,
                                     quantization=evt.quantization, quantization_requested=evt.quantization,
                                     quantization_reason="", reason="", requested_by=evt.requested_by))
            case LoadPlaced():
                load = await session.get(Load, evt.load_id)
                if load is None or load.state in ENDED:
                    return
                load.state = "loading"
                load.placed_at = evt.at
                load.num_stages = len({a.stage for a in evt.stages})
                load.transport = msgspec.to_builtins(evt.transport)
                load.quantization = evt.quantization
                load.quantization_reason = evt.quantization_reason
                load.reason = evt.reason
                placed = method_of(evt.quantization)
                for a in evt.stages:
                    session.add(LoadStage(load_id=evt.load_id, stage=a.stage, replica=a.replica, fellow_id=a.fellow_id,
                                          layer_first=a.layers[0], layer_last=a.layers[1],
                                          state="loading", pid=0, kv_tokens=0, kv_tokens_planned=0,
                                          max_in_flight=evt.transport.max_in_flight, vram_bytes=0,
                                          weights={"quantization": placed, "estimate_bytes": a.weights_estimate}))
            case StageReady():
                stage = await session.get(LoadStage, (evt.load_id, evt.stage, evt.replica))
                if stage is None or stage.state != "loading":
                    return
                stage.state = "ready"
                stage.pid = evt.pid
                stage.kv_tokens = evt.kv_tokens
                stage.kv_tokens_planned = evt.kv_tokens_planned
                stage.max_in_flight = evt.max_in_flight
                stage.vram_bytes = evt.vram_bytes
                stage.kernels = as_json(evt.kernels) or None
                if evt.weights:  # what it serves and measures, beside what placement priced
                    stage.weights = {**(stage.weights or {}), **evt.weights}
            case ModelLoaded():
                load = await session.get(Load, evt.load_id)
                if load is not None and load.state not in ENDED:
                    load.state = "ready"
                    load.ready_at = evt.at
            case UnloadRequested():
                load = await session.get(Load, evt.load_id)
                if load is not None and load.state not in ENDED:
                    load.state = "unloading"
                    load.unload_requested_by = evt.requested_by
            case StageReplaced():
                stage = await session.get(LoadStage, (evt.load_id, evt.stage, evt.replica))
                if stage is None or stage.state not in ("loading", "ready"):
                    return
                stage.replaced = [*(stage.replaced or []), {"from": evt.lost_fellow_id, "to": evt.fellow_id,
                                                             "at": evt.at, "reason": evt.reason}]
                stage.fellow_id, stage.state, stage.pid = evt.fellow_id, "loading", 0
            case ReplicaLost():
                stages = await session.scalars(select(LoadStage).where(LoadStage.load_id == evt.load_id,
                                                                       LoadStage.replica == evt.replica))
                for stage in stages:
                    if evt.code == STAGE_RESTARTING and stage.state == "ready":  # its StageReady comes again
                        stage.state = "loading"
                    elif stage.state in ("loading", "ready"):
                        stage.state = "failed" if evt.code in ("load_failed", "fellow_lost") else "unloaded"
            case LoadFailed():
                await self._end(session, evt.load_id, "failed", evt.reason, evt.at)
            case ModelUnloaded():
                await self._end(session, evt.load_id, "unloaded", evt.reason, evt.at)

    async def _end(self, session: AsyncSession, load_id: str, state: str, reason: str, at: float) -> None:
        load = await session.get(Load, load_id)
        if load is None or load.state in ENDED:
            return
        load.state = state
        load.reason = reason
        load.ended_at = at
        stages = await session.scalars(select(LoadStage).where(LoadStage.load_id == load_id))
        for stage in stages:
            stage.state = state
