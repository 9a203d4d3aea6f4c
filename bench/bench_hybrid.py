"""Decode speed of a hybrid (Qwen3-Next) stage: linear-attention layers with per-session states.

For each shape, in one run: transformers' ``generate`` (greedy, one stream and a batch of 8 equal-length
prompts), the stage one stream, and the stage at 8 sessions two ways: each session alone through the
layers (``StageModel.each_alone``, how decode steps ran before RecurrentBatchedView) and batched (the
states stacked). Tokens/s of decode after the prompt; ratios against the same run's baselines, with the
min and median over the shapes.

    .venv/bin/python bench/bench_hybrid.py [--tokens 32] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from fellow.runtime.model.stage import StageModel

SHAPES = {  # name: (hidden, layers, linear heads k / v, experts)
    "next-h256-l8": (256, 8, (4, 8), 8),
    "next-h512-l4": (512, 4, (4, 8), 4),
    "next-h384-l12": (384, 12, (2, 4), 8),
}
VOCAB, PROMPT = 4096, 16


def model_of(hidden: int, layers: int, heads: tuple[int, int], experts: int) -> Qwen3NextForCausalLM:
    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=2, head_dim=64, intermediate_size=3 * hidden, linear_num_key_heads=heads[0],
        linear_num_value_heads=heads[1], linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=hidden,
        shared_expert_intermediate_size=hidden, max_position_embeddings=4096,
        layer_types=[("full_attention" if i % 4 == 3 else "linear_attention") for i in range(layers)])
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(config).eval()


def prompts(n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, PROMPT), generator=torch.Generator().manual_seed(n))


@torch.inference_mode()
def generate_tps(model, rows: int, tokens: int) -> float:
    ids = prompts(rows)
    mask = torch.ones_like(ids)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm
    started = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, do_sample=False)
    full = time.perf_counter() - started
    started = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    prompt = time.perf_counter() - started
    return rows * tokens / max(full - prompt, 1e-9)


@torch.inference_mode()
def stage_tps(stage: StageModel, rows: int, tokens: int, alone: bool) -> float:
    caches = [stage.new_cache() for _ in range(rows)]
    last = torch.stack([stage.prefill(c, p) for c, p in zip(caches, prompts(rows))]).argmax(-1)
    step = (lambda ids: stage.each_alone(caches, [ids[r : r + 1] for r in range(rows)])) if alone else \
        (lambda ids: stage.decode(caches, ids))
    last = step(last).argmax(-1)  # warm
    started = time.perf_counter()
    for _ in range(tokens):
        last = step(last).argmax(-1)
    took = time.perf_counter() - started
    for cache in caches:
        cache.release()
    return rows * tokens / took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads, {args.tokens} new tokens per stream")
    rows = []
    for name, shape in SHAPES.items():
        model = model_of(*shape)
        stage = StageModel.from_causal_lm(model)
        r = {"name": name, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
             "gen1": generate_tps(model, 1, args.tokens), "gen8": generate_tps(model, 8, args.tokens),
             "stage1": stage_tps(stage, 1, args.tokens, alone=False),
             "alone8": stage_tps(stage, 8, args.tokens, alone=True),
             "batched8": stage_tps(stage, 8, args.tokens, alone=False)}
        print(r, flush=True)
        rows.append(r)
    print("\n| shape | params | generate 1 | stage 1 | generate 8 | stage 8 alone | stage 8 batched | stage/gen 1 "
          "| batched/alone 8 | batched/gen 8 |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['params_m']:.0f}M | {r['gen1']:.1f} | {r['stage1']:.1f} | {r['gen8']:.1f} | "
              f"{r['alone8']:.1f} | {r['batched8']:.1f} | {r['stage1'] / r['gen1']:.2f}x | "
              f"{r['batched8'] / r['alone8']:.2f}x | {r['batched8'] / r['gen8']:.2f}x |")
    for label, num, den in (("stage / generate, 1 stream", "stage1", "gen1"),
                            ("batched / alone, 8 sessions", "batched8", "alone8"),
                            ("batched / generate, 8 streams", "batched8", "gen8")):
        ratios = [r[num] / r[den] for r in rows]
        print(f"{label}: min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
