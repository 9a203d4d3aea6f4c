"""What a stage's load spends measuring (issue 13's budget: under 2 s for a 1B model on a CPU): the
kernel choice (each weight shape timed under each kernel, ``fellow.runtime.model.kernels``) and the
step costs (``SWARM_SERVE_STEP_COSTS``: a decode step at batch 1 and at the batch cap), each the way
the stage does it now and the way it did before (seven timed calls per kernel and row count, each
after reading 64 MiB, every kernel timed to the end; three timed steps per batch size, each after an
untimed one), alternated in one process.

    .venv/bin/python bench/bench_load.py [--shapes tiny-1b q46m-v4k llama-deep] [--rounds 2]

tiny-1b is TinyLlama-1.1B's shape (hidden 2,048, 22 layers, MLP 5,632, 32k vocabulary, 32 heads
over 4), with random weights; the others are bench/bench_matrix.py's. Also printed: whether the
two ways chose the same kernel for every shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402

ALL = {**SHAPES, "tiny-1b": ("llama", 2048, 22, 5632, 32000, 32, 4, False)}


def measure(servable: Path, before: bool, cap: int) -> dict:
    from fellow.runtime.model import kernels
    from fellow.runtime.model.loader import load_one_stage

    saved = (kernels.MIN_SAMPLES, kernels.FLUSH_BIG, kernels.STEP_COST_BUDGET_S, kernels.STEP_WARM_EACH,
             kernels.CLEAR_LOSER)
    if before:
        (kernels.MIN_SAMPLES, kernels.FLUSH_BIG, kernels.STEP_COST_BUDGET_S, kernels.STEP_WARM_EACH,
         kernels.CLEAR_LOSER) = kernels.SAMPLES, True, float("inf"), True, float("inf")
    try:
        started = time.perf_counter()
        stage = load_one_stage(servable, device="cpu", batch_cap=cap).stage
        load_s = time.perf_counter() - started
        started = time.perf_counter()
        costs = kernels.step_costs(stage, sorted({1, cap}))
        steps_s = time.perf_counter() - started
    finally:
        (kernels.MIN_SAMPLES, kernels.FLUSH_BIG, kernels.STEP_COST_BUDGET_S, kernels.STEP_WARM_EACH,
         kernels.CLEAR_LOSER) = saved
    return {"choose_s": stage.kernels["seconds"], "step_costs_s": round(steps_s, 3), "load_s": round(load_s, 2),
            "chosen": {shape: v["kernel"] for shape, v in stage.kernels["shapes"].items()}, "step_ms": costs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["tiny-1b", "q46m-v4k", "llama-deep"], choices=list(ALL))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cap", type=int, default=8, help="the batch cap the chooser and the step costs time")
    args = ap.parse_args()
    from fellow.runtime.tools.export import export

    tmp = scratch_dir("swarm-bench-load-")
    rows = []
    for name in args.shapes:
        ckpt = make_checkpoint(tmp / name / "hf", ALL[name])
        export(ckpt, tmp / name / "servable", stages=1, model_id=name)
        for r in range(args.rounds):
            for way in ("before", "now"):
                row = {"shape": name, "round": r, "way": way,
                       **measure(tmp / name / "servable", way == "before", args.cap)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| shape | round | kernel choice s: before / now | step costs s: before / now | same kernels |")
    print("|---|---|---|---|---|")
    for name in args.shapes:
        for r in range(args.rounds):
            b, n = (next(x for x in rows if x["shape"] == name and x["round"] == r and x["way"] == w)
                    for w in ("before", "now"))
            same = "yes" if b["chosen"] == n["chosen"] else f"no: {b['chosen']} / {n['chosen']}"
            print(f"| {name} | {r + 1} | {b['choose_s']:.2f} / {n['choose_s']:.2f} | "
                  f"{b['step_costs_s']:.2f} / {n['step_costs_s']:.2f} | {same} |")


if __name__ == "__main__":
    main()
