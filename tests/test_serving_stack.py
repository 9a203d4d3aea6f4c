"""Serving end to end over the real bus: leader + fellow processes, a tiny servable, HF as the reference."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from events.frames import DoneFrame
from tests.processes import pid_alive, wait_until
from tests.request_helpers import kill_stage_and_wait_restart
from tests.serving_fixtures import Stack, chat_over_bus, hf_greedy, make_servable


@pytest.fixture(scope="module")
def servable(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    hf, out = make_servable(root, "tiny", layers=4, hidden=64)
    return hf, out


async def test_load_chat_over_bus_equals_hf_and_unload(tmp_path, nats_server, nc, js, servable):
    hf, out = servable
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, out.parent,
                                                  SWARM_SERVE_STEP_COSTS="1", SWARM_SERVE_MAX_BATCH="4").start())
    try:
        load = await asyncio.to_thread(stack.load, "tiny")
        assert load["stages"][0]["kv_tokens"] > 0 and load["stages"][0]["fellow_id"] == "f0"
        assert load["transport"]["step_costs"] is True
        kernels = load["stages"][0]["kernels"]  # chosen by timing at load, with the step's cost
        assert kernels["path"] == "fused" and kernels["rows"] == [1, 4]
        assert kernels["shapes"] and all(e["kernel"] in e["ms"] for e in kernels["shapes"].values())
        assert set(kernels["step_ms"]) == {"1", "4"} and all(ms > 0 for ms in kernels["step_ms"].values())
        assert "[stage0 step-costs] path=fused decode step batch 1:" in stack.logs()
        costs = kernels["step_costs"]  # the spec's other step costs (fellow.runtime.model.load.step_report)
        assert set(costs) == {"verify_ms", "batch_ms", "attn", "graph_spike"} and set(costs["batch_ms"]) == {"2", "4"}
        assert all(len(widths) == 8 for widths in costs["verify_ms"].values()), costs["verify_ms"]
        assert "[stage0 verify-cost] context 256: M=1:" in stack.logs()
        assert "[stage0 graph-spike] needs CUDA" in stack.logs()
        assert "fused layers; kernels chosen in" in stack.logs()
        prompt = "What is a list comprehension?"
        rid, frames, tokens, text = await chat_over_bus(nc, js, load["load_id"], "tiny", prompt, max_tokens=24)
        done = frames[-1]
        assert isinstance(done, DoneFrame), frames[-1]
        assert tokens == hf_greedy(hf, prompt, 24)
        assert done.completion_tokens == len(tokens)
        assert done.finish_reason == ("length" if len(tokens) == 24 else "stop")
        assert "prefill_ms" in done.timing and done.timing["route"] == "local"
        status = stack.get("/api/v1/models/tiny/status").json()
        pid = status["load"]["stages"][0]["pid"]
        assert pid_alive(pid)
        wait_until(lambda: stack.get("/api/v1/models/tiny/status").json()["load"]["metrics"].get("requests") == 1,
                   30, "metrics in the heartbeat")
        r = stack.post("/api/v1/models/tiny/unload")
        assert r.status_code == 200, r.text
        wait_until(lambda: not pid_alive(pid), 30, "stage process gone")
        wait_until(lambda: stack.get("/api/v1/models/tiny").json()["load_state"] == "unloaded", 30, "unloaded")
    finally:
        stack.stop()


async def test_fellow_sigkill_leaves_no_stage_process_and_fails_the_load(tmp_path, nats_server, nc, js, servable):
    _, out = servable
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, out.parent).start())
    try:
        load = await asyncio.to_thread(stack.load, "tiny")
        pid = load["stages"][0]["pid"]
        assert pid_alive(pid)
        stack.fellows[0].kill(signal.SIGKILL)
        await asyncio.to_thread(wait_until, lambda: not pid_alive(pid), 30, "stage process died with its agent")
        await asyncio.to_thread(
            wait_until, lambda: stack.get("/api/v1/models/tiny").json()["load_state"] == "unloaded"
            and stack.get("/api/v1/models/tiny/status").json()["load"] is None, 30, "load failed")
    finally:
        stack.stop()


async def test_a_stage_that_crashes_fails_its_load_with_its_exit_and_log_line(tmp_path, nats_server, servable):
    _, out = servable
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, out.parent).start())
    try:
        load = await asyncio.to_thread(stack.load, "tiny")
        # its one restart in a minute: the next death ends the load
        pid = await asyncio.to_thread(kill_stage_and_wait_restart, stack, load["load_id"], load["stages"][0]["pid"])
        os.kill(pid, signal.SIGKILL)  # the second: the load fails (and heals, leader.serving.heal)
        await asyncio.to_thread(wait_until, lambda: stack.sql("SELECT state, reason FROM loads WHERE load_id = ?",
                                                              load["load_id"])[0][0] == "failed", 30, "the load ended")
        (reason,), = stack.sql("SELECT reason FROM loads WHERE load_id = ?", load["load_id"])
        assert "exited unexpectedly (code -9)" in reason, reason
        assert "the last line of its log: " in reason and reason.split("its log: ")[1].strip(), reason
        healing = await asyncio.to_thread(wait_until, lambda: (s := stack.get("/api/v1/models/tiny/status").json())[
            "load"] and s["load"]["load_id"] != load["load_id"] and s["load"], 30, "the model healing")
        assert healing["reason"].startswith(f"heals {load['load_id']}, which failed: ") and reason in healing["reason"]
        assert pid_alive(stack.fellows[0].proc.pid)  # the fellow lives on, ready for the next load
    finally:
        stack.stop()
