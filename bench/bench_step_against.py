"""The native step's C kernel of this tree against the same kernel at another git revision, on one stage, the
two in turn: quiet, then beside a process that takes a core 1 ms in every 4 (as the leader, nats-server and
the clients take the stage's cores in the stack).

    .venv/bin/python bench/bench_step_against.py --rev REV [--shapes q46m-v4k q36m-l20]
        [--methods none int8 int4-fast] [--rows 1 8] [--rounds 7]

REV's ``step_kernel.py`` and ``step_products.py`` are read with ``git show`` and built beside this tree's (the
structs the step passes must be the same at both). Each stage is loaded as a fellow loads it
(``load_one_stage``); one ``NativeStep`` holds its weights and calls either kernel. Each figure is the median
over the rounds of the median of 10 steps, in ms, on caches of 64 random positions (cropped back after each
step), and the ratio REV / tree (above 1: this tree is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402
from bench.bench_native_step import crop  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from events.stage import StageOptions  # noqa: E402
from fellow.runtime.kernels import step_kernel  # noqa: E402
from fellow.runtime.model.forms import native_step  # noqa: E402
from fellow.runtime.model.kv_cache import random_caches  # noqa: E402
from fellow.runtime.model.load.loader import load_one_stage  # noqa: E402
from fellow.runtime.tools.export import export  # noqa: E402

NOISE = "import time\nwhile True:\n    t = time.perf_counter()\n    while time.perf_counter() - t < 0.001: pass\n" \
        "    time.sleep(0.003)\n"
MODEL = "fellow/runtime/model"


def kernel_at(rev: str, tmp: Path):
    """REV's step_kernel module (its own step_products beside it)."""
    for name in ("step_products", "step_kernel"):
        text = subprocess.run(["git", "show", f"{rev}:{MODEL}/{name}.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        text = text.replace("from fellow.runtime.model import native, step_products",
                            "from fellow.runtime.model import native\nimport step_products_at as step_products")
        (tmp / f"{name}_at.py").write_text(text)
    sys.path.insert(0, str(tmp))
    spec = importlib.util.spec_from_file_location("step_kernel_at", tmp / "step_kernel_at.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def median_ms(step, caches, context: int, passes: int = 10) -> float:
    times = []
    for _ in range(passes):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
        crop(caches, context)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def measure(name: str, method: str, rows: int, kernels: dict, tmp: Path, rounds: int, context: int = 64) -> dict:
    ckpt = make_checkpoint(tmp / f"{name}-hf", SHAPES[name])
    servable = tmp / f"{name}-servable"
    if not servable.exists():
        export(ckpt, servable, stages=1, model_id=name)
    stage = load_one_stage(servable, "cpu", StageOptions(quantization=method, compile=None)).stage
    step = native_step.NativeStep(stage, stage.plain_weights)
    caches = random_caches(stage.new_cache, rows, context, 1, torch.Generator().manual_seed(0))
    ids = torch.arange(7, 7 + rows)
    found = {"shape": name, "method": method, "rows": rows}
    for noise in (False, True):
        beside = subprocess.Popen([sys.executable, "-c", NOISE]) if noise else None
        times = {kind: [] for kind in kernels}
        try:
            for _ in range(rounds):
                for kind, module in kernels.items():
                    native_step.step_kernel = module  # NativeStep.decode calls the module's STEP
                    times[kind].append(median_ms(lambda: step.decode(caches, ids), caches, context))
        finally:
            native_step.step_kernel = step_kernel
            if beside is not None:
                beside.kill()
        at, tree = (statistics.median(times[kind]) for kind in kernels)
        found["noise" if noise else "quiet"] = {"rev_ms": round(at, 3), "tree_ms": round(tree, 3),
                                                "rev_over_tree": round(at / tree, 2)}
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    ap.add_argument("--shapes", nargs="+", default=["q46m-v4k", "q36m-l20"], choices=list(SHAPES))
    ap.add_argument("--methods", nargs="+", default=["none", "int8", "int4-fast"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    tmp = scratch_dir("bench-step-against-")
    kernels = {"rev": kernel_at(args.rev, tmp), "tree": step_kernel}
    print(f"{torch.get_num_threads()} torch threads, {args.rev} against the tree", flush=True)
    for name in args.shapes:
        for method in args.methods:
            for rows in args.rows:
                print(json.dumps(measure(name, method, rows, kernels, tmp, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
