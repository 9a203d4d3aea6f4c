"""Prompts that arrive together are prefilled in one padded forward, and each reply is what it is alone."""

import pytest
import torch
import transformers

from events.requests import Sampling
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.session import Session
from fellow.runtime.model.stage import StageModel

VOCAB = 512


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def stage(request) -> StageModel:
    common = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB)
    config = (transformers.Qwen3Config(head_dim=16, **common) if request.param == "qwen3"
              else transformers.LlamaConfig(**common))
    torch.manual_seed(3)
    return StageModel.from_causal_lm(transformers.AutoModelForCausalLM.from_config(config).eval())


def sessions(sampled: bool) -> list[Session]:
    lengths = (5, 40, 17, 1, 29)
    gen = torch.Generator().manual_seed(0)
    return [Session(f"s{i}", torch.randint(0, VOCAB, (n,), generator=gen).tolist(), 20,
                    Sampling(temperature=0.9, top_p=0.95, seed=50 + i) if sampled
                    else Sampling(temperature=0.0)) for i, n in enumerate(lengths)]


def run(stage: StageModel, batch: list[Session], chunk: int = 256, max_batch: int = 0) -> tuple[dict, list[int]]:
    engine = local_engine(stage, kv_tokens=8192, prefill_chunk=chunk, max_batch=max_batch)
    for s in batch:
        engine.add(Session(s.session_id, s.prompt_ids, s.max_new_tokens, s.sampling))
    out: dict[str, list[int]] = {}
    first_tokens = []
    while engine.busy:
        result = engine.step()
        first_tokens.append(sum(1 for sid in result.tokens if len(out.get(sid, [])) == 0))
        for sid, tokens in result.tokens.items():
            out.setdefault(sid, []).extend(tokens)
    return out, first_tokens


@pytest.mark.parametrize("sampled", [False, True])
def test_prompts_prefilled_together_equal_each_alone(stage, sampled):
    together, first_tokens = run(stage, sessions(sampled))
    assert first_tokens[0] == 5  # every prompt got its first token in the first step: one padded forward
    for s in sessions(sampled):
        alone, _ = run(stage, [s])
        assert together[s.session_id] == alone[s.session_id], s.session_id


def test_the_padded_batch_respects_the_prefill_chunk(stage):
    _, first_tokens = run(stage, sessions(False), chunk=80)  # 2 rows x 40 is all one step may take
    assert first_tokens[0] == 2 and sum(first_tokens) == 5


def test_max_batch_caps_the_padded_prefill_too(stage):
    for cap, batched in ((0, 5), (2, 2), (1, 0)):  # 1: batching off
        engine = local_engine(stage, kv_tokens=8192, max_batch=cap)
        for s in sessions(False):
            engine.add(s)
        engine.step()
        assert engine.runner.last_prefill_batch == batched, cap
