"""Loads on the leader: request, place, command, react to stages ready and fellows lost; resolve chat models.

By concern: `commands` (request, place, command, unload), `reactions` (to load events and lost
fellows, in a task of their own), `grants` (which fellow may pull which load's requests), `ready` (the
ready-model view the chat hot path reads), `sweeper` (ends the rows of requests that can no longer
finish), `reconcile` (stops the stages a returning fellow still runs for loads the leader gave up on),
`limits` (what the bus carries).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.settings import Settings
from leader.catalog import Catalog
from leader.db.tables import Load, LoadStage
from leader.errors import ApiError
from leader.fellow_monitor import FellowMonitor
from leader.projectors.runner import ProjectionRunner
from leader.relay_stats import RelayStats
from leader.services import Publish
from leader.serving.commands import LoadCommands
from leader.serving.grants import RequestGrants
from leader.serving.heal import Healer
from leader.serving.reactions import Reactions
from leader.serving.ready import ReadyLoad, ReadyView
from leader.serving.reconcile import Reconciler
from leader.serving.rows import ACTIVE, active_load, get_load, load_stages, model_not_found
from leader.serving.sweeper import RequestSweeper

__all__ = ["ACTIVE", "AUTOLOAD_WAIT_S", "ReadyLoad", "Serving", "ServingDeps", "model_not_found"]

AUTOLOAD_WAIT_S = 600.0


@dataclass(frozen=True)
class ServingDeps:
    """What the serving's parts use of the started leader (leader.context.Leader passes them at start)."""

    settings: Settings
    nc: Client
    js: JetStreamContext
    sessions: async_sessionmaker
    projections: ProjectionRunner
    fellows: FellowMonitor
    publish: Publish
    frame_secret: bytes  # signs requests' frame keys (events.frames.frame_key)
    on_stop: list  # the leader's stop hooks: the serving adds its own stop


class Serving:
    def __init__(self, deps: ServingDeps):
        d = self.deps = deps
        self.settings, self.sessions = d.settings, d.sessions
        self.catalog = Catalog(d.settings, d.sessions, d.publish, d.projections)
        self.view = ReadyView(d.settings, d.sessions)
        self.relay = RelayStats()  # bytes and frames per lane of every ring, for the performance view
        self.grants = RequestGrants(d.settings, d.sessions)  # which fellow may pull which load's requests
        self.commands = LoadCommands(d.settings, d.sessions, d.js, d.publish, d.fellows, self.catalog, self.grants)
        self.sweeper = RequestSweeper(d.js, d.sessions, d.projections, d.publish, d.frame_secret)
        self.reactions = Reactions(d.js, d.sessions, d.projections, d.fellows, d.publish, self.commands, self.view,
                                   self.relay, on_ended=self.sweeper.poke)
        self.healer = self.reactions.healer = Healer(d.sessions, self.commands, self.view, self.reactions.changed)
        self.reconciler = Reconciler(d.js, d.sessions, d.projections, d.fellows)

    @property
    def registry(self) -> Catalog:
        """The catalog, under the name leader/api and leader/web reach it by."""
        return self.catalog

    @property
    def ready(self) -> dict[str, ReadyLoad]:
        """model_id -> its ready load (the hot path's view)."""
        return self.view.loads

    async def start(self) -> None:
        await self.grants.start(self.deps.nc)  # the auth callout where it is on; the rows' grants
        await self.relay.start(self.deps.nc)
        await self.reactions.start()
        await self.sweeper.start()
        await self.reconciler.start()
        self.deps.on_stop.append(self.stop)

    async def stop(self) -> None:
        await self.reconciler.stop()
        await self.sweeper.stop()
        await self.reactions.stop()
        await self.relay.stop()
        await self.grants.stop()

    # --- API ---------------------------------------------------------------------------------

    async def active_load(self, model_id: str) -> Load | None:
        return await active_load(self.sessions, model_id)

    async def get_load(self, load_id: str) -> Load | None:
        return await get_load(self.sessions, load_id)

    async def stages(self, load_id: str) -> list[LoadStage]:
        return await load_stages(self.sessions, load_id)

    async def load(self, model_id: str, num_stages: int | None = None, fellow_id: str | None = None,
                   quantization: dict | None = None, requested_by: str = "",
                   fellow_ids: list[str] | None = None, replicas: int = 1,
                   speculative: int | None = None) -> Load:
        """Request a load (or return the model's active one) and place it; returns the load's row.

        Stages: ``num_stages`` when given, else one per pinned ``fellow_ids``, else one with
        ``fellow_id``, else the servable's own count when enough fellows can form that ring.
        ``replicas`` > 1: that many one-stage copies on as many fellows (``fellow_ids`` pins them),
        sharing one request queue. ``speculative``: tokens drafted per decode pass on a one-stage
        load (None: SWARM_SERVE_SPECULATIVE).
        """
        return await self.commands.load(model_id, num_stages, fellow_id, quantization, requested_by, fellow_ids,
                                        replicas, speculative)

    async def unload(self, model_id: str, requested_by: str = "") -> Load:
        return await self.commands.unload(model_id, requested_by)

    async def wait_settled(self, load_id: str, timeout: float) -> Load:
        """Wait until the load is ready or ended; returns its row (TimeoutError past `timeout`)."""
        changed = self.reactions.changed

        async def settled() -> Load:
            async with changed:
                while True:
                    load = await self.get_load(load_id)
                    if load is not None and load.state not in ("requested", "loading"):
                        return load
                    await changed.wait()

        return await asyncio.wait_for(settled(), timeout)

    async def ready_load(self, model_id: str, autoload: bool | None = None) -> ReadyLoad:
        """The model's ready load for a chat request; 404 unknown, 409 not loaded (unless autoload)."""
        ready = self.view.loads.get(model_id)
        if ready is not None:
            return ready
        if await self.catalog.get(model_id) is None:
            raise model_not_found(model_id)
        autoload = self.settings.leader.autoload if autoload is None else autoload
        if not autoload:
            healed = await self.healer.wait(model_id)  # a load that failed is placed again: wait for it
            if healed is not None:
                return healed
            raise ApiError(409, f"The model '{model_id}' is not loaded. Load it with `swarm model-load {model_id} "
                                f"--wait` or POST /api/v1/models/{model_id}/load", code="model_not_loaded")
        load = await self.load(model_id, num_stages=1, requested_by="autoload")  # the spec: on one stage
        try:
            load = await self.wait_settled(load.load_id, AUTOLOAD_WAIT_S)
        except asyncio.TimeoutError:
            raise ApiError(503, f"The model '{model_id}' did not finish loading in {AUTOLOAD_WAIT_S:.0f}s",
                           code="model_loading") from None
        if load.state == "ready" and model_id not in self.view.loads:
            await self.view.refresh()  # the row is ready; the reaction that refreshes the view may lag it
        if load.state != "ready" or model_id not in self.view.loads:
            raise ApiError(503, f"The model '{model_id}' failed to load: {load.reason or load.state}",
                           code="load_failed")
        return self.view.loads[model_id]
