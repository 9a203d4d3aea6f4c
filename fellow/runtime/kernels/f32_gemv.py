"""A float32 weight times one row, on AVX2: how a compiled one-session step's ``reduce`` form multiplies.

A decode step for one session reads every weight once, so its speed is the speed weights stream from
memory. MKL's one-row GEMV ran on one thread here (12 GB/s on a 6,144 x 512 weight), and inductor's loop
over a product and a sum (``graph_linear.REDUCE``) at about 23. This kernel splits the weight's rows over
torch's OpenMP threads in blocks of eight, eight running sums a block (the row loaded once for the eight):
over a step's weights, 2.0 (q46m-v4k) and 1.8 (q36m-l20) times MKL's speed in one run of
bench/bench_row_kernels.py (24.7 and 20.5 GB/s; 31 and 27 on a quieter spell, where two threads read about
32 from memory). Software prefetching the next block, four or twelve rows a block, or rows interleaved in
blocks of eight were each as fast or slower. Called from compiled graphs as ``swarm::f32_rows`` (opaque to
inductor); built on first use by ``native.build``, and where it cannot be, ``available()`` is False and the
graph keeps inductor's loop.
"""

from __future__ import annotations

import ctypes

import torch

from fellow.runtime.kernels import native

KERNEL = native.Kernel("f32_gemv", "f32_gemv.c", "the float32 row kernel", "swarm_f32_gemv",
                       [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2)
available, unavailable_reason = KERNEL.available, KERNEL.unavailable_reason


def takes(weight: torch.Tensor) -> bool:
    """Whether one row times ``weight`` [N, K] can go through the kernel (float32, contiguous, K in eights)."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.shape[1] % 8 == 0 and available())


def f32_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] float32 times weight [N, K] (where ``takes(weight)``) -> [1, N]."""
    if not weight.is_contiguous():  # never seen: the graph passes the weight it kept
        return torch.nn.functional.linear(x, weight)
    x = x.contiguous()
    n, k = weight.shape
    out = torch.empty(1, n, dtype=torch.float32)
    KERNEL.fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), n, k)
    return out


_LIBRARY = torch.library.Library("swarm", "FRAGMENT")  # dispatch: 5 us a call, against custom_op's 10
_LIBRARY.define("f32_rows(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("f32_rows", f32_gemv, "CPU")


@torch.library.register_fake("swarm::f32_rows")
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(1, weight.shape[0])
