"""`export(bottleneck=D)`: a PCA codec on each boundary, its halves in the shards, its error recorded."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.servable import BottleneckCompressor, NoCompressor, load_manifest
from core.servable_plan import plan_stage
from fellow.runtime.model.load.weights import build_stage_modules
from fellow.runtime.tools.calibration import default_texts
from fellow.runtime.tools.export import export
from tests.tiny import make_tiny_checkpoint

TEXTS = default_texts()[10:18]  # 8 texts: the export holds out the last 2
SEQ_LEN = 64


def exported(tmp_path, dim=16):
    hf = make_tiny_checkpoint(tmp_path / "hf", layers=4, hidden=64)
    export(hf, tmp_path / "sv", stages=2, bottleneck=dim, calibration=TEXTS, calib_seq_len=SEQ_LEN)
    return hf, tmp_path / "sv", load_manifest(tmp_path / "sv")


def test_bottleneck_halves_the_boundary_bytes(tmp_path):
    hf, sv, manifest = exported(tmp_path, dim=16)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])
    stage0 = build_stage_modules(manifest, 0, sv)
    sent = stage0.forward(ids)
    uncompressed = ids.shape[1] * manifest.hidden_size * sent.element_size()
    assert sent.shape == (1, ids.shape[1], 16)
    assert sent.nbytes * 2 <= uncompressed
    stage1 = build_stage_modules(manifest, 1, sv)
    assert stage1.encoder is None and stage1.decoder is not None and stage0.decoder is None
    logits = stage1.forward(sent)
    assert logits.shape == (1, ids.shape[1], manifest.config["vocab_size"])


def test_recorded_error_matches_a_measurement_on_held_out_text(tmp_path):
    hf, sv, manifest = exported(tmp_path, dim=16)
    codec = manifest.compressors[0]
    assert isinstance(codec, BottleneckCompressor) and codec.dim == 16
    assert codec.file == "shards/stage-0/weights.safetensors"
    tokenizer = AutoTokenizer.from_pretrained(str(sv / "tokenizer"))
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    encoder = build_stage_modules(manifest, 0, sv).encoder
    decoder = build_stage_modules(manifest, 1, sv).decoder
    num, den = 0.0, 0.0
    with torch.no_grad():
        for text in TEXTS[-2:]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:SEQ_LEN]
            h = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[2].double()
            rebuilt = decoder(encoder(h.float())).double()
            num += float(((h - rebuilt) ** 2).sum())
            den += float((h**2).sum())
    measured = num / den
    assert 0.0 < measured < 1.0
    assert abs(codec.error - measured) <= 1e-6 * max(measured, 1e-12) + 1e-9


def test_wider_bottleneck_has_smaller_error(tmp_path):
    _, _, narrow = exported(tmp_path / "a", dim=4)
    _, _, wide = exported(tmp_path / "b", dim=32)
    assert wide.compressors[0].error < narrow.compressors[0].error


def test_only_trained_cuts_are_compressed_at_another_stage_count(tmp_path):
    _, sv, manifest = exported(tmp_path, dim=16)
    plans = [plan_stage(manifest, s, 4) for s in range(4)]  # cuts at layers 1, 2, 3; trained at 2
    assert [type(p.send) for p in plans[:3]] == [NoCompressor, BottleneckCompressor, NoCompressor]
    assert isinstance(plans[2].recv, BottleneckCompressor)
    stage1 = build_stage_modules(manifest, 1, sv, num_stages=4)
    stage3 = build_stage_modules(manifest, 3, sv, num_stages=4)
    assert stage1.encoder is not None and stage1.decoder is None and stage3.decoder is None
