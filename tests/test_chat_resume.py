"""Resumable token streams (issue 18): a streaming client that lost its connection posts again with the
Last-Event-ID of its last chunk and gets the rest of its reply from SWARM_TOKENS, nothing repeated or
missing; a hang-up cancels the request only once the grace (SWARM_STREAM_RESUME_S) ran out.

The real app on uvicorn, a real nats-server and SQLite; `ServingPeer` answers on the bus as a stage.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from events.frames import DoneFrame, TokenFrame
from leader.app import create_app
from leader.context import Leader
from tests.chat_fixtures import READY, Gateway, ServingPeer, StandInServing, served, wait_cancel
from tests.conftest import make_settings
from tests.request_helpers import content, read_events

GRACE_S = 2.0
BODY = {"model": READY.model_id, "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture
async def gateway(tmp_path, nats_server, sqlite_url):
    settings = make_settings(tmp_path, nats_server.url, sqlite_url, SWARM_STREAM_RESUME_S=GRACE_S)
    leader = Leader(settings, serving=StandInServing)
    async with served(create_app(settings, leader, chat_timeout_s=20.0)) as url:
        yield Gateway(url, leader)


def token(rid: str, seq: int, text: str) -> TokenFrame:
    return TokenFrame(request_id=rid, seq=seq, texts=[text], text=text)


async def test_a_client_that_reconnects_gets_the_rest_of_its_reply_once(gateway, nc, js):
    peer, cancelled = ServingPeer(js), await wait_cancel(nc)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as http:
        async with http.stream("POST", "/v1/chat/completions", json=BODY) as r:
            rid = (await peer.next_request()).request_id
            for seq, text in enumerate("abc"):
                await peer.publish(token(rid, seq, text))
            first = await read_events(r, until="c")
        hung_up = time.monotonic()  # the connection is gone; the reply goes on without it
        for seq, text in enumerate("de", start=3):
            await peer.publish(token(rid, seq, text))
        await peer.publish(DoneFrame(request_id=rid, seq=5, completion_tokens=5, prompt_tokens=3,
                                     finish_reason="stop"))
        last_id = first[-1][0]
        assert last_id == f"{rid}:3", first
        async with http.stream("POST", "/v1/chat/completions", json=BODY, headers={"Last-Event-ID": last_id}) as r:
            assert r.status_code == 200
            rest = await read_events(r)
    assert time.monotonic() - hung_up < GRACE_S  # resumed within the grace
    assert first[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert not any(d.get("choices", [{}])[0].get("delta", {}).get("role") for _, d in rest[:-1])  # no role again
    assert content(first) + content(rest) == "abcde"
    assert rest[-2][1]["choices"][0]["finish_reason"] == "stop" and rest[-1][1] == "[DONE]"
    assert {d["id"] for _, d in first + rest[:-1]} == {"chatcmpl-" + rid}
    with pytest.raises(asyncio.TimeoutError):  # the grace was called off: no cancel, even after it
        await asyncio.wait_for(asyncio.shield(cancelled), GRACE_S + 1)


async def test_a_hang_up_cancels_only_after_the_grace(gateway, nc, js):
    peer, cancelled = ServingPeer(js), await wait_cancel(nc)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as http:
        async with http.stream("POST", "/v1/chat/completions", json=BODY) as r:
            rid = (await peer.next_request()).request_id
            await peer.publish(token(rid, 0, "a"))
            await read_events(r, until="a")
        hung_up = time.monotonic()
    await asyncio.wait_for(cancelled, GRACE_S + 10)
    assert time.monotonic() - hung_up >= GRACE_S * 0.9


async def test_a_resume_names_a_streamed_reply_of_that_model(gateway, nc, js):
    peer = ServingPeer(js)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as http:
        for bad in ("nonsense", "x:y", ":3"):
            r = await http.post("/v1/chat/completions", json=BODY, headers={"Last-Event-ID": bad})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_last_event_id", r.text
        r = await http.post("/v1/chat/completions", json=BODY, headers={"Last-Event-ID": "0123abc:1"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found", r.text

        async with http.stream("POST", "/v1/chat/completions", json=BODY) as r:
            rid = (await peer.next_request()).request_id
            await peer.answer(rid, [["a"]])
            await read_events(r)
        other = dict(BODY, model="cataloged")
        r = await http.post("/v1/chat/completions", json=other, headers={"Last-Event-ID": f"{rid}:0"})
        assert r.status_code == 404, r.text
        async with http.stream("POST", "/v1/chat/completions", json=BODY, headers={"Last-Event-ID": f"{rid}:0"}) as r:
            again = await read_events(r)  # from the start: the whole reply, long after it ended
        assert content(again) == "a" and again[-1][1] == "[DONE]"


async def test_a_resume_after_the_last_chunk_ends_at_once(gateway, nc, js):
    """A client that lost the connection just before [DONE] resumes with the finish chunk's id: [DONE]
    at once, no chunk again (it waited out the chat timeout before)."""
    peer = ServingPeer(js)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as http:
        async with http.stream("POST", "/v1/chat/completions", json=BODY) as r:
            rid = (await peer.next_request()).request_id
            await peer.answer(rid, [["a"], ["b"]])
            events = await read_events(r)
        finish_id = events[-2][0]
        assert finish_id == f"{rid}:3" and events[-2][1]["choices"][0]["finish_reason"] == "stop", events
        started = time.monotonic()
        async with http.stream("POST", "/v1/chat/completions", json=BODY,
                               headers={"Last-Event-ID": finish_id}) as r:
            assert r.status_code == 200
            rest = await read_events(r)
    assert [d for _, d in rest] == ["[DONE]"], rest
    assert time.monotonic() - started < 10  # not the 20 s chat timeout
