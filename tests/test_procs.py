"""Children die with their parent without `preexec_fn`: each sets its own parent-death signal at its start."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.procs import PARENT_PID_ENV
from tests.processes import SwarmProcess, children_of, pid_alive, swarm_env, wait_until

ROOT = Path(__file__).resolve().parents[1]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_swarm_up_killed_takes_leader_fellow_and_nats_server_with_it(tmp_path):
    env = swarm_env(tmp_path, None)
    up = SwarmProcess(["up", "--no-demo"], env, tmp_path / "up.log").start()
    children = []
    try:
        wait_until(lambda: [f for f in up.get("/api/v1/fellows").json()["data"] if f["status"] == "online"],
                   60, "a local fellow")
        children = children_of(up.proc.pid)
        parts = [c for c in children if "core.cli" in cmdline(c)]
        assert len(parts) == 2, [cmdline(c) for c in children]  # leader and fellow
        assert all(os.getpgid(c) == c for c in parts)  # each in its own process group
        parts += [c for c in children if "nats-server" in cmdline(c)]
        assert len(parts) == 3, [cmdline(c) for c in children]
        # a second `swarm up` on the same data dir: one line, no second nats-server on the store
        second = subprocess.run([sys.executable, "-m", "core.cli", "up", "--no-demo"], capture_output=True,
                                text=True, timeout=120, env=env)
        assert second.returncode == 1 and "another nats-server runs on the store" in second.stdout + second.stderr, \
            (second.stdout, second.stderr[-2000:])
        os.kill(up.proc.pid, signal.SIGKILL)  # the parent alone: no group kill, no clean stop
        up.proc.wait(10)
        try:
            wait_until(lambda: not any(pid_alive(c) for c in parts), 30,
                       "leader, fellow and nats-server gone with swarm up")
        except AssertionError as exc:  # name the ones left, and what the fellow and leader logged last
            left = [cmdline(c) for c in parts if pid_alive(c)]
            logs = {p.name: p.read_text()[-1500:] for p in tmp_path.rglob("*.log")}
            raise AssertionError(f"{exc}; still running: {left}; logs: {logs}") from None
    finally:
        up.kill()
        for c in children:  # whatever a failure left
            if pid_alive(c):
                os.kill(c, signal.SIGTERM)


def child_env(parent: int) -> dict:
    return dict(os.environ, **{PARENT_PID_ENV: str(parent)})


def test_a_child_whose_parent_is_already_gone_stops_at_once():
    out = subprocess.run([sys.executable, "-m", "core.cli", "--help"], env=child_env(1), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == -signal.SIGTERM and out.stdout == ""
    out = subprocess.run([sys.executable, "-m", "core.cli", "--help"], env=child_env(os.getpid()),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: swarm" in out.stdout


def test_a_grandchild_dies_with_a_parent_killed_mid_flight(tmp_path):
    """A parent spawns a child through spawn_child, then is SIGKILLed; the child goes too."""
    child = ("from core.procs import follow_parent; follow_parent(); import os, time; "
             "print(os.environ.get('SWARM_PARENT_PID', 'unset'), flush=True); time.sleep(120)")
    parent = ("import sys, time; from core.procs import spawn_child; "
              f"p = spawn_child([sys.executable, '-c', {child!r}]); print(p.pid, flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        pid = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "unset"  # taken out of the child's environment
        assert os.getpgid(pid) == pid
        proc.kill()
        proc.wait(10)
        wait_until(lambda: not pid_alive(pid), 20, "the child gone with its parent")
    finally:
        proc.kill()


def test_a_child_whose_stop_hangs_exits_its_grace_after_the_parent_died():
    """The parent-death signal asks for a clean stop; a child stuck in it (here: ignoring SIGTERM) still
    ends `grace` seconds later, as nobody is left to kill it."""
    child = ("from core.procs import follow_parent; follow_parent(grace=1.0); import os, signal, time; "
             "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); time.sleep(120)")
    parent = ("import sys, time; from core.procs import spawn_child; "
              f"spawn_child([sys.executable, '-c', {child!r}]); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        pid = int(proc.stdout.readline())
        assert pid_alive(pid)
        proc.kill()
        proc.wait(10)
        wait_until(lambda: not pid_alive(pid), 20, "the stuck child gone after its grace")
        assert "after its parent" in proc.stderr.read()  # it said why it went
    finally:
        proc.kill()


def preexec_users() -> dict[str, int]:
    found = {}
    for layer in ("events", "core", "leader", "fellow"):
        for path in (ROOT / layer).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.keyword) and node.arg == "preexec_fn":
                    found[str(path.relative_to(ROOT))] = node.value.lineno
    return found


def test_no_preexec_fn():
    users = preexec_users()
    assert not users, f"preexec_fn is unsafe in a threaded parent: {users}"


def test_a_nats_server_dies_with_its_parent_and_one_store_takes_one_server(tmp_path):
    """Issue 38: `kill -9` of `swarm up` left its nats-server running, and the next `swarm up` on the same
    data dir started a second nats-server on the same JetStream store."""
    from core.nats_server import EmbeddedNats, NatsServerError

    store = tmp_path / "js"
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom core.nats_server import EmbeddedNats\n"
                               f"n = EmbeddedNats(Path({str(store)!r})).start()\nprint(n.process.pid, flush=True)\n"
                               "time.sleep(600)"],
        stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        server_pid = int(parent.stdout.readline())
        assert "nats-server" in cmdline(server_pid)
        with pytest.raises(NatsServerError, match="another nats-server runs on the store"):
            EmbeddedNats(store).start(timeout=5)
        os.kill(parent.pid, signal.SIGKILL)  # the parent alone, no clean stop
        parent.wait(10)
        wait_until(lambda: not pid_alive(server_pid), 30, "nats-server gone with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
    again = EmbeddedNats(store).start()  # the store is free again
    again.stop()
