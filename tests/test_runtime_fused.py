"""Fused layers (fellow.runtime.model.fused) give HF generate's greedy replies under each kernel, on
two shapes of every family served; batched and fresh-batched steps equal each session alone."""

import copy
import time

import pytest
import torch
import transformers

from fellow.runtime.model.fused import KERNELS, Linear, fusable
from fellow.runtime.model.load.kernels import KernelChooser, available_kernels, prepare_stage, step_costs
from fellow.runtime.model.load.packed_linear import pack_stage
from fellow.runtime.model.stage import StageModel
from tests.tiny import FAMILIES, make_tiny_checkpoint

KERNELS_HERE = available_kernels(torch.device("cpu"), torch.float32)
# (layers, hidden, key/value heads' share): a narrow deep one, and a wider one with grouped attention 4:1
SHAPES = {"deep": dict(layers=5, hidden=64), "wide": dict(layers=2, hidden=128)}
PATHS = ["hf", "hf+onednn"] + [f"fused-{k}" for k in KERNELS]


def staged(model, path: str) -> StageModel:
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    if path == "hf+onednn":
        pack_stage(stage)
    elif path.startswith("fused-"):
        kernel = path.removeprefix("fused-")
        stage.fuse(lambda weight, bias: Linear(weight, bias, kernel))
    return stage


def greedy(stage: StageModel, ids: list[int], new_tokens: int) -> list[int]:
    cache = stage.new_cache()
    logits = stage.prefill(cache, torch.tensor(ids), prefill_chunk=7)  # pieces: a masked past too
    out = []
    for _ in range(new_tokens):
        out.append(int(logits.argmax()))
        logits = stage.decode([cache], torch.tensor([out[-1]]))[0]
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        for name, shape in SHAPES.items():
            ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp(f"{family}-{name}"), family, **shape)
            model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None
            out[family, name] = model
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_path_gives_generates_greedy_reply(models, family, shape):
    model = models[family, shape]
    assert fusable(model.model.layers, model.config, torch.device("cpu")) is None
    ids = torch.randint(0, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        inputs = torch.tensor([ids])
        want = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=32,
                              min_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    for path in PATHS:
        if path.removeprefix("fused-").removeprefix("hf+") in ("onednn",) and "onednn" not in KERNELS_HERE:
            continue  # this torch has no oneDNN linear (never the case on the CI image)
        assert greedy(staged(model, path), ids, 32) == want, path


def test_batched_and_fresh_batched_steps_equal_each_session_alone(models):
    model = models["qwen3", "wide"]
    stage = staged(model, f"fused-{KERNELS_HERE[-1]}")
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 2)]
    alone = [greedy(stage, ids, 12) for ids in prompts]
    caches = [stage.new_cache() for _ in prompts]
    logits = stage.prefill_fresh(caches, prompts)  # left-padded into one forward
    outs = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(11):
        logits = stage.decode(caches, torch.tensor([o[-1] for o in outs]))
        for out, token in zip(outs, logits.argmax(-1).tolist()):
            out.append(token)
    assert outs == alone


def test_a_ring_stage_runs_fused_on_hidden_states(models):
    model = models["llama", "deep"]
    whole = staged(model, "fused-mkl")
    first = StageModel.from_causal_lm(copy.deepcopy(model), 0, 2)
    last = StageModel.from_causal_lm(copy.deepcopy(model), 2)
    for part in (first, last):
        part.fuse(lambda weight, bias: Linear(weight, bias, "mkl"))
    ids = list(range(7, 20))
    c_first, c_last = first.new_cache(), last.new_cache()
    logits = last.prefill(c_last, first.prefill(c_first, torch.tensor(ids)))
    token, out = int(logits.argmax()), []
    for _ in range(10):
        out.append(token)
        logits = last.decode([c_last], first.decode([c_first], torch.tensor([token])))
        token = int(logits[0].argmax())
    assert out == greedy(whole, ids, 10)


def test_the_chooser_keeps_the_fastest_kernel_per_shape_and_step_costs_roll_back(models):
    model = models["qwen3", "deep"]
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    kernels = prepare_stage(stage, batch_cap=4)
    assert kernels.path == "fused" and kernels.rows == [1, 4] and kernels.seconds > 0
    for entry in kernels.shapes.values():
        totals = {name: sum(ms) for name, ms in entry["ms"].items()}
        assert entry["kernel"] == min(totals, key=totals.get)
    ids = list(range(4, 15))
    before = greedy(stage, ids, 8)
    costs = step_costs(stage, [1, 4])
    assert set(costs) == {"1", "4"} and all(ms > 0 for ms in costs.values())
    assert greedy(stage, ids, 8) == before


def test_the_chooser_times_seven_calls_or_three_once_they_took_their_budget(monkeypatch):
    """Each kernel and row count gets SAMPLES timed calls after a first, untimed one, or MIN_SAMPLES once
    those took SAMPLE_BUDGET_S (a big weight's calls); a weight as big as the flush has no untimed call.
    Counted on the real Linear each call goes through."""
    from fellow.runtime.model.load import kernels as chooser_module

    calls: list[int] = []

    class Counted(Linear):
        __slots__ = ()

        def __call__(self, x):
            calls.append(x.shape[0])
            return super().__call__(x)

    def counted(budget: float) -> dict[int, int]:
        calls.clear()
        monkeypatch.setattr(chooser_module, "SAMPLE_BUDGET_S", budget)
        chooser = KernelChooser(["mkl"], batch_cap=4, make=lambda weight, bias, kernel: Counted(weight, bias, kernel))
        assert chooser.linear(torch.randn(64, 32), None).kernel == "mkl"
        return {rows: calls.count(rows) for rows in (1, 4)}

    assert counted(60.0) == {1: 1 + chooser_module.SAMPLES, 4: 1 + chooser_module.SAMPLES}
    assert counted(0.0) == {1: 1 + chooser_module.MIN_SAMPLES, 4: 1 + chooser_module.MIN_SAMPLES}
    # a weight as big as the flush evicts itself: its first call is a timed sample, no untimed call first
    monkeypatch.setattr(chooser_module, "FLUSH_BYTES", 64 * 32 * 4)
    assert counted(0.0) == {1: chooser_module.MIN_SAMPLES, 4: chooser_module.MIN_SAMPLES}


def test_a_kernel_that_clearly_loses_is_timed_no_further():
    """The first kernel is timed in full; a second whose calls add up past CLEAR_LOSER times the
    first's sum stops there (one call after its warm one, no row count after it), and is not chosen.
    Counted on the real Linear each call goes through; the slow kernel is slow for real (it sleeps)."""
    from fellow.runtime.model.load import kernels as chooser_module

    calls: dict[str, list[int]] = {"mkl": [], "slow": []}

    class Counted(Linear):
        __slots__ = ("label",)

        def __init__(self, weight, bias, label):
            super().__init__(weight, bias, "mkl")
            self.label = label

        def __call__(self, x):
            calls[self.label].append(x.shape[0])
            if self.label == "slow":  # slower than a 64 x 32 matmul by far, even on a loaded machine (a CI run
                time.sleep(0.05)  # of a 10 ms sleep saw MKL's best calls add up past 10 / CLEAR_LOSER ms)
            return super().__call__(x)

    chooser = KernelChooser(["mkl", "slow"], batch_cap=4, make=lambda weight, bias, label: Counted(weight, bias, label))
    chosen = chooser.linear(torch.randn(64, 32), None)
    assert chosen.label == "mkl"
    assert all(calls["mkl"].count(rows) >= 1 + chooser_module.MIN_SAMPLES for rows in (1, 4))
    assert calls["slow"] == [1, 1]  # its warm call and one timed call at one row, then nothing
    timings = chooser.summary()["shapes"]["64x32"]["ms"]
    assert len(timings["mkl"]) == 2 and len(timings["slow"]) == 1 and timings["slow"][0] > sum(timings["mkl"])


def test_step_costs_repeat_a_step_until_their_budget(models, monkeypatch):
    """The largest batch first: its sessions put in the decode slab (a fused stage) or an untimed step
    (the HF layers), then up to ``repeats`` timed steps, fewer (at least one) once they took
    STEP_COST_BUDGET_S (a 1B model's CPU step is over 0.2 s); the smaller batches after it without
    either, everything warm by then."""
    from fellow.runtime.model.load import kernels as chooser_module

    fused = StageModel.from_causal_lm(copy.deepcopy(models["qwen3", "deep"]))
    prepare_stage(fused, batch_cap=2)
    hf = StageModel.from_causal_lm(copy.deepcopy(models["qwen3", "deep"]))  # the HF layers, unfused
    for stage, untimed in ((fused, 0), (hf, 1)):
        steps: list[tuple[int, int]] = []
        decode = stage.__class__.decode
        slab = stage.fused.slab if stage.fused is not None else None
        monkeypatch.setattr(stage, "decode", lambda caches, inputs, stage=stage, slab=slab: steps.append(
            (len(caches), slab.rebuilds if slab else 0)) or decode(stage, caches, inputs))
        for budget, timed in ((60.0, 3), (0.0, 1)):
            steps.clear()
            rebuilds = slab.rebuilds if slab else 0
            monkeypatch.setattr(chooser_module, "STEP_COST_BUDGET_S", budget)
            costs = step_costs(stage, [1, 2], repeats=3)
            assert [rows for rows, _ in steps] == [2] * (untimed + timed) + [1] * timed
            assert list(costs) == ["1", "2"] and all(ms > 0 for ms in costs.values())
            if slab is not None:  # the slab was built before the first timed step, and not again
                assert [seen for rows, seen in steps if rows == 2] == [rebuilds + 1] * timed


def test_what_cannot_fuse_keeps_the_hf_layers_and_says_why():
    config = transformers.Qwen3Config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, vocab_size=64, hidden_act="gelu")
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    stage = StageModel.from_causal_lm(model)
    kernels = prepare_stage(stage)
    assert stage.fused is None and "not SiLU" in kernels.why and kernels.path.startswith("hf")
    assert "cuda" in fusable(model.model.layers, config, torch.device("cuda"))
    chooser = KernelChooser(["mkl"], batch_cap=1)
    assert chooser.linear(torch.randn(8, 4), None).kernel == "mkl" and chooser.summary()["rows"] == [1]
