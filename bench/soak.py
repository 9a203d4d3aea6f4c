"""Soak: a real `swarm up` (nats-server with its users, leader, one fellow, autoload) under steady
streaming load, first quiet, then with a fault injected at a fixed interval; then the count.

    .venv/bin/python bench/soak.py [--minutes 10] [--concurrency 8] [--fault-every 30] [--tokens 16] [--demo] [--keep]

Half the time is quiet (the RSS growth is measured there, after a warm-up of a fifth of it); the
other half SIGKILLs, in turn, the fellow's stage process, the fellow, the leader and nats-server
(`swarm up` restarts each). Every request streams; the first SSE chunk names its request id,
so a request counts as *accepted* once its client saw an id. At the end, after the stack settles:

- sent, accepted, finished (reply whole with [DONE]), failed (an error status, an error chunk, or a
  broken stream), refused (no id: the leader was down);
- lost: accepted, yet no final row (`finished`/`failed`/`too_long`) in SQL; duplicated: a request id
  twice in SQL or in the client's own list;
- end-to-end latency p50/p99 of the finished ones, quiet phase and fault phase apart;
- RSS of the leader and the fellow (with its stage processes) after the warm-up and at the end of the
  quiet phase.

By default the model is a tiny random Qwen3 (the same shape as the tests'); --demo serves the demo
model (`swarm up` builds it once, about two minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.processes import free_port, wait_until  # noqa: E402

FINAL = ("finished", "failed", "too_long")
FAULTS = ("stage", "fellow", "leader", "nats-server")
SERIES_S = 15.0  # seconds between RSS samples over the quiet half


class Tally:
    def __init__(self) -> None:
        self.sent = self.finished = self.failed = self.refused = 0
        self.accepted: list[str] = []
        self.latency: dict[str, list[float]] = {"quiet": [], "faults": []}
        self.errors: dict[str, int] = {}

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def one_request(http: httpx.AsyncClient, body: dict, tally: Tally, phase: str) -> bool:
    """One streamed request, counted; False when the leader could not be reached at all."""
    tally.sent += 1
    start, rid, done = time.monotonic(), None, False
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                tally.failed += 1  # not accepted, but answered: counted as failed, never as lost
                tally.error(f"http {r.status_code} {r.json().get('error', {}).get('code', '')}".strip())
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if rid is None and chunk.get("id"):
                    rid = chunk["id"].removeprefix("chatcmpl-")
                    tally.accepted.append(rid)
                if "error" in chunk:
                    tally.error(f"error chunk {chunk['error'].get('code')}")
                    break
    except httpx.HTTPError as exc:
        if rid is None:
            tally.refused += 1
            tally.error(f"no id: {type(exc).__name__}")
            return False
        tally.error(f"broken stream: {type(exc).__name__}")
    if done:
        tally.finished += 1
        tally.latency[phase].append(time.monotonic() - start)
    elif rid is not None:
        tally.failed += 1
    return True


def children(pid: int) -> dict[str, psutil.Process]:
    """`swarm up`'s children by role, and the stage processes under the fellow."""
    out = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if cmd and cmd[0].endswith("nats-server"):
            out["nats-server"] = p
        elif "core.cli" in cmd and "leader" in cmd:
            out["leader"] = p
        elif "core.cli" in cmd and "fellow" in cmd:
            out["fellow"] = p
        elif "fellow.runtime" in cmd:
            out["stage"] = p
    return out


def rss(procs: dict[str, psutil.Process]) -> dict[str, int]:
    def of(*names):
        total = 0
        for n in names:
            try:
                total += procs[n].memory_info().rss
            except (KeyError, psutil.Error):
                pass
        return total

    return {"leader": of("leader"), "fellow": of("fellow", "stage")}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def soak(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="swarm-soak-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    port = free_port()
    env.update(SWARM_DATA_DIR=str(tmp / "data"), SWARM_LEADER_PORT=str(port), SWARM_AUTOLOAD="1",
               SWARM_MODEL_IDLE_UNLOAD_S="0", SWARM_LOG_FORMAT="text")
    model = "swarm-demo"
    if args.demo and args.models:
        env["SWARM_SERVABLE_MODELS_ROOT"] = str(Path(args.models).resolve())
    if not args.demo:
        from tests.serving_fixtures import make_servable

        model = "tiny-soak"
        make_servable(tmp / "models", model, layers=2, hidden=64, stages=1, seed=1)
        env["SWARM_SERVABLE_MODELS_ROOT"] = str(tmp / "models" / "servables")
    cmd = [sys.executable, "-m", "core.cli", "up"] + ([] if args.demo else ["--no-demo"])
    log = open(tmp / "up.log", "ab")
    up = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    tally, faults, samples, series = Tally(), [], {}, []
    try:
        # with --demo, `swarm up` first trains the demo model (minutes on two busy cores)
        wait_until(lambda: httpx.get(base + "/healthz", timeout=2).json().get("nats"), 1800 if args.demo else 600,
                   "the stack")
        body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": args.tokens, "stream": True, "temperature": 0.7}
        quiet_s = args.minutes * 30.0
        start = time.monotonic()
        phase = "quiet"
        stop = asyncio.Event()

        async def client() -> None:
            async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(120, connect=5)) as http:
                while not stop.is_set():
                    if not await one_request(http, body, tally, phase):
                        await asyncio.sleep(0.2)  # the leader is restarting: no busy loop

        clients = [asyncio.create_task(client()) for _ in range(args.concurrency)]
        next_fault, turn = start + quiet_s + args.fault_every / 2, 0
        while time.monotonic() - start < args.minutes * 60:
            await asyncio.sleep(1.0)
            now = time.monotonic() - start
            procs = children(up.pid)
            if phase == "quiet":
                if now >= len(series) * SERIES_S:
                    mib = rss(procs)
                    series.append((round(now), round(mib["leader"] / 2**20, 1), round(mib["fellow"] / 2**20, 1)))
                if now >= quiet_s / 5 and "warm" not in samples:
                    samples["warm"] = rss(procs)
                if now >= quiet_s:
                    samples["quiet_end"] = rss(procs)
                    phase = "faults"
            elif time.monotonic() >= next_fault:
                role = args.faults[turn % len(args.faults)]
                turn += 1
                next_fault += args.fault_every
                if role in procs:
                    os.kill(procs[role].pid, signal.SIGKILL)
                    faults.append((round(now, 1), role))
        stop.set()
        await asyncio.gather(*clients)
        db = tmp / "data" / "swarm.db"

        def settled():
            with sqlite3.connect(db) as conn:
                rows = conn.execute("SELECT request_id, status FROM requests").fetchall()
            return rows if rows and all(s in FINAL for _, s in rows) else None

        try:
            rows = wait_until(settled, 120, "every row final", interval=1.0)
        except AssertionError:
            with sqlite3.connect(db) as conn:
                rows = conn.execute("SELECT request_id, status FROM requests").fetchall()
        status = dict(rows)
        lost = [r for r in tally.accepted if status.get(r) not in FINAL]
        dup = len(tally.accepted) - len(set(tally.accepted)) + len(rows) - len(status)
        growth = {k: (samples["quiet_end"][k] - samples["warm"][k]) / samples["warm"][k]
                  for k in samples.get("warm", {}) if samples["warm"][k]} if "quiet_end" in samples else {}
        return {
            "minutes": args.minutes, "concurrency": args.concurrency, "tokens": args.tokens, "model": model,
            "sent": tally.sent, "accepted": len(tally.accepted), "finished": tally.finished,
            "failed": tally.failed, "refused": tally.refused, "lost": len(lost), "duplicated": dup,
            "rows_not_final": sum(s not in FINAL for s in status.values()), "rows": len(rows),
            "faults": faults, "errors": tally.errors,
            "latency_s": {ph: {"n": len(v), "p50": percentile(v, 0.5), "p99": percentile(v, 0.99),
                               "mean": statistics.fmean(v) if v else None} for ph, v in tally.latency.items()},
            "rss_mib": {k: {ph: round(v[k] / 2**20, 1) for ph, v in samples.items()} for k in ("leader", "fellow")},
            "rss_growth_quiet": {k: round(v * 100, 2) for k, v in growth.items()},
            "rss_series_mib": series,  # (s, leader, fellow) every SERIES_S over the quiet half
            "data": str(tmp) if args.keep else None,
        }
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        log.close()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults in the fault phase")
    p.add_argument("--tokens", type=int, default=16, help="max_tokens of each request")
    p.add_argument("--demo", action="store_true", help="serve the demo model instead of a tiny one")
    p.add_argument("--models", help="with --demo: a servables folder that already holds swarm-demo "
                                     "(`swarm demo-model DIR/swarm-demo`), so `swarm up` does not train it")
    p.add_argument("--keep", action="store_true", help="keep the stack's data folder (logs, database)")
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS),
                   help="the processes killed in turn in the fault half (default: all four kinds)")
    args = p.parse_args()
    print(json.dumps(asyncio.run(soak(args)), indent=1))


if __name__ == "__main__":
    main()
