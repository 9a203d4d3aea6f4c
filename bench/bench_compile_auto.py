"""The default (SWARM_SERVE_COMPILE=auto: the decode step compiled in the background once the stage serves)
against the fused step alone (off), through the whole stack, per shape, interleaved in one run:

- time to ready (issue 35: within 10 % of off's): the load's row, requested to ready, and the load request
  with ``wait`` until it answers;
- how long the background compile takes to be serving, and what the status says then;
- single-stream decode tokens/s through the stack once it is (and 8 streams, which stay fused).

    .venv/bin/python bench/bench_compile_auto.py [--shapes q46m-v4k llama-deep q36m-l20] [--rounds 2]

Each round loads every shape under each setting on a fresh stack (nats-server, leader, one fellow) whose
inductor cache starts empty unless ``--warm-cache``; the order of the two settings alternates by round.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402
from bench.bench_serving import load_test  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from tests.serving_fixtures import Stack  # noqa: E402

ALL = SHAPES


def measure(name: str, tmp: Path, servables: Path, setting: str, tokens: int, cache: Path | None) -> dict:
    env = {"SWARM_SERVE_COMPILE": setting, "SWARM_MODEL_IDLE_UNLOAD_S": 0, "SWARM_SERVE_PREFIX_CACHE": "off",
           "SWARM_SERVE_MAX_IN_FLIGHT": 8}
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    with EmbeddedNats(tmp / "js") as nats:
        stack = Stack(tmp, nats.url, servables, **env).start()
        try:
            started = time.perf_counter()
            r = stack.post(f"/api/v1/models/{name}/load", {"wait": True, "timeout_s": 1800}, timeout=1900)
            ready_s = time.perf_counter() - started
            assert r.status_code == 200 and r.json()["state"] == "ready", r.text
            (requested, ready), = stack.sql("SELECT requested_at, ready_at FROM loads")
            row = {"ready_s": ready_s, "sql_ready_s": ready - requested, "state": "off", "compiled_s": 0.0}
            if setting == "auto":
                while True:
                    stage = stack.get(f"/api/v1/models/{name}/status").json()["load"]["stages"][0]
                    if not stage.get("compiled", "compiling").startswith("compiling"):
                        break
                    time.sleep(0.5)
                row["compiled_s"] = time.perf_counter() - started
                row["state"] = stage["compiled"]
            row["tok_s_1"] = asyncio.run(load_test(stack.url, name, 1, tokens))["agg_tok_s"]
            row["tok_s_8"] = asyncio.run(load_test(stack.url, name, 8, tokens))["agg_tok_s"]
            return row
        finally:
            stack.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["q46m-v4k", "llama-deep", "q36m-l20"], choices=list(ALL))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--warm-cache", action="store_true", help="one inductor cache for all rounds (else each fresh)")
    args = ap.parse_args()
    from fellow.runtime.tools.export import export

    tmp = scratch_dir("compile-auto")
    for name in args.shapes:
        if not (tmp / "servables" / name / "servable.json").is_file():
            export(make_checkpoint(tmp / name / "hf", ALL[name]), tmp / "servables" / name, stages=1, model_id=name)
    rows: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for name in args.shapes:
            for setting in (("off", "auto") if rnd % 2 == 0 else ("auto", "off")):
                cache = tmp / "inductor" if args.warm_cache else tmp / f"inductor-{name}-{rnd}"
                row = measure(name, tmp / f"run-{name}-{setting}-{rnd}", tmp / "servables", setting, args.tokens,
                              cache)
                rows.setdefault((name, setting), []).append(row)
                print(name, setting, rnd, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()},
                      flush=True)
    print("\n| shape | ready s off / auto (row) | auto/off (row) | ready s off / auto (load --wait) | auto/off "
          "| compiled after s | 1 stream tok/s off / auto | auto/off "
          "| 8 streams off / auto | auto/off | auto's state |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ready_ratios, speed_ratios = [], []
    for name in args.shapes:
        off, auto = rows[(name, "off")], rows[(name, "auto")]
        med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        ready, speed, eight = (med(auto, k) / med(off, k) for k in ("sql_ready_s", "tok_s_1", "tok_s_8"))
        waited = med(auto, "ready_s") / med(off, "ready_s")
        ready_ratios.append(ready)
        speed_ratios.append(speed)
        print(f"| {name} | {med(off, 'sql_ready_s'):.2f} / {med(auto, 'sql_ready_s'):.2f} | {ready:.3f}x | "
              f"{med(off, 'ready_s'):.2f} / {med(auto, 'ready_s'):.2f} | {waited:.3f}x | "
              f"{med(auto, 'compiled_s'):.0f} | {med(off, 'tok_s_1'):.1f} / {med(auto, 'tok_s_1'):.1f} | "
              f"{speed:.2f}x | "
              f"{med(off, 'tok_s_8'):.1f} / {med(auto, 'tok_s_8'):.1f} | {eight:.2f}x | {auto[-1]['state']} |")
    print(f"\nready auto/off: max {max(ready_ratios):.3f}x; 1-stream tok/s auto/off: min {min(speed_ratios):.2f}x, "
          f"median {statistics.median(speed_ratios):.2f}x")


if __name__ == "__main__":
    main()
