"""LoRA variants beyond one r and alpha: ``rank_pattern`` / ``alpha_pattern`` (rsLoRA too) give each module
PEFT's own scale, and an embedding's LoRA adds PEFT's delta to the table. A full-precision stage merges
them and computes what PEFT's ``PeftModel`` does; a quantized stage keeps the patterned adapters apart,
lean at each module's scale, computing what PEFT's own layers do over the same quantized weights."""

from __future__ import annotations

import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from core.quantization import INT8
from events.stage import StageOptions
from fellow.runtime.model.load.loader import build_stage
from fellow.runtime.model.load.lora_merge import lora_scale
from fellow.runtime.model.load.weights import build_stage_modules
from fellow.runtime.tools.export import export
from tests.test_servable_adapters import IDS
from tests.tiny import make_tiny_checkpoint

# a pattern by layer and module (layer 2's q_proj) and one by module name alone (every v_proj)
PATTERNS = dict(rank_pattern={"layers.2.self_attn.q_proj": 2, "down_proj": 6},
                alpha_pattern={"v_proj": 32, "model.layers.1.self_attn.q_proj": 3})


def variant_lora(tmp_path, **config):
    """(base checkpoint, saved adapters, PEFT's own logits over IDS) for a LoraConfig of ``config``."""
    hf = make_tiny_checkpoint(tmp_path / "hf", layers=4, hidden=64)
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    torch.manual_seed(2)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], **config}
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **config)).eval()
    peft_model.save_pretrained(str(tmp_path / "lora"))
    with torch.no_grad():
        expected = peft_model(input_ids=IDS).logits
    return hf, tmp_path / "lora", expected, peft_model


def served(manifest, sv, stages: int) -> torch.Tensor:
    x = IDS
    for stage in range(stages):
        x = build_stage_modules(manifest, stage, sv, num_stages=stages).forward(x)
    return x


@pytest.mark.parametrize("rslora", [False, True])
def test_rank_and_alpha_patterns_merge_at_each_modules_own_peft_scale(tmp_path, rslora):
    hf, lora, expected, peft_model = variant_lora(tmp_path, use_rslora=rslora, **PATTERNS)
    manifest = export(hf, tmp_path / "sv", stages=2, adapters=lora)
    # each module's scale is the one PEFT gave its layer
    layers = peft_model.base_model.model.model.layers
    for i, layer in enumerate(layers):
        for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            assert lora_scale(manifest.adapter_config, f"layers.{i}.{name}") == \
                pytest.approx(layer.get_submodule(name).scaling["default"])
    assert len({layer.self_attn.q_proj.scaling["default"] for layer in layers}) == 3  # the patterns bite
    got = served(manifest, tmp_path / "sv", 2)
    assert torch.allclose(got, expected, atol=1e-5)
    one_scale = dict(manifest.adapter_config, rank_pattern={}, alpha_pattern={})
    manifest.adapter_config.update(one_scale)
    assert not torch.allclose(served(manifest, tmp_path / "sv", 2), expected, atol=1e-3)  # patterns count


def test_embedding_lora_merges_into_the_table_as_peft_adds_it(tmp_path):
    hf, lora, expected, _ = variant_lora(tmp_path, target_modules=["embed_tokens", "q_proj"])
    manifest = export(hf, tmp_path / "sv", stages=2, adapters=lora)
    got = served(manifest, tmp_path / "sv", 2)
    assert torch.allclose(got, expected, atol=1e-5)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(hf)).eval()(input_ids=IDS).logits
    assert not torch.allclose(base, expected, atol=1e-3)


def test_patterned_adapters_over_int8_serve_lean_what_peft_layers_do(tmp_path):
    """Over an int8 base the patterned adapters stay apart, lean (fused layers) at each module's scale:
    the logits are those of PEFT's own layers over the same int8 weights (SWARM_SERVE_LORA=peft)."""
    hf, lora, tuned, _ = variant_lora(tmp_path, **PATTERNS)
    manifest = export(hf, tmp_path / "sv", stages=1, adapters=lora)
    built = {mode: build_stage(manifest, 0, tmp_path / "sv", 1, torch.device("cpu"),
                               StageOptions(quantization=INT8, lora=mode))[1] for mode in ("lean", "peft")}
    assert built["lean"].kernels.path == "fused" and built["peft"].kernels.path == "hf"
    logits = {mode: stage.prefill(stage.new_cache(), IDS[0]) for mode, stage in built.items()}
    assert float((logits["lean"] - logits["peft"]).abs().max()) < 1e-4
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(hf)).eval()(input_ids=IDS).logits[0, -1]
    effect = float((base - tuned[0, -1]).abs().max())
    assert float((logits["lean"] - tuned[0, -1]).abs().max()) < effect / 4


def test_embedding_lora_over_int8_is_merged_into_the_table_before_its_rows_are_rounded(tmp_path, caplog):
    hf, lora, tuned, _ = variant_lora(tmp_path, target_modules=["embed_tokens", "q_proj"])
    manifest = export(hf, tmp_path / "sv", stages=1, adapters=lora)
    with caplog.at_level(logging.INFO):
        stage = build_stage(manifest, 0, tmp_path / "sv", 1, torch.device("cpu"),
                            StageOptions(quantization=INT8))[1]
    assert any("embed_tokens" in r.getMessage() and "merged" in r.getMessage() for r in caplog.records)
    got = stage.prefill(stage.new_cache(), IDS[0])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(hf)).eval()(input_ids=IDS).logits[0, -1]
    effect = float((base - tuned[0, -1]).abs().max())
    assert float((got - tuned[0, -1]).abs().max()) < effect / 4


def test_lora_bias_merges_into_the_base_bias_and_goes_to_peft_over_int8(tmp_path, caplog):
    """PEFT's lora_bias (B's own bias, scaled with its product) on a qwen2 model, whose q/k/v have biases:
    a full-precision stage merges it into the base bias (PEFT's forward, exactly); over int8 lean does
    not compute it, so those modules are served through PEFT's own layers under ``lean`` too, with a log
    line saying so, and compute what ``peft`` mode does."""
    hf = make_tiny_checkpoint(tmp_path / "hf", family="qwen2", layers=2, hidden=64)
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_bias=True, init_lora_weights=False)
    peft_model = get_peft_model(model, config).eval()
    with torch.no_grad():
        for module in peft_model.modules():
            if hasattr(module, "lora_B") and "default" in module.lora_B:
                module.lora_B["default"].bias.normal_(0, 1.0)  # a bias training moved
        expected = peft_model(input_ids=IDS).logits
    peft_model.save_pretrained(str(tmp_path / "lora"))
    manifest = export(hf, tmp_path / "sv", stages=1, adapters=tmp_path / "lora")
    assert torch.allclose(served(manifest, tmp_path / "sv", 1), expected, atol=1e-5)

    from peft.tuners.lora.layer import Linear as PeftLinear

    with caplog.at_level(logging.INFO):
        built = {mode: build_stage(manifest, 0, tmp_path / "sv", 1, torch.device("cpu"),
                                   StageOptions(quantization=INT8, lora=mode))[1] for mode in ("lean", "peft")}
    assert any("lora_bias on 4 modules served through PEFT" in r.getMessage() for r in caplog.records)
    assert built["lean"].kernels.lora == {"mode": "lean", "modules": 4, "peft": {"lora_bias": 4}}
    assert sum(isinstance(m, PeftLinear) for layer in built["lean"].layers for m in layer.modules()) == 4
    logits = {mode: stage.prefill(stage.new_cache(), IDS[0]) for mode, stage in built.items()}
    assert torch.equal(logits["lean"], logits["peft"])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(hf)).eval()(input_ids=IDS).logits[0, -1]
    effect = float((base - expected[0, -1]).abs().max())
    assert float((logits["lean"] - expected[0, -1]).abs().max()) < effect / 4

    # the spec's [stage0 lora-cost] over the stage that sent its lora_bias modules to PEFT: four ways, then as served
    from fellow.runtime.model.load.kernels import lora_costs

    costs = lora_costs(built["lean"])
    assert list(costs) == ["peft_ms", "lean_ms", "lean16_ms", "off_ms"] and all(ms > 0 for ms in costs.values())
    assert torch.equal(built["lean"].prefill(built["lean"].new_cache(), IDS[0]), logits["lean"])
