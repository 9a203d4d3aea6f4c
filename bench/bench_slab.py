"""The decode slab against attending row by row: one fused decode step of a batch, on shapes of
bench/bench_matrix.py, the two ways alternated in one process (fellow.runtime.model.decode_slab).

    .venv/bin/python bench/bench_slab.py [--shapes llama-deep q46m-v4k] [--rows 8] [--pasts 60 256]

Each row's past is random positions, the rows' lengths 5 apart (so the slab's step masks). Per way:
the median and best of 40 steps after 5 warm ones, each step's new position cropped away again, and
the ways alternated twice (A B A B), so a drift of the machine shows as a difference between rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402


def time_steps(stage, caches, ids, lengths, steps: int = 40) -> tuple[float, float]:
    def step() -> None:
        stage.decode(caches, ids)
        for cache, length in zip(caches, lengths):
            cache.crop_to(length)

    for _ in range(5):
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3, min(times) * 1e3


@torch.inference_mode()
def run_shape(name: str, tmp: Path, rows: int, pasts: list[int]) -> list[dict]:
    from fellow.runtime.model.kv_cache import random_caches
    from fellow.runtime.model.loader import load_one_stage
    from fellow.runtime.tools.export import export

    ckpt = make_checkpoint(tmp / name / "hf", SHAPES[name])
    export(ckpt, tmp / "servables" / name, stages=1, model_id=name)
    stage = load_one_stage(tmp / "servables" / name, device="cpu", batch_cap=rows).stage
    slab = stage.fused.slab
    out = []
    for past in pasts:
        caches = random_caches(stage.new_cache, rows, past, 1, torch.Generator().manual_seed(past))
        lengths = [past - 5 * i for i in range(rows)]
        for cache, length in zip(caches, lengths):
            cache.crop_to(length)
        ids = torch.randint(0, 1000, (rows,))
        result = {"shape": name, "rows": rows, "past": past, "row_by_row": [], "slab": []}
        for _ in range(2):
            for way in ("row_by_row", "slab"):
                if way == "row_by_row":
                    slab.drop()  # each cache back in buffers of its own
                stage.fused.slab = slab if way == "slab" else None
                result[way].append([round(v, 2) for v in time_steps(stage, caches, ids, lengths)])
        stage.fused.slab = slab
        for cache in caches:
            cache.release()
        print(json.dumps(result), flush=True)
        out.append(result)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-deep", "q46m-v4k"], choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--pasts", type=int, nargs="+", default=[60, 256])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-bench-slab-") as tmp:
        results = [r for name in args.shapes for r in run_shape(name, Path(tmp), args.rows, args.pasts)]
    print("\n| shape | rows | past | row by row: median / best ms (two rounds) | slab: median / best ms (two rounds) |")
    print("|---|---|---|---|---|")
    for r in results:
        ways = [", ".join(f"{m:.2f} / {b:.2f}" for m, b in r[w]) for w in ("row_by_row", "slab")]
        print(f"| {r['shape']} | {r['rows']} | {r['past']} | {ways[0]} | {ways[1]} |")


if __name__ == "__main__":
    main()
