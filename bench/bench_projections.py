"""Event publish -> projected row: latency (p50/p99) and sustained events/s on SQLite.

    .venv/bin/python bench/bench_projections.py [--samples 500] [--burst 5000]

Real nats-server (file store) and a real SQLite file; the projectors run in this process, as in
the leader. Latency is one event at a time: publish, then wait until the `requests` projection
has committed it. Throughput publishes a burst without waiting and times until all are projected.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from core.bus import connect, ensure_streams, publish_event
from core.nats_server import EmbeddedNats
from events.requests import RequestAccepted, RequestFinished
from leader.db.engine import make_engine, session_factory, upgrade
from leader.projectors.all import all_projectors
from leader.projectors.runner import ProjectionRunner


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def main(samples: int, burst: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    with EmbeddedNats(tmp / "js") as srv:
        url = f"sqlite+aiosqlite:///{tmp / 'swarm.db'}"
        await upgrade(url)
        engine = make_engine(url)
        nc = await connect(srv.url, "bench")
        js = nc.jetstream()
        await ensure_streams(js)
        runner = ProjectionRunner(js, session_factory(engine), all_projectors())
        await runner.start()
        for i in range(50):  # warm up
            ack = await publish_event(js, RequestAccepted(request_id=f"w{i}", model_id="m", load_id="L"))
        await runner.wait_for(ack.seq, timeout=30)

        publish_ms, projected_ms = [], []
        for i in range(samples):
            t0 = time.perf_counter()
            ack = await publish_event(js, RequestAccepted(request_id=f"l{i}", model_id="m", load_id="L"))
            t1 = time.perf_counter()
            await runner.wait_for(ack.seq, ["requests"], timeout=30)
            t2 = time.perf_counter()
            publish_ms.append((t1 - t0) * 1e3)
            projected_ms.append((t2 - t0) * 1e3)

        t0 = time.perf_counter()
        futures = []
        for i in range(burst):
            evt = (RequestAccepted(request_id=f"b{i // 2}", model_id="m", load_id="L") if i % 2 == 0 else
                   RequestFinished(request_id=f"b{i // 2}", model_id="m", load_id="L", completion_tokens=i))
            futures.append(asyncio.ensure_future(publish_event(js, evt, timeout=60)))
        acks = await asyncio.gather(*futures)
        t1 = time.perf_counter()
        await runner.wait_for(max(a.seq for a in acks), timeout=600)
        t2 = time.perf_counter()
        await runner.stop()
        await nc.close()
        await engine.dispose()

    print(f"publish (JetStream ack) ms: p50 {pct(publish_ms, .5):.3f}  p99 {pct(publish_ms, .99):.3f}")
    print(f"publish -> projected row ms: p50 {pct(projected_ms, .5):.3f}  p99 {pct(projected_ms, .99):.3f}  "
          f"(mean {statistics.mean(projected_ms):.3f}, n={samples})")
    print(f"burst of {burst}: published in {t1 - t0:.2f}s ({burst / (t1 - t0):.0f}/s), "
          f"all projected (5 projectors) after {t2 - t0:.2f}s: {burst / (t2 - t0):.0f} events/s sustained")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--burst", type=int, default=5000)
    args = ap.parse_args()
    asyncio.run(main(args.samples, args.burst))
