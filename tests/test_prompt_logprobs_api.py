"""Prompt logprobs through the API (leader.openai.prompt_logprobs) against `swarm leader` and `swarm fellow`
processes serving a tiny real model: OpenAI's echo with logprobs (scoring only with max_tokens 0), vLLM's
prompt_logprobs, each equal to a teacher-forced HF forward to 1e-4; and what is refused. (Rings:
tests/test_prompt_logprobs.py; lm-evaluation-harness on the demo model: tests/test_clients.py.)"""

from __future__ import annotations

import openai
import pytest
import torch

from tests.serving_fixtures import one_model_stack

pytestmark = pytest.mark.slow
TEXT = "Red, green and blue are colours."


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    for stack, hf, _ in one_model_stack(tmp_path_factory.mktemp("prompt-logprobs"), layers=2, hidden=64):
        yield stack, hf


@pytest.fixture(scope="module")
def forward(stack):
    """The prompt's ids and the teacher-forced log-softmax [T, V] of the served weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = stack[1]
    ids = AutoTokenizer.from_pretrained(str(hf))(TEXT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=stack[0].url + "/v1", api_key="unused", max_retries=0,
                                  timeout=60) as c:
        yield c


async def test_echo_with_logprobs_scores_the_prompt_as_a_teacher_forced_forward(client, forward):
    ids, want = forward
    only = await client.completions.create(model="tiny", prompt=TEXT, max_tokens=0, echo=True, logprobs=2)
    choice = only.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert only.usage.prompt_tokens == len(ids) and only.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == TEXT and lp.text_offset[1] == len(lp.tokens[0])
    errors = [abs(got - float(want[p - 1, ids[p]])) for p, got in enumerate(lp.token_logprobs[1:], start=1)]
    assert max(errors) < 1e-4, errors
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(float(want[p - 1].max()), abs=1e-4)
               for p, top in enumerate(lp.top_logprobs[1:], start=1))
    # with a reply: the prompt's entries, then the reply's, as without echo
    both = await client.completions.create(model="tiny", prompt=TEXT, max_tokens=4, echo=True, logprobs=1,
                                           temperature=0)
    alone = await client.completions.create(model="tiny", prompt=TEXT, max_tokens=4, logprobs=1, temperature=0)
    assert both.choices[0].text == TEXT + alone.choices[0].text
    assert both.choices[0].logprobs.token_logprobs[: len(ids)] == lp.token_logprobs
    # (the scored prompt's head reads every position: the reply's logprobs agree to rounding)
    assert both.choices[0].logprobs.token_logprobs[len(ids):] == pytest.approx(
        alone.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert both.usage.completion_tokens == 4


async def test_vllms_prompt_logprobs_field(client, forward):
    ids, want = forward
    reply = await client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0,
                                            extra_body={"prompt_logprobs": 3})
    prompt = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    for p, entry in enumerate(prompt[1:], start=1):
        row = want[p - 1]
        own = entry[str(ids[p])]
        assert abs(own["logprob"] - float(row[ids[p]])) < 1e-4 and own["rank"] == int((row > row[ids[p]]).sum()) + 1
        best = torch.topk(row, 3).indices.tolist()
        assert set(entry) == {str(ids[p])} | {str(i) for i in best}
        assert all(entry[str(i)]["rank"] == r for r, i in enumerate(best, start=1) if i != ids[p])
    assert reply.choices[0].logprobs is None  # echo's shape only where asked


async def test_what_is_refused(client):
    for body, param in (({"max_tokens": 0}, "max_tokens"), ({"echo": True, "logprobs": 1, "stream": True}, "stream"),
                        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs")):
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(model="tiny", prompt="a", **body)
        assert exc.value.param == param
