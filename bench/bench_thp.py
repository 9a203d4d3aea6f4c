"""Transparent huge pages for a CPU stage's tensors (torch's THP_MEM_ALLOC_ENABLE), on and off, over the
matrix's shapes: the engine alone at 1 and 8 streams, its time to the first token, and what the load spent
measuring (the kernel choice and the step costs), each in a fresh process, the two ways alternated.

    .venv/bin/python bench/bench_thp.py [--shapes A B ...] [--rounds 3] [--tokens 48]

With THP_MEM_ALLOC_ENABLE=1, torch aligns every CPU allocation of 2 MB or more to 2 MB and asks the kernel
for huge pages there (madvise), which this machine's kernel gives where asked
(/sys/kernel/mm/transparent_hugepage/enabled: madvise). A decode step reads every weight: with 4 KB pages
that is a TLB miss every 4 KB; a fresh KV buffer or decode slab faults in 4 KB at a time. The figure is
the median over rounds of on / off within the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, engine_alone, make_checkpoint  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402


def child(servable: Path, ckpt: Path, tokens: int, streams: list[int]) -> dict:
    from transformers import AutoTokenizer

    from events.stage import StageOptions
    from fellow.runtime.model.load.kernels import step_costs
    from fellow.runtime.model.load.loader import load_one_stage

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    started = time.perf_counter()
    stage = load_one_stage(servable, "cpu", StageOptions(max_batch=max(streams))).stage
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    step_costs(stage, sorted({1, max(streams)}))
    steps_s = time.perf_counter() - started
    rates = {b: engine_alone(stage, tok, b, tokens) for b in streams}
    return {"load_s": round(load_s, 3), "choose_s": stage.kernels.seconds, "step_costs_s": round(steps_s, 3),
            "rate": {b: rate for b, (rate, _) in rates.items()}, "first_ms": rates[min(streams)][1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("SERVABLE", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child[0]), Path(args.child[1]), args.tokens, args.streams)))
        return
    from fellow.runtime.tools.export import export

    tmp = scratch_dir("swarm-bench-thp-")
    rows = []
    for name in args.shapes:
        ckpt = make_checkpoint(tmp / name / "hf", SHAPES[name])
        servable = tmp / name / "servable"
        export(ckpt, servable, stages=1, model_id=name)
        for r in range(args.rounds):
            for thp in ("0", "1") if r % 2 == 0 else ("1", "0"):
                out = subprocess.run([sys.executable, __file__, "--child", str(servable), str(ckpt), "--tokens",
                                      str(args.tokens), "--streams", *map(str, args.streams)],
                                     env={**os.environ, "THP_MEM_ALLOC_ENABLE": thp}, capture_output=True, text=True,
                                     check=True)
                row = {"shape": name, "round": r, "thp": thp == "1", **json.loads(out.stdout.strip().splitlines()[-1])}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| shape | "
          + " | ".join(f"{b} stream(s) tok/s: off / on (on/off, median over rounds)" for b in args.streams)
          + " | first token ms: off / on | kernel choice + step costs s: off / on |")
    print("|---|" + "---|" * (len(args.streams) + 2))
    gains = {b: [] for b in args.streams}
    for name in args.shapes:
        def pair(key, r, name=name):
            return [next(x for x in rows if x["shape"] == name and x["round"] == r and x["thp"] == on)[key]
                    for on in (False, True)]
        cells = []
        for b in args.streams:
            pairs = [pair("rate", r) for r in range(args.rounds)]
            ratio = statistics.median(on[str(b)] / off[str(b)] for off, on in pairs)
            gains[b].append(ratio)
            cells.append(f"{statistics.median(p[0][str(b)] for p in pairs):.1f} / "
                         f"{statistics.median(p[1][str(b)] for p in pairs):.1f} ({ratio:.2f}x)")
        firsts = [pair("first_ms", r) for r in range(args.rounds)]
        cells.append(f"{statistics.median(f[0] for f in firsts):.1f} / {statistics.median(f[1] for f in firsts):.1f}")
        measured = [[a + b for a, b in zip(pair("choose_s", r), pair("step_costs_s", r))] for r in range(args.rounds)]
        cells.append(f"{statistics.median(m[0] for m in measured):.2f} / "
                     f"{statistics.median(m[1] for m in measured):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for b in args.streams:
        print(f"on / off at {b} stream(s): min {min(gains[b]):.2f}x, median {statistics.median(gains[b]):.2f}x")


if __name__ == "__main__":
    main()
