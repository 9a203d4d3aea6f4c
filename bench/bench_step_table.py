"""What the step table costs a decode step: ``StageModel.decode`` (through ``steps.table.StepTable``) against
the form it picks called directly, on shapes of bench/bench_matrix.py (issue 52: speed unchanged).

    .venv/bin/python bench/bench_step_table.py [--shapes q46m-v4k llama-deep q36m-l20] [--rows 1 8]

Per shape and batch size, for the eager fused form and (where it builds) the native C step put in the table's
``compiled`` slot: the median of 40 steps after 5 warm ones, each step's new position cropped away again, the
two ways alternated over three rounds; the ratio is the median of the rounds' table / direct.
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

PAST = 64


def median_ms(step, caches, steps: int = 40) -> float:
    for _ in range(5):
        step()
        for cache in caches:
            cache.crop_to(PAST)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
        for cache in caches:
            cache.crop_to(PAST)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def run_shape(name: str, tmp: Path, rows_list: list[int]) -> list[dict]:
    from events.stage import StageOptions
    from fellow.runtime.model.forms.native_step import NativeStep, why_not as native_why_not
    from fellow.runtime.model.kv_cache import random_caches
    from fellow.runtime.model.load.loader import load_one_stage
    from fellow.runtime.tools.export import export

    ckpt = make_checkpoint(tmp / name / "hf", SHAPES[name])
    export(ckpt, tmp / "servables" / name, stages=1, model_id=name)
    # compile=None: SWARM_SERVE_COMPILE=auto, which keeps the plain weights the native step is built from
    stage = load_one_stage(tmp / "servables" / name, "cpu", StageOptions(compile=None)).stage
    plain = stage.plain_weights  # kept for the background compile, which this process does not start
    forms = {"fused": None}
    if plain is not None and native_why_not(stage) is None:
        forms["native"] = NativeStep(stage, plain)
    out = []
    for form, step in forms.items():
        for rows in rows_list:
            if step is not None and not step.build(rows, only_faster=False)["serving"]:
                continue
            stage.steps.put("compiled", step)
            direct = stage.steps.eager if step is None else step
            caches = random_caches(stage.new_cache, rows, PAST, 1, torch.Generator().manual_seed(rows))
            ids = torch.randint(0, 1000, (rows,))
            assert stage.steps.choose(caches) is direct
            table, alone = [], []
            for _ in range(3):
                table.append(median_ms(lambda: stage.decode(caches, ids), caches))
                alone.append(median_ms(lambda: direct.decode(caches, ids), caches))
            for cache in caches:
                cache.release()
            result = {"shape": name, "form": form, "rows": rows, "table_ms": [round(t, 3) for t in table],
                      "direct_ms": [round(t, 3) for t in alone],
                      "table_over_direct": round(statistics.median(t / a for t, a in zip(table, alone)), 3)}
            print(json.dumps(result), flush=True)
            out.append(result)
        stage.steps.put("compiled", None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["q46m-v4k", "llama-deep", "q36m-l20"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            results += run_shape(name, Path(tmp), args.rows)
    print("\n| shape | form | rows | table ms | direct ms | table / direct |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['form']} | {r['rows']} | {statistics.median(r['table_ms']):.3f} | "
              f"{statistics.median(r['direct_ms']):.3f} | {r['table_over_direct']:.3f} |")
    ratios = sorted(r["table_over_direct"] for r in results)
    print(f"\ntable / direct: min {ratios[0]:.3f}, median {statistics.median(ratios):.3f}, max {ratios[-1]:.3f}")


if __name__ == "__main__":
    main()
