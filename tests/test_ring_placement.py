"""Ring placement from heartbeats: one fellow per stage, capabilities required, refusals that name the fellow."""

from __future__ import annotations

import pytest

from core.settings import Settings
from events.fellow import CAP_CONCURRENT as CONCURRENT, CAP_N_STAGE as N_STAGE, Gpu, Heartbeat
from leader.placement import PlacementError, place_ring, ring_needs, ring_stage_count, transport_plan

GIB = 1 << 30
RANGES = [(0, 3), (3, 4)]
SHARDS = [[0], [1]]


def beat(fellow_id: str, free_gib: float, capabilities=(N_STAGE, CONCURRENT)) -> Heartbeat:
    return Heartbeat(fellow_id=fellow_id, hostname="h", seq=1, interval_s=1.0, capabilities=list(capabilities),
                     gpus=[Gpu(index=0, name="card", total_bytes=int(24 * GIB), free_bytes=int(free_gib * GIB))])


def test_the_heaviest_stage_goes_to_the_fellow_with_the_most_room():
    fellows = {"a": beat("a", 4), "b": beat("b", 20), "c": beat("c", 8)}
    placed = place_ring(2_000_000_000, RANGES, SHARDS, fellows, set(fellows), needs=ring_needs(8))
    assert [(p.stage, p.fellow_id, p.layers, p.shards) for p in placed] == [(0, "b", (0, 3), [0]),
                                                                            (1, "c", (3, 4), [1])]


def test_pinned_fellows_serve_in_ring_order_and_must_be_distinct_and_online():
    fellows = {"a": beat("a", 4), "b": beat("b", 20)}
    placed = place_ring(1000, RANGES, SHARDS, fellows, set(fellows), pinned=["a", "b"])
    assert [p.fellow_id for p in placed] == ["a", "b"]
    with pytest.raises(PlacementError, match="repeat"):
        place_ring(1000, RANGES, SHARDS, fellows, set(fellows), pinned=["a", "a"])
    with pytest.raises(PlacementError, match="'c' is not online"):
        place_ring(1000, RANGES, SHARDS, fellows, set(fellows), pinned=["a", "c"])
    with pytest.raises(PlacementError, match="3 fellow_ids for a ring of 2"):
        place_ring(1000, RANGES, SHARDS, fellows, set(fellows), pinned=["a", "b", "a"])


def test_a_ring_with_a_fellow_lacking_a_capability_is_refused_naming_it():
    fellows = {"a": beat("a", 8), "old": beat("old", 20, capabilities=("serve-one-stage",)),
               "solo": beat("solo", 20, capabilities=(N_STAGE,))}
    with pytest.raises(PlacementError, match="fellow old does not declare serve-n-stage"):
        place_ring(1000, RANGES, SHARDS, fellows, set(fellows), pinned=["a", "old"])
    with pytest.raises(PlacementError, match="fellow solo does not declare serve-concurrent"):
        place_ring(1000, RANGES, SHARDS, fellows, set(fellows), pinned=["solo", "a"], needs=ring_needs(8))
    with pytest.raises(PlacementError, match=r"needs 2 fellows .* 1 online do \(fellow old does not declare "
                                             r"serve-n-stage, serve-concurrent; fellow solo does not declare "
                                             r"serve-concurrent\)"):
        place_ring(1000, RANGES, SHARDS, fellows, set(fellows), needs=ring_needs(8))
    # one at a time, no concurrency is asked, so "solo" serves
    placed = place_ring(1000, RANGES, SHARDS, fellows, set(fellows), needs=ring_needs(1))
    assert {p.fellow_id for p in placed} == {"a", "solo"}


def test_a_stage_that_does_not_fit_names_the_fellow():
    fellows = {"a": beat("a", 1), "b": beat("b", 1)}
    with pytest.raises(PlacementError, match="fellow .* has no room for stage 0"):
        place_ring(2_000_000_000, RANGES, SHARDS, fellows, set(fellows))


def test_default_stage_count_and_transport():
    fellows = {"a": beat("a", 8), "b": beat("b", 8), "old": beat("old", 8, capabilities=())}
    assert ring_stage_count(2, fellows, set(fellows)) == 2
    assert ring_stage_count(3, fellows, set(fellows)) == 1  # only two fellows can form a ring
    assert ring_stage_count(2, fellows, {"a", "old"}) == 1
    plan = transport_plan(Settings.from_env({"SWARM_SERVE_PREFILL_CHUNK": "64"}), 2)
    assert plan.max_in_flight == 8 and plan.kv_tokens == 8 * 1024 and plan.prefill_chunk == 64
    assert plan.in_flight_max == 8  # stage 0 sizes it from what it measures, at most four a stage
    assert transport_plan(Settings.from_env({}), 3).max_in_flight == 12  # the spec's 4 x stages
    fixed = transport_plan(Settings.from_env({"SWARM_SERVE_IN_FLIGHT": "3"}), 2)
    assert fixed.max_in_flight == 3 and fixed.in_flight_max == 0  # set by hand: not sized
    one = transport_plan(Settings.from_env({"SWARM_SERVE_MAX_IN_FLIGHT": "5"}), 1)  # one stage: what a fellow holds
    assert one.max_in_flight == 5 and one.kv_tokens == max(Settings.from_env({}).serving.context_tokens, 5 * 1024)
    assert one.in_flight_max == 0
