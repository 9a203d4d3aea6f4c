"""How a ring batches, on real tiny stages: stage 0's decode groups of ceil(in flight / stages), its prompt
pieces up to one a stage in the ring (prefill_ahead), and the padded-batch fit every batcher asks
(fellow.runtime.engine.padded), with the replies still the model's alone."""

from __future__ import annotations

import math

import pytest
import torch

from events.ring import DECODE, PIECE, Hidden, Token
from fellow.runtime.engine.padded import fits_padded, padded_batches, padded_layers
from tests.serving_fixtures import make_servable
from tests.test_ring_runtime import PROMPTS, LocalRing, one_stage

# three short prompts and one of 250 tokens: 295 of 320 KV tokens reserved with 8 new tokens each, so two
# rows beside the long one (2 x 251 positions of one layer) pass what is free plus a prompt piece of 8
LONG = [[7, 8, 9], [3] * 5, list(range(5, 10)), [5 + i % 200 for i in range(250)]]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    torch.set_num_threads(1)
    return make_servable(tmp_path_factory.mktemp("ring-batches"), "tiny2", layers=4, hidden=64, stages=2)[1]


def test_the_padded_fit_and_its_batches():
    assert fits_padded(0, 64, 4000, 0)  # nothing padded: any batch fits
    assert fits_padded(2, 3, 99, 150) and not fits_padded(2, 4, 99, 150)  # 3 x 100 / 2 = 150; 4 x 100 / 2 = 200
    lengths = [50, 10, 12, 11, 300]
    fits = lambda rows, longest: fits_padded(1, rows, longest, 100)  # noqa: E731
    assert padded_batches(lengths, int, 0, fits) == [[10, 11, 12], [50], [300]]  # similar lengths together
    assert padded_batches(lengths, int, 2, lambda rows, longest: True) == [[10, 11], [12, 50], [300]]  # the cap


def drive(ring: LocalRing, prompts, new_tokens: int, watch=None) -> dict[str, list[int]]:
    """Generate on the ring, ``watch(frame)`` seeing each frame stage 0 sends as it sends it."""
    if watch is not None:
        send = ring.head.runner.units.send
        ring.head.runner.units.send = lambda frame: (watch(frame), send(frame))
    try:
        got = ring.generate(prompts, new_tokens)
        ring.settle()
    finally:
        ring.close()
    return got


def test_stage_0s_groups_hold_ceil_in_flight_over_stages_and_a_prompt_runs_ahead_one_piece_a_stage(two):
    expected = one_stage(two, PROMPTS, 12)
    ring = LocalRing(two, 2, prefill_chunk=8)
    assert padded_layers(ring.stages[0].stage) == 0  # fused CPU layers pad nothing
    ahead: list[int] = []  # a session's pieces already in the ring as stage 0 sends another

    def watch(frame):
        if isinstance(frame, Hidden) and frame.kind == PIECE:
            ahead.append(ring.head.sessions[frame.session].in_ring)

    assert drive(ring, PROMPTS, 12, watch) == expected
    groups = [f.batch for s, f in ring.sent if s == 0 and isinstance(f, Hidden) and f.kind == DECODE]
    assert max(groups) == math.ceil(len(PROMPTS) / 2)  # five sessions over two stages: groups of three
    assert max(ahead) == 1  # piece i + 1 went while piece i was on the next stage, and never a third
    capped = LocalRing(two, 3, prefill_chunk=8, max_batch=1)
    assert capped.head.runner.units._group_size(capped.head) == 1  # max_batch still caps a group
    capped.close()


def test_stage_0_sends_a_long_session_alone_where_its_groups_padded_copy_would_pass_the_budget(two):
    prompts = LONG
    expected = one_stage(two, prompts, 8)
    ring = LocalRing(two, 2, prefill_chunk=8, kv_tokens=320)  # every session admitted, 25 tokens free
    ring.head.runner.units.padded_layers = 1  # as if its layers were HF ones, padded in one cache each
    assert drive(ring, prompts, 8) == expected
    decoded = [f for s, f in ring.sent if s == 0 and isinstance(f, Hidden) and f.kind == DECODE]
    assert {f.batch for f in decoded if f.session == "s3"} == {1}  # stage 0: the 250-token session alone
    assert max(f.batch for f in decoded if f.session != "s3") > 1  # the short ones still batch


def test_a_later_stage_cuts_a_group_stage_0_sent_whole_where_its_padded_copy_would_not_fit(two):
    # four sessions of 200 tokens; the last stage holds 208 KV tokens, so each session's reservation leaves it
    # no room for two rows beside one another (2 x 201 positions) even with a prompt piece's 256, while stage
    # 0, padding nothing, groups them in twos
    prompts = [[5 + (i * 7 + k) % 200 for i in range(200)] for k in range(4)]
    expected = one_stage(two, prompts, 8)
    ring = LocalRing(two, 2, prefill_chunk=64, kv_tokens=836, stage_kv=[208])
    ring.workers[0].padded_layers = 1  # as if the last stage's layers were HF ones
    assert drive(ring, prompts, 8) == expected
    decoded = [f for s, f in ring.sent if s == 0 and isinstance(f, Hidden) and f.kind == DECODE]
    answered = [f for s, f in ring.sent if s == 1 and isinstance(f, Token) and f.token >= 0]
    assert max(f.batch for f in decoded) == 2 and {f.batch for f in answered} == {1}
