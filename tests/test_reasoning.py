"""Reasoning kept apart, through the official client against `swarm leader` and `swarm fellow` processes
serving three tiny random models: one with Qwen3's template (the reply opens its ``<think>`` block
itself), one with a DeepSeek-R1-style template (the prompt opens the block) and one whose template
does not think. Logit biases on ``<think>`` / ``</think>`` make the random models open and close
blocks within a few sampled tokens.

Each split is checked against the raw text the same sampling gives on /v1/completions (vLLM's rule:
the thinking ends at the first ``</think>``)."""

from __future__ import annotations

import httpx
import openai
import pytest

from fellow.runtime.tools.chat_tokenizer import CHAT_TEMPLATE
from tests.serving_fixtures import make_servable, responses_stream, stack_serving
from tests.tiny import PLAIN_TEMPLATE, R1_TEMPLATE

pytestmark = pytest.mark.slow
PROMPT = [{"role": "user", "content": "What is a list?"}]
MODELS = {"tiny-qwen": CHAT_TEMPLATE, "tiny-r1": R1_TEMPLATE, "tiny-plain": PLAIN_TEMPLATE}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    for model, template in MODELS.items():
        make_servable(root, model, layers=2, stages=1, chat_template=template)
    env = {"SWARM_MAX_LOADED_MODELS": 3, "SWARM_HEARTBEAT_S": 1.0, "OMP_NUM_THREADS": 1}
    yield from stack_serving(root, root / "servables", *MODELS, env=env, num_stages=1)


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def bias(stack, model: str, **tags: float) -> dict:
    """A logit bias on the think tags: open= and close= their biases."""
    out = {}
    for name, value in tags.items():
        text = {"open": "<think>", "close": "</think>"}[name]
        ids = httpx.post(stack.url + "/tokenize", json={"model": model, "prompt": text}).json()["tokens"]
        assert len(ids) == 1  # a special token of the template's tokenizer
        out[str(ids[0])] = value
    return out


async def prompt_ids(stack, model: str, **template) -> list[int]:
    """The chat prompt's token ids, as the model's template renders it."""
    r = httpx.post(stack.url + "/tokenize", json={"model": model, "messages": PROMPT, **template})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


async def raw_reply(stack, client, model: str, sampling: dict, **template) -> str:
    """The reply's raw text: the chat prompt's ids continued on /v1/completions with the same sampling."""
    reply = await client.completions.create(model=model, prompt=await prompt_ids(stack, model, **template),
                                            **sampling)
    return reply.choices[0].text


def split(raw: str, inside: bool) -> tuple[str | None, str]:
    """(reasoning_content, content) of a raw reply."""
    if not inside:
        if not raw.lstrip().startswith("<think>"):
            return None, raw
        raw = raw.lstrip()[len("<think>"):]
    thought, _, answer = raw.partition("</think>")
    return thought.strip() or None, answer.lstrip()


def thinking_tokens(tokens: list[str], inside: bool) -> int:
    """The tokens spent thinking, tags included, from a raw reply's token texts."""
    if not inside and not "".join(tokens).lstrip().startswith("<think>"):
        return 0
    start = 0 if inside else tokens.index("<think>")
    return (tokens.index("</think>", start) if "</think>" in tokens[start:] else len(tokens) - 1) - start + 1


async def streamed(client, **request) -> tuple[str, str, object]:
    thought, text, usage = "", "", None
    stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request)
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            text += choice.delta.content or ""
    return thought, text, usage


@pytest.mark.parametrize("model, inside, tags", [("tiny-qwen", False, {"open": 4.0, "close": 3.0}),
                                                 ("tiny-r1", True, {"close": 3.0})])
async def test_chat_keeps_the_thinking_apart_whole_and_streamed(stack, client, model, inside, tags):
    sampling = dict(max_tokens=30, temperature=1.0, top_p=1.0, seed=3, logit_bias=bias(stack, model, **tags),
                    extra_body={"top_k": 0})
    raws = (await client.completions.create(model=model, prompt=await prompt_ids(stack, model), n=8, logprobs=0,
                                            **sampling)).choices
    reply = await client.chat.completions.create(model=model, messages=PROMPT, n=8, **sampling)
    counts = [thinking_tokens(raw.logprobs.tokens, inside) for raw in raws]
    # every token counts, one that completes no character yet too (the byte-level model writes some)
    assert reply.usage.completion_tokens_details.reasoning_tokens == sum(counts)
    thoughts = 0
    for raw, choice in zip(raws, reply.choices):
        thought, answer = split(raw.text, inside)
        assert (choice.message.model_extra["reasoning_content"], choice.message.content) == (thought, answer)
        thoughts += bool(thought and answer)
    assert thoughts >= 2  # these seeds think, then answer
    first = reply.choices[0].message
    alone = await client.chat.completions.create(model=model, messages=PROMPT, **sampling)
    assert alone.choices[0].message == first
    details = alone.usage.completion_tokens_details  # the thinking counts, tags included, within the reply's
    assert (details.reasoning_tokens > 0) == (first.model_extra["reasoning_content"] is not None)
    assert details.reasoning_tokens == counts[0] < alone.usage.completion_tokens
    s_thought, s_text, usage = await streamed(client, model=model, messages=PROMPT, **sampling)
    assert (s_thought or None, s_text) == (first.model_extra["reasoning_content"], first.content)
    assert usage.completion_tokens == alone.usage.completion_tokens
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


async def test_enable_thinking_false_and_a_model_that_does_not_think(stack, client):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for model, template in (("tiny-qwen", off), ("tiny-r1", off), ("tiny-plain", {})):
        sampling = dict(max_tokens=16, temperature=1.0, seed=5)
        raw = await raw_reply(stack, client, model, sampling, **template)
        reply = await client.chat.completions.create(model=model, messages=PROMPT, extra_body=template, **sampling)
        message = reply.choices[0].message
        assert message.content == raw, model  # the whole reply is the answer
        if model == "tiny-plain":  # unchanged: no reasoning field, no reasoning count
            assert "reasoning_content" not in message.model_extra and reply.usage.completion_tokens_details is None
        else:
            assert message.model_extra["reasoning_content"] is None
            assert reply.usage.completion_tokens_details.reasoning_tokens == 0
        _, text, _ = await streamed(client, model=model, messages=PROMPT, extra_body=template, **sampling)
        assert text == raw


@pytest.mark.parametrize("model, inside", [("tiny-qwen", False), ("tiny-r1", True)])
async def test_responses_put_the_thinking_in_a_reasoning_item(stack, client, model, inside):
    """Greedy (Responses takes no seed or bias): the Qwen3-style model then writes no block, the R1-style
    one never closes its block, so all is answer, or all is thought."""
    thought, answer = split(await raw_reply(stack, client, model, dict(max_tokens=24, temperature=0)), inside)
    common = dict(model=model, input=PROMPT, max_output_tokens=24, temperature=0, store=False)
    whole = await client.responses.create(**common)
    assert whole.output_text == answer and "<think>" not in whole.output_text
    kinds = [item.type for item in whole.output]
    assert kinds == (["reasoning", "message"] if thought else ["message"])
    if thought:
        assert whole.output[0].content[0].text == thought
        assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens
    events, deltas, final = await responses_stream(client, "response.reasoning_text.delta", **common)
    assert ("".join(deltas) or None) == thought and final.output_text == answer
    assert [item.type for item in final.output] == kinds
    if thought:
        assert events.index("response.reasoning_text.done") < events.index("response.output_text.done")
