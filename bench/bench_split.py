"""More sessions than the batch cap (``SWARM_SERVE_MAX_BATCH``): each decode step runs them in batches,
one after another. Decode tokens/s of the engine (fused layers, kernels chosen at load) with 16
sessions at a batch cap of 8, the decode slab as it is now (the sessions a batch leaves out keep
their rows, so each batch steps over its own block of one slab) and as it was ("before": a rebuild
gave them their own buffers, so every batch of every step rebuilt the slab), and at a batch cap of 16
(one batch: the reference), alternated in one process (fellow.runtime.model.forms.decode_slab).

    .venv/bin/python bench/bench_split.py [--shapes llama-deep q46m-v4k q2-wide-mlp llama-gqa8] [--past 500]

Each session's prompt is ``--past`` random tokens (plus its index, so the pasts differ), served from a
prefix cache after the first run; ``--tokens`` greedy tokens each, timed from the step after every
first token to the last reply's end, in wall time on torch's default threads. Best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402

WAYS = (("now", 8), ("before", 8), ("one batch", 16))


def run(stage, prompts: list[list[int]], tokens: int, cap: int, prefix) -> tuple[float, int]:
    """(decode tokens/s, slab rebuilds while decoding)."""
    from events.requests import Sampling
    from fellow.runtime.engine.engine import local_engine
    from fellow.runtime.engine.session import Session

    engine = local_engine(stage, kv_tokens=1 << 22, max_batch=cap)
    engine.prefix = prefix
    sessions = [Session(f"s{i}", ids, tokens, Sampling(temperature=0.0)) for i, ids in enumerate(prompts)]
    for session in sessions:
        engine.add(session)
    while any(s.first_token_at is None for s in sessions):
        engine.step()
    rebuilds = stage.fused.slab.rebuilds
    started = time.perf_counter()
    while engine.busy:
        engine.step()
    elapsed = time.perf_counter() - started
    return sum(len(s.output_ids) - 1 for s in sessions) / elapsed, stage.fused.slab.rebuilds - rebuilds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-deep", "q46m-v4k", "q2-wide-mlp", "llama-gqa8"],
                    choices=list(SHAPES))
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--past", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from bench.bench_spec import make_stage
    from fellow.runtime.engine.prefix_cache import PrefixCache
    from fellow.runtime.model.forms import decode_slab

    tmp = scratch_dir("swarm-bench-split-")
    print(f"{torch.get_num_threads()} threads, {args.sessions} sessions, pasts {args.past}+, {args.tokens} tokens each")
    print("| shape | cap 8, now: tok/s | cap 8, before: tok/s | cap 16: tok/s | now / before | now / cap 16 | "
          "rebuilds now / before |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes:
        ckpt = make_checkpoint(tmp / name, SHAPES[name])
        stage = make_stage(ckpt, None, args.sessions)
        vocab = SHAPES[name][4]
        draws = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, vocab, (args.past + i,), generator=draws).tolist() for i in range(args.sessions)]
        prefix = PrefixCache()
        rates: dict[str, list[float]] = {way: [] for way, _ in WAYS}
        rebuilds: dict[str, int] = {}
        for _ in range(args.rounds):
            for way, cap in WAYS:
                decode_slab.KEEP_LEFT_OUT = way != "before"
                try:
                    rate, rebuilds[way] = run(stage, prompts, args.tokens, cap, prefix)
                finally:
                    decode_slab.KEEP_LEFT_OUT = True
                rates[way].append(rate)
        best = {way: max(r) for way, r in rates.items()}
        print(f"| {name} | {best['now']:.1f} | {best['before']:.1f} | {best['one batch']:.1f} | "
              f"{best['now'] / best['before']:.2f}x | {best['now'] / best['one batch']:.2f}x | "
              f"{rebuilds['now']} / {rebuilds['before']} |", flush=True)
        del stage


if __name__ == "__main__":
    main()
