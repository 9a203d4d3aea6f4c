"""The draft model's fixed-shape decoder (TS9): CUDA graphs where they hold, eager steps elsewhere.

On a CPU the decoder is not captured (``fixed_decoder`` says eager); its fixed-shape step still runs
here through a capture that returns the step itself, so the static pool, the slots, the masks and
the load's check are exercised, and greedy replies stay those of the served model alone. A capture
that fails, and a replay that does not step (the check fails), leave eager steps and one log line.
The CUDA graph itself runs in the ``gpu`` test only.
"""

import logging

import pytest
import torch

from fellow.runtime.engine.draft_model import DraftModel, load_draft_model
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.model.forms.draft_graph import (
    CUDA_GRAPH,
    EAGER,
    FixedDecoder,
    FixedStep,
    SlotCache,
    fixed_decoder,
)
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel
from tests.test_runtime_draft_model import _planted
from tests.test_runtime_speculative import copying, random_prompts, run


def _pair(path: str, device: str = "cpu") -> tuple[StageModel, StageModel]:
    stages = (StageModel.from_causal_lm(_planted(3, 64, 0).to(device)),
              StageModel.from_causal_lm(_planted(1, 64, 5).to(device)))
    if path == "fused":
        for stage in stages:
            assert prepare_stage(stage).path == "fused"
    return stages


def _sessions():
    return copying(2, 20) + random_prompts(3, 60)


def _counting(replays: list[int]):
    """A capture that runs the step itself each replay (no graph), counting replays."""
    def capture(step):
        def replay():
            replays.append(1)
            step()
        return replay
    return capture


@pytest.mark.parametrize("path", ["hf", "fused"])
def test_the_fixed_shape_step_checks_against_eager_and_keeps_greedy_replies(path, caplog):
    """Two slots of 24 positions for five sessions: the copying ones never fit (eager from the start),
    one random one finds no free slot, two start in slots and move out when they outgrow them."""
    target, small = _pair(path)
    off, _ = run(local_engine(target, kv_tokens=8192), _sessions())
    replays: list[int] = []
    with caplog.at_level(logging.INFO, logger="swarm.draft"):
        decoder, label = fixed_decoder(small, slots=2, positions=24, capture=_counting(replays), label="fixed-shape")
    assert decoder is not None and label == decoder.label == "fixed-shape"
    assert decoder.buckets == [1, 2] and set(decoder.replays) == {1, 2}
    assert "draft decoder: fixed-shape (2 slots of 24 positions, 2 captured steps" in caplog.text
    checked = len(replays)
    assert checked == 2  # the load's check replayed each bucket once
    draft = DraftModel(small, target, decoder=decoder)
    slotted, moved = set(), set()

    def watch(engine):
        for session_id, state in draft.states.items():
            (slotted if isinstance(state.cache, SlotCache) else moved).add(session_id)

    on, ends = run(local_engine(target, kv_tokens=8192, speculative=4, draft=draft), _sessions(), watch)
    assert on == off
    assert len(replays) > checked  # steps ran through the fixed-shape decoder
    assert slotted == {"r0", "r1"} and {"r0", "r1", "r2", "c0", "c1"} <= moved | slotted
    assert {"r0", "r1"} <= moved  # they outgrew their slots and went on eagerly
    assert sum(s.spec_model_drafted for s in ends.values()) > 0
    assert decoder.free == {0, 1} and not draft.states
    served = small.steps.get("cuda_graphs")  # the draft stage's table: its slots' steps went through the decoder
    assert isinstance(served, FixedStep) and served.report().steps == len(replays) - checked > 0
    eager = local_engine(target, kv_tokens=8192, speculative=4, draft=DraftModel(small, target))
    _, eager_ends = run(eager, _sessions())

    def counts(ends):
        return {k: (s.spec_model_drafted, s.spec_model_accepted) for k, s in ends.items()}

    assert counts(ends) == counts(eager_ends)  # the same drafts as the eager steps'


def test_a_replay_that_fails_while_serving_gives_up_and_the_eager_form_serves_the_same_step(caplog):
    """The decoder's third replayed step raises (after the check's): nothing advanced, the table's eager form
    serves that step and every later one, and the drafts are the eager steps' to the token."""
    target, small = _pair("fused")
    replays: list[int] = []
    decoder, _ = fixed_decoder(small, slots=2, positions=24, capture=_counting(replays), label="fixed-shape")
    served = []

    def failing(replay):
        def fails_on_the_third():
            served.append(1)
            if len(served) == 3:
                raise RuntimeError("the replay failed")
            replay()
        return fails_on_the_third

    decoder.replays = {n: failing(replay) for n, replay in decoder.replays.items()}
    draft = DraftModel(small, target, decoder=decoder)
    with caplog.at_level(logging.INFO, logger="swarm.draft"):
        on, ends = run(local_engine(target, kv_tokens=8192, speculative=4, draft=draft), _sessions())
    form = small.steps.get("cuda_graphs")
    assert form.report().steps == 2 and form.report().given_up == "RuntimeError: the replay failed"
    assert "draft decoder: eager from now on, a replayed step failed: RuntimeError: the replay failed" in caplog.text
    assert small.steps.choose([SlotCache(decoder, 0)]) is small.steps.eager  # it takes no step after
    off, eager_ends = run(local_engine(target, kv_tokens=8192, speculative=4, draft=DraftModel(small, target)),
                          _sessions())
    assert on == off
    assert ({k: (s.spec_model_drafted, s.spec_model_accepted) for k, s in ends.items()}
            == {k: (s.spec_model_drafted, s.spec_model_accepted) for k, s in eager_ends.items()})


def test_on_a_cpu_the_draft_model_steps_eagerly_and_the_load_says_so(tmp_path, caplog):
    from fellow.runtime.model.load.loader import load_one_stage
    from tests.serving_fixtures import make_servable

    _, served = make_servable(tmp_path, "big", layers=2, hidden=64, stages=1)
    _, small = make_servable(tmp_path, "small", layers=1, hidden=32, stages=1, seed=3)
    target = load_one_stage(served, "cpu")
    with caplog.at_level(logging.INFO, logger="swarm.draft"):
        draft = load_draft_model(small, target.stage, target.tokenizer, target.device)
    assert draft.decoder is None and draft.decoder_label == EAGER
    assert "draft decoder: eager (the draft model is on cpu)" in caplog.text


def test_a_capture_that_fails_leaves_eager_steps_and_one_log_line(caplog):
    target, small = _pair("hf")

    def unsupported(step):
        step()  # the warm-up runs, then capturing refuses
        raise RuntimeError("operation not permitted when stream is capturing")

    with caplog.at_level(logging.INFO, logger="swarm.draft"):
        decoder, label = fixed_decoder(small, slots=4, positions=64, capture=unsupported)
    assert decoder is None and label == "eager (capture failed)"
    lines = [r.getMessage() for r in caplog.records if r.name == "swarm.draft"]
    assert lines == ["draft decoder: eager, the capture failed: RuntimeError: operation not permitted when "
                     "stream is capturing"]
    off, _ = run(local_engine(target, kv_tokens=8192), _sessions())
    on, _ = run(local_engine(target, kv_tokens=8192, speculative=4, draft=DraftModel(small, target, decoder=decoder)),
                _sessions())
    assert on == off


def test_a_replay_that_does_not_step_fails_the_check(caplog):
    _, small = _pair("hf")
    with caplog.at_level(logging.INFO, logger="swarm.draft"):
        decoder, label = fixed_decoder(small, slots=3, positions=64, capture=lambda step: (lambda: None))
    assert decoder is None and label == "eager (check failed)"
    assert "draft decoder: eager, the captured step does not match the eager step" in caplog.text


def test_a_slot_holds_its_positions_and_no_more():
    _, small = _pair("hf")
    decoder = FixedDecoder(small, slots=1, positions=8)
    assert decoder.take(9) is None
    slot = decoder.take(8)
    assert slot is not None and decoder.take(1) is None  # the one slot is taken
    small.prefill(slot, torch.arange(8))
    with pytest.raises(RuntimeError, match="holds 8 positions, 9 asked"):
        small.prefill(slot, torch.arange(1))
    slot.release()
    assert decoder.free == {0} and decoder.take(2) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_draft_steps_replay_a_checked_cuda_graph_and_greedy_replies_stay(caplog):
    target, small = _pair("hf", "cuda")
    with caplog.at_level(logging.INFO, logger="swarm.draft"):
        decoder, label = fixed_decoder(small, slots=4, positions=128)
    assert label == CUDA_GRAPH and decoder is not None, caplog.text
    assert set(decoder.replays) == {1, 2, 4}
    off, _ = run(local_engine(target, kv_tokens=8192), _sessions())
    draft = DraftModel(small, target, decoder=decoder)
    on, ends = run(local_engine(target, kv_tokens=8192, speculative=4, draft=draft), _sessions())
    assert on == off and sum(s.spec_model_drafted for s in ends.values()) > 0
    assert decoder.free == {0, 1, 2, 3}
