"""One session's decode step as one C call (fellow.runtime.model.forms.native_step, the background compile's
``native`` form): on a tied Qwen3 with per-head norms and grouped attention, and on a Qwen2 with biases
whose upper layers slide, it gives HF generate's greedy reply token for token; an int8 stage replies as
its fused step does, an int4 one within the quantized tolerance; quantized inputs past a multiple of 32 are
read as zeros; its AVX-512 and AVX2 builds each pass the check; a stage it cannot take says why; the
background compile builds it by default.

Real tiny models, the kernel compiled with the host's C compiler (skipped where there is none, or no AVX2)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from events.stage import StageOptions
from fellow.runtime.kernels import native, step_kernel
from fellow.runtime.model.forms.background_compile import BackgroundCompile
from fellow.runtime.model.forms.checked_step import QUANTIZED_LOGIT_TOLERANCE
from fellow.runtime.model.forms.graph_linear import REDUCE
from fellow.runtime.model.forms.native_step import NATIVE, NativeStep, int4_rows, why_not
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.load.loader import load_one_stage
from fellow.runtime.model.stage import StageModel
from tests.serving_fixtures import make_servable
from tests.test_compiled_decode import greedy
from tests.tiny import make_tiny_checkpoint

# skipped only where nothing could build it (no C compiler, no AVX2 and FMA): where one could and the build
# fails, the tests fail (tests/test_kernel_sources.py says the compiler's reason)
pytestmark = [pytest.mark.skipif(not native.cpu_has_avx2_fma() or shutil.which(native.compiler()) is None,
                                 reason="no C compiler, or this CPU lacks AVX2 or FMA"),
              pytest.mark.usefixtures("two_threads")]  # its splits over threads are what is checked

SHAPES = {"qwen3-wide": dict(family="qwen3", layers=2, hidden=128),
          "qwen2-window": dict(family="qwen2", layers=4, hidden=64, window=16),
          # one key-value head: one session has fewer (session, key-value head) pairs than two threads, so the
          # kernel rotates every head, then attends by query head
          "qwen3-one-kv": dict(family="qwen3", layers=2, hidden=32)}
PROMPT, NEW = 23, 32  # the window's 16 positions are passed well before the reply ends


def trained_norms(model) -> None:
    """Every norm's weights away from a random model's ones, each its own (a trained model's are; Qwen3's
    query and key norms differ): a step that read one norm's weights for another's gives another reply."""
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("norm") and getattr(module, "weight", None) is not None:
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=generator))


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("name", SHAPES)
def test_the_native_step_gives_generates_greedy_reply(tmp_path, name, parallel, monkeypatch):
    if parallel:  # the products and heads split over threads, as a model past PARALLEL_BYTES does
        monkeypatch.setattr(step_kernel, "PARALLEL_BYTES", 0)
    ckpt = make_tiny_checkpoint(tmp_path, **SHAPES[name])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    trained_norms(model)
    model.generation_config.eos_token_id = None
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    prepare_stage(stage, batch_cap=2, keep_plain=True)
    assert why_not(stage) is None
    step = NativeStep(stage, stage.plain_weights)
    assert step.model.parallel == int(parallel)
    entry = step.build(1, only_faster=False, compiled=True)
    assert entry["serving"] and entry["max_logit_diff"] < 1e-4 and entry["compiled_ms"] > 0, entry
    stage.steps.put("compiled", step)
    ids = torch.randint(0, model.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        inputs = torch.tensor([ids])
        want = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=NEW,
                              min_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
    steps = step.steps
    assert greedy(stage, ids, NEW) == want
    assert step.steps == steps + NEW  # every decode step ran through the kernel
    # two sessions in turn: each step finds its own cache's buffers (they grew meanwhile, too)
    first, second = stage.new_cache(), stage.new_cache()
    a = int(stage.prefill(first, torch.tensor(ids)).argmax())
    b = int(stage.prefill(second, torch.tensor(ids[:9])).argmax())
    outs = ([a], [b])
    for _ in range(70):  # past the caches' first 64 positions of room
        for cache, out in zip((first, second), outs):
            out.append(int(stage.decode([cache], torch.tensor([out[-1]]))[0].argmax()))
    stage.steps.put("compiled", None)
    assert outs[0] == greedy(stage, ids, 71) and outs[1] == greedy(stage, ids[:9], 71)


@pytest.mark.parametrize("parallel", [False, True])
def test_a_native_batch_equals_each_session_alone(tmp_path, parallel, monkeypatch):
    """Three sessions of different lengths (one past the window before long) stepped together through one
    call, then two, each equal to its reply alone; the kernel served every step."""
    if parallel:
        monkeypatch.setattr(step_kernel, "PARALLEL_BYTES", 0)
    ckpt = make_tiny_checkpoint(tmp_path, **SHAPES["qwen2-window"])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    stage = StageModel.from_causal_lm(model)
    prepare_stage(stage, batch_cap=4, keep_plain=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 19, 11)]
    alone = [greedy(stage, ids, 14) for ids in prompts]
    step = NativeStep(stage, stage.plain_weights)
    for rows in (1, 2, 3):
        assert step.build(rows, only_faster=False, compiled=True)["serving"]
    stage.steps.put("compiled", step)
    caches = [stage.new_cache() for _ in prompts]
    outs = [[int(stage.prefill(cache, torch.tensor(ids)).argmax())] for cache, ids in zip(caches, prompts)]
    steps = step.steps
    with torch.inference_mode():
        for i in range(13):
            live = [j for j in range(3) if i < 8 or j != 1]  # the second leaves after eight steps
            logits = stage.decode([caches[j] for j in live], torch.tensor([outs[j][-1] for j in live]))
            for j, row in zip(live, logits):
                outs[j].append(int(row.argmax()))
    assert step.steps == steps + 13
    assert outs[0] == alone[0][:14] and outs[2] == alone[2][:14] and outs[1] == alone[1][:9]


def test_an_int8_stage_replies_as_its_fused_step(tmp_path):
    _, servable = make_servable(tmp_path, "tiny", layers=2, hidden=64, stages=1)
    stage = load_one_stage(servable, "cpu", StageOptions(quantization="int8", compile=None)).stage
    ids = list(range(5, 30))
    expected = greedy(stage, ids, 24)
    assert why_not(stage) is None
    step = NativeStep(stage, stage.plain_weights)
    entry = step.build(1, only_faster=False, compiled=True)
    assert entry["serving"], entry
    stage.steps.put("compiled", step)
    assert greedy(stage, ids, 24) == expected and step.steps >= 23


def test_an_int4_stage_computes_its_fused_steps_logits_within_the_quantized_tolerance(tmp_path):
    """int4 rows read from torch's packing (``int4_rows``) and multiplied with int16 inputs, where the fused
    step reads bfloat16 ones: the same token path, teacher-forced, gives logits within the tolerance the
    background compile checks."""
    _, servable = make_servable(tmp_path, "tiny", layers=2, hidden=64, stages=1)
    stage = load_one_stage(servable, "cpu", StageOptions(quantization="int4-fast", compile=None)).stage
    lin = stage.fused.layers[0].gate_up
    rows, scales = int4_rows(lin)
    n, k = lin.out_features, lin.in_features
    q = torch.cat([rows.reshape(n, k // 32, 16) & 15, rows.reshape(n, k // 32, 16) >> 4], dim=2).float()
    weight = (q.reshape(n, k // lin.group, lin.group) * scales[..., :1] + scales[..., 1:]).reshape(n, k)
    # torch's dequantized form comes through its kernel in bfloat16
    assert torch.allclose(weight, lin.dequantized(), atol=2 ** -8 * float(weight.abs().max()))
    assert why_not(stage) is None
    step = NativeStep(stage, stage.plain_weights)
    assert step.build(1, only_faster=False, compiled=True)["serving"]
    ids = list(range(5, 30))
    path = greedy(stage, ids, 24)
    fused, native = stage.new_cache(), stage.new_cache()
    stage.prefill(fused, torch.tensor(ids))
    stage.prefill(native, torch.tensor(ids))
    for token in path:
        want = stage.decode([fused], torch.tensor([token]))
        got = step.decode([native], torch.tensor([token]))
        assert float((got - want).abs().max()) <= QUANTIZED_LOGIT_TOLERANCE * (1 + float(want.abs().max()))


def test_an_int4_stage_of_a_benchmark_shape_is_taken_at_one_and_eight_sessions(tmp_path):
    """The check the background compile runs, on a random Qwen3 of the speed benchmarks' width (hidden 512,
    head 64, MLP 3,072: q46m-v4k's layer, two of them): the native int4 step must agree with the fused one
    at both batch sizes it serves. The tiny test above passed where this width's longer products went
    past the tolerance (int8 inputs, reverted: the benchmark's int4 served the slower graph)."""
    from fellow.runtime.tools.export import export

    hf = make_tiny_checkpoint(tmp_path / "hf", layers=2, hidden=512, shape=dict(
        intermediate_size=3072, num_attention_heads=8, num_key_value_heads=4, head_dim=64))
    export(hf, tmp_path / "servable", stages=1, model_id="wide")
    stage = load_one_stage(tmp_path / "servable", "cpu", StageOptions(quantization="int4-fast", compile=None)).stage
    assert why_not(stage) is None
    step = NativeStep(stage, stage.plain_weights)
    for rows in (1, 8):
        found = step.build(rows, only_faster=False, compiled=True)
        assert found["serving"], found


@pytest.mark.parametrize("method", ["int8", "int4-fast"])
def test_quantized_inputs_past_a_multiple_of_32_are_read_as_zeros(tmp_path, method):
    """A down product of 208 inputs (six 32-blocks and 16) is taken, read as 224 with zero columns: the step's
    logits do not change with what its work buffer held past the 208 (the kernel quantizes them as zeros),
    and stay within the background compile's tolerance of the fused step's."""
    from fellow.runtime.tools.export import export

    hf = make_tiny_checkpoint(tmp_path / "hf", layers=2, hidden=64, shape=dict(intermediate_size=208))
    export(hf, tmp_path / "servable", stages=1, model_id="tail")
    stage = load_one_stage(tmp_path / "servable", "cpu", StageOptions(quantization=method, compile=None)).stage
    assert why_not(stage) is None
    step = NativeStep(stage, stage.plain_weights)
    assert (step.layers[0].down.k, step.layers[0].down.kin) == (224, 208)
    assert step.build(1, only_faster=False, compiled=True)["serving"]
    ids = torch.arange(5, 30)
    logits = []
    for fill in (0.0, 1e4):
        cache = stage.new_cache()
        stage.prefill(cache, ids)
        step._work.fill_(fill)
        logits.append(step.decode([cache], torch.tensor([7])))
    assert torch.equal(logits[0], logits[1])
    fused = stage.new_cache()
    stage.prefill(fused, ids)
    want = stage.decode([fused], torch.tensor([7]))
    assert float((logits[0] - want).abs().max()) <= QUANTIZED_LOGIT_TOLERANCE * (1 + float(want.abs().max()))

# What each forced capability needs of the CPU. torch takes ATEN_CPU_CAPABILITY=avx512 at its word and runs its
# AVX-512 kernels on a CPU without them (SIGILL, seen on an AVX2-only AMD EPYC), so a test that forces one asks
# what this process can run first (native._cpu_flags: CPUID and /proc/cpuinfo) and skips where it lacks it.
CAPABILITY_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2", "fma"},
                    "default": set()}


def skip_unless_cpu_has(capability: str) -> None:
    from fellow.runtime.kernels import native

    lacking = sorted(CAPABILITY_FLAGS[capability] - native._cpu_flags())
    if lacking:
        pytest.skip(f"this CPU lacks {' '.join(lacking)}, which {capability} needs")


BUILDS = """
import sys, torch
from pathlib import Path
from events.stage import StageOptions
from fellow.runtime.kernels import native
from fellow.runtime.model.load.loader import load_one_stage
from fellow.runtime.model.forms.native_step import NativeStep, why_not
from fellow.runtime.tools.export import export
from tests.tiny import make_tiny_checkpoint
torch.set_num_threads(2)
root = Path(sys.argv[1])
for method, inter in (("none", 232), ("int8", 224), ("int4-fast", 224), ("int8", 208), ("int4-fast", 208)):
    hf = make_tiny_checkpoint(root / f"{method}-{inter}-hf", layers=2, hidden=96, shape=dict(
        intermediate_size=inter, num_attention_heads=4, num_key_value_heads=2, head_dim=24))
    export(hf, root / f"{method}-{inter}", stages=1, model_id=method)
    stage = load_one_stage(root / f"{method}-{inter}", "cpu", StageOptions(quantization=method, compile=None)).stage
    assert why_not(stage) is None, (method, why_not(stage))
    step = NativeStep(stage, stage.plain_weights)
    for rows in (1, 3, 8):
        found = step.build(rows, only_faster=False, compiled=True)
        assert found["serving"], (method, rows, found)
print(torch.backends.cpu.get_cpu_capability(), "-mavx512f" in native.flags())
"""


@pytest.mark.parametrize("capability", ["avx512", "avx2"])
def test_each_build_of_the_kernel_agrees_with_the_fused_step(tmp_path, capability):
    """The kernel is built for AVX-512 where torch dispatches AVX-512 (``step_avx512``), else for AVX2: under
    each capability this CPU has, float32 (a down product of 232 inputs: a masked last eight), int8 and int4
    (224: an odd count of 32-blocks; 208: a last block of 16 inputs, the kernel's zero padding) steps of 1, 3
    and 8 sessions pass the background compile's check."""
    skip_unless_cpu_has(capability)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", BUILDS, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    ran, avx512 = done.stdout.split()[-2:]
    if ran.lower() != capability:
        pytest.skip(f"this CPU runs {ran}, not {capability}")
    assert avx512 == str(capability == "avx512")


@pytest.mark.parametrize("capability", ["avx512", "avx2", "default"])
def test_torchs_int4_packing_is_read_back_under_each_cpu_capability(capability):
    """torch packs int4 by the capability it dispatches to (blocks of 64 outputs with AVX-512, 32 with AVX2,
    pairs of neighbours without vectors; a short last block in pairs); ``int4_values`` reads each back, on
    output counts with and without a short block. ATEN_CPU_CAPABILITY picks one at or below this CPU's."""
    check = """
import sys, torch
from fellow.runtime.model.forms.native_step import int4_packing, int4_values
for n in (32, 48, 96, 160, 192, 208):
    q = torch.randint(0, 16, (n, 128), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2).view(torch.uint8)
    assert torch.equal(int4_values(packed, n, 128).int(), q), n
print(torch.backends.cpu.get_cpu_capability(), int4_packing())
"""
    skip_unless_cpu_has(capability)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ran, packing = done.stdout.split(maxsplit=1)
    if ran.lower() != capability:
        pytest.skip(f"this CPU runs {ran}, not {capability}")
    assert packing.strip() == {"avx512": "(64, True)", "avx2": "(32, True)", "default": "(32, False)"}[capability]


def test_what_it_cannot_take_says_why_and_the_background_compile_builds_it_where_it_can(tmp_path):
    _, servable = make_servable(tmp_path, "tiny", layers=2, hidden=64, stages=1)
    for method in ("int8", "int4-fast"):
        stage = load_one_stage(servable, "cpu", StageOptions(quantization=method, compile=None)).stage
        background = BackgroundCompile(stage, stage.plain_weights, rows=(1, 8))
        assert background.plan == [(NATIVE, 1), (NATIVE, 8), (REDUCE, 1), (REDUCE, 8)]  # native first
        assert isinstance(background.candidates[NATIVE], NativeStep)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_kernel, "MAX_DIM", 8)
        assert "its head size" in why_not(stage)
        assert NATIVE not in BackgroundCompile(stage, stage.plain_weights, rows=(1,)).candidates
    float_stage = load_one_stage(servable, "cpu", StageOptions(compile=None)).stage
    plan = BackgroundCompile(float_stage, float_stage.plain_weights, rows=(1,)).plan
    assert plan[0] == (NATIVE, 1) and len(plan) >= 3  # before the graphs' GEMV forms


def test_its_library_builds_on_the_compile_thread_and_a_failed_build_says_why(tmp_path, monkeypatch):
    """``why_not`` builds nothing (the C compiler's 3 s would delay the stage's ready): ``warm``, on the compile
    thread, builds; where that fails, the step's check says why and ``why_not`` from then on too."""
    from fellow.runtime.kernels import native

    (tmp_path / "broken.c").write_text("this is not C")
    broken = native.Kernel("swarm_step_broken", tmp_path / "broken.c", "the native step kernel", "swarm_step", [])
    monkeypatch.setattr(step_kernel, "STEP", broken)
    monkeypatch.setattr(step_kernel, "available", broken.available)
    monkeypatch.setattr(step_kernel, "unavailable_reason", broken.unavailable_reason)
    _, servable = make_servable(tmp_path, "tiny", layers=2, hidden=64, stages=1)
    stage = load_one_stage(servable, "cpu", StageOptions(quantization="int8", compile=None)).stage
    assert why_not(stage) is None and "_built" not in vars(broken)  # nothing built yet
    step = NativeStep(stage, stage.plain_weights)
    step.warm(1)
    with pytest.raises(RuntimeError, match="did not build"):
        step.build(1, only_faster=False, compiled=True)
    assert "the native step kernel did not build" in why_not(stage)
