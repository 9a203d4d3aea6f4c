"""Structured outputs and tools through the official client against `swarm leader` and `swarm fellow`
processes serving the demo model (`swarm demo-model`: its shape, tokenizer and chat template, trained
once a session for DEMO_STEPS of the 260 steps `make run` trains, to keep the suite short), on
one stage and as a 2-stage ring on two fellows.

The demo model writes chat-like text, never JSON; the grammar alone makes its replies valid JSON,
valid calls."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.serving_fixtures import responses_stream, stack_serving

pytestmark = pytest.mark.slow
PROMPT = [{"role": "user", "content": "Name a colour."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "level", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "level": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["warm", "cold"]}, "maxItems": 2},
                         "ok": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, TIME]


class Colour(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    warm: bool
    score: int = pydantic.Field(ge=0, le=9)


MODEL = "swarm-demo"


@pytest.fixture(scope="module")
def demo(demo_servables):
    """The servables folder holding the demo model, trained once a session (tests/conftest.py)."""
    return demo_servables


@pytest.fixture(scope="module")
def stack(tmp_path_factory, demo):
    yield from stack_serving(tmp_path_factory.mktemp("structured"), demo, MODEL, num_stages=1)


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def json_format(schema: dict = SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


async def test_parse_returns_a_valid_pydantic_instance_whole_and_streamed(client):
    reply = await client.chat.completions.parse(model=MODEL, messages=PROMPT, response_format=Colour,
                                                max_tokens=120, temperature=1.0, seed=5)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Colour) and 0 <= choice.message.parsed.score <= 9
    pieces, reason = [], None
    stream = await client.chat.completions.create(model=MODEL, messages=PROMPT, response_format=json_format(),
                                                  max_tokens=120, temperature=1.0, seed=6, stream=True)
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    assert reason == "stop"
    jsonschema.validate(json.loads("".join(pieces)), SCHEMA)


async def test_fifty_sampled_replies_follow_the_schema_beside_an_unconstrained_reply(client):
    plain = dict(model=MODEL, messages=PROMPT, max_tokens=24, temperature=0)
    alone = (await client.chat.completions.create(**plain)).choices[0].message.content
    batch, beside = await asyncio.gather(
        client.chat.completions.create(model=MODEL, messages=PROMPT, response_format=json_format(), n=50,
                                       max_tokens=120, temperature=1.0, seed=100),
        client.chat.completions.create(**plain))
    assert beside.choices[0].message.content == alone  # an unconstrained row in the same batches is untouched
    assert len(batch.choices) == 50
    replies = set()
    for choice in batch.choices:
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        jsonschema.validate(value, SCHEMA)
        replies.add(choice.message.content)
    assert len(replies) > 10  # sampled, not one reply fifty times


async def test_json_object_and_the_cut_off_reply_and_bad_schemas(client):
    reply = await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=60, temperature=1.0,
                                                 seed=1, response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # a random model may fill an open object to the limit; then the reply says so
        assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content.startswith("{")
    short = await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=3,
                                                 response_format=json_format())
    assert short.choices[0].finish_reason == "length"  # cut off mid-JSON: never a silent "stop"
    with pytest.raises(openai.LengthFinishReasonError):
        await client.chat.completions.parse(model=MODEL, messages=PROMPT, response_format=Colour, max_tokens=3)
    for schema, needle in (({"type": "nonsense"}, "nonsense"), ({"type": "string", "pattern": "(("}, "regex")):
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=MODEL, messages=PROMPT, response_format=json_format(schema))
        assert err.value.body["param"] == "response_format.json_schema.schema" and needle in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=PROMPT,
                                             response_format={"type": "json_schema", "json_schema": {"schema": {}}})
    assert err.value.body["param"] == "response_format.json_schema.name"


def check_call(call, tools=TOOLS) -> dict:
    fn = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, fn["parameters"])
    return args


async def test_required_and_named_tool_calls_whole_and_streamed(client):
    reply = await client.chat.completions.create(model=MODEL, messages=PROMPT, tools=TOOLS, tool_choice="required",
                                                 max_tokens=120, temperature=1.0, seed=2)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])
    named = {"type": "function", "function": {"name": "get_time"}}
    calls: dict[int, dict] = {}
    reason = None
    stream = await client.chat.completions.create(model=MODEL, messages=PROMPT, tools=TOOLS, tool_choice=named,
                                                  max_tokens=120, temperature=1.0, seed=3, stream=True)
    async for chunk in stream:
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += part.id or ""
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_time"
    assert json.loads(calls[0]["arguments"])["zone"] in ("UTC", "CET") and calls[0]["id"].startswith("call_")


async def test_a_tool_round_trip_call_result_answer(client):
    messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                 max_tokens=120, temperature=1.0, seed=9)
    call = first.choices[0].message.tool_calls[0]
    check_call(call)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear"})}]
    answer = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=12,
                                                  temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls  # "auto": text, or a call it wrote itself
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result went in


async def test_tool_requests_that_cannot_be_served_are_refused(client):
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice.function.name"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "retrieval"}]), "tools[0]"),
        (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
        (dict(tools=TOOLS, logprobs=True), "logprobs"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
              tool_choice="required"), "tools"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4, **extra)
        assert err.value.body["param"] == param, (extra, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, max_tokens=4,
                                             messages=PROMPT + [{"role": "tool", "content": "x"}])
    assert err.value.body["param"] == "messages[1].tool_call_id"


async def test_responses_whole_and_streamed(client):
    common = dict(model=MODEL, instructions="Answer briefly.", input="Name a colour.", max_output_tokens=8,
                  temperature=0, store=False)
    whole = await client.responses.create(**common)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete") and whole.output[0].type == "message"
    assert whole.usage.output_tokens <= 8 and whole.usage.input_tokens > 0
    chat = await client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}])
    assert whole.output_text == chat.choices[0].message.content  # the same request as chat runs it
    assert (whole.status == "incomplete") == (chat.choices[0].finish_reason == "length")
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    kinds, deltas, final = await responses_stream(client, "response.output_text.delta", **common)
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(deltas) == whole.output_text == final.output_text


async def test_responses_structured_output_and_a_tool_call_and_refusals(client):
    reply = await client.responses.create(model=MODEL, input=[{"role": "user", "content": "A colour?"}],
                                          max_output_tokens=120, temperature=1.0, store=False,
                                          text={"format": {"type": "json_schema", "name": "thing",
                                                           "schema": SCHEMA, "strict": True}})
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    flat = [{"type": "function", **TIME["function"]}]
    called = await client.responses.create(model=MODEL, input="What time is it?", tools=flat,
                                           tool_choice="required", max_output_tokens=120, store=False)
    item = called.output[0]
    assert item.type == "function_call" and item.name == "get_time" and item.call_id.startswith("call_")
    assert json.loads(item.arguments)["zone"] in ("UTC", "CET")
    followed = await client.responses.create(model=MODEL, max_output_tokens=6, store=False, tools=flat, input=[
        {"role": "user", "content": "What time is it?"},
        {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": "12:00"}])
    assert followed.usage.input_tokens > called.usage.input_tokens
    for extra, param in ((dict(previous_response_id="resp_x"), "previous_response_id"),
                         (dict(store=True), "store"), (dict(reasoning={"effort": "low"}), "reasoning"),
                         (dict(max_output_tokens=0), "max_output_tokens"),
                         (dict(tools=[{"type": "web_search"}]), "tools[0].type")):
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model=MODEL, input="hi", **{"store": False, **extra})
        assert err.value.body["param"] == param, (extra, err.value.body)


@pytest.fixture(scope="module")
def ring(tmp_path_factory, demo):
    """The demo model as a 2-stage ring on two fellows: the last stage samples, so it holds the grammar."""
    yield from stack_serving(tmp_path_factory.mktemp("structured-ring"), demo, MODEL, env={"OMP_NUM_THREADS": 1},
                             fellows=2, num_stages=2, fellow_ids=["f0", "f1"])


async def test_structured_outputs_and_tool_calls_on_a_two_stage_ring(ring):
    async with openai.AsyncOpenAI(base_url=ring.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        batch = await client.chat.completions.create(model=MODEL, messages=PROMPT, response_format=json_format(),
                                                     n=8, max_tokens=120, temperature=1.0, seed=7)
        for choice in batch.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        parsed = await client.chat.completions.parse(model=MODEL, messages=PROMPT, response_format=Colour,
                                                     max_tokens=120, temperature=1.0, seed=8)
        assert isinstance(parsed.choices[0].message.parsed, Colour)
        reply = await client.chat.completions.create(model=MODEL, messages=PROMPT, tools=TOOLS,
                                                     tool_choice="required", max_tokens=120, seed=4)
        assert reply.choices[0].finish_reason == "tool_calls"
        check_call(reply.choices[0].message.tool_calls[0])
        deltas = []
        stream = await client.chat.completions.create(model=MODEL, messages=PROMPT, tools=TOOLS, stream=True,
                                                      tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}},
                                                      max_tokens=120, seed=5)
        async for chunk in stream:
            deltas += chunk.choices[0].delta.tool_calls or []
        assert deltas[0].function.name == "get_weather" and {d.index for d in deltas} == {0}  # head, then pieces
        arguments = "".join(d.function.arguments or "" for d in deltas)
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_langchain_chat_openai_structured_output_and_a_tool_call(stack):
    """A second real client: LangChain's ChatOpenAI, once with a pydantic schema and once binding a tool."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=stack.url + "/v1", api_key="unused", max_tokens=120, temperature=1.0,
                     seed=11, max_retries=0, timeout=120)
    colour = llm.with_structured_output(Colour, method="json_schema").invoke("Name a colour.")
    assert isinstance(colour, Colour) and 0 <= colour.score <= 9

    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        return "12:00"

    message = llm.bind_tools([get_time], tool_choice="get_time").invoke("What time is it?")
    assert len(message.tool_calls) == 1 and message.tool_calls[0]["name"] == "get_time"
    assert message.tool_calls[0]["args"]["zone"] in ("UTC", "CET") and message.tool_calls[0]["id"].startswith("call_")
