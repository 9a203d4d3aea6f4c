"""Does the compiled decode step (SWARM_SERVE_COMPILE, max-autotune) give HF `generate`'s greedy replies
on the matrix's shapes? The tests check it on tiny models in inductor's default mode (max-autotune takes
too long for CI); this checks the mode a stage serves with, on bench/bench_matrix.py's shapes.

    .venv/bin/python bench/bench_compiled_greedy.py [--shapes A B ...] [--prompts 4] [--tokens 64] [--batch 8]

Each shape: a stage loaded with its decode step compiled at batch 1 (kept only where it timed faster;
the line says whether it was), then per prompt of 20 random ids, `--tokens` greedy tokens through the
stage against `generate`'s. With ``--batch N`` the stage compiles batches 1 and N, and the prompts
(14, 16, ... ids: pasts of different lengths) decode together, N at a time, each row against
`generate`'s reply to its prompt alone: the batched step (compiled where kept, else fused) and the
decode slab. Prints one JSON line per shape.
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


def check(name: str, tmp: Path, prompts: int, tokens: int, batch: int = 1) -> dict:
    from transformers import AutoModelForCausalLM

    from events.stage import StageOptions
    from fellow.runtime.model.load.loader import load_one_stage
    from fellow.runtime.tools.export import export

    ckpt = make_checkpoint(tmp / name / "hf", SHAPES[name])
    export(ckpt, tmp / "servables" / name, stages=1, model_id=name)
    sizes = (1,) if batch == 1 else (1, batch)
    stage = load_one_stage(tmp / "servables" / name, "cpu", StageOptions(max_batch=max(8, batch), compile=sizes)).stage
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    identical, first_difference = 0, []
    steps = stage.compiled.steps if stage.compiled is not None else 0
    vocab = model.config.vocab_size
    every = [torch.randint(0, vocab, (20 if batch == 1 else 14 + 2 * seed,),
                           generator=torch.Generator().manual_seed(seed)).tolist() for seed in range(prompts)]
    for start in range(0, prompts, batch):
        group = every[start : start + batch]
        wants = []
        with torch.inference_mode():
            for ids in group:
                inputs = torch.tensor([ids])
                wants.append(model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=tokens,
                                            min_new_tokens=tokens, do_sample=False)[0, len(ids):].tolist())
            caches = [stage.new_cache() for _ in group]
            logits = torch.cat([stage.prefill(cache, torch.tensor(ids)).reshape(1, -1)
                                for cache, ids in zip(caches, group)])
            gots = [[] for _ in group]
            for _ in range(tokens):
                for got, row in zip(gots, logits):
                    got.append(int(row.argmax()))
                logits = stage.decode(caches, torch.tensor([got[-1] for got in gots]))
            for cache in caches:
                cache.release()
        for got, want in zip(gots, wants):
            identical += got == want
            first_difference.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None))
    return {"batch": batch, "name": name, "compiled_serving": stage.kernels.compiled.get("serving"),
            "compiled_steps": (stage.compiled.steps - steps) if stage.compiled is not None else 0,
            "identical_replies": f"{identical}/{prompts}", "first_difference": first_difference}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="sessions decoded together (compiled at 1 and this)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-bench-greedy-") as tmp:
        for name in args.shapes:
            print(json.dumps(check(name, Path(tmp), args.prompts, args.tokens, args.batch)), flush=True)


if __name__ == "__main__":
    main()
