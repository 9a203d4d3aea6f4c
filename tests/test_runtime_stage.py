"""A stage over real tiny HF models: greedy equals generate, prompt pieces equal the whole prompt, stages chain."""

import pytest
import torch
import transformers

from events.requests import Sampling
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.session import Session
from fellow.runtime.model.stage import StageModel

SHAPE = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512)
GREEDY = Sampling(temperature=0.0)
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def tiny_model(kind: str, attention: str = "sdpa", seed: int = 0, device: str = "cpu"):
    config = (transformers.Qwen3Config if kind == "qwen3" else transformers.LlamaConfig)(**SHAPE)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention,
                                                          dtype=torch.float32).eval().to(device)
    model.generation_config.eos_token_id = None  # random weights: generate the full length
    model.generation_config.pad_token_id = 0
    return model


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, SHAPE["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_alone(model, ids: list[int], new_tokens: int, prefill_chunk: int = 0) -> list[int]:
    engine = local_engine(StageModel.from_causal_lm(model), kv_tokens=4096, prefill_chunk=prefill_chunk)
    engine.add(Session("s", ids, new_tokens, GREEDY))
    tokens = []
    while engine.busy:
        tokens += engine.step().tokens.get("s", [])
    return tokens


@pytest.mark.parametrize("kind,attention,device", [("qwen3", "sdpa", "cpu"), ("llama", "sdpa", "cpu"),
                                                   ("qwen3", "eager", "cpu"),
                                                   pytest.param("qwen3", "sdpa", "cuda", marks=ON_GPU)])
def test_greedy_equals_generate(kind, attention, device):
    model = tiny_model(kind, attention, device=device)
    ids = prompt(23, seed=1)
    with torch.inference_mode():
        inputs = torch.tensor([ids], device=device)
        reference = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=36,
                                   do_sample=False)[0, len(ids):].tolist()
    assert len(reference) == 36
    assert run_alone(model, ids, 36) == reference
    assert run_alone(model, ids, 36, prefill_chunk=5) == reference


def test_prompt_in_pieces_equals_whole_prompt():
    stage = StageModel.from_causal_lm(tiny_model("qwen3"))
    ids = torch.tensor(prompt(50, seed=2))
    whole, pieces = stage.new_cache(), stage.new_cache()
    whole_logits = stage.prefill(whole, ids, prefill_chunk=0)
    piece_logits = stage.prefill(pieces, ids, prefill_chunk=7)
    assert whole.length == pieces.length == 50
    assert piece_logits.shape == (SHAPE["vocab_size"],)  # the head read only the last position
    torch.testing.assert_close(piece_logits, whole_logits, rtol=1e-4, atol=1e-5)
    for slot in range(whole.num_layers):
        torch.testing.assert_close(pieces.layer(slot)[0], whole.layer(slot)[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pieces.layer(slot)[1], whole.layer(slot)[1], rtol=1e-4, atol=1e-5)


def test_two_stages_chained_equal_one():
    model = tiny_model("llama", seed=3)
    whole = StageModel.from_causal_lm(model)
    first, last = StageModel.from_causal_lm(model, 0, 2), StageModel.from_causal_lm(model, 2)
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False, False, True)
    ids = torch.tensor(prompt(30, seed=4))
    whole_cache, first_cache, last_cache = whole.new_cache(), first.new_cache(), last.new_cache()
    expected = whole.prefill(whole_cache, ids, prefill_chunk=8)
    for start in range(0, 30, 8):  # the ring passes every piece on, in order
        hidden = first.forward_piece(first_cache, ids[start : start + 8])
        assert hidden.shape == (1, min(8, 30 - start), SHAPE["hidden_size"])
        got = last.forward_piece(last_cache, hidden)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    token = torch.tensor([int(expected.argmax())])
    step_whole = whole.decode([whole_cache], token)
    step_ring = last.decode([last_cache], first.decode([first_cache], token))
    torch.testing.assert_close(step_ring, step_whole, rtol=1e-4, atol=1e-5)
    assert (first_cache.num_layers, last_cache.first_layer, last_cache.num_layers) == (2, 2, 1)


def test_unbatchable_attention_is_refused():
    model = tiny_model("qwen3")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="padded batch"):
        StageModel.from_causal_lm(model)
