"""Time to first token beside llama.cpp's server, on the same weights and prompt, requests alternated.

    .venv/bin/python bench/bench_ttft_peers.py --llama-cpp DIR [--shape q46m-v4k] [--rounds 24] [--tokens 1 64]

The whole stack with the fellow's defaults (as bench/bench_stack_trace.py builds it, the background compile
done; its prefix cache off, so that each request computes its whole prompt) and `llama-server` on the
checkpoint converted to GGUF float32 (bench/peers_llama.py; one slot, as many threads as torch has here;
``cache_prompt`` off, checked by the prompt tokens it says it evaluated). Each round, for each token count,
each answers the same chat prompt streamed (the stack's /v1/chat/completions; llama-server's /completion, the
same chat-templated prompt as token ids), in turn (the order reversed every other round), each after a quiet
0.4 s (bench_stack_trace's two pauses).
Both sides open a fresh connection a request: llama-server closes kept-alive ones (bench/peers_llama.py).

Per side and token count: the median time to the first text from the HTTP call, its engine's own time to
the first token for that request (the stage's ``swarm.timing.ttft_ms``; llama-server's ``timings.prompt_ms``),
and the median of their differences, "around": what HTTP, and for the stack its gateway and bus, add around
the engine. "ratio" is the stack's first text over llama-server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, prepare, prompts_for  # noqa: E402
from bench.bench_peers import settled  # noqa: E402
from bench.bench_stack_ab import first_text  # noqa: E402
from bench.bench_stack_trace import default_stack  # noqa: E402
from bench.peers_llama import LlamaServer, gguf_files, llama_tree  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402

FRESH = httpx.Limits(max_keepalive_connections=0)


async def stack_first(url: str, model: str, tokens: int) -> tuple[float, float]:
    """(ms to the first text, the stage's own ms to the first token)."""
    async with httpx.AsyncClient(timeout=600, limits=FRESH) as client:
        first, around = await first_text(client, url + "/v1/chat/completions", model, tokens)
    return first, first - around


async def llama_first(url: str, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(ms to the first text, llama-server's own ms for the prompt). The whole prompt is evaluated each time
    (``cache_prompt`` off, as the stack's prefix cache is here): asserted by the prompt tokens it reports."""
    body = {"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "cache_prompt": False}
    async with httpx.AsyncClient(timeout=600, limits=FRESH) as client:
        started, first, own = time.perf_counter(), None, None
        async with client.stream("POST", url + "/completion", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = json.loads(line[6:])
                if first is None and data.get("content"):
                    first = (time.perf_counter() - started) * 1e3
                if data.get("timings"):
                    own, evaluated = data["timings"]["prompt_ms"], data["timings"]["prompt_n"]
                    assert evaluated == len(prompt), f"llama-server evaluated {evaluated} of {len(prompt)} tokens"
    return first, own


def summary(rows: list[tuple[float | None, float | None]]) -> dict:
    """Medians over the requests whose reply had text and said its engine's time (all, normally)."""
    rows = [(f, o) for f, o in rows if f is not None and o is not None]
    return {"timed": len(rows), "first_text_ms": round(statistics.median(f for f, _ in rows), 2),
            "own_first_ms": round(statistics.median(o for _, o in rows), 2),
            "around_ms": round(statistics.median(f - o for f, o in rows), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", help="a llama.cpp source tree with build/bin/llama-server (or "
                                        "SWARM_BENCH_LLAMA_CPP)")
    ap.add_argument("--shape", default="q46m-v4k", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=24)
    args = ap.parse_args()
    tree = llama_tree(args.llama_cpp)
    tmp = scratch_dir("swarm-bench-ttft-peers-")
    ckpt, tok, model = prepare(args.shape, SHAPES[args.shape], tmp)
    del model
    prompt = prompts_for(tok, 1)[0]
    files = gguf_files(tree, ckpt, tmp / args.shape / "gguf")
    got = {(side, t): [] for side in ("stack", "llama.cpp") for t in args.tokens}
    with EmbeddedNats(tmp / "js") as nats, LlamaServer(tree, files["f32"], tmp / "llama-server.log",
                                                       torch.get_num_threads(), 1) as server:
        (tmp / "stack").mkdir()
        stack = default_stack(tmp / "stack", nats.url, tmp / "servables").start()
        try:
            settled(stack, args.shape, stack.load(args.shape))  # its background compile, done
            ask = {"stack": lambda t: stack_first(stack.url, args.shape, t),
                   "llama.cpp": lambda t: llama_first(server.url, prompt, t)}
            for side in ask:  # warm
                for _ in range(2):
                    asyncio.run(ask[side](4))
            for r in range(args.rounds):
                for t in args.tokens:
                    for side in (("stack", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "stack")):
                        time.sleep(0.4)
                        got[(side, t)].append(asyncio.run(ask[side](t)))
        finally:
            stack.stop()
    for t in args.tokens:
        ours, theirs = summary(got[("stack", t)]), summary(got[("llama.cpp", t)])
        print(json.dumps({"shape": args.shape, "tokens": t, "requests": args.rounds, "stack": ours,
                          "llama.cpp": theirs,
                          "ratio": round(ours["first_text_ms"] / theirs["first_text_ms"], 2)}), flush=True)


if __name__ == "__main__":
    main()
