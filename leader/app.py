"""The Litestar application factory: routes, error shape, and the leader's lifespan."""

from __future__ import annotations

from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.openapi import OpenAPIConfig

from core.settings import Settings
from leader.api.fellows import list_fellows
from leader.api.health import healthz
from leader.context import Leader
from leader.errors import exception_handlers

ROUTES = [healthz, list_fellows]


def create_app(settings: Settings | None = None, leader: Leader | None = None) -> Litestar:
    settings = settings or Settings.from_env()
    leader = leader or Leader(settings)

    @asynccontextmanager
    async def lifespan(app: Litestar):
        await leader.start()
        try:
            yield
        finally:
            await leader.stop()

    app = Litestar(
        route_handlers=list(ROUTES),
        lifespan=[lifespan],
        exception_handlers=exception_handlers,
        openapi_config=OpenAPIConfig(title="Swarm", version="0.1.0", path="/schema"),
        debug=False,
    )
    app.state.leader = leader
    app.state.settings = settings
    return app
