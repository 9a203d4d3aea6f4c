"""Export a tiny checkpoint as a servable and check each stage, loaded alone, rebuilds the model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.servable import ServableError, load_manifest
from fellow.runtime.model.load.weights import build_stage_modules, load_stage_state
from fellow.runtime.tools.export import export
from tests.tiny import make_tiny_checkpoint

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 12, 300]])


def reference_logits(hf_dir) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def run_stages(servable, num_stages=None) -> torch.Tensor:
    manifest = load_manifest(servable)
    n = num_stages or manifest.num_stages
    x = IDS
    for stage in range(n):
        x = build_stage_modules(manifest, stage, servable, num_stages=num_stages).forward(x)
    return x


@pytest.mark.parametrize("family,stages", [("qwen3", 2), ("qwen3", 3), ("llama", 2), ("mistral", 3), ("qwen2", 1)])
def test_round_trip_reproduces_logits(tmp_path, family, stages):
    hf = make_tiny_checkpoint(tmp_path / "hf", family=family)
    export(hf, tmp_path / "sv", stages=stages)
    assert torch.allclose(run_stages(tmp_path / "sv"), reference_logits(hf), atol=1e-5)


def test_each_shard_holds_only_its_stage(tmp_path):
    hf = make_tiny_checkpoint(tmp_path / "hf", layers=6)
    manifest = export(hf, tmp_path / "sv", stages=3)
    assert manifest.boundaries == [[0, 2], [2, 4], [4, 6]]
    first = load_stage_state(tmp_path / "sv", 0)
    middle = load_stage_state(tmp_path / "sv", 1)
    last = load_stage_state(tmp_path / "sv", 2)
    assert "embed_tokens.weight" in first and "lm_head.weight" not in first
    assert {k.split(".")[1] for k in middle} == {"2", "3"}
    # tied embeddings: the last stage has its own copy of the head
    assert torch.equal(last["lm_head.weight"], first["embed_tokens.weight"])
    assert "norm.weight" in last and "embed_tokens.weight" not in last


def test_serving_with_another_stage_count_reads_overlapping_shards(tmp_path):
    hf = make_tiny_checkpoint(tmp_path / "hf", layers=6, tie_embeddings=False)
    export(hf, tmp_path / "sv", stages=3)
    state = load_stage_state(tmp_path / "sv", 0, num_stages=2)  # layers 0..3 span shards 0 and 1
    assert sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")}) == [0, 1, 2]
    assert torch.allclose(run_stages(tmp_path / "sv", num_stages=2), reference_logits(hf), atol=1e-5)


def test_export_without_boundaries_serves_only_its_own_count(tmp_path):
    hf = make_tiny_checkpoint(tmp_path / "hf")
    export(hf, tmp_path / "sv", stages=2)
    path = tmp_path / "sv" / "servable.json"
    doc = json.loads(path.read_text())
    doc["boundaries"] = None  # as an export from before boundaries were recorded
    path.write_text(json.dumps(doc))
    assert load_manifest(tmp_path / "sv").boundaries is None
    assert torch.allclose(run_stages(tmp_path / "sv"), reference_logits(hf), atol=1e-5)
    with pytest.raises(ServableError, match="records no boundaries"):
        load_stage_state(tmp_path / "sv", 0, num_stages=3)
