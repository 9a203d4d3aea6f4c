"""The target stage's decode step replayed from a pool of sessions (SWARM_SERVE_CUDA_GRAPHS, issue 13).

On a CPU no graph is captured; ``graph_decode`` still builds the pool here with a capture that
returns the step itself, so the pool, its slots, sessions outgrowing them, mixed batches, the
load's check and its timed choice all run, and greedy replies stay those of the eager stage. The
CUDA graphs themselves run in the ``gpu`` tests only.
"""

import logging
import time

import pytest
import torch
import transformers

from fellow.runtime.engine.engine import local_engine
from fellow.runtime.model.forms.cuda_graphs import GraphedDecode, PoolCache, graph_decode
from fellow.runtime.model.kv_cache import KVCache
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel
from tests.test_runtime_draft_model import _planted
from tests.test_runtime_speculative import copying, random_prompts, run


def _stage(path: str, device: str = "cpu") -> StageModel:
    stage = StageModel.from_causal_lm(_planted(3, 64, 0).to(device))
    if path == "fused":
        assert prepare_stage(stage).path == "fused"
    return stage


def _sessions():
    # the random prompts (9-11 tokens, 60 new) start in slots of 48 positions and outgrow them; the copying
    # ones (57, 60 tokens) never fit one: the first takes the last slot and leaves it at once, the second
    # finds none free. Their 20 steps are mixed batches (eager), the random ones' next steps replay
    return random_prompts(3, 60) + copying(2, 20)


def _counting(replays: list[int], fail_after: int | None = None):
    """A capture that runs the step itself each replay (no graph), counting replays; with
    ``fail_after``, every replay past that many raises."""
    def capture(step):
        def replay():
            replays.append(1)
            if fail_after is not None and len(replays) > fail_after:
                raise RuntimeError("replay failed")
            step()
        return replay
    return capture


class _Watch:
    """Which sessions decoded from a slot of the pool, and which left it for buffers of their own."""

    def __init__(self) -> None:
        self.pooled, self.moved = set(), set()

    def __call__(self, engine) -> None:
        for session_id, session in engine.sessions.items():
            cache = session.cache
            if isinstance(cache, PoolCache):
                (self.pooled if cache.decoder is not None else self.moved).add(session_id)
                if cache.decoder is not None:  # in the pool, its past is in its slot and nowhere else
                    assert cache.keys[0].data_ptr() == cache.decoder.keys[cache.slot].data_ptr(), session_id
                    assert cache.home is None, session_id


@pytest.mark.parametrize("speculative", [0, 4])
@pytest.mark.parametrize("path", ["hf", "fused"])
def test_a_pool_stage_decodes_as_its_eager_self_with_sessions_in_and_out_of_slots(path, speculative, caplog):
    off, _ = run(local_engine(_stage(path), kv_tokens=8192, speculative=speculative), _sessions())
    stage = _stage(path)
    replays: list[int] = []
    with caplog.at_level(logging.INFO, logger="fellow.runtime.model.forms.cuda_graphs"):
        status = graph_decode(stage, slots=4, positions=48, capture=_counting(replays), label="fixed-shape",
                              choose=False)
    assert status["path"] == "fixed-shape" and status["buckets"] == [1, 2, 4], status
    assert isinstance(stage.graphed, GraphedDecode)
    assert "cuda graphs: fixed-shape, 4 slots of 48 positions, 3 captured steps" in caplog.text
    checked = len(replays)
    assert checked == 3  # the load's check replayed each bucket once
    watch = _Watch()
    on, ends = run(local_engine(stage, kv_tokens=8192, speculative=speculative), _sessions(), watch)
    assert on == off  # token for token, every session
    assert len(replays) > checked  # steps replayed from the pool
    assert {"r0", "r1", "r2"} <= watch.pooled and {"r0", "r1", "r2"} <= watch.moved  # they outgrew their slots
    assert stage.graphed.decoder.free == {0, 1, 2, 3}  # every slot back
    assert stage.graphed.failed is None
    if speculative:
        assert sum(s.spec_drafted for s in ends.values()) > 0


@torch.inference_mode()
def test_a_pool_cache_moves_to_buffers_of_its_own_with_its_past_and_frees_its_slot():
    stage = _stage("hf")
    graph_decode(stage, slots=2, positions=16, capture=lambda step: step, choose=False)
    decoder = stage.graphed.decoder
    cache = stage.new_cache()
    assert isinstance(cache, PoolCache) and cache.slot == 0 and decoder.free == {1}
    cache.reserve(10)
    past = torch.randn(len(stage.layers), stage.num_kv_heads, 10, stage.head_dim)
    cache.keys[0][:, :, :10].copy_(past)
    cache.advance(10)
    assert cache.keys[0].data_ptr() == decoder.keys[0].data_ptr()  # the slot's own memory
    cache.reserve(6)  # 16: still the slot
    assert cache.decoder is decoder
    cache.reserve(7)  # 17: past the slot
    assert cache.decoder is None and decoder.free == {0, 1} and cache.capacity >= 17
    assert torch.equal(cache.keys[0][:, :, :10], past)
    assert cache.keys[0].data_ptr() != decoder.keys[0].data_ptr()
    assert not stage.graphed.takes([cache])
    cache.release()
    assert decoder.free == {0, 1} and cache.keys == [None]
    a, b = stage.new_cache(), stage.new_cache()
    third = stage.new_cache()  # the pool is full: a cache of its own
    assert {a.slot, b.slot} == {0, 1} and type(third) is KVCache
    b.release()
    assert decoder.free == {b.slot} and stage.new_cache().slot == b.slot


@pytest.mark.parametrize("path", ["hf", "fused"])
@torch.inference_mode()
def test_a_replayed_step_over_some_slots_in_any_order_gives_each_session_its_own_logits(path):
    eager, stage = _stage(path), _stage(path)
    replays: list[int] = []
    graph_decode(stage, slots=4, positions=64, capture=_counting(replays), choose=False)
    prompts = [p.prompt_ids for p in random_prompts(4, 1)]
    pooled = [stage.new_cache() for _ in prompts]
    own = [eager.new_cache() for _ in prompts]
    for a, b, prompt in zip(pooled, own, prompts):
        stage.prefill(a, torch.tensor(prompt))
        eager.prefill(b, torch.tensor(prompt))
    pooled[1].release()  # slots 3, 0 and 2 step, in that order, with slot 1 free
    order = [3, 0, 2]
    ids = torch.tensor([5, 6, 7])
    done = len(replays)
    got = stage.decode([pooled[i] for i in order], ids)
    want = eager.decode([own[i] for i in order], ids)
    assert len(replays) == done + 1  # replayed (bucket 4)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert [pooled[i].length for i in order] == [own[i].length for i in order]


def test_a_replay_that_fails_while_serving_leaves_eager_steps_and_the_same_replies(caplog):
    off, _ = run(local_engine(_stage("hf"), kv_tokens=8192), random_prompts(3, 30))
    stage = _stage("hf")
    replays: list[int] = []
    graph_decode(stage, slots=4, positions=64, capture=_counting(replays, fail_after=8), choose=False)
    with caplog.at_level(logging.WARNING, logger="fellow.runtime.model.forms.cuda_graphs"):
        on, _ = run(local_engine(stage, kv_tokens=8192), random_prompts(3, 30))
    assert on == off
    assert len(replays) == 9  # the check's three, five steps, the one that failed; then none
    assert stage.graphed.failed == "RuntimeError: replay failed"
    assert "a replay failed, decode steps are eager from now on" in caplog.text
    assert stage.graphed.take() is None  # new sessions get caches of their own


def test_a_replay_that_does_not_step_fails_the_check_and_the_stage_stays_eager():
    stage = _stage("fused")
    status = graph_decode(stage, slots=2, positions=64, capture=lambda step: (lambda: None))
    assert status["path"] == "eager" and "does not match the eager step" in status["why"]
    assert stage.graphed is None and type(stage.new_cache()) is KVCache


def test_the_load_replays_only_where_the_replayed_step_measured_faster():
    def slow(step):
        def replay():
            time.sleep(0.2)  # a replay far slower than an eager step of this tiny model, even on a loaded machine
            step()
        return replay

    stage = _stage("fused")
    status = graph_decode(stage, slots=3, positions=300, capture=slow, label="fixed-shape")
    assert status["path"] == "eager" and status["why"].startswith("replayed steps measured no faster at batch 1")
    assert set(status["step_ms"]) == {"1", "3"}
    for ms in status["step_ms"].values():
        assert ms["graph_ms"] >= 200 and ms["graph_ms"] > ms["eager_ms"] > 0  # (an eager step took 41 ms on a
        # loaded clean-clone run: the time is the sleep's floor, not a bound on the machine's speed)
    assert stage.graphed is None

    stage = _stage("fused")
    status = graph_decode(stage, slots=3, positions=300, capture=lambda step: step, label="fixed-shape")
    faster = all(ms["graph_ms"] < ms["eager_ms"] for ms in status["step_ms"].values())
    assert status["path"] == ("fixed-shape" if faster else "eager")  # whichever it measured
    assert (stage.graphed is not None) == faster


def test_a_ring_stage_and_a_cpu_stage_without_a_capture_get_no_pool():
    model = _planted(3, 64, 0)
    first = StageModel.from_causal_lm(model, 0, 2)
    assert graph_decode(first, slots=2, capture=lambda step: step)["why"].startswith("a ring stage")
    assert first.graphed is None
    whole = StageModel.from_causal_lm(model)
    assert graph_decode(whole, slots=2) is None and whole.graphed is None  # no CUDA here, nothing to report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("batch", [1, 4])
def test_on_cuda_the_decode_step_replays_a_checked_cuda_graph_and_greedy_replies_equal_generate(batch, caplog):
    model = _planted(3, 64, 0).to("cuda")
    stage = StageModel.from_causal_lm(model)
    with caplog.at_level(logging.INFO, logger="fellow.runtime.model.forms.cuda_graphs"):
        status = graph_decode(stage, slots=4, positions=128)
    assert status["path"] == "cuda-graph", (status, caplog.text)
    assert set(status["step_ms"]) == {"1", "4"}
    sessions = random_prompts(batch, 40)
    replies, _ = run(local_engine(stage, kv_tokens=8192), sessions)
    for session in random_prompts(batch, 40):
        ids = torch.tensor([session.prompt_ids], device="cuda")
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                              generation_config=transformers.GenerationConfig(eos_token_id=None, pad_token_id=0))
        assert replies[session.session_id] == want[0, ids.shape[1]:].tolist()
    assert stage.graphed.failed is None and stage.graphed.decoder.free == {0, 1, 2, 3}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_load_says_in_its_status_whether_its_decode_replays_graphs(tmp_path):
    from events.stage import StageOptions
    from fellow.runtime.model.load.loader import load_one_stage
    from tests.serving_fixtures import make_servable

    _, servable = make_servable(tmp_path, stages=1)
    stage = load_one_stage(servable, "cuda:0", StageOptions(max_batch=4)).stage
    graphs = stage.kernels.cuda_graphs
    assert graphs["path"] == "cuda-graph" and graphs["slots"] == 4 and set(graphs["step_ms"]) == {"1", "4"}, graphs
    assert isinstance(stage.new_cache(), PoolCache)
    off = load_one_stage(servable, "cuda:0", StageOptions(max_batch=4, cuda_graphs=False)).stage
    assert off.kernels.cuda_graphs is None and off.graphed is None
