"""One session's decode attention for one layer, as one C call: what a compiled one-session step attends with.

Through torch, a layer's attention for one new position was a key write, a value write and an sdpa call,
about 60 us of dispatch and small kernels (sdpa 28, the writes 22, docs/benchmarks.md) for arithmetic
that takes a few: q36m-l20's 20 layers spent over 1 ms of a 7.5 ms step there. This kernel writes the
new key and value into the session's buffers and attends each query head to positions ``start`` to
``length`` (a sliding window starts later) with a softmax over their scaled dot products, the same
arithmetic as ``F.scaled_dot_product_attention`` (float32 throughout, the largest score subtracted
before the exponent). Heads are split over torch's OpenMP threads only where the work pays for waking
them (PARALLEL_WORK); a short context stays on the calling thread. bench/bench_row_kernels.py: 12-15 us a
layer against torch's 48-58 at 64 past positions, 41-43 against 89-112 at 512, 152-155 against 182-200 at
2,048 (q46m-v4k and q36m-l20's heads, one run).

Built on first use by ``native.build``; where it cannot be (no compiler, no AVX2), ``available()`` is
False and ``attend_one`` attends through torch as before.
"""

from __future__ import annotations

import ctypes

import torch

from fellow.runtime.kernels import native

PARALLEL_WORK = 1 << 17  # heads x positions x head dim from which the heads are split over threads


KERNEL = native.Kernel("attend_one", "attend_one.c", "the attention kernel", "swarm_attend_one",
                       [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int64])
available, unavailable_reason = KERNEL.available, KERNEL.unavailable_reason


def takes(keys: torch.Tensor) -> bool:
    """Whether a session's key (or value) buffer [kv_heads, capacity, D] can be attended by the kernel."""
    return keys.dtype == torch.float32 and keys.device.type == "cpu" and keys.stride(-1) == 1 and available()


def caller():
    """The kernel's C function (``swarm_attend_one``); only where ``available()``."""
    return KERNEL.fn
