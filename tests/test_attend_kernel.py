"""The C kernel a compiled one-session decode step attends with (fellow.runtime.kernels.attend_kernel): the
same outputs as torch's sdpa over the session's past, its new key and value written where the cache keeps
them, over head sizes with and without a remainder, grouped queries, a sliding window's start, buffers whose
positions are further apart than a head's size, and heads split over threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fellow.runtime.kernels import attend_kernel

pytestmark = [pytest.mark.skipif(not attend_kernel.available(),
                                reason=f"no attention kernel: {attend_kernel.unavailable_reason()}"),
              pytest.mark.usefixtures("two_threads")]  # heads split over threads are what is checked

CASES = [  # kv heads, groups, head size, length (positions before the new one), window start, split over threads
    (2, 2, 64, 0, 0, 0),
    (4, 1, 64, 39, 0, 0),
    (2, 3, 48, 100, 60, 0),
    (1, 4, 20, 7, 2, 0),
    (3, 2, 128, 257, 0, 1),
    (2, 2, 32, 66, 10, 1),
]


@pytest.mark.parametrize("kv,groups,dim,length,start,parallel", CASES)
@pytest.mark.parametrize("spread", [False, True])
def test_the_kernel_attends_as_sdpa_and_writes_the_new_position(kv, groups, dim, length, start, parallel, spread):
    g = torch.Generator().manual_seed(kv * 1000 + dim + length)
    capacity = length + 5
    # spread: each position's row inside a wider one, as a buffer cut from a larger one would be
    keys_full, values_full = (torch.randn(kv, capacity, dim + (24 if spread else 0), generator=g) for _ in "kv")
    keys, values = keys_full[..., :dim], values_full[..., :dim]
    before_keys, before_values = keys.clone(), values.clone()
    q = torch.randn(1, kv * groups, 1, dim, generator=g)
    k, v = (torch.randn(1, kv, 1, dim, generator=g) for _ in "kv")
    scale = dim ** -0.5
    out = torch.full((1, 1, kv * groups * dim), float("nan"))
    attend_kernel.caller()(q.data_ptr(), k.data_ptr(), v.data_ptr(), keys.data_ptr(), values.data_ptr(),
                           keys.stride(0), keys.stride(1), kv, groups, dim, length, start, scale, out.data_ptr(),
                           parallel)
    # the new position written, nothing else touched
    assert torch.equal(keys[:, length], k.view(kv, dim)) and torch.equal(values[:, length], v.view(kv, dim))
    others = [p for p in range(capacity) if p != length]
    assert torch.equal(keys[:, others], before_keys[:, others])
    assert torch.equal(values[:, others], before_values[:, others])
    past = slice(start, length + 1)
    want = F.scaled_dot_product_attention(q.view(1, kv, groups, dim).double(), keys[None, :, past].double(),
                                          values[None, :, past].double(), scale=scale)
    torch.testing.assert_close(out.view(-1).double(), want.reshape(-1), rtol=1e-5, atol=1e-6)


def test_a_stale_score_cannot_pass():
    """The comparison above can fail: attending one position fewer than asked differs from sdpa."""
    g = torch.Generator().manual_seed(1)
    kv, groups, dim, length = 2, 2, 64, 30
    keys, values = torch.randn(kv, length + 1, dim, generator=g), torch.randn(kv, length + 1, dim, generator=g)
    q, k, v = torch.randn(1, kv * groups, 1, dim, generator=g), *(torch.randn(1, kv, 1, dim, generator=g) for _ in "kv")
    out = torch.empty(kv * groups * dim)
    attend_kernel.caller()(q.data_ptr(), k.data_ptr(), v.data_ptr(), keys.data_ptr(), values.data_ptr(),
                           keys.stride(0), keys.stride(1), kv, groups, dim, length, 1, 0.125, out.data_ptr(), 0)
    whole = F.scaled_dot_product_attention(q.view(1, kv, groups, dim), keys[None], values[None], scale=0.125)
    assert not torch.allclose(out, whole.reshape(-1), rtol=1e-5, atol=1e-6)
