"""Mixed versions: a leader that meets a fellow declaring less than serve-kv-budget or serve-speculative
plans the load as the spec says for old fellows (leader.placement.for_old_fellows), and says why."""

from __future__ import annotations

from core.settings import Settings
from events.fellow import CAP_CONCURRENT, CAP_KV_BUDGET, CAP_N_STAGE, CAP_ONE_STAGE, CAP_SPECULATIVE, Heartbeat
from events.loads import StageAssignment
from leader.placement import for_old_fellows, transport_plan

NEW = (CAP_ONE_STAGE, CAP_N_STAGE, CAP_CONCURRENT, CAP_KV_BUDGET, CAP_SPECULATIVE)


def fellow(fellow_id: str, *caps: str) -> Heartbeat:
    return Heartbeat(fellow_id=fellow_id, hostname="h", seq=1, interval_s=1.0, capabilities=list(caps),
                     memory_free_bytes=8 << 30)


def ring(*ids: str) -> list[StageAssignment]:
    return [StageAssignment(stage=i, fellow_id=f, layers=(i, i + 1), shards=[i]) for i, f in enumerate(ids)]


def plan(env: dict, stages: int, fellows: dict[str, Heartbeat]):
    settings = Settings.from_env(env)
    return for_old_fellows(transport_plan(settings, stages), ring(*fellows), fellows, settings, stages)


def test_new_fellows_get_the_token_budget_and_drafting():
    fellows = {"a": fellow("a", *NEW), "b": fellow("b", *NEW)}
    transport, why = plan({"SWARM_SERVE_SPECULATIVE": "2"}, 2, fellows)
    assert why == [] and transport == transport_plan(Settings.from_env({"SWARM_SERVE_SPECULATIVE": "2"}), 2)
    assert transport.max_in_flight == 8 and transport.kv_tokens == 8 * 1024 and transport.kv_tokens_max == 8 * 4096
    assert transport.speculative == 2


def test_a_fellow_without_serve_kv_budget_gets_a_full_context_per_request_and_two_a_stage():
    old = tuple(c for c in NEW if c != CAP_KV_BUDGET)
    fellows = {"a": fellow("a", *NEW), "old": fellow("old", *old)}
    transport, why = plan({}, 2, fellows)
    assert transport.max_in_flight == 4 and transport.kv_tokens == 4 * 4096
    assert transport.kv_tokens_max == 0 and transport.in_flight_max == 0  # no growth, no ring sizing
    assert len(why) == 1 and "fellow old does not declare serve-kv-budget" in why[0]
    # SWARM_SERVE_IN_FLIGHT set: its count, still a full context each
    transport, _ = plan({"SWARM_SERVE_IN_FLIGHT": "3", "SWARM_SERVE_CONTEXT_TOKENS": "2048"}, 2, fellows)
    assert (transport.max_in_flight, transport.kv_tokens) == (3, 3 * 2048)


def test_a_ring_drafts_only_where_every_fellow_declares_serve_speculative():
    old = tuple(c for c in NEW if c != CAP_SPECULATIVE)
    fellows = {"a": fellow("a", *NEW), "old": fellow("old", *old)}
    transport, why = plan({"SWARM_SERVE_SPECULATIVE": "2"}, 2, fellows)
    assert transport.speculative == 0 and why == ["no drafting: fellow old does not declare serve-speculative"]
    assert transport.kv_tokens_max > 0  # serve-kv-budget is declared: the token budget stays
    # a one-stage load drafts on its own fellow, whatever it declares
    one, why = plan({"SWARM_SERVE_SPECULATIVE": "2"}, 1, {"old": fellow("old", *old)})
    assert one.speculative == 2 and why == []
