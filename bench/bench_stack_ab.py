"""Settings against each other through the whole stack: one stack per setting (its own nats-server, leader,
fellow and stage), their requests alternated in one run, so the machine's swings fall on all of them alike.

    .venv/bin/python bench/bench_stack_ab.py --rounds 24 --tokens 1 64 -- "" "SWARM_SERVE_STREAM_INTERVAL_MS=0"

Each configuration is a comma-separated list of NAME=VALUE for that stack's leader and fellow ("" for the
defaults). Each round, for each token count, each stack in turn (the order reversed every other round)
answers the same chat prompt, streamed; before each request the engine alone answers its first token in this
process, each of the two after a quiet 0.2 s, as bench/bench_stack_trace.py does. Per configuration and token
count it prints the median time to the first text (from the HTTP call), the engine's, and the median of the
pairs' differences, and "around_stage_ms": the first text less the stage's own time to that request's first
token (its reply's ``swarm.timing``). Compare configurations by their first text or around the stage: the
engine's first token after a pause swings by several ms from one pair to the next, so a run's "added" is
noisier than either.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402
from bench.bench_peers import settled  # noqa: E402
from bench.bench_serving import QUESTIONS, sse_chunks  # noqa: E402
from bench.bench_stack_trace import default_stack, engine_first_and_step  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from tests.serving_fixtures import Stack  # noqa: E402


async def first_text(client: httpx.AsyncClient, url: str, model: str, tokens: int) -> tuple[float, float]:
    """The first text's time from the HTTP call, and that less the stage's own time to the first token
    (the last chunk's ``swarm.timing``): what the stack adds around the stage."""
    started, first, stage = time.perf_counter(), None, None
    async for chunk in sse_chunks(client, url, model, QUESTIONS[0], tokens):
        if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
            first = (time.perf_counter() - started) * 1e3
        stage = ((chunk.get("swarm") or {}).get("timing") or {}).get("ttft_ms", stage)
    return first, first - stage


async def alternate(stacks: list[Stack], model: str, tokens: list[int], rounds: int, alone) -> dict:
    pairs = {(i, t): [] for i in range(len(stacks)) for t in tokens}
    clients = [httpx.AsyncClient(timeout=600) for _ in stacks]
    try:
        for client, stack in zip(clients, stacks):  # warm
            for _ in range(2):
                await first_text(client, stack.url + "/v1/chat/completions", model, 4)
        for r in range(rounds):
            order = list(range(len(stacks)))[::1 if r % 2 == 0 else -1]
            for t in tokens:
                for i in order:
                    time.sleep(0.2)
                    engine = alone()
                    time.sleep(0.2)
                    pairs[(i, t)].append((*await first_text(clients[i], stacks[i].url + "/v1/chat/completions",
                                                            model, t), engine))
    finally:
        for client in clients:
            await client.aclose()
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="q46m-v4k", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("configs", nargs="+", help='NAME=VALUE,... per stack; "" for the defaults')
    args = ap.parse_args()
    configs = [dict(kv.split("=", 1) for kv in c.split(",") if kv) for c in args.configs]
    tmp = scratch_dir("swarm-bench-ab-")
    ckpt = make_checkpoint(tmp / args.shape / "hf", SHAPES[args.shape])
    from fellow.runtime.tools.export import export

    export(ckpt, tmp / "servables" / args.shape, stages=1, model_id=args.shape)
    alone, first = engine_first_and_step(tmp / "servables" / args.shape, ckpt)
    print(json.dumps(alone), flush=True)
    servers, stacks = [], []
    try:
        for i, env in enumerate(configs):
            servers.append(EmbeddedNats(tmp / f"js{i}").__enter__())
            (tmp / f"stack{i}").mkdir()
            stacks.append(default_stack(tmp / f"stack{i}", servers[-1].url, tmp / "servables", **env).start())
            settled(stacks[-1], args.shape, stacks[-1].load(args.shape))  # its background compile, done
        pairs = asyncio.run(alternate(stacks, args.shape, args.tokens, args.rounds, first))
        for (i, t), rows in pairs.items():
            print(json.dumps({"config": args.configs[i], "tokens": t, "requests": len(rows),
                              "first_text_ms": round(statistics.median([f for f, _, _ in rows]), 2),
                              "around_stage_ms": round(statistics.median([a for _, a, _ in rows]), 2),
                              "engine_first_ms": round(statistics.median([e for _, _, e in rows]), 2),
                              "added_ms": round(statistics.median([f - e for f, _, e in rows]), 2)}), flush=True)
    finally:
        for stack in stacks:
            stack.stop()
        for server in servers:
            server.__exit__(None, None, None)


if __name__ == "__main__":
    main()
