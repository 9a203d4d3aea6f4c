"""An int8 weight times a few float32 rows, on AVX2: what a quantized stage's decode steps multiply by.

torch's CPU int8 kernel (``aten._weight_int8pack_mm``) is bound by its arithmetic here, not by memory:
a 6,144 x 512 weight read from memory took 503 us on one thread and 263 us on two (6.3 and 12 GB/s of
weights, where two threads read 32 GB/s): an int8 46M Qwen3 spent about 3.2 ms of its 5.9 ms compiled
step in those calls, where llama.cpp's whole q8_0 step took 3.6. Widening the weights to float32 in
a kernel of our own was no faster (284 us). So this kernel does what llama.cpp's q8_0 does: each row of
activations is quantized to int8 in blocks of BLOCK (a float32 scale a block: its largest magnitude over
127), and each block's products with the weight's int8 row are summed in integers (AVX2's byte
multiply-adds), then scaled by the block's scale and the weight row's. 172 us for that weight, 1.4-1.7
times torch's kernel on most shapes (docs/benchmarks.md). The rows' quantization moves a product by
about 0.5 % of its size (relative norm, random rows), against 0.2-0.3 % for torch's kernel, which reads
rows in bfloat16; perplexity through decode steps is in docs/benchmarks.md. The weight's rows are split
over the OpenMP threads torch runs (the library links the ``libgomp`` torch loaded, so the two share one
pool and its thread count), each read from memory once for all the rows of the call.

The library is compiled on first use from ``kernels/csrc/int8_gemv.c`` (``native.build``: the host's C compiler,
cached beside inductor's cache); where there is no compiler, no AVX2 or FMA, or the build fails,
``available()`` is False, says why (``unavailable_reason``), and the stage multiplies with torch's kernel,
as it does calls of more than MAX_ROWS rows (prompt pieces) and weights whose inputs are not a multiple
of BLOCK.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from fellow.runtime.kernels import native

log = logging.getLogger(__name__)

MAX_ROWS = 8  # calls of more rows (prompt pieces) go to torch's kernel
_scratch = threading.local()  # per thread (the serving one, the compile one): int8_gemv's working buffers
BLOCK = 32  # inputs per activation scale

KERNEL = native.Kernel("int8_gemv", "int8_gemv.c", "the int8 kernel", "swarm_int8_gemv",
                       [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2)
available, unavailable_reason = KERNEL.available, KERNEL.unavailable_reason


def takes(in_features: int) -> bool:
    """Whether a weight of ``in_features`` inputs can go through the kernel (blocks of 32, and built here)."""
    return in_features % BLOCK == 0 and available()


def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 (M <= MAX_ROWS, K a multiple of BLOCK), weight [N, K] int8, scales [N] float32 ->
    [M, N] float32. Only where ``takes(K)``."""
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    scratch = getattr(_scratch, "buffers", None)
    if scratch is None or scratch[0].numel() < rows * k:  # the rows' int8 form and their block scales
        scratch = _scratch.buffers = (torch.empty(rows * k, dtype=torch.int8), torch.empty(rows * k // BLOCK))
    KERNEL.fn(x.data_ptr(), weight.data_ptr(), scales.data_ptr(), out.data_ptr(), rows, n, k,
                                  scratch[0].data_ptr(), scratch[1].data_ptr())
    return out


def reference(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What ``int8_gemv`` computes, in torch (tests): each row quantized in blocks of BLOCK as the kernel does
    (in float32, rounding to nearest even), the int8 products summed exactly."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d > 0, 1.0 / d, 0.0))
    products = torch.einsum("mbi,nbi->mnb", q.double(), weight.double().reshape(-1, k // BLOCK, BLOCK))
    return (products * d[..., 0].double()[:, None, :]).sum(-1) * scales.double()


# ``int8_gemv`` as an op a compiled graph calls (opaque to inductor). Defined through torch.library.Library
# rather than custom_op: its dispatch cost 5 us a call against custom_op's 10 (a 20-layer stage calls it
# 81 times a step)
_LIBRARY = torch.library.Library("swarm", "FRAGMENT")
_LIBRARY.define("int8_rows(Tensor x, Tensor weight, Tensor scales) -> Tensor")
_LIBRARY.impl("int8_rows", lambda x, weight, scales: int8_gemv(x, weight, scales), "CPU")


@torch.library.register_fake("swarm::int8_rows")
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def rows_kernel() -> str:
    """What multiplies an int8 weight by at most MAX_ROWS rows here, for a stage's status."""
    return "swarm-int8-blocks" if available() else f"aten ({unavailable_reason()})"
