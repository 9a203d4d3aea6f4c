"""Sessions with the same prompt share one prefill (fellow.runtime.engine.forks): the first runs the prompt,
the others fork from its positions, and each reply is what that session gets alone, sampled or greedy, in
pieces or whole, arriving together or while the first is still in its prompt; the ledger is whole after."""

from __future__ import annotations

import pytest
import torch

from events.requests import Sampling
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.session import Session
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel
from tests.tiny import small_qwen3

VOCAB = 512
KV = 4096


@pytest.fixture(scope="module")
def stage():
    stage = StageModel.from_causal_lm(small_qwen3(VOCAB))
    prepare_stage(stage, batch_cap=8)
    return stage


class Counted:
    """Prompt positions the stage ran (forward_piece, prefill_fresh), counted on the real stage."""

    def __init__(self, stage, monkeypatch):
        self.positions = 0
        piece, fresh = stage.forward_piece, stage.prefill_fresh

        def counted_piece(cache, inputs):
            self.positions += inputs.shape[0]
            return piece(cache, inputs)

        def counted_fresh(caches, pieces):
            self.positions += sum(map(len, pieces))
            return fresh(caches, pieces)

        monkeypatch.setattr(stage, "forward_piece", counted_piece)
        monkeypatch.setattr(stage, "prefill_fresh", counted_fresh)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(stage, joins: dict[int, list[Session]], chunk: int) -> tuple[dict, dict]:
    """Step until idle, adding each step's sessions; (tokens, ended sessions) by id."""
    engine = local_engine(stage, kv_tokens=KV, prefill_chunk=chunk, prefix_cache=False)
    out, ended, step = {}, {}, 0
    while engine.busy or joins:
        for s in joins.pop(step, []):
            engine.add(s)
        result = engine.step()
        for sid, tokens in result.tokens.items():
            out.setdefault(sid, []).extend(tokens)
        ended.update({s.session_id: s for s in result.finished})
        step += 1
    assert engine.budget.free == KV  # every reservation released
    return out, ended


def alone(stage, session: Session, chunk: int) -> list[int]:
    return serve(stage, {0: [session]}, chunk)[0][session.session_id]


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_n_sessions_with_one_prompt_cost_one_prefill_and_reply_as_alone(stage, monkeypatch, chunk, sampling):
    ids, other = prompt(40, 1), prompt(12, 2)

    def params(seed: int) -> Sampling:
        return Sampling(temperature=0.0) if sampling == "greedy" else Sampling(temperature=1.0, top_p=0.9, seed=seed)

    want = {f"c{i}": alone(stage, Session(f"c{i}", ids, 8, params(10 + i)), chunk) for i in range(4)}
    want["o"] = alone(stage, Session("o", other, 8, params(99)), chunk)
    counted = Counted(stage, monkeypatch)
    sessions = [Session(f"c{i}", ids, 8, params(10 + i)) for i in range(4)] + [Session("o", other, 8, params(99))]
    got, ended = serve(stage, {0: sessions}, chunk)
    assert got == want
    assert counted.positions == len(ids) + len(other)  # one prefill of the shared prompt, not four
    assert sorted(sid for sid, s in ended.items() if s.forked) == ["c1", "c2", "c3"]
    assert all(ended[f"c{i}"].timing()["forked"] for i in (1, 2, 3)) and "forked" not in ended["c0"].timing()
    if sampling == "sampled":
        assert len({tuple(t) for sid, t in got.items() if sid != "o"}) > 1  # each choice draws its own


def test_a_session_that_comes_while_the_first_runs_its_prompt_forks_and_one_cancelled_first_hands_over(
        stage, monkeypatch):
    ids = prompt(64, 3)
    want = alone(stage, Session("late", ids, 6, Sampling(temperature=0.0)), 16)
    counted = Counted(stage, monkeypatch)
    got, ended = serve(stage, {0: [Session("first", ids, 6, Sampling(temperature=0.0))],
                               2: [Session("late", ids, 6, Sampling(temperature=0.0))]}, 16)
    assert got["late"] == got["first"] == want and ended["late"].forked
    assert counted.positions == len(ids)
    # the first cancelled in its prompt: the one waiting runs the prompt itself
    engine = local_engine(stage, kv_tokens=KV, prefill_chunk=16, prefix_cache=False)
    engine.add(Session("first", ids, 6, Sampling(temperature=0.0)))
    engine.step()
    engine.add(Session("waits", ids, 6, Sampling(temperature=0.0)))
    engine.step()
    engine.cancel("first", "cancelled")
    tokens: list[int] = []
    while engine.busy:
        tokens += engine.step().tokens.get("waits", [])
    assert tokens == want and engine.budget.free == KV


def test_sessions_that_score_their_prompt_or_end_at_once_do_not_break_the_forks(stage):
    ids = prompt(30, 4)
    scored = Session("scored", ids, 3, Sampling(temperature=0.0, prompt_logprobs=0))
    short = Session("short", ids, 1, Sampling(temperature=0.0))  # its first token ends it (and its cache)
    rest = [Session(f"r{i}", ids, 5, Sampling(temperature=0.0)) for i in range(2)]
    got, ended = serve(stage, {0: [short, scored, *rest]}, 0)
    want = alone(stage, Session("x", ids, 5, Sampling(temperature=0.0)), 0)
    assert got["r0"] == got["r1"] == want and got["short"] == want[:1] and got["scored"] == want[:3]
    assert not ended["scored"].forked and len(ended["scored"].prompt_logprobs) == len(ids)
    assert [ended[s].forked for s in ("short", "r0", "r1")] == [False, True, True]


def test_a_session_that_comes_after_the_first_ran_its_prompt_copies_all_but_the_last_position(stage, monkeypatch):
    """Choices reach a stage as separate requests: a short prompt's prefill is done before the next is in."""
    ids = prompt(24, 6)
    sampled = [Sampling(temperature=1.0, seed=s) for s in (5, 6)]
    want = [alone(stage, Session(f"w{i}", ids, 6, sampled[i]), 16) for i in range(2)]
    counted = Counted(stage, monkeypatch)
    got, ended = serve(stage, {0: [Session("first", ids, 6, sampled[0])],
                               3: [Session("later", ids, 6, sampled[1])]}, 16)
    assert [got["first"], got["later"]] == want and ended["later"].forked and not ended["first"].forked
    assert counted.positions == len(ids) + 1  # the later one ran the prompt's last position only
