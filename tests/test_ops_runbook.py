"""docs/operations.md, tested: each JSON body it shows is published as written (ids filled in) with
nats-py and the system acts on it; each stream-level command is mirrored by the `$JS.API` request the
NATS CLI makes. The bodies and commands are read from the page, so the page cannot drift."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest

from core.bus import connect
from core.nats_server import EmbeddedNats
from events import subjects
from events.frames import DoneFrame, TokenFrame, frame_decoder
from events.logs import LogsReply
from events.requests import ChatMessage, ChatRequest, Sampling
from tests.processes import eventually, wait_until
from tests.serving_fixtures import Stack, chat_over_bus, make_servable

pytestmark = pytest.mark.slow
PAGE = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
MODEL = "tiny"
FELLOW = "f0"
SH_LINES = [line.strip() for block in re.findall(r"```sh\n(.*?)```", PAGE, re.S) for line in block.splitlines()]
BODIES = {m.group(2).strip("'"): m.group(3) for line in SH_LINES
          if (m := re.fullmatch(r"nats (pub|req) (\S+) '(.*)'", line))}
TABLE = [m.group(1) for m in re.finditer(r"^\| `(nats (?:stream|consumer) [^`]+)` \|", PAGE, re.M)]


def fill(text: str, load_id: str = "", request_id: str = "") -> str:
    return text.replace("FELLOW_ID", FELLOW).replace("LOAD_ID", load_id).replace("REQUEST_ID", request_id)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("runbook")
    _, out = make_servable(root, MODEL, layers=2, hidden=64, stages=1)
    (root / "jetstream").mkdir()
    nats = EmbeddedNats(root / "jetstream").start()
    s = Stack(root, nats.url, out.parent).start()
    s.nats_url = nats.url
    s.load_id = s.load(MODEL)["load_id"]
    try:
        yield s
    finally:
        s.stop()
        nats.stop()


async def api(nc, subject: str, body: dict | None = None) -> dict:
    """One JetStream API request, as the CLI makes it."""
    msg = await nc.request(subject, json.dumps(body or {}).encode(), timeout=5)
    reply = json.loads(msg.data)
    assert "error" not in reply, (subject, reply)
    return reply


async def view(nc, stream: str, filter_subject: str | None = None) -> list:
    """`nats stream view`: an ephemeral consumer, then its messages one MSG.NEXT at a time."""
    config = {"deliver_policy": "all", "ack_policy": "none", "inactive_threshold": 30_000_000_000}
    if filter_subject:
        config["filter_subject"] = filter_subject
    name = (await api(nc, f"$JS.API.CONSUMER.CREATE.{stream}", {"stream_name": stream, "config": config}))["name"]
    inbox = nc.new_inbox()
    replies: asyncio.Queue = asyncio.Queue()
    sub = await nc.subscribe(inbox, cb=replies.put)
    out = []
    try:
        while True:
            await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}",
                             json.dumps({"batch": 1, "no_wait": True}).encode(), reply=inbox)
            msg = await asyncio.wait_for(replies.get(), 5)
            if msg.headers and msg.headers.get("Status"):  # 404: no more messages
                return out
            out.append(msg)
    finally:
        await sub.unsubscribe()


@pytest.fixture
async def nc(stack):
    client = await connect(stack.nats_url, name="runbook")
    yield client
    await client.close()


def test_the_page_lists_what_the_tests_run():
    assert set(BODIES) == {"swarm.logs.FELLOW_ID", "swarm.cancel.LOAD_ID.REQUEST_ID", "swarm.cmd.FELLOW_ID.unload",
                           "swarm.cmd.FELLOW_ID.stop"}
    stream_commands = {line for line in SH_LINES if re.match(r"nats (stream|consumer) ", line)}
    assert stream_commands and stream_commands <= set(TABLE), stream_commands - set(TABLE)
    assert set(TABLE) == set(MIRRORED), set(TABLE) ^ set(MIRRORED)


async def test_streams_info_and_events(stack, nc):
    listed = await api(nc, "$JS.API.STREAM.LIST")
    assert {s["config"]["name"]: s["config"]["subjects"] for s in listed["streams"]} == \
        {spec.name: spec.subjects for spec in subjects.STREAMS}
    for name in {s.name for s in subjects.STREAMS}:
        assert f"| {name} |" in PAGE
    info = await api(nc, "$JS.API.STREAM.INFO.SWARM_EVENTS")
    assert info["state"]["messages"] > 0
    first = (await api(nc, "$JS.API.STREAM.MSG.GET.SWARM_EVENTS", {"seq": 1}))["message"]
    assert first["seq"] == 1 and first["subject"].startswith("swarm.evt.")
    every = await view(nc, "SWARM_EVENTS")
    assert len(every) >= info["state"]["messages"]
    loads = await view(nc, "SWARM_EVENTS", "swarm.evt.load.>")
    assert {json.loads(m.data)["type"] for m in loads} >= {"load.requested", "load.placed", "load.loaded"}
    assert await view(nc, "SWARM_EVENTS", "swarm.evt.load.failed") == []


async def test_follow_a_request_then_cancel_one(stack, nc):
    js = nc.jetstream()
    rid, frames, tokens, _ = await chat_over_bus(nc, js, stack.load_id, MODEL, "What is a list?", max_tokens=5)
    assert isinstance(frames[-1], DoneFrame) and tokens  # chat_over_bus follows swarm.tok.<rid>, as `nats sub`
    stored = [frame_decoder.decode(m.data) for m in await view(nc, "SWARM_TOKENS", f"swarm.tok.{rid}")]
    assert [f.seq for f in stored] == [f.seq for f in frames]  # the same frames, kept in the stream
    async def finished() -> bool:  # the fellow reports the request once its done frame is out
        events = [json.loads(m.data) for m in await view(nc, "SWARM_EVENTS", "swarm.evt.request.>")]
        return any(e["type"] == "request.finished" and e["request_id"] == rid for e in events)

    await eventually(finished, 30, f"request.finished for {rid} in SWARM_EVENTS")

    rid = "rq-" + uuid.uuid4().hex[:12]
    first, done = asyncio.Event(), asyncio.get_running_loop().create_future()

    async def on_frame(msg):
        frame = frame_decoder.decode(msg.data)
        if isinstance(frame, TokenFrame):
            first.set()
        elif isinstance(frame, DoneFrame) and not done.done():
            done.set_result(frame)

    sub = await nc.subscribe(fill("swarm.tok.REQUEST_ID", request_id=rid), cb=on_frame)
    req = ChatRequest(request_id=rid, load_id=stack.load_id, model_id=MODEL, max_tokens=2000,
                      sampling=Sampling(min_tokens=2000),  # only the cancel ends it (400 tokens ended first once)
                      messages=[ChatMessage(role="user", content="Tell me a long story.")], created=time.time())
    await js.publish(subjects.request(stack.load_id), msgspec.json.encode(req))
    await asyncio.wait_for(first.wait(), 60)
    subject, body = "swarm.cancel.LOAD_ID.REQUEST_ID", BODIES["swarm.cancel.LOAD_ID.REQUEST_ID"]
    await nc.publish(fill(subject, stack.load_id, rid), body.encode())
    ended = await asyncio.wait_for(done, 60)
    await sub.unsubscribe()
    assert ended.finish_reason == "cancelled" and ended.completion_tokens < 2000


async def test_logs_request(stack, nc):
    body = BODIES["swarm.logs.FELLOW_ID"]
    msg = await nc.request(fill("swarm.logs.FELLOW_ID"), body.encode(), timeout=5)
    reply = msgspec.json.decode(msg.data, type=LogsReply)
    assert reply.fellow_id == FELLOW and not reply.error and 0 < len(reply.lines) <= 20
    assert [(s.load_id, s.stage) for s in reply.stages] == [(stack.load_id, 0)] and reply.stages[0].lines
    bad = msgspec.json.decode((await nc.request(fill("swarm.logs.FELLOW_ID"), b"{tail", timeout=5)).data,
                              type=LogsReply)
    assert bad.error.startswith("not a logs request") and not bad.lines  # a bad body: a clear refusal


async def test_consumer_lag_and_purging_a_stuck_queue(stack, nc):
    listed = await api(nc, "$JS.API.CONSUMER.LIST.SWARM_REQUESTS")
    assert subjects.request_consumer(stack.load_id) in {c["name"] for c in listed["consumers"]}
    lag = await api(nc, fill("$JS.API.CONSUMER.INFO.SWARM_REQUESTS.load-LOAD_ID", stack.load_id))
    assert lag["num_pending"] == 0 and lag["num_ack_pending"] == 0  # everything asked was served
    commands = await api(nc, fill("$JS.API.CONSUMER.INFO.SWARM_COMMANDS.fellow-FELLOW_ID"))
    assert commands["name"] == subjects.command_consumer(FELLOW) and commands["num_pending"] == 0

    stuck = "ld-stuck" + uuid.uuid4().hex[:6]  # a load whose stages are gone: nothing takes its queue
    for i in range(3):
        await nc.jetstream().publish(subjects.request(stuck), b"{}")
    queued = await api(nc, "$JS.API.STREAM.INFO.SWARM_REQUESTS", {"subjects_filter": subjects.request(stuck)})
    assert queued["state"]["subjects"] == {subjects.request(stuck): 3}
    purged = await api(nc, "$JS.API.STREAM.PURGE.SWARM_REQUESTS", {"filter": fill("swarm.req.LOAD_ID", stuck)})
    assert purged["success"] and purged["purged"] == 3
    after = await api(nc, "$JS.API.STREAM.INFO.SWARM_REQUESTS", {"subjects_filter": subjects.request(stuck)})
    assert not after["state"].get("subjects")


async def test_commands_unload_then_stop(stack, nc):
    subject = "swarm.cmd.FELLOW_ID.unload"
    ack = json.loads((await nc.request(fill(subject), fill(BODIES[subject], stack.load_id).encode(), timeout=5)).data)
    assert ack["stream"] == subjects.COMMANDS_STREAM and ack["seq"] > 0

    for _ in range(300):  # the fellow takes the command from its queue, then reports what it did
        unloaded = [json.loads(m.data) for m in await view(nc, "SWARM_EVENTS", "swarm.evt.load.unloaded")]
        if any(e["load_id"] == stack.load_id and e["reason"] == "operator" for e in unloaded):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("no load.unloaded with the operator's reason")
    await asyncio.to_thread(wait_until, lambda: httpx.get(f"{stack.url}/api/v1/models/{MODEL}").json()["load_state"]
                            == "unloaded", 30, "the model unloaded")

    subject = "swarm.cmd.FELLOW_ID.stop"
    ack = json.loads((await nc.request(fill(subject), BODIES[subject].encode(), timeout=5)).data)
    assert ack["stream"] == subjects.COMMANDS_STREAM
    assert await asyncio.to_thread(stack.fellows[0].proc.wait, 30) == 0


# Which test makes each stream-level command's request (the page's table must list exactly these).
MIRRORED = {
    "nats stream ls": test_streams_info_and_events,
    "nats stream info SWARM_EVENTS": test_streams_info_and_events,
    "nats stream view SWARM_EVENTS": test_streams_info_and_events,
    "nats stream view SWARM_EVENTS --subject 'swarm.evt.request.>'": test_follow_a_request_then_cancel_one,
    "nats stream view SWARM_EVENTS --subject swarm.evt.load.failed": test_streams_info_and_events,
    "nats stream get SWARM_EVENTS 1": test_streams_info_and_events,
    "nats stream view SWARM_TOKENS --subject swarm.tok.REQUEST_ID": test_follow_a_request_then_cancel_one,
    "nats consumer ls SWARM_REQUESTS": test_consumer_lag_and_purging_a_stuck_queue,
    "nats consumer info SWARM_REQUESTS load-LOAD_ID": test_consumer_lag_and_purging_a_stuck_queue,
    "nats consumer info SWARM_COMMANDS fellow-FELLOW_ID": test_consumer_lag_and_purging_a_stuck_queue,
    "nats stream purge SWARM_REQUESTS --subject swarm.req.LOAD_ID --force": test_consumer_lag_and_purging_a_stuck_queue,
}
