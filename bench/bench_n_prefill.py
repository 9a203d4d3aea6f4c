"""``n`` choices on one prompt: time to first token with n = 4 against n = 1, the choices forking from one
prefill (fellow.runtime.engine.forks, the default) and each running its own (forks off), in one run over a
matrix of shapes. The engine serves the stage as a fellow does (fused layers, kernels chosen at load,
prefill pieces of 256), in this process; the n sessions are added together, as the intake hands over a
request's choices, and time to first token is until every choice has its first token.

    .venv/bin/python bench/bench_n_prefill.py [--shapes q46m-v4k llama-deep q2-wide-mlp] [--prompt 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from events.requests import Sampling  # noqa: E402
from fellow.runtime.engine import engine as engine_module  # noqa: E402
from fellow.runtime.engine.engine import local_engine  # noqa: E402
from fellow.runtime.engine.session import Session  # noqa: E402


def ttft_ms(stage, ids: list[int], n: int, forks: bool) -> float:
    """ms until each of ``n`` sessions of prompt ``ids`` (seeds 0..n-1) has its first token."""
    twins = engine_module.twins
    if not forks:
        engine_module.twins = lambda sessions: {}
    try:
        engine = local_engine(stage, kv_tokens=1 << 20, prefix_cache=False)
        sessions = [Session(f"c{i}", ids, 1, Sampling(temperature=1.0, seed=i)) for i in range(n)]
        started = time.perf_counter()
        for s in sessions:
            engine.add(s)
        while engine.busy:
            engine.step()
        return (time.perf_counter() - started) * 1e3
    finally:
        engine_module.twins = twins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["q46m-v4k", "llama-deep", "q2-wide-mlp"], choices=list(SHAPES))
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from fellow.runtime.model.load.kernels import prepare_stage
    from fellow.runtime.model.stage import StageModel

    print(f"{args.prompt}-token prompt, {args.rounds} interleaved rounds (median), {torch.get_num_threads()} threads")
    print("\n| shape | n=1 ms | n=4 forked ms | n=4 unforked ms | forked / n=1 | unforked / n=1 |"
          "\n|---|---|---|---|---|---|")
    ratios = []
    for name in args.shapes:
        ckpt = make_checkpoint(scratch_dir("swarm-bench-n-"), SHAPES[name])
        model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        stage = StageModel.from_causal_lm(model)
        prepare_stage(stage, batch_cap=4)
        ids = torch.randint(10, model.config.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0))
        ids = ids.tolist()
        ttft_ms(stage, ids, 1, True)  # warm
        runs = {"one": [], "forked": [], "unforked": []}
        for _ in range(args.rounds):
            runs["one"].append(ttft_ms(stage, ids, 1, True))
            runs["forked"].append(ttft_ms(stage, ids, 4, True))
            runs["unforked"].append(ttft_ms(stage, ids, 4, False))
        med = {k: statistics.median(v) for k, v in runs.items()}
        ratios.append(med["forked"] / med["one"])
        print(f"| {name} | {med['one']:.0f} | {med['forked']:.0f} | {med['unforked']:.0f} | "
              f"{med['forked'] / med['one']:.2f}x | {med['unforked'] / med['one']:.2f}x |")
    print(f"\nn=4 forked / n=1: min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x, "
          f"max {max(ratios):.2f}x")


if __name__ == "__main__":
    main()
