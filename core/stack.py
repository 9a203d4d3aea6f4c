"""`swarm up`: the embedded stack — nats-server, leader and local fellows — started and stopped together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from core.nats_server import EmbeddedNats
from core.procs import spawn_child, stop_child
from core.settings import Settings

DEMO_MODEL_ID = "swarm-demo"


def _wait_http(url: str, procs: list[subprocess.Popen], timeout: float, check) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a stack process exited early (code {p.returncode})")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200 and check(r.json()):
                return r.json()
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready within {timeout:.0f}s (last: {last})")


def ensure_demo_model(settings: Settings) -> None:
    """Build the demo servable once (in a subprocess: torch stays out of this process)."""
    target = settings.servable_models_root / DEMO_MODEL_ID
    if (target / "servable.json").exists():
        return
    print(f"building the demo model into {target} (once; about two minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "core.cli", "demo-model", str(target)], check=True)


def run_stack(settings: Settings, fellows: int = 1, demo: bool = True) -> int:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if demo:
        ensure_demo_model(settings)
    nats = None
    env = dict(os.environ)
    env.setdefault("SWARM_AUTOLOAD", "1")
    if not settings.nats_url:
        nats = EmbeddedNats(settings.nats_store_dir).start()
        env["SWARM_NATS_URL"] = nats.url
    env["SWARM_DATA_DIR"] = str(settings.data_dir)
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        procs.append(spawn_child([sys.executable, "-m", "core.cli", "leader"], env=env))
        for i in range(fellows):
            procs.append(spawn_child([sys.executable, "-m", "core.cli", "fellow", "--id", f"local-{i}"],
                                     env=env))
        base = f"http://{settings.leader_host}:{settings.leader_port}"
        _wait_http(base + "/healthz", procs, 60, lambda b: b.get("nats"))
        _wait_http(base + "/api/v1/fellows", procs, 60,
                   lambda b: sum(f["status"] == "online" for f in b["data"]) >= fellows)
        print(f"swarm is up: {base}  (nats {env['SWARM_NATS_URL']}, data {settings.data_dir})", flush=True)
        print(f"  chat: {base}/v1/chat/completions   fellows: {base}/api/v1/fellows   Ctrl-C stops",
              flush=True)
        while not stop.is_set():
            if any(p.poll() is not None for p in procs):
                print("swarm: a stack process exited; stopping", file=sys.stderr)
                break
            stop.wait(0.5)
        return 0
    finally:
        for p in reversed(procs):  # fellows first, then the leader
            stop_child(p)
        if nats is not None:
            nats.stop()
        print("swarm stopped", flush=True)
