"""Loads that heal (issue 53): a load that failed after it had served is placed again, autoload or not.

A one-stage process that dies twice within its fellow's restart window, a ring stage its fellow does
not restart (stage 0, the last stage), a fellow lost with a load nobody could take over: each ends the
load with LoadFailed. The leader then requests the same shape again (LoadRequested by ``heal``; its
LoadPlaced reason, and so the load's status, names the load it heals and why that one failed), placed
on the fellows online now: the same fellow where it is still there with room, another otherwise. Where
the same shape no longer fits (a ring, replicas, one fellow fewer), one stage. At most ``HEALS_MAX``
heals of a model within ``HEAL_WINDOW_S``: a model that cannot stay up ends failed, its log saying so.

A request that arrives while a model heals waits for it (`Healer.wait`, at most ``HEAL_WAIT_S``), then
is served; past the bound it gets 503 ``model_loading``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from events.loads import LoadFailed
from leader.db.tables import Load
from leader.errors import ApiError
from leader.serving.commands import LoadCommands
from leader.serving.ready import ReadyLoad, ReadyView
from leader.serving.rows import active_load, get_load, latest_load, load_stages

log = logging.getLogger(__name__)

HEAL = "heal"  # the requested_by of a load the leader placed to heal another
HEALS_MAX = 3  # heals of one model ...
HEAL_WINDOW_S = 600.0  # ... within this long, then a failed load stays failed
HEAL_WAIT_S = 120.0  # how long a request waits for a model that heals
RECENT_S = 60.0  # a failure this recent, not healed yet, is about to be (the reaction runs after the projection)
NOT_HEALED = ("placement_failed",)  # a load that never placed has nothing to heal


def healable(load: Load | None) -> bool:
    """Whether a failed load is one to place again: it had served, and nobody asked it to go."""
    return (load is not None and load.state == "failed" and load.ready_at is not None
            and not load.unload_requested_by)


class Healer:
    """Places a failed load's model again, and lets requests wait for it."""

    def __init__(self, sessions, commands: LoadCommands, view: ReadyView, changed: asyncio.Condition):
        self.sessions = sessions
        self.commands = commands
        self.view = view
        self.changed = changed  # notified after each batch of load events was reacted to
        self._heals: dict[str, list[float]] = {}  # model_id -> when it was healed, within the window
        self.pending: set[str] = set()  # models whose heal is being placed now

    def _allowed(self, model_id: str) -> bool:
        now = time.monotonic()
        self._heals[model_id] = [t for t in self._heals.get(model_id, []) if now - t < HEAL_WINDOW_S]
        return len(self._heals[model_id]) < HEALS_MAX

    async def failed(self, evt: LoadFailed) -> None:
        """React to a LoadFailed (after the loads projection applied it): place its model again where it
        had served."""
        load = await get_load(self.sessions, evt.load_id)
        if evt.code in NOT_HEALED or not healable(load):
            return
        model_id = load.model_id
        if not self._allowed(model_id):
            log.warning("load %s of %s failed and is not healed: %d heals within %.0f s already (%s)",
                        load.load_id, model_id, HEALS_MAX, HEAL_WINDOW_S, evt.reason)
            return
        if await active_load(self.sessions, model_id) is not None:
            return  # another load serves it already (autoload, an operator, another leader's heal)
        self._heals[model_id].append(time.monotonic())
        replicas = len({s.replica for s in await load_stages(self.sessions, load.load_id)}) or 1
        note = f"heals {load.load_id}, which failed: {evt.reason}"
        log.warning("load %s of %s failed (%s); placing it again", load.load_id, model_id, evt.reason)
        self.pending.add(model_id)
        try:
            try:
                await self.commands.load(model_id, num_stages=load.num_stages, quantization=load.quantization_requested,
                                         requested_by=HEAL, replicas=replicas, note=note)
            except ApiError as exc:
                if exc.code != "placement_failed" or (load.num_stages or 1) == 1 and replicas == 1:
                    raise
                log.warning("load %s: its shape no longer fits (%s); healing it on one stage", load.load_id, exc)
                await self.commands.load(model_id, num_stages=1, quantization=load.quantization_requested,
                                         requested_by=HEAL, note=note)
        except ApiError as exc:
            log.warning("load %s of %s is not healed: %s", load.load_id, model_id, exc)
        finally:
            self.pending.discard(model_id)
            async with self.changed:  # a request waiting on a heal that did not place stops waiting
                self.changed.notify_all()

    async def _coming(self, model_id: str) -> bool:
        """Whether a load of the model is healing or about to (a request for it waits)."""
        if model_id in self.pending:
            return True
        active = await active_load(self.sessions, model_id)
        if active is not None:  # healing, or ready but not yet in the view (or ending: its failure follows)
            return active.requested_by == HEAL or active.state == "ready"
        latest = await latest_load(self.sessions, model_id)
        return (healable(latest) and time.time() - (latest.ended_at or 0) < RECENT_S
                and len([t for t in self._heals.get(model_id, []) if time.monotonic() - t < HEAL_WINDOW_S])
                < HEALS_MAX)

    async def wait(self, model_id: str, bound_s: float = HEAL_WAIT_S) -> ReadyLoad | None:
        """The model's ready load once it healed; None where nothing heals it (the caller says it is not
        loaded); 503 model_loading past ``bound_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound_s
        async with self.changed:
            while True:
                if (ready := self.view.loads.get(model_id)) is not None:
                    return ready
                if not await self._coming(model_id):
                    return None
                if (left := deadline - loop.time()) <= 0:
                    raise ApiError(503, f"The model '{model_id}' is healing after its load failed and was not "
                                        f"serving again within {bound_s:.0f}s", code="model_loading")
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
