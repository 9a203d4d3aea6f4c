"""Linear weights packed for oneDNN (float32 on a CPU): the same replies as the plain modules and as
HF generate, for every family served, through the loader the fellow uses."""

import copy

import pytest
import torch
import transformers
from torch import nn

from events.stage import StageOptions
from fellow.runtime.model.load.loader import load_one_stage
from fellow.runtime.model.load.packed_linear import PackedLinear, can_pack, pack_stage
from fellow.runtime.model.stage import StageModel
from fellow.runtime.tools.export import export
from tests.tiny import FAMILIES, make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32),
                                reason="this torch has no oneDNN linear")


def greedy(stage: StageModel, ids: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    cache = stage.new_cache()
    logits = stage.prefill(cache, torch.tensor(ids), prefill_chunk=7)
    first, out = logits.clone(), []
    for _ in range(new_tokens):
        token = int(logits.argmax())
        out.append(token)
        logits = stage.decode([cache], torch.tensor([token]))[0]
    return out, first


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_stage_equals_plain_and_generate(tmp_path, family):
    ckpt = make_tiny_checkpoint(tmp_path / family, family, layers=3, hidden=64)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    plain = StageModel.from_causal_lm(model)
    packed = StageModel.from_causal_lm(copy.deepcopy(model))
    linears = sum(type(m) is nn.Linear for layer in packed.layers for m in layer.modules())
    assert pack_stage(packed) == linears + 1  # every projection of every layer, and the head
    assert not any(type(m) is nn.Linear for layer in packed.layers for m in layer.modules())
    assert isinstance(packed.head, PackedLinear)

    ids = torch.randint(0, model.config.vocab_size, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    want, want_logits = greedy(plain, ids, 40)
    got, got_logits = greedy(packed, ids, 40)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)  # another kernel: equal to rounding
    assert got == want
    with torch.inference_mode():
        inputs = torch.tensor([ids])
        reference = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=40,
                                   min_new_tokens=40, do_sample=False)[0, len(ids):].tolist()
    assert got == reference


def test_the_loader_times_both_kernels_unless_told_not_to_pack(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "hf", "qwen2", layers=2, hidden=64, tie_embeddings=True)  # biases, tied
    servable = tmp_path / "servable"
    export(ckpt, servable, stages=1, model_id="tiny-qwen2")
    chosen = load_one_stage(servable, "cpu", StageOptions(max_batch=4))
    plain = load_one_stage(servable, "cpu", StageOptions(packed_linear=False))
    for loaded, timed in ((chosen, {"mkl", "onednn"}), (plain, {"mkl"})):
        kernels = loaded.stage.kernels
        assert kernels.path == "fused" and loaded.stage.fused is not None
        assert set(kernels.shapes) == {"128x64", "64x64", "256x64", "64x128", "384x64"}  # qkv o gate_up down head
        for entry in kernels.shapes.values():
            assert set(entry["ms"]) == timed and entry["kernel"] in timed
            assert all(ms > 0 for times in entry["ms"].values() for ms in times)
    assert chosen.stage.kernels.rows == [1, 4] and plain.stage.kernels.rows == [1, 8]
    assert chosen.stage.layers[0].self_attn.q_proj is None  # the HF weights are gone: each is held once
    assert chosen.stage.fused.layers[0].qkv.bias is not None  # Qwen2's biases, fused too
    ids = list(range(5, 30))
    assert greedy(chosen.stage, ids, 24)[0] == greedy(plain.stage, ids, 24)[0]
    # a tied head keeps the embedding table it shares
    assert chosen.stage.embed.weight.shape == (chosen.stage.config.vocab_size, 64)


def test_other_devices_and_dtypes_keep_their_modules():
    assert not can_pack(torch.device("cpu"), torch.bfloat16)
    assert not can_pack(torch.device("cuda"), torch.float32)
    config = transformers.Qwen3Config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    stage = StageModel.from_causal_lm(model)
    assert pack_stage(stage) == 0
    assert type(stage.head) is nn.Linear
