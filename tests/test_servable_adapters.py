"""export: "adapters" stores only LoRA weights per stage; a stage merges them over its base's layers."""

from __future__ import annotations

import shutil

import pytest
import safetensors.torch
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from core.servable import ServableError, load_manifest, param_count
from fellow.runtime.model.load.lora_merge import MAGNITUDE, merge_lora
from fellow.runtime.model.load.weights import build_stage_modules, load_stage_state
from fellow.runtime.tools.export import export
from tests.tiny import make_tiny_checkpoint

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])


def tiny_lora(tmp_path, keep_model: bool = False, dora: bool = False):
    """(base checkpoint, saved adapters, the tuned model's logits over IDS); ``keep_model``: the PEFT model.
    ``dora``: DoRA adapters, their magnitudes moved off the base's row norms (as training moves them)."""
    hf = make_tiny_checkpoint(tmp_path / "hf", layers=4, hidden=64)
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    torch.manual_seed(1)
    # init_lora_weights=False: B is random too, so the adapters change every output.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                        use_dora=dora)
    peft_model = get_peft_model(model, config)
    for module in peft_model.modules() if dora else ():
        if hasattr(module, "lora_magnitude_vector") and "default" in module.lora_magnitude_vector:
            with torch.no_grad():
                magnitude = module.lora_magnitude_vector["default"].weight
                magnitude.mul_(1 + 0.3 * torch.randn_like(magnitude))
    if keep_model:
        return peft_model.eval()
    peft_model.save_pretrained(str(tmp_path / "lora"))
    with torch.no_grad():
        expected = peft_model(input_ids=IDS).logits
    return hf, tmp_path / "lora", expected


def test_adapters_export_holds_only_lora_weights_and_rebuilds_the_tuned_model(tmp_path):
    hf, lora, expected = tiny_lora(tmp_path)
    manifest = export(hf, tmp_path / "sv", stages=2, adapters=lora)
    assert manifest.export == "adapters" and manifest.base == str(hf.resolve())
    assert manifest.adapter_config["r"] == 4
    for stage in range(2):
        state = load_stage_state(tmp_path / "sv", stage)
        assert state and all(".lora_" in k for k in state)
    x = IDS
    for stage in range(2):
        x = build_stage_modules(manifest, stage, tmp_path / "sv").forward(x)
    assert torch.allclose(x, expected, atol=1e-5)
    base_only = AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    with torch.no_grad():
        assert not torch.allclose(base_only(input_ids=IDS).logits, expected, atol=1e-3)


def test_dora_adapters_export_and_merge_into_the_tuned_model(tmp_path):
    """DoRA (use_dora): the export keeps each module's magnitude beside A and B, and a full-precision
    stage merges PEFT's row factor into its weights: the logits are the tuned model's, not plain LoRA's."""
    hf, lora, expected = tiny_lora(tmp_path, dora=True)
    manifest = export(hf, tmp_path / "sv", stages=2, adapters=lora)
    assert manifest.adapter_config["use_dora"] is True
    assert any(k.endswith(".lora_magnitude_vector") for k in load_stage_state(tmp_path / "sv", 0))
    x = IDS
    for stage in range(2):
        x = build_stage_modules(manifest, stage, tmp_path / "sv").forward(x)
    assert torch.allclose(x, expected, atol=1e-4), float((x - expected).abs().max())
    lora_tensors = load_stage_state(tmp_path / "sv", 0)
    base = {k.removeprefix("model."): v for k, v in safetensors.torch.load_file(str(hf / "model.safetensors")).items()}
    plain = {k: v for k, v in lora_tensors.items() if not k.endswith(MAGNITUDE)}
    q = "layers.0.self_attn.q_proj.weight"  # the magnitudes move the merged weight, not only A and B
    with_dora, without = (merge_lora(base, t, manifest.adapter_config)[q] for t in (lora_tensors, plain))
    assert float((with_dora - without).abs().max()) > 1e-3


def test_adapters_export_is_sized_by_its_base(tmp_path):
    hf, lora, _ = tiny_lora(tmp_path)
    export(hf, tmp_path / "sv", stages=2, adapters=lora, base_id="org/tiny-base")
    manifest = load_manifest(tmp_path / "sv")
    base_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(hf)).parameters())
    cache = tmp_path / "cache"
    shutil.copytree(hf, cache / "org" / "tiny-base")
    assert param_count(tmp_path / "sv", model_cache=cache) == base_params
    assert manifest.size_bytes * 10 < base_params * 4  # the shards are a few percent of the model
    # without the base on disk: the shape rule, never the shard files
    assert param_count(tmp_path / "sv", model_cache=tmp_path / "empty") == 12 * 4 * 64**2
    with pytest.raises(ServableError, match="not on this machine"):
        build_stage_modules(manifest, 0, tmp_path / "sv", model_cache=tmp_path / "empty")
