"""What the trust checks cost (issue 38): decode tokens/s and time to first token at 1 and 8 streams through
a stack whose NATS has a user per role (signed token frames, permissions checked by nats-server, events
screened against placement) against one without (anonymous NATS, unsigned frames), in one run, rounds
interleaved. Both stacks serve the same ~45M Qwen3 (bench_serving's) on one fellow each, one thread a
process; only one is measured at a time.

    .venv/bin/python bench/bench_trust_cost.py [--rounds 3] [--tokens 96] [--layout cluster]

``--layout cluster``: each stack's NATS is a 3-node JetStream cluster on this host (streams at 3 replicas,
SWARM_NATS_REPLICAS=3), the leader and fellow connected to its first node; else one nats-server each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_serving import load_test, make_checkpoint  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from core.nats_auth import AuthDir  # noqa: E402
from core.nats_server import EmbeddedNats, local_cluster  # noqa: E402
from tests.serving_fixtures import Stack, secured_processes, stop_all  # noqa: E402

MODEL = "bench45m"


def load(url: str) -> None:
    r = httpx.post(f"{url}/api/v1/models/{MODEL}/load", json={"wait": True}, timeout=300)
    assert r.status_code == 200 and r.json()["state"] == "ready", r.text


def servers(base: Path, layout: str, config=None) -> list[EmbeddedNats]:
    """One stack's NATS, started: one server, or a 3-node JetStream cluster."""
    nodes = [EmbeddedNats(base, config=config)] if layout == "single" else local_cluster(base, 3, config=config)
    for node in nodes:
        node.start()
    return nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layout", choices=["single", "cluster"], default="single")
    args = ap.parse_args()
    replicas = {"SWARM_NATS_REPLICAS": 3} if args.layout == "cluster" else {}
    tmp = scratch_dir("swarm-bench-trust-")
    from fellow.runtime.tools.export import export

    export(make_checkpoint(tmp / "hf"), tmp / "servables" / MODEL, stages=1, model_id=MODEL)
    auth = AuthDir(tmp / "auth")
    auth.ensure(["f0"])
    plain_nats = servers(tmp / "js-plain", args.layout)
    secured_nats = servers(tmp / "js-secured", args.layout, config=auth.config)
    (tmp / "plain").mkdir()
    (tmp / "secured").mkdir()
    # secured_processes runs every process with OMP_NUM_THREADS=1 (as the trust tests do): the plain stack too
    plain = Stack(tmp / "plain", plain_nats[0].url, tmp / "servables", OMP_NUM_THREADS=1, **replicas).start()
    leader, fellows = secured_processes(tmp / "secured", auth, secured_nats[0].url, tmp / "servables", ["f0"],
                                        **replicas)
    try:
        urls = {"without": plain.url, "with": leader.base_url}
        for url in urls.values():
            load(url)
        runs: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            order = ["without", "with"] if r % 2 == 0 else ["with", "without"]
            for name in order:
                for streams in args.streams:
                    runs.setdefault((name, streams), []).append(
                        asyncio.run(load_test(urls[name], MODEL, streams, args.tokens)))
    finally:
        plain.stop()
        stop_all(leader, fellows)
        for node in plain_nats + secured_nats:
            node.stop()
    print(f"{MODEL}, {args.tokens} tokens a stream, {args.rounds} interleaved rounds (median), NATS: {args.layout}\n")
    print("| streams | tok/s without | tok/s with | with / without | TTFT ms without | TTFT ms with | with / without |")
    print("|---|---|---|---|---|---|---|")
    for streams in args.streams:
        med = {name: {k: statistics.median(run[k] for run in runs[(name, streams)]) for k in ("agg_tok_s", "ttft_ms")}
               for name in ("without", "with")}
        w, o = med["with"], med["without"]
        print(f"| {streams} | {o['agg_tok_s']:.1f} | {w['agg_tok_s']:.1f} | {w['agg_tok_s'] / o['agg_tok_s']:.3f}x | "
              f"{o['ttft_ms']:.0f} | {w['ttft_ms']:.0f} | {w['ttft_ms'] / o['ttft_ms']:.3f}x |")


if __name__ == "__main__":
    main()
