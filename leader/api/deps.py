"""What handlers get injected: the leader, its services and a database session per request.

`create_app` installs `dependencies(leader)` app-wide; a handler names what it needs as a
parameter (`serving`, `auth`, `streams`, `db`, `caller` ...), never reaching into `app.state`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar import Request
from litestar.di import NamedDependency, Provide
from sqlalchemy.ext.asyncio import AsyncSession

from core.settings import Settings
from leader.auth.guard import token_of
from leader.auth.service import AuthService, Identity
from leader.context import Leader
from leader.errors import ApiError
from leader.fellow_monitor import FellowMonitor
from leader.serving import Serving
from leader.token_stream import TokenStreams

OPEN_CALLER = "open"  # requested_by of a call made in open mode (no token exists, so none was sent)


def _started(service):
    if service is None:  # only between the socket opening and the lifespan's start
        raise ApiError(503, "The leader is still starting", code="unavailable")
    return service


def requested_by(caller: Identity | None) -> str:
    """Who made a call, for the audit: the token's id (never its secret), or "open" without one."""
    return caller.token_id if caller is not None else OPEN_CALLER


def dependencies(leader: Leader, chat_timeout_s: float) -> dict[str, Provide]:
    def provide_leader() -> Leader:
        return leader

    def provide_settings() -> Settings:
        return leader.settings

    def provide_serving() -> Serving:
        return _started(leader.serving)

    def provide_fellows() -> FellowMonitor:
        return _started(leader.fellows)

    def provide_auth() -> AuthService:
        return _started(leader.auth)

    def provide_streams() -> TokenStreams:
        return _started(leader.token_streams)

    def provide_chat_timeout() -> float:
        return chat_timeout_s

    async def provide_db() -> AsyncIterator[AsyncSession]:
        async with _started(leader.sessions)() as session:
            yield session

    def provide_caller(request: Request) -> Identity | None:
        return token_of(request)

    sync = {"leader": provide_leader, "settings": provide_settings, "serving": provide_serving,
            "fellows": provide_fellows, "auth": provide_auth, "streams": provide_streams,
            "chat_timeout_s": provide_chat_timeout, "caller": provide_caller}
    return {**{name: Provide(fn, sync_to_thread=False) for name, fn in sync.items()}, "db": Provide(provide_db)}


# What a handler parameter annotated with one of these gets injected (by its name, as above).
LeaderDep = NamedDependency[Leader]
SettingsDep = NamedDependency[Settings]
ServingDep = NamedDependency[Serving]
FellowsDep = NamedDependency[FellowMonitor]
AuthDep = NamedDependency[AuthService]
StreamsDep = NamedDependency[TokenStreams]
ChatTimeout = NamedDependency[float]
Db = NamedDependency[AsyncSession]
Caller = NamedDependency[Identity | None]
