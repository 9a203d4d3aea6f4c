"""An honest pair over many requests (issue 54, leader.verify): two fellows serve one load of two replicas
of the tests' tiny model at SWARM_VERIFY_SHARE=1, half the requests greedy and half sampled, and every
reply is scored by the other replica. Prints the checks, how many passed, the greedy replies' worst gap
and the sampled ones' lowest logprob, and each fellow's trust row. An honest pair must raise no flag.

    .venv/bin/python bench/bench_verify_honest.py [--requests 500] [--method none|int8|int4-fast]

``--method``: the load's ``quantization: {"method": ...}`` (none: float32); a load placed otherwise stops it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from tests.processes import wait_until  # noqa: E402
from tests.serving_fixtures import Stack, make_servable  # noqa: E402
from tests.test_verify_replies import chat, checks, trust  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--method", choices=("none", "int8", "int4-fast"), default="int8")
    args = ap.parse_args()
    tmp = scratch_dir("verify-honest")
    _, servable = make_servable(tmp, "tiny", layers=2, hidden=64, stages=1, seed=11)
    quant = {} if args.method == "none" else {"quantization": {"method": args.method}}
    with EmbeddedNats(tmp / "js") as nats:
        s = Stack(tmp, nats.url, servable.parent, fellows=2, SWARM_VERIFY_SHARE=1, SWARM_SERVE_QUANTIZED="auto").start()
        try:
            load = s.load("tiny", replicas=2, **quant)
            served = {st["weights"].get("quantization") for st in load["stages"]}
            print("load quantization:", load.get("quantization"), load.get("quantization_reason"), served, flush=True)
            if served != {args.method}:
                raise SystemExit(f"asked {quant['quantization']}, placed {load.get('quantization')}: "
                                 f"{load.get('quantization_reason')}")
            began = time.monotonic()
            for i in range(args.requests):
                chat(s, i, 0.0 if i % 2 == 0 else 1.0)
            wait_until(lambda: len(checks(s)) >= args.requests, 300, "every reply checked")
            rows = checks(s)
            greedy = [r for r in rows if r[3] == "greedy"]
            sampled = [r for r in rows if r[3] == "sampled"]
            flags = sum(1 for r in rows if not r[4])
            print(f"{args.method}: {len(rows)} checks in {time.monotonic() - began:.0f} s, {flags} failed; "
                  f"{len(greedy)} greedy (worst gap {max(r[5] for r in greedy):.6f} nats), {len(sampled)} "
                  f"sampled (lowest logprob {min(r[5] for r in sampled):.3f}); trust {trust(s)}")
        finally:
            s.stop()


if __name__ == "__main__":
    main()
