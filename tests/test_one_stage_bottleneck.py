"""A model trained over two stages, loaded as one: the cut training made inside it (a learned bottleneck,
or a fixed 8-bit quantizer) is applied where it was trained, so one stage serves what the 2-stage ring
serves (greedy, token for token), on the fused path and the HF layers' path alike."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from core.servable import BottleneckCompressor, QuantizerCompressor, load_manifest
from core.servable_plan import plan_stage
from events.requests import Sampling
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.session import Session
from fellow.runtime.model.boundary import apply_inner
from fellow.runtime.model.load.loader import load_one_stage
from fellow.runtime.model.load.weights import build_stage_modules
from fellow.runtime.model.stage import StageModel
from fellow.runtime.ring.loader import load_ring_stage
from fellow.runtime.tools.export import export
from tests.serving_fixtures import make_servable
from tests.tiny import make_tiny_checkpoint

PROMPTS = [list(range(5, 40)), [7, 8, 9], list(range(100, 117))]
NEW = 10


@pytest.fixture(scope="module")
def servables(tmp_path_factory):
    root = tmp_path_factory.mktemp("inner")
    hf = make_tiny_checkpoint(root / "hf-bn", layers=4, hidden=64, seed=2)
    bottleneck = root / "servables" / "tiny-bn"
    export(hf, bottleneck, stages=2, bottleneck=16, model_id="tiny-bn", calib_sequences=16, calib_seq_len=64)
    _, two = make_servable(root, "tiny2", layers=4, hidden=64, stages=2)
    quantizer = root / "servables" / "tiny-q8"
    shutil.copytree(two, quantizer)
    manifest = json.loads((quantizer / "servable.json").read_text())
    manifest.update(model_id="tiny-q8", compressors=[{"kind": "quantizer", "bits": 8}])
    (quantizer / "servable.json").write_text(json.dumps(manifest))
    return {"bottleneck": bottleneck, "quantizer": quantizer}


@pytest.fixture(scope="module")
def ring_replies(servables):
    """What the 2-stage ring answers each prompt, per servable: the whole sequence through both ring
    stages and the boundary's wire codec each step (the ring's own tests hold its cached serving to this)."""
    return {which: {f"s{i}": ring_greedy(model, p) for i, p in enumerate(PROMPTS)}
            for which, model in servables.items()}


def ring_greedy(model_dir, prompt: list[int]) -> list[int]:
    stages = [load_ring_stage(model_dir, i, 2, device="cpu") for i in range(2)]
    ids, out = list(prompt), []
    for _ in range(NEW):
        hidden = stages[0].stage.forward_piece(stages[0].stage.new_cache(), torch.tensor(ids))
        rows = stages[0].sender.encode(hidden)
        x = stages[1].receiver.decode(rows, len(ids), stages[1].stage.dtype, stages[1].stage.input_device)
        token = int(stages[1].stage.forward_piece(stages[1].stage.new_cache(), x).argmax())
        if token in stages[0].stop_ids:
            break
        ids.append(token)
        out.append(token)
    return out


def load(model, path: str):
    """The one-stage load on the fused path, or the same modules on the HF layers' path (unfused)."""
    if path == "fused":
        return load_one_stage(model, "cpu").stage
    mods = build_stage_modules(load_manifest(model), 0, model, num_stages=1, dtype=torch.float32)
    mods.config._attn_implementation = "sdpa"
    stage = StageModel(config=mods.config, layers=mods.layers, first_layer=0, rotary_emb=mods.rotary_emb,
                       embed=mods.embed, norm=mods.norm, head=mods.lm_head)
    apply_inner(stage, mods.inner)
    return stage


def one_stage_greedy(stage) -> dict[str, list[int]]:
    engine = local_engine(stage, kv_tokens=4096, max_batch=4, prefill_chunk=8)
    for i, prompt in enumerate(PROMPTS):
        engine.add(Session(f"s{i}", prompt, NEW, sampling=Sampling(temperature=0.0)))
    out: dict[str, list[int]] = {}
    while engine.busy:
        for sid, tokens in engine.step().tokens.items():
            out.setdefault(sid, []).extend(tokens)
    return out


def test_the_plan_names_the_trained_cut_inside_one_stage(servables):
    manifest = load_manifest(servables["bottleneck"])
    assert [(cut, type(c)) for cut, c in plan_stage(manifest, 0, 1).inner] == [(2, BottleneckCompressor)]
    assert plan_stage(manifest, 0, 2).inner == [] and plan_stage(manifest, 1, 2).inner == []
    assert [(cut, type(c)) for cut, c in plan_stage(load_manifest(servables["quantizer"]), 0, 1).inner] == [
        (2, QuantizerCompressor)]


@pytest.mark.parametrize("which", ["bottleneck", "quantizer"])
@pytest.mark.parametrize("path", ["fused", "hf"])
def test_one_stage_keeps_the_trained_cut_and_equals_the_ring(servables, ring_replies, which, path):
    stage = load(servables[which], path)
    assert stage.kernels.inner == {"2": which}
    assert (stage.fused is not None) == (path == "fused")
    assert one_stage_greedy(stage) == ring_replies[which] and all(ring_replies[which].values())


@pytest.mark.parametrize("path", ["fused", "hf"])
def test_without_the_cut_the_logits_differ(servables, path):
    """The cut does something: the same stage with the bottleneck dropped computes other logits."""
    kept, dropped = load(servables["bottleneck"], path), load(servables["bottleneck"], path)
    for layer in dropped.layers:
        layer._forward_pre_hooks.clear()
    if dropped.fused is not None:
        dropped.fused.before.clear()
    ids = torch.tensor(PROMPTS[0])
    a = kept.forward_piece(kept.new_cache(), ids)
    b = dropped.forward_piece(dropped.new_cache(), ids)
    assert (a - b).abs().max() > 1e-3
