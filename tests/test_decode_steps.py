"""Every form of the decode step keeps the ``DecodeStep`` contract (fellow.runtime.steps.protocol).

Parametrized over each form that builds here: the eager ones (HF layers alone and padded, the fused step,
recurrent layers batched and each session alone), inductor's graph of the step, the native C step, and
the CUDA-graph pool (on a CPU through a capture that runs the step as written: tests/test_runtime_cuda_graphs).
At 1, 3 and 8 sessions each form's logits equal each session's own next position through the stage's
prompt path (``forward_piece`` on a twin of its cache) within the form's tolerance, and every cache advances
by exactly one position. A form that fails inside ``decode`` advances no cache, and the table's next form
serves that same step. Real tiny models; the native step where a C compiler and AVX2 are.
"""

from __future__ import annotations

import ast
import copy
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from fellow.runtime.kernels import native, step_kernel
from fellow.runtime.model.forms.checked_step import CheckedStep
from fellow.runtime.model.forms.compiled import CompiledDecode
from fellow.runtime.model.forms.cuda_graphs import graph_decode
from fellow.runtime.model.forms.native_step import NativeStep
from fellow.runtime.model.kv_cache import random_caches
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel
from fellow.runtime.steps.protocol import DecodeStep, StepReport
from tests.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 3, 8)
CONTEXT = 40  # positions each cache holds before the step
EAGER_TOLERANCE = 1e-4  # relative, as CheckedStep's: an eager form against the prompt path of the same layers
CAN_NATIVE = native.cpu_has_avx2_fma() and shutil.which(native.compiler()) is not None
# form -> (the model it runs, whether its stage is fused)
FORMS = {"hf_alone": ("qwen3", False), "hf_padded": ("qwen3", False), "fused": ("qwen3", True),
         "recurrent_batched": ("qwen3_next", False), "recurrent_alone": ("qwen3_next", False),
         "compiled": ("qwen3", True), "native": ("qwen3", True), "cuda_graphs": ("qwen3", False)}
# one session goes alone through HF layers; recurrent sessions batch from two on
CASES = [(form, rows) for form in FORMS for rows in ROWS
         if not (form == "hf_alone" and rows > 1) and not (form == "recurrent_batched" and rows == 1)]
failing = {"now": False}  # the CUDA-graph pool's stand-in capture raises while this is set


def fallible_capture(step):
    def replay():
        if failing["now"]:
            raise RuntimeError("a forced failure inside the replay")
        step()
    return replay


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for family, shape in (("qwen3", dict(layers=2, hidden=64)), ("qwen3_next", dict(layers=4, hidden=64))):
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family=family, **shape)
        out[family] = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return out


@pytest.fixture(scope="module")
def built(models):
    """form -> (its stage, the form in that stage's table), made once a form."""
    cache: dict = {}

    def get(form: str) -> tuple[StageModel, DecodeStep]:
        if form not in cache:
            cache[form] = _build(models, form)
        return cache[form]
    return get


def _build(models, form: str) -> tuple[StageModel, DecodeStep]:
    family, fused = FORMS[form]
    stage = StageModel.from_causal_lm(copy.deepcopy(models[family]))
    if fused:
        assert prepare_stage(stage, batch_cap=8, keep_plain=form in ("compiled", "native")).path == "fused"
    if form in ("compiled", "native"):
        if form == "native" and not CAN_NATIVE:
            pytest.skip("the native step needs a C compiler and AVX2 with FMA")
        step = NativeStep(stage, stage.plain_weights) if form == "native" else \
            CompiledDecode(stage, stage.plain_weights, None)  # inductor's default mode: seconds, not a minute
        for rows in ROWS:
            assert step.build(rows, only_faster=False)["serving"], rows
        stage.steps.put("compiled", step)
    if form == "cuda_graphs":
        status = graph_decode(stage, slots=8, positions=CONTEXT + 16, capture=fallible_capture, choose=False)
        assert stage.graphed is not None, status
    found = [f for f in stage.steps.forms if f.name == form or (form in ("compiled", "native") and f is step)]
    assert len(found) == 1, [f.name for f in stage.steps.forms]
    return stage, found[0]


@torch.inference_mode()  # the pool's slots are inference tensors
def twins(stage: StageModel, rows: int, seed: int) -> tuple[list, list]:
    """Two sets of ``rows`` caches with the same random past; the second each a cache of its own."""
    first = random_caches(stage.new_cache, rows, CONTEXT, 1, torch.Generator().manual_seed(seed))
    own = stage.steps.get("cuda_graphs")
    if own is not None:  # the twins outside the pool: its slots are the step's own
        own.failed, saved = "twins", own.failed
    try:
        second = random_caches(stage.new_cache, rows, CONTEXT, 1, torch.Generator().manual_seed(seed))
    finally:
        if own is not None:
            own.failed = saved
    return first, second


def alone(stage: StageModel, caches: list, ids: torch.Tensor) -> torch.Tensor:
    """Each session's next position through the prompt path, by itself."""
    return torch.stack([stage.forward_piece(cache, ids[i : i + 1]) for i, cache in enumerate(caches)])


def tolerance(form: DecodeStep) -> float:
    return form.tolerance if isinstance(form, CheckedStep) else EAGER_TOLERANCE


@pytest.mark.parametrize("form,rows", CASES)
def test_a_form_gives_each_sessions_logits_and_advances_every_cache_by_one(built, form, rows):
    stage, step = built(form)
    caches, twin = twins(stage, rows, seed=rows)
    ids = torch.randint(0, stage.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
    assert step.takes(caches)
    before = step.report().steps
    with torch.inference_mode():
        got = step.decode(caches, ids)
        want = alone(stage, twin, ids)
    assert got.shape == want.shape == (rows, stage.config.vocab_size)
    diff = float((got - want).abs().max())
    assert diff <= tolerance(step) * (1.0 + float(want.abs().max())), diff
    assert [cache.length for cache in caches] == [CONTEXT + 1] * rows
    report = step.report()
    assert isinstance(report, StepReport) and report.steps == before + 1 and not report.given_up
    for cache in caches + twin:
        cache.release()


FAST = ["compiled", "native", "cuda_graphs"]


@pytest.mark.parametrize("form", FAST)
def test_a_form_that_fails_inside_its_step_advances_nothing_and_the_next_form_serves_it(built, form, monkeypatch):
    stage, step = built(form)
    rows = 3
    caches, twin = twins(stage, rows, seed=7)
    ids = torch.tensor([5, 9, 11])

    def fail(*args, **kwargs):
        raise RuntimeError("a forced failure inside the step")
    if form == "cuda_graphs":
        monkeypatch.setitem(failing, "now", True)
    else:  # after each cache made room for the new position, before any advanced
        monkeypatch.setattr(step, "rotary", fail)
    later = stage.steps.forms[stage.steps.forms.index(step) + 1 :]
    nxt = next(f for f in later if f is stage.steps.eager or f.takes(caches))
    served = nxt.report().steps
    with torch.inference_mode():
        got = stage.decode(caches, ids)
        want = alone(stage, twin, ids)
    diff = float((got - want).abs().max())
    assert diff <= EAGER_TOLERANCE * (1.0 + float(want.abs().max())), diff
    assert [cache.length for cache in caches] == [CONTEXT + 1] * rows  # one position: the next form's
    assert nxt.report().steps == served + 1
    assert not step.takes(caches) and "forced failure" in step.report().given_up
    for cache in caches + twin:
        cache.release()
    # the forms built for this test are given back whole for any later case of the module
    if form == "cuda_graphs":
        stage.steps.get("cuda_graphs").failed = None
    else:
        step.serving.add(rows)
        step.given_up = ""


@pytest.mark.parametrize("form", ["fused", "hf_padded", "recurrent_batched"])
def test_an_eager_forms_failure_is_the_steps(built, form, monkeypatch):
    """The eager forms cannot promise their layers wrote nothing: their failure fails the step."""
    stage, step = built(form)
    caches, _ = twins(stage, 3, seed=3)

    def fail(*args, **kwargs):
        raise RuntimeError("a forced failure inside the step")
    monkeypatch.setattr(stage, "run_fused" if form == "fused" else "run_layers", fail)
    with pytest.raises(RuntimeError, match="forced failure"), torch.inference_mode():
        stage.decode(caches, torch.tensor([1, 2, 3]))


def test_the_table_tries_the_fast_slots_first_and_the_eager_form_last(built):
    stage, step = built("compiled")
    assert [f.name for f in stage.steps.forms] == ["compiled", "fused"]
    assert stage.steps.eager.name == "fused" and stage.compiled is step
    assert stage.steps.choose(random_caches(stage.new_cache, 2, 4, 1)) is stage.steps.eager  # built at 1, 3, 8
    three = random_caches(stage.new_cache, 3, 4, 1)
    assert stage.steps.choose(three) is step
    step.serving.discard(3)
    assert stage.steps.choose(three) is stage.steps.eager
    step.serving.add(3)
    with pytest.raises(ValueError, match="no step slot"):
        stage.steps.put("elsewhere", step)


def _calls_in(tree: ast.AST, names: set[str]) -> list[str]:
    """The calls of ``names`` in ``tree``: ``f(...)``, ``x.f(...)``; ``put`` only as ``<...>.steps.put(...)``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name == "put" and not (isinstance(func.value, ast.Attribute) and func.value.attr == "steps"):
            continue
        if name in names:
            found.append(name)
    return found


def test_plan_steps_is_the_only_chooser_and_stage_decode_is_one_call():
    """Outside the chooser (model/forms/plan_steps.py) and the modules that define them, nothing in the fellow's code
    builds a form or fills a slot of the table; StageModel.decode is one statement."""
    choosers = {"compile_decode", "graph_decode", "BackgroundCompile", "CompiledSteps", "NativeStep",
                "CompiledDecode", "GraphedDecode", "FixedStep", "put"}
    allowed = {"fellow/runtime/model/forms/plan_steps.py": choosers,
               "fellow/runtime/model/forms/compiled.py": {"CompiledDecode", "put"},
               "fellow/runtime/model/forms/cuda_graphs.py": {"GraphedDecode", "put"},
               # the background compile builds its candidates, and puts what it found between two steps
               "fellow/runtime/model/forms/background_compile.py": {"NativeStep", "CompiledDecode", "CompiledSteps",
                                                                    "put"}}
    found = {}
    for path in sorted((ROOT / "fellow").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        calls = set(_calls_in(ast.parse(path.read_text()), choosers)) - allowed.get(rel, set())
        if calls:
            found[rel] = sorted(calls)
    assert not found, f"these pick a decode form outside model/forms/plan_steps.py: {found}"
    tree = ast.parse((ROOT / "fellow/runtime/model/stage.py").read_text())
    decode = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "decode")
    body = [node for node in decode.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    assert len(body) == 1 and isinstance(body[0], ast.Return), ast.dump(decode)


def test_the_native_step_is_checked_where_it_builds():
    """Where a compiler and AVX2 are, the native form above ran (its build failing fails the suite, not skips)."""
    if not CAN_NATIVE:
        pytest.skip("no C compiler, or this CPU lacks AVX2 or FMA")
    assert step_kernel.available(), step_kernel.unavailable_reason()
