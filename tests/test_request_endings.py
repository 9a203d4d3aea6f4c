"""Every accepted request reaches a final row in bounded time (issue 21 item 5), on a real stack.

The stage is held with SIGSTOP where a test needs requests to stay queued: a held stage takes
nothing from the bus, so what is queued is known without racing the model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from events import subjects
from tests.processes import wait_until
from tests.request_helpers import (
    all_final,
    chat,
    kill_stage_and_wait_restart,
    rows,
    start_stream,
)
from tests.serving_fixtures import Stack


async def test_queued_requests_of_an_unloaded_load_fail_at_once_and_every_row_ends(tmp_path, nats_server, servables):
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, servables, SWARM_SERVE_MAX_IN_FLIGHT=1,
                                                  SWARM_MODEL_IDLE_UNLOAD_S=0).start())
    try:
        load = await asyncio.to_thread(stack.load, "tiny-a")
        pid = load["stages"][0]["pid"]
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
            # Over the bus' max_payload: refused before anything is recorded (no row, checked below).
            big = await http.post("/v1/chat/completions", json=chat("x" * 1_100_000))
            assert big.status_code == 413, big.text
            assert big.json()["error"]["code"] == "request_too_large"

            running = await start_stream(http, chat("tell me everything", max_tokens=3000, stream=True))
            os.kill(pid, signal.SIGSTOP)  # held: it takes nothing more from the queue
            try:
                queued = [asyncio.ensure_future(http.post("/v1/chat/completions", json=chat(f"q{i}", max_tokens=4)))
                          for i in range(3)]
                await asyncio.to_thread(wait_until, lambda: len(rows(stack)) == 4, 30, "4 rows accepted")
                r = await http.post("/api/v1/models/tiny-a/unload")
                assert r.status_code == 200, r.text
            finally:
                os.kill(pid, signal.SIGCONT)
            t0 = time.monotonic()
            answers = await asyncio.wait_for(asyncio.gather(*queued), 60)
            assert time.monotonic() - t0 < 30  # not the gateway's 600 s
            for a in answers:
                assert a.status_code == 503 and a.json()["error"]["code"] == "model_not_loaded", a.text
            events = await asyncio.wait_for(running, 60)
            assert events[-1].get("error", {}).get("code") == "model_not_loaded" or \
                events[-1]["choices"][0].get("finish_reason"), events[-1]

        got = await asyncio.to_thread(wait_until, lambda: all_final(stack), 30, "every row final")
        assert len(got) == 4, got  # the 413 left none
        assert sorted(code for _, status, code, _ in got if status == "failed").count("model_unloaded") >= 3, got
        assert not [g for g in got if g[1] == "finished" and g[2]], got  # one state per row
        assert stack.get("/api/v1/models/tiny-a").json()["load_state"] == "unloaded"
    finally:
        await asyncio.to_thread(stack.stop)


async def test_the_sweeper_ends_the_rows_a_dead_leader_left_accepted(tmp_path, nats_server, nc, servables):
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, servables, SWARM_SERVE_MAX_IN_FLIGHT=1,
                                                  SWARM_MODEL_IDLE_UNLOAD_S=0).start())
    try:
        load = await asyncio.to_thread(stack.load, "tiny-a")
        # its one restart in a minute: the next death ends the load
        pid = await asyncio.to_thread(kill_stage_and_wait_restart, stack, load["load_id"], load["stages"][0]["pid"])
        os.kill(pid, signal.SIGSTOP)
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
            pending = asyncio.ensure_future(http.post("/v1/chat/completions", json=chat("never served", max_tokens=4)))
            await asyncio.to_thread(wait_until, lambda: rows(stack), 30, "the row accepted")
            await asyncio.to_thread(stack.leader.kill)  # its gateway dies with the request queued
            with pytest.raises(httpx.HTTPError):
                await pending
        failed = asyncio.get_running_loop().create_future()

        async def on_failed(msg):
            if not failed.done():
                failed.set_result(msg)

        sub = await nc.subscribe(subjects.event("load.failed"), cb=on_failed)
        os.kill(pid, signal.SIGKILL)  # and the load ends while no leader runs (the fellow reports it)
        await asyncio.wait_for(failed, 30)
        await sub.unsubscribe()
        await asyncio.to_thread(stack.leader.start)
        await asyncio.to_thread(stack.leader.wait_healthy)
        (rid, status, code, _), = await asyncio.to_thread(
            wait_until, lambda: [r for r in rows(stack) if r[1] != "accepted"], 60, "the row ended")
        assert (status, code) == ("failed", "model_not_loaded"), (rid, status, code, stack.logs())
    finally:
        await asyncio.to_thread(stack.stop)
