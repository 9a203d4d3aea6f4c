"""Speculative decoding on one stage: prompt lookup's drafts checked in one pass, exactly.

The model is a random one with a bigram table of a text planted in it (tests/copying.py), so that
it copies its prompt in runs: drafts then both stand and fall.
"""

import msgspec
import pytest
import torch
import transformers

from events.requests import Sampling
from fellow.runtime.engine.drafting import FAILED_PASSES, PAUSE_PASSES, DraftGuard, PromptLookup, check_speculative
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.scheduler import Scheduler
from fellow.runtime.engine.session import Session
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel
from tests.copying import plant_bigrams

VOCAB = 512
GREEDY = Sampling(temperature=0.0)


def _text(seed: int = 1) -> list[int]:
    """Phrases of 6 tokens strung in a random order: a token's successor depends on its phrase's."""
    generator = torch.Generator().manual_seed(seed)
    phrases = [torch.randint(0, VOCAB, (6,), generator=generator).tolist() for _ in range(8)]
    return [t for i in torch.randint(0, 8, (30,), generator=generator).tolist() for t in phrases[i]]


TEXT = _text()


@pytest.fixture(scope="module", params=["hf", "fused"])
def stage(request) -> StageModel:
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plant_bigrams(model, TEXT)
    stage = StageModel.from_causal_lm(model)
    if request.param == "fused":
        assert prepare_stage(stage).path == "fused"
    return stage


def run(engine: Scheduler, sessions: list[Session], on_step=None) -> tuple[dict, dict]:
    for session in sessions:
        engine.add(session)
    outputs, finished = {}, {}
    while engine.busy:
        result = engine.step()
        for session_id, tokens in result.tokens.items():
            outputs.setdefault(session_id, []).extend(tokens)
        finished.update({s.session_id: s for s in result.finished})
        if on_step is not None:
            on_step(engine)
    return outputs, finished


def copying(n: int, new: int, sampling=GREEDY, prefix: str = "c") -> list[Session]:
    return [Session(f"{prefix}{i}", TEXT[: 57 + 3 * i], new, sampling) for i in range(n)]


def random_prompts(n: int, new: int) -> list[Session]:
    generator = torch.Generator().manual_seed(7)
    return [Session(f"r{i}", torch.randint(0, VOCAB, (9 + i,), generator=generator).tolist(), new, GREEDY)
            for i in range(n)]


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    lookup = PromptLookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    assert lookup.draft(3) == [7, 8, 5]  # the tail 1 2 3 last came before 7 8 5
    lookup.extend([4])
    assert lookup.draft(3) == []  # 3 4, 2 3 4, 1 2 3 4: never seen
    loop = PromptLookup([6, 5, 6, 5])
    assert loop.draft(5) == [6, 5, 6, 5, 6]  # a repeating tail is drafted as repeating on
    assert PromptLookup([4, 4]).draft(2) == []  # nothing earlier than the tail itself
    longest = PromptLookup([0, 8, 3, 1, 7, 8, 3, 2, 9, 8, 3])
    assert longest.draft(1) == [2]  # the 2-gram 8 3's latest occurrence
    for bad in (-1, 9, 2.0, True):
        with pytest.raises(ValueError, match="speculative"):
            check_speculative(bad)


def test_greedy_with_drafts_equals_without_token_for_token_batched_with_sessions_that_do_not_draft(stage):
    sessions = lambda: copying(3, 40) + random_prompts(2, 12)  # noqa: E731
    off, off_ends = run(local_engine(stage, kv_tokens=4096), sessions())
    mixed_passes = []

    def watch(engine):
        drafting = [s for s in engine.sessions.values() if s.spec_passes]
        if drafting and any(not s.spec_drafted for s in engine.sessions.values() if not s.prefilling):
            mixed_passes.append(len(engine.sessions))

    on, on_ends = run(local_engine(stage, kv_tokens=4096, speculative=4), sessions(), watch)
    assert on == off
    assert {k: s.finish_reason for k, s in on_ends.items()} == {k: s.finish_reason for k, s in off_ends.items()}
    drafted = sum(on_ends[f"c{i}"].spec_drafted for i in range(3))
    accepted = sum(on_ends[f"c{i}"].spec_accepted for i in range(3))
    assert 0 < accepted < drafted  # drafts both stood and fell
    assert all(on_ends[f"c{i}"].spec_passes < 39 for i in range(3))  # fewer passes than tokens
    assert all(on_ends[f"r{i}"].spec_drafted == 0 for i in range(2))
    assert mixed_passes  # sessions with and without drafts shared a pass
    timing = on_ends["c0"].timing()
    assert timing["spec_k"] == 4 and timing["spec_tokens"] == on_ends["c0"].spec_tokens > timing["spec_passes"]
    assert "spec_k" not in off_ends["c0"].timing()


def test_processors_and_logprobs_see_each_drafted_position_as_if_sampled_one_by_one(stage):
    params = Sampling(temperature=0.0, frequency_penalty=0.6, presence_penalty=0.3,
                            repetition_penalty=1.2, logit_bias={TEXT[3]: 2.5}, logprobs=2)
    sessions = lambda: copying(2, 30, params)  # noqa: E731
    off, off_ends = run(local_engine(stage, kv_tokens=4096), sessions())
    on, on_ends = run(local_engine(stage, kv_tokens=4096, speculative=4), sessions())
    assert on == off
    assert sum(s.spec_accepted for s in on_ends.values()) > 0
    for key in off_ends:
        for (t1, lp1, top1), (t2, lp2, top2) in zip(off_ends[key].logprobs, on_ends[key].logprobs, strict=True):
            assert t1 == t2 and lp1 == pytest.approx(lp2, abs=1e-4)
            assert [i for i, _ in top1] == [i for i, _ in top2]


def _chi_square_p(a: dict, b: dict) -> float:
    """p-value of a chi-square test that two samples of outcomes come from one distribution (cells
    expected under 5 pooled)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    cells = sorted(set(a) | set(b), key=lambda c: -(a.get(c, 0) + b.get(c, 0)))
    table, rare = [], [0, 0]
    for cell in cells:
        row = [a.get(cell, 0), b.get(cell, 0)]
        if min(sum(row) * total_a, sum(row) * total_b) / (total_a + total_b) < 5:
            rare = [rare[0] + row[0], rare[1] + row[1]]
        else:
            table.append(row)
    if sum(rare):
        table.append(rare)
    n = total_a + total_b
    stat = 0.0
    for row in table:
        for count, total in zip(row, (total_a, total_b)):
            expected = sum(row) * total / n
            stat += (count - expected) ** 2 / expected
    df = len(table) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("params", [Sampling(temperature=1.0),
                                    Sampling(temperature=0.8, top_k=3, top_p=0.95, min_p=0.05,
                                                   frequency_penalty=0.5)],
                         ids=["plain", "filtered-penalised"])
def test_sampled_replies_keep_their_distribution(params):
    """The first four tokens of 2,000 seeded replies with drafts against 2,000 without: a chi-square
    test of one distribution at significance 0.001 (seeds fixed, so the outcome is too)."""
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(4)
    alphabet = torch.randperm(VOCAB, generator=generator)[:3].tolist()
    text = [alphabet[i] for i in torch.randint(0, 3, (90,), generator=generator).tolist()]
    plant_bigrams(model, text)  # after each of 3 tokens, each of them in proportion to the text's pairs
    stage = StageModel.from_causal_lm(model)
    prepare_stage(stage)
    draws = 2000

    def sample(speculative: int, seed0: int) -> tuple[dict, list[Session]]:
        engine = local_engine(stage, kv_tokens=draws * 64, prefill_chunk=0, prefix_cache=False, speculative=speculative)
        sessions = [Session(f"s{i}", text[:24], 4, _seeded(params, seed0 + i)) for i in range(draws)]
        outputs, ends = run(engine, sessions)
        counts: dict = {}
        for session in sessions:
            key = tuple(outputs.get(session.session_id, []))
            counts[key] = counts.get(key, 0) + 1
        return counts, list(ends.values())

    without, _ = sample(0, 0)
    with_drafts, ends = sample(3, 10_000)
    assert sum(s.spec_accepted for s in ends) > draws // 4  # drafts stood ...
    assert sum(s.spec_drafted - s.spec_accepted for s in ends) > draws // 4  # ... and fell
    assert _chi_square_p(without, with_drafts) > 0.001
    # the test can tell two distributions apart: the same draws one token shorter are another
    shifted = {}
    for key, count in with_drafts.items():
        shifted[key[1:] + key[:1]] = shifted.get(key[1:] + key[:1], 0) + count
    assert _chi_square_p(without, shifted) < 0.001


def _seeded(params: Sampling, seed: int) -> Sampling:
    return msgspec.structs.replace(params, seed=seed)


def test_a_seeded_sampled_reply_with_drafts_repeats_itself(stage):
    params = Sampling(temperature=0.9, seed=5)
    first, _ = run(local_engine(stage, kv_tokens=4096, speculative=4), copying(2, 30, params))
    again, ends = run(local_engine(stage, kv_tokens=4096, speculative=4), copying(2, 30, params))
    assert first == again and sum(s.spec_passes for s in ends.values()) > 0


def test_draft_guard_stops_drafting_for_16_passes_and_resumes():
    guard = DraftGuard(8)
    assert guard.allows() and guard.limit == 8
    guard.record(drafted=3, accepted=3)
    assert guard.limit == 6  # all stood: twice as many next time
    guard.record(drafted=6, accepted=6)
    assert guard.limit == 8  # never above k
    guard.record(drafted=3, accepted=1)
    assert guard.limit == 2  # one more than stood
    for _ in range(FAILED_PASSES - 1):
        guard.record(drafted=3, accepted=0)
    assert guard.allows() and guard.pauses == 0  # not yet: a draft stood before these
    guard.record(drafted=3, accepted=0)
    assert guard.pauses == 1
    assert [guard.allows() for _ in range(PAUSE_PASSES)] == [False] * PAUSE_PASSES
    assert guard.allows()
    guard.record(drafted=0, accepted=0)  # a pass without drafts counts neither way
    assert guard.failures == 0


def test_a_session_whose_drafts_keep_failing_pauses_then_drafts_again():
    """A model that walks a chain of distinct tokens, and a prompt in which every pair of the chain
    was followed by another token: each pass drafts, each draft falls, drafting pauses for 16 passes
    and then drafts again."""
    chain = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:60].tolist()
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plant_bigrams(model, chain)
    prompt = [t for i in range(50) for t in (chain[i], chain[i + 1], chain[i + 5])] + chain[:2]
    history: list[int] = []  # per step: the drafts so far

    def watch(engine):
        session = engine.sessions.get("g")
        if session is not None and not session.prefilling:
            history.append(session.spec_drafted)

    session = Session("g", prompt, 45, GREEDY)
    outputs, _ = run(local_engine(StageModel.from_causal_lm(model), kv_tokens=4096, speculative=4), [session], watch)
    assert outputs["g"] == chain[2:47]  # the model walks the chain
    assert session.spec_accepted == 0 and session.guard.pauses >= 2
    passes = "".join("d" if b > a else "." for a, b in zip(history, history[1:]))
    assert "d" * FAILED_PASSES + "." * PAUSE_PASSES + "d" in passes


def test_the_budget_never_over_commits_with_drafts_in_flight(stage):
    """Reservations fill the budget exactly; with k = 8 no cache ever holds more than its
    reservation, and all of them together never more than the budget."""
    sessions = copying(3, 25) + [Session("short", TEXT[:30], 2, GREEDY)]
    kv_tokens = sum(s.reserved_tokens for s in sessions)
    seen = []

    def watch(engine):
        caches = [(s, s.cache.length) for s in engine.sessions.values() if s.cache is not None]
        assert all(length <= s.reserved_tokens for s, length in caches)
        total = sum(length for _, length in caches) + engine.prefix.tokens
        assert total <= engine.budget.reserved + engine.prefix.tokens <= kv_tokens
        seen.append(total)

    outputs, ends = run(local_engine(stage, kv_tokens=kv_tokens, speculative=8), sessions, watch)
    assert {k: s.finish_reason for k, s in ends.items()} == {s.session_id: "length" for s in sessions}
    assert sum(s.spec_accepted for s in ends.values()) > 0
    assert ends["short"].spec_drafted <= 1  # a reply of 2 tokens drafts at most 1 after its first


def test_a_session_cancelled_after_a_verify_pass_leaves_no_cache_and_no_drafts_behind(stage):
    engine = local_engine(stage, kv_tokens=4096, speculative=4)
    session = copying(1, 40)[0]
    engine.add(session)
    while not session.spec_passes or session.spec_accepted == session.spec_drafted:
        engine.step()  # until a pass in which a draft fell: its positions were written, then cropped
    assert session.cache.length == len(session.prompt_ids) + len(session.output_ids) - 1
    engine.cancel(session.session_id)
    result = engine.step()
    assert [s.finish_reason for s in result.finished] == ["cancelled"]
    assert session.cache is None and engine.budget.reserved == 0 and not engine.sessions
    kept = [t for block in engine.prefix.blocks.values() for t in block.tokens]
    ids = session.prompt_ids + session.output_ids
    assert engine.prefix.tokens == len(ids) - 1 and kept == ids[: len(kept)]  # no fallen draft kept


def test_a_stop_string_inside_a_pass_ends_the_reply_there_and_counts_only_what_was_sent():
    """A verify pass can gain several tokens past a stop string: the reply ends at the string and
    its completion_tokens count the ids sent, not the ones gained after it."""
    import threading

    from fellow.runtime.engine.serving_loop import Job, ServingLoop
    from tests.tiny import _tokenizer

    tok = _tokenizer()
    ids = tok("abcdefghijklmnopqrstuvwxyz" * 4, add_special_tokens=False)["input_ids"]  # each id's successor is one
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=128, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plant_bigrams(model, ids)
    engine = local_engine(StageModel.from_causal_lm(model), kv_tokens=4096, speculative=8)
    outputs, done = [], threading.Event()

    def deliver(batch):
        outputs.extend(batch)
        if any(o.finish_reason for o in batch):
            done.set()

    loop = ServingLoop(engine, tok, frozenset(), deliver)
    loop.start()
    try:
        loop.submit(Job("j", ids, 40, GREEDY, stop=["mno"]))
        assert done.wait(60)
    finally:
        loop.stop()
    text = "".join(t for o in outputs for t in o.texts)
    sent = [i for o in outputs for i in o.ids]
    end = outputs[-1]
    assert end.finish_reason == "stop" and text == "abcdefghijkl", text
    assert end.completion_tokens == len(sent) and end.timing["spec_accepted"] > 0
    assert end.timing["spec_tokens"] > end.timing["spec_passes"]


def test_a_grammar_row_drafts_nothing_and_keeps_its_grammar_beside_drafting_rows(stage):
    import json

    from llguidance import LLMatcher

    from fellow.runtime.engine.processors import constraint_for
    from tests.tiny import _tokenizer

    tok = _tokenizer()  # 384 ids: the model's other 128 are barred for the constrained row
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    bound = Session("g", TEXT[:40], 40, Sampling(temperature=0.0, grammar=grammar), stop_ids=frozenset({stop}))
    bound.constraint = constraint_for(tok, grammar, frozenset({stop}))
    outputs, ends = run(local_engine(stage, kv_tokens=4096, speculative=4), copying(2, 24) + [bound])
    assert ends["g"].finish_reason == "stop" and ends["g"].spec_drafted == 0
    assert set(json.loads(tok.decode(ends["g"].output_ids))) == {"n", "ok"}
    assert sum(ends[f"c{i}"].spec_drafted for i in range(2)) > 0  # the rows beside it did draft
