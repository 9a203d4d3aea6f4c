"""Decode on a GPU over the matrix of model shapes, all in one run: HF `generate` against the engine
alone over the stage as a fellow loads it, with its decode step replayed as CUDA graphs
(SWARM_SERVE_CUDA_GRAPHS=auto) and stepped eagerly (off), at 1 and 8 streams (issue 13).

    .venv/bin/python bench/bench_cuda_graphs.py [--shapes A B ...] [--tokens 64] [--device cuda:0]

The shapes are bench_matrix.py's (random models, end-of-turn rows zeroed, so no reply ends early),
in the card's half precision (bfloat16 where it has it). Each row also shows what the load chose
(``kernels.cuda_graphs``: its path, or why not, and the step times it measured) and the stage's
decode ms per token. ``--device cpu`` runs the same script on a CPU, where no graph is captured:
a check that the script runs, not a measurement of graphs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, engine_alone, make_checkpoint, prompts_for  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate_rate(model, tok, batch: int, tokens: int, device: torch.device) -> float:
    enc = tok.pad({"input_ids": prompts_for(tok, batch)}, return_tensors="pt").to(device)

    def run(n: int) -> float:
        _sync(device)
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
        _sync(device)
        return time.perf_counter() - started

    run(4)
    return max(batch * (tokens - 1) / (run(tokens) - run(1)) for _ in range(3))


def run_shape(name: str, shape: tuple, tmp: Path, tokens: int, streams: list[int], device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from events.stage import StageOptions
    from fellow.runtime.model.load.loader import load_one_stage, pick_dtype
    from fellow.runtime.tools.export import export

    ckpt = make_checkpoint(tmp / name / "hf", shape)
    servable = tmp / "servables" / name
    export(ckpt, servable, stages=1, model_id=name)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    tok.padding_side = "left"
    dtype = pick_dtype(device)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).to(device).eval()
    row = {"name": name, "dtype": str(dtype).removeprefix("torch."),
           "generate": {b: generate_rate(model, tok, b, tokens, device) for b in streams}}
    del model
    for label, graphs in (("graphs", True), ("eager", False)):
        stage = load_one_stage(servable, str(device), StageOptions(max_batch=max(streams), cuda_graphs=graphs)).stage
        row[label] = {b: engine_alone(stage, tok, b, tokens)[0] for b in streams}  # tokens reach the host: synchronized
        if graphs:
            row["chosen"] = stage.kernels.cuda_graphs or {"path": "n/a", "why": f"a {device.type} stage"}
        del stage
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per stream")
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows, tmp = [], scratch_dir("bench-cuda-graphs-")
    for name in args.shapes:
        rows.append(run_shape(name, SHAPES[name], tmp, args.tokens, args.streams, device))
        print(json.dumps(rows[-1]), flush=True)
    heads = " | ".join(f"generate {b} | graphs {b} | eager {b} | graphs/gen {b} | eager/gen {b}" for b in args.streams)
    print(f"\n| shape | dtype | chosen | {heads} |")
    print("|---|---|---|" + "---|" * 5 * len(args.streams))
    for r in rows:
        chosen = r["chosen"].get("path", "?") if r["chosen"].get("path") != "eager" else f"eager ({r['chosen']['why']})"
        cells = " | ".join(f"{r['generate'][b]:.1f} | {r['graphs'][b]:.1f} | {r['eager'][b]:.1f} | "
                           f"{r['graphs'][b] / r['generate'][b]:.2f}x | {r['eager'][b] / r['generate'][b]:.2f}x"
                           for b in args.streams)
        print(f"| {r['name']} | {r['dtype']} | {chosen} | {cells} |")
    for b in args.streams:
        ratios = [r["graphs"][b] / r["generate"][b] for r in rows]
        print(f"graphs / generate at {b} stream(s): min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
