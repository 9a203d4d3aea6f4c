"""Child processes that never outlive their parent: the parent-death signal, and clean stops."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux; else no-op).

    Called in a child before exec (`preexec_fn`), so even a SIGKILL of the parent takes the child.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def spawn_child(args: list[str], env: dict | None = None, sig: int = signal.SIGTERM,
                **kwargs) -> subprocess.Popen:
    """Start a child that gets `sig` when we die; the pdeathsig is set between fork and exec."""
    parent = os.getpid()

    def _pre() -> None:
        die_with_parent(sig)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return subprocess.Popen(args, env=env, preexec_fn=_pre, **kwargs)


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
