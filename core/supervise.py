"""`swarm up`'s supervision: a child that dies is started again after a backoff, and the reason is logged.

A child that fails MAX_FAILURES times within WINDOW_S seconds ends the stack, with one line saying so.
A child that exits 0 was asked to (a fellow told to stop): it is not restarted.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import deque
from typing import Callable

MAX_FAILURES = 5
WINDOW_S = 60.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0


class GaveUp(RuntimeError):
    """A child failed MAX_FAILURES times within WINDOW_S seconds."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Child:
    """One supervised process: `start()` returns its Popen, `stop(proc)` ends it."""

    def __init__(self, name: str, start: Callable[[], subprocess.Popen],
                 stop: Callable[[subprocess.Popen], object], essential: bool = True):
        self.name = name
        self._start = start
        self._stop = stop
        self.essential = essential  # a clean exit of an essential child ends the stack
        self.proc: subprocess.Popen | None = None
        self.failures: deque[float] = deque()
        self.restart_at: float | None = None
        self.done = False  # exited 0: not restarted
        self.starts = 0

    def start(self) -> None:
        self.proc = self._start()
        self.starts += 1
        self.restart_at = None

    def stop(self) -> None:
        if self.proc is not None:
            self._stop(self.proc)


class Supervisor:
    def __init__(self, children: list[Child], clock: Callable[[], float] = time.monotonic, out=None):
        self.children = children
        self.clock = clock
        self.out = out or sys.stderr

    def say(self, line: str) -> None:
        print(f"swarm: {line}", file=self.out, flush=True)

    def start_all(self) -> None:
        for child in self.children:
            child.start()

    def tick(self) -> bool:
        """Restart what is due and note what died; False once an essential child ended cleanly.

        Raises GaveUp when a child failed too often.
        """
        now = self.clock()
        for child in self.children:
            if child.done:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._restart(child)
                continue
            code = child.proc.poll() if child.proc is not None else None
            if code is None:
                continue
            if code == 0:
                child.done = True
                self.say(f"{child.name} exited cleanly; not restarted")
                if child.essential:
                    return False
                continue
            self._failed(child, code, now)
        return True

    def _failed(self, child: Child, code: int, now: float) -> None:
        child.failures.append(now)
        while child.failures and now - child.failures[0] > WINDOW_S:
            child.failures.popleft()
        if len(child.failures) >= MAX_FAILURES:
            raise GaveUp(f"{child.name} failed {len(child.failures)} times in {WINDOW_S:.0f} s "
                         f"(last: {describe_exit(code)}); giving up")
        delay = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (len(child.failures) - 1))
        child.restart_at = now + delay
        self.say(f"{child.name} died ({describe_exit(code)}); restarting it in {delay:g} s")

    def _restart(self, child: Child) -> None:
        try:
            child.start()
        except Exception as exc:  # e.g. nats-server that did not come up: a failure like any other
            self.say(f"{child.name} did not start: {exc}")
            child.proc = None
            self._failed(child, 1, self.clock())
            return
        self.say(f"{child.name} restarted (pid {child.proc.pid})")

    def stop_all(self) -> None:
        """Newest role first: fellows, then the leader, then nats-server."""
        for child in reversed(self.children):
            child.stop()
