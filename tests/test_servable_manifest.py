"""servable.json validation, sizing from safetensors headers, and the torch-free import rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from core.servable import ServableError, load_manifest, param_count, verify_checksums
from core.servable_plan import plan_stage
from fellow.runtime.tools.calibration import default_texts
from fellow.runtime.tools.export import export
from tests.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def servable(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("servable")
    hf = make_tiny_checkpoint(tmp / "hf", layers=4, hidden=64)
    export(hf, tmp / "sv", stages=2, model_id="tiny")
    return hf, tmp / "sv"


def copy_of(servable_dir: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(servable_dir, tmp_path / "copy"))


def test_valid_manifest_loads(servable):
    _, sv = servable
    manifest = load_manifest(sv)
    assert manifest.model_id == "tiny" and manifest.format_version == "1.0"
    assert manifest.architecture == "Qwen3ForCausalLM" and manifest.num_layers == 4
    assert manifest.pieces == {"embed_tokens": 0, "norm": 1, "lm_head": 1}
    assert "<think>" in manifest.chat_template and manifest.generation.eos_token_ids
    verify_checksums(manifest, sv)


def test_missing_shard_file_is_named(servable, tmp_path):
    sv = copy_of(servable[1], tmp_path)
    (sv / "shards/stage-1/weights.safetensors").unlink()
    with pytest.raises(ServableError, match="missing shard file shards/stage-1/weights.safetensors"):
        load_manifest(sv)


def test_missing_manifest_and_tokenizer(servable, tmp_path):
    with pytest.raises(ServableError, match="no servable.json"):
        load_manifest(tmp_path)
    sv = copy_of(servable[1], tmp_path)
    import shutil

    shutil.rmtree(sv / "tokenizer")
    with pytest.raises(ServableError, match="missing tokenizer/"):
        load_manifest(sv)


def test_bad_json_is_one_line(servable, tmp_path):
    sv = copy_of(servable[1], tmp_path)
    (sv / "servable.json").write_text('{"model_id": "tiny",')
    with pytest.raises(ServableError, match="not valid JSON") as err:
        load_manifest(sv)
    assert "\n" not in str(err.value)


def test_unknown_major_version_is_refused_minor_is_not(servable, tmp_path):
    sv = copy_of(servable[1], tmp_path)
    doc = json.loads((sv / "servable.json").read_text())
    doc["format_version"] = "1.7"
    (sv / "servable.json").write_text(json.dumps(doc))
    assert load_manifest(sv).format_version == "1.7"
    doc["format_version"] = "2.0"
    (sv / "servable.json").write_text(json.dumps(doc))
    with pytest.raises(ServableError, match="format_version '2.0' is not supported"):
        load_manifest(sv)


def test_tampered_shard_fails_size_and_checksum(servable, tmp_path):
    sv = copy_of(servable[1], tmp_path)
    shard = sv / "shards/stage-0/weights.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ServableError, match="does not match its sha256"):
        verify_checksums(load_manifest(sv), sv)
    shard.write_bytes(bytes(data) + b"x")
    with pytest.raises(ServableError, match="manifest says"):
        load_manifest(sv)


def test_inconsistent_boundaries_are_refused(servable, tmp_path):
    sv = copy_of(servable[1], tmp_path)
    doc = json.loads((sv / "servable.json").read_text())
    doc["boundaries"] = [[0, 3], [2, 4]]
    (sv / "servable.json").write_text(json.dumps(doc))
    with pytest.raises(ServableError, match="do not split 4 layers"):
        load_manifest(sv)


@pytest.mark.parametrize("tie", [True, False])
def test_param_count_from_headers_equals_torch(tmp_path, tie):
    hf = make_tiny_checkpoint(tmp_path / "hf", family="llama", layers=3, hidden=64, tie_embeddings=tie)
    # codec tensors sit in the shards too; they must not count as parameters
    export(hf, tmp_path / "sv", stages=3, bottleneck=16, calibration=default_texts()[:4], calib_seq_len=32)
    torch_count = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(hf)).parameters())
    assert param_count(tmp_path / "sv") == torch_count


def test_plan_reads_every_overlapping_shard(tmp_path):
    hf = make_tiny_checkpoint(tmp_path / "hf", layers=6)
    manifest = export(hf, tmp_path / "sv", stages=3)  # [0,2) [2,4) [4,6)
    assert [plan_stage(manifest, s).shards for s in range(3)] == [[0], [1], [2]]
    two = [plan_stage(manifest, s, 2) for s in range(2)]  # [0,3) [3,6)
    assert [p.layers for p in two] == [(0, 3), (3, 6)]
    assert [p.shards for p in two] == [[0, 1], [1, 2]]
    with pytest.raises(ServableError, match="out of range"):
        plan_stage(manifest, 3)


def test_core_servable_never_imports_torch():
    code = ("import core.servable, core.servable_plan, sys; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
