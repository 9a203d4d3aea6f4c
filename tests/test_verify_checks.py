"""leader.verify.checks: the greedy margin, the sampled floor and the share, as pure functions."""

from __future__ import annotations

import math

from events.frames import TokenLogprob, TopLogprob
from events.requests import ChatMessage, ChatRequest, Sampling
from leader.verify.checks import GREEDY_MARGIN, checkable, chosen, judge, sampled_floor


def entry(logprob: float, best: float, rank: int) -> TokenLogprob:
    return TokenLogprob("x", logprob, [120], [TopLogprob("y", best, [121], 7)], rank)


def request(**sampling) -> ChatRequest:
    return ChatRequest(request_id="r", load_id="l", model_id="m", messages=[ChatMessage(role="user", content="hi")],
                       max_tokens=8, sampling=Sampling(**sampling))


def test_greedy_tokens_must_be_the_argmax_or_a_near_tie():
    greedy = request(temperature=0.0)
    assert judge(greedy, [1, 2], [entry(-1.0, -1.0, 1), entry(-1.05, -1.0, 2)], 384).passed  # 0.05 nats: a tie
    v = judge(greedy, [1, 2, 3], [entry(-1.0, -1.0, 1), entry(-2.0, -1.0, 3), entry(-3.0, -1.0, 9)], 384)
    assert not v.passed and v.bad == 2 and v.first_bad == 1 and math.isclose(v.worst, 2.0)
    assert GREEDY_MARGIN < 0.7  # the tiny liar's tokens sat 0.7 nats and more below the argmax
    assert not judge(greedy, [1, 2], [entry(-1.0, -1.0, 1)], 384).passed  # a token the scorer did not score


def test_sampled_tokens_must_clear_a_floor_an_honest_sampler_rarely_misses():
    floor = sampled_floor(1.0, 384)
    assert math.isclose(floor, math.log(1e-6 / 384))
    assert sampled_floor(0.5, 384) == floor and sampled_floor(2.0, 384) < floor  # hotter: a lower floor
    sampled = request(temperature=1.0)
    assert judge(sampled, [1], [entry(floor + 1, -0.1, 50)], 384).passed
    assert not judge(sampled, [1], [entry(floor - 1, -0.1, 300)], 384).passed


def test_which_requests_are_checked():
    assert checkable(request()) and not checkable(request(repetition_penalty=1.2))
    assert not checkable(request(grammar="x")) and not checkable(request(logit_bias={1: 5.0}))
    picked = sum(chosen(f"rq-{i}", 0.1) for i in range(10_000))
    assert 900 < picked < 1100 and chosen("rq-1", 0.1) == chosen("rq-1", 0.1)
    assert not any(chosen(f"rq-{i}", 0.0) for i in range(100))
