"""The MCP endpoint at `/mcp` (streamable HTTP, the `mcp` package): the API's main verbs as tools.

Each tool calls the leader's own HTTP API in-process with the caller's bearer token, so a tool checks
the same scope as its route: `models_list` and `models_performance` need `read`, `model_load`,
`model_unload` and `chat` need `operate`. The mount itself needs `read`.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, Callable

import httpx
from litestar import asgi
from litestar.types import Receive, Scope, Send
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp

API = "http://leader"  # the in-process app answers whatever host is named


class McpEndpoint:
    """Built by `create_app`; `app()` gives the Litestar app, which exists only after the routes."""

    def __init__(self, app: Callable[[], Any], host: str):
        self.app = app
        self.server = MCPServer("swarm", instructions="Swarm serves LLMs: list models, their performance, "
                                "load and unload them, and chat with a loaded one.")
        self._tools()
        self.server.streamable_http_app(stateless_http=True, json_response=True, host=host)  # builds the manager
        self.asgi = StreamableHTTPASGIApp(self.server.session_manager)

    @asynccontextmanager
    async def running(self):
        async with self.server.session_manager.run():
            yield

    async def call(self, ctx: Context, method: str, path: str, body: dict | None = None) -> dict:
        auth = (ctx.headers or {}).get("authorization")
        transport = httpx.ASGITransport(app=self.app())
        async with httpx.AsyncClient(transport=transport, base_url=API, timeout=None) as client:
            r = await client.request(method, path, json=body, headers={"Authorization": auth} if auth else {})
        try:
            data = r.json()
        except ValueError:
            data = {"error": {"message": r.text}}
        if r.status_code >= 400:
            err = data.get("error") or {}
            raise ToolError(f"{r.status_code} {err.get('code') or ''}: {err.get('message') or r.text}".strip())
        return data

    def _tools(self) -> None:
        tool = self.server.tool

        @tool(description="The servable models, each with its load state")
        async def models_list(ctx: Context) -> dict:
            return await self.call(ctx, "GET", "/api/v1/models")

        @tool(description="A model's throughput, TTFT, time split per token and its stages, over the last "
                          "window_s seconds (60 to 21600)")
        async def models_performance(model_id: str, ctx: Context, window_s: int = 900) -> dict:
            return await self.call(ctx, "GET", f"/api/v1/models/{model_id}/performance?window_s={window_s}")

        @tool(description="Load a model (operate scope); waits until it is ready or failed")
        async def model_load(model_id: str, ctx: Context, replicas: int | None = None) -> dict:
            body = {"wait": True, **({"replicas": replicas} if replicas is not None else {})}
            return await self.call(ctx, "POST", f"/api/v1/models/{model_id}/load", body)

        @tool(description="Unload a model (operate scope)")
        async def model_unload(model_id: str, ctx: Context) -> dict:
            return await self.call(ctx, "POST", f"/api/v1/models/{model_id}/unload")

        @tool(description="Send one user message to a loaded model (operate scope); the reply's text and usage")
        async def chat(model: str, message: str, ctx: Context, max_tokens: int | None = None,
                       temperature: float | None = None) -> dict:
            body: dict = {"model": model, "messages": [{"role": "user", "content": message}]}
            body.update({k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature)) if v is not None})
            reply = await self.call(ctx, "POST", "/v1/chat/completions", body)
            choice = reply["choices"][0]
            return {"id": reply["id"], "text": choice["message"]["content"], "finish_reason": choice["finish_reason"],
                    "usage": reply.get("usage")}

    def route(self):
        endpoint = self.asgi

        @asgi("/mcp", is_mount=True, copy_scope=True, opt={"scope": "read"}, tags=["mcp"])
        async def mcp(scope: Scope, receive: Receive, send: Send) -> None:
            await endpoint(scope, receive, send)

        return mcp
