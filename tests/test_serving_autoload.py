"""With SWARM_AUTOLOAD, the first requests for an unloaded model load it once and are all answered."""

from __future__ import annotations

import asyncio

import httpx

from core.nats_server import EmbeddedNats
from tests.serving_fixtures import Stack, make_servable


async def test_concurrent_first_requests_share_one_autoload(tmp_path):
    make_servable(tmp_path, "tiny", layers=2, hidden=64, stages=1)
    nats = EmbeddedNats(tmp_path / "js").start()
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats.url, tmp_path / "servables",
                                                  SWARM_AUTOLOAD=1).start())
    try:
        assert stack.get("/api/v1/models/tiny").json()["load_state"] == "unloaded"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with httpx.AsyncClient(timeout=300) as client:
            replies = await asyncio.gather(*(client.post(stack.url + "/v1/chat/completions", json=body)
                                             for _ in range(4)))
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        loads = stack.sql("select load_id, state from loads where model_id = 'tiny'")
        assert len(loads) == 1 and loads[0][1] == "ready", loads
    finally:
        await asyncio.to_thread(stack.stop)
        nats.stop()
