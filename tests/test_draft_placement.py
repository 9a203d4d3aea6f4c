"""The draft model where the spec puts it (TS9): SWARM_SERVE_DRAFT_MODEL on the leader (``auto`` or a model
id) names the small model a drafting load's last stage drafts with; fellows that do not declare
serve-draft-model keep the load to prompt lookup, and the load's status says so."""

from __future__ import annotations

import json
import shutil

import pytest

from events.fellow import CAP_DRAFT_MODEL, CAP_KV_BUDGET, CAP_SPECULATIVE, Heartbeat
from events.loads import StageAssignment, TransportPlan
from leader.catalog import scan
from leader.db.tables import Model
from leader.placement import for_old_fellows
from leader.serving.drafts import choose_draft
from tests.serving_fixtures import Stack, make_servable


@pytest.fixture(scope="module")
def servables(tmp_path_factory):
    """Two Qwen3 servables of one vocabulary (4 layers at 64 wide, 1 at 32), a Llama one, and a copy of the
    small one whose tokenizer has one more token."""
    root = tmp_path_factory.mktemp("drafts")
    make_servable(root, "tiny", layers=4, hidden=64, stages=2, seed=1)
    _, small = make_servable(root, "tiny-draft", layers=1, hidden=32, stages=1, seed=2)
    make_servable(root, "tiny-llama", family="llama", layers=1, hidden=32, stages=1, seed=3)
    other = root / "servables" / "tiny-other"
    shutil.copytree(small, other)
    manifest = json.loads((other / "servable.json").read_text())
    (other / "servable.json").write_text(json.dumps({**manifest, "model_id": "tiny-other"}))
    tokenizer = other / "tokenizer" / "tokenizer.json"
    spec = json.loads(tokenizer.read_text())
    spec["added_tokens"].append({**spec["added_tokens"][-1], "id": 999_999, "content": "<extra>"})
    tokenizer.write_text(json.dumps(spec))
    return root / "servables"


def rows(servables) -> dict[str, Model]:
    return {mid: Model(**{f: getattr(e, f) for f in e.__struct_fields__}) for mid, e in scan(servables).items()}


def test_auto_takes_the_smallest_servable_of_the_architecture_and_vocabulary(servables):
    models = rows(servables)
    catalog = list(models.values())
    draft, why = choose_draft("auto", models["tiny"], catalog)
    assert draft.model_id == "tiny-draft" and why == ""  # not the Llama one, not the other vocabulary
    assert choose_draft("auto", models["tiny-draft"], catalog) == (
        None, "no draft model: SWARM_SERVE_DRAFT_MODEL=auto found no smaller Qwen3ForCausalLM servable with the "
              "vocabulary of tiny-draft in the catalog")


def test_a_named_draft_model_must_be_in_the_catalog_and_share_the_vocabulary(servables):
    models = rows(servables)
    catalog = list(models.values())
    assert choose_draft("tiny-draft", models["tiny"], catalog)[0].model_id == "tiny-draft"
    assert choose_draft("nowhere", models["tiny"], catalog) == (
        None, "no draft model: SWARM_SERVE_DRAFT_MODEL='nowhere' is not in the catalog")
    draft, why = choose_draft("tiny-other", models["tiny"], catalog)
    assert draft is None and "'tiny-other' does not share the vocabulary of tiny" in why
    assert "is the served model itself" in choose_draft("tiny", models["tiny"], catalog)[1]


def test_a_fellow_without_serve_draft_model_keeps_the_load_to_prompt_lookup():
    def beat(fellow_id: str, *caps: str) -> Heartbeat:
        return Heartbeat(fellow_id=fellow_id, hostname="h", seq=1, interval_s=1.0,
                         capabilities=[CAP_KV_BUDGET, CAP_SPECULATIVE, *caps])

    plan = TransportPlan(speculative=2, draft_model="tiny-draft")
    stages = [StageAssignment(stage=0, fellow_id="new"), StageAssignment(stage=1, fellow_id="old")]
    beats = {"new": beat("new", CAP_DRAFT_MODEL), "old": beat("old")}
    transport, why = for_old_fellows(plan, stages, beats, None, 2)
    assert (transport.speculative, transport.draft_model) == (2, "")
    assert why == ["no draft model: fellow old does not declare serve-draft-model"]
    beats["old"] = beat("old", CAP_DRAFT_MODEL)
    assert for_old_fellows(plan, stages, beats, None, 2) == (plan, [])


def _chat(stack: Stack, content: str) -> dict:
    body = {"model": "tiny", "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": content}]}
    r = stack.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_rings_last_stage_drafts_with_the_leaders_draft_model_fetched_and_replies_as_without(
        servables, tmp_path, nats_server):
    """SWARM_SERVE_DRAFT_MODEL=auto on the leader: a two-stage load with speculative 2 names tiny-draft in its
    transport; the last stage's fellow fetches it from the leader (SWARM_FELLOW_FETCH=always) and drafts
    with it, stage 0 holds none; the replies' timings count its drafts, and greedy replies equal the same
    ring's without drafting. (With SWARM_SERVE_STEP_COSTS=1, stage 0 also reports its link probe.)"""
    stack = Stack(tmp_path, nats_server.url, servables, fellows=2, SWARM_SERVE_DRAFT_MODEL="auto",
                  SWARM_FELLOW_FETCH="always", SWARM_SERVE_STEP_COSTS="1").start()
    prompts = ["tell me something new", "the same words again and again", "count to ten"]
    try:
        load = stack.load("tiny", num_stages=2, speculative=2)
        assert load["transport"]["draft_model"] == "tiny-draft" and not load["reason"], load
        first, last = sorted(load["stages"], key=lambda s: s["stage"])
        assert "draft_decoder" not in first["kernels"] and last["kernels"]["draft_decoder"] == "eager"
        assert first["kernels"]["link_probe"]["trips"] == 10  # step costs asked: stage 0 timed its links too
        fetched = list((tmp_path / "data").rglob("tiny-draft-*/servable.json"))
        assert fetched, "the last stage's fellow fetched the draft model into its model cache"
        drafted = [_chat(stack, p) for p in prompts]
        timings = [r["swarm"]["timing"] for r in drafted]
        assert all(t["spec_k"] == 2 for t in timings)
        assert sum(t.get("spec_model_drafted", 0) for t in timings) > 0, timings
        assert stack.post("/api/v1/models/tiny/unload").status_code == 200
        plain = stack.load("tiny", num_stages=2, speculative=0)
        assert plain["transport"]["draft_model"] == ""  # no drafting, no draft model
        assert [r["choices"][0]["message"]["content"] for r in drafted] == [
            _chat(stack, p)["choices"][0]["message"]["content"] for p in prompts]
    finally:
        stack.stop()


def test_a_one_stage_load_drafts_with_the_draft_model_the_leader_names(servables, tmp_path, nats_server):
    """SWARM_SERVE_DRAFT_MODEL=<id> on the leader, a one-stage load: its only stage is its last, and drafts."""
    stack = Stack(tmp_path, nats_server.url, servables, SWARM_SERVE_DRAFT_MODEL="tiny-draft").start()
    try:
        load = stack.load("tiny", num_stages=1, speculative=2)
        assert load["transport"]["draft_model"] == "tiny-draft"
        assert load["stages"][0]["kernels"]["draft_decoder"] == "eager"
        timing = _chat(stack, "tell me something new")["swarm"]["timing"]
        assert timing["spec_k"] == 2 and timing["spec_model_drafted"] > 0, timing
    finally:
        stack.stop()
