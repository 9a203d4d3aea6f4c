"""export: "adapters" stores only LoRA weights per stage; a stage merges them over its base's layers."""

from __future__ import annotations

import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from core.servable import ServableError, load_manifest, param_count
from fellow.runtime.tools.export import export
from fellow.runtime.model.weights import build_stage_modules, load_stage_state
from tests.tiny import make_tiny_checkpoint

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])


def tiny_lora(tmp_path, keep_model: bool = False):
    """(base checkpoint, saved adapters, the tuned model's logits over IDS); ``keep_model``: the PEFT model."""
    hf = make_tiny_checkpoint(tmp_path / "hf", layers=4, hidden=64)
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    torch.manual_seed(1)
    # init_lora_weights=False: B is random too, so the adapters change every output.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
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
