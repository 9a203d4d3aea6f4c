"""CPU weight-only int8 / int4 and bitsandbytes NF4 stages against float32, all in one run: decode tokens/s
at 1 and 8 streams of HF `generate` (float32), the float32 stage, and the int8, int4-fast and nf4 stages,
each driven by the engine as a fellow serves it (bench/bench_matrix.py's `engine_alone`), on shapes of
bench/bench_matrix.py.

    .venv/bin/python bench/bench_quant.py [--shapes q46m-v4k llama-deep] [--streams 1 8] [--tokens 48] [--threads N]

Also prints each stage's measured weight bytes (fellow.runtime.model.quant.report.stage_weights) against float32's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, engine_alone, hf_generate, prepare  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402

METHODS = ("none", "int8", "int4-fast", "nf4")


def run_shape(name: str, tmp: Path, tokens: int, streams: list[int]) -> dict:
    from events.stage import StageOptions
    from fellow.runtime.model.load.loader import load_one_stage

    _, tok, model = prepare(name, SHAPES[name], tmp)
    row = {"name": name, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
           "generate": {b: hf_generate(model, tok, b, tokens) for b in streams}}
    del model
    for method in METHODS:
        stage = load_one_stage(tmp / "servables" / name, "cpu",
                               StageOptions(max_batch=max(streams), quantization=method)).stage
        row[method] = {b: engine_alone(stage, tok, b, tokens)[0] for b in streams}
        row[f"{method}_mb"] = stage.weights["bytes"] / 1e6
        del stage
    return row


def table(rows: list[dict], streams: list[int]) -> str:
    quantized = METHODS[1:]
    head = "| shape | params |"
    for b in streams:
        head += f" generate {b} | fp32 stage {b} |" + "".join(f" {m} {b} |" for m in quantized)
        head += "".join(f" {m}/gen {b} |" for m in quantized) + "".join(f" {m}/fp32 stage {b} |" for m in quantized)
    head += " weights MB " + " / ".join(("fp32", *quantized)) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["name"], f"{r['params_m']:.0f}M"]
        for b in streams:
            g, f = r["generate"][b], r["none"][b]
            cells += [f"{g:.1f}", f"{f:.1f}", *(f"{r[m][b]:.1f}" for m in quantized),
                      *(f"{r[m][b] / g:.2f}x" for m in quantized), *(f"{r[m][b] / f:.2f}x" for m in quantized)]
        cells.append(" / ".join(f"{r[f'{m}_mb']:.1f}" for m in METHODS))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[dict], streams: list[int]) -> str:
    out = []
    for b in streams:
        for method in METHODS[1:]:
            for base, label in (("generate", "generate"), ("none", "float32 stage")):
                ratios = sorted(r[method][b] / r[base][b] for r in rows)
                out.append(f"{method} / {label} at {b} stream(s): min {ratios[0]:.2f}x, "
                           f"median {statistics.median(ratios):.2f}x")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["q46m-v4k", "llama-deep"], choices=list(SHAPES))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per stream")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, one per core)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads, {args.tokens} new tokens per stream", flush=True)
    run_shapes("swarm-bench-quant-", args.shapes, lambda name, tmp: run_shape(name, tmp, args.tokens, args.streams),
               lambda rows: (table(rows, args.streams), summary(rows, args.streams)))


def run_shapes(prefix: str, shapes: list[str], run, report) -> list[dict]:
    """``run(name, tmp)`` for each shape in one temporary folder, each row printed as it comes, then
    ``report(rows)``'s texts (bench_quant's tables and summaries; bench_lora's too)."""
    tmp = scratch_dir(prefix)
    rows = []
    for name in shapes:
        rows.append(run(name, tmp))
        print(json.dumps(rows[-1], default=str), flush=True)
    for text in report(rows):
        print()
        print(text)
    return rows


if __name__ == "__main__":
    main()
