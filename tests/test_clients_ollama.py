"""Ollama's API through the `ollama` Python client, unchanged, against `swarm leader` and `swarm fellow`
processes serving a tiny random model with Qwen3's template: chat (streamed and whole), generate, list,
show, ps, version, a tool round trip, a tool call coming back (a third model, tests/tool_caller.py, whose
greedy reply is one Hermes call), ``format`` with a schema and "json", ``think`` (a second model whose
template opens a ``<think>`` block); pull and delete
refused naming the catalog's way; bad bodies answered as ``{"error": ...}`` (never a 5xx) while the stack
keeps serving; the SQL audit and /metrics count the requests."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from tests.processes import wait_until
from tests.serving_fixtures import make_servable, stack_serving
from tests.tiny import R1_TEMPLATE
from tests.tool_caller import make_tool_caller

pytestmark = pytest.mark.slow
MODEL, THINKER, CALLER = "tiny", "tiny-r1", "tiny-caller"
HELLO = [{"role": "user", "content": "Say hello."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "count": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["name", "count"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama")
    make_servable(root, MODEL, layers=2, stages=1)
    make_servable(root, THINKER, layers=2, stages=1, chat_template=R1_TEMPLATE)  # its reply starts thinking
    make_tool_caller(root, CALLER, "get_weather", {"city": "Oslo"})  # its greedy reply calls get_weather
    env = {"SWARM_MAX_LOADED_MODELS": 3, "OMP_NUM_THREADS": 1}
    yield from stack_serving(root, root / "servables", MODEL, THINKER, CALLER, env=env, num_stages=1)


@pytest.fixture(scope="module")
def client(stack):
    return ollama.Client(host=stack.url, timeout=120)


def test_chat_whole_and_streamed(client, stack):
    reply = client.chat(model=MODEL, messages=HELLO, options={"num_predict": 5, "temperature": 0, "seed": 3})
    assert reply.done and reply.done_reason == "length" and reply.eval_count == 5 and reply.prompt_eval_count > 0
    assert reply.message.role == "assistant" and reply.message.content and reply.model == MODEL
    parts = list(client.chat(model=MODEL, messages=HELLO, stream=True, options={"num_predict": 5, "temperature": 0}))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == 5
    assert "".join(p.message.content for p in parts) == reply.message.content  # greedy: the same reply
    stopped = client.chat(model=MODEL, messages=HELLO, options={"num_predict": 5, "temperature": 0,
                                                                "stop": [reply.message.content[0]]})
    assert stopped.done_reason == "stop" and stopped.message.content == ""
    wait_until(lambda: stack.sql("SELECT count(*) FROM requests WHERE status = 'finished'")[0][0] >= 3, 30,
               "the requests' audit rows")
    assert set(stack.sql("SELECT api FROM requests")) == {("ollama",)}  # the API they came through
    assert f'model_name="{MODEL}"' in httpx.get(stack.url + "/metrics").text


def test_hanging_up_on_a_stream_cancels_it(client, stack):
    parts = client.chat(model=MODEL, messages=HELLO, stream=True, options={"num_predict": 1900})
    next(p for p in parts if p.message.content)  # the request runs: its stage takes a cancel
    parts.close()
    wait_until(lambda: stack.sql("SELECT count(*) FROM requests WHERE max_tokens = 1900 AND finish_reason = "
                                 "'cancelled' AND completion_tokens < 1900")[0][0] == 1, 30, "the stream cancelled")


def test_generate_whole_and_streamed(client):
    reply = client.generate(model=MODEL, prompt="Once", system="Be brief.", options={"num_predict": 4})
    assert reply.done and reply.response and reply.eval_count == 4
    parts = list(client.generate(model=MODEL, prompt="Once", stream=True, options={"num_predict": 4}))
    assert parts[-1].done and parts[-1].done_reason == "length" and isinstance(parts[0].response, str)
    assert client.generate(model=MODEL, prompt="").done_reason == "load"  # Ollama's way to load a model


def test_list_show_ps_version(client, stack):
    models = client.list().models
    assert sorted(m.model for m in models) == sorted([MODEL, THINKER, CALLER])
    assert models[0].size > 0 and models[0].details.family
    shown = client.show(MODEL)
    assert "tools" in shown.capabilities and "thinking" in shown.capabilities and "<tool_call>" in shown.template
    assert shown.modelinfo["general.parameter_count"] > 0
    assert sorted(m.model for m in client.ps().models) == sorted([MODEL, THINKER, CALLER])
    assert httpx.get(stack.url + "/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("nope")
    assert missing.value.status_code == 404


def test_format_schema_and_json(client):
    reply = client.chat(model=MODEL, messages=HELLO, format=SCHEMA, options={"num_predict": 60})
    jsonschema.validate(json.loads(reply.message.content), SCHEMA)
    reply = client.generate(model=MODEL, prompt="JSON please", format="json", options={"num_predict": 40})
    if reply.done_reason == "stop":
        assert isinstance(json.loads(reply.response), dict)


def test_tool_round_trip_and_think(client):
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                             "arguments": {"city": "Oslo"}}}]}
    reply = client.chat(model=MODEL, tools=[WEATHER], options={"num_predict": 6}, messages=[
        {"role": "user", "content": "Weather in Oslo?"}, call,
        {"role": "tool", "content": "Sunny", "tool_name": "get_weather"}])
    assert reply.done and reply.eval_count >= 1
    for part in client.chat(model=MODEL, tools=[WEATHER], messages=HELLO, stream=True, options={"num_predict": 40}):
        for c in part.message.tool_calls or []:  # a random model calls now and then: a call is whole, its args a dict
            assert c.function.name == "get_weather" and isinstance(c.function.arguments, dict)
    plain = client.chat(model=MODEL, messages=HELLO, think=False, options={"num_predict": 4})
    assert plain.message.thinking is None
    thought = client.chat(model=THINKER, messages=HELLO, think=True, options={"num_predict": 30})
    assert thought.message.thinking and "<think>" not in thought.message.content  # apart from the answer
    parts = list(client.generate(model=THINKER, prompt="Hi", think=True, stream=True, options={"num_predict": 30}))
    assert "".join(p.thinking or "" for p in parts) and parts[-1].done


def test_a_tool_call_comes_back_whole_and_streamed(client):
    ask = dict(model=CALLER, tools=[WEATHER], messages=[{"role": "user", "content": "Weather in Oslo?"}],
               options={"num_predict": 8, "temperature": 0})
    reply = client.chat(**ask)
    assert reply.done and reply.done_reason == "stop" and reply.message.content == "", reply
    [call] = reply.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Oslo"}
    parts = list(client.chat(**ask, stream=True))
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert "".join(p.message.content for p in parts) == "" and parts[-1].done and parts[-1].done_reason == "stop"
    assert all(not p.done for p in parts[:-1]) and parts[-1].eval_count == reply.eval_count
    closed = client.chat(**ask, think=False)  # after a closed think block the same call
    assert [(c.function.name, c.function.arguments) for c in closed.message.tool_calls or []] == [
        ("get_weather", {"city": "Oslo"})]
    unasked = client.chat(**{**ask, "tools": None})  # no tools offered: the same text, not read as a call
    assert not unasked.message.tool_calls and "get_weather" in unasked.message.content


def test_errors_name_ollamas_parameters(client):
    with pytest.raises(ollama.ResponseError) as huge:
        client.chat(model=MODEL, messages=HELLO, options={"num_predict": 10**9})
    assert huge.value.status_code == 400 and "'options.num_predict'" in huge.value.error
    with pytest.raises(ollama.ResponseError) as hot:
        client.chat(model=MODEL, messages=HELLO, options={"temperature": 9.0})
    assert "'options.temperature'" in hot.value.error


def test_pull_and_delete_name_the_catalog_way(client):
    for call in (lambda: client.pull("llama3"), lambda: client.delete(MODEL)):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 400 and "swarm export" in refused.value.error


@pytest.mark.parametrize("path, body", [
    ("/api/chat", {"model": MODEL}),
    ("/api/chat", {"model": MODEL, "messages": "hi"}),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "options": {"num_predict": 10**9}}),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "options": {"num_ctx": 4096}}),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "options": {"temperature": "hot"}}),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "format": 5}),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "keep_alive": "5m"}),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "think": "high"}),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["AA=="]}]}),
    ("/api/chat", {"model": "nope", "messages": HELLO}),
    ("/api/generate", {"model": MODEL, "prompt": "x", "raw": True}),
    ("/api/generate", {"model": MODEL, "prompt": 5}),
    ("/api/generate", {"model": MODEL, "prompt": "x", "suffix": "y"}),
    ("/api/show", {"verbose": True}),
    ("/api/chat", "[" * 2000 + "]" * 2000),
    ("/api/generate", "[1, 2]"),
])
def test_bad_bodies_get_ollamas_error_shape(stack, path, body):
    raw = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(stack.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert list(r.json()) == ["error"] and isinstance(r.json()["error"], str) and r.json()["error"], r.text
    assert httpx.get(stack.url + "/api/tags").status_code == 200
