"""`swarm up`: the embedded stack — nats-server, leader and local fellows — started and stopped together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from core.nats_auth import LEADER_USER, AuthDir, fellow_user
from core.nats_server import EmbeddedNats, NatsServerError
from core.procs import spawn_child, stop_child
from core.settings import Settings
from core.supervise import Child, GaveUp, Supervisor

DEMO_MODEL_ID = "swarm-demo"


class StartFailed(RuntimeError):
    """The stack did not come up: one line for the user, no traceback."""


def _wait_http(url: str, sup: Supervisor, timeout: float, check) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if not sup.tick():
            raise StartFailed("a stack process exited during the start")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200 and check(r.json()):
                return r.json()
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise StartFailed(f"{url} not ready within {timeout:.0f} s (last: {last}); stopping")


def ensure_demo_model(settings: Settings) -> None:
    """Build the demo servable once (in a subprocess: torch stays out of this process)."""
    target = settings.leader.servable_models_root / DEMO_MODEL_ID
    if (target / "servable.json").exists():
        return
    print(f"building the demo model into {target} (once; about two minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "core.cli", "demo-model", str(target)], check=True)


def _children(settings: Settings, env: dict, fellows: int) -> list[Child]:
    """nats-server (unless SWARM_NATS_URL names one), the leader, the fellows: each restarted when it dies.

    The embedded nats-server runs with a user per role (core/nats_auth.py, passwords kept under
    SWARM_DATA_DIR/nats-auth): the leader and each fellow get their own credentials in their environment.
    The leader manages that server's grants (SWARM_NATS_AUTH_DIR): a fellow pulls only the request queues
    of the loads placed on it. With SWARM_NATS_URL, every child uses the SWARM_NATS_USER/PASSWORD it
    inherits, if any, and a fellow may pull any load's requests (the leader cannot change that server's users)."""
    out = []
    creds: dict[str, dict] = {}  # child name -> its NATS credentials' variables
    if not settings.nats.url:
        auth = AuthDir(settings.data_dir / "nats-auth")
        auth.ensure([f"local-{i}" for i in range(fellows)], per_load=True)
        creds["leader"] = {**auth.credentials(LEADER_USER).env(), "SWARM_NATS_AUTH_DIR": str(auth.path)}
        creds.update({f"local-{i}": auth.credentials(fellow_user(f"local-{i}")).env() for i in range(fellows)})
        nats = EmbeddedNats(settings.nats_store_dir, config=auth.config, pid_file=auth.pid_file)

        def start_nats() -> subprocess.Popen:  # the same store, and after the first start the same port
            nats.start()
            env["SWARM_NATS_URL"] = nats.url
            return nats.process

        out.append(Child("nats-server", start_nats, lambda proc: stop_child(proc)))

    def part(who: str, *args: str, **extra: str):  # env read at each start: SWARM_NATS_URL is set by nats-server's
        return lambda: spawn_child([sys.executable, "-m", "core.cli", *args],
                                   env={**extra, **env, **creds.get(who, {})})

    # The leader's Python heap stays flat under load, but each thread (aiosqlite runs one per connection)
    # may get a glibc malloc arena of its own, and RSS crept up by them (docs/reliability.md §15).
    out.append(Child("the leader", part("leader", "leader", MALLOC_ARENA_MAX="2"), stop_child))
    out += [Child(f"fellow local-{i}", part(f"local-{i}", "fellow", "--id", f"local-{i}"), stop_child,
                  essential=False) for i in range(fellows)]
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
        base = f"http://{settings.leader.host}:{settings.leader.port}"
        _wait_http(base + "/healthz", sup, 60, lambda b: b.get("nats"))
        _wait_http(base + "/api/v1/fellows", sup, 60,
                   lambda b: sum(f["status"] == "online" for f in b["data"]) >= fellows)
        print(f"swarm is up: {base}  (nats {env['SWARM_NATS_URL']}, data {settings.data_dir})", flush=True)
        print(f"  chat: {base}/v1/chat/completions   fellows: {base}/api/v1/fellows   Ctrl-C stops",
              flush=True)
        if not settings.nats.url:
            print(f"  NATS users (leader, ops, each fellow): {settings.data_dir / 'nats-auth'}", flush=True)
        while not stop.is_set() and sup.tick():
            stop.wait(0.2)
        return 0 if stop.is_set() else 1  # an essential part that ended unasked ends the stack as a failure
    except (GaveUp, NatsServerError, StartFailed) as exc:  # NatsServerError: another stack runs on this data dir
        sup.say(str(exc))
        return 1
    finally:
        sup.stop_all()
        print("swarm stopped", flush=True)
