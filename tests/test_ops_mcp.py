"""The MCP endpoint at /mcp, driven by the `mcp` package's own client over streamable HTTP, on a real
stack: open first, then with API tokens, where each tool needs its route's scope."""

from __future__ import annotations

import asyncio
import json

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.serving_fixtures import Stack, make_servable

pytestmark = pytest.mark.slow
MODEL = "tiny"
TOOLS = {"models_list", "models_performance", "model_load", "model_unload", "chat"}


def mcp_client(url: str, secret: str | None = None) -> Client:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return Client(streamable_http_client(url + "/mcp", http_client=httpx2.AsyncClient(headers=headers, timeout=120)))


async def call(client: Client, tool: str, **args):
    result = await client.call_tool(tool, args)
    text = result.content[0].text
    return (text if result.is_error else json.loads(text)), result.is_error


def mint(url: str, scopes: list[str], secret: str | None = None) -> str:
    r = httpx.post(url + "/api/v1/api-tokens", json={"label": "mcp-" + scopes[0], "scopes": scopes},
                   headers={"Authorization": f"Bearer {secret}"} if secret else {})
    assert r.status_code == 201, r.text
    return r.json()["token"]


async def test_mcp_tools_open_then_with_tokens(tmp_path, nats_server):
    _, out = make_servable(tmp_path / "models", MODEL, layers=2, hidden=64, stages=1)
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, out.parent).start())
    try:
        async with mcp_client(stack.url) as client:  # open mode: no token at all
            assert {t.name for t in (await client.list_tools()).tools} == TOOLS
            models, err = await call(client, "models_list")
            assert not err and [m["id"] for m in models["data"]] == [MODEL], models
            loaded, err = await call(client, "model_load", model_id=MODEL)
            assert not err and loaded["state"] == "ready", loaded
            reply, err = await call(client, "chat", model=MODEL, message="What is a set?", max_tokens=6, temperature=0)
            assert not err and reply["usage"]["completion_tokens"] <= 6, reply
        direct = await asyncio.to_thread(lambda: httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "What is a set?"}]}).json())
        assert reply["text"] == direct["choices"][0]["message"]["content"]  # greedy: the same reply

        admin = await asyncio.to_thread(mint, stack.url, ["admin"])
        reader = await asyncio.to_thread(mint, stack.url, ["read"], admin)
        operator = await asyncio.to_thread(mint, stack.url, ["operate"], admin)
        r = await asyncio.to_thread(httpx.post, stack.url + "/mcp", json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (await asyncio.to_thread(stack.get, "/metrics")).status_code == 401  # /metrics: read, as the rest
        scraped = await asyncio.to_thread(httpx.get, stack.url + "/metrics",
                                          headers={"Authorization": f"Bearer {reader}"})
        assert scraped.status_code == 200 and 'swarm:request_success_total{finished_reason=' in scraped.text
        async with mcp_client(stack.url, reader) as client:
            perf, err = await call(client, "models_performance", model_id=MODEL)
            assert not err and perf["model_id"] == MODEL and perf["load"]["state"] == "ready", perf
            assert perf["totals"]["requests"] >= 1
            refused, err = await call(client, "model_unload", model_id=MODEL)
            assert err and "403" in refused, refused
            refused, err = await call(client, "chat", model=MODEL, message="hi", max_tokens=2)
            assert err and "403" in refused, refused
        async with mcp_client(stack.url, operator) as client:
            reply, err = await call(client, "chat", model=MODEL, message="What is a set?", max_tokens=6, temperature=0)
            assert not err and reply["text"] == direct["choices"][0]["message"]["content"]
            gone, err = await call(client, "model_unload", model_id=MODEL)
            assert not err, gone
            missing, err = await call(client, "models_performance", model_id="nope")
            assert err and "404" in missing
        assert stack.get("/api/v1/models/" + MODEL).status_code == 401  # and the rest of the API is closed too
    finally:
        stack.stop()
