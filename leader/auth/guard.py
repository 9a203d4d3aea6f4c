"""The app-wide Litestar guard: every route handler declares `opt={"scope": ...}` or is refused.

A handler declares one of `public`, `read`, `operate`, `admin`. The guard (`scope_guard(leader)`)
authenticates the bearer token (when enforcement is on), checks the scope, and leaves the identity in
the ASGI scope, where `token_of(request)` (or the injected `caller`) finds it (None in open first-run
mode). A handler that declares nothing answers 500, and `undeclared_handlers(app)` lists such handlers
so a test catches them before a request does.
`opt={"first_run_open": True}` lets a handler through while no unrevoked token exists (minting the
first token), even under SWARM_REQUIRE_API_TOKEN=1.
"""

from __future__ import annotations

import logging

from litestar import Litestar
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.routes import HTTPRoute
from litestar.types import Guard

from leader.auth.scopes import PUBLIC, ROUTE_SCOPES
from leader.auth.service import AuthService, Identity
from leader.errors import ApiError

log = logging.getLogger(__name__)

SCOPE_KEY = "swarm_token"  # where the authenticated Identity lives in the ASGI scope
# Handlers Litestar generates itself: the automatic OPTIONS answer and the OpenAPI schema routes.
_FRAMEWORK_PUBLIC = ("litestar.routes.http", "litestar._openapi.", "litestar.openapi.")


def declared_scope(handler: BaseRouteHandler) -> str | None:
    """The scope a handler declared; None when it declared none or an unknown one."""
    scope = handler.opt.get("scope")
    if scope is None and getattr(handler.fn, "__module__", "").startswith(_FRAMEWORK_PUBLIC):
        return PUBLIC
    return scope if scope in ROUTE_SCOPES else None


def undeclared_handlers(app: Litestar) -> list[str]:
    """`METHOD path (module.function)` for each HTTP handler without a valid scope."""
    found = []
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for handler in route.route_handlers:
            if declared_scope(handler) is None:
                fn = handler.fn
                methods = ",".join(sorted(handler.http_methods))
                found.append(f"{methods} {route.path} ({fn.__module__}.{fn.__qualname__})")
    return sorted(found)


def token_of(request: ASGIConnection) -> Identity | None:
    """The token a request authenticated with; None when the leader is in open mode."""
    return request.scope.get(SCOPE_KEY)  # type: ignore[return-value]


def scope_guard(leader) -> Guard:
    """The app-wide guard; it asks the leader's AuthService, built in Leader.start."""

    async def require_scope(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        needed = declared_scope(handler)
        if needed is None:
            log.error("route %s has no declared scope (opt={'scope': ...}); refusing it", connection.url.path)
            raise ApiError(500, "This route declares no access scope and is refused.",
                           code="route_scope_undeclared")
        connection.scope[SCOPE_KEY] = None  # type: ignore[literal-required]
        if needed == PUBLIC:
            return
        service: AuthService | None = leader.auth
        if service is None:
            raise ApiError(503, "The leader is still starting", code="unavailable")
        identity = await service.check(connection.headers.get("authorization"), needed,
                                       first_run_open=bool(handler.opt.get("first_run_open")))
        connection.scope[SCOPE_KEY] = identity  # type: ignore[literal-required]

    return require_scope
