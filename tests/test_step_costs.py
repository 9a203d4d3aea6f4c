"""The spec's step costs (fellow.runtime.model.load.step_report): verify, batch, attention, graph-spike and
profile on a stage whole and on a ring's two halves, the stage serving exactly as before; the setting's
three values."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers

from core.settings import Settings, SettingsError
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.load.step_report import BATCH_ROWS, VERIFY_CONTEXTS, VERIFY_WIDTHS, measure, verify_contexts
from fellow.runtime.model.stage import StageModel
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", layers=4, hidden=64)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None
    return m


def greedy(first: StageModel, last: StageModel | None, ids: list[int], n: int) -> list[int]:
    caches = [first.new_cache()] + ([last.new_cache()] if last else [])

    def run(step, x):
        out = step(first, caches[0], x)
        return step(last, caches[1], out) if last else out

    logits = run(lambda s, c, x: s.prefill(c, x), torch.tensor(ids))
    out = []
    for _ in range(n):
        out.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
        logits = run(lambda s, c, x: s.decode([c], x), torch.tensor([out[-1]]))
    return out


def assert_costs(report: dict, profiled: bool, config) -> None:
    verify = report["verify_ms"]
    contexts = verify_contexts(config)  # 256 and 2,048, or the model's longest
    assert contexts[0] == min(VERIFY_CONTEXTS) and len(contexts) == 2
    assert contexts[1] == min(max(VERIFY_CONTEXTS), config.max_position_embeddings - max(VERIFY_WIDTHS))
    assert set(verify) == {str(c) for c in contexts}
    for widths in verify.values():
        assert set(widths) == {str(w) for w in VERIFY_WIDTHS} and all(ms > 0 for ms in widths.values())
    assert set(report["batch_ms"]) == {str(r) for r in BATCH_ROWS} and all(ms > 0 for ms in report["batch_ms"].values())
    attn = report["attn"]  # sdpa against grouped attention at the longest context
    assert attn["context"] == contexts[1]
    assert attn["heads"] == f"{config.num_attention_heads}/{config.num_key_value_heads}"
    for name in ("sdpa_ms", "grouped_ms"):
        assert set(attn[name]) == {"1", "3", "batch4"} and all(ms > 0 for ms in attn[name].values())
    assert report["graph_spike"].startswith("needs CUDA")
    if profiled:
        p = report["profile"]
        assert p["cpu_ms"] > 0 and p["kernel_launches"] == 0 and 0 < len(p["ops"]) <= 5
        assert any("mm" in op or "linear" in op for op in p["ops"]), p["ops"]
    else:
        assert "profile" not in report


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "hf"])
def test_a_whole_stage_reports_every_cost_and_serves_as_before(model, fused, caplog):
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    if fused:
        prepare_stage(stage, batch_cap=4)
    ids = list(range(4, 20))
    before = greedy(stage, None, ids, 8)
    with caplog.at_level(logging.INFO, logger="fellow.runtime.model.load.step_report"):
        report = measure(stage, 0, profiled=True)
    assert_costs(report, profiled=True, config=stage.config)
    assert greedy(stage, None, ids, 8) == before
    for name in ("verify-cost", "batch-cost", "attn-cost", "graph-spike", "step-profile"):
        assert f"[stage0 {name}]" in caplog.text


def test_a_rings_halves_report_their_passes_and_serve_as_before(model):
    first = StageModel.from_causal_lm(copy.deepcopy(model), 0, 2)
    last = StageModel.from_causal_lm(copy.deepcopy(model), 2, None)
    ids = list(range(4, 20))
    before = greedy(first, last, ids, 8)
    for index, stage in enumerate((first, last)):
        assert_costs(measure(stage, index), profiled=False, config=stage.config)
    assert greedy(first, last, ids, 8) == before


def test_the_setting_takes_off_on_and_profile(monkeypatch):
    for raw, mode in (("0", "off"), ("off", "off"), ("1", "on"), ("yes", "on"), ("profile", "profile")):
        monkeypatch.setenv("SWARM_SERVE_STEP_COSTS", raw)
        assert Settings.from_env().serving.step_costs == mode
    monkeypatch.setenv("SWARM_SERVE_STEP_COSTS", "sometimes")
    with pytest.raises(SettingsError, match="off, on, profile"):
        Settings.from_env()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_stage_measures_its_graph_spike_and_kernel_launches(model):
    stage = StageModel.from_causal_lm(copy.deepcopy(model).to("cuda"))
    report = measure(stage, 0, profiled=True)
    spike = report["graph_spike"]
    assert spike["blocks"] == 4 and spike["eager_ms"] > 0 and spike["graph_ms"] > 0
    assert spike["saving_ms"] == pytest.approx((spike["eager_ms"] - spike["graph_ms"]) * 4, abs=1e-2)
    assert report["profile"]["kernel_launches"] > 0
