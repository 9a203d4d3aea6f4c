"""Decode tokens/s through the whole stack against raw HF `generate` and `transformers serve` on the
same ~45M-parameter Qwen3 (fp32, CPU), all in one run.

    .venv/bin/python bench/bench_serving.py [--concurrency 1 4 8 16] [--tokens 128] [--no-hf-serve]

The stack is real: nats-server, a leader and a fellow process with its stage subprocess; clients
stream from /v1/chat/completions over HTTP. `transformers serve --continuous-batching` (needs
fastapi) serves the same checkpoint. HF generate runs in this process at the same batch sizes.
Every figure is decode throughput: completion tokens over wall time, all streams together; TTFT
is the single stream's time to its first token. The model's end-of-turn rows are zeroed, so no
reply ends early and every path produces the same number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from tests.processes import free_port, wait_until  # noqa: E402
from tests.serving_fixtures import Stack  # noqa: E402

QUESTIONS = ["What is a list comprehension?", "Explain the with statement.", "How do generators work?",
             "What does a decorator do?", "Describe exceptions in Python.", "What is a dictionary?",
             "How are modules imported?", "What is a class?"]


def make_checkpoint(out: Path, vocab: int = 32000, hidden: int = 512, layers: int = 8) -> Path:
    """A Qwen3 of about 45M parameters with the project's tiny chat tokenizer padded to `vocab`."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from fellow.runtime.tools.chat_tokenizer import generation_config_values
    from tests.tiny import _tokenizer

    tok = _tokenizer()
    tok.add_tokens([f"<w{i}>" for i in range(vocab - len(tok))])
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden + 256,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    gen = generation_config_values(tok)
    cfg.eos_token_id, cfg.pad_token_id = gen["eos_token_id"][0], gen["pad_token_id"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # no reply ends early: every path decodes the same number of tokens
        for i in gen["eos_token_id"]:  # a zero row (tied head) scores 0, below the best of 32k others
            model.model.embed_tokens.weight[i] = 0.0
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def prompts(tok, n: int) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False) for i in range(n)]


def hf_generate(ckpt: Path, batch: int, tokens: int) -> float:
    """Decode tokens/s of model.generate at `batch` (time past the prompt: a 1-token run subtracted)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = prompts(tok, batch)
    enc = tok.pad({"input_ids": ids}, return_tensors="pt")

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
        return time.perf_counter() - t0

    run(4)
    best = 0.0
    for _ in range(2):
        whole, first = run(tokens), run(1)
        best = max(best, batch * (tokens - 1) / (whole - first))
    return best


async def sse_chunks(client: httpx.AsyncClient, url: str, model: str, question: str, tokens: int):
    """The parsed ``data:`` chunks of one streamed, greedy chat completion (usage included)."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def stream_one(client: httpx.AsyncClient, url: str, model: str, question: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage = None
    async for data in sse_chunks(client, url, model, question, tokens):
        if data.get("usage"):
            usage = data["usage"]
        for ch in data.get("choices") or []:
            if (ch.get("delta") or {}).get("content"):
                chunks += 1
                now = time.perf_counter()
                first = first or now
                last = now
    n = usage["completion_tokens"] if usage else chunks
    return {"ttft": (first or t0) - t0, "tokens": n, "decode_s": (last or t0) - (first or t0),
            "end": time.perf_counter()}


async def load_test(base: str, model: str, concurrency: int, tokens: int) -> dict:
    url = base + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await stream_one(client, url, model, "warm up", 8)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, url, model, QUESTIONS[i % len(QUESTIONS)], tokens)
                                         for i in range(concurrency)))
    return aggregate(results, t0)


def aggregate(results: list[dict], t0: float) -> dict:
    """The figures of streams started together at `t0`, each a dict of ttft, tokens, decode_s and end."""
    concurrency = len(results)
    wall = max(r["end"] for r in results) - t0
    total = sum(r["tokens"] for r in results)
    ttft = statistics.median(r["ttft"] for r in results)
    # aggregate decode rate: tokens past each stream's first, over the span they were produced in
    span = max(r["end"] for r in results) - t0 - ttft
    return {"tokens": total, "wall_s": wall, "agg_tok_s": (total - concurrency) / max(span, 1e-9),
            "ttft_ms": ttft * 1e3,
            "stream_tok_s": statistics.median((r["tokens"] - 1) / max(r["decode_s"], 1e-9) for r in results)}


def run_hf_serve(ckpt: Path, levels: list[int], tokens: int) -> dict[int, dict]:
    port = free_port()
    exe = Path(sys.executable).parent / "transformers"
    proc = subprocess.Popen([str(exe), "serve", str(ckpt), "--port", str(port), "--continuous-batching",
                             "--device", "cpu", "--dtype", "float32"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200, 300,
                   "transformers serve")
        return {c: asyncio.run(load_test(f"http://127.0.0.1:{port}", str(ckpt), c, tokens)) for c in levels}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-hf-serve", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    tmp = scratch_dir("swarm-bench-serving-")
    ckpt = make_checkpoint(tmp / "hf")
    from fellow.runtime.tools.export import export

    export(ckpt, tmp / "servables" / "bench45m", stages=1, model_id="bench45m")
    params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(
        str(ckpt)).parameters())
    print(f"model: Qwen3, {params / 1e6:.1f}M parameters, fp32, {torch.get_num_threads()} threads, "
          f"{args.tokens} new tokens per stream")
    hf = {c: hf_generate(ckpt, c, args.tokens) for c in args.concurrency}
    with EmbeddedNats(tmp / "js") as nats:
        stack = Stack(tmp, nats.url, tmp / "servables", SWARM_MODEL_IDLE_UNLOAD_S=0,
                      SWARM_SERVE_MAX_IN_FLIGHT=max(args.concurrency)).start()
        try:
            stack.load("bench45m")
            swarm = {c: asyncio.run(load_test(stack.url, "bench45m", c, args.tokens)) for c in args.concurrency}
        finally:
            stack.stop()
    serve = {} if args.no_hf_serve else run_hf_serve(ckpt, args.concurrency, args.tokens)
    print("\n| streams | HF generate tok/s | swarm tok/s | swarm / generate | swarm TTFT ms |"
          + (" transformers serve tok/s | swarm / serve |" if serve else ""))
    print("|---|---|---|---|---|" + ("---|---|" if serve else ""))
    for c in args.concurrency:
        s = swarm[c]
        row = f"| {c} | {hf[c]:.1f} | {s['agg_tok_s']:.1f} | {s['agg_tok_s'] / hf[c]:.2f}x | {s['ttft_ms']:.0f} |"
        if serve:
            row += f" {serve[c]['agg_tok_s']:.1f} | {s['agg_tok_s'] / serve[c]['agg_tok_s']:.2f}x |"
        print(row)


if __name__ == "__main__":
    main()
