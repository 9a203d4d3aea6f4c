"""A stage subprocess SIGKILLed mid-stream (issue 18): its fellow starts it again, once per load per 60 s.

Real nats-server, leader, fellow and stage processes. The request the stage had started moves to the new
process (leader.moves, issue 53) and its stream ends with no error; the request it had not started is
served by the new process; every row ends finished. A second death within the minute fails the load.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from tests.processes import wait_until
from tests.request_helpers import (
    all_final,
    chat,
    start_stream,
)
from tests.serving_fixtures import Stack

pytestmark = pytest.mark.slow


def stage_row(stack: Stack, load_id: str) -> tuple:
    return stack.sql("SELECT state, pid FROM load_stages WHERE load_id = ?", load_id)[0]


async def test_a_killed_stage_is_restarted_and_serves_what_it_had_started_and_not(tmp_path, nats_server, servables):
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, servables, SWARM_SERVE_MAX_IN_FLIGHT=1,
                                                  SWARM_MODEL_IDLE_UNLOAD_S=0).start())
    try:
        load = await asyncio.to_thread(stack.load, "tiny-a")
        load_id, stage = load["load_id"], load["stages"][0]["pid"]
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
            started = await start_stream(http, chat("story", max_tokens=4000, stream=True, temperature=0))
            queued = asyncio.ensure_future(http.post("/v1/chat/completions", json=chat("hi", max_tokens=8)))
            await asyncio.to_thread(wait_until, lambda: len(rows_of(stack)) == 2, 30, "the second request accepted")
            os.kill(stage, signal.SIGKILL)
            events = await asyncio.wait_for(started, 120)  # it went on at the restarted stage
            assert not any("error" in e for e in events), events[-1]
            assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length"), events[-1]
            reply = await asyncio.wait_for(queued, 90)  # served by the new stage process
            assert reply.status_code == 200, (reply.text, stack.logs())
        state, pid = await asyncio.to_thread(wait_until, lambda: (r := stage_row(stack, load_id))[0] == "ready" and r,
                                             30, "the stage ready again")
        assert pid not in (0, stage)
        assert stack.sql("SELECT state FROM loads WHERE load_id = ?", load_id) == [("ready",)]
        got = await asyncio.to_thread(wait_until, lambda: all_final(stack), 30, "every row final")
        assert sorted((status, code) for _, status, code, _ in got) == [("finished", ""), ("finished", "")]

        os.kill(pid, signal.SIGKILL)  # again within the minute: the load fails
        await asyncio.to_thread(wait_until, lambda: stack.sql("SELECT state FROM loads WHERE load_id = ?", load_id)
                                == [("failed",)], 30, "the load failed")
    finally:
        await asyncio.to_thread(stack.stop)


def rows_of(stack: Stack) -> list[tuple]:
    return stack.sql("SELECT request_id FROM requests")
