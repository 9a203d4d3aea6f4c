"""A fellow that comes back reconciles with the leader: it stops the stages the leader gave up on.

A fellow that paused past its heartbeat timeout was declared lost, and its loads failed (or its
replica was lost); its stages may still run. When a live heartbeat lists a stage whose load the
leader failed, unloaded or never heard of, or whose replica on that fellow no longer counts, the
leader sends that fellow an UnloadStage for it, once per load and fellow (the msg id dedups).
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js import JetStreamContext
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.bus import publish_struct
from core.tasks import cancel_and_wait
from events import subjects
from events.commands import UnloadStage
from events.fellow import Heartbeat
from leader.db.tables import Load, LoadStage
from leader.fellow_monitor import FellowMonitor
from leader.projectors.runner import ProjectionRunner
from leader.serving.rows import ACTIVE, SERVING

log = logging.getLogger(__name__)

RESEND_S = 120.0  # SWARM_COMMANDS' duplicate window: a command repeated sooner is dropped there anyway


def orphan_unload_id(load_id: str, fellow_id: str) -> str:
    return f"{load_id}-orphan-{fellow_id}"


class Reconciler:
    def __init__(self, js: JetStreamContext, sessions: async_sessionmaker, projections: ProjectionRunner,
                 fellows: FellowMonitor):
        self.js = js
        self.sessions = sessions
        self.projections = projections
        self.fellows = fellows  # the heartbeats of fellows that come back
        self._beats: dict[str, Heartbeat] = {}  # fellow_id -> its latest live heartbeat not yet checked
        self._wake = asyncio.Event()
        self._sent: dict[tuple[str, str], float] = {}  # (load_id, fellow_id) -> when its unload was sent
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.fellows.beat_listeners.append(self._on_beat)
        self._task = asyncio.create_task(self._run(), name="serving-reconcile")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    def _on_beat(self, hb: Heartbeat) -> None:
        if hb.loaded_models:
            self._beats[hb.fellow_id] = hb
            self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            beats, self._beats = self._beats, {}
            for hb in beats.values():
                try:
                    await self._check(hb)
                except (OSError, DBAPIError) as exc:  # the database away for a while: the next beat tries again
                    log.warning("reconciling fellow %s failed: %s", hb.fellow_id, exc.__class__.__name__)
                except Exception:
                    log.exception("reconciling fellow %s failed", hb.fellow_id)

    async def orphans(self, hb: Heartbeat) -> dict[str, str]:
        """load_id -> the state the leader has it in, for each stage `hb` lists that the leader gave up on."""
        load_ids = {m.load_id for m in hb.loaded_models}
        if not load_ids:
            return {}
        async with self.sessions() as session:
            states = dict((await session.execute(select(Load.load_id, Load.state)
                                                 .where(Load.load_id.in_(load_ids)))).all())
            mine = set(await session.scalars(select(LoadStage.load_id).where(
                LoadStage.load_id.in_(load_ids), LoadStage.fellow_id == hb.fellow_id,
                LoadStage.state.in_(SERVING))))
        return {load_id: states.get(load_id, "unknown") for load_id in load_ids
                if states.get(load_id) != "unloading"  # being unloaded: its own command is on the way
                and (states.get(load_id) not in ACTIVE or load_id not in mine)}

    async def _check(self, hb: Heartbeat) -> None:
        if not await self.orphans(hb):
            return
        # The SQL may only lag the log (a leader catching up after a restart): ask again once the
        # loads projection has applied everything published so far.
        info = await self.js.stream_info(subjects.EVENTS_STREAM)
        await self.projections.wait_for(info.state.last_seq, ["loads"], timeout=30.0)
        now = time.monotonic()
        self._sent = {k: t for k, t in self._sent.items() if now - t < RESEND_S}
        for load_id, state in (await self.orphans(hb)).items():
            if (load_id, hb.fellow_id) in self._sent:
                continue
            self._sent[load_id, hb.fellow_id] = now
            log.warning("fellow %s still serves load %s, which is %s here: telling it to stop", hb.fellow_id,
                        load_id, state)
            await publish_struct(self.js, subjects.command(hb.fellow_id, "unload"),
                                 UnloadStage(load_id=load_id, reason="orphaned"),
                                 msg_id=orphan_unload_id(load_id, hb.fellow_id))
