"""The openai client against `swarm leader` and `swarm fellow` processes serving a tiny real model."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec
import openai
import pytest

from core.bus import connect
from events.requests import RequestFinished
from tests.processes import wait_until
from tests.serving_fixtures import one_model_stack

PROMPT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    for stack, _, url in one_model_stack(tmp_path_factory.mktemp("chat-e2e"), layers=4, hidden=64,
                                         env={"SWARM_STREAM_RESUME_S": 0.5}):  # a hang-up cancels after 0.5 s
        yield stack, url


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=stack[0].url + "/v1", api_key="unused", max_retries=0,
                                  timeout=60) as c:
        yield c


async def test_streamed_and_whole_replies_agree_and_carry_usage_and_timing(client):
    whole = await client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=16, temperature=0)
    stream = await client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=16, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens == whole.usage.prompt_tokens
    reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert reason == whole.choices[0].finish_reason == ("length" if usage.completion_tokens == 16 else "stop")
    for timing in (whole.model_extra["swarm"]["timing"], chunks[-1].model_extra["swarm"]["timing"]):
        assert timing["route"] == "local" and "prefill_ms" in timing


async def test_greedy_reply_through_the_gateway_equals_hf_generate(stack, client):
    """The whole path (gateway, bus, stage, detokenizer) adds nothing to what the model says."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = stack[0].tmp / "models" / "hf-tiny"
    tok = AutoTokenizer.from_pretrained(str(hf))
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=model.generation_config.eos_token_id)[0, ids["input_ids"].shape[1]:].tolist()
    stops = set(model.generation_config.eos_token_id)
    expected = tok.decode([t for t in out if t not in stops], skip_special_tokens=False)
    reply = await client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens == len([t for t in out if t not in stops])


async def test_the_next_turn_of_a_chat_reuses_the_last_turns_positions(stack, client):
    """The prefix cache: usage.prompt_tokens_details.cached_tokens is OpenAI's field for it."""
    first = [{"role": "user", "content": "Tell me about the prefix cache of this chat, in some words."}]
    one = await client.chat.completions.create(model="tiny", messages=first, max_tokens=12, temperature=0)
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "And then?"}]
    two = await client.chat.completions.create(model="tiny", messages=second, max_tokens=12, temperature=0)
    ids = [(await asyncio.to_thread(stack[0].post, "/tokenize", {"model": "tiny", "messages": m})).json()["tokens"]
           for m in (first, second)]
    assert ids[0] and len(ids[0]) == one.usage.prompt_tokens
    common = next((i for i, (a, b) in enumerate(zip(*ids)) if a != b), min(map(len, ids)))
    assert common >= 16
    # every whole block the two prompts share came from the cache; a block is 16 positions
    assert two.usage.prompt_tokens_details.cached_tokens >= common // 16 * 16
    assert two.usage.prompt_tokens_details.cached_tokens < two.usage.prompt_tokens


async def test_a_stop_string_ends_the_reply_before_it(client):
    full = (await client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=24,
                                                 temperature=0)).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3, full
    reply = await client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=24, temperature=0,
                                                 stop=[stop])
    assert reply.choices[0].message.content == full[:full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


async def test_hanging_up_cancels_the_generation(stack, client):
    nc = await connect(stack[1], name="chat-e2e")
    finished = asyncio.get_running_loop().create_future()

    async def on_finished(msg):
        evt = msgspec.json.decode(msg.data, type=RequestFinished)
        if not finished.done() and evt.request_id == rid:
            finished.set_result(evt)

    sub = await nc.subscribe("swarm.evt.request.finished", cb=on_finished)
    try:
        stream = await client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=3000,
                                                      temperature=0, stream=True)
        first = await stream.__anext__()
        rid = first.id.removeprefix("chatcmpl-")
        await stream.close()
        evt = await asyncio.wait_for(finished, 30)
        assert evt.finish_reason == "cancelled" and evt.completion_tokens < 3000
    finally:
        await sub.unsubscribe()
        await nc.close()


async def test_a_fellow_lost_mid_stream_ends_the_reply_with_an_error(stack, client):
    s = stack[0]
    pid = s.get("/api/v1/models/tiny/status").json()["load"]["stages"][0]["pid"]
    stream = await client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=3000,
                                                  temperature=0, stream=True)
    await stream.__anext__()
    os.kill(pid, signal.SIGSTOP)  # freeze the generation, then lose its fellow
    await asyncio.to_thread(s.fellows[0].kill, signal.SIGKILL)
    with pytest.raises(openai.APIError) as exc:
        async for _ in stream:
            pass
    assert exc.value.code == "load_failed" and "f0" in exc.value.message
    await asyncio.to_thread(wait_until, lambda: s.get("/api/v1/models/tiny").json()["load_state"] != "ready",
                            30, "the load ended")


