"""Where the whole stack's time goes, one stream at a time: a request's path from the HTTP call to its
first token, and each process's CPU time a token (the leader, nats-server, the fellow agent, its stage
process, and this client), on one shape of bench/bench_matrix.py.

    .venv/bin/python bench/bench_stack_trace.py [--shape q46m-v4k] [--tokens 1 64] [--requests 6]

The stack is real (nats-server, a leader, a fellow and its stage subprocess, as bench_matrix runs it),
and the client streams /v1/chat/completions over HTTP. A core NATS subscriber in this process times
when the request reaches ``swarm.req.<load>`` and when its start and token frames reach
``swarm.tok.<request>`` (each frame is then delivered twice, to the leader and to it). The stage's own
figures (its prefill and decode step) come from the reply's ``swarm.timing``. CPU time is read from
/proc before and after each timed request (10 ms ticks: a figure is good to about 10 ms over the run).
With ``--tokens 1`` the CPU a token is the CPU a whole one-token request costs. Before each request the
engine alone answers the same prompt's first token in this process (the stack idle, so both see the
machine as it is then; its CPU counts in "client"): "added_ms" is the median of the pairs' differences,
the stack's first text less the engine's first token, the time the stack adds to the first token (each
of the two starts after a quiet 0.2 s). "around_stage_ms" is the median of the stack's first text less the
stage's own time to that request's first token (from its session's start in the engine, the reply's timing):
what the HTTP call, the gateway and the bus add around the stage, without the noise of a second engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from bench.scratch import scratch_dir  # noqa: E402
from core.bus import connect  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from events.frames import DoneFrame, StartFrame, TokenFrame, frame_decoder  # noqa: E402
from tests.serving_fixtures import Stack  # noqa: E402


def default_stack(root: Path, nats_url: str, servables: Path, **env) -> Stack:
    """A stack with the fellow's defaults (the test fixture turns the background compile and quantized probes
    off), prompts not reused; ``env`` adds settings."""
    return Stack(root, nats_url, servables, SWARM_MODEL_IDLE_UNLOAD_S=0, SWARM_SERVE_PREFIX_CACHE="off",
                 SWARM_SERVE_QUANTIZED="auto", SWARM_SERVE_COMPILE="auto", **env)


def cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


async def trace(stack: Stack, nats_url: str, pids: dict[str, int], model: str, tokens: int, requests: int,
                alone=None) -> dict:
    nc = await connect(nats_url, name="bench-trace")
    seen: dict = {}

    async def on_request(msg):
        seen.setdefault("req", time.perf_counter())

    async def on_frame(msg):
        try:
            frame = frame_decoder.decode(msg.data)
        except Exception:
            return
        seen.setdefault("frames", []).append((time.perf_counter(), frame))

    await nc.subscribe("swarm.req.>", cb=on_request)
    await nc.subscribe("swarm.tok.>", cb=on_frame)
    url = stack.url + "/v1/chat/completions"
    rows = []
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(2):  # warm
            async for _chunk in sse_chunks(client, url, model, "warm", 4):
                pass
        spent = dict.fromkeys(pids, 0.0)
        for _ in range(requests):
            # the engine alone just before, a pair on the same machine state; each after a quiet 0.2 s (what the
            # last request left, such as the requests projection's linger, done; torch's threads asleep)
            time.sleep(0.2)
            engine_ms = alone() if alone else None
            time.sleep(0.2)
            seen.clear()
            before = {k: cpu_ms(p) for k, p in pids.items()}  # around the request alone, not the pauses
            started = time.perf_counter()
            content = []
            async for chunk in sse_chunks(client, url, model, QUESTIONS[0], tokens):
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    content.append(time.perf_counter())
            await nc.flush()
            for k, p in pids.items():
                spent[k] += cpu_ms(p) - before[k]
            frames = seen.get("frames", [])
            start = next(t for t, f in frames if isinstance(f, StartFrame))
            token_times = [t for t, f in frames if isinstance(f, TokenFrame)]
            done = next(f for _, f in frames if isinstance(f, DoneFrame))
            ms = lambda t: (t - started) * 1e3  # noqa: E731
            rows.append({"published": ms(seen["req"]), "started": ms(start), "first_frame": ms(token_times[0]),
                         "first_text": ms(content[0]) if content else None, "frames": len(token_times),
                         "prefill_ms": done.timing.get("prefill_ms"), "decode_ms": done.timing.get("decode_ms"),
                         "queue_ms": done.timing.get("queue_ms"), "stage_ttft_ms": done.timing.get("ttft_ms"),
                         "engine_first_ms": engine_ms,
                         "added_ms": ms(content[0]) - engine_ms if content and engine_ms is not None else None,
                         "around_stage_ms": ms(content[0]) - done.timing["ttft_ms"]
                         if content and "ttft_ms" in done.timing else None,
                         "frame_gap_ms": statistics.median(
                             [(b - a) * 1e3 for a, b in zip(token_times, token_times[1:])])
                         if len(token_times) > 2 else None})
    await nc.close()
    frames_total = sum(r["frames"] for r in rows)

    def med(k: str) -> float | None:
        values = [r[k] for r in rows if r[k] is not None]
        return statistics.median(values) if values else None

    return {"tokens": tokens, "requests": requests,
            **{k: round(med(k), 2) for k in ("published", "started", "first_frame", "first_text", "queue_ms",
                                             "prefill_ms", "stage_ttft_ms", "engine_first_ms", "added_ms",
                                             "around_stage_ms", "decode_ms", "frame_gap_ms")
               if med(k) is not None},
            "cpu_ms_per_token": {k: round(spent[k] / frames_total, 3) for k in pids}}


def engine_first_and_step(servable: Path, model_dir: Path, tokens: int = 32) -> dict:
    """The stage alone in this process, as bench_matrix times it: ms to the first token of the same
    prompt (median of 12) and ms of a decode step (median over one reply); and a callable that times
    one more first token (``trace`` runs it before each request: "added_ms" is the pair's difference)."""
    from transformers import AutoTokenizer

    from bench.bench_matrix import prompts_for
    from events.requests import Sampling
    from events.stage import StageOptions
    from fellow.runtime.engine.engine import local_engine
    from fellow.runtime.engine.session import Session
    from fellow.runtime.model.load.loader import load_one_stage

    stage = load_one_stage(servable, "cpu", StageOptions(max_batch=8)).stage
    prompt = prompts_for(AutoTokenizer.from_pretrained(str(model_dir)), 1)[0]

    def run(n: int) -> Session:
        engine = local_engine(stage, kv_tokens=1 << 20)
        session = Session("s", prompt, n, Sampling(temperature=0.0))
        engine.add(session)
        while engine.busy:
            engine.step()
        return session

    run(2)
    firsts = [run(1).timing()["ttft_ms"] for _ in range(12)]
    return {"engine_first_ms": round(statistics.median(firsts), 2),
            "engine_decode_ms": round(run(tokens).timing()["decode_ms"], 2)}, lambda: run(1).timing()["ttft_ms"]


def main() -> None:
    from fellow.runtime.tools.export import export

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="q46m-v4k", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--env", nargs="+", default=[], metavar="NAME=VALUE",
                    help="settings for the stack's leader and fellow, e.g. SWARM_SERVE_THREADS=1")
    args = ap.parse_args()
    extra = dict(item.split("=", 1) for item in args.env)
    tmp = scratch_dir("swarm-bench-trace-")
    ckpt = make_checkpoint(tmp / args.shape / "hf", SHAPES[args.shape])
    export(ckpt, tmp / "servables" / args.shape, stages=1, model_id=args.shape)
    alone, first = engine_first_and_step(tmp / "servables" / args.shape, ckpt)
    print(json.dumps(alone), flush=True)
    with EmbeddedNats(tmp / "js") as nats:
        stack = default_stack(tmp / args.shape, nats.url, tmp / "servables", **extra).start()
        try:
            settled(stack, args.shape, stack.load(args.shape))  # the default's background compile, done
            fellow = stack.fellows[0].proc.pid
            pids = {"leader": stack.leader.proc.pid, "nats-server": nats.process.pid, "fellow": fellow,
                    "stage": children(fellow)[0], "client": os.getpid()}
            for tokens in args.tokens:
                print(json.dumps(asyncio.run(trace(stack, nats.url, pids, args.shape, tokens, args.requests,
                                                    first))),
                      flush=True)
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
