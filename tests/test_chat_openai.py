"""The official openai client against the gateway on a real uvicorn server, the bus and SQLite.

The serving stage's side of the protocol is played by `ServingPeer` on the real bus (the
fellow's own end-to-end tests cover a real model); what is checked here is how the gateway
turns requests into ChatRequests and frames into OpenAI replies, errors and cancels.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from core.bus import publish_event
from events import subjects
from events.frames import TokenFrame
from events.loads import LoadFailed
from leader.app import create_app
from leader.context import Leader
from leader.db.tables import Request as RequestRow
from tests.chat_fixtures import (
    GENERATION,
    READY,
    Gateway,
    ServingPeer,
    StandInServing,
    cataloged_servable,
    served,
    wait_cancel,
)
from tests.conftest import make_settings

TIMING = {"stage0_ms": 1.5, "link_ms": 0.0, "stage1_ms": 0.0, "prefill_ms": 3.0, "bytes_per_token": 0,
          "route": "local"}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def gateway(tmp_path, nats_server, sqlite_url):
    root = tmp_path / "servables"
    cataloged_servable(root, "cataloged")
    settings = make_settings(tmp_path, nats_server.url, sqlite_url, SWARM_SERVABLE_MODELS_ROOT=root,
                             SWARM_STREAM_RESUME_S=0.5)  # a streaming client's hang-up cancels after 0.5 s
    leader = Leader(settings, serving=StandInServing)
    async with served(create_app(settings, leader, chat_timeout_s=20.0)) as url:
        yield Gateway(url, leader)


@pytest.fixture
async def client(gateway):
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


async def test_error_objects_raise_the_sdk_exceptions(client):
    with pytest.raises(openai.NotFoundError) as exc:
        await client.chat.completions.create(model="nope", messages=MSGS)
    assert exc.value.code == "model_not_found" and exc.value.param == "model"
    with pytest.raises(openai.ConflictError) as exc:
        await client.chat.completions.create(model="cataloged", messages=MSGS)
    assert exc.value.code == "model_not_loaded" and "model-load cataloged" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=READY.model_id, messages=MSGS, n=0)
    assert exc.value.param == "n" and exc.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=READY.model_id, messages=MSGS, stream=True, temperature=3)
    assert exc.value.param == "temperature"


async def test_a_reply_in_one_piece_with_usage_and_timing(client, js):
    peer = ServingPeer(js)
    reply = asyncio.ensure_future(client.chat.completions.create(
        model=READY.model_id, messages=[{"role": "developer", "content": "be brief"},
                                        {"role": "user", "content": [{"type": "text", "text": "hel"},
                                                                     {"type": "text", "text": "lo"}]}],
        seed=11, stop="END", user="u1", n=1, presence_penalty=0, logit_bias={}, store=False,
        extra_body={"chat_template_kwargs": {"enable_thinking": False, "other": 1}}))
    req = await peer.next_request()
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "hello")]
    assert req.max_tokens == GENERATION["max_new_tokens"] and req.stop == ["END"] and req.enable_thinking is False
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.6, 0.95, 20, 0.0, 11)
    done = await peer.answer(req.request_id, [["Hel", "lo"], [" world"]], finish_reason="length", timing=TIMING)
    c = await reply
    assert c.id == "chatcmpl-" + req.request_id and c.object == "chat.completion" and c.model == READY.model_id
    assert c.choices[0].message.content == "Hello world" and c.choices[0].message.role == "assistant"
    assert c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (
        done.prompt_tokens, 3, done.prompt_tokens + 3)
    assert c.model_extra["swarm"] == {"timing": TIMING}


async def test_a_streamed_reply_in_openai_chunks(client, js):
    peer = ServingPeer(js)
    stream = await client.chat.completions.create(
        model=READY.model_id, messages=MSGS, stream=True, stream_options={"include_usage": True},
        temperature=0, top_p=0.5, max_completion_tokens=9, extra_body={"top_k": 3, "min_p": 0.1})
    req = await peer.next_request()
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.sampling.min_p) == (0.0, 0.5, 3, 0.1)
    assert req.max_tokens == 9 and req.enable_thinking is None
    batches = [["A", "\u00e9"], ["\"q\"\n"], [], ["z"]]
    done = await peer.answer(req.request_id, batches, timing=TIMING)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "A\u00e9\"q\"\nz"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.id == "chatcmpl-" + req.request_id and c.object == "chat.completion.chunk" for c in chunks)
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == done.completion_tokens == 4
    assert last.usage.prompt_tokens == done.prompt_tokens
    assert last.model_extra["swarm"] == {"timing": TIMING}
    assert all(c.usage is None for c in chunks[:-1])


async def test_context_too_long_is_413_or_an_error_event(client, js):
    peer = ServingPeer(js)
    too_long = "this conversation needs 4,312 tokens; the pool serving this model holds 256"
    reply = asyncio.ensure_future(client.chat.completions.create(model=READY.model_id, messages=MSGS))
    await peer.fail((await peer.next_request()).request_id, 0, too_long, "context_too_long")
    with pytest.raises(openai.APIStatusError) as exc:
        await reply
    assert exc.value.status_code == 413 and exc.value.code == "context_length_exceeded"
    assert too_long in exc.value.message

    stream = await client.chat.completions.create(model=READY.model_id, messages=MSGS, stream=True)
    await peer.fail((await peer.next_request()).request_id, 0, too_long, "context_too_long")
    with pytest.raises(openai.APIError) as exc:
        async for _ in stream:
            pass
    assert too_long in exc.value.message and exc.value.code == "context_length_exceeded"


async def test_a_stage_exception_text_is_logged_not_returned(client, js, caplog):
    peer = ServingPeer(js)
    raw = "ValueError: Seed must be between 0 and 2**64 - 1"
    reply = asyncio.ensure_future(client.chat.completions.create(model=READY.model_id, messages=MSGS))
    rid = (await peer.next_request()).request_id
    await peer.fail(rid, 0, raw, "internal_error")
    with pytest.raises(openai.InternalServerError) as exc:
        await reply
    assert exc.value.code == "internal_error" and "log" in exc.value.message
    assert raw not in exc.value.message and "Seed" not in exc.value.message
    assert any(raw in r.getMessage() and rid in r.getMessage() for r in caplog.records)  # the leader's log has it


async def test_a_load_lost_mid_stream_ends_the_reply_and_is_recorded(gateway, client, js):
    peer = ServingPeer(js)
    stream = await client.chat.completions.create(model=READY.model_id, messages=MSGS, stream=True)
    rid = (await peer.next_request()).request_id
    await peer.publish(TokenFrame(request_id=rid, seq=0, texts=["par"], text="par"))
    seen = []
    with pytest.raises(openai.APIError) as exc:
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content)
            if seen[-1] == "par":
                await publish_event(js, LoadFailed(load_id=READY.load_id, model_id=READY.model_id,
                                                   reason="fellow f0 was lost", code="fellow_lost"))
    assert "fellow f0 was lost" in exc.value.message and exc.value.code == "load_failed"
    last = await js.get_last_msg("SWARM_EVENTS", "swarm.evt.request.failed")
    leader = gateway.leader
    await leader.projections.wait_for(last.seq, ["requests"], timeout=10)
    async with leader.sessions() as session:
        row = await session.get(RequestRow, rid)
    assert row.status == "failed" and row.error_code == "load_failed" and row.stream is True


async def test_a_client_that_hangs_up_cancels_its_request(gateway, nc, js):
    peer = ServingPeer(js)
    cancelled = await wait_cancel(nc)
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        async with http.stream("POST", "/v1/chat/completions",
                               json={"model": READY.model_id, "messages": MSGS, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            rid = (await peer.next_request()).request_id
            lines = r.aiter_lines()
            assert (await lines.__anext__()).startswith("id: ")  # for a reconnect (tests/test_chat_resume.py)
            first = await lines.__anext__()
            assert first.startswith("data: ") and '"role":"assistant"' in first
    assert await asyncio.wait_for(cancelled, 10) == subjects.cancel(READY.load_id, rid)

    cancelled = await wait_cancel(nc)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=httpx.Timeout(5.0, read=1.0)) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json={"model": READY.model_id, "messages": MSGS})
    rid = (await peer.next_request()).request_id
    assert await asyncio.wait_for(cancelled, 10) == subjects.cancel(READY.load_id, rid)
