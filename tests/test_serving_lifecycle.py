"""Every path that ends a stage gives its process back: eviction, idle, unload, stop, update, shutdown."""

from __future__ import annotations

import asyncio
import hashlib
import io
import signal
import tarfile

import httpx
import pytest

from core.bus import publish_struct
from events import subjects
from events.commands import StopFellow, UpdateFellow
from events.frames import DoneFrame
from tests.processes import pid_alive, wait_until
from tests.serving_fixtures import Stack, chat_over_bus, make_servable


@pytest.fixture(scope="module")
def servables(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_servable(root, "tiny-a", layers=2, hidden=64, stages=1, seed=1)
    make_servable(root, "tiny-b", layers=2, hidden=64, stages=1, seed=2)
    return root / "servables"


def state_of(stack: Stack, model_id: str) -> str:
    return stack.get(f"/api/v1/models/{model_id}").json()["load_state"]


def test_archive_is_resumable_and_checksummed(tmp_path, nats_server, servables):
    stack = Stack(tmp_path, nats_server.url, servables, fellows=0).start()
    try:
        whole = stack.get("/api/v1/models/tiny-a/archive")
        assert whole.status_code == 200
        digest = whole.headers["x-swarm-sha256"]
        assert hashlib.sha256(whole.content).hexdigest() == digest
        names = tarfile.open(fileobj=io.BytesIO(whole.content)).getnames()
        assert "servable.json" in names and any(n.startswith("shards/stage-0/") for n in names)
        part = httpx.get(stack.url + "/api/v1/models/tiny-a/archive", headers={"Range": "bytes=100-"})
        assert part.status_code == 206 and part.content == whole.content[100:]
        assert part.headers["content-range"] == f"bytes 100-{len(whole.content) - 1}/{len(whole.content)}"
        bad = httpx.get(stack.url + "/api/v1/models/tiny-a/archive", headers={"Range": f"bytes={10**9}-"})
        assert bad.status_code == 416 and bad.json()["error"]["code"] == "range_not_satisfiable"
        missing = stack.get("/api/v1/models/nope/archive")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    finally:
        stack.stop()


def test_fetch_evict_and_idle_unload(tmp_path, nats_server, servables):
    stack = Stack(tmp_path, nats_server.url, servables, SWARM_FELLOW_FETCH="always",
                  SWARM_MAX_LOADED_MODELS=1, SWARM_MODEL_IDLE_UNLOAD_S=4).start()
    try:
        a = stack.load("tiny-a")
        cache = tmp_path / "data" / "models"
        assert [p.name for p in cache.iterdir() if p.name.startswith("tiny-a-") and p.is_dir()]
        pid_a = a["stages"][0]["pid"]
        b = stack.load("tiny-b")  # one model per fellow: the oldest is evicted first
        pid_b = b["stages"][0]["pid"]
        wait_until(lambda: not pid_alive(pid_a), 30, "evicted process gone")
        wait_until(lambda: state_of(stack, "tiny-a") == "unloaded", 30, "tiny-a unloaded")
        assert pid_alive(pid_b)
        wait_until(lambda: not pid_alive(pid_b), 60, "idle process reaped")
        wait_until(lambda: state_of(stack, "tiny-b") == "unloaded", 30, "tiny-b unloaded")
    finally:
        stack.stop()


async def test_cancel_frees_the_session_and_its_tokens(tmp_path, nats_server, nc, js, servables):
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, servables,
                                                  SWARM_MODEL_IDLE_UNLOAD_S=0).start())
    try:
        load = await asyncio.to_thread(stack.load, "tiny-b")
        rid = "rq-cancel-me"
        seen = asyncio.Event()

        async def cancel_after_first_token(msg):
            if b'"tokens"' in msg.data and not seen.is_set():
                seen.set()
                await nc.publish(subjects.cancel(load["load_id"], rid), b"")

        watcher = await nc.subscribe(f"swarm.tok.{rid}", cb=cancel_after_first_token)
        _, frames, tokens, _ = await chat_over_bus(nc, js, load["load_id"], "tiny-b", "Tell me everything.",
                                                   max_tokens=2000, temperature=1.0, seed=3, request_id=rid)
        await watcher.unsubscribe()
        done = frames[-1]
        assert isinstance(done, DoneFrame) and done.finish_reason == "cancelled", done
        assert done.completion_tokens < 2000

        def freed():
            m = stack.get("/api/v1/models/tiny-b/status").json()["load"]["stages"][0].get("metrics", {})
            return m.get("in_flight") == 0 and m.get("requests") == 1

        await asyncio.to_thread(wait_until, freed, 30, "the fellow reports nothing in flight")
        # Its tokens went back to the pool: a request needing nearly the whole budget is served now.
        _, frames, _, _ = await chat_over_bus(nc, js, load["load_id"], "tiny-b", "hi", max_tokens=4)
        assert isinstance(frames[-1], DoneFrame)
    finally:
        stack.stop()


async def test_stop_update_and_shutdown_release_the_stage(tmp_path, nats_server, nc, js, servables):
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, servables, fellows=2).start())
    try:
        # update: the stage stops first, then the agent re-execs itself (same pid, new start time)
        load = await asyncio.to_thread(stack.load, "tiny-a", fellow_id="f0")
        pid = load["stages"][0]["pid"]
        await publish_struct(js, "swarm.cmd.f0.update", UpdateFellow(), msg_id="update-f0")
        await asyncio.to_thread(wait_until, lambda: not pid_alive(pid), 30, "stage stopped before update")
        assert stack.fellows[0].proc.poll() is None  # the agent itself lives on, re-executed
        # stop command: stages stop and the agent exits
        load = await asyncio.to_thread(stack.load, "tiny-b", fellow_id="f1")
        pid = load["stages"][0]["pid"]
        await publish_struct(js, "swarm.cmd.f1.stop", StopFellow(), msg_id="stop-f1")
        await asyncio.to_thread(wait_until, lambda: not pid_alive(pid), 30, "stage stopped by stop command")
        await asyncio.to_thread(wait_until, lambda: stack.fellows[1].proc.poll() is not None, 30, "agent exited")
        # shutdown (SIGTERM to the agent)
        await asyncio.to_thread(wait_until, lambda: any(
            f["id"] == "f0" and f["status"] == "online" for f in stack.get("/api/v1/fellows").json()["data"]),
            30, "f0 back after update")
        load = await asyncio.to_thread(stack.load, "tiny-a", fellow_id="f0")
        pid = load["stages"][0]["pid"]
        stack.fellows[0].proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(wait_until, lambda: not pid_alive(pid), 30, "stage stopped at shutdown")
        assert stack.fellows[0].proc.wait(30) == 0
    finally:
        stack.stop()
