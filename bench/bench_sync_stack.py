"""Decode tokens/s through the whole stack with JetStream synced (`sync_interval: always`, the project's
setting) beside nats-server's default sync, in one run (issue 53; bench/bench_nats_sync.py times the bus alone).

    .venv/bin/python bench/bench_sync_stack.py [--concurrency 1 8] [--tokens 64] [--rounds 3] [--env NAME=VALUE ...]

Two real stacks, each its own nats-server (its store under the system's temporary folder, a real disk),
leader, fellow and stage, serve bench_serving's ~45M-parameter Qwen3; each round, at each concurrency,
each stack in turn (the order reversed every other round) streams that many replies at once, after a
round that is not counted. It prints
each stack's median over rounds of the aggregate tokens/s and the single stream's TTFT, and synced over
default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_serving import load_test, make_checkpoint  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import SYNC_ALWAYS, EmbeddedNats  # noqa: E402
from tests.serving_fixtures import Stack  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for both stacks' leader and fellow")
    args = ap.parse_args()
    tmp = scratch_dir("swarm-bench-sync-stack-")
    from fellow.runtime.tools.export import export

    export(make_checkpoint(tmp / "hf"), tmp / "servables" / "bench45m", stages=1, model_id="bench45m")
    servers, stacks = {}, {}
    try:
        for name, sync in (("always", SYNC_ALWAYS), ("default", None)):
            servers[name] = EmbeddedNats(tmp / name / "js", sync=sync).start()
            stacks[name] = Stack(tmp / name, servers[name].url, tmp / "servables", SWARM_MODEL_IDLE_UNLOAD_S=0,
                                 SWARM_SERVE_MAX_IN_FLIGHT=max(args.concurrency),
                                 **dict(kv.split("=", 1) for kv in args.env)).start()
            stacks[name].load("bench45m")
        got: dict[str, dict[int, list[dict]]] = {n: {c: [] for c in args.concurrency} for n in stacks}
        for r in range(-1, args.rounds):  # round -1 warms both stacks up (its first replies run 5-10x slower)
            order = list(stacks) if r % 2 == 0 else list(reversed(stacks))
            for c in args.concurrency:
                for name in order:
                    res = asyncio.run(load_test(stacks[name].url, "bench45m", c, args.tokens))
                    if r < 0:
                        continue
                    got[name][c].append(res)
                    print(json.dumps({"sync": name, "round": r, "streams": c, "agg_tok_s": round(res["agg_tok_s"], 1),
                                      "ttft_ms": round(res["ttft_ms"], 1)}), flush=True)
    finally:
        for name in list(stacks):
            stacks[name].stop()
        for srv in servers.values():
            srv.stop()
    for c in args.concurrency:
        med = {n: {k: statistics.median(x[k] for x in got[n][c]) for k in ("agg_tok_s", "ttft_ms")} for n in got}
        a, d = med["always"], med["default"]
        print(json.dumps({"streams": c, "tokens": args.tokens, "rounds": args.rounds,
                          "always": {k: round(v, 1) for k, v in a.items()},
                          "default": {k: round(v, 1) for k, v in d.items()},
                          "tok_s_always_over_default": round(a["agg_tok_s"] / d["agg_tok_s"], 3),
                          "ttft_always_over_default": round(a["ttft_ms"] / d["ttft_ms"], 3)}), flush=True)


if __name__ == "__main__":
    main()
