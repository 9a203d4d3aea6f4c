"""Faults under `swarm up` (issue 18): its children are supervised, so one killed process never stops
the service. Real `swarm up`, nats-server, leader and fellow processes, a tiny servable with autoload.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.processes import SwarmProcess, children_of, swarm_env, wait_until
from tests.request_helpers import chat
from tests.request_helpers import servables  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow


def child_pid(up: SwarmProcess, role: str) -> int | None:
    """The pid of `swarm up`'s child running `swarm <role>`."""
    for pid in children_of(up.proc.pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"core.cli" in args and role.encode() in args:
            return pid
    return None


def fellow_row(up: SwarmProcess) -> dict | None:
    return next((f for f in up.get("/api/v1/fellows").json()["data"] if f["id"] == "local-0"), None)


@pytest.fixture
def up(tmp_path, servables):  # noqa: F811
    env = swarm_env(tmp_path, None, SWARM_SERVABLE_MODELS_ROOT=servables, SWARM_AUTOLOAD=1,
                    SWARM_MODEL_IDLE_UNLOAD_S=0)
    proc = SwarmProcess(["up", "--no-demo"], env, tmp_path / "up.log").start()
    try:
        wait_until(lambda: (f := fellow_row(proc)) and f["status"] == "online", 90, "the local fellow")
        yield proc
    finally:
        proc.stop()


def test_a_killed_fellow_is_restarted_while_the_leader_answers(up):
    body = chat("hello", max_tokens=4, temperature=0)
    first = httpx.post(up.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text
    fellow, started = child_pid(up, "fellow"), fellow_row(up)["joined_at"]
    os.kill(fellow, signal.SIGKILL)

    deadline = time.monotonic() + 60
    while True:  # the leader answers at every poll while the fellow is down and back
        health = up.get("/healthz")
        assert health.status_code == 200 and health.json()["nats"], health.text
        row = fellow_row(up)
        model = up.get("/api/v1/models/tiny-a").json()
        if row["status"] == "online" and row["joined_at"] != started and model["load_state"] != "ready":
            break
        assert time.monotonic() < deadline, (row, model, up.tail())
        time.sleep(0.1)
    assert child_pid(up, "fellow") not in (None, fellow)
    assert "fellow local-0 died (killed by SIGKILL); restarting it in" in up.tail()

    again = httpx.post(up.base_url + "/v1/chat/completions", json=body, timeout=120)  # autoloads anew
    assert again.status_code == 200, (again.text, up.tail())
    assert again.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
