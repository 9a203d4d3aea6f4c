"""Does the compiled decode step (SWARM_SERVE_COMPILE, max-autotune) give HF `generate`'s greedy replies
on the matrix's shapes? The tests check it on tiny models in inductor's default mode (max-autotune takes
too long for CI); this checks the mode a stage serves with, on bench/bench_matrix.py's shapes.

    .venv/bin/python bench/bench_compiled_greedy.py [--shapes A B ...] [--prompts 4] [--tokens 64]

Each shape: a stage loaded with its decode step compiled at batch 1 (kept only where it timed faster;
the line says whether it was), then per prompt of 20 random ids, `--tokens` greedy tokens through the
stage against `generate`'s. Prints one JSON line per shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402


def check(name: str, tmp: Path, prompts: int, tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    from fellow.runtime.model.loader import load_one_stage
    from fellow.runtime.tools.export import export

    ckpt = make_checkpoint(tmp / name / "hf", SHAPES[name])
    export(ckpt, tmp / "servables" / name, stages=1, model_id=name)
    stage = load_one_stage(tmp / "servables" / name, device="cpu", batch_cap=8, compile=(1,)).stage
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    identical, first_difference = 0, []
    steps = stage.compiled.steps if stage.compiled is not None else 0
    for seed in range(prompts):
        ids = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(seed)).tolist()
        with torch.inference_mode():
            inputs = torch.tensor([ids])
            want = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=tokens,
                                  min_new_tokens=tokens, do_sample=False)[0, len(ids):].tolist()
        cache = stage.new_cache()
        logits = stage.prefill(cache, torch.tensor(ids))
        got = []
        for _ in range(tokens):
            got.append(int(logits.argmax()))
            logits = stage.decode([cache], torch.tensor([got[-1]]))[0]
        identical += got == want
        first_difference.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None))
    return {"name": name, "compiled_serving": stage.kernels["compiled"].get("serving"),
            "compiled_steps": (stage.compiled.steps - steps) if stage.compiled is not None else 0,
            "identical_replies": f"{identical}/{prompts}", "first_difference": first_difference}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="swarm-bench-greedy-"))
    for name in args.shapes:
        print(json.dumps(check(name, tmp, args.prompts, args.tokens)), flush=True)


if __name__ == "__main__":
    main()
