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
from core.supervise import Child, GaveUp, Supervisor

DEMO_MODEL_ID = "swarm-demo"


def _wait_http(url: str, sup: Supervisor, timeout: float, check) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if not sup.tick():
            raise RuntimeError("a stack process exited during the start")
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


def _children(settings: Settings, env: dict, fellows: int) -> list[Child]:
    """nats-server (unless SWARM_NATS_URL names one), the leader, the fellows: each restarted when it dies."""
    out = []
    if not settings.nats_url:
        nats = EmbeddedNats(settings.nats_store_dir)

        def start_nats() -> subprocess.Popen:  # the same store, and after the first start the same port
            nats.start()
            env["SWARM_NATS_URL"] = nats.url
            return nats.process

        out.append(Child("nats-server", start_nats, lambda proc: stop_child(proc)))

    def part(*args: str):
        return lambda: spawn_child([sys.executable, "-m", "core.cli", *args], env=env)

    out.append(Child("the leader", part("leader"), stop_child))
    out += [Child(f"fellow local-{i}", part("fellow", "--id", f"local-{i}"), stop_child, essential=False)
            for i in range(fellows)]
    return out


def run_stack(settings: Settings, fellows: int = 1, demo: bool = True) -> int:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if demo:
        ensure_demo_model(settings)
    env = dict(os.environ)
    env.setdefault("SWARM_AUTOLOAD", "1")
    env["SWARM_DATA_DIR"] = str(settings.data_dir)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    sup = Supervisor(_children(settings, env, fellows))
    try:
        sup.start_all()
        base = f"http://{settings.leader_host}:{settings.leader_port}"
        _wait_http(base + "/healthz", sup, 60, lambda b: b.get("nats"))
        _wait_http(base + "/api/v1/fellows", sup, 60,
                   lambda b: sum(f["status"] == "online" for f in b["data"]) >= fellows)
        print(f"swarm is up: {base}  (nats {env['SWARM_NATS_URL']}, data {settings.data_dir})", flush=True)
        print(f"  chat: {base}/v1/chat/completions   fellows: {base}/api/v1/fellows   Ctrl-C stops",
              flush=True)
        while not stop.is_set() and sup.tick():
            stop.wait(0.2)
        return 0
    except GaveUp as exc:
        sup.say(str(exc))
        return 1
    finally:
        sup.stop_all()
        print("swarm stopped", flush=True)
