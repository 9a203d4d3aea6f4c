"""The leader's running parts in one object: bus, SQL, projectors, fellow monitor, and the services the
HTTP handlers get injected (serving, token authority, token streams), all built in `start`."""

from __future__ import annotations

import logging
import time
from typing import Callable

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from core.bus import close_quietly, connect, ensure_streams, publish_event
from core.procs import run_hooks
from core.settings import Settings
from events.base import Event
from leader.auth.service import AuthService
from leader.db.engine import make_engine, session_factory, upgrade
from leader.fellow_monitor import FellowMonitor
from leader.metrics import Metrics
from leader.projectors.all import all_projectors
from leader.projectors.runner import ProjectionRunner
from leader.serving import Serving, ServingDeps
from leader.token_stream import TokenStreams
from leader.verify import start_verifier

log = logging.getLogger(__name__)


class Leader:
    """Started by the app's lifespan; handlers get its services injected (leader.api.deps).

    Each service is built in `start` with the few parts it uses passed in (none gets the Leader itself).
    Tests replace a service here: `serving` builds the serving (a subclass of Serving) from its
    `ServingDeps`, `clock` and `prune_interval_s` drive the token authority.
    """

    def __init__(self, settings: Settings, serving: Callable[[ServingDeps], Serving] = Serving,
                 clock: Callable[[], float] = time.time, prune_interval_s: float = 600.0):
        self.settings = settings
        self._make_serving = serving
        self._clock = clock
        self._prune_interval_s = prune_interval_s
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.engine: AsyncEngine | None = None
        self.sessions: async_sessionmaker | None = None
        self.projections: ProjectionRunner | None = None
        self.fellows: FellowMonitor | None = None
        self.serving: Serving | None = None
        self.auth: AuthService | None = None
        self.token_streams: TokenStreams | None = None
        self.metrics: Metrics | None = None
        self.on_stop: list = []  # async callables run first at stop (services added by features)
        # signs requests' frame keys (events.frames.frame_key): the leader user's NATS password, which every
        # leader shares and no fellow knows; none without NATS auth, where anyone may publish anything anyway
        creds = settings.nats.credentials
        self.frame_secret = creds.password.encode() if creds else b""

    async def start(self) -> None:
        s = self.settings
        await upgrade(s.leader.database_url)
        self.engine = make_engine(s.leader.database_url)
        self.sessions = session_factory(self.engine)
        self.nc = await connect(s.nats.url or "nats://127.0.0.1:4222", name="swarm-leader",
                                credentials=s.nats.credentials)
        self.js = self.nc.jetstream()
        await ensure_streams(self.js, s.nats.replicas)
        self.projections = ProjectionRunner(self.js, self.sessions, all_projectors())
        await self.projections.start()
        self.fellows = FellowMonitor(self.js, self.sessions, timeout_s=s.leader.fellow_timeout_s)
        await self.fellows.start()
        self.auth = AuthService(s, self.sessions, self.projections, self.publish, clock=self._clock,
                                prune_interval_s=self._prune_interval_s)
        self.auth.start()
        await self.auth.sync_file()
        self.serving = self._make_serving(ServingDeps(
            settings=s, nc=self.nc, js=self.js, sessions=self.sessions, projections=self.projections,
            fellows=self.fellows, publish=self.publish, frame_secret=self.frame_secret, on_stop=self.on_stop))
        await self.serving.start()
        self.token_streams = await TokenStreams(self.nc, self.js, secret=self.frame_secret,
                                                authority=self.projections.authority).start()
        self.token_streams.on_ended.append(self.serving.view.drop)  # a failed load takes no new request
        if (healer := getattr(self.serving, "healer", None)) is not None:  # its requests wait for its heal
            self.token_streams.heal_wait = healer.wait
        self.metrics = Metrics(self.js, self.sessions, self.fellows, relay=getattr(self.serving, "relay", None))
        await self.metrics.start()
        self.on_stop.append(self.metrics.stop)
        verifier = await start_verifier(s, self.nc, self.js, self.sessions, self.token_streams, self.publish,
                                        self.projections)  # leader.verify: a share of replies checked
        self.on_stop.insert(0, verifier.stop)
        log.info("leader started (database %s)", s.leader.database_url.split("://", 1)[0])

    async def stop(self) -> None:
        await run_hooks(self.on_stop, log)
        if self.token_streams:
            await self.token_streams.stop()
        if self.auth:
            await self.auth.stop()
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
