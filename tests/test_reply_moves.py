"""A reply that outlives its stage (issue 53): a one-stage load of two replicas, the stage serving a request
SIGKILLed mid-reply; the request goes on at a healthy stage (leader.moves).

Real nats-server, leader, two fellows and their stage processes. The streamed and the non-streamed reply
carry no error and equal the uninterrupted greedy reply, usage counts each token once, the row is
finished, and the move is a RequestMoved event naming the fellow whose stage died (a request_moves row).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter

import httpx
import msgspec
import pytest

from events import subjects
from events.frames import StartFrame, TokenFrame, frame_decoder
from events.moves import RequestMoved
from tests.processes import wait_until
from tests.request_helpers import chat, servables  # noqa: F401 (the module's servable)
from tests.serving_fixtures import Stack

pytestmark = pytest.mark.slow

BODY = chat("Tell me a long story", max_tokens=3000, temperature=0)


async def streamed(http: httpx.AsyncClient, on_text=None, body: dict = BODY) -> tuple[str, list[dict]]:
    """(the reply's text, its chunks) of a streamed greedy chat with usage; ``on_text(request_id)`` is
    awaited once the first text came."""
    chunks, text = [], ""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line[6:]))
            piece = "".join(c["delta"].get("content") or "" for c in chunks[-1].get("choices", []))
            if piece and not text and on_text is not None:
                await on_text(chunks[-1]["id"].removeprefix("chatcmpl-"))
            text += piece
    return text, chunks


def stage_pids(stack: Stack) -> dict[tuple[str, int], int]:
    """(fellow, replica) -> pid of each stage, once every one is ready (read ahead: a kill must be quick)."""
    def ready():
        stages = stack.get("/api/v1/models/tiny-a/status").json()["load"]["stages"]
        return all(s["state"] == "ready" for s in stages) and {(s["fellow_id"], s["replica"]): s["pid"]
                                                               for s in stages}
    return wait_until(ready, 60, "every stage ready")


async def kill_its_stage(js, pids: dict, request_id: str) -> str:
    """SIGKILL the stage process that took the request (its start frame names the fellow); that fellow."""
    first = await js.get_msg(subjects.TOKENS_STREAM, seq=1, subject=subjects.tokens(request_id), next=True)
    start = frame_decoder.decode(first.data)
    assert isinstance(start, StartFrame), start
    os.kill(pids[start.fellow_id, start.replica], signal.SIGKILL)
    return start.fellow_id


async def next_token_at(js, request_id: str, seq: int) -> float:
    """When SWARM_TOKENS stored the first token frame after frame ``seq`` (a moved request's new start)."""
    subject, at = subjects.tokens(request_id), 0
    while True:
        msg = await js.get_msg(subjects.TOKENS_STREAM, seq=at + 1, subject=subject, next=True)
        at, frame = msg.seq, frame_decoder.decode(msg.data)
        if isinstance(frame, TokenFrame) and frame.seq > seq:
            return msg.time.timestamp()


async def moves_of(js, request_id: str) -> RequestMoved:
    msg = await js.get_msg(subjects.EVENTS_STREAM, subject=subjects.event("request.moved"))
    evt = msgspec.json.decode(msg.data, type=RequestMoved)
    assert evt.request_id == request_id, evt
    return evt


def two_replicas(tmp_path, url: str, root) -> Stack:
    """A stack of two fellows with tiny-a loaded on both (one replica each), autoload off."""
    stack = Stack(tmp_path, url, root, fellows=2, SWARM_AUTOLOAD=0, SWARM_MODEL_IDLE_UNLOAD_S=0,
                  OMP_NUM_THREADS=1).start()
    try:
        stack.load("tiny-a", replicas=2)
    except BaseException:
        stack.stop()
        raise
    return stack


async def test_a_reply_goes_on_at_another_stage_when_its_stage_dies(tmp_path, nats_server, nc, servables):  # noqa: F811
    stack = await asyncio.to_thread(two_replicas, tmp_path, nats_server.url, servables)
    js = nc.jetstream()
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=180) as http:
            before, chunks = await streamed(http)
            ours = [chunks[0]["id"].removeprefix("chatcmpl-")]
            usage = {k: chunks[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
            assert usage["completion_tokens"] >= 1000, usage  # long enough to be cut

            victims: list[tuple[str, str, float]] = []
            pids = await asyncio.to_thread(stage_pids, stack)

            async def kill(rid: str) -> None:
                victims.append((rid, await kill_its_stage(js, pids, rid), time.time()))

            text, chunks = await streamed(http, kill)  # streamed: cut after its first text
            assert not any("error" in c for c in chunks), chunks[-1]
            assert text == before
            assert {k: chunks[-1]["usage"][k] for k in usage} == usage, (chunks[-1]["usage"], usage)
            assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
            rid, victim, killed_at = victims[0]
            ours.append(rid)
            moved = await moves_of(js, rid)
            # the figure of docs/reliability.md section 16 (printed, not asserted)
            print(f"kill to move {moved.at - killed_at:.3f} s; kill to the next token stored "
                  f"{await next_token_at(js, rid, moved.seq) - killed_at:.3f} s")
            assert moved.fellow_id == victim and moved.moves == 1 and 0 < moved.tokens < usage["completion_tokens"]

            pids = await asyncio.to_thread(stage_pids, stack)  # the killed one restarted
            under_way: asyncio.Future = asyncio.get_running_loop().create_future()
            counts: dict[str, int] = {}

            async def on_frame(msg) -> None:  # its start frame and two of tokens: under way
                counts[msg.subject] = counts.get(msg.subject, 0) + 1
                if counts[msg.subject] == 3 and not under_way.done():
                    under_way.set_result(msg.subject.removeprefix("swarm.tok."))
            sub = await nc.subscribe("swarm.tok.*", cb=on_frame)
            whole = asyncio.ensure_future(http.post("/v1/chat/completions", json=BODY))  # not streamed
            rid = await asyncio.wait_for(under_way, 60)
            ours.append(rid)
            await sub.unsubscribe()
            victim = await kill_its_stage(js, pids, rid)
            reply = await whole
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == before
            assert {k: reply.json()["usage"][k] for k in usage} == usage
            moved = await moves_of(js, rid)
            assert moved.fellow_id == victim and moved.tokens > 0
        got = await asyncio.to_thread(wait_until, lambda: (r := stack.sql(
            "SELECT status, completion_tokens FROM requests WHERE request_id IN (?, ?, ?)", *ours))
            and all(s != "accepted" for s, _ in r) and r, 30, "every row final")
        assert got == [("finished", usage["completion_tokens"])] * 3, got
        # the audit counts moves per fellow (request_moves, from RequestMoved)
        expected = sorted(Counter([victims[0][1], victim]).items())
        per_fellow = await asyncio.to_thread(wait_until, lambda: (r := sorted(stack.sql(
            "SELECT fellow_id, count(*) FROM request_moves GROUP BY fellow_id"))) == expected and r, 30, "the moves")
        assert per_fellow == expected
    finally:
        await asyncio.to_thread(stack.stop)


def usage_of(chunks: list[dict]) -> dict:
    return {k: chunks[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


async def test_stop_strings_penalties_and_a_grammar_go_on_at_the_next_stage(tmp_path, nats_server, nc,
                                                                          servables):  # noqa: F811
    """What a reply's next tokens depend on besides prompt + reply is rebuilt from the reply's ids at the next
    stage: the text held back while it may start a stop string, the counts presence and frequency penalties
    take over the reply, a grammar's state. Each reply, cut after its first text, equals the uninterrupted one."""
    penalised = {**BODY, "presence_penalty": 0.4, "frequency_penalty": 0.3, "min_tokens": 2000}
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 300, "maxItems": 300}
    shaped = {**BODY, "response_format": {"type": "json_schema", "json_schema": {"name": "ints", "schema": schema}}}
    stack = await asyncio.to_thread(two_replicas, tmp_path, nats_server.url, servables)
    js = nc.jetstream()
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=180) as http:
            free, chunks = await streamed(http, body=penalised)
            assert usage_of(chunks)["completion_tokens"] >= 1000, usage_of(chunks)
            # a stop string first found three quarters in: the cut comes long before it
            at = next(i for i in range(len(free) * 3 // 4, len(free)) if free.find(free[i:i + 6]) == i)
            stopped = {**penalised, "stop": [free[at:at + 6]]}
            cases = [(stopped, *(await streamed(http, body=stopped))), (shaped, *(await streamed(http, body=shaped)))]
            assert cases[0][1] == free[:at]
            assert [c["choices"][0]["finish_reason"] for c in cases[0][2] if c["choices"]][-1] == "stop"
            assert usage_of(cases[1][2])["completion_tokens"] >= 600, usage_of(cases[1][2])
            for body, before, chunks in cases:
                pids = await asyncio.to_thread(stage_pids, stack)  # every stage up (a killed one restarted)
                victims: list[tuple[str, str]] = []

                async def kill(rid: str) -> None:
                    victims.append((rid, await kill_its_stage(js, pids, rid)))

                text, moved_chunks = await streamed(http, kill, body=body)
                assert not any("error" in c for c in moved_chunks), moved_chunks[-1]
                assert text == before
                assert usage_of(moved_chunks) == usage_of(chunks)
                rid, victim = victims[0]
                moved = await moves_of(js, rid)
                assert moved.fellow_id == victim and 0 < moved.tokens < usage_of(chunks)["completion_tokens"]
                row = await asyncio.to_thread(wait_until, lambda: (r := stack.sql(
                    "SELECT status, completion_tokens FROM requests WHERE request_id = ?", rid))
                    and r[0][0] != "accepted" and r, 30, "the row final")
                assert row == [("finished", usage_of(chunks)["completion_tokens"])], row
    finally:
        await asyncio.to_thread(stack.stop)
