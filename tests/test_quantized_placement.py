"""Placement of quantized loads (core.quantization, leader.placement): what a request may ask, which
fellows may serve it, what it is priced at, and the full-precision fallback that keeps the price honest."""

from __future__ import annotations

import pytest

from core.quantization import (
    INT4_FAST,
    INT8,
    NF4,
    NONE,
    QuantizationError,
    as_request,
    bytes_per_param,
    manifest_method,
    method_of,
)
from events.fellow import (
    CAP_CONCURRENT,
    CAP_CPU_INT4,
    CAP_CPU_INT8,
    CAP_INT4_FAST,
    CAP_N_STAGE,
    CAP_ONE_STAGE,
    CAP_QUANTIZED,
    Gpu,
    Heartbeat,
)
from leader.placement import PlacementError, place_replicas, place_ring
from leader.serving.commands import place_keeping_price

GIB = 1 << 30
PARAMS = 1_000_000_000
BASE = (CAP_ONE_STAGE, CAP_N_STAGE, CAP_CONCURRENT)


def cpu(fellow_id: str, free_gib: float, *caps: str) -> Heartbeat:
    return Heartbeat(fellow_id=fellow_id, hostname="h", seq=1, interval_s=1.0, capabilities=[*BASE, *caps],
                     memory_free_bytes=int(free_gib * GIB))


def gpu(fellow_id: str, free_gib: float, *caps: str) -> Heartbeat:
    return Heartbeat(fellow_id=fellow_id, hostname="h", seq=1, interval_s=1.0, capabilities=[*BASE, *caps],
                     gpus=[Gpu(index=0, name="card", total_bytes=int(24 * GIB), free_bytes=int(free_gib * GIB))])


def test_requests_name_one_of_four_methods_and_anything_else_is_refused():
    assert [method_of(q) for q in ({"method": "none"}, {"method": "nf4"}, {"bits": 8}, {"method": "int4-fast"},
                                   {"bits": 4}, {"method": "INT8"}, {"backend": "torchao"}, None)] == \
        [NONE, NF4, INT8, INT4_FAST, NF4, INT8, INT4_FAST, NONE]
    for bad, says in (({"bits": 3}, "4 or 8"), ({"method": "fp4"}, "not served"), ({"method": "nf4", "bits": 8},
                      "not 8-bit"), ({"colour": 1}, "not colour"), ({}, "names no method"), ([8], "an object"),
                      ({"bits": True}, "4 or 8"), ({"backend": "torchao", "method": "nf4"}, "int4-fast only")):
        with pytest.raises(QuantizationError, match=says):
            method_of(bad)
    assert [as_request(m) for m in (INT8, NF4)] == [{"bits": 8}, {"method": "nf4"}]
    # the manifest's own: an HF quantization_config, or one of ours; an unserved one is full precision
    assert manifest_method({"quant_method": "bitsandbytes", "load_in_4bit": True}) == NF4
    assert manifest_method({"quant_method": "bitsandbytes", "load_in_8bit": True}) == INT8
    assert manifest_method({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}) == NONE
    assert manifest_method({"quant_method": "gptq", "bits": 4}) == NONE and manifest_method(None) == NONE
    assert bytes_per_param(NF4, True) == bytes_per_param(INT4_FAST, False) == 0.55
    assert bytes_per_param(INT8, False) == 1.05 and bytes_per_param(NONE, False) == 4.0


def test_a_quantized_load_goes_only_to_fellows_that_declare_its_kernels_priced_as_quantized():
    fellows = {"big": cpu("big", 64), "small": cpu("small", 2, CAP_CPU_INT8, CAP_CPU_INT4)}
    online = set(fellows)
    # full precision: 4.8 GB with headroom, only "big" fits
    [a] = place_replicas(PARAMS, 8, 1, fellows, online, method=NONE)
    assert a.fellow_id == "big" and a.weights_estimate == 4 * PARAMS
    # int8 fits "small" (1.26 GB) and only "small" declares the CPU int8 kernel
    [a] = place_replicas(PARAMS, 8, 1, fellows, online, method=INT8)
    assert a.fellow_id == "small" and a.weights_estimate == int(1.05 * PARAMS)
    [a] = place_replicas(PARAMS, 8, 1, fellows, online, method=INT4_FAST)
    assert a.fellow_id == "small" and a.weights_estimate == int(0.55 * PARAMS)
    # NF4 needs bitsandbytes (serve-quantized): neither of these fellows declares it
    with pytest.raises(PlacementError, match="big does not declare serve-quantized.*small does not declare"):
        place_replicas(PARAMS, 8, 1, fellows, online, method=NF4)
    # on a GPU the same int8 request needs bitsandbytes, and int4-fast torchao's kernels
    cards = {"g": gpu("g", 20, CAP_CPU_INT8, CAP_CPU_INT4)}
    with pytest.raises(PlacementError, match="g does not declare serve-quantized"):
        place_replicas(PARAMS, 8, 1, cards, {"g"}, method=INT8)
    with pytest.raises(PlacementError, match="serve-int4-fast"):
        place_replicas(PARAMS, 8, 1, cards, {"g"}, method=INT4_FAST)
    cards = {"g": gpu("g", 20, CAP_QUANTIZED, CAP_INT4_FAST)}
    assert place_replicas(PARAMS, 8, 1, cards, {"g"}, method=INT4_FAST)[0].weights_estimate == int(0.55 * PARAMS)


def test_a_ring_needs_every_fellow_capable_and_prices_each_stage_by_its_share():
    ranges, shards = [(0, 6), (6, 8)], [[0], [1]]
    fellows = {"a": cpu("a", 8, CAP_CPU_INT8), "b": cpu("b", 8, CAP_CPU_INT8)}
    placed = place_ring(PARAMS, ranges, shards, fellows, set(fellows), method=INT8)
    assert sorted(a.weights_estimate for a in placed) == [int(1.05 * PARAMS * 2 / 8), int(1.05 * PARAMS * 6 / 8)]
    fellows["b"] = cpu("b", 8)
    with pytest.raises(PlacementError, match="declare serve-n-stage, serve-cpu-int8 or serve-quantized"):
        place_ring(PARAMS, ranges, shards, fellows, set(fellows), method=INT8)


def test_too_few_capable_fellows_serve_full_precision_and_say_why_never_priced_4bit():
    fellows = {"plain": cpu("plain", 64)}

    def place(method):
        return place_replicas(PARAMS, 8, 1, fellows, set(fellows), method=method)

    assignments, served, why = place_keeping_price(place, INT4_FAST)
    assert served == NONE and assignments[0].weights_estimate == 4 * PARAMS  # priced as it is served
    assert why.startswith("int4-fast asked, served in full precision: ") and "serve-cpu-int4" in why
    fellows["q"] = cpu("q", 4, CAP_CPU_INT4)
    assignments, served, why = place_keeping_price(place, INT4_FAST)
    assert (served, why, assignments[0].fellow_id) == (INT4_FAST, "", "q")
    assert assignments[0].weights_estimate == int(0.55 * PARAMS)
    # too few fellows run the int4 kernels but some run bitsandbytes': it stays 4-bit, as NF4, at 4-bit's price
    fellows = {"plain": cpu("plain", 64), "bnb": cpu("bnb", 4, CAP_QUANTIZED)}
    assignments, served, why = place_keeping_price(place, INT4_FAST)
    assert (served, assignments[0].fellow_id, assignments[0].weights_estimate) == (NF4, "bnb", int(0.55 * PARAMS))
    assert why.startswith("int4-fast asked, served as nf4: ") and "serve-cpu-int4" in why
    assert place_keeping_price(place, INT8)[1] == NONE  # int8 has no 4-bit step down
    # where full precision does not fit either, the quantized refusal is the one reported
    fellows = {"tiny": cpu("tiny", 1)}
    with pytest.raises(PlacementError, match="tiny does not declare serve-cpu-int4"):
        place_keeping_price(place, INT4_FAST)


def test_a_load_on_a_card_older_than_ampere_decodes_batches_of_2_or_4_where_every_fellow_splits():
    """SWARM_SERVE_MAX_BATCH unset: the spec's default cap for loads on pre-Ampere cards, 4-bit, 8-bit or
    float16 alike (bitsandbytes' kernel for 4 rows and more was 4.5x slower than for 3 on a GTX 1660 SUPER):
    2, or 4 where every fellow of the load splits 4-bit calls (serve-4bit-rows); none on newer cards, or
    where the leader sets the cap itself."""
    from events.fellow import CAP_4BIT_ROWS, Gpu
    from events.loads import TransportPlan
    from leader.placement import pre_ampere_batch_cap

    def card(fellow_id: str, cc: str, *caps: str) -> Heartbeat:
        return Heartbeat(fellow_id=fellow_id, hostname="h", seq=1, interval_s=1.0, capabilities=[*BASE, *caps],
                         gpus=[Gpu(index=0, name=f"card-{cc}", total_bytes=6 * GIB, free_bytes=5 * GIB,
                                   compute_capability=cc)])

    plan = TransportPlan(max_in_flight=4, kv_tokens=4096)
    fellows = {"old": card("old", "7.5", CAP_QUANTIZED), "new": card("new", "8.6", CAP_QUANTIZED, CAP_4BIT_ROWS),
               "old-split": card("old-split", "6.1", CAP_QUANTIZED, CAP_4BIT_ROWS)}
    ring = lambda *ids: [place_for(i, f) for i, f in enumerate(ids)]  # noqa: E731

    def cap(ids, method=NF4, explicit=False):
        transport, why = pre_ampere_batch_cap(plan, ring(*ids), fellows, method, explicit)
        return transport.max_batch, why

    batch, why = cap(["old", "new"])
    assert batch == 2 and "card-7.5 (sm 7.5), older than Ampere" in why and "not every fellow" in why
    batch, why = cap(["old-split", "new"])
    assert batch == 4 and "card-6.1 (sm 6.1)" in why and "every fellow splits 4-bit calls" in why
    assert cap(["new"]) == (0, "")  # Ampere or newer: no cap
    batch, why = cap(["old"], NONE)  # a float16 load on a GTX 16xx: capped too
    assert batch == 2 and "a none load on card-7.5 (sm 7.5)" in why
    assert cap(["old"], INT8)[0] == 2 and cap(["old-split"], NONE)[0] == 4
    assert cap(["new"], NONE) == (0, "")
    assert cap(["old"], explicit=True) == (0, "")  # SWARM_SERVE_MAX_BATCH set on the leader: its own
    fellows["blank"] = card("blank", "")  # nvidia-smi gave no capability: nothing known to cap for
    assert cap(["blank"]) == (0, "")


def place_for(stage: int, fellow_id: str):
    from events.loads import StageAssignment

    return StageAssignment(stage=stage, fellow_id=fellow_id, layers=[0, 1], shards=[stage])
