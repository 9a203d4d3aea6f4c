"""Rings across fellow processes over a real bus: greedy equals the model alone, timing, refusals, a lost stage."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
import uuid

import httpx
import msgspec
import pytest

from core.bus import connect
from core.nats_server import EmbeddedNats
from events.frames import DoneFrame, ErrorFrame, StartFrame, TokenFrame, frame_decoder
from events.requests import ChatMessage, ChatRequest, Sampling
from tests.processes import pid_alive, wait_until
from tests.serving_fixtures import Stack, chat_over_bus, hf_greedy, make_servable

PROMPTS = ["What is a list comprehension?", "hi", "Explain the with statement in Python, with an example or two.",
           "Name three colours."]
HIDDEN = 64


@pytest.fixture(scope="module")
def ring_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("ring-stack")
    hf, servable = make_servable(root / "models", "tiny", layers=4, hidden=HIDDEN, stages=2)
    legacy = servable.parent / "legacy"
    shutil.copytree(servable, legacy)
    manifest = json.loads((legacy / "servable.json").read_text())
    (legacy / "servable.json").write_text(json.dumps({**manifest, "model_id": "legacy", "boundaries": None}))
    nats = EmbeddedNats(root / "jetstream").start()
    # pieces of 8 tokens, so every prompt crosses the ring in several; one torch thread per stage process
    stack = Stack(root, nats.url, servable.parent, fellows=4, SWARM_SERVE_PREFILL_CHUNK=8, OMP_NUM_THREADS=1)
    try:
        stack.start()
        yield stack, nats.url, hf
    finally:
        stack.stop()
        nats.stop()


async def _bus(url):
    nc = await connect(url, name="ring-test")
    return nc, nc.jetstream()


async def _greedy_ring_equals_hf(stack, url, hf, num_stages: int, fellow_ids: list[str]) -> None:
    load = await asyncio.to_thread(stack.load, "tiny", num_stages=num_stages, fellow_ids=fellow_ids)
    assert [s["fellow_id"] for s in load["stages"]] == fellow_ids
    assert [tuple(s["layers"]) for s in load["stages"]][0][0] == 0 and load["stages"][-1]["layers"][1] == 4
    assert all(s["kv_tokens"] > 0 for s in load["stages"])
    sized = load["stages"][0]["kernels"]["ring"]  # stage 0 timed every stage's step and the links at start
    assert len(sized["step_ms"]) == num_stages and all(ms > 0 for ms in sized["step_ms"]) and sized["transit_ms"] > 0
    assert sized["groups"] >= num_stages and sized["in_flight"] == load["stages"][0]["max_in_flight"]
    nc, js = await _bus(url)
    try:
        replies = await asyncio.gather(*(chat_over_bus(nc, js, load["load_id"], "tiny", p, max_tokens=20)
                                         for p in PROMPTS))
        for prompt, (_, frames, tokens, _) in zip(PROMPTS, replies):
            done = frames[-1]
            assert isinstance(done, DoneFrame), (done, stack.logs())
            assert tokens == hf_greedy(hf, prompt, 20)
            t = done.timing
            # each link's route, chosen by timing both at start: direct on a quiet loopback, but a busy machine
            # (CI) once timed the relay faster on one link, so the choice is not asserted here
            assert set(t["route"].split(",")) <= {"direct", "relay"} and t["bytes_per_token"] == HIDDEN * 2
            assert {"stage0_ms", "link_ms", "prefill_ms"} <= set(t)
            assert all(f"stage{i}_ms" in t for i in range(1, num_stages)) or len(tokens) < 2
        # garbage on every ring lane is dropped, and the ring serves on
        for lane in ("act", "act1", "tok"):
            await nc.publish(f"swarm.ring.{load['load_id']}.{lane}", b"\x93not a frame")
        await nc.publish("swarm.evt.load.failed", b"[" * 100_000)  # and on the stages' load watch
        _, frames, tokens, _ = await chat_over_bus(nc, js, load["load_id"], "tiny", PROMPTS[0], max_tokens=20)
        assert isinstance(frames[-1], DoneFrame) and tokens == hf_greedy(hf, PROMPTS[0], 20)
        # the same prompt again: every stage took its whole blocks (16 positions each) from its prefix cache
        t = frames[-1].timing
        assert t["cached_tokens"] == (t["prompt_tokens"] - 1) // 16 * 16 > 0
        def relay_counted():  # each stage publishes its counts once a second: wait for the activations' bytes
            status = stack.get("/api/v1/models/tiny/status").json()
            lanes = status["load"]["relay"]
            act = lanes.get("act", {})
            return (lanes.get("tok", {}).get("frames") and act.get("bytes", 0) > act.get("frames", 0) * HIDDEN * 2
                    and status)

        status = await asyncio.to_thread(wait_until, relay_counted, 30, "relay stats of every stage")
        relay = status["load"]["relay"]
        assert relay["act"]["bytes"] > relay["act"]["frames"] * HIDDEN * 2 > 0
        pids = [s["pid"] for s in status["load"]["stages"]]
        assert all(pid_alive(p) for p in pids)
    finally:
        await nc.close()
    r = await asyncio.to_thread(stack.post, "/api/v1/models/tiny/unload")
    assert r.status_code == 200, r.text
    await asyncio.to_thread(wait_until, lambda: not any(pid_alive(p) for p in pids), 30, "stage processes gone")
    await asyncio.to_thread(wait_until, lambda: stack.get("/api/v1/models/tiny").json()["load_state"] == "unloaded",
                            30, "unloaded")


async def test_two_and_three_stage_rings_equal_hf_greedy_with_sessions_in_flight(ring_stack):
    stack, url, hf = ring_stack
    await _greedy_ring_equals_hf(stack, url, hf, 2, ["f1", "f0"])
    await _greedy_ring_equals_hf(stack, url, hf, 3, ["f0", "f1", "f2"])


async def test_two_ring_replicas_share_one_request_queue(ring_stack):
    stack, url, hf = ring_stack
    load = await asyncio.to_thread(stack.load, "tiny", num_stages=2, replicas=2)
    assert sorted((s["replica"], s["stage"]) for s in load["stages"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({s["fellow_id"] for s in load["stages"]}) == 4 and load["replicas"] == 2
    pids = [s["pid"] for s in load["stages"]]
    nc, js = await _bus(url)
    try:
        prompts = PROMPTS * 2
        replies = await asyncio.gather(*(chat_over_bus(nc, js, load["load_id"], "tiny", p, max_tokens=12)
                                         for p in prompts))
        for prompt, (_, frames, tokens, _) in zip(prompts, replies):
            assert isinstance(frames[-1], DoneFrame), (frames[-1], stack.logs())
            assert tokens == hf_greedy(hf, prompt, 12)
        # both rings pulled from the one queue: each request's start frame names the replica that took it
        assert {f.replica for _, frames, _, _ in replies for f in frames if isinstance(f, StartFrame)} == {0, 1}
    finally:
        await nc.close()
    r = await asyncio.to_thread(stack.post, "/api/v1/models/tiny/unload")
    assert r.status_code == 200, r.text
    await asyncio.to_thread(wait_until, lambda: not any(pid_alive(p) for p in pids), 30, "stage processes gone")
    await asyncio.to_thread(wait_until, lambda: stack.get("/api/v1/models/tiny").json()["load_state"] == "unloaded",
                            30, "unloaded")


async def test_a_servable_without_boundaries_is_refused_over_another_count(ring_stack):
    stack, _, _ = ring_stack
    r = await asyncio.to_thread(stack.post, "/api/v1/models/legacy/load", {"num_stages": 3, "wait": True})
    assert r.status_code == 409 and r.json()["error"]["code"] == "unsupported_num_stages"
    assert "records no boundaries" in r.json()["error"]["message"]
    r = await asyncio.to_thread(stack.post, "/api/v1/models/tiny/load",
                                {"num_stages": 2, "fellow_ids": ["f0", "f0"], "wait": True})
    assert r.status_code == 409 and "repeat" in r.json()["error"]["message"]


# a reply's length: the ring cannot finish it without the stage that is killed once its first tokens came
LONG_REPLY = 400


async def _first_tokens_then_end(nc, js, load_id: str, content: str, started: asyncio.Event, timeout: float = 60):
    rid = "rq-" + uuid.uuid4().hex[:12]
    frames, ended = [], asyncio.Event()

    async def on_frame(msg):
        frame = frame_decoder.decode(msg.data)
        frames.append(frame)
        if isinstance(frame, TokenFrame):
            started.set()
        if isinstance(frame, (DoneFrame, ErrorFrame)):
            ended.set()

    await nc.subscribe(f"swarm.tok.{rid}", cb=on_frame)
    req = ChatRequest(request_id=rid, load_id=load_id, model_id="tiny",
                      messages=[ChatMessage(role="user", content=content)], max_tokens=LONG_REPLY,
                      sampling=Sampling(temperature=0.0), created=time.time())
    await js.publish(f"swarm.req.{load_id}", msgspec.json.encode(req), headers={"Nats-Msg-Id": rid})
    await asyncio.wait_for(ended.wait(), timeout)
    return frames


async def test_a_middle_stage_killed_mid_stream_is_replaced_and_the_replies_finish_as_before(ring_stack):
    """f1 holds stage 1 of three and dies mid-stream: the leader places stage 1 on the spare f3, stage 0
    replays its sessions into the new ring, and each reply is what the model gives alone."""
    stack, url, hf = ring_stack
    load = await asyncio.to_thread(stack.load, "tiny", num_stages=3, fellow_ids=["f0", "f1", "f2"])
    lost_pid = load["stages"][1]["pid"]
    prompts = ["Tell me a story " * (i + 1) for i in range(2)]
    nc, js = await _bus(url)
    try:
        started = [asyncio.Event() for _ in prompts]
        replies = [asyncio.create_task(_first_tokens_then_end(nc, js, load["load_id"], p, started[i], timeout=120))
                   for i, p in enumerate(prompts)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        stack.fellows[1].kill(signal.SIGKILL)
        for prompt, frames in zip(prompts, await asyncio.gather(*replies)):
            done = frames[-1]
            assert isinstance(done, DoneFrame), (done, stack.logs())
            tokens = [t for f in sorted(frames, key=lambda f: f.seq) if isinstance(f, TokenFrame) for t in f.token_ids]
            assert tokens == hf_greedy(hf, prompt, LONG_REPLY)
            assert done.timing["replays"] == 1  # it was in flight when the stage went, and replayed
    finally:
        await nc.close()
    assert not pid_alive(lost_pid)
    status = stack.get("/api/v1/models/tiny/status").json()["load"]
    moved = status["stages"][1]
    assert moved["fellow_id"] == "f3" and moved["state"] == "ready" and status["state"] == "ready"
    assert [(r["from"], r["to"]) for r in moved["replaced"]] == [("f1", "f3")]
    perf = stack.get("/api/v1/models/tiny/performance").json()["load"]
    assert perf["stages"][1]["replaced"][0]["from"] == "f1"


async def _streamed_chat(http, content: str, started: asyncio.Event) -> tuple[str, str]:
    """(text, finish reason) of a greedy streamed chat through the gateway; ``started`` once text came."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": LONG_REPLY,
            "temperature": 0, "stream": True}
    text, finish = "", ""
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
                started.set() if text else None
    return text, finish


async def test_a_stage_no_fellow_can_take_over_fails_its_load_which_heals_and_its_replies_go_on(ring_stack):
    """The ring of the test before (f0, f3, f2) loses f3 with no fellow left to take stage 1: the load fails,
    leaves no stage process, and heals on the fellows left; the replies it was making go on there (leader
    .moves), each the reply it would have been."""
    stack, url, _ = ring_stack
    load = stack.get("/api/v1/models/tiny/status").json()["load"]
    assert [s["fellow_id"] for s in load["stages"]] == ["f0", "f3", "f2"]
    pids = [s["pid"] for s in load["stages"]]
    prompts = ["Tell me a story " * (i + 1) for i in range(2)]
    async with httpx.AsyncClient(base_url=stack.url, timeout=180) as http:
        whole = [await _streamed_chat(http, p, asyncio.Event()) for p in prompts]
        started = [asyncio.Event() for _ in prompts]
        replies = [asyncio.create_task(_streamed_chat(http, p, e)) for p, e in zip(prompts, started)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        stack.fellows[3].kill(signal.SIGKILL)
        await asyncio.to_thread(wait_until, lambda: not any(pid_alive(p) for p in pids), 30, "no stage process left")
        await asyncio.to_thread(wait_until, lambda: stack.sql("SELECT state FROM loads WHERE load_id = ?",
                                                              load["load_id"]) == [("failed",)], 30, "load failed")
        # the model heals (issue 53): the leader places it again on the fellows left, autoload off
        healed = await asyncio.to_thread(wait_until, lambda: (m := stack.get("/api/v1/models/tiny").json())[
            "load_state"] == "ready" and m["load_id"] != load["load_id"] and m["load_id"], 90, "the model healed")
        assert stack.sql("SELECT requested_by FROM loads WHERE load_id = ?", healed) == [("heal",)]
        stages = stack.get("/api/v1/models/tiny/status").json()["load"]["stages"]
        assert {s["fellow_id"] for s in stages} <= {"f0", "f2"}, stages
        assert await asyncio.wait_for(asyncio.gather(*replies), 120) == whole
