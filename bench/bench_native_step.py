"""One session's decode step as one C call (``native_step``) against the fused step and the compiled graph
the background compile builds (batch 1: its reduce and kernel forms; more rows: the linear form for float32,
reduce for quantized weights), per shape, float32, int8 and int4, at each batch size, in one run.

    .venv/bin/python bench/bench_native_step.py [--shapes q46m-v4k q36m-l20] [--methods none int8 int4-fast]
        [--rows 1 8] [--context 64]

Each stage is loaded as a fellow loads it (``load_one_stage``: the load's kernel choices, its plain weights
kept for the compiled forms); the graphs are compiled in inductor's default mode (the reduce and kernel
forms' own; the background compile builds the linear form under max-autotune). Every step runs on a
cache of ``--context`` random positions, cropped back after each; the paths take turns, and each
figure is the median of the rounds' best-of-5, in ms, with its ratio to the fused step's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from events.stage import StageOptions  # noqa: E402
from fellow.runtime.model.forms.compiled import CompiledDecode  # noqa: E402
from fellow.runtime.model.forms.graph_linear import KERNEL, LINEAR, REDUCE, gemv_forms  # noqa: E402
from fellow.runtime.model.forms.native_step import NativeStep, why_not  # noqa: E402
from fellow.runtime.model.kv_cache import random_caches  # noqa: E402
from fellow.runtime.model.load.loader import load_one_stage  # noqa: E402
from fellow.runtime.tools.export import export  # noqa: E402


def crop(caches, context: int) -> None:
    for cache in caches:
        cache.crop_to(context)


def best_ms(step, caches, context: int, passes: int = 5) -> float:
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - started)
        crop(caches, context)
    return best * 1e3


@torch.inference_mode()
def measure(name: str, method: str, tmp: Path, context: int, rounds: int, rows: int) -> dict:
    ckpt = make_checkpoint(tmp / f"{name}-hf", SHAPES[name])
    servable = tmp / f"{name}-servable"
    if not servable.exists():
        export(ckpt, servable, stages=1, model_id=name)
    stage = load_one_stage(servable, "cpu", StageOptions(quantization=method, compile=None)).stage
    if (why := why_not(stage)) is not None:
        return {"shape": name, "method": method, "why": why}
    paths = {"fused": lambda caches, ids: stage.decode(caches, ids)}
    native = NativeStep(stage, stage.plain_weights)
    paths["native"] = native.decode
    forms = [f for f in gemv_forms() if f in (REDUCE, KERNEL)] if method == "none" else [REDUCE]
    for form in forms if rows == 1 else [LINEAR if method == "none" else REDUCE]:
        graph = CompiledDecode(stage, stage.plain_weights, None, form)
        graph.warm(rows)
        paths[form] = graph.decode
    caches = random_caches(stage.new_cache, rows, context, 1, torch.Generator().manual_seed(0))
    ids = torch.arange(7, 7 + rows)
    for step in paths.values():  # each once, before timing (the compiled ones run their first call)
        step(caches, ids)
        crop(caches, context)
    times: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(rounds):
        for path, step in paths.items():
            times[path].append(best_ms(lambda: step(caches, ids), caches, context))
    ms = {path: round(statistics.median(t), 3) for path, t in times.items()}
    return {"shape": name, "method": method, "rows": rows, "context": context, "ms": ms,
            "vs_fused": {path: round(ms["fused"] / t, 2) for path, t in ms.items() if path != "fused"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["q46m-v4k", "q36m-l20"], choices=list(SHAPES))
    ap.add_argument("--methods", nargs="+", default=["none", "int8", "int4-fast"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = scratch_dir("bench-native-step-")
    print(f"{torch.get_num_threads()} torch threads, context {args.context}, median of {args.rounds} rounds' best of 5",
          flush=True)
    for name in args.shapes:
        for method in args.methods:
            for rows in args.rows:
                print(json.dumps(measure(name, method, tmp, args.context, args.rounds, rows)), flush=True)


if __name__ == "__main__":
    main()
