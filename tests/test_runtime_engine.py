"""The one-stage engine: batched sessions get what they would alone, cancel frees, admission waits by tokens."""

import threading

import pytest
import torch
import transformers

from events.requests import Sampling
from fellow.runtime.engine.budget import AdmissionFailed, ContextTooLong
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.scheduler import Scheduler
from fellow.runtime.engine.serving_loop import Job, ServingLoop
from fellow.runtime.engine.session import Session
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.load.packed_linear import pack_stage
from fellow.runtime.model.stage import StageModel

VOCAB = 512
GREEDY = Sampling(temperature=0.0)
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")])


@pytest.fixture(scope="module", params=["cpu", "cpu-packed", "cpu-fused", CUDA])
def stage(request) -> StageModel:
    """The engine's stage as the fellow serves it: on CPU float32 fused with measured kernels, and the
    HF layers plain and packed."""
    config = transformers.Qwen3Config(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB)
    torch.manual_seed(0)
    device, _, packed = request.param.partition("-")
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to(device)
    stage = StageModel.from_causal_lm(model)
    if packed == "packed":
        assert pack_stage(stage) == 3 * 7 + 1  # q k v o, gate up down per layer, and the head
    elif packed == "fused":
        assert prepare_stage(stage).path == "fused"
    return stage


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def drain(engine: Scheduler, outputs: dict, finished: dict, joins: dict | None = None, batch_sizes=None) -> None:
    """Step until idle, adding the sessions in ``joins`` (step number -> sessions) as their step comes."""
    joins = dict(joins or {})
    step = 0
    while engine.busy or joins:
        for session in joins.pop(step, []):
            engine.add(session)
        result = engine.step()
        for session_id, tokens in result.tokens.items():
            outputs.setdefault(session_id, []).extend(tokens)
        finished.update({s.session_id: s.finish_reason for s in result.finished})
        if batch_sizes is not None:
            batch_sizes.extend(engine.last_batches)
        step += 1


def alone(stage: StageModel, session: Session) -> list[int]:
    outputs, finished = {}, {}
    engine = local_engine(stage, kv_tokens=4096)
    engine.add(Session(session.session_id, session.prompt_ids, session.max_new_tokens, session.sampling))
    drain(engine, outputs, finished)
    assert finished == {session.session_id: "length"}
    return outputs[session.session_id]


def four_sessions(sampled: bool) -> list[Session]:
    lengths, news = (5, 31, 12, 47), (30, 22, 35, 26)
    return [Session(f"s{i}", prompt(n, seed=i), new,
                    Sampling(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i) if sampled else GREEDY)
            for i, (n, new) in enumerate(zip(lengths, news))]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("max_batch", [0, 2])
def test_batched_sessions_get_what_they_get_alone(stage, sampled, max_batch):
    sessions = four_sessions(sampled)
    expected = {s.session_id: alone(stage, s) for s in sessions}
    engine = local_engine(stage, kv_tokens=4096, max_batch=max_batch, prefill_chunk=16)
    outputs, finished, batch_sizes = {}, {}, []
    drain(engine, outputs, finished, joins={0: sessions[:1], 3: sessions[1:3], 9: sessions[3:]},
          batch_sizes=batch_sizes)
    assert outputs == expected
    assert finished == {s.session_id: "length" for s in sessions}
    assert max(batch_sizes) == (max_batch or 4)
    assert engine.stats()["reserved_tokens"] == 0 and engine.stats()["in_flight"] == 0


def test_the_step_that_ends_a_prompt_hands_out_its_first_token_before_any_decode(stage):
    """The first token goes out with the prompt's step: the session decodes from the next step on (as
    vLLM and llama.cpp's server step), so its first token never waits for a decode pass. Sessions
    already decoding keep decoding in that step."""
    engine = local_engine(stage, kv_tokens=4096)
    engine.add(Session("a", prompt(7, seed=1), 5, GREEDY))
    first = engine.step()
    assert {k: len(v) for k, v in first.tokens.items()} == {"a": 1}
    engine.add(Session("b", prompt(9, seed=2), 5, GREEDY))
    joined = engine.step()
    assert {k: len(v) for k, v in joined.tokens.items()} == {"a": 1, "b": 1}
    assert engine.last_batches == [1]  # a decoded; b's prompt ran and gave its first token
    both = engine.step()
    assert {k: len(v) for k, v in both.tokens.items()} == {"a": 1, "b": 1} and engine.last_batches == [2]


def test_stop_id_ends_the_session_without_showing_it(stage):
    ids = prompt(9, seed=7)
    free_run = alone(stage, Session("s", ids, 12, GREEDY))
    stop = free_run[5]
    engine = local_engine(stage, kv_tokens=4096)
    engine.add(Session("s", ids, 12, GREEDY, stop_ids={stop}))
    outputs, finished = {}, {}
    drain(engine, outputs, finished)
    assert finished == {"s": "stop"}
    assert outputs["s"] == free_run[: free_run.index(stop)]


def test_cancel_frees_the_cache_and_the_reservation(stage):
    engine = local_engine(stage, kv_tokens=4096)
    keep, drop = Session("keep", prompt(10, 1), 20, GREEDY), Session("drop", prompt(30, 2), 40, GREEDY)
    engine.add(keep)
    engine.add(drop)
    outputs = {}
    for _ in range(3):
        for session_id, tokens in engine.step().tokens.items():
            outputs.setdefault(session_id, []).extend(tokens)
    assert engine.stats()["reserved_tokens"] == 30 + 70
    cache = drop.cache
    assert cache.length > 30 and cache.bytes > 0
    engine.cancel("drop")
    result = engine.step()
    assert [(s.session_id, s.finish_reason) for s in result.finished] == [("drop", "cancelled")]
    assert drop.cache is None and cache.bytes == 0 and cache.keys == [None] * len(cache.groups)
    assert engine.stats()["reserved_tokens"] == 30 and engine.stats()["in_flight"] == 1
    finished = {}
    outputs["keep"] += result.tokens.get("keep", [])
    drain(engine, outputs, finished)
    assert outputs["keep"] == alone(stage, keep)


def test_admission_waits_for_tokens_and_refuses_what_never_fits(stage):
    engine = local_engine(stage, kv_tokens=100, prefill_chunk=8)
    first, second = Session("a", prompt(20, 3), 40, GREEDY), Session("b", prompt(25, 4), 35, GREEDY)
    assert engine.can_admit(60)
    engine.add(first)
    engine.add(second)
    assert not engine.can_admit(1)  # both wait in line: 120 tokens asked of 100
    engine.step()
    assert engine.stats()["in_flight"] == 1 and engine.stats()["waiting"] == 1
    assert not engine.can_admit(60)  # 100 - 60 reserved by a, and b is ahead in line
    admitted_b_at = None
    steps = 0
    while engine.busy:
        result = engine.step()
        steps += 1
        if any(s.session_id == "a" for s in result.finished):
            assert engine.can_admit(40)  # b's 60 wait their turn; a's 60 came back
        if admitted_b_at is None and "b" in engine.sessions:
            admitted_b_at = steps
            assert first.finish_reason == "length"
    assert engine.can_admit(100) and not engine.can_admit(101)
    with pytest.raises(ContextTooLong) as refused:
        engine.add(Session("big", prompt(61, 5), 40, GREEDY))
    assert refused.value.needed == 101 and refused.value.kv_tokens == 100
    assert "needs 101 tokens" in str(refused.value) and "holds 100" in str(refused.value)
    assert refused.value.code == "context_too_long"


def test_a_batch_stops_growing_where_its_padded_copy_would_pass_the_budget(stage):
    """HF layers copy a batch's pasts into one padded buffer; fused layers copy nothing, so they batch."""
    sessions = [Session(f"s{i}", prompt(100, seed=20 + i), 20, GREEDY) for i in range(2)]
    expected = {s.session_id: alone(stage, s) for s in sessions}
    tight = 2 if stage.fused is not None else 1
    for kv_tokens, widest in ((4096, 2), (250, tight)):  # 250: 240 reserved, too little room to pad two rows
        engine = local_engine(stage, kv_tokens=kv_tokens, prefill_chunk=8)
        outputs, finished, batch_sizes = {}, {}, []
        drain(engine, outputs, finished, joins={0: [Session(s.session_id, s.prompt_ids, 20, GREEDY)
                                                    for s in sessions]}, batch_sizes=batch_sizes)
        assert outputs == expected and max(batch_sizes) == widest


@pytest.mark.parametrize("reserved", [False, True])
def test_a_failing_admission_fails_that_session_alone_and_gives_its_tokens_back(stage, reserved):
    """A seed past 2**64 makes torch's generator raise while the session is admitted (issue 21, item 2)."""
    engine = local_engine(stage, kv_tokens=4096)
    bad = Session("bad", prompt(12, 6), 30, Sampling(temperature=0.8, seed=2**64))
    good = [Session(f"good{i}", prompt(10 + i, 7 + i), 12, GREEDY) for i in range(2)]
    for session in [good[0], bad, good[1]]:  # admitted in one step, batched together
        if reserved:  # as the stage's intake does: tokens offered to the scheduler first
            assert engine.offer(session.session_id, len(session.prompt_ids), session.max_new_tokens)
        engine.add(session)
    outputs, finished = {}, {}
    drain(engine, outputs, finished)
    assert finished == {"bad": "error", "good0": "length", "good1": "length"}
    assert isinstance(bad.error, AdmissionFailed) and isinstance(bad.error.__cause__, ValueError)
    assert bad.error.code == "admission_failed" and bad.cache is None and "bad" not in outputs
    assert engine.budget.reserved == 0 and engine.stats()["in_flight"] == 0
    for session in good:
        assert outputs[session.session_id] == alone(stage, session)


def test_a_job_the_engine_refuses_gives_its_reserved_tokens_back(stage):
    """The intake takes a request's tokens from the ledger before the engine sees it: a refusal returns them."""
    engine = local_engine(stage, kv_tokens=4096)
    outputs, delivered = [], threading.Event()

    def deliver(outs):
        outputs.extend(outs)
        delivered.set()

    loop = ServingLoop(engine, tokenizer=None, stop_ids=frozenset(), deliver=deliver)
    loop.start()
    try:
        assert engine.offer("empty", 12, 0)
        loop.submit(Job("empty", prompt(12, 9), 0, GREEDY))  # max_new_tokens 0: Session refuses
        assert delivered.wait(10)
    finally:
        loop.stop()
        loop.thread.join(10)
    assert [(o.request_id, type(o.error)) for o in outputs] == [("empty", ValueError)]
    assert engine.budget.reserved == 0
