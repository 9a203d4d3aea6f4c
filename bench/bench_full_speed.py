"""Time to full speed (issue 56): from a load's ``ready`` to the speed it settles at, at the defaults.

Per shape and quantization (float32, int8, int4-fast), on a fresh stack (nats-server, leader, one fellow)
whose caches start empty (``cold``), then on another fresh stack over the same caches (``warm``: inductor's
and the native kernels' libraries under the fellow's data dir): from ``ready`` on, one greedy stream after
another of ``--tokens`` tokens, each one's decode tokens/s and when it ended (seconds after ready), until the
background compile has settled and ``--after`` more streams ran. ``settled`` is the median of those last
streams; the table gives the first stream at >= 95 % of it (its end, seconds after ready) and the slowest
stream that ended more than 10 s after ready, as a share of settled.

    .venv/bin/python bench/bench_full_speed.py [--shapes q46m-v4k q36m-l20] [--quant f32 int8 int4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402
from bench.bench_serving import stream_one  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from tests.serving_fixtures import Stack  # noqa: E402

QUANT = {"f32": None, "int8": {"bits": 8}, "int4": {"method": "int4-fast"}}
SHARE = 0.95


async def streams_until_settled(stack: Stack, name: str, ready_at: float, tokens: int, after: int) -> list[dict]:
    url, out, left = stack.url + "/v1/chat/completions", [], None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        while left is None or left > 0:
            r = await stream_one(client, url, name, f"question {len(out)}", tokens)
            out.append({"end_s": r["end"] - ready_at, "tok_s": (r["tokens"] - 1) / max(r["decode_s"], 1e-9)})
            if left is not None:
                left -= 1
            else:
                stage = (await client.get(f"{stack.url}/api/v1/models/{name}/status")).json()["load"]["stages"][0]
                compiled = stage.get("compiled")  # None until the stage's first metrics report
                if compiled is not None and not compiled.startswith("compiling"):
                    left = after
                    out[-1]["state"] = compiled
    return out


def measure(name: str, quant: str, run: Path, data: Path, servables: Path, tokens: int, after: int) -> dict:
    # the fellow's defaults (SWARM_SERVE_QUANTIZED and SWARM_SERVE_COMPILE auto: the test fixture turns both off)
    env = {"SWARM_MODEL_IDLE_UNLOAD_S": 0, "SWARM_SERVE_PREFIX_CACHE": "off", "SWARM_DATA_DIR": str(data),
           "SWARM_SERVE_QUANTIZED": "auto", "SWARM_SERVE_COMPILE": "auto"}
    with EmbeddedNats(run / "js") as nats:
        stack = Stack(run, nats.url, servables, **env).start()
        try:
            body = {"wait": True, "timeout_s": 1800} | ({"quantization": QUANT[quant]} if QUANT[quant] else {})
            r = stack.post(f"/api/v1/models/{name}/load", body, timeout=1900)
            ready_at = time.perf_counter()
            assert r.status_code == 200 and r.json()["state"] == "ready", r.text
            streams = asyncio.run(streams_until_settled(stack, name, ready_at, tokens, after))
        finally:
            stack.stop()
    settled = statistics.median(s["tok_s"] for s in streams[-after:])
    first = next(s for s in streams if s["tok_s"] >= SHARE * settled)
    late = [s["tok_s"] for s in streams if s["end_s"] > 10.0]
    state = next((s["state"] for s in streams if "state" in s), "")
    return {"settled_tok_s": settled, "full_after_s": first["end_s"], "first_tok_s": streams[0]["tok_s"],
            "slowest_after_10s": min(late) / settled if late else None, "settled_after_s":
            next(s["end_s"] for s in streams if "state" in s), "streams": len(streams), "state": state}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["q46m-v4k", "llama-deep", "q36m-l20"], choices=list(SHAPES))
    ap.add_argument("--quant", nargs="+", default=list(QUANT), choices=list(QUANT))
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--after", type=int, default=5, help="streams timed once settled")
    args = ap.parse_args()
    from fellow.runtime.tools.export import export

    tmp = scratch_dir("full-speed")
    rows = []
    for name in args.shapes:
        export(make_checkpoint(tmp / name / "hf", SHAPES[name]), tmp / "servables" / name, stages=1, model_id=name)
        for quant in args.quant:
            data = tmp / f"data-{name}-{quant}"  # its caches: empty for the cold load, kept for the warm one
            for cache in ("cold", "warm"):
                row = measure(name, quant, tmp / f"run-{name}-{quant}-{cache}", data, tmp / "servables",
                              args.tokens, args.after)
                rows.append({"shape": name, "quant": quant, "cache": cache, **row})
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}),
                      flush=True)
    print("\n| shape | weights | cache | settled tok/s | first stream tok/s | >= 95 % after (s) "
          "| slowest after 10 s / settled | compile settled after (s) | what serves |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        slow = "-" if r["slowest_after_10s"] is None else f"{r['slowest_after_10s']:.2f}"
        print(f"| {r['shape']} | {r['quant']} | {r['cache']} | {r['settled_tok_s']:.1f} | {r['first_tok_s']:.1f} "
              f"| {r['full_after_s']:.1f} | {slow} | {r['settled_after_s']:.0f} | {r['state'][:90]} |")
    for cache in ("cold", "warm"):
        full = [r["full_after_s"] for r in rows if r["cache"] == cache]
        print(f"{cache}: >= 95 % of settled after {min(full):.1f}-{max(full):.1f} s "
              f"(median {statistics.median(full):.1f}) over {len(full)} loads")


if __name__ == "__main__":
    main()
