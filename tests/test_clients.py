"""The clients people already use, unchanged, against `swarm leader` and `swarm fellow` processes serving
the demo model (tests/conftest.py's, trained once a session): `instructor` (JSON-schema and tools
modes), LangChain's `ChatOpenAI` and the OpenAI Agents SDK (on the Responses and the chat-completions
model, and a streamed run), lm-evaluation-harness's `local-completions` model (log-likelihood and
generation on a task file the test writes); and pydantic's schemas, which write no `additionalProperties`, held
strict by default.

The demo model writes chat-like text, never JSON: the grammar alone makes its replies follow a schema,
so a reply that rambles on in invented keys would show here."""

from __future__ import annotations

import json
import math
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from core.servable import TOKENIZER_DIR
from tests.serving_fixtures import stack_serving

pytestmark = pytest.mark.slow
MODEL = "swarm-demo"
SEEDS = (1, 2, 3)


class Item(pydantic.BaseModel):
    """An item, its schema as pydantic writes it (without a word on keys it does not name)."""

    code: str = pydantic.Field(pattern=r"^[A-Z]{2}[0-9]{2}$")
    name: str = pydantic.Field(max_length=12)
    count: int = pydantic.Field(ge=1, le=20)
    price: float = pydantic.Field(ge=0.5, le=9.5)
    tags: list[Literal["new", "old"]] = pydantic.Field(max_length=3)


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""

    city: str = pydantic.Field(max_length=10)
    days: int = pydantic.Field(ge=1, le=7)


def get_time(zone: Literal["UTC", "CET"]) -> str:
    """The time in a zone."""
    return f"12:00 {zone}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, demo_servables):
    # a frame a token (no 25 ms interval): how many pieces a streamed reply comes in then does not follow
    # the machine's decode speed
    yield from stack_serving(tmp_path_factory.mktemp("clients"), demo_servables, MODEL, num_stages=1,
                             env={"SWARM_SERVE_STREAM_INTERVAL_MS": 0})


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def check_item(value: dict) -> None:
    """Every bound holds, and no key beyond the schema's."""
    assert set(value) == {"code", "name", "count", "price", "tags"}, value
    assert re.fullmatch(r"[A-Z]{2}[0-9]{2}", value["code"]) and len(value["name"]) <= 12
    assert 1 <= value["count"] <= 20 and isinstance(value["count"], int) and 0.5 <= value["price"] <= 9.5
    assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"new", "old"}
    jsonschema.validate(value, Item.model_json_schema())


async def test_a_schema_without_additional_properties_is_closed_20_of_20_seeds(client):
    schema = Item.model_json_schema()
    assert "additionalProperties" not in schema
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe one item."}], n=20, max_tokens=100,
        temperature=1.0, seed=20, response_format={"type": "json_schema", "json_schema": {"name": "item",
                                                                                          "schema": schema}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice  # within max_tokens, never cut off mid-ramble
        check_item(json.loads(choice.message.content))
    assert len({c.message.content for c in reply.choices}) > 5  # sampled, twenty seeds
    opened = {**schema, "additionalProperties": {"type": "integer"}}  # a schema that opens it still does
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe one item."}], max_tokens=100, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": opened}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), opened) if reply.choices[0].finish_reason \
        == "stop" else None


async def test_streamed_tool_calls_as_the_sdk_stream_helper_reads_them(client):
    """OpenAI's delta order: the call's head (id, type, name, arguments "") first, then argument pieces."""
    tools = [openai.pydantic_function_tool(GetWeather)]
    for seed in SEEDS[:2]:
        async with client.chat.completions.stream(
                model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=tools,
                tool_choice="required", max_tokens=100, temperature=1.0, seed=seed) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_completion()
        entries = [entry for e in events if e.type == "chunk" and e.chunk.choices
                   for entry in e.chunk.choices[0].delta.tool_calls or []]
        head, rest = entries[0], entries[1:]
        assert head.id.startswith("call_") and head.type == "function" and head.function.name == "GetWeather"
        assert head.function.arguments == "" and len(rest) > 2
        assert all(e.index == 0 and e.id is None and e.function.name is None for e in rest)
        assert sum(e.type == "tool_calls.function.arguments.delta" for e in events) > len(rest) // 2
        done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
        assert len(done) == 1 and isinstance(done[0].parsed_arguments, GetWeather)
        message = final.choices[0].message
        assert final.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].id == head.id
        assert message.tool_calls[0].function.parsed_arguments == done[0].parsed_arguments


async def test_tools_beside_a_response_format_give_a_call_or_the_answer_in_it(client):
    """tool_choice "auto" with a response_format (an agent that calls tools, then answers in a schema)."""
    for seed in SEEDS:
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe one item."}], max_tokens=100, seed=seed,
            temperature=1.0, tools=[openai.pydantic_function_tool(GetWeather)],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "item", "schema": Item.model_json_schema()}})
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            GetWeather.model_validate_json(choice.message.tool_calls[0].function.arguments)
        else:
            assert choice.finish_reason == "stop"
            check_item(json.loads(choice.message.content))


async def test_instructor_json_schema_and_tools_modes(client):
    import instructor

    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        patched = instructor.from_openai(client, mode=mode)
        for seed in SEEDS:
            item = await patched.chat.completions.create(
                model=MODEL, response_model=Item, max_retries=0, max_tokens=100, temperature=1.0, seed=seed,
                messages=[{"role": "user", "content": "Describe one item."}])
            assert isinstance(item, Item), mode
            check_item(item.model_dump())


def test_langchain_structured_output_tools_and_streamed_usage(stack):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=stack.url + "/v1", api_key="unused", max_tokens=100, temperature=1.0,
                     max_retries=0, timeout=120, stream_usage=True)
    for seed, method in zip(SEEDS, ("json_schema", "function_calling", "json_schema")):
        item = llm.bind(seed=seed).with_structured_output(Item, method=method).invoke("Describe one item.")
        check_item(item.model_dump())
    message = llm.bind_tools([get_time], tool_choice="required").invoke("What time is it?")
    assert [c["name"] for c in message.tool_calls] == ["get_time"] and message.tool_calls[0]["args"]["zone"] in (
        "UTC", "CET")
    chunks = list(llm.bind(max_tokens=12, seed=4).stream("What is a list?"))
    whole = sum(chunks[1:], chunks[0])
    # the same reply as asked whole (its thinking split off alike; what the demo model writes varies with its
    # training, which is not the same from run to run: one wrote "</think><think>" before any block opened)
    assert len(chunks) > 3 and whole.content == llm.bind(max_tokens=12, seed=4).invoke("What is a list?").content
    usage = whole.usage_metadata  # the usage chunk, from stream_options.include_usage
    assert 0 < usage["output_tokens"] <= 12 and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def agent(model):
    """An agent whose run ends at its tool's output: a free-text answer from the demo model may run to
    max_tokens, which the SDK fails ("incomplete") on the Responses model."""
    from agents import Agent, ModelSettings, function_tool

    return Agent(name="clock", instructions="Tell the time.", model=model, tools=[function_tool(get_time)],
                 tool_use_behavior="stop_on_first_tool",
                 model_settings=ModelSettings(tool_choice="get_time", max_tokens=60, temperature=1.0))


def called(result) -> None:
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]
    assert json.loads(result.new_items[0].raw_item.arguments)["zone"] in ("UTC", "CET")
    assert result.final_output in ("12:00 UTC", "12:00 CET")


async def test_openai_agents_with_a_function_tool_on_both_models_and_streamed(client):
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel, RunConfig, Runner

    config = RunConfig(tracing_disabled=True)
    for model in (OpenAIResponsesModel(MODEL, client), OpenAIChatCompletionsModel(MODEL, client)):
        called(await Runner.run(agent(model), "What time is it?", max_turns=2, run_config=config))
    streamed = Runner.run_streamed(agent(OpenAIResponsesModel(MODEL, client)), "What time is it?", max_turns=2,
                                   run_config=config)
    events = [event async for event in streamed.stream_events()]
    raw = [e.data.type for e in events if e.type == "raw_response_event"]
    # the arguments streamed as they decoded: in more than two pieces (a frame a token here)
    assert raw.count("response.function_call_arguments.delta") > 2
    assert raw.index("response.output_item.added") < raw.index("response.function_call_arguments.delta")
    called(streamed)


def test_lm_evaluation_harness_scores_a_task_file(stack, demo_servables, tmp_path, monkeypatch):
    """local-completions sends context + continuation as token ids with echo and logprobs, and reads the
    continuation's logprobs and whether each was the greedy choice; generate_until calls completions."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "tiny.jsonl"
    rows = [{"context": "Red, green and", "continuation": " blue"}, {"context": "One, two,", "continuation": " three"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: \"{{context}}\"\ndoc_to_target: \"{{continuation}}\"\n")
    (tmp_path / "swarm_ll.yaml").write_text(
        "task: swarm_ll\n" + common + "output_type: loglikelihood\nmetric_list:\n"
        "  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (tmp_path / "swarm_gen.yaml").write_text(
        "task: swarm_gen\n" + common + "output_type: generate_until\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
        "  max_gen_toks: 4\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    url = stack.url + "/v1/completions"
    tokenizer = demo_servables / MODEL / TOKENIZER_DIR
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["swarm_ll", "swarm_gen"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        model_args=f"model={MODEL},base_url={url},tokenizer_backend=huggingface,tokenizer={tokenizer},"
                   "num_concurrent=1,max_retries=1,tokenized_requests=True")
    ll = results["results"]["swarm_ll"]
    assert math.isfinite(ll["perplexity,none"]) and ll["perplexity,none"] > 1 and 0 <= ll["acc,none"] <= 1
    assert 0 <= results["results"]["swarm_gen"]["exact_match,none"] <= 1
    served = stack.sql("SELECT count(*) FROM requests WHERE finish_reason IS NOT NULL")[0][0]
    assert served >= 4  # two scored and two generated, at least, through the stack
