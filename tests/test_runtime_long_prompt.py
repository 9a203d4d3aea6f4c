"""A 2,000-token prompt served in pieces gives the reply it gives whole; the head reads one position."""

import torch
import transformers

from events.requests import Sampling
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.session import Session
from fellow.runtime.model.stage import StageModel

VOCAB = 512


def stage() -> StageModel:
    config = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                                      max_position_embeddings=4096)
    torch.manual_seed(1)
    return StageModel.from_causal_lm(transformers.AutoModelForCausalLM.from_config(config).eval())


def reply(model: StageModel, prompt: list[int], chunk: int, sampling: Sampling) -> tuple[list[int], int]:
    engine = local_engine(model, kv_tokens=4096, prefill_chunk=chunk)
    engine.add(Session("long", prompt, 24, sampling))
    out, steps = [], 0
    while engine.busy:
        out += engine.step().tokens.get("long", [])
        steps += 1
    return out, steps


def test_two_thousand_token_prompt_in_pieces_equals_whole():
    model = stage()
    prompt = torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(7)).tolist()
    for sampling in (Sampling(temperature=0.0), Sampling(temperature=0.8, top_p=0.9, seed=11)):
        whole, whole_steps = reply(model, prompt, 0, sampling)
        pieces, piece_steps = reply(model, prompt, 256, sampling)
        assert pieces == whole and len(whole) == 24
        assert piece_steps == whole_steps + 7  # ceil(2000 / 256) = 8 pieces, one per step, instead of 1


def test_a_prompt_piece_puts_only_its_last_position_through_the_head():
    model = stage()
    cache = model.new_cache()
    logits = model.forward_piece(cache, torch.arange(300))
    assert logits.shape[-1] == VOCAB and logits.numel() == VOCAB  # one row of logits, not 300
    assert cache.length == 300
