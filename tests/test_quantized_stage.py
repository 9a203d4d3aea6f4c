"""CPU int8 / int4 weight-only and bitsandbytes NF4 stages (fellow.runtime.model.quant): quantized layer by
layer as they load, close to the float32 stage, batched equal to alone, and a fraction of its weight bytes;
NF4's weights byte for byte those of ``from_pretrained`` with bitsandbytes' NF4.

The model: a random tiny Qwen3 of 8 layers, hidden 256, MLP 512, vocabulary 384, tied embeddings (4.9M
parameters). Its layers hold 96 % of the parameters, so the weight-byte claims are about the quantized
part; what stays in full precision (the float32 embedding table, norms) is counted in the measured bytes.
Random weights give nearly flat logits (top-1 margins of a few hundredths), the hardest case for greedy
agreement; the numbers are printed for the record (pytest -s). On the trained demo model the quantized
stages keep float32's perplexity (bench/bench_perplexity.py, docs/benchmarks.md).
"""

from __future__ import annotations

import pytest
import torch

from core.quantization import INT4_FAST, INT8, NF4, NONE
from core.servable import load_manifest
from events.stage import StageOptions
from fellow.runtime.model.load.kernels import quant_chooser
from fellow.runtime.model.load.loader import build_stage
from fellow.runtime.model.load.weights import build_stage_modules, hf_config
from fellow.runtime.model.quant.linear import NF4_BLOCK, QUANT_KERNELS, QuantLinear, int4_layout
from fellow.runtime.model.quant.lora import LeanLoRA
from fellow.runtime.model.quant.probe import probe
from fellow.runtime.model.quant.quantizer import QuantEmbedding, QuantModule, StageQuantizer, quantize_children
from fellow.runtime.model.quant.report import stage_weights
from tests.serving_fixtures import make_servable

PROMPTS, NEW_TOKENS = 8, 64
SHAPE = dict(layers=8, hidden=256)
# the measured bytes over the float32 stage's, at most (the bar)
RATIO = {INT8: 0.30, INT4_FAST: 0.17, NF4: 0.17}
# the least share of greedy tokens equal to float32's (free-running, 64 tokens x 8 prompts), and of
# teacher-forced top-1 agreement; set below what was measured (see the module docstring)
GREEDY = {INT8: 0.9, INT4_FAST: 0.25, NF4: 0.25}
FORCED = {INT8: 0.97, INT4_FAST: 0.6, NF4: 0.6}
METHODS = [INT8, INT4_FAST, NF4]


@pytest.fixture(scope="module")
def servable(tmp_path_factory):
    _, out = make_servable(tmp_path_factory.mktemp("quant"), "tiny", stages=1, **SHAPE)
    return out


@pytest.fixture(scope="module")
def stages(servable):
    manifest = load_manifest(servable)
    return {m: build_stage(manifest, 0, servable, 1, torch.device("cpu"), StageOptions(quantization=m))[1]
            for m in (NONE, *METHODS)}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 380, (int(n),), generator=g).tolist()
            for n in torch.randint(5, 30, (PROMPTS,), generator=g)]


def greedy(stage, ids: list[int], forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """64 greedy tokens and each step's logits; ``forced``: feed these tokens instead (teacher forcing)."""
    cache = stage.new_cache()
    logits = stage.prefill(cache, torch.tensor(ids))
    out, steps = [], []
    for i in range(NEW_TOKENS):
        steps.append(logits)
        out.append(int(logits.argmax()))
        logits = stage.decode([cache], torch.tensor([forced[i] if forced else out[-1]]))[0]
    return out, torch.stack(steps)


@pytest.fixture(scope="module")
def reference(stages):
    return [greedy(stages[NONE], ids) for ids in prompts()]


@pytest.mark.parametrize("method", METHODS)
def test_quantized_stage_agrees_with_float32(stages, reference, method):
    same = forced_same = 0
    error = 0.0
    for ids, (want, want_logits) in zip(prompts(), reference):
        got, _ = greedy(stages[method], ids)
        same += sum(a == b for a, b in zip(got, want))
        _, logits = greedy(stages[method], ids, forced=want)  # the float32 stage's context at every step
        forced_same += int((logits.argmax(-1) == want_logits.argmax(-1)).sum())
        error = max(error, float((logits - want_logits).abs().max()))
    total = PROMPTS * NEW_TOKENS
    scale = max(float(logits.abs().max()) for _, logits in reference)
    print(f"\n{method}: greedy tokens equal to float32's {same}/{total} = {same / total:.3f}; teacher-forced "
          f"top-1 {forced_same / total:.3f}; max logit error {error:.4f} (largest float32 logit {scale:.3f})")
    assert same / total >= GREEDY[method]
    assert forced_same / total >= FORCED[method]
    assert error < scale  # errors stay below the logits' own size


@pytest.mark.parametrize("method", METHODS)
def test_batched_equals_alone_within_the_quantized_path(stages, method):
    """Decode steps of several sessions at once give each session's own tokens, token for token; a
    fresh batch's left-padded prompts give each prompt's logits to rounding (its attention is padded)."""
    stage = stages[method]
    ids = prompts()[:4]
    alone = [greedy(stage, p)[0][:16] for p in ids]
    caches = [stage.new_cache() for _ in ids]
    firsts = [stage.prefill(cache, torch.tensor(p)) for cache, p in zip(caches, ids)]
    outs = [[int(logits.argmax())] for logits in firsts]
    for _ in range(15):
        logits = stage.decode(caches, torch.tensor([o[-1] for o in outs]))
        for out, token in zip(outs, logits.argmax(-1).tolist()):
            out.append(token)
    assert outs == alone
    fresh = stage.prefill_fresh([stage.new_cache() for _ in ids], ids)
    assert torch.allclose(fresh, torch.stack(firsts), atol=0.02)


@pytest.mark.parametrize("method", METHODS)
def test_measured_weight_bytes_and_the_kernels_in_the_status(stages, method):
    stage, full = stages[method], stages[NONE]
    w = stage.weights
    assert w["quantization"] == method and full.weights["quantization"] == NONE
    assert w["parameters"] == full.weights["parameters"]  # the same weights, counted alike
    assert w["float_bytes"] == 4 * w["parameters"]
    ratio = w["bytes"] / full.weights["bytes"]
    print(f"\n{method}: {w['bytes']} bytes measured against {full.weights['bytes']} in float32: {ratio:.3f}")
    assert ratio <= RATIO[method]
    assert stage.kernels.path == "fused"
    kernels = {entry["kernel"] for entry in stage.kernels.shapes.values()}
    assert kernels == {QUANT_KERNELS[method]}
    assert isinstance(stage.head, QuantModule) and stage.head.linear.kernel == "int8"  # the head: int8
    # a tied model's embedding table: the head's int8 rows, held once, each looked-up row within a step
    assert isinstance(stage.embed, QuantEmbedding) and stage.embed.linear is stage.head.linear
    ids = torch.arange(stage.embed.num_embeddings)
    step = full.embed.weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((stage.embed(ids) - full.embed(ids)).abs() <= step * 0.51).all()
    assert isinstance(stage.fused.layers[0].qkv, QuantLinear)


def test_layers_are_quantized_one_by_one_as_they_load(servable):
    """When a layer is read, every layer before it holds quantized weights only: the stage's float
    copy never exists whole."""
    manifest = load_manifest(servable)
    quantizer = StageQuantizer(INT8, hf_config(manifest), torch.device("cpu"), quant_chooser(INT8, 4))
    float_layers_seen = []

    def on_layer(index, layer, adapters):
        assert adapters == {}
        float_layers_seen.append(sum(type(m) is torch.nn.Linear for m in (*built, layer) for m in m.modules()))
        quantizer.layer(index, layer, adapters)
        built.append(layer)

    built: list = []
    build_stage_modules(manifest, 0, servable, num_stages=1, dtype=torch.float32, on_layer=on_layer)
    assert float_layers_seen == [7] * SHAPE["layers"]  # the new layer's seven linears, none of earlier layers'
    assert all(sum(type(m) is torch.nn.Linear for m in layer.modules()) == 0 for layer in built)


def test_int4_pads_inputs_to_multiples_of_32_and_the_hf_path_quantizes_too():
    assert int4_layout(256) == (64, 8) and int4_layout(96) == (32, 2) and int4_layout(48) is None
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(40, 48, generator=g), torch.randn(3, 48, generator=g)
    linear = QuantLinear(weight, None, INT4_FAST)  # 48 inputs: zero columns to 64
    assert linear.pad == 16 and linear.dequantized().shape == (40, 48)
    # the kernel rounds its result to bfloat16, and dequantized() comes through it too: within about a
    # bfloat16 step (1/128) of the largest output (measured over 200 seeds: at most 0.0044 of it)
    exact = x.to(torch.bfloat16).float() @ linear.dequantized().t()
    assert float((linear(x) - exact).abs().max()) <= float(exact.abs().max()) / 128
    assert torch.allclose(linear.dequantized(), weight, atol=0.5)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 64, bias=False))
    x = torch.randn(3, 64)
    want = layer(x)
    assert quantize_children(layer, INT8) == 2
    assert all(isinstance(layer[i], QuantModule) for i in (0, 2))
    assert torch.allclose(layer(x), want, atol=0.05)


def test_the_probe_declares_the_kernels_that_run_here():
    assert probe() == ["serve-cpu-int8", "serve-cpu-int4", "serve-quantized"]


def test_nf4_weights_are_bit_identical_to_from_pretrained_with_bitsandbytes(servable, stages):
    """Each fused weight of the NF4 stage ([q; k; v], o, [gate; up], down) holds the same packed bytes and
    the same block scales as ``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4"))`` on the same checkpoint, its parts stacked in the same order (every
    part's size is a whole number of NF4_BLOCK blocks, so no block straddles two)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    hf_dir = servable.parent.parent / "hf-tiny"  # tests.serving_fixtures.make_servable's checkpoint
    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    groups = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
              "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
    compared = 0
    for ours, theirs in zip(stages[NF4].fused.layers, model.model.layers):
        for attr, names in groups.items():
            mine: QuantLinear = getattr(ours, attr)
            parts = [theirs.get_submodule(name).weight for name in names]
            assert all(p.quant_state.quant_type == "nf4" and p.quant_state.blocksize == NF4_BLOCK for p in parts)
            assert torch.equal(mine.weight, torch.cat([p.data for p in parts]))
            assert torch.equal(mine.scales.absmax, torch.cat([p.quant_state.absmax for p in parts]))
            compared += 1
    assert compared == 4 * SHAPE["layers"]


def test_lean_lora_computes_what_peft_does_on_a_fused_weight(tmp_path):
    """[q; k; v] with adapters on q and v only: the stacked A's and block-diagonal B give PEFT's outputs."""
    from fellow.runtime.model.fused import Linear
    from tests.test_servable_adapters import tiny_lora

    peft_model = tiny_lora(tmp_path, keep_model=True)
    attn = peft_model.base_model.model.model.layers[1].self_attn
    x = torch.randn(3, 5, attn.q_proj.in_features)
    with torch.no_grad():
        want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    base = [m.base_layer.weight if hasattr(m, "base_layer") else m.weight
            for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    q_rows, k_rows = base[0].shape[0], base[1].shape[0]
    parts = [(0, attn.q_proj.lora_A["default"].weight, attn.q_proj.lora_B["default"].weight),
             (q_rows + k_rows, attn.v_proj.lora_A["default"].weight, attn.v_proj.lora_B["default"].weight)]
    lean = LeanLoRA(Linear(torch.cat(base), None, "mkl"), parts, attn.q_proj.scaling["default"])
    assert torch.allclose(lean(x), want, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_qlora_a_quantized_base_plus_adapters_serves_the_tuned_model(tmp_path, method):
    """Adapters stay apart over a quantized stage (no second rounding): its logits are the tuned model's
    within quantization error, far closer than the base model's."""
    from fellow.runtime.tools.export import export
    from tests.test_servable_adapters import IDS, tiny_lora

    hf, lora, tuned = tiny_lora(tmp_path)
    manifest = export(hf, tmp_path / "sv", stages=1, adapters=lora)
    stage = build_stage(manifest, 0, tmp_path / "sv", 1, torch.device("cpu"), StageOptions(quantization=method))[1]
    kinds = {entry["kernel"] for entry in stage.kernels.shapes.values()}
    assert kinds == {QUANT_KERNELS[method]}  # the kernels time the base weights
    adapted = [name for name in ("qkv", "down") if isinstance(getattr(stage.fused.layers[0], name), LeanLoRA)]
    assert adapted == ["qkv", "down"] and not isinstance(stage.fused.layers[0].o, LeanLoRA)
    got = stage.prefill(stage.new_cache(), IDS[0])
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(hf)).eval()(input_ids=IDS).logits[0, -1]
    error, effect = float((got - tuned[0, -1]).abs().max()), float((base - tuned[0, -1]).abs().max())
    print(f"\n{method} + LoRA: max logit error against the tuned model {error:.4f}; "
          f"the adapters move logits {effect:.4f}")
    assert error < effect / 4


def test_serve_lora_modes_lean16_and_peft_serve_what_lean_does(tmp_path):
    """SWARM_SERVE_LORA over an int8 base: ``peft`` runs the layers' HF forward with PEFT's own LoRA layers
    and computes what lean does to rounding, greedy tokens and all; ``lean16`` holds A and B in bfloat16
    (half the adapters' bytes) and stays within bfloat16 rounding of lean, far inside the adapters' effect.
    The status says which mode serves how many modules."""
    from peft.tuners.lora.layer import Linear as PeftLinear

    from fellow.runtime.tools.export import export
    from tests.test_servable_adapters import IDS, tiny_lora

    hf, lora, tuned = tiny_lora(tmp_path)
    manifest = export(hf, tmp_path / "sv", stages=1, adapters=lora)
    built = {mode: build_stage(manifest, 0, tmp_path / "sv", 1, torch.device("cpu"),
                               StageOptions(quantization=INT8, lora=mode))[1]
             for mode in ("lean", "lean16", "peft")}
    modules = 3 * 4  # q_proj, v_proj and down_proj in each of 4 layers
    for mode, stage in built.items():
        assert stage.kernels.lora == {"mode": mode, "modules": modules}
    assert built["lean"].kernels.path == built["lean16"].kernels.path == "fused"
    assert built["peft"].kernels.path == "hf" and "PEFT" in built["peft"].kernels.why
    peft_layers = [m for layer in built["peft"].layers for m in layer.modules() if isinstance(m, PeftLinear)]
    assert len(peft_layers) == modules and all(isinstance(m.base_layer, QuantModule) for m in peft_layers)
    lean16 = built["lean16"].fused.layers[0].qkv
    assert isinstance(lean16, LeanLoRA) and lean16.a.dtype == lean16.b.dtype == torch.bfloat16

    logits = {mode: stage.prefill(stage.new_cache(), IDS[0]) for mode, stage in built.items()}
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(hf)).eval()(input_ids=IDS).logits[0, -1]
    effect = float((base - tuned[0, -1]).abs().max())  # how far the adapters move the logits
    peft_error = float((logits["peft"] - logits["lean"]).abs().max())
    lean16_error = float((logits["lean16"] - logits["lean"]).abs().max())
    print(f"\nmax logit difference from lean: peft {peft_error:.2e}, lean16 {lean16_error:.2e}; "
          f"the adapters move logits {effect:.3f}")
    assert peft_error < 1e-4
    assert 0 < lean16_error < effect / 20
    ids = IDS[0].tolist()
    assert greedy(built["peft"], ids)[0] == greedy(built["lean"], ids)[0]
    _, params = stage_weights(built["lean"])
    assert stage_weights(built["peft"])[1] == params  # PEFT's adapter layers are not base parameters

    # the spec's [stageN lora-cost]: a step as served and with the adapters off, then back as they were
    from fellow.runtime.model.load.kernels import lora_costs
    from fellow.runtime.model.quant.lora_modes import adapters_as, adapters_off

    for mode, stage in built.items():
        costs = lora_costs(stage)  # every way side by side, whichever the stage serves
        assert list(costs) == ["peft_ms", "lean_ms", "lean16_ms", "off_ms"] and all(ms > 0 for ms in costs.values())
        assert torch.equal(stage.prefill(stage.new_cache(), IDS[0]), logits[mode])  # back as served
        for other in ("lean", "lean16", "peft"):  # each way computes what a stage served so does
            with adapters_as(stage, other):
                got = stage.prefill(stage.new_cache(), IDS[0])
            assert float((got - logits[other]).abs().max()) < (lean16_error * 4 if "lean16" in (mode, other) else 1e-4)
        with adapters_off(stage):
            off = stage.prefill(stage.new_cache(), IDS[0])
        assert float((off - logits[mode]).abs().max()) > effect / 4  # off means off
        assert torch.equal(stage.prefill(stage.new_cache(), IDS[0]), logits[mode])  # and back on


@pytest.mark.parametrize("mode", ["lean", "peft"])
def test_dora_adapters_stay_apart_over_a_quantized_base_with_their_row_factor(tmp_path, mode):
    """DoRA over an int8 base: A and B stay apart as for LoRA, and each adapted output row is scaled by
    PEFT's factor (m / ||W + s·B A||, from the full-precision weight): the logits are the tuned model's
    within quantization error, and dropping the factor moves them well past it. SWARM_SERVE_LORA=peft
    serves DoRA modules lean too (PEFT's DoRA layer reads no quantized weight)."""
    from fellow.runtime.tools.export import export
    from tests.test_servable_adapters import IDS, tiny_lora

    hf, lora, tuned = tiny_lora(tmp_path, dora=True)
    manifest = export(hf, tmp_path / "sv", stages=1, adapters=lora)
    options = StageOptions(quantization=INT8, lora=mode)
    stage = build_stage(manifest, 0, tmp_path / "sv", 1, torch.device("cpu"), options)[1]
    leans = [m for layer in stage.layers for m in layer.modules() if isinstance(getattr(m, "linear", None), LeanLoRA)]
    leans = [m.linear for m in leans] + [getattr(f, a) for f in (stage.fused.layers if stage.fused else [])
                                         for a in ("qkv", "down") if isinstance(getattr(f, a), LeanLoRA)]
    assert leans and all(lean.rows_scale is not None for lean in leans)
    served = stage.prefill(stage.new_cache(), IDS[0])
    error = float((served - tuned[0, -1]).abs().max())
    from fellow.runtime.model.load.kernels import lora_costs

    assert all(ms > 0 for ms in lora_costs(stage).values())  # every way, DoRA's row factor kept lean
    assert torch.equal(stage.prefill(stage.new_cache(), IDS[0]), served)
    for lean in leans:
        lean.rows_scale, lean.rows_shift = None, None
    without = float((stage.prefill(stage.new_cache(), IDS[0]) - tuned[0, -1]).abs().max())
    print(f"\nDoRA over int8 ({mode}): max logit error {error:.4f}; without the row factor {without:.4f}")
    assert error < without / 4
