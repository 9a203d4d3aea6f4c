"""A 2- or 3-stage ring over simulated WAN links: direct links against the relay, 1 and 4 sessions in flight.

One home per stage, every two homes at a round trip of RTT ms (one way RTT/2), every link between
them through a delay proxy (tests/delay_proxy.py, each in a process of its own): nats-server and
stage 0 are in home 0, stage i in home i. So each later stage's NATS connection crosses the WAN, and
so does every direct hop (0 -> 1 -> ... -> 0: one crossing a hop). The ring is the real one
(ring_engine, RingWorker, RingLink over a real nats-server), its stages in this process on threads of
their own (tests/bus_ring.py), greedy, no stop ids.

For each stage count, RTT and route it reports decode tokens/s at 1 and at 4 sessions in flight (the
sum of each session's own decode rate), the stages' compute per token (c = c0 + c1 + ...), and the
bound for one session: 1 / (c + S RTT/2) for S stages, a token crossing each of the S hops once (two
stages: 1 / (c + RTT)); and the issue's looser 1 / (c + S RTT). Bytes per token on the wire, with
and without a trained bottleneck, come from a 0 ms run of the first stage count.

    .venv/bin/python bench/bench_links.py --rtt 0 20 50 [--stages 2 3]

With --sized, direct links only: decode tokens/s at 1 in flight, at the fixed plan (4 a stage) and at
the in flight stage 0 sizes from its stages' measured steps and probe trips round the ring
(fellow.runtime.ring.sizing, the same code a ring's stage 0 runs at start), all on the same ring.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from fellow.runtime.tools.export import export  # noqa: E402
from tests.bus_ring import BusRing  # noqa: E402
from tests.delay_proxy import SpawnedProxy  # noqa: E402
from tests.processes import free_port  # noqa: E402
from tests.serving_fixtures import make_servable  # noqa: E402

PROMPTS = [list(range(5, 40)), list(range(100, 130)), list(range(200, 232)), [3, 9, 27] * 10]


def prompts(n: int) -> list[list[int]]:
    """``n`` different prompts of 30 ids: PROMPTS first."""
    more = ([(5 + 13 * i + 7 * j) % 247 + 3 for j in range(30)] for i in range(max(0, n - len(PROMPTS))))
    return [*PROMPTS, *more][:n]


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def homes(nats: EmbeddedNats, stages: int, rtt_ms: float) -> tuple[dict, dict, dict]:
    """One home per stage, every two at a round trip of ``rtt_ms`` (0: plain loopback, no proxy): the
    delay proxies (stop them after), each later stage's way to home 0's nats-server, and where each
    stage listens and what it gives its predecessor to dial (BusRing's ``urls`` and ``listen``)."""
    if not rtt_ms:
        return {}, {}, {}
    one_way = rtt_ms / 2000
    ports = {i: free_port() for i in range(stages)}
    proxies = {i: SpawnedProxy(("127.0.0.1", p), delay_s=one_way) for i, p in ports.items()}
    proxies["nats"] = SpawnedProxy(host_port(nats.url), delay_s=one_way)  # later stages' way to home 0's server
    urls = {i: f"nats://{proxies['nats'].address}" for i in range(1, stages)}
    listen = {i: (ports[i], proxies[i].address) for i in ports}
    return proxies, urls, listen


async def measure(model: Path, nats: EmbeddedNats, rtt_ms: float, links: str, tokens: int, in_flight: list[int],
                  stages: int = 2) -> dict:
    proxies, urls, listen = homes(nats, stages, rtt_ms)
    ring = BusRing(model, stages, links, listen=listen, prefill_chunk=256)
    try:
        await ring.start(nats.url, urls=urls)
        await asyncio.to_thread(ring.generate, PROMPTS[:1], 4)  # warm
        out = {"stages": stages, "rtt_ms": rtt_ms, "links": links, "routes": ring.routes,
               "probe_ms": ring.links_[0].probe_ms}
        for n in in_flight:
            replies, timings = await asyncio.to_thread(ring.generate, PROMPTS[:n], tokens)
            assert all(len(r) == tokens for r in replies.values()), replies
            rate = sum(t["tokens_per_s"] for t in timings.values())
            out[f"tok_s_{n}"] = round(rate, 2)
            if n == 1:
                t = next(iter(timings.values()))
                out.update(c_ms=[t[f"stage{i}_ms"] for i in range(stages)], link_ms=t["link_ms"], route=t["route"],
                           bytes_per_token=t["bytes_per_token"])
        compute = sum(out["c_ms"])
        out["bound_tok_s"] = round(1000 / (compute + stages * rtt_ms / 2), 2)
        out["issue_bound_tok_s"] = round(1000 / (compute + stages * rtt_ms), 2)
        return out
    finally:
        await ring.close()
        for proxy in proxies.values():
            proxy.stop()


async def measure_sized(model: Path, nats: EmbeddedNats, rtt_ms: float, tokens: int, stages: int,
                        per_group: int = 4, ceiling_per_stage: int = 16) -> dict:
    """Direct links: decode tokens/s at 1 in flight, at the fixed plan (per_group a stage) and at what
    stage 0 sizes from its measured steps and links (fellow.runtime.ring.sizing), the same ring."""
    proxies, urls, listen = homes(nats, stages, rtt_ms)
    ring = BusRing(model, stages, "direct", listen=listen, prefill_chunk=256)
    try:
        await ring.start(nats.url, urls=urls)
        await asyncio.to_thread(ring.generate, PROMPTS[:1], 4)  # warm
        sizing = await ring.size(per_group, ceiling_per_stage * stages)
        out = {"sized": True, "stages": stages, "rtt_ms": rtt_ms, "routes": ring.routes, **sizing.as_dict()}
        fixed = per_group * stages
        for label, n, groups in (("1", 1, stages), ("fixed", fixed, stages),
                                 ("sized", sizing.in_flight, sizing.groups)):
            ring.head.runner.units.groups = groups
            replies, timings = await asyncio.to_thread(ring.generate, prompts(n), tokens)
            assert all(len(r) == tokens for r in replies.values()), replies
            out[f"tok_s_{label}"] = round(sum(t["tokens_per_s"] for t in timings.values()), 2)
        out["fixed_in_flight"] = fixed
        return out
    finally:
        await ring.close()
        for proxy in proxies.values():
            proxy.stop()


async def run(args) -> list[dict]:
    root = scratch_dir("bench-links-")
    models, hfs = {}, {}
    for n in args.stages:  # the same seed: the same weights, split in n
        hfs[n], models[n] = make_servable(root / f"s{n}", "wan", layers=args.layers, hidden=args.hidden, stages=n)
    first = args.stages[0]
    hf = hfs[first]
    bottleneck = root / "servables" / "wan-bn"
    export(hf, bottleneck, stages=first, bottleneck=args.hidden // 8, model_id="wan-bn", calib_sequences=16,
           calib_seq_len=64)
    nats = EmbeddedNats(root / "jetstream").start()
    rows = []
    try:
        if args.sized:
            for n in args.stages:
                for rtt in args.rtt:
                    row = await measure_sized(models[n], nats, rtt, args.tokens, n)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            return rows
        for n in args.stages:
            for rtt in args.rtt:
                for links in ("relay", "direct"):
                    row = await measure(models[n], nats, rtt, links, args.tokens, [1, 4], n)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        bn = await measure(bottleneck, nats, 0, "direct", args.tokens, [1], first)
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
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the stages share this process)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2], choices=[2, 3])
    ap.add_argument("--sized", action="store_true",
                    help="direct links only: 1 in flight, the fixed 4 a stage, and what stage 0 sizes from its "
                         "measured steps and links")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = asyncio.run(run(args))
    if args.sized:
        print("\n| stages | RTT ms | steps ms (4 rows) | links ms | groups | in flight | 1 tok/s | fixed tok/s "
              "| sized tok/s | sized / fixed | sized / 1 |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['stages']} | {r['rtt_ms']:g} | {' + '.join(f'{ms:.2f}' for ms in r['step_ms'])} | "
                  f"{r['transit_ms']:.1f} | {r['groups']} | {r['in_flight']} | {r['tok_s_1']:.1f} | "
                  f"{r['tok_s_fixed']:.1f} ({r['fixed_in_flight']}) | {r['tok_s_sized']:.1f} | "
                  f"{r['tok_s_sized'] / r['tok_s_fixed']:.2f}x | {r['tok_s_sized'] / r['tok_s_1']:.2f}x |")
        return
    print("\n| stages | RTT ms | route | c ms | 1 in flight tok/s | bound 1/(c+S RTT/2) | ratio | issue's 1/(c+S RTT) "
          "| ratio | 4 in flight tok/s | 4 / 1 | bytes/token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "bottleneck" in r:
            continue
        c = sum(r["c_ms"])
        print(f"| {r['stages']} | {r['rtt_ms']:g} | {r['route']} | {c:.2f} | {r['tok_s_1']:.2f} | "
              f"{r['bound_tok_s']:.2f} | "
              f"{r['tok_s_1'] / r['bound_tok_s']:.2f}x | {r['issue_bound_tok_s']:.2f} | "
              f"{r['tok_s_1'] / r['issue_bound_tok_s']:.2f}x | {r['tok_s_4']:.2f} | "
              f"{r['tok_s_4'] / r['tok_s_1']:.2f}x | "
              f"{r['bytes_per_token']:g} |")
    for n, rtt in sorted({(r["stages"], r["rtt_ms"]) for r in rows if "bottleneck" not in r}):
        by = {r["links"]: r for r in rows if (r.get("stages"), r.get("rtt_ms")) == (n, rtt) and "bottleneck" not in r}
        if {"relay", "direct"} <= set(by):
            print(f"{n} stages, RTT {rtt:g} ms: direct / relay, 1 in flight: "
                  f"{by['direct']['tok_s_1'] / by['relay']['tok_s_1']:.2f}x")
    bn = next(r for r in rows if "bottleneck" in r)
    plain = next(r for r in rows if "bottleneck" not in r)
    print(f"bytes per token: {plain['bytes_per_token']:g} without a bottleneck, {bn['bytes_per_token']:g} with a "
          f"trained {bn['bottleneck']}-wide one")


if __name__ == "__main__":
    main()
