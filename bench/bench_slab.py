"""The decode slab against attending row by row: one fused decode step of a batch, on shapes of
bench/bench_matrix.py, the two ways alternated in one process (fellow.runtime.model.forms.decode_slab).

    .venv/bin/python bench/bench_slab.py [--shapes llama-deep q46m-v4k] [--rows 8] [--pasts 60 256]
    .venv/bin/python bench/bench_slab.py --rows 4 --widths 5 1 3 1   # a verify pass of drafts instead

With ``--widths`` the step timed is a verify pass (``StageModel.verify``) in which row i runs
``widths[i % len(widths)]`` positions (its last token and its drafts), and a plain decode step over the
slab is timed beside it as the reference.

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


def time_steps(stage, caches, ids, lengths, steps: int = 40, widths: list[int] | None = None) -> tuple[float, float]:
    inputs = None if widths is None else [[int(i)] * w for i, w in zip(ids, widths)]

    def step() -> None:
        if inputs is None:
            stage.decode(caches, ids)
        else:
            stage.verify(caches, inputs)
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
def run_shape(name: str, tmp: Path, rows: int, pasts: list[int], widths: list[int] | None = None) -> list[dict]:
    from events.stage import StageOptions
    from fellow.runtime.model.kv_cache import random_caches
    from fellow.runtime.model.load.loader import load_one_stage
    from fellow.runtime.tools.export import export

    ckpt = make_checkpoint(tmp / name / "hf", SHAPES[name])
    export(ckpt, tmp / "servables" / name, stages=1, model_id=name)
    stage = load_one_stage(tmp / "servables" / name, "cpu", StageOptions(max_batch=rows)).stage
    slab = stage.fused.slab
    out = []
    for past in pasts:
        caches = random_caches(stage.new_cache, rows, past, 1, torch.Generator().manual_seed(past))
        lengths = [past - 5 * i for i in range(rows)]
        for cache, length in zip(caches, lengths):
            cache.crop_to(length)
        ids = torch.randint(0, 1000, (rows,))
        per_row = None if widths is None else [widths[i % len(widths)] for i in range(rows)]
        result = {"shape": name, "rows": rows, "past": past, "widths": per_row, "row_by_row": [], "slab": []}
        if per_row is not None:
            result["decode"] = []
        for _ in range(2):
            for way in ("row_by_row", "slab") + (() if per_row is None else ("decode",)):
                if way == "row_by_row":
                    slab.drop()  # each cache back in buffers of its own
                stage.fused.slab = None if way == "row_by_row" else slab
                timed = time_steps(stage, caches, ids, lengths, widths=None if way == "decode" else per_row)
                result[way].append([round(v, 2) for v in timed])
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
    ap.add_argument("--widths", type=int, nargs="+", help="time a verify pass: positions per row, cycled")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="swarm-bench-slab-") as tmp:
        results = [r for name in args.shapes for r in run_shape(name, Path(tmp), args.rows, args.pasts, args.widths)]
    ways = ("row_by_row", "slab") + (("decode",) if args.widths else ())
    names = {"row_by_row": "row by row", "slab": "slab", "decode": "decode step (slab)"}
    print(f"\n{torch.get_num_threads()} threads" + (f", verify widths {args.widths} per row" if args.widths else ""))
    print("| shape | rows | past | " + " | ".join(f"{names[w]}: median / best ms (two rounds)" for w in ways) + " |")
    print("|---|---|---|" + "---|" * len(ways))
    for r in results:
        cells = [", ".join(f"{m:.2f} / {b:.2f}" for m, b in r[w]) for w in ways]
        print(f"| {r['shape']} | {r['rows']} | {r['past']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
