"""Llama 3.x JSON and Mistral [TOOL_CALLS] tool calls through the official client against `swarm leader` and
`swarm fellow` processes serving tiny models made with those chat templates (tests/tool_templates.py): a
constrained call whole and streamed (the SDK's stream helper, and the delta order: id, type and name
first, then argument pieces), and a round trip, the call and its result rendered back by the template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from leader.openai.tokenizer import tokenizer_for
from tests.serving_fixtures import make_servable, stack_serving
from tests.tool_templates import LLAMA3_TEMPLATE, MISTRAL_TEMPLATE

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, TIME]
FORMATS = {"llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-formats")
    servables = {}
    for name, template in FORMATS.items():
        _, servables[name] = make_servable(root / "models", name, layers=2, hidden=64, chat_template=template)
    # a frame a token: how many pieces a streamed call comes in does not follow the machine's decode speed
    env = {"SWARM_MAX_LOADED_MODELS": 2, "SWARM_SERVE_STREAM_INTERVAL_MS": 0}
    yield from stack_serving(root, servables["llama3"].parent, *FORMATS, env=env, num_stages=1)


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def check(call, name: str, model: str) -> dict:
    assert call.type == "function" and call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, {t["function"]["name"]: t for t in TOOLS}[name]["function"]["parameters"])
    assert (len(call.id) == 9 and call.id.isalnum()) if model == "mistral" else call.id.startswith("call_")
    return args


@pytest.mark.parametrize("model", list(FORMATS))
async def test_a_constrained_call_whole_and_streamed(client, model):
    reply = await client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 max_tokens=80, temperature=1.0, seed=1)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert len(choice.message.tool_calls) == 1
    check(choice.message.tool_calls[0], choice.message.tool_calls[0].function.name, model)
    named = {"type": "function", "function": {"name": "get_weather"}}
    deltas = []
    stream = await client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=named,
                                                  max_tokens=80, temperature=1.0, seed=2, stream=True)
    async for chunk in stream:
        deltas += [(part, chunk.choices[0].finish_reason) for part in chunk.choices[0].delta.tool_calls or []]
    first = deltas[0][0]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == ""  # the name first, then the arguments as they decode
    pieces = [p.function.arguments for p, _ in deltas[1:]]
    assert len(pieces) >= 2 and all(p.id is None and p.function.name is None for p, _ in deltas[1:])
    assert json.loads("".join(pieces))["city"] is not None
    strict = [{"type": "function", "function": {**t["function"], "strict": True, "parameters": {
        **t["function"]["parameters"], "additionalProperties": False}}} for t in TOOLS]  # what the helper parses
    async with client.chat.completions.stream(model=model, messages=ASK, tools=strict, tool_choice=named,
                                              max_tokens=80, temperature=1.0, seed=3) as helper:
        final = await helper.get_final_completion()
    helped = final.choices[0]
    assert helped.finish_reason == "tool_calls" and check(helped.message.tool_calls[0], "get_weather", model)


@pytest.mark.parametrize("model", list(FORMATS))
async def test_a_call_and_its_result_round_trip_through_the_template(client, stack, model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = await client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=named,
                                                 max_tokens=80, temperature=1.0, seed=4)
    call = first.choices[0].message.tool_calls[0]
    args = check(call, "get_weather", model)
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear"})}]
    answer = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=6,
                                                  temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result went in
    # as the template renders that history (what the stage's prompt holds): the call as the model writes it
    sent = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                    "arguments": json.loads(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    servable = f"{stack.env['SWARM_SERVABLE_MODELS_ROOT']}/{model}"
    text = tokenizer_for(servable).render(sent, True, tools=TOOLS)
    written = json.dumps(args, ensure_ascii=False)
    if model == "llama3":
        assert '<|python_tag|>{"name": "get_weather", "parameters": ' + written + "}" in text
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"sky": "clear"}' in text
    else:
        calls = text[text.index("[TOOL_CALLS] [") + len("[TOOL_CALLS] "):text.index("]</s>") + 1]
        assert json.loads(calls) == [{"name": "get_weather", "arguments": args, "id": call.id}], calls
        assert f'"call_id": "{call.id}"}}[/TOOL_RESULTS]' in text


async def test_auto_leaves_a_text_reply_as_text(client):
    for model in FORMATS:
        reply = await client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=8,
                                                     temperature=0)
        choice = reply.choices[0]
        assert choice.message.tool_calls is None and choice.message.content, choice  # a random model writes text
