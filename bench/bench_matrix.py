"""Decode speed over a matrix of model shapes, all in one run: the whole stack and the engine alone
against raw HF `generate`, at 1 and 8 streams, and the stage's ms per token against the memory-bandwidth
floor of each shape (weight bytes a token reads over this machine's read bandwidth, measured here).

    .venv/bin/python bench/bench_matrix.py [--shapes A B ...] [--tokens 64] [--no-stack] [--compile 1,8]

Every model is random (float32, CPU) with its end-of-turn rows zeroed, so no reply ends early and every
path decodes the same number of tokens. The stack is real: nats-server, a leader, a fellow and its stage
subprocess; clients stream from /v1/chat/completions. The engine alone is the stage as the fellow
serves it (fused layers, kernels chosen at load) driven in this process. TTFT added is the stack's
median time to first token over short prompts minus the engine's own prefill-and-first-token time.
``--compile``: the stage's decode step compiled at those batch sizes (SWARM_SERVE_COMPILE), in the engine
alone and in the stack's stage, each where it measured faster at load (fellow.runtime.model.forms.compiled).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_serving import QUESTIONS, load_test, stream_one  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from tests.serving_fixtures import Stack  # noqa: E402

# name: (family, hidden, layers, intermediate, vocab, heads, kv_heads, tied)
SHAPES = {
    "q46m-v4k": ("qwen3", 512, 8, 3072, 4096, 8, 4, True),  # MLP 6x, 4k vocabulary, tied: the user's shape
    "q45m-v32k": ("qwen3", 512, 8, 1792, 32000, 8, 4, True),  # the first benchmark's shape: MLP 3.5x, 32k
    "llama-deep": ("llama", 256, 16, 688, 32000, 8, 8, False),  # hidden 256, 16 layers, MLP 2.7x, untied
    "llama-gqa8": ("llama", 1024, 4, 2816, 4096, 16, 2, False),  # hidden 1,024, grouped attention 8:1
    "q2-wide-mlp": ("qwen2", 384, 12, 2304, 32000, 6, 2, False),  # Qwen2 biases, MLP 6x, untied
    "q3-v152k": ("qwen3", 768, 6, 3072, 151936, 12, 4, True),  # Qwen's 152k vocabulary, MLP 4x
    "q36m-l20": ("qwen3", 384, 20, 1152, 4096, 6, 2, True),  # deep and narrow: 20 layers at hidden 384, MLP 3x
}


def make_checkpoint(out: Path, shape: tuple) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    from fellow.runtime.tools.chat_tokenizer import generation_config_values
    from tests.tiny import _tokenizer

    family, hidden, layers, mlp, vocab, heads, kv_heads, tied = shape
    # a copy: the cached tokenizer grown for one shape's vocabulary gave every later shape at least as many
    # words (a full matrix ran llama-gqa8 with 32k, after q45m-v32k, not its 4k)
    tok = copy.deepcopy(_tokenizer())
    extra = 0
    while len(tok) < vocab:  # some added words already exist: add until the vocabulary is exact
        tok.add_tokens([f"<w{i}>" for i in range(extra, extra + vocab - len(tok))])
        extra += vocab
    config_class = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[family]
    cfg = config_class(vocab_size=len(tok), hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                       max_position_embeddings=4096, tie_word_embeddings=tied)
    gen = generation_config_values(tok)
    cfg.eos_token_id, cfg.pad_token_id = gen["eos_token_id"][0], gen["pad_token_id"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # a zero row scores 0, below the best of thousands of others: no reply ends early
        for i in gen["eos_token_id"]:
            model.lm_head.weight[i] = 0.0
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def read_bandwidth() -> float:
    """Bytes/s of summing a buffer far larger than any cache, best of five."""
    buffer = torch.ones(256 * 1024 * 1024)  # 1 GiB of float32
    buffer.sum()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best


def weight_bytes_per_token(model) -> int:
    """What one decode step reads: every layer's weights, the final norm and the head (not the embeddings)."""
    layers = sum(p.numel() for p in model.model.layers.parameters())
    return 4 * (layers + model.model.norm.weight.numel() + model.lm_head.weight.numel())


def prompts_for(tok, n: int) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False) for i in range(n)]


def hf_generate(model, tok, batch: int, tokens: int) -> float:
    enc = tok.pad({"input_ids": prompts_for(tok, batch)}, return_tensors="pt")

    def run(n: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
        return time.perf_counter() - started

    run(4)
    return max(batch * (tokens - 1) / (run(tokens) - run(1)) for _ in range(2))


def engine_alone(stage, tok, batch: int, tokens: int) -> tuple[float, float]:
    """(decode tokens/s, ms to the first token of one short prompt) of the stage as a fellow serves it."""
    from events.requests import Sampling
    from fellow.runtime.engine.engine import local_engine
    from fellow.runtime.engine.session import Session

    prompts = prompts_for(tok, batch)

    def run(n: int) -> float:
        engine = local_engine(stage, kv_tokens=1 << 20)
        started = time.perf_counter()
        for row, ids in enumerate(prompts):
            engine.add(Session(f"s{row}", ids, n, Sampling(temperature=0.0)))
        while engine.busy:
            engine.step()
        return time.perf_counter() - started

    run(4)
    rate = max(batch * (tokens - 1) / (run(tokens) - run(1)) for _ in range(2)) if tokens else 1.0
    first = min(run(1) for _ in range(5)) if batch == 1 else 0.0
    return rate, first * 1e3


async def stack_ttft(base: str, model: str, n: int = 12) -> float:
    """Median ms of a whole one-token streamed reply: its one token is the first, whatever text it
    decodes to (a token that is part of a character shows no text until the stream ends)."""
    url = base + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await stream_one(client, url, model, QUESTIONS[0], 1)
        times = []
        for _ in range(n):
            started = time.perf_counter()
            await stream_one(client, url, model, QUESTIONS[0], 1)
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def prepare(name: str, shape: tuple, tmp: Path) -> tuple:
    """(checkpoint folder, its tokenizer padding left, the model in float32) of a shape, exported as a
    one-stage servable at tmp/servables/name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fellow.runtime.tools.export import export

    ckpt = make_checkpoint(tmp / name / "hf", shape)
    export(ckpt, tmp / "servables" / name, stages=1, model_id=name)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    tok.padding_side = "left"
    return ckpt, tok, AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def run_shape(name: str, shape: tuple, tmp: Path, tokens: int, streams: list[int], bandwidth: float,
              with_stack: bool, stage_threads: int = 0, engine: bool = True, compile: str = "off") -> dict:
    _, tok, model = prepare(name, shape, tmp)
    row = {"name": name, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
           "floor_ms": weight_bytes_per_token(model) / bandwidth * 1e3}
    row["generate"] = {b: hf_generate(model, tok, b, tokens) if tokens else 1.0 for b in streams}
    del model
    row["engine"], row["engine_first_ms"] = {b: float("nan") for b in streams}, 0.0
    if engine:
        _engine_rows(row, tmp / "servables" / name, tok, tokens, streams, compile)
    if with_stack:
        with EmbeddedNats(tmp / name / "js") as nats:
            stack = Stack(tmp / name, nats.url, tmp / "servables", SWARM_MODEL_IDLE_UNLOAD_S=0,
                          SWARM_SERVE_MAX_IN_FLIGHT=max(streams), SWARM_SERVE_THREADS=stage_threads,
                          # the engine alone keeps no prefix cache either
                          SWARM_SERVE_PREFIX_CACHE="off", SWARM_SERVE_COMPILE=compile).start()
            try:
                r = stack.post(f"/api/v1/models/{name}/load", {"wait": True, "timeout_s": 1800}, timeout=1900)
                assert r.status_code == 200 and r.json()["state"] == "ready", r.text
                row["stack_compiled"] = r.json()["stages"][0]["kernels"].get("compiled", {}).get("serving")
                row["stack"] = {b: (asyncio.run(load_test(stack.url, name, b, tokens))["agg_tok_s"] if tokens else 0.0)
                                for b in streams}
                row["stack_ttft_ms"] = asyncio.run(stack_ttft(stack.url, name))
            finally:
                stack.stop()
    return row


def _engine_rows(row: dict, servable: Path, tok, tokens: int, streams: list[int], compile: str = "off") -> None:
    from core.settings import Settings
    from events.stage import StageOptions
    from fellow.runtime.model.load.loader import load_one_stage

    sizes = Settings.from_env({"SWARM_SERVE_COMPILE": compile}).serving.compile
    stage = load_one_stage(servable, "cpu", StageOptions(max_batch=max(streams), compile=sizes)).stage
    if sizes:
        row["compiled"] = stage.kernels.compiled
        print(json.dumps({"name": row["name"], "compiled": row["compiled"]}), flush=True)
    row["kernels"] = {k: v["kernel"] for k, v in stage.kernels.get("shapes", {}).items()} or stage.kernels.path
    engine = {b: engine_alone(stage, tok, b, tokens) for b in streams}
    row["engine"] = {b: rate for b, (rate, _) in engine.items()}
    row["engine_first_ms"] = engine[1][1] if 1 in engine else 0.0


def ratio_table(rows: list[dict], streams: list[int], with_stack: bool) -> str:
    head = "| shape | params | " + " | ".join(
        f"generate {b} tok/s | engine {b} | engine/gen {b}" + (f" | stack {b} | stack/gen {b} | stack/engine {b}"
                                                                 if with_stack else "") for b in streams)
    head += " | stage ms/token | floor ms | stage/floor |" + (" TTFT added ms |" if with_stack else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["name"], f"{r['params_m']:.0f}M"]
        for b in streams:
            g, e = r["generate"][b], r["engine"][b]
            cells += [f"{g:.1f}", f"{e:.1f}", f"{e / g:.2f}x"]
            if with_stack:
                s = r["stack"][b]
                cells += [f"{s:.1f}", f"{s / g:.2f}x", f"{s / e:.2f}x"]
        stage_ms = 1e3 / r["engine"][streams[0]]
        cells += [f"{stage_ms:.1f}", f"{r['floor_ms']:.1f}", f"{stage_ms / r['floor_ms']:.2f}x"]
        if with_stack:
            cells.append(f"{r['stack_ttft_ms'] - r['engine_first_ms']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[dict], streams: list[int], with_stack: bool) -> str:
    out = []
    for b in streams:
        for what in (["stack"] if with_stack else []) + ["engine"]:
            ratios = sorted(r[what][b] / r["generate"][b] for r in rows)
            out.append(f"{what} / generate at {b} stream(s): min {ratios[0]:.2f}x, "
                       f"median {statistics.median(ratios):.2f}x")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per stream (0: only the time to first token)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in this process (0: torch's default)")
    ap.add_argument("--no-stack", action="store_true", help="generate and the engine alone")
    ap.add_argument("--no-engine", action="store_true", help="generate and the stack only")
    ap.add_argument("--stage-threads", type=int, default=0, help="SWARM_SERVE_THREADS for the stack's stage")
    ap.add_argument("--compile", default="off", help="SWARM_SERVE_COMPILE for the engine and the stack's stage")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads, {args.tokens} new tokens "
          f"per stream", flush=True)
    tmp = scratch_dir("swarm-bench-matrix-")
    rows = []
    for name in args.shapes:
        rows.append(run_shape(name, SHAPES[name], tmp, args.tokens, args.streams, bandwidth, not args.no_stack,
                              args.stage_threads, not args.no_engine, args.compile))
        print(json.dumps(rows[-1], default=str), flush=True)
    print()
    print(ratio_table(rows, args.streams, not args.no_stack))
    print()
    print(summary(rows, args.streams, not args.no_stack))


if __name__ == "__main__":
    main()
