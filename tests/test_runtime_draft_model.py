"""Speculative decoding with a draft model beside a one-stage engine (the spec's TS9).

The served model is test_runtime_speculative's: random layers with a bigram table of a text planted
in it. The draft is a smaller random model with the same table, so its greedy guesses mostly stand
and sometimes fall; the served model itself as its own draft gives acceptance 1.
"""

import pytest
import torch
import transformers

from events.requests import Sampling
from fellow.runtime.engine.draft_model import DraftModel, DraftModelMismatch, check_same_vocabulary, load_draft_model
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.session import Session
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.load.loader import load_one_stage
from fellow.runtime.model.stage import StageModel
from tests.copying import plant_bigrams
from tests.test_runtime_speculative import GREEDY, TEXT, VOCAB, copying, random_prompts, run


def _planted(layers: int, hidden: int, seed: int, vocab: int = VOCAB) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plant_bigrams(model, TEXT)
    return model


@pytest.fixture(scope="module", params=["hf", "fused"])
def pair(request) -> tuple[StageModel, StageModel]:
    """(served stage, draft stage): 3 layers against 1, the same planted text."""
    stages = StageModel.from_causal_lm(_planted(3, 64, 0)), StageModel.from_causal_lm(_planted(1, 64, 5))
    if request.param == "fused":
        for stage in stages:
            assert prepare_stage(stage).path == "fused"
    return stages


def test_greedy_with_a_draft_model_equals_off_token_for_token_batched_with_sessions_that_do_not_draft(pair):
    target, small = pair
    sessions = lambda: copying(3, 30) + random_prompts(2, 16)  # noqa: E731
    short = lambda: Session("short", TEXT[:20], 2, GREEDY)  # noqa: E731  its 2nd token is its only decode
    off, off_ends = run(local_engine(target, kv_tokens=4096), sessions() + [short()])
    draft = DraftModel(small, target)
    mixed, passes = [], []

    def watch(engine):  # "short" comes in mid-way, and decodes its one position beside drafting sessions
        passes.append(sum(s.spec_passes for s in engine.sessions.values()))
        if len(passes) == 4:
            engine.add(short())  # its prompt runs in the next step, its decode in the one after
        if len(passes) == 6:
            mixed.append(passes[-1] > passes[-2])

    on, on_ends = run(local_engine(target, kv_tokens=4096, speculative=4, draft=draft), sessions(), watch)
    assert on == off
    assert {k: s.finish_reason for k, s in on_ends.items()} == {k: s.finish_reason for k, s in off_ends.items()}
    model_drafted = sum(s.spec_model_drafted for s in on_ends.values())
    model_accepted = sum(s.spec_model_accepted for s in on_ends.values())
    assert 0 < model_accepted < model_drafted  # the draft model's guesses both stood and fell
    assert model_drafted < sum(s.spec_drafted for s in on_ends.values())  # prompt lookup still drafted first
    assert on_ends["short"].spec_drafted == 0 and on_ends["short"].decode_steps == 1
    assert mixed == [True]  # ... in a step with drafts
    assert all(on_ends[f"r{i}"].spec_model_drafted for i in range(2))  # lookup found nothing: the model drafted
    timing = on_ends["r0"].timing()
    assert timing["spec_model_drafted"] == on_ends["r0"].spec_model_drafted
    assert not draft.states and draft.positions == 0  # every session's draft cache went with it


def test_the_served_model_as_its_own_draft_keeps_every_draft(pair):
    target, _ = pair
    sessions = lambda: random_prompts(3, 20)  # noqa: E731
    off, _ = run(local_engine(target, kv_tokens=4096), sessions())
    on, ends = run(local_engine(target, kv_tokens=4096, speculative=3, draft=DraftModel(target, target)), sessions())
    assert on == off
    drafted = sum(s.spec_model_drafted for s in ends.values())
    assert drafted > 0 and sum(s.spec_model_accepted for s in ends.values()) == drafted
    assert all(s.spec_passes < 19 for s in ends.values())


def test_sampled_replies_with_a_draft_model_stay_seeded_and_draft():
    """A greedy draft is a point mass: speculative sampling checks it exactly (test_runtime_speculative's
    chi-square covers that check); here the draft model's drafts meet a sampled request."""
    target, small = StageModel.from_causal_lm(_planted(3, 64, 0)), StageModel.from_causal_lm(_planted(1, 64, 5))
    params = Sampling(temperature=0.8, top_p=0.95, seed=11)
    make = lambda: [Session("s", TEXT[:9], 24, params)]  # noqa: E731
    first, ends = run(local_engine(target, kv_tokens=4096, speculative=4, draft=DraftModel(small, target)), make())
    again, _ = run(local_engine(target, kv_tokens=4096, speculative=4, draft=DraftModel(small, target)), make())
    assert first == again and ends["s"].spec_model_drafted > 0


def test_a_draft_model_with_another_vocabulary_is_refused():
    target = StageModel.from_causal_lm(_planted(1, 64, 0))
    other = StageModel.from_causal_lm(_planted(1, 64, 0, vocab=VOCAB + 64))
    with pytest.raises(DraftModelMismatch, match="share the served model's vocabulary"):
        DraftModel(other, target)
    with pytest.raises(ValueError, match="only with speculative"):
        local_engine(target, kv_tokens=4096, draft=DraftModel(target, target))


def test_a_servable_draft_loads_with_the_same_tokenizer_and_is_refused_with_another(tmp_path):
    from fellow.runtime.tools.calibration import default_texts
    from fellow.runtime.tools.chat_tokenizer import train_chat_tokenizer
    from tests.serving_fixtures import make_servable

    _, served = make_servable(tmp_path, "big", layers=2, hidden=64, stages=1)
    _, small = make_servable(tmp_path, "small", layers=1, hidden=32, stages=1, seed=3)
    target = load_one_stage(served, "cpu")
    draft = load_draft_model(small, target.stage, target.tokenizer, target.device)
    assert draft.name == "small" and draft.ratio == pytest.approx(0.25)  # 1 layer of half the width's kv
    prompts = [target.tokenizer.encode("hello there, hello there, hello")] * 2
    make = lambda: [Session(f"p{i}", p, 12, GREEDY) for i, p in enumerate(prompts)]  # noqa: E731
    off, _ = run(local_engine(target.stage, kv_tokens=4096), make())
    on, ends = run(local_engine(target.stage, kv_tokens=4096, speculative=2, draft=draft), make())
    assert on == off and sum(s.spec_drafted for s in ends.values()) > 0

    hf_dir = tmp_path / "hf-small"
    train_chat_tokenizer(default_texts()[8:14], 320).save_pretrained(str(hf_dir))
    from fellow.runtime.tools.export import export

    export(hf_dir, tmp_path / "servables" / "retokenized", stages=1, model_id="retokenized")
    with pytest.raises(DraftModelMismatch, match="tokenizer is not the served model's"):
        load_draft_model(tmp_path / "servables" / "retokenized", target.stage, target.tokenizer, target.device)
    with pytest.raises(DraftModelMismatch):
        check_same_vocabulary(target.tokenizer, train_chat_tokenizer(default_texts()[8:14], 320))


def test_a_cancelled_session_leaves_no_cache_in_the_draft_model(pair):
    target, small = pair
    draft = DraftModel(small, target)
    engine = local_engine(target, kv_tokens=4096, speculative=4, draft=draft)
    session, other = random_prompts(2, 40)
    engine.add(session)
    engine.add(other)
    while not session.spec_model_drafted or session.spec_model_accepted == session.spec_model_drafted:
        engine.step()  # until a pass in which a model's draft fell: its positions were cropped
    assert set(draft.states) == {session.session_id, other.session_id} and draft.positions > 0
    engine.cancel(session.session_id)
    result = engine.step()
    assert [s.finish_reason for s in result.finished] == ["cancelled"]
    assert set(draft.states) == {other.session_id}
    engine.cancel(other.session_id)
    engine.step()
    assert not draft.states and draft.positions == 0 and engine.budget.reserved == 0


def test_the_budget_counts_the_draft_models_cache_and_never_over_commits(pair):
    """The served model's positions plus the draft model's (at its bytes per position) never
    exceed what was measured, with every reservation taken."""
    target, small = pair
    draft = DraftModel(small, target)
    sessions = copying(2, 25) + random_prompts(2, 25)
    measured = int(sum(s.reserved_tokens for s in sessions) * (1 + draft.ratio)) + 1
    engine = local_engine(target, kv_tokens=measured, speculative=8, draft=draft)
    assert engine.kv_tokens == draft.budget_tokens(measured) < measured
    seen = []

    def watch(engine):
        live = {s.session_id: s for s in engine.sessions.values()}
        for session_id, state in draft.states.items():
            assert state.cache.length <= live[session_id].reserved_tokens
        assert all(s.cache.length <= s.reserved_tokens for s in live.values())
        served = sum(s.cache.length for s in live.values()) + engine.prefix.tokens
        assert served + draft.ratio * draft.positions <= measured
        seen.append(draft.positions)

    _, ends = run(engine, sessions, watch)
    assert {s.finish_reason for s in ends.values()} == {"length"} and max(seen) > 0
    assert sum(s.spec_model_drafted for s in ends.values()) > 0


def test_the_draft_model_setting_names_a_folder_or_an_id_in_the_model_cache(tmp_path):
    from core.servable import MANIFEST_NAME
    from core.settings import Settings
    from fellow.fetch import draft_model_dir

    cached = tmp_path / "cache" / "small-0123456789abcdef"
    cached.mkdir(parents=True)
    (cached / MANIFEST_NAME).write_text("{}")
    settings = Settings.from_env({"SWARM_DATA_DIR": str(tmp_path), "SWARM_FELLOW_MODEL_CACHE": str(tmp_path / "cache"),
                                  "SWARM_SERVE_DRAFT_MODEL": "small"})
    assert draft_model_dir(settings) == cached
    assert draft_model_dir(settings.replace(serving={"draft_model": str(cached)})) == cached
    with pytest.raises(FileNotFoundError, match="SWARM_SERVE_DRAFT_MODEL='nowhere' is neither a servable's folder"):
        draft_model_dir(settings.replace(serving={"draft_model": "nowhere"}))


def test_a_one_stage_load_drafts_with_the_fellows_draft_model(tmp_path, nats_server):
    """SWARM_SERVE_DRAFT_MODEL on the fellow: a load with speculative k drafts with it, and the reply's
    timing says how many of the draft model's tokens stood (greedy equality: the engine tests above)."""
    from tests.serving_fixtures import Stack, make_servable

    _, served = make_servable(tmp_path / "models", "tiny", layers=2, hidden=64, stages=1, seed=1)
    _, small = make_servable(tmp_path / "models", "tiny-draft", layers=1, hidden=32, stages=1, seed=2)
    body = {"model": "tiny", "max_tokens": 10, "temperature": 0,
            "messages": [{"role": "user", "content": "tell me something new"}]}
    stack = Stack(tmp_path, nats_server.url, served.parent, SWARM_SERVE_DRAFT_MODEL=str(small)).start()
    try:
        load = stack.load("tiny", speculative=2)
        assert load["stages"][0]["kernels"]["draft_decoder"] == "eager"  # a CPU: no CUDA graphs
        reply = stack.post("/v1/chat/completions", body).json()
        timing = reply["swarm"]["timing"]
        assert timing["spec_k"] == 2 and timing["spec_model_drafted"] > 0, timing
        assert 0 <= timing["spec_model_accepted"] <= timing["spec_model_drafted"]
    finally:
        stack.stop()
