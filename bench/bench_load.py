"""What a stage's load spends measuring (issue 13's budget: under 2 s for a 1B model on a CPU): the
kernel choice (each weight shape timed under each kernel, ``fellow.runtime.model.load.kernels``) and the
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


# the module settings each way changes; "now" is the code's own
WAYS = {
    # seven timed calls per kernel and row count, each after reading 64 MiB, every kernel timed to the end;
    # an untimed step and three timed ones per batch size, every cache position drawn
    "before": {"MIN_SAMPLES": "SAMPLES", "FLUSH_BIG": True, "STEP_COST_BUDGET_S": float("inf"),
               "STEP_WARM_EACH": True, "CLEAR_LOSER": float("inf"), "WARM_BIG": True, "STEP_SLAB_FIRST": False,
               "STEP_COST_TILE": 0},
    # as of 2026-12-02 16:00: an untimed call before a big weight's samples, an untimed step readying the
    # largest batch (it builds the slab), every cache position drawn
    "last": {"WARM_BIG": True, "STEP_SLAB_FIRST": False, "STEP_COST_TILE": 0},
    "now": {},
}


def measure(servable: Path, way: str, cap: int) -> dict:
    from events.stage import StageOptions
    from fellow.runtime.model.load import kernels
    from fellow.runtime.model.load.loader import load_one_stage

    changes = {name: getattr(kernels, value) if isinstance(value, str) else value
               for name, value in WAYS[way].items()}
    saved = {name: getattr(kernels, name) for name in changes}
    for name, value in changes.items():
        setattr(kernels, name, value)
    try:
        started = time.perf_counter()
        stage = load_one_stage(servable, "cpu", StageOptions(max_batch=cap)).stage
        load_s = time.perf_counter() - started
        started = time.perf_counter()
        costs = kernels.step_costs(stage, sorted({1, cap}))
        steps_s = time.perf_counter() - started
    finally:
        for name, value in saved.items():
            setattr(kernels, name, value)
    return {"choose_s": stage.kernels.seconds, "step_costs_s": round(steps_s, 3), "load_s": round(load_s, 2),
            "chosen": {shape: v["kernel"] for shape, v in stage.kernels.shapes.items()}, "step_ms": costs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["tiny-1b", "q46m-v4k", "llama-deep"], choices=list(ALL))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cap", type=int, default=8, help="the batch cap the chooser and the step costs time")
    ap.add_argument("--ways", nargs="+", default=["before", "now"], choices=list(WAYS),
                    help="what to alternate: before, last (as of 2026-12-02 16:00), now")
    args = ap.parse_args()
    from fellow.runtime.tools.export import export

    tmp = scratch_dir("swarm-bench-load-")
    rows = []
    for name in args.shapes:
        ckpt = make_checkpoint(tmp / name / "hf", ALL[name])
        export(ckpt, tmp / name / "servable", stages=1, model_id=name)
        for r in range(args.rounds):
            for way in args.ways if r % 2 == 0 else args.ways[::-1]:  # the order alternated by round
                row = {"shape": name, "round": r, "way": way, **measure(tmp / name / "servable", way, args.cap)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    ways = " / ".join(args.ways)
    print(f"\n| shape | round | kernel choice s: {ways} | step costs s: {ways} | both s: {ways} | same kernels |")
    print("|---|---|---|---|---|---|")
    for name in args.shapes:
        for r in range(args.rounds):
            got = [next(x for x in rows if x["shape"] == name and x["round"] == r and x["way"] == w) for w in args.ways]
            same = "yes" if all(g["chosen"] == got[0]["chosen"] for g in got) else \
                "no: " + " / ".join(str(g["chosen"]) for g in got)
            cells = [" / ".join(f"{value(g):.2f}" for g in got)
                     for value in (lambda g: g["choose_s"], lambda g: g["step_costs_s"],
                                   lambda g: g["choose_s"] + g["step_costs_s"])]
            print(f"| {name} | {r + 1} | {' | '.join(cells)} | {same} |")


if __name__ == "__main__":
    main()
