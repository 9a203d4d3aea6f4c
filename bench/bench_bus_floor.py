"""The floor under the stack's time to first token on this machine: its transports with no work on them.

    .venv/bin/python bench/bench_bus_floor.py [--trips 40] [--pauses 0 0.05 0.4]

A request's path to its first text crosses HTTP (client -> gateway -> client), a JetStream publish taken by
the stage's pull consumer (gateway -> nats-server -> stage), and a core NATS message back (stage ->
nats-server -> gateway). Each is timed here alone, between real processes doing nothing else:

- ``http``: a null ASGI app under uvicorn in a child process answers a streamed POST from httpx with one SSE
  line at once; the time to that line (a gateway that does no work);
- ``core``: a core NATS message to a child process that sends one back at once (two crossings of
  nats-server, a round trip);
- ``jetstream``: a JetStream publish to a work-queue stream, taken by the child's ``fetch(1)`` (as
  fellow.runtime.server.intake takes requests), answered on core NATS (the stage's path and the frame's);
- ``jetstream-push``: the same publish (another subject of the stream) to a push consumer's callback, which
  the stage does not use: what a pushed intake would cost instead.

Each is timed hot (back to back) and after each pause (seconds; bench_stack_trace waits 0.2 s twice before a
request): medians over ``--trips`` of the way there (the receiver's clock reading on arrival, CLOCK_MONOTONIC
as every process here reads it), back, and the round trip, which is also given as a ratio to its hot one.
The last line adds what a request's path crosses: HTTP and JetStream in after the pause, then core NATS and
HTTP out as they come back to back (the prompt step between keeps the machine awake).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from tests.processes import free_port, wait_until  # noqa: E402

STREAM, WORK, PUSHED, CORE, BACK = "FLOOR", "floor.work", "floor.pushed", "floor.core", "floor.back"


async def null_app(scope, receive, send):
    if scope["type"] != "http":
        return
    arrived = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process here
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b"data: %r\n\n" % arrived, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def answer(url: str) -> None:
    """The child: answers core messages and takes JetStream ones, each with a core message back."""
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()

    async def on_core(msg):
        await nc.publish(BACK, repr(time.perf_counter()).encode())

    async def on_pushed(msg):
        await nc.publish(BACK, repr(time.perf_counter()).encode())
        await msg.ack()

    await nc.subscribe(CORE, cb=on_core)
    await js.subscribe(PUSHED, durable="floor-push", stream=STREAM, cb=on_pushed, manual_ack=True)
    sub = await js.pull_subscribe(WORK, durable="floor", stream=STREAM)
    while True:
        try:
            msgs = await sub.fetch(1, timeout=1.0)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            continue
        for msg in msgs:
            await nc.publish(BACK, repr(time.perf_counter()).encode())
            await msg.ack()


async def timed(trips: int, pause: float, once) -> dict:
    """Medians of ``once()``'s (time there, time there and back) in ms, each after ``pause`` seconds; two
    untimed first."""
    out = []
    for i in range(trips + 2):
        await asyncio.sleep(pause)
        there, back = await once()
        if i >= 2:
            out.append((there, back))
    return {"there": round(statistics.median(t for t, _ in out), 3),
            "back": round(statistics.median(b - t for t, b in out), 3),
            "round": round(statistics.median(b for _, b in out), 3)}


async def bus_floor(url: str, trips: int, pauses: list[float]) -> dict:
    import nats
    from nats.js.api import RetentionPolicy, StreamConfig

    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=[WORK, PUSHED], retention=RetentionPolicy.WORK_QUEUE))
    back: asyncio.Queue = asyncio.Queue()

    async def on_back(msg):
        back.put_nowait((float(msg.data), time.perf_counter()))

    await nc.subscribe(BACK, cb=on_back)
    child = subprocess.Popen([sys.executable, __file__, "--answer", url])
    try:
        await asyncio.sleep(1.5)  # its subscription and pull are in place
        out = {}
        for name, send in (("core", lambda: nc.publish(CORE, b"x")), ("jetstream", lambda: js.publish(WORK, b"x")),
                           ("jetstream-push", lambda: js.publish(PUSHED, b"x"))):
            async def once():
                t0 = time.perf_counter()
                await send()
                there, came = await back.get()
                return (there - t0) * 1e3, (came - t0) * 1e3
            out[name] = {str(p): await timed(trips, p, once) for p in pauses}
        return out
    finally:
        child.kill()
        await nc.close()


async def http_floor(trips: int, pauses: list[float]) -> dict:
    import httpx

    port = free_port()
    child = subprocess.Popen([sys.executable, __file__, "--serve-http", str(port)])
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/", timeout=2), 30, "the null app listening")
        async with httpx.AsyncClient(timeout=30) as client:
            async def once():
                t0 = time.perf_counter()
                async with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json={"a": 1}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            first, there = time.perf_counter(), float(line[6:])
                            break
                return (there - t0) * 1e3, (first - t0) * 1e3
            return {str(p): await timed(trips, p, once) for p in pauses}
    finally:
        child.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trips", type=int, default=40)
    ap.add_argument("--pauses", type=float, nargs="+", default=[0.0, 0.05, 0.4])
    ap.add_argument("--answer", help=argparse.SUPPRESS)
    ap.add_argument("--serve-http", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.answer:
        asyncio.run(answer(args.answer))
        return
    if args.serve_http:
        import uvicorn

        uvicorn.run(null_app, host="127.0.0.1", port=args.serve_http, log_level="warning")
        return
    with EmbeddedNats(scratch_dir("swarm-bench-floor-") / "js") as server:
        got = {"http": asyncio.run(http_floor(args.trips, args.pauses)),
               **asyncio.run(bus_floor(server.url, args.trips, args.pauses))}
    hot, paused = str(args.pauses[0]), str(args.pauses[-1])
    for name, by_pause in got.items():
        print(json.dumps({"path": name, "ms": by_pause, "round_vs_first": {
            p: round(ms["round"] / by_pause[hot]["round"], 2) for p, ms in by_pause.items()}}), flush=True)
    # a request's way in starts after the pause; the way out comes after its prompt step, the machine awake
    way_in = got["http"][paused]["there"] + got["jetstream"][paused]["there"]
    way_out = got["core"][hot]["there"] + got["http"][hot]["back"]
    print(json.dumps({"path": "the stack's: http and jetstream in (after the pause), core and http out (hot)",
                      "pause_s": args.pauses[-1], "in_ms": round(way_in, 3), "out_ms": round(way_out, 3),
                      "ms": round(way_in + way_out, 3), "of_5_ms": round((way_in + way_out) / 5.0, 2)}), flush=True)


if __name__ == "__main__":
    main()
