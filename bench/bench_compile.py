"""Would `torch.compile` make the CPU decode step faster? The stage's own decode step (fused layers,
kernels chosen at load, a growing KV cache per session) against one decode step written with static
shapes and compiled by inductor (`freezing` + `max-autotune-no-cudagraphs`), on shapes of
bench/bench_matrix.py, in the same process, timed in alternating rounds.

    .venv/bin/python bench/bench_compile.py [--shapes llama-deep q46m-v4k] [--batch 1] [--max 512]

The compiled step holds each layer's keys and values in a fixed buffer [batch, kv_heads, MAX, head_dim]
and masks the positions past each row's length, so one graph serves every step of a batch of that size
(the stage's engine does not: this measures what such a path would give, it is not one). Its weights are
the checkpoint's, plain float32: inductor's freezing packs them itself. Both read caches of --context
random positions; the logits of one step are compared. Compile time is the first call, with inductor's
cache in a fresh temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402


class StaticStep(nn.Module):
    """One decode step of a Llama-family model (Llama, Qwen2, Qwen3) with static shapes."""

    def __init__(self, model) -> None:
        super().__init__()
        cfg = model.config
        self.hidden, self.heads, self.kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.dim = getattr(cfg, "head_dim", None) or self.hidden // self.heads
        self.inter, self.eps = cfg.intermediate_size, float(model.model.norm.variance_epsilon)
        self.rope_scale = float(model.model.rotary_emb.attention_scaling)
        self.n = len(model.model.layers)
        self.scaling = [layer.self_attn.scaling for layer in model.model.layers]

        def keep(name: str, t: torch.Tensor | None) -> None:
            self.register_buffer(name, None if t is None else t.detach().clone().contiguous())

        for i, layer in enumerate(model.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            keep(f"in{i}", layer.input_layernorm.weight)
            keep(f"qkv{i}", torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            keep(f"qkvb{i}", None if a.q_proj.bias is None
                 else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
            keep(f"qkn{i}", None if getattr(a, "q_norm", None) is None else torch.cat(
                [a.q_norm.weight.expand(self.heads, -1), a.k_norm.weight.expand(self.kv, -1)]))
            keep(f"o{i}", a.o_proj.weight)
            keep(f"post{i}", layer.post_attention_layernorm.weight)
            keep(f"gu{i}", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            keep(f"down{i}", mlp.down_proj.weight)
        keep("norm", model.model.norm.weight)
        keep("head", model.lm_head.weight)
        keep("embed", model.model.embed_tokens.weight)
        keep("inv_freq", model.model.rotary_emb.inv_freq)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        """ids, pos [B]; kv: per layer keys, values [B, kv_heads, MAX, D]. The logits [B, vocab]."""
        batch, size, d, qk_heads = ids.shape[0], kv[0].shape[2], self.dim, self.heads + self.kv

        def w(name: str, i: int) -> torch.Tensor:
            return getattr(self, f"{name}{i}")

        hidden = F.embedding(ids, self.embed)[:, None]
        freqs = pos[:, None].float() * self.inv_freq[None]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * self.rope_scale, angles.sin() * self.rope_scale
        sin = torch.cat((-sin[..., : d // 2], sin[..., d // 2 :]), dim=-1)
        cos, sin = cos[:, None, None], sin[:, None, None]
        mask = (torch.arange(size)[None] <= pos[:, None])[:, None, None, :]
        rows, kv_heads = torch.arange(batch)[:, None], torch.arange(self.kv)[None, :]
        for i in range(self.n):
            qkv = F.linear(F.rms_norm(hidden, (self.hidden,), w("in", i), self.eps), w("qkv", i), w("qkvb", i))
            qk = qkv[..., : qk_heads * d].view(batch, 1, qk_heads, d)
            if w("qkn", i) is not None:
                qk = F.rms_norm(qk, (d,), None, self.eps) * w("qkn", i)
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
            q, k = qk[:, :, : self.heads].transpose(1, 2), qk[:, :, self.heads :].transpose(1, 2)
            v = qkv[..., qk_heads * d :].view(batch, 1, self.kv, d).transpose(1, 2)
            keys, values = kv[2 * i], kv[2 * i + 1]
            keys.index_put_((rows, kv_heads, pos[:, None]), k[:, :, 0])
            values.index_put_((rows, kv_heads, pos[:, None]), v[:, :, 0])
            queries = q.reshape(batch, self.kv, self.heads // self.kv, d)
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scaling[i])
            hidden = hidden + F.linear(attended.reshape(batch, 1, self.heads * d), w("o", i))
            gate, up = F.linear(F.rms_norm(hidden, (self.hidden,), w("post", i), self.eps), w("gu", i)).split(
                self.inter, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, w("down", i))
        return F.linear(F.rms_norm(hidden[:, -1], (self.hidden,), self.norm, self.eps), self.head)


def median_ms(step, n: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def run_shape(name: str, tmp: Path, batch: int, size: int, context: int, rounds: int, steps: int) -> dict:
    from transformers import AutoModelForCausalLM

    from events.stage import StageOptions
    from fellow.runtime.model.load.loader import load_one_stage
    from fellow.runtime.tools.export import export

    ckpt = make_checkpoint(tmp / name / "hf", SHAPES[name])
    export(ckpt, tmp / "servables" / name, stages=1, model_id=name)
    stage = load_one_stage(tmp / "servables" / name, "cpu", StageOptions(max_batch=max(8, batch))).stage
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    static = StaticStep(model)
    del model
    torch.manual_seed(1)
    caches = [stage.new_cache() for _ in range(batch)]
    for cache in caches:  # --context random positions, the same in both
        cache.reserve(context + 8)
        for keys, values in zip(cache.keys, cache.values):
            keys.normal_(), values.normal_()
        cache.advance(context)
    kv = []
    for i in range(static.n):
        for part in ("keys", "values"):
            buffer = torch.zeros(batch, static.kv, size, static.dim)
            for row, cache in enumerate(caches):
                buffer[row, :, :context] = getattr(cache, part)[0][i, :, :context]
            kv.append(buffer)
    ids = torch.randint(0, static.embed.shape[0], (batch,))
    pos = torch.full((batch,), context, dtype=torch.long)

    def eager() -> torch.Tensor:
        out = stage.decode(caches, ids)
        for cache in caches:
            cache.crop_to(context)  # the same state every step
        return out

    torch._dynamo.reset()
    torch._inductor.config.freezing = True
    compiled = torch.compile(static, dynamic=False, mode="max-autotune-no-cudagraphs")
    started = time.perf_counter()
    got = compiled(ids, pos, *kv)
    compile_s = time.perf_counter() - started
    want = eager()
    row = {"name": name, "batch": batch, "max": size, "compile_s": round(compile_s, 1),
           "max_logit_diff": float((got - want).abs().max()), "eager": [], "compiled": []}
    for _ in range(rounds):
        row["eager"].append(median_ms(eager, steps))
        row["compiled"].append(median_ms(lambda: compiled(ids, pos, *kv), steps))
    row["eager_ms"], row["compiled_ms"] = statistics.median(row["eager"]), statistics.median(row["compiled"])
    row["speedup"] = row["eager_ms"] / row["compiled_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max", type=int, default=512, help="positions of the compiled step's fixed KV buffers")
    ap.add_argument("--context", type=int, default=256, help="positions already in each cache")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per round (the median counts)")
    args = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(scratch_dir("swarm-bench-inductor-")))
    print(f"{torch.get_num_threads()} threads, batch {args.batch}, MAX {args.max}, context {args.context}", flush=True)
    tmp = scratch_dir("swarm-bench-compile-")
    rows = []
    for name in args.shapes:
        rows.append(run_shape(name, tmp, args.batch, args.max, args.context, args.rounds, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| shape | batch | eager stage ms/step | compiled static step ms/step | speed-up | compile s "
          "| max logit diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['batch']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {r['speedup']:.2f}x | "
              f"{r['compile_s']:.0f} | {r['max_logit_diff']:.1e} |")
    ratios = sorted(r["speedup"] for r in rows)
    print(f"\nspeed-up over {len(rows)} shapes: min {ratios[0]:.2f}x, median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
