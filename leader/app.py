"""The Litestar application factory: routes, error shape, injected services and the leader's lifespan."""

from __future__ import annotations

from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.logging.config import LoggingConfig
from litestar.openapi import OpenAPIConfig

from core.settings import Settings
from leader.api.anthropic import ANTHROPIC
from leader.api.body import body_read_timeout, json_bodies_only
from leader.api.chat import FRAME_TIMEOUT_S, chat_completions
from leader.api.completions import completions
from leader.api.deps import dependencies
from leader.api.downloads import ROUTES as DOWNLOAD_ROUTES
from leader.api.fellows import list_fellows
from leader.api.health import healthz
from leader.api.models import ROUTES as MODEL_ROUTES
from leader.api.ollama_models import OLLAMA
from leader.api.operations import ROUTES as OPERATION_ROUTES
from leader.api.responses import responses
from leader.api.tokenize import detokenize, tokenize
from leader.auth.guard import scope_guard
from leader.auth.routes import TOKEN_ROUTES
from leader.context import Leader
from leader.errors import exception_handlers
from leader.mcp_tools import McpEndpoint
from leader.web import ROUTES as WEB_ROUTES

BODY_TIMEOUT_S = 30.0
ROUTES = [healthz, list_fellows, *MODEL_ROUTES, *DOWNLOAD_ROUTES, *TOKEN_ROUTES, chat_completions, completions,
          responses, tokenize, detokenize, *WEB_ROUTES, *OPERATION_ROUTES, ANTHROPIC, OLLAMA]


def json_logging(settings: Settings) -> dict:
    """With SWARM_LOG_FORMAT=json, Litestar's own logging config writes JSON lines too."""
    if settings.logging.format != "json":
        return {}
    return {"logging_config": LoggingConfig(formatters={"standard": {"()": "core.logs.JsonFormatter"}})}


def create_app(settings: Settings | None = None, leader: Leader | None = None,
               chat_timeout_s: float = FRAME_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S) -> Litestar:
    """`leader` replaces the leader (tests pass one with a stand-in service); `chat_timeout_s` is the
    longest wait for a chat's first (or next) frame, `body_timeout_s` for the next part of a request body."""
    settings = settings or Settings.from_env()
    leader = leader or Leader(settings)
    mcp = McpEndpoint(lambda: app, settings.leader.host)

    @asynccontextmanager
    async def lifespan(app: Litestar):
        await leader.start()
        try:
            async with mcp.running():
                yield
        finally:
            await leader.stop()

    app = Litestar(
        route_handlers=[*ROUTES, mcp.route()],
        lifespan=[lifespan],
        dependencies=dependencies(leader, chat_timeout_s),
        middleware=[json_bodies_only, body_read_timeout(body_timeout_s)],
        exception_handlers=exception_handlers,
        guards=[scope_guard(leader)],
        openapi_config=OpenAPIConfig(title="Swarm", version="0.1.0", path="/schema"),
        request_max_body_size=settings.leader.http_max_body_bytes,
        debug=False,
        **json_logging(settings),
    )
    app.state.leader = leader  # for whoever holds only the app (tests); handlers get it injected
    return app
