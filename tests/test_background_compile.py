"""SWARM_SERVE_COMPILE=auto, the default (fellow.runtime.model.forms.background_compile): a stage serves its fused
step at once, compiles its decode step on another thread meanwhile, and swaps it in at a step boundary; the
replies are the fused step's throughout, and the load's status says where the compile is.

In-process, the reduce form alone (inductor's default mode: a third of the compile; tests/test_compiled_decode.py
says why); the stack test runs what a fellow runs, both forms, the linear one under max-autotune, which takes
tens of seconds even for a tiny model."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from events.requests import Sampling
from events.stage import StageOptions
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.session import Session
from fellow.runtime.model.forms.background_compile import COMPILING, BackgroundCompile
from fellow.runtime.model.forms.compiled_steps import choose
from fellow.runtime.model.forms.graph_linear import REDUCE
from fellow.runtime.model.forms.native_step import NATIVE, why_not as native_why_not
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.load.loader import load_one_stage
from fellow.runtime.model.stage import StageModel
from tests.processes import wait_until
from tests.serving_fixtures import Stack, make_servable
from tests.tiny import make_tiny_checkpoint

PROMPTS = [list(range(5, 30)), [7, 8, 9, 10], list(range(40, 57))]


def replies(engine, prompts, new: int, between=None) -> dict[str, list[int]]:
    """Greedy replies, one session at a time (batch 1: the size it compiles), ``between`` called between steps."""
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add(Session(f"s{i}", prompt, new, sampling=Sampling(temperature=0.0)))
        while engine.busy:
            if between is not None:
                between()
            for sid, tokens in engine.step().tokens.items():
                out.setdefault(sid, []).extend(tokens)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("bg"), family="qwen3", layers=2, hidden=128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


def test_a_stage_serves_while_its_step_compiles_and_swaps_it_in_between_steps(model):
    fused = StageModel.from_causal_lm(copy.deepcopy(model))
    prepare_stage(fused, batch_cap=2)
    expected = replies(local_engine(fused, kv_tokens=4096), PROMPTS, 24)
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    prepare_stage(stage, batch_cap=2, keep_plain=True)
    background = BackgroundCompile(stage, stage.plain_weights, forms=(REDUCE,), only_faster=False, rows=(1,))
    engine = local_engine(stage, kv_tokens=4096)
    background.start()
    swaps: list[bool] = []
    # served by the fused step while it compiles (and by the compiled one from the boundary it swapped at,
    # where the compile was done first)
    during = replies(engine, PROMPTS, 24, lambda: swaps.append(background.poll()))
    assert during == expected
    assert background.wait(300)
    swaps += [background.poll(), background.poll()]
    assert swaps.count(True) == 1  # swapped once, at a boundary
    assert stage.compiled is background.compiled and background.compiled.serving == {1}
    assert background.state.startswith("batch 1 compiled (reduce)") and background.report["serving"] == [1]
    steps = background.compiled.steps
    assert replies(engine, PROMPTS, 24) == expected  # now the compiled step's, token for token
    assert background.compiled.steps >= steps + 3 * 23


@pytest.mark.parametrize("method", ["int8", "int4-fast"])
def test_a_quantized_stage_compiles_its_step_over_its_own_kernels(tmp_path, method):
    """An int8 or int4 stage compiles in the background too: its graph calls the stage's quantized weights
    (no copy kept at load) and replies token for token as its fused step."""
    _, servable = make_servable(tmp_path, "tiny", layers=2, hidden=64, stages=1)
    options = StageOptions(quantization=method, compile=None, max_batch=2)
    expected = replies(local_engine(load_one_stage(servable, "cpu", options).stage, kv_tokens=4096), PROMPTS, 16)
    stage = load_one_stage(servable, "cpu", options).stage
    assert stage.plain_weights is not None and not stage.plain_weights.by_linear  # nothing kept beside it
    # the graph alone (its default beside it, the native step, rounds its rows otherwise: test_native_step.py)
    background = BackgroundCompile(stage, stage.plain_weights, forms=(REDUCE,), only_faster=False, rows=(1,))
    assert list(background.candidates) == [REDUCE]
    engine = local_engine(stage, kv_tokens=4096)
    background.start()
    assert replies(engine, PROMPTS, 16, background.poll) == expected
    assert background.wait(300) and (background.poll() or background.state != COMPILING)
    assert stage.compiled is background.compiled and background.compiled.serving == {1}, background.report
    steps = background.compiled.steps
    assert replies(engine, PROMPTS, 16) == expected
    assert background.compiled.steps >= steps + 3 * 15


def test_batches_of_several_rows_compile_too_and_each_size_is_served_by_its_own_step(model):
    """rows=(1, 2): two graphs' worth of steps behind one ``stage.compiled``; two sessions decoding together
    take the batch-2 step, and the replies are the fused step's."""
    fused = StageModel.from_causal_lm(copy.deepcopy(model))
    prepare_stage(fused, batch_cap=2)

    def together(engine):
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.add(Session(f"s{i}", prompt, 12, sampling=Sampling(temperature=0.0)))
        out: dict[str, list[int]] = {}
        while engine.busy:
            for sid, tokens in engine.step().tokens.items():
                out.setdefault(sid, []).extend(tokens)
        return out

    expected = together(local_engine(fused, kv_tokens=4096))
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    prepare_stage(stage, batch_cap=2, keep_plain=True)
    background = BackgroundCompile(stage, stage.plain_weights, forms=(REDUCE,), only_faster=False, rows=(1, 2))
    assert background.plan == [(REDUCE, 1), (REDUCE, 2)]
    background.start()
    assert background.wait(300) and background.poll()
    assert stage.compiled.serving == {1, 2}, background.report
    assert set(background.report["batches"]) == {"1", "2"}
    steps = stage.compiled.steps
    assert together(local_engine(stage, kv_tokens=4096)) == expected
    assert stage.compiled.steps >= steps + 10  # most of the 12 steps ran two rows compiled


def native_ready(model):
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    prepare_stage(stage, batch_cap=2, keep_plain=True)
    if (why := native_why_not(stage)) is not None:
        pytest.skip(f"no native step here: {why}")
    return stage


def test_the_native_step_serves_seconds_in_and_where_it_takes_every_size_no_graph_is_built(model):
    """The native step is built first and serves from the first step boundary after (a load at about full
    speed seconds after ready); where it serves every batch size, inductor builds nothing. Replies are the
    fused step's throughout."""
    fused = StageModel.from_causal_lm(copy.deepcopy(model))
    prepare_stage(fused, batch_cap=2)
    expected = replies(local_engine(fused, kv_tokens=4096), PROMPTS, 24)
    stage = native_ready(model)
    background = BackgroundCompile(stage, stage.plain_weights, forms=(REDUCE, NATIVE), only_faster=False, rows=(1,))
    assert background.plan == [(NATIVE, 1), (REDUCE, 1)]
    background.start()
    wait_until(background.poll, 120, "the native step serving")
    assert background.state.startswith("compiling; meanwhile batch 1 native") and background.native_covers
    assert stage.compiled.by_rows == {1: background.candidates[NATIVE]}
    assert background.report["first"]["serving"] == [1] and background.report["first"]["after_s"] >= 0
    native = stage.compiled.by_rows[1]
    assert replies(local_engine(stage, kv_tokens=4096), PROMPTS, 24) == expected
    assert native.steps >= 3 * 23  # those replies were the native step's
    assert background.wait(60) and background.poll() and background.settled
    assert (REDUCE, 1) not in background._seconds and background.report["graphs"].startswith("not built")
    assert background.state.startswith("batch 1 compiled (native)")
    assert replies(local_engine(stage, kv_tokens=4096), PROMPTS, 24) == expected
    assert not background.poll()  # nothing changes from here on


def test_where_the_native_step_does_not_serve_the_graphs_compile_and_serve(model):
    """The native step refused (its check made to fail: logits must differ by less than nothing): the fused
    step goes on serving, the graphs compile, and the reduce graph serves once checked."""
    stage = native_ready(model)
    background = BackgroundCompile(stage, stage.plain_weights, forms=(REDUCE, NATIVE), only_faster=False, rows=(1,))
    background.candidates[NATIVE].tolerance = -1.0
    background.start()
    # the serving thread's polls, as a stage's loop makes them: the graphs wait for its verdict on the native step
    wait_until(lambda: background.poll() and background.settled, 300, "the graphs compiled and checked")
    assert not background.native_covers
    assert not background.report["first"]["serving"] and "graphs" not in background.report
    assert background.state.startswith("batch 1 compiled (reduce)"), background.state
    forms_ms = background.report["batches"]["1"]["forms_ms"]
    assert forms_ms[NATIVE] is None and forms_ms[REDUCE] > 0  # refused, and the graph timed
    assert "differ" in background.report["first"]["batches"]["1"]["why"]


def test_graphs_compile_only_for_the_sizes_the_native_step_does_not_serve(model):
    """The native step serves batch 1 and is refused at batch 2 (its check made to fail there): only the
    batch-2 graph compiles, and each size is served by its own form once settled."""
    stage = native_ready(model)
    background = BackgroundCompile(stage, stage.plain_weights, forms=(REDUCE, NATIVE), only_faster=False,
                                   rows=(1, 2))
    native = background.candidates[NATIVE]
    checked = native.build
    native.build = lambda rows, *args, **kw: ({"serving": False, "why": "refused here"} if rows == 2
                                              else checked(rows, *args, **kw))
    background.start()
    wait_until(lambda: background.poll() and background.settled, 300, "the batch-2 graph compiled and checked")
    assert (REDUCE, 2) in background._seconds and (REDUCE, 1) not in background._seconds
    assert background.eta.skipped == 1 and background.eta.built == [background._seconds[REDUCE, 2]]
    assert {rows: step.name for rows, step in stage.compiled.by_rows.items()} == {1: NATIVE, 2: "compiled"}


def test_a_compile_records_its_time_and_the_next_of_that_shape_has_it_as_its_eta(model, tmp_path, monkeypatch):
    """The first compile of a shape says at ready that its ETA is unknown; once settled it records its time
    beside the kernels' cache, and the next compile of the same stage and plan starts with that time as its
    ETA (in the ready event's report and the status line); another plan's is unknown again."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    stage = native_ready(model)
    first = BackgroundCompile(stage, stage.plain_weights, forms=(REDUCE, NATIVE), only_faster=False, rows=(1,))
    assert first.report["eta_s"] is None and first.report["eta"].startswith("unknown"), first.report
    assert first.status_line() == COMPILING + " (0 of 1 graphs built, ETA unknown)"
    first.start()
    wait_until(lambda: first.poll() and first.settled, 300, "the first compile settled")
    assert first.status_line() == first.state  # settled: no ETA any more
    took = first.report["settled_after_s"]
    again = native_ready(model)
    second = BackgroundCompile(again, again.plain_weights, forms=(REDUCE, NATIVE), only_faster=False, rows=(1,))
    assert second.report["eta_s"] == took and f"took {took:.0f} s" in second.report["eta"], second.report
    assert "s left)" in second.status_line()
    other = BackgroundCompile(again, again.plain_weights, forms=(REDUCE, NATIVE), only_faster=False, rows=(1, 2))
    assert other.report["eta_s"] is None


def test_the_fastest_form_that_checks_serves():
    fast = {"serving": True, "compiled_ms": 4.0, "fused_ms": 6.0}
    slow = {"serving": True, "compiled_ms": 5.0, "fused_ms": 6.0}
    chosen = choose({"reduce": slow, "linear": fast}, "")
    assert chosen["form"] == "linear" and chosen["forms_ms"] == {"reduce": 5.0, "linear": 4.0}
    wrong = {"serving": False, "why": "its logits differ from the fused step's by 0.1"}
    assert choose({"reduce": wrong, "linear": slow}, "")["form"] == "linear"
    none = choose({"reduce": wrong, "linear": {"serving": False, "why": "not faster than the fused step here"}}, "")
    assert not none["serving"] and "reduce: its logits" in none["why"] and "linear: not faster" in none["why"]
    assert choose({}, "RuntimeError: no compiler") == {"serving": False, "why": "RuntimeError: no compiler"}


def test_a_stack_load_is_ready_before_its_step_compiles_and_its_status_follows(tmp_path, nats_server):
    """Through a fellow, SWARM_SERVE_COMPILE=auto: the load is ready while the step still compiles (its
    status says so), a chat is served meanwhile, and the status names what serves once it is done."""
    _, servable = make_servable(tmp_path / "models", "tiny", layers=2, hidden=64, stages=1)
    stack = Stack(tmp_path, nats_server.url, servable.parent, SWARM_SERVE_COMPILE="auto").start()
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    try:
        load = stack.load("tiny")
        assert load["stages"][0]["kernels"]["compiled"]["state"] == COMPILING
        first = stack.post("/v1/chat/completions", body)
        assert first.status_code == 200, first.text

        def compiled_state():
            stage = stack.get("/api/v1/models/tiny/status").json()["load"]["stages"][0]
            return not (stage.get("compiled") or COMPILING).startswith(COMPILING) and stage["compiled"]

        state = wait_until(compiled_state, 400, "the background compile to finish")
        assert state.startswith(("batch 1 compiled", "batch 1 fused: not faster")), state
        again = stack.post("/v1/chat/completions", body)
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    finally:
        stack.stop()
