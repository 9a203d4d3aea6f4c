"""A 2-stage ring over simulated WAN links: direct links against the relay, 1 and 4 sessions in flight.

Two homes, A and B, at a round trip of RTT ms (one way RTT/2), every link between them through a
delay proxy (tests/delay_proxy.py, each in a process of its own): nats-server and stage 0 are in home A, stage 1 in home B. So
stage 1's NATS connection crosses the WAN, and so do both direct hops (0 -> 1 and 1 -> 0). The ring
is the real one (RingHead, RingWorker, RingLink over a real nats-server), its stages in this process on
threads of their own (tests/bus_ring.py), greedy, no stop ids.

For each RTT and route it reports decode tokens/s at 1 and at 4 sessions in flight (the sum of each
session's own decode rate), the stages' compute per token (c0, c1), and the bound for one session:
1 / (c0 + c1 + RTT), a token crossing each hop once; and the issue's looser 1 / (c0 + c1 + 2 RTT).
Bytes per token on the wire, with and without a trained bottleneck, come from a 0 ms run.

    .venv/bin/python bench/bench_links.py --rtt 0 20 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from core.nats_server import EmbeddedNats  # noqa: E402
from fellow.runtime.tools.export import export  # noqa: E402
from tests.bus_ring import BusRing  # noqa: E402
from tests.delay_proxy import SpawnedProxy  # noqa: E402
from tests.processes import free_port  # noqa: E402
from tests.serving_fixtures import make_servable  # noqa: E402

PROMPTS = [list(range(5, 40)), list(range(100, 130)), list(range(200, 232)), [3, 9, 27] * 10]


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


async def measure(model: Path, nats: EmbeddedNats, rtt_ms: float, links: str, tokens: int, in_flight: list[int]) -> dict:
    one_way = rtt_ms / 2000
    ports = {0: free_port(), 1: free_port()}
    proxies, urls, listen = {}, {}, {}
    if rtt_ms:  # 0: plain loopback, no proxy in the way
        proxies = {i: SpawnedProxy(("127.0.0.1", p), delay_s=one_way) for i, p in ports.items()}
        proxies["nats"] = SpawnedProxy(host_port(nats.url), delay_s=one_way)  # stage 1's way to home A's server
        urls = {1: f"nats://{proxies['nats'].address}"}
        listen = {i: (ports[i], proxies[i].address) for i in ports}
    ring = BusRing(model, 2, links, listen=listen, prefill_chunk=256)
    try:
        await ring.start(nats.url, urls=urls)
        await asyncio.to_thread(ring.generate, PROMPTS[:1], 4)  # warm
        out = {"rtt_ms": rtt_ms, "links": links, "routes": ring.routes,
               "probe_ms": ring.links_[0].probe_ms}
        for n in in_flight:
            replies, timings = await asyncio.to_thread(ring.generate, PROMPTS[:n], tokens)
            assert all(len(r) == tokens for r in replies.values()), replies
            rate = sum(t["tokens_per_s"] for t in timings.values())
            out[f"tok_s_{n}"] = round(rate, 2)
            if n == 1:
                t = next(iter(timings.values()))
                out.update(c0_ms=t["stage0_ms"], c1_ms=t["stage1_ms"], link_ms=t["link_ms"], route=t["route"],
                           bytes_per_token=t["bytes_per_token"])
        compute = out["c0_ms"] + out["c1_ms"]
        out["bound_tok_s"] = round(1000 / (compute + rtt_ms), 2)
        out["issue_bound_tok_s"] = round(1000 / (compute + 2 * rtt_ms), 2)
        return out
    finally:
        await ring.close()
        for proxy in proxies.values():
            proxy.stop()


async def run(args) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="bench-links-"))
    hf, model = make_servable(root, "wan", layers=args.layers, hidden=args.hidden, stages=2)
    bottleneck = root / "servables" / "wan-bn"
    export(hf, bottleneck, stages=2, bottleneck=args.hidden // 8, model_id="wan-bn", calib_sequences=16,
           calib_seq_len=64)
    nats = EmbeddedNats(root / "jetstream").start()
    rows = []
    try:
        for rtt in args.rtt:
            for links in ("relay", "direct"):
                row = await measure(model, nats, rtt, links, args.tokens, [1, 4])
                print(json.dumps(row), flush=True)
                rows.append(row)
        bn = await measure(bottleneck, nats, 0, "direct", args.tokens, [1])
        print(json.dumps({"bottleneck": args.hidden // 8, **bn}), flush=True)
        rows.append({"bottleneck": args.hidden // 8, **bn})
    finally:
        nats.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt", type=float, nargs="+", default=[0, 20, 50])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both stages share this process)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = asyncio.run(run(args))
    print("\n| RTT ms | route | c0+c1 ms | 1 in flight tok/s | bound 1/(c+RTT) | ratio | issue's 1/(c+2RTT) | ratio "
          "| 4 in flight tok/s | 4 / 1 | bytes/token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "bottleneck" in r:
            continue
        c = r["c0_ms"] + r["c1_ms"]
        print(f"| {r['rtt_ms']:g} | {r['route']} | {c:.2f} | {r['tok_s_1']:.2f} | {r['bound_tok_s']:.2f} | "
              f"{r['tok_s_1'] / r['bound_tok_s']:.2f}x | {r['issue_bound_tok_s']:.2f} | "
              f"{r['tok_s_1'] / r['issue_bound_tok_s']:.2f}x | {r['tok_s_4']:.2f} | {r['tok_s_4'] / r['tok_s_1']:.2f}x | "
              f"{r['bytes_per_token']:g} |")
    for rtt in sorted({r["rtt_ms"] for r in rows if "bottleneck" not in r}):
        by = {r["links"]: r for r in rows if r.get("rtt_ms") == rtt and "bottleneck" not in r}
        if {"relay", "direct"} <= set(by):
            print(f"RTT {rtt:g} ms: direct / relay, 1 in flight: {by['direct']['tok_s_1'] / by['relay']['tok_s_1']:.2f}x")
    bn = next(r for r in rows if "bottleneck" in r)
    plain = next(r for r in rows if "bottleneck" not in r)
    print(f"bytes per token: {plain['bytes_per_token']:g} without a bottleneck, {bn['bytes_per_token']:g} with a "
          f"trained {bn['bottleneck']}-wide one")


if __name__ == "__main__":
    main()
