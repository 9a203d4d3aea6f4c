"""Logits processors and logprobs, checked on the logits; then the same over a 2-stage ring."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from events.requests import Sampling
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.processors import MIN_LOGPROB, logprob_of, processed, sample_next
from fellow.runtime.engine.session import Session
from fellow.runtime.model.load.loader import load_one_stage
from tests.serving_fixtures import make_servable
from tests.test_ring_runtime import LocalRing

V = 12


@dataclass
class Row:
    sampling: Sampling
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    pending_logprob: tuple | None = None


def _logits() -> torch.Tensor:
    return torch.linspace(-3.0, 3.0, V)[None]  # both signs, so the repetition penalty shows both ways


def test_presence_and_frequency_penalties_subtract_per_output_token():
    row = Row(Sampling(presence_penalty=0.5, frequency_penalty=0.25), prompt_ids=[1], output_ids=[2, 2, 2, 5])
    got = processed(_logits(), [row])[0]
    expected = _logits()[0].clone()
    expected[2] -= 3 * 0.25 + 0.5
    expected[5] -= 0.25 + 0.5  # the prompt's token 1 is left alone (OpenAI counts the output only)
    assert torch.allclose(got, expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    row = Row(Sampling(repetition_penalty=2.0), prompt_ids=[0], output_ids=[11])
    got, base = processed(_logits(), [row])[0], _logits()[0]
    assert got[0] == base[0] * 2.0 and base[0] < 0  # more negative
    assert got[11] == base[11] / 2.0 and base[11] > 0
    assert torch.equal(got[1:11], base[1:11])


def test_logit_bias_adds_and_min_tokens_bars_the_stop_ids_until_reached():
    params = Sampling(temperature=0.0, logit_bias={3: 100.0, 4: -1.0}, min_tokens=2)
    row = Row(params, output_ids=[3], stop_ids=frozenset({3}))
    got = processed(_logits(), [row])[0]
    assert got[3] == float("-inf") and got[4] == _logits()[0, 4] - 1.0
    assert sample_next(_logits(), [row]) == [V - 1]  # the stop id, biased to the top, is barred
    row.output_ids.append(7)
    assert sample_next(_logits(), [row]) == [3]  # two tokens came: the bias wins


def test_rows_without_processors_keep_their_logits_and_rows_do_not_mix():
    plain, penalised = Row(Sampling()), Row(Sampling(frequency_penalty=1.0), output_ids=[0])
    logits = torch.cat([_logits(), _logits()])
    assert processed(logits[:1], [plain]) is logits[:1] or torch.equal(processed(logits[:1], [plain]), logits[:1])
    got = processed(logits, [plain, penalised])
    assert torch.equal(got[0], logits[0]) and got[1, 0] == logits[1, 0] - 1.0


def test_logprobs_are_the_processed_log_softmax_over_the_temperature():
    row = Row(Sampling(temperature=0.5, frequency_penalty=1.0, logprobs=3, seed=1), output_ids=[11])
    row.generator = torch.Generator().manual_seed(1)
    token = sample_next(_logits(), [row])[0]
    expected = torch.log_softmax(processed(_logits(), [row])[0] / 0.5, dim=-1)
    got_token, logprob, best = row.pending_logprob
    assert got_token == token and abs(logprob - float(expected[token])) < 1e-6
    assert [i for i, _ in best] == expected.topk(3).indices.tolist()
    assert all(abs(lp - float(expected[i])) < 1e-6 for i, lp in best)
    _, barred, _ = logprob_of(torch.tensor([0.0, float("-inf")]), 1, 0.0, 0)
    assert barred == MIN_LOGPROB


def test_the_session_keeps_one_logprob_per_output_token():
    session = Session("s", [1, 2], 3, sampling=Sampling(temperature=0.0, logprobs=0), stop_ids={0})
    session.pending_logprob = (5, -0.1, [])
    session.accept(5, 0.0)
    session.pending_logprob = (0, -0.2, [])
    assert session.accept(0, 0.0) and session.output_ids == [5] and session.logprobs == [(5, -0.1, [])]


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    torch.set_num_threads(1)
    _, servable = make_servable(tmp_path_factory.mktemp("proc"), "tiny2", layers=2, hidden=64, stages=2)
    return servable


PENALISED = {
    "a": Sampling(temperature=0.0, logprobs=5, frequency_penalty=1.5, presence_penalty=0.5),
    "b": Sampling(temperature=0.8, seed=3, logprobs=2, repetition_penalty=1.3, logit_bias={9: 2.0},
                        min_tokens=4),
}


def _run(engine, sessions: dict[str, Session]) -> dict[str, tuple[list[int], list[tuple]]]:
    for session in sessions.values():
        engine.add(session)
    ended = {}
    while engine.busy:
        for session in engine.step().finished:
            ended[session.session_id] = (session.output_ids, session.logprobs)
    return ended


def test_a_two_stage_ring_applies_the_processors_and_logprobs_as_one_stage_does(two_stages):
    prompts = {"a": [5, 6, 7, 5, 6, 7], "b": list(range(20, 31))}

    def sessions():
        return {sid: Session(sid, prompts[sid], 10, sampling=p, stop_ids={1, 2}) for sid, p in PENALISED.items()}

    expected = _run(local_engine(load_one_stage(two_stages, "cpu").stage, kv_tokens=4096), sessions())
    ring = LocalRing(two_stages, 2, prefill_chunk=4)
    try:
        got = _run(ring.head, sessions())
    finally:
        ring.close()
    for sid in PENALISED:
        (ids, logprobs), (want_ids, want_logprobs) = got[sid], expected[sid]
        assert ids == want_ids and len(logprobs) == len(ids) and ids
        for (token, lp, best), (want_token, want_lp, want_best) in zip(logprobs, want_logprobs):
            assert token == want_token and abs(lp - want_lp) < 1e-2  # the boundary carries 16-bit hidden states
            assert [i for i, _ in best] == [i for i, _ in want_best] and len(best) == PENALISED[sid].logprobs


def test_a_grammar_masks_its_row_only_and_advances_with_each_drawn_token():
    """A constrained row beside a free one in one batch: only its logits are masked, and greedy decoding
    under the mask spells a value of the schema, then the stop id."""
    import json

    from llguidance import LLMatcher

    from fellow.runtime.engine.processors import constraint_for
    from tests.tiny import _tokenizer

    tok = _tokenizer()
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    grammar = LLMatcher.grammar_from_json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                  "required": ["ok"], "additionalProperties": False},
                                                 defaults={"whitespace_flexible": False})
    bound = Row(Sampling(temperature=0.0, grammar=grammar), stop_ids=frozenset({stop}))
    bound.constraint = constraint_for(tok, grammar, frozenset({stop}))
    free = Row(Sampling(temperature=0.0))
    free.constraint = None
    vocab = len(tok) + 6  # a model's head may be wider than its tokenizer: those ids are barred too
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    out = processed(logits, [bound, free])
    assert torch.equal(out[1], logits[1].float())  # the free row is untouched
    allowed = (out[0] > float("-inf")).nonzero()[:, 0].tolist()
    assert allowed and all(tok.decode([t]).startswith("{") or "{".startswith(tok.decode([t])) for t in allowed)
    assert torch.equal(out[0][allowed], logits[0][allowed].float())
    tokens = []
    for _ in range(20):
        token = sample_next(torch.randn(2, vocab, generator=torch.Generator().manual_seed(len(tokens))),
                            [bound, free])[0]
        if token == stop:
            break
        tokens.append(token)
        bound.output_ids.append(token)
    assert json.loads(tok.decode(tokens)) in ({"ok": True}, {"ok": False}) and token == stop


def test_a_replayed_reply_resumes_its_grammar_where_it_stood():
    """A ring's last stage rebuilds a replayed session's grammar past the reply so far: the same mask as
    a grammar that took those tokens one by one; ids that leave the grammar are refused."""
    from llguidance import LLMatcher

    from fellow.runtime.engine.processors import allowed_tokens, constraint_for
    from tests.tiny import _tokenizer

    tok = _tokenizer()
    stops = frozenset({tok.convert_tokens_to_ids("<|im_end|>")})
    grammar = LLMatcher.grammar_from_json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                  "required": ["ok"]}, defaults={"whitespace_flexible": False})
    so_far = tok.encode('{"ok":', add_special_tokens=False)
    stepped = constraint_for(tok, grammar, stops)
    for token in so_far:
        stepped.take(token)
    replayed = constraint_for(tok, grammar, stops, so_far)
    masks = allowed_tokens([stepped, replayed], len(tok))
    assert torch.equal(masks[0], masks[1]) and 0 < int(masks[0].sum()) < len(tok)
    with pytest.raises(ValueError, match="left it"):
        constraint_for(tok, grammar, stops, tok.encode("hello", add_special_tokens=False))
