"""A fellow that pauses past SWARM_FELLOW_TIMEOUT_S and comes back (issue 21 item 6), with real processes.

While the fellow is stopped its stage runs on; the leader declares the fellow lost and fails its
load and requests. After SIGCONT the leader tells it to stop that orphaned stage, and every request
row ends in one consistent state.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx

from tests.processes import pid_alive, wait_until
from tests.request_helpers import (
    all_final,
    chat,
    start_stream,
)
from tests.serving_fixtures import Stack


def fellow_status(stack: Stack) -> str:
    return stack.get("/api/v1/fellows").json()["data"][0]["status"]


async def test_a_paused_fellow_is_lost_then_its_orphaned_stage_is_stopped(tmp_path, nats_server, servables):
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, servables, SWARM_FELLOW_TIMEOUT_S=2,
                                                  SWARM_SERVE_MAX_IN_FLIGHT=2, SWARM_MODEL_IDLE_UNLOAD_S=0).start())
    fellow = stack.fellows[0].proc.pid
    try:
        load = await asyncio.to_thread(stack.load, "tiny-a")
        stage = load["stages"][0]["pid"]
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
            streams = [await start_stream(http, chat(f"story {i}", max_tokens=2000, stream=True)) for i in range(2)]
            os.kill(fellow, signal.SIGSTOP)
            try:
                await asyncio.to_thread(wait_until, lambda: fellow_status(stack) == "lost", 30, "fellow lost")
                assert pid_alive(stage)  # the stage itself was never paused
                replies = await asyncio.wait_for(asyncio.gather(*streams), 60)
            finally:
                os.kill(fellow, signal.SIGCONT)
        for events in replies:  # failed by the gateway, or finished before the loss was seen
            assert events[-1].get("error", {}).get("code") == "load_failed" or \
                events[-1]["choices"][0].get("finish_reason"), events[-1]
        await asyncio.to_thread(wait_until, lambda: fellow_status(stack) == "online", 30, "fellow back")
        await asyncio.to_thread(wait_until, lambda: not pid_alive(stage), 30, "orphaned stage stopped")
        assert stack.sql("SELECT state FROM loads WHERE load_id = ?", load["load_id"]) == [("failed",)]

        got = await asyncio.to_thread(wait_until, lambda: all_final(stack), 30, "every row final")
        assert len(got) == 2, got
        for _, status, code, finish in got:  # one state: finished without an error, or failed without a finish
            assert (status == "finished" and not code) or (status == "failed" and code and not finish), got
    finally:
        os.kill(fellow, signal.SIGCONT)
        await asyncio.to_thread(stack.stop)
