"""What JetStream's sync costs (issue 53): `sync_interval: always` (fsync each write before its ack, the
project's setting) beside nats-server's default (every two minutes, after the ack), same run, same disk.

    .venv/bin/python bench/bench_nats_sync.py [--events 400] [--frames 4000] [--rounds 2]

Two servers, each on its own store under the system's temporary folder (a real disk: on tmpfs an fsync
costs nothing), both up for the whole run; each round measures one, then the other, on the project's streams:

- ``ack``: an event published and its ack awaited, one after another (as the leader publishes an event or a
  chat request): p50 / p99 ms;
- ``events_s``: 8 publishers at once, each awaiting its acks (eight requests' events at a time): events/s;
- ``frames``: token frames as a stage sends them (fellow/token_batcher.py: a core publish on the request's
  ``swarm.tok.<id>``, no ack awaited) from 8 requests at once, 100 bytes each: how many a second the server
  stores (until the stream holds them all), and the gateway's receipt of each (a core subscriber) p50 / p99.

The last line gives each figure synced over default (ratios of the medians over rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scratch import scratch_dir  # noqa: E402
from core.bus import connect, ensure_streams, publish_with_id  # noqa: E402
from core.nats_server import SYNC_ALWAYS, EmbeddedNats  # noqa: E402
from events.subjects import TOKENS_STREAM  # noqa: E402

EVENT = b'{"type": "request.finished", "id": "%d", "usage": {"prompt_tokens": 12, "completion_tokens": 64}}'
STREAMS = 8


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(url: str, events: int, frames: int, tag: str) -> dict:
    nc = await connect(url, name="bench-sync")
    js = nc.jetstream()
    await ensure_streams(js)
    lat = []
    for i in range(events):
        t = time.perf_counter()
        await publish_with_id(js, "swarm.evt.request.finished", EVENT % i, f"{tag}-a{i}")
        lat.append((time.perf_counter() - t) * 1000)

    async def publisher(k: int) -> None:
        for i in range(events // STREAMS):
            await publish_with_id(js, "swarm.evt.request.finished", EVENT % i, f"{tag}-c{k}-{i}")

    t = time.perf_counter()
    await asyncio.gather(*(publisher(k) for k in range(STREAMS)))
    events_s = (events // STREAMS * STREAMS) / (time.perf_counter() - t)

    before = (await js.stream_info(TOKENS_STREAM)).state.messages
    got: list[float] = []
    done = asyncio.Event()

    async def received(msg) -> None:
        got.append((time.perf_counter() - float(msg.headers["t"])) * 1000)
        if len(got) == frames:
            done.set()

    sub = await nc.subscribe("swarm.tok.*", cb=received)
    await nc.flush()
    t = time.perf_counter()
    for i in range(frames):  # 8 requests' frames interleaved, as 8 streams decoding at once send them
        await nc.publish(f"swarm.tok.{tag}s{i % STREAMS}", b"x" * 100, headers={"t": repr(time.perf_counter())})
    await nc.flush()
    await asyncio.wait_for(done.wait(), 60)
    while (await js.stream_info(TOKENS_STREAM)).state.messages < before + frames:
        await asyncio.sleep(0.005)
    frames_s = frames / (time.perf_counter() - t)
    await sub.unsubscribe()
    await nc.close()
    return {"ack_p50_ms": statistics.median(lat), "ack_p99_ms": _pct(lat, 0.99), "events_s": events_s,
            "frames_stored_s": frames_s, "frame_p50_ms": statistics.median(got), "frame_p99_ms": _pct(got, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=400)
    ap.add_argument("--frames", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    root = scratch_dir("swarm-bench-sync-")
    servers = {"always": EmbeddedNats(root / "always", sync=SYNC_ALWAYS).start(),
               "default": EmbeddedNats(root / "default", sync=None).start()}
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    try:
        for r in range(args.rounds):
            for name, srv in servers.items():
                got = asyncio.run(measure(srv.url, args.events, args.frames, f"r{r}"))
                runs[name].append(got)
                print(json.dumps({"sync": name, "round": r, **{k: round(v, 3) for k, v in got.items()}}), flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    med = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for name, rs in runs.items()}
    print(json.dumps({"store": str(root), "events": args.events, "frames": args.frames, "rounds": args.rounds,
                      "always_over_default": {k: round(med["always"][k] / med["default"][k], 2)
                                              for k in med["always"]},
                      "median": {n: {k: round(v, 3) for k, v in m.items()} for n, m in med.items()}}), flush=True)


if __name__ == "__main__":
    main()
