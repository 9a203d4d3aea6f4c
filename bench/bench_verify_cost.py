"""What checking replies costs (issue 54, leader.verify): decode tokens/s and time to first token through two
stacks of two fellows serving one load of two replicas, one at SWARM_VERIFY_SHARE=0 and one at a share you
give (1 by default: every reply scored by the other replica, the worst case; the cost scales with the
share), in one run, rounds interleaved. Every process has one thread; only one stack is measured at a time,
but the checks it asks for run while it is measured (on the other replica, one prefill of prompt + reply).

    .venv/bin/python bench/bench_verify_cost.py [--rounds 3] [--tokens 64] [--share 1] [--streams 1 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_serving import load_test, make_checkpoint  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from tests.serving_fixtures import Stack  # noqa: E402

MODEL = "bench45m"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--share", type=float, default=1.0)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    tmp = scratch_dir("swarm-bench-verify-")
    from fellow.runtime.tools.export import export

    export(make_checkpoint(tmp / "hf"), tmp / "servables" / MODEL, stages=1, model_id=MODEL)
    servers, stacks = {}, {}
    try:
        for name, share in (("off", 0.0), ("on", args.share)):
            servers[name] = EmbeddedNats(tmp / f"js-{name}").start()
            (tmp / name).mkdir()
            stacks[name] = Stack(tmp / name, servers[name].url, tmp / "servables", fellows=2, OMP_NUM_THREADS=1,
                                 SWARM_VERIFY_SHARE=share).start()
            stacks[name].load(MODEL, replicas=2)
        runs: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            for name in (["off", "on"] if r % 2 == 0 else ["on", "off"]):
                for streams in args.streams:
                    runs.setdefault((name, streams), []).append(
                        asyncio.run(load_test(stacks[name].url, MODEL, streams, args.tokens)))
        checks = stacks["on"].sql("select count(*), sum(passed) from reply_checks")[0]
    finally:
        for s in stacks.values():
            s.stop()
        for n in servers.values():
            n.stop()
    print(f"{MODEL}, 2 replicas, {args.tokens} tokens a stream, share {args.share:g} against 0, "
          f"{args.rounds} interleaved rounds (median); checks {checks[0]}, passed {checks[1]}\n")
    print("| streams | tok/s off | tok/s on | on / off | TTFT ms off | TTFT ms on | on / off |")
    print("|---|---|---|---|---|---|---|")
    for streams in args.streams:
        med = {name: {k: statistics.median(run[k] for run in runs[(name, streams)]) for k in ("agg_tok_s", "ttft_ms")}
               for name in ("off", "on")}
        on, off = med["on"], med["off"]
        ratio = on['agg_tok_s'] / off['agg_tok_s']
        print(f"| {streams} | {off['agg_tok_s']:.1f} | {on['agg_tok_s']:.1f} | {ratio:.3f}x"
              f" | {off['ttft_ms']:.0f} | {on['ttft_ms']:.0f} | {on['ttft_ms'] / off['ttft_ms']:.3f}x |")


if __name__ == "__main__":
    main()
