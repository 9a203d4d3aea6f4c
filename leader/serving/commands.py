"""Load commands: request a load, place it, command its stages' fellows; unload.

One path serves every shape: one stage, a ring of several, or replicas of one stage each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

import msgspec
from nats.js import JetStreamContext
from sqlalchemy import text
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.bus import publish_struct
from core.quantization import INT4_FAST, NF4, NONE, QuantizationError, as_request, manifest_method, method_of
from core.servable import ServableError, is_servable_dir, load_manifest
from core.servable_plan import plan_stage, serving_ranges
from core.settings import Settings
from events import subjects
from events.commands import LoadStage, UnloadStage
from events.loads import (
    LoadFailed,
    LoadPlaced,
    LoadRequested,
    StageAssignment,
    StageReplaced,
    TransportPlan,
    UnloadRequested,
    load_failed_id,
    replica_part,
    stage_replaced_id,
)
from leader.catalog import Catalog
from leader.db.tables import Load, LoadStage as LoadStageRow, Model
from leader.errors import ApiError
from leader.fellow_monitor import FellowMonitor
from leader.placement import (
    PlacementError,
    fewer_stages_note,
    for_old_fellows,
    place_replacement,
    place_replicas,
    place_ring_replicas,
    pre_ampere_batch_cap,
    ring_needs,
    ring_stage_count,
    transport_plan,
)
from leader.services import Publish
from leader.serving.drafts import choose_draft
from leader.serving.grants import RequestGrants
from leader.serving.rows import active_load, get_load, load_stages, model_not_found

log = logging.getLogger(__name__)


def place_keeping_price(place: Callable[[str], list[StageAssignment]],
                        asked: str) -> tuple[list[StageAssignment], str, str]:
    """(assignments, the method served, why it differs from ``asked``): quantized where enough fellows
    declare its kernels and fit it at its price, else in full precision, priced as such. int4-fast first
    stays 4-bit on bitsandbytes NF4 (the same price) where too few fellows run its kernels. A load is
    never priced quantized and served otherwise: each stage is told the method it was priced at."""
    if asked == NONE:
        return place(NONE), NONE, ""
    try:
        return place(asked), asked, ""
    except PlacementError as quantized:
        if asked == INT4_FAST:
            try:
                return place(NF4), NF4, f"{asked} asked, served as {NF4}: {quantized}"
            except PlacementError:
                pass
        try:
            assignments = place(NONE)
        except PlacementError:
            raise quantized from None
        return assignments, NONE, f"{asked} asked, served in full precision: {quantized}"


def load_msg_id(load_id: str, a: StageAssignment) -> str:
    return f"{load_id}-{a.stage}-load{replica_part(a.replica)}"


def unload_msg_id(stage: LoadStageRow) -> str:
    return f"{stage.load_id}-{stage.stage}-unload{replica_part(stage.replica)}"


@dataclass(frozen=True)
class LoadPlan:
    """A load's shape before placement: how many stages and replicas, pinned fellows, its transport."""

    num_stages: int
    replicas: int
    pinned: list[str]
    transport: TransportPlan
    place: Callable[[str], list[StageAssignment]]  # at a quantization method, from the fellows' latest heartbeats
    note: str = ""  # why it has fewer stages than the model trained with, where placement chose that


@asynccontextmanager
async def model_lock(sessions, model_id: str):
    """On PostgreSQL, a transaction holding an advisory lock on the model for the block: another
    leader's load of the same model waits, then finds this one's load (the block waits for the loads
    projection, which commits before the lock goes). On SQLite (one leader), nothing."""
    async with sessions() as session:
        if session.get_bind().dialect.name != "postgresql":
            yield
            return
        async with session.begin():
            await session.execute(text("SELECT pg_advisory_xact_lock(:ns, hashtext(:model))"),
                                  {"ns": LOAD_LOCK_NS, "model": model_id})
            yield


LOAD_LOCK_NS = 0x4C4F4144  # "LOAD": the advisory lock namespace of model loads


class LoadCommands:
    def __init__(self, settings: Settings, sessions: async_sessionmaker, js: JetStreamContext, publish: Publish,
                 fellows: FellowMonitor, catalog: Catalog, grants: RequestGrants):
        self.settings = settings
        self.sessions = sessions
        self.js = js
        self.publish = publish
        self.fellows = fellows  # where a load may be placed
        self.catalog = catalog
        self.grants = grants
        self._loading: dict[str, asyncio.Lock] = {}

    async def load(self, model_id: str, num_stages: int | None = None, fellow_id: str | None = None,
                   quantization: dict | None = None, requested_by: str = "",
                   fellow_ids: list[str] | None = None, replicas: int = 1,
                   speculative: int | None = None, note: str = "") -> Load:
        # One load at a time per model: concurrent first requests (autoload) share the load the
        # first one placed instead of each placing its own; across leaders on one PostgreSQL too.
        async with self._loading.setdefault(model_id, asyncio.Lock()), model_lock(self.sessions, model_id):
            model = await self.catalog.get(model_id)
            if model is None:
                raise model_not_found(model_id)
            if not model.available:
                raise ApiError(409, f"The model '{model_id}' is not servable: {model.reason}",
                               code="model_unavailable")
            existing = await active_load(self.sessions, model_id)
            if existing is not None:
                return existing
            plan = self._plan(model, num_stages, fellow_id, fellow_ids, replicas, speculative)
            if note:  # why the leader placed it (leader.serving.heal), beside placement's own notes
                plan = dataclasses.replace(plan, note="; ".join(n for n in (note, plan.note) if n))
            try:
                asked = method_of(quantization) if quantization is not None else manifest_method(model.quantization)
            except QuantizationError as exc:
                raise ApiError(400, str(exc), code="invalid_value", param="quantization") from None
            return await self._place_and_command(model, plan, asked, requested_by)

    def _plan(self, model: Model, num_stages: int | None, fellow_id: str | None, fellow_ids: list[str] | None,
              replicas: int, speculative: int | None = None) -> LoadPlan:
        monitor = self.fellows
        if replicas > 1 and num_stages is None:
            num_stages = 1  # replicas are one-stage copies unless num_stages asks for rings
        note = ""
        if num_stages is None:
            num_stages = (len(fellow_ids) if fellow_ids else 1 if fellow_id else
                          ring_stage_count(model.num_stages, monitor.latest, set(monitor.online)))
            if num_stages < model.num_stages and not fellow_id and not fellow_ids:
                note = fewer_stages_note(model.num_stages, monitor.latest, set(monitor.online))
        transport = transport_plan(self.settings, num_stages)
        if speculative is not None:
            transport = msgspec.structs.replace(transport, speculative=speculative)
        if num_stages == 1:
            if replicas > 1:
                pinned = fellow_ids or ([fellow_id] if fellow_id else [])
            else:
                pinned = [fellow_id] if fellow_id else (fellow_ids or [])[:1]
            return LoadPlan(1, replicas, pinned, transport, lambda method: place_replicas(
                model.parameters, model.num_layers, replicas, monitor.latest, set(monitor.online), pinned or None,
                method), note)
        try:
            manifest = load_manifest(model.path)
            ranges = serving_ranges(manifest, num_stages)
            shards = [plan_stage(manifest, i, num_stages).shards for i in range(num_stages)]
        except ServableError as exc:
            raise ApiError(409, f"Cannot serve '{model.model_id}' over {num_stages} stages: {exc}",
                           code="unsupported_num_stages", param="num_stages") from None
        pinned = fellow_ids or ([fellow_id] if fellow_id else [])
        return LoadPlan(num_stages, replicas, pinned, transport, lambda method: place_ring_replicas(
            model.parameters, ranges, shards, replicas, monitor.latest, set(monitor.online), pinned or None,
            method, ring_needs(transport.max_in_flight)))

    async def _place_and_command(self, model: Model, plan: LoadPlan, asked: str, requested_by: str) -> Load:
        """Request, place, record the placement, and send each stage's fellow its load command."""
        model_id = model.model_id
        load_id = "ld-" + uuid.uuid4().hex[:16]
        await self.publish(LoadRequested(load_id=load_id, model_id=model_id, num_stages=plan.num_stages,
                                                fellow_ids=plan.pinned, quantization=as_request(asked),
                                                requested_by=requested_by, replicas=plan.replicas),
                                  wait=["loads"])
        try:
            assignments, served, reason = place_keeping_price(plan.place, asked)
        except PlacementError as exc:
            await self.publish(LoadFailed(id=load_failed_id(load_id), load_id=load_id, model_id=model_id,
                                                 reason=str(exc), code="placement_failed"), wait=["loads"])
            raise ApiError(409, f"Cannot load '{model_id}': {exc}", code="placement_failed") from None
        quantization = as_request(served)
        transport, drafting = await self._with_draft(model, plan.transport)
        transport, capped = pre_ampere_batch_cap(transport, assignments, self.fellows.latest, served,
                                                 explicit=self.settings.serving.max_batch is not None)
        transport, older = for_old_fellows(transport, assignments, self.fellows.latest, self.settings,
                                           plan.num_stages)
        notes = [why for why in (plan.note, capped, drafting, *older) if why]
        draft = await self._draft_files(transport)
        for why in notes:
            log.info("load %s of %s: %s", load_id, model_id, why)
        await self.publish(LoadPlaced(load_id=load_id, model_id=model_id, stages=assignments,
                                             transport=transport, quantization=quantization,
                                             quantization_reason=reason, reason="; ".join(notes)), wait=["loads"])
        await self.grants.sync()  # stage 0's fellows may pull the load's requests before they are told to
        for a in assignments:
            cmd = LoadStage(load_id=load_id, model_id=model_id, assignment=a, num_stages=plan.num_stages,
                            stage_fellows=[x.fellow_id for x in assignments if x.replica == a.replica],
                            transport=transport, quantization=quantization, model_path=model.path,
                            manifest_sha256=model.manifest_sha256, replicas=plan.replicas, **draft)
            await publish_struct(self.js, subjects.command(a.fellow_id, "load"), cmd,
                                 msg_id=load_msg_id(load_id, a))
        return await get_load(self.sessions, load_id)

    async def _with_draft(self, model: Model, transport: TransportPlan) -> tuple[TransportPlan, str]:
        """The transport with the draft model SWARM_SERVE_DRAFT_MODEL chooses for a drafting load
        (leader.serving.drafts), and why there is none where it chooses none. A servable's folder there is
        the fellows' own setting (each last stage loads it), not the leader's."""
        setting = self.settings.serving.draft_model
        if not setting or not transport.speculative or is_servable_dir(setting):
            return transport, ""
        draft, why = choose_draft(setting, model, await self.catalog.all())
        transport = msgspec.structs.replace(transport, draft_asked=setting)  # the fellows' own stays unused
        if draft is None:
            return transport, why
        return msgspec.structs.replace(transport, draft_model=draft.model_id), ""

    async def _draft_files(self, transport: TransportPlan) -> dict:
        """Where the leader has the transport's draft model, for the last stage's fellow to find or fetch it."""
        draft = await self.catalog.get(transport.draft_model) if transport.draft_model else None
        return {"draft_path": draft.path, "draft_sha256": draft.manifest_sha256} if draft is not None else {}

    async def unload(self, model_id: str, requested_by: str = "") -> Load:
        load = await active_load(self.sessions, model_id)
        if load is None:
            if await self.catalog.get(model_id) is None:
                raise model_not_found(model_id)
            raise ApiError(409, f"The model '{model_id}' is not loaded", code="model_not_loaded")
        await self.publish(UnloadRequested(load_id=load.load_id, model_id=model_id,
                                                  requested_by=requested_by), wait=["loads"])
        await self.unload_stages(await load_stages(self.sessions, load.load_id))
        return await get_load(self.sessions, load.load_id)

    async def replace_stage(self, load: Load, lost: LoadStageRow, stages: list[LoadStageRow], why: str) -> bool:
        """Place a later ring stage whose fellow was lost on another fellow (StageReplaced, then its
        LoadStage command); False where none can take it (the caller ends the load as before)."""
        model = await self.catalog.get(load.model_id)
        if model is None or not model.available or lost.stage == 0:
            return False
        transport = msgspec.convert(load.transport or {}, TransportPlan)
        monitor = self.fellows
        try:
            manifest = load_manifest(model.path)
            shards = plan_stage(manifest, lost.stage, load.num_stages).shards
            fellow = place_replacement(model.parameters, (lost.layer_first, lost.layer_last), model.num_layers,
                                       monitor.latest, set(monitor.online), {s.fellow_id for s in stages},
                                       method_of(load.quantization), ring_needs(transport.max_in_flight))
        except (PlacementError, ServableError) as exc:
            log.warning("load %s: stage %d cannot be re-placed: %s", load.load_id, lost.stage, exc)
            return False
        await self.publish(StageReplaced(
            id=stage_replaced_id(load.load_id, lost.stage, lost.replica, lost.fellow_id), load_id=load.load_id,
            model_id=load.model_id, stage=lost.stage, replica=lost.replica, fellow_id=fellow,
            lost_fellow_id=lost.fellow_id, reason=why), wait=["loads"])
        await self.grants.sync()  # a later stage pulls no requests: nothing changes today, but the rows decide
        assignment = StageAssignment(stage=lost.stage, fellow_id=fellow, replica=lost.replica,
                                     layers=(lost.layer_first, lost.layer_last), shards=list(shards))
        ring = sorted((s for s in stages if s.replica == lost.replica), key=lambda s: s.stage)
        cmd = LoadStage(load_id=load.load_id, model_id=load.model_id, assignment=assignment,
                        num_stages=load.num_stages,
                        stage_fellows=[fellow if s.stage == lost.stage else s.fellow_id for s in ring],
                        transport=transport, quantization=load.quantization, model_path=model.path,
                        manifest_sha256=model.manifest_sha256, replicas=len({s.replica for s in stages}),
                        **await self._draft_files(transport))
        await publish_struct(self.js, subjects.command(fellow, "load"), cmd,
                             msg_id=f"{load_msg_id(load.load_id, assignment)}-on-{fellow}")
        log.info("load %s: stage %d re-placed from %s on %s (%s)", load.load_id, lost.stage, lost.fellow_id, fellow,
                 why)
        return True

    async def unload_stages(self, stages: list[LoadStageRow], reason: str = "requested") -> None:
        """Tell each of these stages' fellows to stop it and free its memory."""
        for stage in stages:
            await publish_struct(self.js, subjects.command(stage.fellow_id, "unload"),
                                 UnloadStage(load_id=stage.load_id, reason=reason), msg_id=unload_msg_id(stage))
