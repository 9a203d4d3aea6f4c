"""`swarm up`'s supervisor with real child processes (its clock stepped so backoffs take no time), and a
real `swarm up` that gives up."""

from __future__ import annotations

import io
import socket
import subprocess
import sys

import pytest

from core.procs import stop_child
from core.supervise import MAX_FAILURES, Child, GaveUp, Supervisor
from tests.processes import SwarmProcess, swarm_env


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def run_until_settled(sup: Supervisor, clock: Clock, step: float, ticks: int) -> bool:
    """Tick `ticks` times, `step` seconds of the supervisor's clock apart, each after its children exited."""
    for _ in range(ticks):
        for child in sup.children:
            if child.proc is not None and child.restart_at is None and not child.done:
                child.proc.wait(30)
        if not sup.tick():
            return False
        clock.now += step
    return True


def test_a_child_failing_five_times_in_a_minute_ends_the_stack_in_one_line():
    clock, out = Clock(), io.StringIO()
    sup = Supervisor([Child("fellow x", lambda: python("raise SystemExit(3)"), stop_child)], clock, out)
    sup.start_all()
    with pytest.raises(GaveUp, match=r"^fellow x failed 5 times in 60 s \(last: exit code 3\); giving up$"):
        run_until_settled(sup, clock, 5.0, 50)
    assert sup.children[0].starts == MAX_FAILURES
    lines = out.getvalue().splitlines()
    assert lines[0] == "swarm: fellow x died (exit code 3); restarting it in 0.5 s"
    assert [ln.split(" in ")[-1] for ln in lines if "died" in ln] == ["0.5 s", "1 s", "2 s", "4 s"]


def test_failures_spread_wider_than_the_window_are_restarted_for_ever():
    clock, out = Clock(), io.StringIO()
    sup = Supervisor([Child("the leader", lambda: python("import os; os.kill(os.getpid(), 9)"), stop_child)],
                     clock, out)
    sup.start_all()
    assert run_until_settled(sup, clock, 16.0, 40)  # one failure per 32 s: never 5 within 60 s
    assert sup.children[0].starts > MAX_FAILURES
    assert "the leader died (killed by SIGKILL); restarting it in" in out.getvalue()


def test_a_clean_exit_is_not_restarted_and_ends_the_stack_only_for_an_essential_child():
    clock, out = Clock(), io.StringIO()
    fellow = Child("fellow y", lambda: python("pass"), stop_child, essential=False)
    leader = Child("the leader", lambda: python("import time; time.sleep(60)"), stop_child)
    sup = Supervisor([leader, fellow], clock, out)
    sup.start_all()
    fellow.proc.wait(30)
    assert sup.tick() and fellow.done and fellow.starts == 1
    assert leader.proc.poll() is None
    leader.proc.terminate()  # exits by signal: a failure, restarted
    leader.proc.wait(30)
    assert sup.tick() and leader.restart_at == 0.5
    clock.now = 1.0
    assert sup.tick() and leader.starts == 2
    sup.stop_all()
    assert leader.proc.returncode is not None
    assert "fellow y exited cleanly; not restarted" in out.getvalue()


@pytest.mark.slow
def test_swarm_up_gives_up_in_one_line_on_a_leader_that_cannot_start(tmp_path):
    with socket.socket() as taken:  # the leader's port is held: each start fails at once
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = swarm_env(tmp_path, None, port=port)
        up = SwarmProcess(["up", "--no-demo"], env, tmp_path / "up.log").start()
        try:
            assert up.proc.wait(120) == 1, up.tail()
        finally:
            up.kill()
    lines = [ln for ln in up.tail(10**6).splitlines() if ln.startswith("swarm: ")]
    assert sum("the leader died (exit code" in ln for ln in lines) == MAX_FAILURES - 1, lines
    assert any(ln.startswith("swarm: the leader failed 5 times in 60 s (last: exit code") and
               ln.endswith("giving up") for ln in lines), lines
    assert "swarm stopped" in up.tail()
    # each leader said why in one line, before starting its parts
    assert f"swarm: error: the leader cannot listen on 127.0.0.1:{port}" in up.tail(10**6)
