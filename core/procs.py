"""Child processes that never outlive their parent: the parent-death signal, and clean stops."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "SWARM_PARENT_PID"  # set by spawn_child for the child's follow_parent
STOP_GRACE_S = 15.0  # after the parent died, this long for a clean stop (a stage has 10 s), then a hard exit


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux; else no-op)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def follow_parent(sig: int = signal.SIGTERM, grace: float | None = STOP_GRACE_S) -> None:
    """At a child's entry point: get `sig` when the parent that spawn_child gave us dies.

    The parent may already be gone when the child gets here; then `sig` comes at once. The variable is
    taken out of the environment, so this process's own children do not inherit it. `grace` seconds after
    the parent's death the process exits whatever it is doing (None: no such bound, for a process about to
    exec, where the thread would not survive).
    """
    raw = os.environ.pop(PARENT_PID_ENV, "")
    if not raw.isdigit():
        return
    die_with_parent(sig)
    if grace is not None:
        _exit_after_parent(int(raw), grace)
    if os.getppid() != int(raw):
        os.kill(os.getpid(), sig)


def _exit_after_parent(parent: int, grace: float) -> None:
    """A daemon thread that ends this process `grace` seconds after its parent dies: the parent-death
    signal asks for a clean stop, and nobody is left to kill a child whose stop hangs."""
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:  # gone already: follow_parent signals at once
        fd = None
    except (AttributeError, OSError):  # no pidfd here (not Linux 5.3+): no bound
        return

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        time.sleep(grace)
        print(f"pid {os.getpid()}: still stopping {grace:.0f}s after its parent {parent} died; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="exit after parent", daemon=True).start()


def parent_env(env: dict | None = None) -> dict:
    """`env` (default: ours) naming this process as the parent that the child's follow_parent watches."""
    return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def spawn_child(args: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
    """Start a child in its own process group that dies with us: it calls follow_parent at its start.

    No code runs between fork and exec (no `preexec_fn`, which is unsafe in a threaded parent).
    """
    return subprocess.Popen(args, env=parent_env(env), process_group=0, **kwargs)


def spawn_binary(args: list[str], **kwargs) -> subprocess.Popen:
    """spawn_child for a program that cannot call follow_parent itself (nats-server): this module sets
    the parent-death signal, then execs it (the signal outlives the exec)."""
    return spawn_child([sys.executable, "-m", "core.procs", *args], **kwargs)


def stop_child(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL after `timeout` seconds; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


async def run_hooks(hooks, log) -> None:
    """Run async stop hooks, newest first; one that fails is logged and the rest still run."""
    for hook in reversed(hooks):
        try:
            await hook()
        except Exception:
            log.exception("stop hook %s failed", getattr(hook, "__qualname__", hook))


if __name__ == "__main__":  # spawn_binary's shim: python -m core.procs PROGRAM ARGS...
    follow_parent(grace=None)
    os.execv(sys.argv[1], sys.argv[1:])
