"""Anthropic's Messages API through the `anthropic` Python SDK, unchanged, against `swarm leader` and
`swarm fellow` processes serving two tiny random models: one with Qwen3's template (tools), one whose
template opens a ``<think>`` block (its reply starts in its thinking). Text, stop sequences and the
max_tokens stop, streamed and whole; tool round trips with tool_choice any and a named tool; thinking
blocks kept apart from text; count_tokens; langchain-anthropic's ChatAnthropic (invoke, stream,
bind_tools); errors as the SDK's own exception classes; the async client; bad bodies answered in
Anthropic's shape (never a 5xx) while the stack keeps serving; the SQL audit and /metrics count each
request."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.processes import wait_until
from tests.serving_fixtures import make_servable, stack_serving
from tests.tiny import R1_TEMPLATE

pytestmark = pytest.mark.slow
MODEL, THINKER = "tiny", "tiny-r1"
GREEDY = {"temperature": 0}
HELLO = [{"role": "user", "content": "Say hello."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic")
    make_servable(root, MODEL, layers=2, stages=1)
    make_servable(root, THINKER, layers=2, stages=1, chat_template=R1_TEMPLATE)
    env = {"SWARM_MAX_LOADED_MODELS": 2, "OMP_NUM_THREADS": 1}
    yield from stack_serving(root, root / "servables", MODEL, THINKER, env=env, num_stages=1)


@pytest.fixture(scope="module")
def client(stack):
    with anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_create_text_max_tokens_and_usage(client, stack):
    reply = client.messages.create(model=MODEL, max_tokens=5, messages=HELLO,
                                   extra_body={"temperature": 1.0, "top_k": 5}, metadata={"user_id": "u1"},
                                   system="Be brief.")
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 5 and reply.usage.input_tokens > 0
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    chat = httpx.post(stack.url + "/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 7},
                      timeout=60)
    assert chat.status_code == 200, chat.text
    wait_until(lambda: stack.sql("SELECT count(*) FROM requests WHERE status = 'finished' AND max_tokens IN (5, 7)"
                                 )[0][0] >= 2, 30, "the requests' audit rows")
    assert stack.sql("SELECT api FROM requests WHERE max_tokens = 5") == [("anthropic",)]  # the API it came through
    assert stack.sql("SELECT api FROM requests WHERE max_tokens = 7") == [("openai",)]


def test_stop_sequence_whole_and_streamed(client):
    free = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    text = free.content[0].text
    assert free.stop_reason == "max_tokens" and text, free
    # greedy: the same text again; the stop is its first character that differs from the first (a random
    # model may write one character over and over: then that one)
    stop = next((c for c in text if c != text[0]), text[0])
    unmatched = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY,
                                       stop_sequences=["\x01never"])
    assert unmatched.stop_reason == "max_tokens" and unmatched.stop_sequence is None
    reply = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, stop_sequences=[stop], extra_body=GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop, (text, reply)
    assert stop not in reply.content[0].text and text.startswith(reply.content[0].text)
    with client.messages.stream(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY,
                                stop_sequences=[stop]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.content[0].text == reply.content[0].text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds


def test_a_system_turn_effort_and_a_prompt_too_long(client):
    """A system turn among the messages (as Claude Code sends them), output_config.effort, and a conversation
    longer than the model holds: Anthropic's 400 "prompt is too long" (what Claude Code reads), not a 413."""
    reply = client.messages.create(model=MODEL, max_tokens=3, output_config={"effort": "low"}, messages=[
        *HELLO, {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}])
    assert reply.stop_reason == "max_tokens"
    with pytest.raises(anthropic.BadRequestError) as long:
        long_text = " ".join(str(i) for i in range(15000))  # past the 32,768 tokens a one-stage pool holds
        client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": long_text}])
    assert long.value.body["error"]["message"].startswith("prompt is too long"), long.value.body


def test_hanging_up_on_a_stream_cancels_it(client, stack):
    with client.messages.stream(model=MODEL, max_tokens=1900, messages=HELLO) as s:
        next(e for e in s if e.type == "content_block_delta")  # the request runs: its stage takes a cancel
    wait_until(lambda: stack.sql("SELECT count(*) FROM requests WHERE max_tokens = 1900 AND finish_reason = "
                                 "'cancelled' AND completion_tokens < 1900")[0][0] == 1, 30, "the stream cancelled")


def test_stream_event_sequence_on_the_wire(stack):
    body = {"model": MODEL, "max_tokens": 4, "messages": HELLO, "stream": True, "temperature": 0}
    with httpx.stream("POST", stack.url + "/v1/messages", json=body, timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [line[7:] for line in s.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"], events
    assert set(events[3:-3]) == {"content_block_delta"} and events[-3:] == ["content_block_stop", "message_delta",
                                                                           "message_stop"]


def test_tool_round_trip_with_any_and_a_named_tool(client):
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        with client.messages.stream(model=MODEL, max_tokens=200, tools=[WEATHER], tool_choice=choice,
                                    messages=[{"role": "user", "content": "Weather in Oslo?"}]) as s:
            deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
            call = s.get_final_message()
        assert call.stop_reason == "tool_use" and "input_json_delta" in deltas
        use = next(b for b in call.content if b.type == "tool_use")
        assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id
        follow = client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in call.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 20 C"}]}])
        assert follow.stop_reason in ("max_tokens", "end_turn", "tool_use") and follow.content
    counted = client.messages.count_tokens(model=MODEL, messages=HELLO)
    with_tools = client.messages.count_tokens(model=MODEL, messages=HELLO, tools=[WEATHER])
    assert 0 < counted.input_tokens < with_tools.input_tokens


def test_thinking_blocks_apart_from_text(client):
    reply = client.messages.create(model=THINKER, max_tokens=1100, messages=HELLO,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    kinds = [b.type for b in reply.content]
    assert kinds[0] == "thinking" and reply.content[0].thinking and set(kinds[1:]) <= {"text"}, kinds
    assert "</think>" not in reply.content[0].thinking  # the thinking ends at its first </think>
    with client.messages.stream(model=THINKER, max_tokens=1100, messages=HELLO,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        deltas = {e.delta.type for e in s if e.type == "content_block_delta"}
        final = s.get_final_message()
    assert "thinking_delta" in deltas and final.content[0].type == "thinking"


def test_errors_as_the_sdks_exception_classes(stack, client):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="nope", max_tokens=5, messages=HELLO)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AA=="}}]}])
    with pytest.raises(anthropic.BadRequestError) as parallel:  # chat's check, in Anthropic's names
        client.messages.create(model=MODEL, max_tokens=5, messages=HELLO, tools=[WEATHER],
                               tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert "'tool_choice.disable_parallel_tool_use'" in parallel.value.body["error"]["message"]


COUNTABLE = (0, 1, 3, 6, 7)  # bad bodies whose prompt count_tokens still takes (what is wrong is not the prompt's)


@pytest.mark.parametrize("case, body", enumerate([
    {"model": MODEL, "messages": HELLO},  # no max_tokens
    {"model": MODEL, "max_tokens": "5", "messages": HELLO},
    {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
    {"model": MODEL, "max_tokens": 10**9, "messages": HELLO},
    {"model": MODEL, "max_tokens": 5, "messages": []},
    {"model": MODEL, "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
    {"model": MODEL, "max_tokens": 5, "messages": HELLO, "temperature": 1.5},
    {"model": MODEL, "max_tokens": 5, "messages": HELLO, "output_config": {"effort": "huge"}},
    {"model": MODEL, "max_tokens": 5, "messages": HELLO, "tool_choice": {"type": "maybe"}},
    {"model": MODEL, "max_tokens": 5, "messages": HELLO, "thinking": {"type": "enabled", "budget_tokens": 10}},
    {"model": MODEL, "max_tokens": 5, "messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "w"}]},
    {"model": "nope", "max_tokens": 5, "messages": HELLO},
    "[" * 2000 + "]" * 2000,
    [1, 2],
    {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": {"nested": True}}]},
]))
def test_bad_bodies_get_anthropics_error_shape(stack, case, body):
    raw = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(stack.url + "/v1/messages", content=raw, headers={"content-type": "application/json"},
                   timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    shape = r.json()
    assert shape["type"] == "error" and set(shape["error"]) == {"type", "message"}, shape
    assert shape["error"]["type"] in ("invalid_request_error", "not_found_error") and shape["error"]["message"]
    r = httpx.post(stack.url + "/v1/messages/count_tokens", content=raw, headers={"content-type": "application/json"})
    if case in COUNTABLE:
        assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
    else:
        assert 400 <= r.status_code < 500 and r.json()["type"] == "error", r.text


def test_langchain_chat_anthropic_invoke_stream_and_bind_tools(stack):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=MODEL, base_url=stack.url, api_key="unused", max_tokens=6, max_retries=0, timeout=120)
    message = llm.invoke("Say hello.")
    assert isinstance(message.content, str) and message.response_metadata["stop_reason"] == "max_tokens"
    assert message.usage_metadata["output_tokens"] == 6
    chunks = list(llm.stream("Say hello."))
    assert len(chunks) > 1 and "".join(c.text for c in chunks if isinstance(c.text, str)) is not None

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "Sunny"

    called = ChatAnthropic(model=MODEL, base_url=stack.url, api_key="unused", max_tokens=200, max_retries=0,
                           timeout=120).bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo?")
    assert [c["name"] for c in called.tool_calls] == ["get_weather"] and isinstance(called.tool_calls[0]["args"], dict)


async def test_async_client_and_the_stack_still_serves(stack):
    async with anthropic.AsyncAnthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=120) as c:
        reply = await c.messages.create(model=MODEL, max_tokens=3, messages=HELLO)
        async with c.messages.stream(model=MODEL, max_tokens=3, messages=HELLO) as s:
            text = await s.get_final_text()
    assert reply.stop_reason == "max_tokens" and isinstance(text, str)
    metrics = httpx.get(stack.url + "/metrics").text
    assert f'model_name="{MODEL}"' in metrics


def test_x_api_key_with_the_same_scopes_last(stack):
    """Last: minting the first token turns authentication on for the stack."""
    admin = stack.post("/api/v1/api-tokens", {"label": "anthropic-admin", "scopes": ["admin"]})
    assert admin.status_code == 201, admin.text
    headers = {"authorization": f"Bearer {admin.json()['token']}"}
    read = httpx.post(stack.url + "/api/v1/api-tokens", json={"label": "anthropic-read", "scopes": ["read"]},
                      headers=headers)
    assert read.status_code == 201, read.text
    with anthropic.Anthropic(base_url=stack.url, api_key=admin.json()["token"], max_retries=0, timeout=120) as c:
        assert c.messages.create(model=MODEL, max_tokens=2, messages=HELLO).stop_reason == "max_tokens"
    with anthropic.Anthropic(base_url=stack.url, api_key=read.json()["token"], max_retries=0) as c:
        with pytest.raises(anthropic.PermissionDeniedError) as denied:
            c.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert denied.value.body["error"]["type"] == "permission_error"
    with anthropic.Anthropic(base_url=stack.url, api_key="sk-wrong", max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError) as wrong:
            c.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert wrong.value.body["error"]["type"] == "authentication_error"
