"""Grouped attention (fellow.runtime.model.grouped_attention): what sdpa computes over repeated keys and
values, to rounding, for every mask a stage hands its HF layers; a stage of HF layers serves the same
greedy tokens with it; SWARM_SERVE_ATTENTION chooses it per stage and the status says which."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from core.settings import Settings, SettingsError
from events.stage import StageOptions
from fellow.runtime.model.grouped_attention import GROUPED, choose_attention, grouped_attention_forward
from fellow.runtime.model.load.loader import build_stage
from fellow.runtime.model.masks import piece_mask
from fellow.runtime.model.stage import StageModel
from tests.serving_fixtures import make_servable
from tests.tiny import make_tiny_checkpoint

HEADS, KV, DIM = 8, 2, 16


class Layer(torch.nn.Module):
    num_key_value_groups = HEADS // KV
    is_causal = True


def qkv(batch: int, q: int, total: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, HEADS, q, DIM, generator=g), torch.randn(batch, KV, total, DIM, generator=g),
            torch.randn(batch, KV, total, DIM, generator=g))


def both(query, key, value, mask):
    got, _ = grouped_attention_forward(Layer(), query, key, value, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(Layer(), query, key, value, mask, scaling=0.25)
    return got, want


@pytest.mark.parametrize("case", ["decode-batch", "verify", "causal-none", "window", "per-head", "bool"])
def test_grouped_attention_equals_sdpa_over_repeated_keys(case):
    batch, q, total = {"decode-batch": (3, 1, 40), "verify": (1, 4, 40)}.get(case, (2, 5, 30))
    query, key, value = qkv(batch, q, total)
    hidden = torch.zeros(1, q, 4)
    mask = {"decode-batch": lambda: torch.randn(batch, 1, 1, total).clamp(max=0) * 50,  # padded rows
            "verify": lambda: piece_mask(total - q, q, hidden),
            "causal-none": lambda: None,
            "window": lambda: piece_mask(total - q, q, hidden, window=8),
            "per-head": lambda: piece_mask(total - q, q, hidden).expand(batch, HEADS, q, total).clone(),
            "bool": lambda: torch.rand(batch, 1, q, total) > 0.3}[case]()
    if case == "per-head":
        mask[:, 1::2, :, : total // 2] = torch.finfo(mask.dtype).min  # odd heads see only the later half
    if case == "bool":
        mask[..., -1] = True  # every row sees a key
    got, want = both(query, key, value, mask)
    assert got.shape == want.shape == (batch, q, HEADS, DIM)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())


def test_the_setting_and_the_choice():
    assert choose_attention("auto", torch.float32, torch.device("cpu")) == "sdpa"  # fused CPU layers attend grouped
    assert choose_attention("auto", torch.float32, torch.device("cuda")) == GROUPED  # where the spec measured it
    assert choose_attention("auto", torch.float16, torch.device("cuda")) == "sdpa"
    assert choose_attention("grouped", torch.float16, torch.device("cpu")) == GROUPED
    assert choose_attention("sdpa", torch.float32, torch.device("cuda")) == "sdpa"
    assert Settings.from_env({"SWARM_SERVE_ATTENTION": "grouped"}).serving.attention == "grouped"
    assert Settings.from_env({}).serving.attention == "auto"
    with pytest.raises(SettingsError, match="SWARM_SERVE_ATTENTION='flash' must be one of: auto, grouped, sdpa"):
        Settings.from_env({"SWARM_SERVE_ATTENTION": "flash"})


def greedy(stage: StageModel, ids: list[int], n: int) -> list[int]:
    cache = stage.new_cache()
    logits = stage.prefill(cache, torch.tensor(ids), prefill_chunk=5)  # pieces: masked, several queries
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = stage.decode([cache], torch.tensor([out[-1]]))[0]
    return out


def test_a_stage_of_hf_layers_serves_the_same_with_grouped_attention(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path, "qwen3", layers=3, hidden=128)  # 4 query heads a key/value head
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    stages = {}
    for name in ("sdpa", GROUPED):
        m = copy.deepcopy(model)
        m.config._attn_implementation = name
        stages[name] = StageModel.from_causal_lm(m)
    ids = list(range(5, 30))
    assert greedy(stages[GROUPED], ids, 10) == greedy(stages["sdpa"], ids, 10)
    verify = {}
    for name, stage in stages.items():  # a verify pass: several queries over a past, the HF layers' way
        cache = stage.new_cache()
        stage.prefill(cache, torch.tensor(ids))
        verify[name] = stage.verify([cache], [[7, 8, 9]])[0]
    assert torch.allclose(verify[GROUPED], verify["sdpa"], atol=1e-5)


def test_the_load_status_says_which_attention(tmp_path):
    """Fused layers attend on their own; a stage of HF layers (a Qwen3-MoE model) takes the setting's choice
    and serves the same greedy tokens either way."""
    from core.servable import load_manifest

    _, dense = make_servable(tmp_path / "dense", stages=1)
    built = build_stage(load_manifest(dense), 0, dense, 1, torch.device("cpu"), StageOptions(attention="grouped"))[1]
    assert built.kernels.attention == "fused"
    _, moe = make_servable(tmp_path / "moe", family="qwen3_moe", stages=1, hidden=128)
    stages = {choice: build_stage(load_manifest(moe), 0, moe, 1, torch.device("cpu"),
                                  StageOptions(attention=choice))[1] for choice in ("auto", "grouped")}
    assert {c: s.kernels.attention for c, s in stages.items()} == {"auto": "sdpa", "grouped": "grouped"}
    assert stages["grouped"].config._attn_implementation == GROUPED
    ids = list(range(5, 25))
    assert greedy(stages["grouped"], ids, 8) == greedy(stages["auto"], ids, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_attention_equals_sdpa_on_a_card(dtype):
    query, key, value = (t.to("cuda", dtype) for t in qkv(1, 3, 2048))
    mask = piece_mask(2045, 3, torch.zeros(1, 3, 4, dtype=dtype, device="cuda"))
    got, want = both(query, key, value, mask)
    assert torch.allclose(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 2e-3)
