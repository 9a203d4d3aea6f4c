"""A CUDA stage's weight-only kernels (fellow.runtime.model.quant): bitsandbytes' int8 (LLM.int8 without
outliers, as ``from_pretrained(load_in_8bit=True)`` serves it) and NF4, torch's int4 kernel for CUDA
(tinygemm), and int4-fast's reload as NF4 where that kernel cannot run.

bitsandbytes' int8 runs on a CPU too, so the CPU tests drive a CUDA stage's int8 kernel there: the kernel
table is pointed at it (``CUDA_KERNELS``), and the stage is built, quantized and served as on a card. The
int4 kernel for CUDA cannot run on a CPU, which is what the fallback test uses: the real check refuses
it and the loader really reloads as NF4. The ``gpu`` tests run the same on a card.
"""

from __future__ import annotations

import pytest
import torch

from core.quantization import INT4_FAST, INT8, NF4, NONE
from core.servable import load_manifest
from events.stage import StageOptions
from fellow.runtime.model.load.loader import build_stage
from fellow.runtime.model.quant import linear
from fellow.runtime.model.quant.linear import (
    CUDA_KERNELS,
    QUANT_KERNELS,
    TINYGEMM_FLOOR,
    Int4Unavailable,
    QuantLinear,
    quant_kernel,
)
from fellow.runtime.model.quant.probe import _kernel_runs, probe
from fellow.runtime.model.quant.quantizer import FUSED_GROUPS, QuantEmbedding, QuantModule
from tests.serving_fixtures import make_servable

SHAPE = dict(layers=4, hidden=128)


def GPU(test):
    """A ``gpu`` test, skipped without a CUDA card."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")(test))
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def servable(tmp_path_factory):
    _, out = make_servable(tmp_path_factory.mktemp("cudaquant"), "tiny", stages=1, **SHAPE)
    return out


def prompts(n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 380, (int(k),), generator=g).tolist() for k in torch.randint(4, 20, (n,), generator=g)]


def greedy(stage, ids: list[int], steps: int = NEW_TOKENS) -> list[int]:
    cache = stage.new_cache()
    logits = stage.prefill(cache, torch.tensor(ids, device=stage.input_device))
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = stage.decode([cache], torch.tensor([out[-1]], device=stage.input_device))[0]
    return out


def batched(stage, prompt_ids: list[list[int]], steps: int = NEW_TOKENS) -> list[list[int]]:
    """Every prompt decoded in one batch a step (the sessions' decode steps batched together)."""
    caches = [stage.new_cache() for _ in prompt_ids]
    last = [int(stage.prefill(c, torch.tensor(ids, device=stage.input_device)).argmax())
            for c, ids in zip(caches, prompt_ids)]
    outs = [[t] for t in last]
    for _ in range(steps - 1):
        logits = stage.decode(caches, torch.tensor([o[-1] for o in outs], device=stage.input_device))
        for o, row in zip(outs, logits):
            o.append(int(row.argmax()))
    return outs


@pytest.fixture(scope="module")
def bnb_int8_stage(servable):
    """An int8 stage built with the CUDA stage's kernel (bitsandbytes'), on the CPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(QUANT_KERNELS, INT8, CUDA_KERNELS[INT8])
        return build_stage(load_manifest(servable), 0, servable, 1, torch.device("cpu"),
                           StageOptions(quantization=INT8))[1]


@pytest.fixture(scope="module")
def float_stage(servable):
    return build_stage(load_manifest(servable), 0, servable, 1, torch.device("cpu"))[1]


def test_bnb_int8_weights_are_bit_identical_to_from_pretrained_load_in_8bit(servable, bnb_int8_stage):
    """Each fused weight holds the int8 rows and row scales of ``from_pretrained(quantization_config=
    BitsAndBytesConfig(load_in_8bit=True))`` on the same checkpoint, its modules' rows stacked in order."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(str(servable.parent.parent / "hf-tiny"), device_map="cpu",
                                                 quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    compared = 0
    for ours, theirs in zip(bnb_int8_stage.fused.layers, model.model.layers):
        for attr, names in FUSED_GROUPS.items():
            mine: QuantLinear = getattr(ours, attr)
            assert mine.kernel == "bnb-int8"
            parts = [theirs.get_submodule(name).weight for name in names]
            assert torch.equal(mine.weight, torch.cat([p.data for p in parts]))
            assert torch.equal(mine.scales, torch.cat([p.SCB for p in parts]))
            compared += 1
    assert compared == 4 * SHAPE["layers"]


def test_a_bnb_int8_stage_serves_close_to_float32_and_batched_equal_to_alone(bnb_int8_stage, float_stage):
    stage = bnb_int8_stage
    assert {e["kernel"] for e in stage.kernels.shapes.values()} == {"bnb-int8"}
    assert stage.head.linear.kernel == "bnb-int8"
    # the tied table: the head's bitsandbytes int8 rows, each looked-up row within half a step of float32
    assert isinstance(stage.embed, QuantEmbedding) and stage.embed.linear is stage.head.linear
    ids = torch.arange(stage.embed.num_embeddings)
    step = float_stage.embed.weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((stage.embed(ids) - float_stage.embed(ids)).abs() <= step * 0.51 + 1e-3).all()
    same = total = 0
    alone = []
    for ids in prompts():
        got, want = greedy(stage, ids), greedy(float_stage, ids)
        same += sum(a == b for a, b in zip(got, want))
        total += len(want)
        alone.append(got)
    print(f"\nbnb-int8: {same}/{total} greedy tokens equal float32's")
    assert same / total >= 0.8
    assert batched(stage, prompts()) == alone  # each input row is quantized by its own absmax
    w = stage.weights
    assert w["quantization"] == INT8 and w["bytes"] / float_stage.weights["bytes"] <= 0.30
    assert "reason" not in w


def test_int4_fast_where_its_kernel_cannot_run_reloads_as_nf4_and_says_so(servable, caplog):
    """The stage asks for the CUDA int4 kernel on a machine without CUDA: its real check refuses, and the
    load reloads as bitsandbytes NF4 rather than failing; the weights in the status say what it serves,
    what was asked and why. It then serves what an NF4 load serves, token for token."""
    manifest = load_manifest(servable)
    with pytest.MonkeyPatch.context() as patch, caplog.at_level("WARNING"):
        patch.setitem(QUANT_KERNELS, INT4_FAST, CUDA_KERNELS[INT4_FAST])
        stage = build_stage(manifest, 0, servable, 1, torch.device("cpu"), StageOptions(quantization=INT4_FAST))[1]
    nf4 = build_stage(manifest, 0, servable, 1, torch.device("cpu"), StageOptions(quantization=NF4))[1]
    w = stage.weights
    assert w["quantization"] == NF4 and w["requested"] == INT4_FAST
    assert "needs a CUDA card" in w["reason"] and w["reason"].endswith("reloaded as nf4")
    assert any("reloaded as nf4" in r.getMessage() for r in caplog.records)
    assert {e["kernel"] for e in stage.kernels.shapes.values()} == {"bnb-nf4"}
    assert w["bytes"] == nf4.weights["bytes"]
    for ids in prompts(2):
        assert greedy(stage, ids, 8) == greedy(nf4, ids, 8)


def test_the_cli_says_why_a_stage_serves_another_quantization():
    from core.cli_models import _weights

    said = _weights({"weights": {"quantization": "nf4", "bytes": 3_000_000, "estimate_bytes": 2_900_000,
                                 "requested": "int4-fast", "reason": "int4-fast cannot run here (x); reloaded as nf4"}})
    assert said.startswith(", nf4 weights") and said.endswith("; int4-fast cannot run here (x); reloaded as nf4")


def test_each_kernel_refuses_a_device_it_does_not_run_on():
    weight = torch.randn(32, 64)
    with pytest.raises(Int4Unavailable, match="needs a CUDA card"):
        QuantLinear(weight, None, INT4_FAST, kernel="int4-tinygemm")
    with pytest.raises(ValueError, match="no 'int4' kernel for 'int8'"):
        QuantLinear(weight, None, INT8, kernel="int4")
    assert quant_kernel(INT8, torch.device("cpu")) == "int8"
    assert quant_kernel(INT8, torch.device("cuda", 0)) == "bnb-int8"  # a name: nothing runs
    assert quant_kernel(INT4_FAST, torch.device("cuda", 0)) == "int4-tinygemm"
    assert quant_kernel(NF4, torch.device("cuda", 0)) == "bnb-nf4"


def test_the_bnb_int8_kernel_checks_on_the_cpu_as_the_probe_checks_a_card(monkeypatch):
    """The probe's check, run on the CPU over bitsandbytes' int8 (what a CUDA fellow checks per card)."""
    monkeypatch.setitem(QUANT_KERNELS, INT8, "bnb-int8")
    assert _kernel_runs(INT8, torch.device("cpu"))
    linear = QuantLinear(torch.randn(48, 64) * 0.05, torch.randn(48), INT8)
    x = torch.randn(5, 64)
    want = torch.nn.functional.linear(x.half().float(), linear.dequantized(), linear.bias.float())
    assert torch.allclose(linear(x), want, atol=0.02)


# --- on a card ------------------------------------------------------------------------------------

@GPU
@pytest.mark.parametrize("method", [NF4, INT8, INT4_FAST])
def test_on_a_card_each_method_loads_with_its_cuda_kernel_and_serves(servable, method):
    manifest = load_manifest(servable)
    card = torch.device("cuda", 0)
    full = build_stage(manifest, 0, servable, 1, card)[1]
    stage = build_stage(manifest, 0, servable, 1, card, StageOptions(quantization=method))[1]
    kernel = CUDA_KERNELS[method]
    linears = [m.linear for m in stage.layers[0].modules() if isinstance(m, QuantModule)]
    assert linears and {linear.kernel for linear in linears} == {kernel}
    assert stage.weights["quantization"] == method and "reason" not in stage.weights
    assert stage.weights["bytes"] / full.weights["bytes"] <= (0.6 if method == INT8 else 0.35)  # of 16-bit
    same = total = 0
    for ids in prompts():
        got, want = greedy(stage, ids), greedy(full, ids)
        same += sum(a == b for a, b in zip(got, want))
        total += len(want)
    print(f"\n{method} on {torch.cuda.get_device_name(0)}: {same}/{total} greedy tokens equal 16-bit's")
    assert same / total >= (0.8 if method == INT8 else 0.25)
    assert len(batched(stage, prompts())) == len(prompts())


@GPU
def test_on_a_card_nf4_weights_are_bit_identical_to_from_pretrained(servable):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    card = torch.device("cuda", 0)
    stage = build_stage(load_manifest(servable), 0, servable, 1, card, StageOptions(quantization=NF4))[1]
    model = AutoModelForCausalLM.from_pretrained(
        str(servable.parent.parent / "hf-tiny"), device_map={"": 0}, dtype=stage.dtype,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    for ours, theirs in zip(stage.layers, model.model.layers):
        for name in ("self_attn.q_proj", "mlp.down_proj"):
            mine, their = ours.get_submodule(name).linear, theirs.get_submodule(name).weight
            assert torch.equal(mine.weight, their.data)
            assert torch.equal(mine.scales.absmax, their.quant_state.absmax)


@GPU
def test_on_a_card_int4_fast_below_its_floor_reloads_as_nf4(servable, monkeypatch):
    monkeypatch.setattr(linear, "TINYGEMM_FLOOR", (99, 0))
    stage = build_stage(load_manifest(servable), 0, servable, 1, torch.device("cuda", 0),
                        StageOptions(quantization=INT4_FAST))[1]
    assert stage.weights["quantization"] == NF4 and stage.weights["requested"] == INT4_FAST
    assert "sm_990" in stage.weights["reason"] and greedy(stage, prompts(1)[0], 4)


@GPU
def test_on_a_card_the_probe_declares_bitsandbytes_and_the_int4_kernel():
    caps = probe()
    assert "serve-quantized" in caps
    assert ("serve-int4-fast" in caps) == all(torch.cuda.get_device_capability(i) >= TINYGEMM_FLOOR
                                              for i in range(torch.cuda.device_count()))


def test_a_full_precision_load_keeps_its_float_weights(float_stage):
    assert float_stage.weights["quantization"] == NONE and "requested" not in float_stage.weights


@GPU
@pytest.mark.parametrize("method", [NF4, INT8])
def test_on_a_card_a_quantized_base_plus_adapters_serves_the_tuned_model(tmp_path, method):
    """QLoRA on a card: the adapters stay apart, beside the base weights on the card."""
    from transformers import AutoModelForCausalLM

    from fellow.runtime.tools.export import export
    from tests.test_servable_adapters import IDS, tiny_lora

    hf, lora, tuned = tiny_lora(tmp_path)
    manifest = export(hf, tmp_path / "sv", stages=1, adapters=lora)
    stage = build_stage(manifest, 0, tmp_path / "sv", 1, torch.device("cuda", 0), StageOptions(quantization=method))[1]
    got = stage.prefill(stage.new_cache(), IDS[0].to(stage.input_device)).float().cpu()
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(hf)).eval()(input_ids=IDS).logits[0, -1]
    error, effect = float((got - tuned[0, -1]).abs().max()), float((base - tuned[0, -1]).abs().max())
    print(f"\n{method} + LoRA on a card: max logit error {error:.4f}; the adapters move logits {effect:.4f}")
    assert error < effect / 2
