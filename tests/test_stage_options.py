"""A stage's options are built once on its fellow, from placement's plan over the fellow's own settings,
and travel whole to the stage process."""

from __future__ import annotations

import pytest

from core.quantization import QuantizationError
from core.settings import Settings
from events.commands import LoadStage
from events.loads import StageAssignment, TransportPlan
from events.stage import StageConfig, decode_config, encode
from fellow.manager import stage_options


def load(num_stages: int = 1, stage: int = 0, quantization: dict | None = None, **plan) -> LoadStage:
    return LoadStage(load_id="ld", model_id="m", num_stages=num_stages, quantization=quantization,
                     assignment=StageAssignment(stage=stage, fellow_id="f0"), transport=TransportPlan(**plan))


FELLOW = Settings.from_env({"SWARM_SERVE_DEVICES": "cpu", "SWARM_SERVE_LORA": "peft", "SWARM_SERVE_COMPILE": "1,8",
                            "SWARM_SERVE_MAX_BATCH": "2", "SWARM_SERVE_STEP_COSTS": "1", "SWARM_SERVE_THREADS": "3",
                            "SWARM_SERVE_PREFIX_CACHE": "off", "SWARM_SERVE_LINKS": "relay"})


def test_a_stage_serves_with_the_plan_over_its_fellows_own_settings():
    o = stage_options(FELLOW, load(max_in_flight=6, kv_tokens=6000, prefill_chunk=64, quantization={"method": "int8"}))
    assert (o.devices, o.lora, o.compile, o.threads, o.prefix_cache, o.links) == ("cpu", "peft", (1, 8), 3, False,
                                                                                   "relay")  # the fellow's
    assert (o.max_in_flight, o.kv_tokens, o.prefill_chunk, o.quantization) == (6, 6000, 64, "int8")  # the plan's
    assert (o.max_batch, o.step_costs, o.step_profile, o.batch_cap) == (2, True, False, 2)  # left open: the fellow's
    profiled = Settings.from_env({"SWARM_SERVE_STEP_COSTS": "profile"})
    assert (stage_options(profiled, load()).step_costs, stage_options(profiled, load()).step_profile) == (True, True)
    assert stage_options(Settings.from_env({}), load(step_costs=True, step_profile=True)).step_profile  # the leader's
    assert stage_options(FELLOW, load(max_batch=4)).max_batch == 4  # chosen by the plan
    holds = Settings.from_env({"SWARM_SERVE_MAX_IN_FLIGHT": "3"})  # a fellow's own, for its one-stage loads
    assert stage_options(holds, load(max_in_flight=8)).max_in_flight == 3
    assert stage_options(holds, load(num_stages=2, stage=1, max_in_flight=8)).max_in_flight == 8  # a later stage
    assert stage_options(Settings.from_env({}), load(max_in_flight=6)).max_in_flight == 6  # unset: the plan's
    assert stage_options(FELLOW, load(num_stages=2, in_flight_max=48)).in_flight_max == 48
    assert stage_options(FELLOW, load(in_flight_max=48)).in_flight_max == 0  # one stage: in flight stays fixed
    unset = stage_options(Settings.from_env({}), load())
    assert (unset.devices, unset.lora, unset.compile, unset.max_batch, unset.draft_model_dir) == ("auto", "lean", None,
                                                                                                   0, "")
    cfg = StageConfig(load_id="ld", model_id="m", model_dir="/m", nats_url="nats://x:1", fellow_id="f0", options=o)
    assert decode_config(encode(cfg).decode()).options == o  # whole, as it goes in the stage's argv


def test_a_rings_stage_0_takes_the_lower_of_the_plan_and_its_fellows_own_and_says_why():
    from fellow.manager import ring_head_bounds

    both = Settings.from_env({"SWARM_SERVE_MAX_IN_FLIGHT": "3", "SWARM_SERVE_PREFILL_CHUNK": "16"})
    head = stage_options(both, load(num_stages=2, max_in_flight=8, in_flight_max=8, prefill_chunk=256))
    assert (head.max_in_flight, head.in_flight_max, head.prefill_chunk) == (3, 0, 16)  # the fellow's, lower, fixed
    why = ring_head_bounds(both.serving, TransportPlan(max_in_flight=8, in_flight_max=8, prefill_chunk=256))[3]
    assert why == ["max_in_flight 3, not the plan's 8: SWARM_SERVE_MAX_IN_FLIGHT=3 on stage 0's fellow",
                   "prefill_chunk 16, not the plan's 256: SWARM_SERVE_PREFILL_CHUNK=16 on stage 0's fellow"]
    lower = stage_options(both, load(num_stages=2, max_in_flight=2, prefill_chunk=8))  # the plan's is lower
    assert (lower.max_in_flight, lower.in_flight_max, lower.prefill_chunk) == (2, 0, 8)
    whole = stage_options(both, load(num_stages=2, prefill_chunk=0))  # the plan sends prompts whole: pieces of 16
    assert whole.prefill_chunk == 16
    more = Settings.from_env({"SWARM_SERVE_MAX_IN_FLIGHT": "32"})  # asks for more than four a stage
    sized = stage_options(more, load(num_stages=2, max_in_flight=8, in_flight_max=8))
    assert (sized.max_in_flight, sized.in_flight_max) == (8, 32)  # the plan's to start, sized up to 32
    fixed = stage_options(more, load(num_stages=2, max_in_flight=8))  # SWARM_SERVE_IN_FLIGHT on the leader: fixed
    assert (fixed.max_in_flight, fixed.in_flight_max) == (8, 0)
    assert ring_head_bounds(Settings.from_env({}).serving, TransportPlan(max_in_flight=8))[3] == []


def test_a_plan_no_load_serves_or_a_draft_model_not_there_is_refused_before_a_process_starts(tmp_path):
    with pytest.raises(QuantizationError):
        stage_options(FELLOW, load(quantization={"method": "int3"}))
    drafting = Settings.from_env({"SWARM_DATA_DIR": str(tmp_path), "SWARM_SERVE_DRAFT_MODEL": "nowhere"})
    assert stage_options(drafting, load()).draft_model_dir == ""  # nothing drafts: not looked for
    with pytest.raises(FileNotFoundError, match="nowhere"):
        stage_options(drafting, load(speculative=4))
    assert stage_options(drafting, load(num_stages=2, stage=0, speculative=4)).draft_model_dir == ""  # not the last
    with pytest.raises(FileNotFoundError, match="nowhere"):  # a ring's last stage drafts
        stage_options(drafting, load(num_stages=2, stage=1, speculative=4))
    leaders = load(num_stages=2, stage=1, speculative=4, draft_model="small")
    assert stage_options(drafting, leaders, "/cache/small").draft_model_dir == "/cache/small"  # the leader's wins
    chose_none = load(num_stages=2, stage=1, speculative=4, draft_asked="nowhere")  # the leader found none
    assert stage_options(drafting, chose_none).draft_model_dir == ""  # its verdict stands: the fellow's not tried
    auto = Settings.from_env({"SWARM_DATA_DIR": str(tmp_path), "SWARM_SERVE_DRAFT_MODEL": "auto"})
    assert stage_options(auto, load(speculative=4)).draft_model_dir == ""  # auto: the leader's to resolve


def test_a_fellows_own_prefill_chunk_is_its_one_stage_loads_and_the_stage_cuts_prompts_by_it(tmp_path):
    from fellow.runtime.server.stage import StageServer
    from tests.serving_fixtures import make_servable

    own = Settings.from_env({"SWARM_SERVE_PREFILL_CHUNK": "16"})
    assert stage_options(own, load(prefill_chunk=256)).prefill_chunk == 16  # set on the fellow: its own
    assert stage_options(own, load(num_stages=2, stage=1, prefill_chunk=256)).prefill_chunk == 256  # a later stage
    assert stage_options(Settings.from_env({}), load(prefill_chunk=64)).prefill_chunk == 64  # unset: the plan's
    assert stage_options(Settings.from_env({"SWARM_SERVE_PREFILL_CHUNK": "0"}), load()).prefill_chunk == 0  # whole
    servable = make_servable(tmp_path, "tiny", layers=2, hidden=64)[1]
    server = StageServer(StageConfig(load_id="ld-chunk", model_id="tiny", model_dir=str(servable),
                                     nats_url="nats://x:1", fellow_id="f0", options=stage_options(own, load())))
    server.load()
    assert server.engine.prefill_chunk == 16
