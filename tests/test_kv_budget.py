"""KV from what is measured: a stage grows its token budget past placement's plan into the memory it
measures (a CPU stage: the host, its cgroup's limit or a limit its caller sets), up to the plan's
ceiling, and says measured, planned and held in its status (``kernels.kv``)."""

from __future__ import annotations

import pytest
import torch
import transformers

from events.stage import StageOptions
from fellow.runtime.model.load.kv_budget import cpu_free_bytes, held_tokens, resident_bytes
from fellow.runtime.model.stage import StageModel
from fellow.runtime.server.base import kv_budget

GB = 10**9


@pytest.fixture(scope="module")
def stage():
    config = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
    torch.manual_seed(0)
    return StageModel.from_causal_lm(transformers.AutoModelForCausalLM.from_config(config).eval())


def test_a_4gb_limit_holds_more_than_1gb_and_both_are_in_status(stage):
    # a prompt piece of 2,048 positions: 33 KB a token, so neither budget reaches the CPU's token cap
    transport = StageOptions(kv_tokens=1000, kv_tokens_max=10**7, max_in_flight=2, prefill_chunk=2048)
    held_1, planned_1 = kv_budget(stage, transport, memory_limit=1 * GB)
    status_1 = stage.kernels.kv
    held_4, planned_4 = kv_budget(stage, transport, memory_limit=4 * GB)
    status_4 = stage.kernels.kv
    assert planned_1 == planned_4 == 1000 == status_4["planned"]
    assert held_4 > held_1 and held_4 > 1000  # grown past the plan into the limit's room
    assert status_1["held"] == held_1 and status_4["held"] == held_4
    assert status_1["measured"] < status_4["measured"] and status_4["most"] == 10**7
    if resident_bytes() < 0.8 * GB:  # this process leaves room under the 1 GB limit
        assert held_1 > 0


def test_an_old_leaders_plan_is_held_at_most():
    """No ceiling (an older leader sends no kv_tokens_max): at most what was planned, as before."""
    assert held_tokens(50_000, 4096) == 4096
    assert held_tokens(50_000, 4096, 16_384) == 16_384
    assert held_tokens(2_000, 4096, 16_384) == 2_000  # less room than planned: what it measured
    assert held_tokens(2_000, 0) == 2_000  # nothing planned: what it measured


def test_a_limit_below_what_the_process_holds_leaves_no_room():
    assert cpu_free_bytes(resident_bytes() // 2) == 0
    assert 0 < cpu_free_bytes(resident_bytes() + GB) <= GB


def test_a_card_computing_prompt_pieces_in_float32_keeps_their_weight_free():
    """The spec's TS12: Qwen3-14B's MLP weight dequantized in float32 (5120 x 17408 x 4 bytes, about
    356 MB) replaces the 300 MiB kept for passing buffers; a smaller one leaves the 300 MiB."""
    from fellow.runtime.model.load.device_split import CUDA_KEEP_BYTES
    from fellow.runtime.model.load.kv_budget import card_keep_bytes

    assert card_keep_bytes(5120 * 17408 * 4) == 356_515_840 > CUDA_KEEP_BYTES
    assert card_keep_bytes(64 * 128 * 4) == card_keep_bytes(0) == CUDA_KEEP_BYTES


def test_float32_piece_bytes_are_the_largest_4bit_weight_per_device(stage, tmp_path):
    """Where fourbit_rows chose float32 prompt pieces (on a card; here its verdict is set on a CPU NF4
    stage), each device keeps its largest 4-bit weight in float32 free: a fused layer's gate_up."""
    from core.quantization import NF4
    from fellow.runtime.model.load.kv_budget import float32_piece_bytes
    from fellow.runtime.model.load.loader import load_one_stage
    from tests.serving_fixtures import make_servable

    assert float32_piece_bytes(stage) == {}  # no 4-bit weights, no float32 pieces
    _, servable = make_servable(tmp_path, "tiny", layers=2, hidden=64, stages=1)
    try:
        nf4 = load_one_stage(servable, "cpu", StageOptions(quantization=NF4)).stage
    except Exception as exc:  # bitsandbytes absent or without a CPU NF4 kernel here
        pytest.skip(f"NF4 does not load here ({exc})")
    assert float32_piece_bytes(nf4) == {}  # prompt pieces stay in the stage's dtype
    nf4.note(fourbit_rows={"float32_prompt_pieces": True})
    config = nf4.config
    assert float32_piece_bytes(nf4) == {torch.device("cpu"): 2 * config.intermediate_size * config.hidden_size * 4}
