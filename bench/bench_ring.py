"""Tokens/s of a 2-stage ring at 1, 2, 4 and 8 in flight against the one-stage load of the same model, in one run.

    .venv/bin/python bench/bench_ring.py [--in-flight 1 2 4 8] [--tokens 96] [--threads 1]

Real processes on loopback: nats-server, a leader and two fellows; clients stream from
/v1/chat/completions. The model is bench_serving's ~45M-parameter Qwen3 (fp32, CPU, end-of-turn
rows zeroed so every reply runs its whole length), exported over 2 stages cut where their compute
balances (``--cut``, 6 of 8 blocks on stage 0: the other holds the head). First it is loaded on
one stage (one fellow), then as a ring over both fellows; every stage process computes with
``--threads`` torch threads. A token's time splits into stage0_ms, link_ms and stage1_ms (each
reply's swarm.timing); the link's share is link_ms over their sum. Target: 4 in flight >= 1.8x one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_serving import QUESTIONS, make_checkpoint, sse_chunks  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from tests.serving_fixtures import Stack  # noqa: E402

MODEL = "bench45m-ring"


async def stream_one(client: httpx.AsyncClient, url: str, question: str, tokens: int) -> dict:
    timing, usage, first = {}, None, None
    async for data in sse_chunks(client, url, MODEL, question, tokens):
        usage = data.get("usage") or usage
        timing = (data.get("swarm") or {}).get("timing") or timing
        if first is None and any((c.get("delta") or {}).get("content") for c in data.get("choices") or []):
            first = time.perf_counter()
    return {"tokens": usage["completion_tokens"], "first": first, "end": time.perf_counter(), "timing": timing}


async def load_test(base: str, in_flight: int, tokens: int) -> dict:
    """in_flight streams at once; decode tokens/s of them all, from the median first token to the last end."""
    url = base + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await stream_one(client, url, "warm up", 8)
        results = await asyncio.gather(*(stream_one(client, url, QUESTIONS[i % len(QUESTIONS)], tokens)
                                         for i in range(in_flight)))
    start = statistics.median(r["first"] for r in results)
    span = max(r["end"] for r in results) - start
    parts = {k: statistics.mean(r["timing"].get(k, 0.0) for r in results)
             for k in ("stage0_ms", "link_ms", "stage1_ms")}
    total = sum(parts.values())
    return {"tok_s": sum(r["tokens"] - 1 for r in results) / max(span, 1e-9), **parts,
            "link_share": parts["link_ms"] / total if total else 0.0,
            "bytes_per_token": results[0]["timing"].get("bytes_per_token")}


def serve(stack: Stack, body: dict, levels: list[int], tokens: int) -> dict[int, dict]:
    stack.load(MODEL, **body)
    try:
        return {n: asyncio.run(load_test(stack.url, n, tokens)) for n in levels}
    finally:
        r = stack.post(f"/api/v1/models/{MODEL}/unload")
        assert r.status_code == 200, r.text
        from tests.processes import wait_until

        wait_until(lambda: stack.get(f"/api/v1/models/{MODEL}").json()["load_state"] == "unloaded", 60, "unloaded")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    ap.add_argument("--cut", type=int, default=6, help="the layer where stage 1 starts (of 8)")
    args = ap.parse_args()
    tmp = scratch_dir("swarm-bench-ring-")
    ckpt = make_checkpoint(tmp / "hf")
    from fellow.runtime.tools.export import export

    # The tied 32k-token head costs about what 4 of the 8 blocks cost, so the cut that balances the
    # two stages' compute (as training would) gives stage 0 six blocks and stage 1 two and the head.
    export(ckpt, tmp / "servables" / MODEL, stages=2, boundaries=[[0, args.cut], [args.cut, 8]], model_id=MODEL)
    print(f"model: Qwen3 ~45M parameters, fp32, cut at block {args.cut} of 8, {args.threads} torch thread(s) "
          f"per stage process, {args.tokens} new tokens per stream, loopback NATS")
    with EmbeddedNats(tmp / "js") as nats:
        stack = Stack(tmp, nats.url, tmp / "servables", fellows=2, SWARM_MODEL_IDLE_UNLOAD_S=0,
                      SWARM_SERVE_MAX_IN_FLIGHT=max(args.in_flight), OMP_NUM_THREADS=args.threads).start()
        try:
            one = serve(stack, {"num_stages": 1, "fellow_id": "f0"}, args.in_flight, args.tokens)
            ring = serve(stack, {"num_stages": 2, "fellow_ids": ["f0", "f1"]}, args.in_flight, args.tokens)
        finally:
            stack.stop()
    base = ring[args.in_flight[0]]["tok_s"]
    print("\n| in flight | one stage tok/s | ring tok/s | ring / one stage | ring / ring at "
          f"{args.in_flight[0]} | stage0 ms | link ms | stage1 ms | link share | bytes/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.in_flight:
        o, r = one[n], ring[n]
        print(f"| {n} | {o['tok_s']:.1f} | {r['tok_s']:.1f} | {r['tok_s'] / o['tok_s']:.2f}x | "
              f"{r['tok_s'] / base:.2f}x | {r['stage0_ms']:.1f} | {r['link_ms']:.1f} | {r['stage1_ms']:.1f} | "
              f"{r['link_share']:.0%} | {r['bytes_per_token']:.0f} |")
    if 4 in ring and 1 in ring:
        ratio = ring[4]["tok_s"] / ring[1]["tok_s"]
        print(f"\ntarget: ring at 4 in flight >= 1.8x ring at 1: {ratio:.2f}x -> "
              f"{'met' if ratio >= 1.8 else 'NOT met'}")


if __name__ == "__main__":
    main()
