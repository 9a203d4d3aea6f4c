"""Replicas: one-stage copies of a load on several fellows share its request queue.

Each replica pulls a request only when it has room, so a second fellow takes the overflow; a
replica that dies fails the requests it had started and nothing else; a request a replica took
but never acked is redelivered and served once, or, if that replica had already said it started
it, dropped (the gateway fails it): never both.
"""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec
import nats
import openai
import pytest

from core.nats_server import EmbeddedNats
from events import subjects
from events.frames import DoneFrame, StartFrame, frame_decoder, frame_msg_id
from events.requests import ChatMessage, ChatRequest, Sampling
from fellow.runtime.server.intake import ACK_WAIT_S
from tests.processes import pid_alive, wait_until
from tests.serving_fixtures import Stack, hf_greedy, make_servable

PROMPT = "Say something about lists."


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    hf_dir, _ = make_servable(root, "tiny", layers=2, hidden=64, stages=1, seed=11)
    server = EmbeddedNats(root / "js").start()
    # one request in flight per replica: a second request at the same time must go to the other fellow
    s = Stack(root, server.url, root / "servables", fellows=2, SWARM_SERVE_IN_FLIGHT=1).start()
    s.nats_url = server.url
    yield s, hf_dir
    s.stop()
    server.stop()


async def bus(s: Stack):
    return await nats.connect(s.nats_url)


def rows(s: Stack) -> dict[str, tuple]:
    return {r[0]: r[1:] for r in s.sql("select request_id, status, fellow_id, error_code from requests")}


def status(s: Stack) -> dict:
    return s.get("/api/v1/models/tiny/status").json()["load"]


async def test_load_with_two_replicas_places_one_per_fellow(stack):
    s, _ = stack
    bad = s.post("/api/v1/models/tiny/load", {"replicas": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "replicas"
    rings = s.post("/api/v1/models/tiny/load", {"replicas": 2, "num_stages": 2, "wait": True})  # 4 fellows needed
    assert rings.status_code == 409 and rings.json()["error"]["code"] == "placement_failed", rings.text
    load = s.load("tiny", replicas=2)
    assert load["replicas"] == 2
    assert sorted((st["replica"], st["stage"]) for st in load["stages"]) == [(0, 0), (1, 0)]
    assert {st["fellow_id"] for st in load["stages"]} == {"f0", "f1"}
    assert all(st["state"] == "ready" and st["kv_tokens"] > 0 for st in load["stages"])
    # each fellow reports its replica in its heartbeat, so the status shows both
    wait_until(lambda: all("metrics" in st for st in status(s)["stages"]), 10, "both replicas' metrics")


async def test_the_second_replica_takes_the_overflow(stack):
    s, hf_dir = stack
    async with openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        replies = await asyncio.gather(*(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=40, temperature=0)
            for _ in range(4)))
    ids = [r.id.removeprefix("chatcmpl-") for r in replies]
    wait_until(lambda: all(rows(s).get(rid, ("",))[0] == "finished" for rid in ids), 10, "the requests projected")
    served = rows(s)
    assert {served[rid][1] for rid in ids} == {"f0", "f1"}  # one request in flight each: both served
    want = hf_greedy(hf_dir, PROMPT, 40)
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(hf_dir)).decode(want, skip_special_tokens=True)
    assert {r.choices[0].message.content for r in replies} == {text}  # the same weights everywhere


async def publish_request(js, load_id: str, rid: str, max_tokens: int = 30) -> None:
    req = ChatRequest(request_id=rid, load_id=load_id, model_id="tiny",
                      messages=[ChatMessage(role="user", content=PROMPT)], max_tokens=max_tokens,
                      sampling=Sampling(temperature=0), created=0.0)
    await js.publish(subjects.request(load_id), msgspec.json.encode(req), headers={"Nats-Msg-Id": rid})


async def frames_of(js, rid: str) -> list:
    """Every frame of ``rid`` in SWARM_TOKENS, in order."""
    sub = await js.subscribe(subjects.tokens(rid), ordered_consumer=True)
    out = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:
                return out
            out.append(frame_decoder.decode(msg.data))
    finally:
        await sub.unsubscribe()


async def ghost_takes(js, load_id: str) -> tuple[ChatRequest, object]:
    """A replica stand-in: fetch the next request from the load's queue and never ack it."""
    psub = await js.pull_subscribe_bind(durable=subjects.request_consumer(load_id), stream=subjects.REQUESTS_STREAM)
    msg = (await psub.fetch(1, timeout=10))[0]
    return msgspec.json.decode(msg.data, type=ChatRequest), psub


async def freeze_every_replica(s: Stack, js, load_id: str) -> list[int]:
    """SIGSTOP every stage process, then wait until none of their pull requests is still open at the
    server (one left open would be handed the next request while its process is frozen)."""
    pids = [st["pid"] for st in status(s)["stages"] if st["state"] == "ready"]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)

    async def drained():
        while (await js.consumer_info(subjects.REQUESTS_STREAM, subjects.request_consumer(load_id))).num_waiting:
            await asyncio.sleep(0.05)
    await asyncio.wait_for(drained(), 10)
    return pids


async def ghost_dies(s: Stack, js, load_id: str, rid: str, says_started: bool) -> StartFrame | None:
    """With every real replica frozen, a stand-in takes request ``rid``, maybe sends its start frame,
    and dies before it acks; then the real replicas go on."""
    pids = await freeze_every_replica(s, js, load_id)
    start = None
    try:
        await publish_request(js, load_id, rid)
        req, ghost = await ghost_takes(js, load_id)
        assert req.request_id == rid
        if says_started:
            start = StartFrame(request_id=rid, seq=0, fellow_id="ghost", replica=7)
            await js.publish(subjects.tokens(rid), msgspec.json.encode(start),
                             headers={"Nats-Msg-Id": frame_msg_id(rid, 0)})
        await ghost.unsubscribe()
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    return start


async def test_a_request_taken_and_never_acked_is_served_once_by_another_replica(stack):
    s, _ = stack
    load_id = status(s)["load_id"]
    nc = await bus(s)
    js = nc.jetstream()
    await ghost_dies(s, js, load_id, "rq-ghost-silent", says_started=False)  # dies before it says anything

    async def finished():
        while not any(isinstance(f, DoneFrame) for f in await frames_of(js, "rq-ghost-silent")):
            await asyncio.sleep(0.2)
    await asyncio.wait_for(finished(), ACK_WAIT_S + 30)  # redelivered after the ack wait
    frames = await frames_of(js, "rq-ghost-silent")
    assert isinstance(frames[0], StartFrame) and frames[0].fellow_id in ("f0", "f1")
    assert [type(f) for f in frames].count(DoneFrame) == 1 and isinstance(frames[-1], DoneFrame)
    assert [f.seq for f in frames] == list(range(len(frames)))
    await nc.close()


async def test_a_request_started_by_a_replica_that_died_is_not_served_again(stack):
    s, _ = stack
    load_id = status(s)["load_id"]
    nc = await bus(s)
    js = nc.jetstream()
    # says it started the request, then dies before it acks: the gateway fails it, nobody serves it
    start = await ghost_dies(s, js, load_id, "rq-ghost-started", says_started=True)

    async def settled():
        while True:
            info = await js.consumer_info(subjects.REQUESTS_STREAM, subjects.request_consumer(load_id))
            if not info.num_pending and not info.num_ack_pending:
                return info
            await asyncio.sleep(0.2)
    await asyncio.wait_for(settled(), ACK_WAIT_S + 30)
    frames = await frames_of(js, "rq-ghost-started")
    assert frames == [start]  # redelivered, seen as started elsewhere, acked and dropped
    logs = s.logs()
    assert "rq-ghost-started was started by another replica" in logs
    await nc.close()


async def test_a_request_whose_claim_is_refused_after_its_prompt_ran_sends_nothing_and_frees_its_room(stack):
    """A stage runs a request's prompt while its start frame is acked; another's frame is there already
    (on the first delivery, so the stage does not look first): refused, it drops the request, sends no
    frame and no request event, and serves on with the room given back."""
    s, _ = stack
    load_id = status(s)["load_id"]
    nc = await bus(s)
    js = nc.jetstream()
    start = StartFrame(request_id="rq-claimed-first", seq=0, fellow_id="ghost", replica=7)
    await js.publish(subjects.tokens("rq-claimed-first"), msgspec.json.encode(start),
                     headers={"Nats-Msg-Id": frame_msg_id("rq-claimed-first", 0)})
    await publish_request(js, load_id, "rq-claimed-first", max_tokens=2)

    async def acked():
        while True:
            info = await js.consumer_info(subjects.REQUESTS_STREAM, subjects.request_consumer(load_id))
            if not info.num_pending and not info.num_ack_pending:
                return
            await asyncio.sleep(0.1)
    await asyncio.wait_for(acked(), 30)
    assert await frames_of(js, "rq-claimed-first") == [start]
    assert "rq-claimed-first was started by another replica" in s.logs()
    assert "rq-claimed-first" not in rows(s)
    for i in range(3):  # more than either replica's room would hold if the dropped one kept its place
        await publish_request(js, load_id, f"rq-after-drop-{i}", max_tokens=2)
    for i in range(3):
        async def done(rid=f"rq-after-drop-{i}"):
            while not any(isinstance(f, DoneFrame) for f in await frames_of(js, rid)):
                await asyncio.sleep(0.2)
        await asyncio.wait_for(done(), 60)
    await nc.close()


async def test_a_lost_replica_moves_its_own_requests_and_the_load_serves_on(stack):
    """The request the lost replica had started goes on at the other (leader.moves, issue 53)."""
    s, _ = stack
    nc = await bus(s)
    starts: dict[str, StartFrame] = {}

    async def on_frame(msg):
        frame = frame_decoder.decode(msg.data)
        if isinstance(frame, StartFrame):
            starts[frame.request_id] = frame
    await nc.subscribe("swarm.tok.*", cb=on_frame)
    async with openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        doomed = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                      max_tokens=3000, temperature=0, stream=True)
        first = await doomed.__anext__()
        rid = first.id.removeprefix("chatcmpl-")
        await asyncio.wait_for(_until(lambda: rid in starts), 10)
        victim = starts[rid].fellow_id
        survivor = "f1" if victim == "f0" else "f0"
        stage_pid = next(st["pid"] for st in status(s)["stages"] if st["fellow_id"] == victim)
        os.kill(stage_pid, signal.SIGSTOP)  # freeze its generation, then lose its fellow
        await asyncio.to_thread(s.fellows[int(victim[1:])].kill, signal.SIGKILL)
        async for chunk in doomed:  # no error: it moved
            pass
        assert chunk.choices[0].finish_reason == "length", chunk
        await asyncio.to_thread(wait_until, lambda: not pid_alive(stage_pid), 30, "the lost replica's stage gone")

        # the load serves on with the other replica
        load = status(s)
        assert load["state"] == "ready", load
        states = {st["fellow_id"]: st["state"] for st in load["stages"]}
        assert states == {victim: "failed", survivor: "ready"}, states
        reply = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                     max_tokens=10, temperature=0)
    last = reply.id.removeprefix("chatcmpl-")
    await asyncio.to_thread(wait_until, lambda: rows(s).get(last, ("",))[0] == "finished", 10, "the reply recorded")
    assert rows(s)[last][:2] == ("finished", survivor)
    await asyncio.to_thread(wait_until, lambda: rows(s)[rid][0] == "finished", 60, "the moved request recorded")
    assert rows(s)[rid][:2] == ("finished", survivor)

    # with the last replica gone the load itself ends
    await asyncio.to_thread(s.fellows[int(survivor[1:])].kill, signal.SIGKILL)
    load_id = load["load_id"]

    def ended() -> tuple[str, str]:
        return s.sql("select state, reason from loads where load_id = ?", load_id)[0]
    await asyncio.to_thread(wait_until, lambda: ended()[0] == "failed", 30, "the load failed")
    assert "no replica is left" in ended()[1] and survivor in ended()[1], ended()
    await nc.close()


async def _until(check) -> None:
    while not check():
        await asyncio.sleep(0.02)


async def test_of_two_replicas_starting_one_request_only_the_first_serves_it(nc, js):
    """A replica frozen past the ack wait and the one handed the redelivery may both reach the start
    frame: JetStream stores the first (same message id) and tells the second it was a duplicate."""
    from fellow.token_batcher import TokenBatcher

    first, second = TokenBatcher(nc, js, "rq-claimed"), TokenBatcher(nc, js, "rq-claimed")
    assert await first.start("f0", 0) is True
    assert await second.start("f1", 1) is False
    stored = await js.get_last_msg(subjects.TOKENS_STREAM, subjects.tokens("rq-claimed"))
    assert frame_decoder.decode(stored.data) == StartFrame(request_id="rq-claimed", seq=0, fellow_id="f0", replica=0)
