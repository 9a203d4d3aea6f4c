"""The stage's own C kernels for a one-session decode step, each against what it replaced, in one process.

    .venv/bin/python bench/bench_row_kernels.py [--shapes q46m-v4k q36m-l20] [--contexts 64 512 2048]

- Float32 rows (``fellow/runtime/kernels/f32_gemv.py``): one row times every weight of a decode step of each
  shape (qkv, o, gate and up, down per layer, then the head; random weights laid out as a stage holds them,
  more bytes than any cache), in order, as ``swarm::f32_rows`` against ``F.linear`` (MKL's one-row GEMV)
  and torch's product and sum run eagerly. GB/s of weights read, best of 15 passes.
- One session's attention (``fellow/runtime/kernels/attend_kernel.py``): a layer's key and value written and
  its heads attended over ``--contexts`` past positions, through the kernel (called as ``attend_one`` calls
  it) against torch's two copies and sdpa (``attend_one``'s fallback), us a call, best of 5 x 200 calls.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES  # noqa: E402
from fellow.runtime.kernels import attend_kernel, f32_gemv  # noqa: E402


def step_weights(shape: tuple) -> list[torch.Tensor]:
    _, hidden, layers, mlp, vocab, heads, kv_heads, _ = shape
    dim = hidden // heads
    sizes = [((heads + 2 * kv_heads) * dim, hidden), (hidden, heads * dim), (2 * mlp, hidden), (hidden, mlp)] * layers
    return [torch.randn(n, k) for n, k in sizes + [(vocab, hidden)]]


def best_of(fn, passes: int) -> float:
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def rows(name: str) -> dict:
    weights = step_weights(SHAPES[name])
    total = sum(w.numel() * 4 for w in weights)
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    ways = {"swarm::f32_rows": lambda x, w: torch.ops.swarm.f32_rows(x, w), "F.linear (MKL)": F.linear,
            "product and sum (eager)": lambda x, w: (x * w).sum(-1)}
    out = {}
    for label, way in ways.items():
        seconds = best_of(lambda: [way(xs[w.shape[1]], w) for w in weights], 15)
        out[label] = {"ms": round(seconds * 1e3, 2), "GB/s": round(total / seconds / 1e9, 1)}
    return {"shape": name, "weights_MB": round(total / 1e6), **out}


def attention(name: str, context: int) -> dict:
    _, hidden, _, _, _, heads, kv, _ = SHAPES[name]
    dim, groups = hidden // heads, heads // kv
    keys, values = torch.randn(kv, context + 64, dim), torch.randn(kv, context + 64, dim)
    q, k, v = torch.randn(1, heads, 1, dim), torch.randn(1, kv, 1, dim), torch.randn(1, kv, 1, dim)
    call, scale = attend_kernel.caller(), dim ** -0.5
    split = int(heads * (context + 1) * dim >= attend_kernel.PARALLEL_WORK)

    def kernel():
        out = torch.empty(1, 1, heads * dim)
        call(q.data_ptr(), k.data_ptr(), v.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0),
             keys.stride(1), kv, groups, dim, context, 0, scale, out.data_ptr(), split)
        return out

    def torch_path():
        keys[:, context].copy_(k.view(kv, dim))
        values[:, context].copy_(v.view(kv, dim))
        return F.scaled_dot_product_attention(q.view(1, kv, groups, dim), keys[None, :, : context + 1],
                                              values[None, :, : context + 1], scale=scale).view(1, 1, heads * dim)

    diff = float((kernel() - torch_path()).abs().max())
    us = {label: round(best_of(lambda: [fn() for _ in range(200)], 5) / 200 * 1e6, 1)
          for label, fn in (("kernel", kernel), ("torch", torch_path))}
    return {"shape": name, "context": context, "heads": f"{heads}/{kv}x{dim}", "us": us, "max_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["q46m-v4k", "q36m-l20"], choices=list(SHAPES))
    ap.add_argument("--contexts", nargs="+", type=int, default=[64, 512, 2048])
    args = ap.parse_args()
    if not (f32_gemv.available() and attend_kernel.available()):
        sys.exit(f"the kernels did not build: {f32_gemv.unavailable_reason() or attend_kernel.unavailable_reason()}")
    print(f"{torch.get_num_threads()} torch threads", flush=True)
    for name in args.shapes:
        print(json.dumps(rows(name)), flush=True)
        for context in args.contexts:
            print(json.dumps(attention(name, context)), flush=True)


if __name__ == "__main__":
    main()
