"""A ring loaded through the API: four in flight a stage by default, and stage 0's fellow's own
SWARM_SERVE_MAX_IN_FLIGHT and SWARM_SERVE_PREFILL_CHUNK bound its intake and prompt pieces (the lower of the
plan's and its own), which its ready event says; the ring still replies as the model alone."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from core.bus import connect
from core.nats_server import EmbeddedNats
from events.frames import DoneFrame
from events.loads import StageReady
from events.subjects import EVENTS_STREAM
from events.union import decode_event
from tests.processes import SwarmProcess
from tests.serving_fixtures import Stack, chat_over_bus, hf_greedy, make_servable

PROMPT = "Explain the with statement in Python, with an example or two."


@pytest.fixture(scope="module")
def bounded_ring(tmp_path_factory):
    root = tmp_path_factory.mktemp("bounded-ring")
    hf, servable = make_servable(root / "models", "tiny", layers=4, hidden=64, stages=2)
    nats = EmbeddedNats(root / "jetstream").start()
    stack = Stack(root, nats.url, servable.parent, fellows=2, OMP_NUM_THREADS=1)
    # stage 0's fellow holds fewer requests and cuts prompts finer than the leader plans (8 and 256)
    own = {**stack.env, "SWARM_SERVE_MAX_IN_FLIGHT": "3", "SWARM_SERVE_PREFILL_CHUNK": "8"}
    stack.fellows[0] = SwarmProcess(["fellow", "--id", "f0"], own, root / "fellow0.log")
    try:
        stack.start()
        yield stack, nats.url, hf
    finally:
        stack.stop()
        nats.stop()


async def stage_ready(url: str, load_id: str, fellow_id: str) -> StageReady:
    """The StageReady a fellow published for ``load_id``, read from SWARM_EVENTS (the load is ready: it is there)."""
    nc = await connect(url, name="bounds-test")
    try:
        sub = await nc.jetstream().pull_subscribe(  # the leader's and every fellow's (with or without its id)
            "swarm.evt.load.>", stream=EVENTS_STREAM,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=30.0))
        while True:
            for msg in await sub.fetch(64, timeout=10):
                evt = decode_event(msg.data)
                if isinstance(evt, StageReady) and (evt.load_id, evt.fellow_id) == (load_id, fellow_id):
                    return evt
    finally:
        await nc.close()


async def test_stage_0s_fellow_bounds_the_rings_intake_and_pieces_and_its_ready_event_says_so(bounded_ring):
    stack, url, hf = bounded_ring
    load = await asyncio.to_thread(stack.load, "tiny", num_stages=2, fellow_ids=["f0", "f1"])
    assert load["transport"]["max_in_flight"] == 8 and load["transport"]["in_flight_max"] == 8  # 4 x stages
    head, later = load["stages"]
    assert head["max_in_flight"] == 3  # SWARM_SERVE_MAX_IN_FLIGHT on f0, lower than the plan's 8
    assert later["max_in_flight"] == 8  # a later stage keeps the plan's
    ready = await stage_ready(url, load["load_id"], "f0")
    assert ready.stage == 0 and ready.max_in_flight == 3
    assert ready.bounds == ["max_in_flight 3, not the plan's 8: SWARM_SERVE_MAX_IN_FLIGHT=3 on stage 0's fellow",
                            "prefill_chunk 8, not the plan's 256: SWARM_SERVE_PREFILL_CHUNK=8 on stage 0's fellow"]
    assert (await stage_ready(url, load["load_id"], "f1")).bounds == []
    nc = await connect(url, name="bounds-chat")
    try:
        _, frames, tokens, _ = await chat_over_bus(nc, nc.jetstream(), load["load_id"], "tiny", PROMPT, max_tokens=12)
    finally:
        await nc.close()
    assert isinstance(frames[-1], DoneFrame), stack.logs()
    assert tokens == hf_greedy(hf, PROMPT, 12)
    assert frames[-1].timing["prompt_tokens"] > 8  # the prompt crossed the ring in pieces of 8
    r = await asyncio.to_thread(stack.post, "/api/v1/models/tiny/unload")
    assert r.status_code == 200, r.text
