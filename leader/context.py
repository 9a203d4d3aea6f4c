"""The leader's running parts in one object: bus, SQL, projectors, fellow monitor."""

from __future__ import annotations

import logging

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from core.bus import close_quietly, connect, ensure_streams, publish_event
from core.procs import run_hooks
from core.settings import Settings
from events.base import Event
from leader.db.engine import make_engine, session_factory, upgrade
from leader.fellow_monitor import FellowMonitor
from leader.projectors.all import all_projectors
from leader.projectors.runner import ProjectionRunner
from leader.serving import Serving

log = logging.getLogger(__name__)


class Leader:
    """Started by the app's lifespan; endpoints reach it as ``request.app.state.leader``."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.engine: AsyncEngine | None = None
        self.sessions: async_sessionmaker | None = None
        self.projections: ProjectionRunner | None = None
        self.fellows: FellowMonitor | None = None
        self.serving: Serving | None = None
        self.on_stop: list = []  # async callables run first at stop (services added by features)

    async def start(self) -> None:
        s = self.settings
        await upgrade(s.database_url)
        self.engine = make_engine(s.database_url)
        self.sessions = session_factory(self.engine)
        self.nc = await connect(s.nats_url or "nats://127.0.0.1:4222", name="swarm-leader")
        self.js = self.nc.jetstream()
        await ensure_streams(self.js)
        self.projections = ProjectionRunner(self.js, self.sessions, all_projectors())
        await self.projections.start()
        self.fellows = FellowMonitor(self.js, self.sessions, timeout_s=s.fellow_timeout_s)
        await self.fellows.start()
        self.serving = Serving(self)
        await self.serving.start()
        log.info("leader started (database %s)", s.database_url.split("://", 1)[0])

    async def stop(self) -> None:
        await run_hooks(self.on_stop, log)
        if self.fellows:
            await self.fellows.stop()
        if self.projections:
            await self.projections.stop()
        if self.nc is not None and not self.nc.is_closed:
            await close_quietly(self.nc)
        if self.engine is not None:
            await self.engine.dispose()

    async def publish(self, evt: Event, wait: list[str] | None = None, timeout: float = 5.0) -> PubAck:
        """Publish an event; with `wait`, return only once those projections have applied it."""
        ack = await publish_event(self.js, evt)
        if wait is not None:
            await self.projections.wait_for(ack.seq, wait or None, timeout=timeout)
        return ack
