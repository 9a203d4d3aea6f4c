"""POST /v1/chat/completions validation through the real app, a real nats-server and SQLite."""

from __future__ import annotations

import sys

import pytest
from litestar.testing import AsyncTestClient

from leader.app import create_app
from leader.context import Leader
from leader.db.tables import Request as RequestRow
from tests.chat_fixtures import READY, ServingPeer, StandInServing, cataloged_servable
from tests.conftest import make_settings

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def client(tmp_path, nats_server, sqlite_url):
    root = tmp_path / "servables"
    cataloged_servable(root, "cataloged")
    settings = make_settings(tmp_path, nats_server.url, sqlite_url, SWARM_SERVABLE_MODELS_ROOT=root)
    app = create_app(settings, Leader(settings, serving=StandInServing), chat_timeout_s=1.0)
    async with AsyncTestClient(app) as c:
        yield c


def body(**fields) -> dict:
    return {"model": READY.model_id, "messages": MSGS, **fields}


def assert_error(r, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


BAD = [
    (body(messages=[]), "messages"),
    ({"model": READY.model_id}, "messages"),
    ({"messages": MSGS}, "model"),
    (body(model=""), "model"),
    (body(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (body(messages=[{"content": "x"}]), "messages[0].role"),
    (body(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (body(messages=[{"role": "user"}]), "messages[0].content"),
    (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0].type"),
    (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
    (body(messages=[{"role": "function", "content": "x"}]), "messages[0].role"),
    (body(messages=[{"role": "user", "content": "x", "tool_calls": [{"id": "c"}]}]), "messages[0].tool_calls"),
    (body(temperature=2.5), "temperature"),
    (body(temperature="hot"), "temperature"),
    (body(top_p=1.5), "top_p"),
    (body(top_k=-1), "top_k"),
    (body(min_p=-0.1), "min_p"),
    (body(max_tokens=0), "max_tokens"),
    (body(max_completion_tokens=-3), "max_completion_tokens"),
    (body(max_tokens=READY.context_tokens + 1), "max_tokens"),
    (body(stop=["a", "b", "c", "d", "e"]), "stop"),
    (body(stop=7), "stop"),
    (body(n=0), "n"),
    (body(n=129), "n"),
    (body(top_logprobs=3), "top_logprobs"),
    (body(logprobs=True, top_logprobs=21), "top_logprobs"),
    (body(presence_penalty=2.5), "presence_penalty"),
    (body(frequency_penalty=-2.2), "frequency_penalty"),
    (body(repetition_penalty=0), "repetition_penalty"),
    (body(logit_bias={"x": 5}), "logit_bias"),
    (body(logit_bias={"42": 101}), "logit_bias"),
    (body(min_tokens=-1), "min_tokens"),
    (body(min_tokens=11, max_tokens=10), "min_tokens"),
    (body(seed=2**63 - 1, n=2), "seed"),
    (body(tools=[{"type": "retrieval"}]), "tools[0]"),
    (body(tools=[{"type": "function", "function": {"name": "no spaces"}}]), "tools[0].function.name"),
    (body(functions=[{"name": "f"}]), "functions"),
    (body(tool_choice="required"), "tool_choice"),
    (body(tool_choice="sometimes"), "tool_choice"),
    (body(tools=[{"type": "function", "function": {"name": "f"}}], parallel_tool_calls=False), "parallel_tool_calls"),
    (body(response_format={"type": "xml"}), "response_format.type"),
    (body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format.json_schema.schema"),
    (body(chat_template_kwargs={"enable_thinking": "no"}), "chat_template_kwargs.enable_thinking"),
    (body(stream="yes"), "stream"),
    (body(seed=2**64), "seed"),
    (body(seed=2**63), "seed"),
    (body(seed=-(2**63) - 1), "seed"),
    (body(seed="7"), "seed"),
]

def nested(depth: int | None = None) -> str:
    """Nesting past msgspec's limit, which is Python's recursion limit at the time: read when called, since a
    test run in this process before (torch's compiler) may have raised it past the default 1,000."""
    depth = depth or sys.getrecursionlimit() + 200
    return "[" * depth + "]" * depth


async def test_bad_requests_get_a_400_naming_the_parameter(client):
    for payload, param in BAD:
        for path in ("/v1/chat/completions", "/api/v1/chat/completions"):
            assert_error(await client.post(path, json=payload), 400, param)


async def test_body_that_is_not_json_or_not_an_object_is_a_400(client):
    err = assert_error(await client.post("/v1/chat/completions", content=b"{nope",
                                         headers={"content-type": "application/json"}), 400, None, "invalid_json")
    assert "JSON" in err["message"]
    assert_error(await client.post("/v1/chat/completions", content=b"[1]"), 400, None)
    assert_error(await client.post("/v1/chat/completions", content=b""), 400, None, "invalid_json")


async def test_json_nested_past_the_recursion_limit_is_a_400(client):
    for field in ("chat_template_kwargs", "an_unknown_field"):
        inner = '{"a": ' + nested() + "}" if field == "chat_template_kwargs" else nested()
        raw = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (
            READY.model_id, field, inner)
        err = assert_error(await client.post("/v1/chat/completions", content=raw.encode()), 400, None,
                           "invalid_json")
        assert "nests too deeply" in err["message"]


async def test_seeds_at_the_ends_of_the_signed_64_bit_range_reach_the_stage(client, js):
    peer = ServingPeer(js)
    for seed in (-(2**63), 2**63 - 1):
        assert_error(await client.post("/v1/chat/completions", json=body(seed=seed)), 504, None, "timeout")
        assert (await peer.next_request()).sampling.seed == seed  # no stage answers here: the 504 is expected
    err = assert_error(await client.post("/v1/chat/completions", json=body(seed=2**64)), 400, "seed")
    assert "signed 64-bit" in err["message"]


async def test_unknown_model_is_404_and_a_model_not_loaded_is_409(client):
    err = assert_error(await client.post("/v1/chat/completions", json=body(model="nope")), 404, "model",
                       "model_not_found")
    assert "nope" in err["message"]
    err = assert_error(await client.post("/v1/chat/completions", json=body(model="cataloged")), 409, None,
                       "model_not_loaded")
    assert "swarm model-load cataloged --wait" in err["message"]


async def test_no_frame_in_time_is_a_504_recorded_as_failed(client, js):
    peer = ServingPeer(js)
    r = await client.post("/v1/chat/completions", json=body())
    err = assert_error(r, 504, None, "timeout")
    assert READY.model_id in err["message"]
    rid = (await peer.next_request()).request_id
    last = await js.get_last_msg("SWARM_EVENTS", "swarm.evt.request.failed")  # published before the 504
    leader = client.app.state.leader

    async def row_once_projected():  # on the app's own loop (the test client runs it in a thread)
        await leader.projections.wait_for(last.seq, ["requests"], timeout=10)
        async with leader.sessions() as session:
            return await session.get(RequestRow, rid)

    row = client.blocking_portal.call(row_once_projected)
    assert row.status == "failed" and row.error_code == "timeout" and row.model_id == READY.model_id
    assert row.load_id == READY.load_id and row.stream is False
