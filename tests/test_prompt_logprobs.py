"""The prompt's own logprobs (fellow.runtime.engine.prompt_scores): equal to a teacher-forced HF forward to
1e-4, whatever the prompt pieces, beside other sessions, with the prefix cache on, and on the HF layers; the
first position has none, ranks and candidates agree with the forward, and the reply is what it is without."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from events.requests import Sampling
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.session import Session
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel
from tests.tiny import small_qwen3

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    return small_qwen3(VOCAB)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]


def run(stage, sessions: list[Session], **engine) -> dict[str, list[int]]:
    eng = local_engine(stage, kv_tokens=4096, **engine)
    for s in sessions:
        eng.add(s)
    out: dict[str, list[int]] = {}
    while eng.busy:
        for sid, tokens in eng.step().tokens.items():
            out.setdefault(sid, []).extend(tokens)
    return out


@pytest.mark.parametrize("path", ["fused", "hf"])
@pytest.mark.parametrize("chunk", [0, 7])
def test_prompt_logprobs_equal_a_teacher_forced_forward(model, path, chunk):
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    if path == "fused":
        assert prepare_stage(stage, batch_cap=4).path == "fused"
    ids = prompt(23, 1)
    scored = Session("scored", ids, 6, Sampling(temperature=0.0, prompt_logprobs=3))
    others = [Session(f"other{i}", prompt(9 + i, 10 + i), 6, Sampling(temperature=0.0)) for i in range(2)]
    plain = Session("plain", ids, 6, Sampling(temperature=0.0))
    got = run(stage, [scored, *others], prefill_chunk=chunk, prefix_cache=True)
    alone = run(stage, [plain], prefill_chunk=chunk)
    assert got["scored"] == alone["plain"]  # scoring the prompt leaves the reply as it was
    want = teacher_forced(model, ids)
    entries = scored.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    for p, (token, logprob, best, rank) in enumerate(entries[1:], start=1):
        row = want[p - 1]
        assert token == ids[p]
        assert abs(logprob - float(row[token])) < 1e-4, (p, logprob, float(row[token]))
        assert rank == int((row > row[token]).sum()) + 1
        top = torch.topk(row, 3)
        assert [i for i, _ in best] == top.indices.tolist()
        assert max(abs(lp - float(v)) for (_, lp), v in zip(best, top.values)) < 1e-4
    assert all(not s.prompt_logprobs for s in others)  # only the request that asked


def test_a_scored_prompt_runs_whole_even_where_the_prefix_cache_holds_it(model):
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    ids = prompt(40, 2)
    eng = local_engine(stage, kv_tokens=4096, prefill_chunk=16, prefix_cache=True)
    eng.add(Session("warm", ids, 2, Sampling(temperature=0.0)))
    while eng.busy:
        eng.step()
    scored = Session("scored", ids, 2, Sampling(temperature=0.0, prompt_logprobs=0))
    eng.add(scored)
    while eng.busy:
        eng.step()
    plain = Session("plain", ids, 2, Sampling(temperature=0.0))
    eng.add(plain)
    while eng.busy:
        eng.step()
    assert plain.cached_tokens > 0  # the cache holds the prompt: a request that does not score reuses it
    assert scored.cached_tokens == 0 and len(scored.prompt_logprobs) == len(ids)
    want = teacher_forced(model, ids)
    assert max(abs(e[1] - float(want[p - 1, e[0]])) for p, e in enumerate(scored.prompt_logprobs[1:], 1)) < 1e-4


@pytest.mark.parametrize("stages", [2, 3])
def test_a_rings_last_stage_scores_the_prompt_as_a_teacher_forced_forward(tmp_path, stages):
    """Over a ring the last stage reads every position of each piece the prompt crosses it in, and stage 0
    puts the pieces' logprobs in order; a session beside it that does not ask gets none."""
    from core.servable import load_manifest
    from tests.serving_fixtures import make_servable
    from tests.test_ring_runtime import LocalRing

    hf, servable = make_servable(tmp_path, "tiny", layers=stages * 2, hidden=64, stages=stages)
    whole = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    ids = list(range(5, 34))  # several pieces of prefill_chunk 8
    ring = LocalRing(servable, stages, prefill_chunk=8)
    try:
        scored = Session("scored", ids, 4, Sampling(temperature=0.0, prompt_logprobs=2))
        other = Session("other", list(range(40, 55)), 4, Sampling(temperature=0.0))
        ring.head.add(scored)
        ring.head.add(other)
        ended = {}
        while ring.head.busy:  # the head serves its own RingSession for each: read them as they end
            ended.update({s.session_id: s for s in ring.head.step().finished})
    finally:
        ring.close()
    scored, other = ended["scored"], ended["other"]
    # the teacher-forced forward of what the ring computes: hidden states cross each boundary as float16
    hooked: list[int] = []
    for start, _ in load_manifest(servable).boundaries[1:]:
        hooked.append(start)
        whole.model.layers[start].register_forward_pre_hook(_through_float16, with_kwargs=True)
    want = teacher_forced(whole, ids)
    assert len(hooked) == stages - 1 and _through_float16.calls >= stages - 1
    entries = scored.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None and not other.prompt_logprobs
    errors = [abs(lp - float(want[p - 1, token])) for p, (token, lp, _, _) in enumerate(entries[1:], start=1)]
    worst = max(range(len(errors)), key=errors.__getitem__)
    print(f"\n{stages} stages: max prompt logprob error {errors[worst]:.2e} against the float16-boundary forward")
    assert [e[0] for e in entries[1:]] == ids[1:] and max(errors) < 1e-4, (errors[worst], entries[worst + 1][1])
    assert all([i for i, _ in e[2]] == torch.topk(want[p - 1], 2).indices.tolist()
               for p, e in enumerate(entries[1:], start=1))


def _through_float16(module, args, kwargs):
    """A layer's input as it arrives over a ring boundary (fellow.runtime.ring.codec: float16 on the wire)."""
    _through_float16.calls += 1
    if args:
        return (args[0].half().float(), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": kwargs["hidden_states"].half().float()}


_through_float16.calls = 0
