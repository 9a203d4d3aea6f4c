"""vLLM's extras of the OpenAI API through the official client against `swarm leader` and `swarm fellow`
processes serving a tiny real model: /tokenize, /detokenize, completions, logprobs, penalties, n."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.processes import wait_until
from tests.serving_fixtures import one_model_stack

pytestmark = pytest.mark.slow
PROMPT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    for stack, hf, _ in one_model_stack(tmp_path_factory.mktemp("openai-extras"), layers=2, hidden=64,
                                        env={"SWARM_STREAM_RESUME_S": 0.5}):  # a hang-up cancels after 0.5 s
        yield stack, hf


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=stack[0].url + "/v1", api_key="unused", max_retries=0,
                                  timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer(stack):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(stack[1]))


def test_tokenize_and_detokenize_agree_with_the_models_tokenizer(stack, hf_tokenizer):
    url = stack[0].url
    r = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": "Name three colours.",
                                            "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == hf_tokenizer("Name three colours.")["input_ids"] and body["count"] == len(body["tokens"])
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(body["tokens"]) and body["max_model_len"] > 0
    r = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": PROMPT,
                                            "chat_template_kwargs": {"enable_thinking": False}})
    expected = hf_tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, enable_thinking=False,
                                                return_dict=True)["input_ids"]
    assert r.json()["tokens"] == expected and r.json().get("token_strs") is None
    r = httpx.post(url + "/detokenize", json={"model": "tiny", "tokens": expected})
    assert r.json() == {"prompt": hf_tokenizer.decode(expected)}
    r = httpx.post(url + "/detokenize", json={"model": "tiny", "tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": "a", "messages": PROMPT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url + "/tokenize", json={"model": "nope", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.fixture(scope="module")
def reference(stack, hf_tokenizer):
    """Greedy decoding with a logits processor, by hand on the HF model: [(token, logprobs [V])] per step."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(stack[1]), dtype=torch.float32).eval()
    prompt = hf_tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"]

    def run(steps: int, process=lambda logits, out: logits, prompt: list[int] = prompt):
        out: list[int] = []
        steps_out = []
        for _ in range(steps):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            logprobs = torch.log_softmax(process(logits.clone(), out), dim=-1)
            token = int(logprobs.argmax())
            steps_out.append((token, logprobs))
            out.append(token)
        return steps_out

    return run


def _assert_logprobs_match(content, steps, hf_tokenizer, top: int) -> None:
    assert len(content) == len(steps)
    for entry, (token, logprobs) in zip(content, steps):
        assert entry.token == hf_tokenizer.decode([token]) and entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - float(logprobs[token])) < 1e-4
        best = logprobs.topk(top)
        assert [t.token for t in entry.top_logprobs] == [hf_tokenizer.decode([i]) for i in best.indices.tolist()]
        assert all(abs(t.logprob - v) < 1e-4 for t, v in zip(entry.top_logprobs, best.values.tolist()))


async def test_chat_logprobs_whole_and_streamed_match_the_models_log_softmax(client, reference, hf_tokenizer):
    steps = reference(8)
    reply = await client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=5)
    _assert_logprobs_match(reply.choices[0].logprobs.content, steps, hf_tokenizer, 5)
    stream = await client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=8, temperature=0,
                                                  logprobs=True, top_logprobs=5, stream=True)
    content = [e async for chunk in stream if chunk.choices and chunk.choices[0].logprobs
               for e in chunk.choices[0].logprobs.content]
    _assert_logprobs_match(content, steps, hf_tokenizer, 5)


@pytest.mark.parametrize("params", [
    {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"repetition_penalty": 1.8, "logit_bias": {"40": 3.0, "41": -50.0}},
])
async def test_penalties_and_logit_bias_change_the_distribution_as_documented(client, reference, hf_tokenizer,
                                                                              params):
    def process(logits, out):
        import torch

        for key, bias in params.get("logit_bias", {}).items():
            logits[int(key)] += bias
        seen = sorted(set(out) | set(reference_prompt))
        if "repetition_penalty" in params and seen:
            values = logits[seen]
            rp = params["repetition_penalty"]
            logits[seen] = torch.where(values > 0, values / rp, values * rp)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        return logits - counts * params.get("frequency_penalty", 0) - (counts > 0) * params.get("presence_penalty", 0)

    reference_prompt = hf_tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True,
                                                        return_dict=True)["input_ids"]
    steps = reference(10, process)
    plain = [t for t, _ in reference(10)]
    assert [t for t, _ in steps] != plain or params.get("logit_bias")  # the processor changed the greedy path
    reply = await client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=3, extra_body=params)
    _assert_logprobs_match(reply.choices[0].logprobs.content, steps, hf_tokenizer, 3)


async def test_n_choices_are_each_what_their_seed_gives_alone(client):
    common = dict(model="tiny", messages=PROMPT, max_tokens=12, temperature=1.0, top_p=1.0,
                  extra_body={"top_k": 0})
    whole = await client.chat.completions.create(n=3, seed=40, **common)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    alone = [await client.chat.completions.create(seed=40 + i, **common) for i in range(3)]
    assert [c.message.content for c in whole.choices] == [a.choices[0].message.content for a in alone]
    assert [c.finish_reason for c in whole.choices] == [a.choices[0].finish_reason for a in alone]
    assert len({c.message.content for c in whole.choices}) > 1
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert whole.usage.prompt_tokens == alone[0].usage.prompt_tokens
    stream = await client.chat.completions.create(n=3, seed=40, stream=True, stream_options={"include_usage": True},
                                                  **common)
    texts, reasons, usage = ["", "", ""], [None] * 3, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.message.content for c in whole.choices] and reasons == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


async def test_completions_from_text_or_ids_whole_streamed_echoed_with_logprobs(client, reference, hf_tokenizer):
    text = "Red, green and"
    ids = hf_tokenizer(text)["input_ids"]
    steps = reference(8, prompt=ids)
    expected = hf_tokenizer.decode([t for t, _ in steps])
    reply = await client.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0, logprobs=3)
    choice = reply.choices[0]
    assert reply.object == "text_completion" and choice.text == expected and choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 8
    lp = choice.logprobs
    assert lp.tokens == [hf_tokenizer.decode([t]) for t, _ in steps] and len(lp.top_logprobs[0]) == 3
    assert all(abs(got - float(logprobs[t])) < 1e-4 for got, (t, logprobs) in zip(lp.token_logprobs, steps))
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    by_ids = await client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert by_ids.choices[0].text == text + expected
    stream = await client.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0, stream=True,
                                             echo=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text + expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].model_extra["swarm"]["timing"]


async def test_completions_with_several_prompts_and_n_and_a_stop(client):
    texts = ["Red, green and", "One, two,"]
    reply = await client.completions.create(model="tiny", prompt=texts, n=2, max_tokens=6, temperature=1.0,
                                            seed=3)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for i, choice in enumerate(reply.choices):
        alone = await client.completions.create(model="tiny", prompt=texts[i // 2], max_tokens=6, temperature=1.0,
                                                seed=3 + i % 2)
        assert choice.text == alone.choices[0].text
    full = (await client.completions.create(model="tiny", prompt=texts[0], max_tokens=12, temperature=0)).choices[0]
    stop = full.text[4:7]
    cut = await client.completions.create(model="tiny", prompt=texts[0], max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full.text[:full.text.index(stop)] and cut.choices[0].finish_reason == "stop"
    for bad, param in (({"prompt": ""}, "prompt"), ({"prompt": [10**7]}, "prompt"), ({"suffix": "x"}, "suffix"),
                       ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 21}, "logprobs"),
                       ({"prompt": [[1], "a", 3]}, "prompt[2]")):
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(model="tiny", **{"prompt": "a", **bad})
        assert exc.value.param == param


async def test_hanging_up_on_n_streamed_choices_cancels_every_one(stack, client):
    s = stack[0]
    before = {r[0] for r in s.sql("SELECT request_id FROM requests")}
    stream = await client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=2000, n=2,
                                                  temperature=0, stream=True)
    started: set[int] = set()
    async for chunk in stream:  # a stage drops a cancel for a request it has not taken: wait until both run
        started |= {c.index for c in chunk.choices if c.delta.content}
        if started == {0, 1}:
            break
    await stream.close()

    def cancelled():  # (an earlier test's last rows may come after `before`: the projection lingers 0.1 s)
        rows = [r for r in s.sql("SELECT request_id, finish_reason, completion_tokens FROM requests")
                if r[0] not in before and r[1] == "cancelled"]
        return len(rows) == 2 and all(r[2] < 2000 for r in rows)

    await asyncio.to_thread(wait_until, cancelled, 30, "both choices were cancelled")
