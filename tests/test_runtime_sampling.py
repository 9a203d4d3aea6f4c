"""The sampler: greedy cases, each filter, seeded draws, rows independent of their batch."""

import math

import pytest
import torch

from events.requests import Sampling
from fellow.runtime.engine.sampling import filtered_probs, make_generator, sample, sample_row

PROBS = [0.5, 0.3, 0.15, 0.05]


def _logits(probs=PROBS) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def _draws(params: Sampling, logits: torch.Tensor, n: int = 300) -> list[int]:
    generator = make_generator(params)
    return [int(sample_row(logits, params, generator)) for _ in range(n)]


def test_temperature_zero_is_argmax_per_row():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(1))
    params = [Sampling(temperature=0.0)] * 5
    assert make_generator(params[0]) is None
    assert sample(logits, params, [None] * 5).tolist() == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_and_top_k_keeps_k():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    assert set(_draws(Sampling(top_k=1), logits, 50)) == {int(logits.argmax())}
    probs, ids = filtered_probs(logits, Sampling(top_k=3))
    assert ids.tolist() == torch.topk(logits, 3).indices.tolist()
    assert set(_draws(Sampling(top_k=3, seed=5), logits)) <= set(ids.tolist())


def test_tiny_top_p_is_greedy():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    assert set(_draws(Sampling(top_p=1e-6, seed=7), logits, 100)) == {int(logits.argmax())}


def test_top_p_keeps_the_head_that_reaches_it():
    # cumulative mass before each token: 0, .5, .8, .95 -> top_p .7 keeps the first two
    draws = _draws(Sampling(top_p=0.7, seed=11), _logits())
    assert set(draws) == {0, 1}


def test_min_p_drops_tokens_below_a_share_of_the_top():
    # .3 >= .5 * .5 stays; .15 and .05 go
    draws = _draws(Sampling(min_p=0.5, seed=13), _logits())
    assert set(draws) == {0, 1}
    probs, _ = filtered_probs(_logits(), Sampling(min_p=0.5))
    assert (probs > 0).tolist() == [True, True, False, False]


def test_temperature_scales_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0])
    probs, ids = filtered_probs(logits, Sampling(temperature=0.5))
    assert ids is None
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1))
    hot = _draws(Sampling(temperature=50.0, seed=3), logits)
    assert set(hot) == {0, 1, 2}


def test_seeded_draws_reproduce_and_seeds_differ():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(4))
    params = Sampling(temperature=1.0, top_p=0.95, seed=1234)
    assert _draws(params, logits, 50) == _draws(params, logits, 50)
    assert _draws(params, logits, 50) != _draws(Sampling(top_p=0.95, seed=4321), logits, 50)


def test_each_row_draws_as_it_would_alone():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(5))
    params = [Sampling(seed=1), Sampling(temperature=0.0), Sampling(top_k=20, min_p=0.05, seed=2)]
    batched_gens = [make_generator(p) for p in params]
    alone_gens = [make_generator(p) for p in params]
    for _ in range(20):
        batched = sample(logits, params, batched_gens).tolist()
        alone = [int(sample(logits[r : r + 1], [params[r]], [alone_gens[r]])[0]) for r in range(3)]
        assert batched == alone


def test_the_requests_sampling_is_checked():
    params = Sampling(temperature=0.7, top_p=0.9, top_k=40, min_p=0.1, seed=9)
    assert params.check() is params and not params.greedy and Sampling(top_k=1).greedy
    for bad in (Sampling(top_p=0.0), Sampling(temperature=-1.0), Sampling(logprobs=21), Sampling(min_tokens=-1),
                Sampling(presence_penalty=2.5), Sampling(repetition_penalty=0.0), Sampling(min_p=1.5)):
        with pytest.raises(ValueError):
            bad.check()


def test_draws_follow_the_distribution():
    draws = _draws(Sampling(seed=21), _logits(), 4000)
    shares = [draws.count(token) / len(draws) for token in range(len(PROBS))]
    assert all(abs(share - p) < 0.03 for share, p in zip(shares, PROBS)), shares
