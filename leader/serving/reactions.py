"""Reactions to load events: a stage ready, a replica lost, a load ended, a fellow lost.

The projectors and the fellow monitor only queue what they saw; the reactions run in a task of
their own, so that what they publish never runs inside a projector's task. Every id they publish is
derived from the cause, so a repeat after a crash is deduplicated by JetStream.
"""

from __future__ import annotations

import asyncio
import logging

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.tasks import cancel_and_wait
from events import subjects
from events.base import Event
from events.fellow import FellowLost
from events.loads import (
    STAGE_RESTARTING,
    LoadFailed,
    LoadPlaced,
    ModelLoaded,
    ModelUnloaded,
    ReplicaLost,
    StageReady,
    StageReplaced,
    load_failed_id,
    replica_lost_id,
)
from leader.db.tables import Load, LoadStage
from leader.fellow_monitor import FellowMonitor
from leader.projectors.runner import ProjectionRunner
from leader.relay_stats import RelayStats
from leader.services import Publish
from leader.serving.commands import LoadCommands
from leader.serving.ready import ReadyView
from leader.serving.rows import ACTIVE, SERVING, UNLOADED_CODES, get_load, load_stages

log = logging.getLogger(__name__)

ENDS_READY = (ModelLoaded, LoadFailed, ModelUnloaded, ReplicaLost, StageReady)  # events that change the ready view
# events that change whose stage 0 a load's is (leader.serving.grants): LoadCommands syncs before placing,
# these after the fact too, for a load that ended or lost a replica, and for a placement the rows only
# hear of on a replay
GRANT_EVENTS = (LoadPlaced, StageReplaced, LoadFailed, ModelUnloaded, ReplicaLost)


async def purge_queue(js, load_id: str) -> None:
    """Drop the requests still queued for an ended load, and its consumer: no stage will take them.

    Their gateways fail them with model_not_loaded (leader.token_stream); the sweeper ends the rows of
    those whose gateway is gone.
    """
    try:
        await js.purge_stream(subjects.REQUESTS_STREAM, subject=subjects.request(load_id))
        await js.delete_consumer(subjects.REQUESTS_STREAM, subjects.request_consumer(load_id))
    except NotFoundError:
        pass
    except (NatsError, asyncio.TimeoutError) as exc:
        log.warning("purging the queue of ended load %s failed: %s", load_id, exc)


class Reactions:
    def __init__(self, js: JetStreamContext, sessions: async_sessionmaker, projections: ProjectionRunner,
                 fellows: FellowMonitor, publish: Publish, commands: LoadCommands, view: ReadyView, relay: RelayStats,
                 on_ended=None, healer=None):
        self.js = js
        self.sessions = sessions
        self.projections = projections  # the loads projection's listeners
        self.fellows = fellows  # fellows lost
        self.publish = publish
        self.on_ended = on_ended  # called when a load ended (the request sweeper's poke)
        self.commands = commands
        self.view = view
        self.relay = relay
        self.healer = healer  # places a failed load's model again (leader.serving.heal)
        self.changed = asyncio.Condition()  # notified after each batch of events was reacted to
        self._queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.projections.listeners.setdefault("loads", []).append(self._queue_loads)
        self.fellows.listeners.append(self._queue_fellow)
        self._task = asyncio.create_task(self._serve(), name="serving-reactions")
        await self._sweep()

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _queue_loads(self, events: list[Event]) -> None:
        if events:
            self._queue.put_nowait(events)

    async def _queue_fellow(self, evt: Event) -> None:
        if isinstance(evt, FellowLost):
            self._queue.put_nowait([evt])

    async def _serve(self) -> None:
        while True:
            events = await self._queue.get()
            try:
                await self._react(events)
            except Exception:
                log.exception("serving: reacting to %s failed", ", ".join(e.type for e in events))

    async def _sweep(self) -> None:
        """After a restart: finish what a crash interrupted, and rebuild the ready view."""
        async with self.sessions() as session:
            loads = list(await session.scalars(select(Load).where(Load.state.in_(ACTIVE))))
        for load in loads:
            await self._check_loaded(load.load_id)
        await self.view.refresh()

    async def _react(self, events: list[Event]) -> None:
        for evt in events:
            if isinstance(evt, StageReady):
                await self._check_loaded(evt.load_id)
            elif isinstance(evt, ReplicaLost):
                await self._replica_lost(evt)
            elif isinstance(evt, (LoadFailed, ModelUnloaded)):
                await purge_queue(self.js, evt.load_id)
                if self.on_ended is not None:
                    self.on_ended()
                await self._release_stages(evt.load_id, "failed" if isinstance(evt, LoadFailed) else evt.reason)
                if isinstance(evt, LoadFailed) and self.healer is not None:
                    await self.healer.failed(evt)
            elif isinstance(evt, FellowLost):
                await self._fellow_lost(evt)
        if any(isinstance(e, GRANT_EVENTS) for e in events):
            await self.commands.grants.sync()  # a stage 0 that ended pulls no more requests
        if any(isinstance(e, ENDS_READY) for e in events):
            await self.view.refresh()
        async with self.changed:
            self.changed.notify_all()

    async def _fellow_lost(self, evt: FellowLost) -> None:
        async with self.sessions() as session:
            rows = await session.execute(
                select(Load.load_id, Load.model_id, LoadStage.replica)
                .join(LoadStage, LoadStage.load_id == Load.load_id)
                .where(LoadStage.fellow_id == evt.fellow_id, Load.state.in_(ACTIVE)))
            hit = sorted(set(rows.all()))
        for load_id, model_id, replica in hit:
            reason = f"fellow {evt.fellow_id} was lost ({evt.reason})"
            if await self._replace(load_id, evt.fellow_id, reason):
                continue
            if len({s.replica for s in await load_stages(self.sessions, load_id)}) > 1:  # the others serve on
                await self.publish(ReplicaLost(
                    id=replica_lost_id(load_id, replica), load_id=load_id, model_id=model_id, replica=replica,
                    fellow_id=evt.fellow_id, code="fellow_lost", reason=reason))
                continue
            await self.publish(LoadFailed(id=load_failed_id(load_id), load_id=load_id, model_id=model_id,
                                                 code="fellow_lost", fellow_id=evt.fellow_id, reason=reason))

    async def _replace(self, load_id: str, fellow_id: str, reason: str) -> bool:
        """A ring that lost a later stage goes on: that stage moves to another fellow, and stage 0 replays
        its sessions once it is ready. False where it cannot (stage 0 lost, no fellow can take it)."""
        load = await get_load(self.sessions, load_id)
        stages = await load_stages(self.sessions, load_id)
        lost = [s for s in stages if s.fellow_id == fellow_id and s.state in SERVING]
        if load is None or load.state != "ready" or (load.num_stages or 1) < 2 or len(lost) != 1:
            return False
        return await self.commands.replace_stage(load, lost[0], [s for s in stages if s.state in SERVING], reason)

    async def _release_stages(self, load_id: str, reason: str) -> None:
        """A load that ended on one stage or replica cannot serve: every other one is told to stop and
        free its memory."""
        stages = await load_stages(self.sessions, load_id)
        if len(stages) < 2:
            return
        await self.commands.unload_stages(stages, reason)
        self.relay.forget(load_id)

    async def _replica_lost(self, evt: ReplicaLost) -> None:
        """One replica went away: the load serves on with the others, or ends with the last one."""
        load = await get_load(self.sessions, evt.load_id)
        if load is None or load.state not in ACTIVE:
            return
        if evt.code != STAGE_RESTARTING and (load.num_stages or 1) > 1:  # a ring replica: its other stages go too
            rest = [s for s in await load_stages(self.sessions, evt.load_id)
                    if s.replica == evt.replica and s.fellow_id != evt.fellow_id]
            await self.commands.unload_stages(rest, "failed")  # quietly: the replica is lost already
        if any(s.state in SERVING for s in await load_stages(self.sessions, evt.load_id)):
            await self._check_loaded(evt.load_id)  # the replicas still loading may be all it waits for
            return
        if evt.code in UNLOADED_CODES:
            await self.publish(ModelUnloaded(id=f"unloaded-{evt.load_id}", load_id=evt.load_id,
                                                    model_id=evt.model_id, reason=evt.code, fellow_id=evt.fellow_id))
        else:
            await self.publish(LoadFailed(
                id=load_failed_id(evt.load_id), load_id=evt.load_id, model_id=evt.model_id, code=evt.code,
                fellow_id=evt.fellow_id, reason=f"no replica is left; the last: {evt.reason}"))

    async def _check_loaded(self, load_id: str) -> None:
        async with self.sessions() as session:  # one read of the load and its stages
            load = await session.get(Load, load_id)
            stages = list(await session.scalars(select(LoadStage).where(LoadStage.load_id == load_id)))
        if load is None or load.state != "loading" or not stages:
            return
        live = [s for s in stages if s.state in SERVING]
        replicas = {s.replica for s in live}
        whole = all(sum(s.replica == r for s in live) == load.num_stages for r in replicas)
        if live and whole and all(s.state == "ready" for s in live):
            await self.publish(ModelLoaded(id=f"loaded-{load_id}", load_id=load_id, model_id=load.model_id))
