"""Loads that heal (issue 53), with SWARM_AUTOLOAD=0: a load whose stage was SIGKILLed serves again.

Real nats-server, leader, fellows and stage processes. A one-stage process is restarted in place by its
fellow once a minute; killed again, its load fails and the leader places the model again
(leader.serving.heal). A ring's stage 0 and its last stage are not restarted: their load fails and heals
the same way. A request sent once the load has failed waits for the healed load and is answered, the
same greedy reply as before; the healed load's row says it heals the failed one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.processes import wait_until
from tests.request_helpers import all_final, chat, kill_stage_and_wait_restart
from tests.serving_fixtures import Stack, make_servable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servables(tmp_path_factory):
    """"tiny-a" on one stage, "tiny-r" trained for two."""
    root = tmp_path_factory.mktemp("models")
    make_servable(root, "tiny-a", layers=2, hidden=64, stages=1, seed=1)
    make_servable(root, "tiny-r", layers=2, hidden=64, stages=2, seed=2)
    return root / "servables"


def load_state(stack: Stack, load_id: str) -> str:
    return stack.sql("SELECT state FROM loads WHERE load_id = ?", load_id)[0][0]


async def reply_text(http: httpx.AsyncClient, model: str) -> str:
    r = await http.post("/v1/chat/completions", json={**chat("hello there", max_tokens=12, temperature=0),
                                                      "model": model})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


async def healed_after(stack: Stack, http: httpx.AsyncClient, model: str, failed: str, before: str) -> str:
    """Once `failed` is failed, a request sent then is answered `before`'s way by the healed load; its id."""
    await asyncio.to_thread(wait_until, lambda: load_state(stack, failed) == "failed", 60, "the load failed")
    sent = time.time()
    assert await reply_text(http, model) == before  # it waited for the heal, then was served
    (healed, by, ready_at, reason), = stack.sql(
        "SELECT load_id, requested_by, ready_at, reason FROM loads WHERE model_id = ? AND state = 'ready'", model)
    assert by == "heal" and ready_at > sent, (by, ready_at, sent)  # placed by the leader, ready after the request
    assert f"heals {failed}, which failed: " in reason, reason
    status = stack.get(f"/api/v1/models/{model}/status").json()
    assert status["load"]["load_id"] == healed and f"heals {failed}" in status["load"]["reason"]
    return healed


async def test_a_one_stage_load_killed_twice_heals_and_a_request_meanwhile_waits(tmp_path, nats_server, servables):
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, servables, SWARM_AUTOLOAD=0,
                                                  SWARM_MODEL_IDLE_UNLOAD_S=0).start())
    try:
        load = await asyncio.to_thread(stack.load, "tiny-a")
        load_id = load["load_id"]
        async with httpx.AsyncClient(base_url=stack.url, timeout=180) as http:
            before = await reply_text(http, "tiny-a")
            # the first death: its fellow restarts it in place, the load stays ready
            pid = await asyncio.to_thread(kill_stage_and_wait_restart, stack, load_id, load["stages"][0]["pid"])
            assert load_state(stack, load_id) == "ready"
            assert await reply_text(http, "tiny-a") == before
            os.kill(pid, signal.SIGKILL)  # the second within the minute: the load fails, and heals
            await healed_after(stack, http, "tiny-a", load_id, before)
        got = await asyncio.to_thread(wait_until, lambda: all_final(stack), 30, "every row final")
        assert {status for _, status, _, _ in got} == {"finished"}, got
    finally:
        await asyncio.to_thread(stack.stop)


async def long_reply(http: httpx.AsyncClient, model: str, on_text=None) -> tuple[str, dict]:
    """(text, usage) of a streamed greedy 3,000-token reply; ``on_text()`` is called once its first text came."""
    body = {**chat("Tell me a long story", max_tokens=3000, temperature=0), "model": model, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, last, gap = "", {}, 0.0, 0.0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            piece = "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
            if piece and not text and on_text is not None:
                on_text()
            if piece:
                gap, last = max(gap, time.monotonic() - last) if text else 0.0, time.monotonic()
            text += piece
            usage = chunk.get("usage") or usage
    if on_text is not None:  # docs/reliability.md's figure (printed, not asserted)
        print(f"the longest wait between two pieces of text, the kill's: {gap:.2f} s")
    return text, {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def healed_from(stack: Stack, model: str, failed: str) -> dict:
    """The model's load that healed ``failed``, once ready: its stages."""
    def ready():
        load = stack.get(f"/api/v1/models/{model}/status").json().get("load") or {}
        return (load.get("state") == "ready" and f"heals {failed}, which failed: " in (load.get("reason") or "")
                and load)
    return wait_until(ready, 60, "the healed load ready")


async def test_a_rings_first_and_last_stage_killed_mid_reply_heal_the_ring_and_the_replies_go_on(
        tmp_path, nats_server, servables):
    """Stage 0, then the healed ring's last stage, SIGKILLed mid-reply: no fellow restarts a ring's stage, so
    the load fails; its reply waits for the load that heals it and goes on there (leader.moves), equal to the
    uninterrupted greedy reply with the same usage. A request sent right after each kill is answered too."""
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, servables, fellows=2, SWARM_AUTOLOAD=0,
                                                  SWARM_MODEL_IDLE_UNLOAD_S=0, OMP_NUM_THREADS=1).start())
    try:
        load = await asyncio.to_thread(stack.load, "tiny-r", num_stages=2, fellow_ids=["f0", "f1"])
        async with httpx.AsyncClient(base_url=stack.url, timeout=180) as http:
            before = await reply_text(http, "tiny-r")
            whole, usage = await long_reply(http, "tiny-r")
            assert usage["completion_tokens"] >= 1000, usage
            current = load
            for which in (0, -1):  # stage 0, then the healed ring's last stage
                failed, pid = current["load_id"], current["stages"][which]["pid"]
                meanwhile: list[asyncio.Task] = []

                def kill(pid=pid):
                    os.kill(pid, signal.SIGKILL)  # no fellow restarts a ring's stage: the load fails
                    meanwhile.append(asyncio.ensure_future(reply_text(http, "tiny-r")))
                assert await long_reply(http, "tiny-r", kill) == (whole, usage)
                assert await meanwhile[0] == before
                healed = await asyncio.to_thread(healed_from, stack, "tiny-r", failed)
                assert load_state(stack, failed) == "failed"
                moved = await asyncio.to_thread(wait_until, lambda: stack.sql(
                    "SELECT max(tokens) FROM request_moves WHERE load_id = ?", healed["load_id"])[0][0], 30,
                    "the move to the healed load")
                assert 0 < moved < usage["completion_tokens"], moved
                current = healed
        got = await asyncio.to_thread(wait_until, lambda: all_final(stack), 30, "every row final")
        assert {status for _, status, _, _ in got} == {"finished"}, got
    finally:
        await asyncio.to_thread(stack.stop)
