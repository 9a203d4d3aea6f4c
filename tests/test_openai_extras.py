"""vLLM's extras of the OpenAI API through the official client against `swarm leader` and `swarm fellow`
processes serving a tiny real model: /tokenize, /detokenize, completions, logprobs, penalties, n."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serving_fixtures import one_model_stack

pytestmark = pytest.mark.slow
PROMPT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    for stack, hf, _ in one_model_stack(tmp_path_factory.mktemp("openai-extras"), layers=2, hidden=64):
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
