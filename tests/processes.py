"""Real leader / fellow / stack processes for tests, with readiness waits on HTTP state."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# not the module's generator: any code that seeds it (transformers' set_seed, say) would have the test
# workers draw the same ports
_draw = random.SystemRandom()


def free_port() -> int:
    """A loopback port free now, for a process to bind later: drawn below the kernel's ephemeral range, so
    that no outgoing connection or port-0 listener (other tests', in parallel) is handed it meanwhile."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(100 if low > 11000 else 0):
        port = _draw.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no range to keep out of: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def swarm_env(tmp_path: Path, nats_url: str | None, database_url: str | None = None, port: int | None = None,
              **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    # a stage compiles its decode step in the background by default (tens of seconds of CPU on each load):
    # tests' stages do not, but the tests of that compile, which ask for it
    env.update(SWARM_DATA_DIR=str(tmp_path / "data"), SWARM_HEARTBEAT_S="0.5",
               SWARM_LEADER_PORT=str(port or free_port()), SWARM_SERVE_COMPILE="off")
    if nats_url:
        env["SWARM_NATS_URL"] = nats_url
    if database_url:
        env["SWARM_DATABASE_URL"] = database_url
    env.update({k: str(v) for k, v in extra.items()})
    return env


def wait_until(check, timeout: float = 30.0, what: str = "condition", interval: float = 0.05):
    """Poll `check` (an observation of real state) until it returns a truthy value."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # not up yet
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last error: {last_exc})")


async def eventually(check, timeout: float, what: str):
    """Poll the async `check` (an observation of real state) until it returns a truthy value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class SwarmProcess:
    """`python -m core.cli <args>` in its own process group."""

    def __init__(self, args: list[str], env: dict, log_path: Path):
        self.args = args
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.env['SWARM_LEADER_PORT']}"

    def start(self) -> "SwarmProcess":
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "core.cli", *self.args], env=self.env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=5.0, **kw)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        def ok():
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}: {self.tail()}")
            return self.get("/healthz").json().get("nats")

        try:
            wait_until(ok, timeout, "leader health")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.tail()}") from None

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def stop(self) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode if self.proc else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found
