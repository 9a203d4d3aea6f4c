"""What the leader's parts may use of the running leader, as a protocol: leader.context.Leader provides it.

The serving, auth, metrics, catalog, sweeper and gateway code take a ``LeaderServices`` rather than the
Leader itself, so they import this module and never leader.context (which builds them): the import
graph has no circle, and the signatures say what they read. The service types are named for type
checkers only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.settings import Settings
from events.base import Event

if TYPE_CHECKING:  # the services themselves import this module
    from leader.auth.service import AuthService
    from leader.fellow_monitor import FellowMonitor
    from leader.metrics import Metrics
    from leader.projectors.runner import ProjectionRunner
    from leader.serving import Serving
    from leader.token_stream import TokenStreams


class LeaderServices(Protocol):
    """The running leader as its parts see it: bus, SQL sessions, settings and the services built at start."""

    settings: Settings
    nc: Client
    js: JetStreamContext
    sessions: async_sessionmaker
    projections: ProjectionRunner
    fellows: FellowMonitor
    serving: Serving
    auth: AuthService
    token_streams: TokenStreams
    metrics: Metrics
    frame_secret: bytes  # signs requests' frame keys (events.frames.frame_key)

    async def publish(self, evt: Event, wait: list[str] | None = None, timeout: float = 5.0) -> PubAck: ...
