"""Admission by KV tokens through the real stack: waiting for room, and 413 for what can never fit."""

from __future__ import annotations

import asyncio

import openai
import pytest

from core.nats_server import EmbeddedNats
from tests.processes import wait_until
from tests.serving_fixtures import Stack, make_servable

BUDGET = 160  # the stage's whole KV budget in these tests: a context (80) for each of 2 requests in flight


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("admission")
    make_servable(root, "tiny", layers=2, hidden=64, stages=1, seed=5)
    nats = EmbeddedNats(root / "js").start()
    stack = Stack(root, nats.url, root / "servables", SWARM_SERVE_CONTEXT_TOKENS=BUDGET // 2,
                  SWARM_SERVE_TYPICAL_TOKENS=10, SWARM_SERVE_IN_FLIGHT=2).start()
    stack.load("tiny")
    yield stack
    stack.stop()
    nats.stop()


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def requests_rows(stack: Stack) -> dict[str, tuple]:
    return {r[0]: r[1:] for r in stack.sql("select request_id, status, error_code from requests")}


async def test_status_reports_the_budget(stack):
    load = stack.get("/api/v1/models/tiny/status").json()["load"]
    # planned: one context; the stage measured room and grew to a context per request in flight
    assert load["stages"][0]["kv_tokens"] == BUDGET == 2 * load["stages"][0]["kv_tokens_planned"]
    kv = load["stages"][0]["kernels"]["kv"]
    assert kv["held"] == BUDGET == kv["most"] and kv["planned"] == BUDGET // 2 and kv["measured"] >= BUDGET
    assert load["queued"] == 0 and load["transport"]["max_in_flight"] == 2


async def test_what_can_never_fit_is_413_and_counted_too_long(stack, client):
    long_prompt = [{"role": "user", "content": "spam " * 120}]
    with pytest.raises(openai.APIStatusError) as err:
        await client.chat.completions.create(model="tiny", messages=long_prompt, max_tokens=100)
    assert err.value.status_code == 413
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and f"holds {BUDGET}" in body["message"], body
    stream = await client.chat.completions.create(model="tiny", messages=long_prompt, max_tokens=100, stream=True)
    with pytest.raises(openai.APIError) as err:
        async for _ in stream:
            pass
    assert "holds 160" in str(err.value)
    await asyncio.to_thread(wait_until, lambda: sum(s == "too_long" for s, _ in requests_rows(stack).values()) == 2,
                            30, "two requests projected as too_long")
    assert all(code == "context_too_long" for s, code in requests_rows(stack).values() if s == "too_long")


async def test_a_request_waits_for_room_then_is_served(stack, client):
    async def one(i: int):
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"story {i}"}], max_tokens=120, temperature=0,
            stream=True, extra_body={"min_tokens": 120})
        chunks = [chunk async for chunk in stream]
        return chunks[0].id.removeprefix("chatcmpl-"), chunks

    # Each reserves prompt + 120 tokens of the 160, so of two sent together one must wait until the other ends.
    # (Sending the second only once the first streams raced: the first's 120 tokens can end before the second
    # reaches the gateway.)
    replies = dict(await asyncio.gather(one(1), one(2)))
    assert all(c[-1].choices[0].finish_reason == "length" for c in replies.values())

    def rows():
        got = {r[0]: (r[1] - r[2], r[1], r[3]) for r in stack.sql(
            "select request_id, ended_at, duration_s, accepted_at from requests where status = 'finished' "
            "and request_id in (?, ?)", *replies)}
        return got if len(got) == 2 else None

    # The stage's own record: from taking a request to its end. The two spans must not overlap.
    got = await asyncio.to_thread(wait_until, rows, 30, "both requests recorded")
    r1, r2 = sorted(got, key=lambda rid: got[rid][0])  # r1: the one taken first
    (_, ended1, _), (taken2, _, accepted2) = got[r1], got[r2]
    assert taken2 >= ended1 - 0.05, got  # slack: events are stamped when published
    assert accepted2 < ended1, got  # both were accepted before the first one ended
    # swarm.timing shows the wait: the second reports as queue_ms about the time from its acceptance to the
    # first one's end
    queue_ms = {rid: c[-1].model_extra["swarm"]["timing"]["queue_ms"] for rid, c in replies.items()}
    waited_ms = (ended1 - accepted2) * 1e3
    assert queue_ms[r2] >= 0.8 * waited_ms and queue_ms[r2] > queue_ms[r1], (queue_ms, waited_ms)
    # and both gave their tokens back (the heartbeat's metrics follow within a beat or two)
    await asyncio.to_thread(wait_until, lambda: stack.get("/api/v1/models/tiny/status").json()["load"]["stages"][0]
                            ["metrics"].get("in_flight") == 0, 30, "nothing in flight")
