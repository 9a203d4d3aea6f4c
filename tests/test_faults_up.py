"""Faults under `swarm up` (issue 18): its children are supervised, so one killed process never stops
the service. One real `swarm up` (nats-server, leader and fellow processes, a tiny servable with
autoload) takes each fault in turn; each test leaves it serving for the next.

What the client sees, and within what time:
- the leader SIGKILLed: its open stream breaks at once; the leader answers again within 60 s, and the
  client that reconnects with its Last-Event-ID gets the rest of its reply, nothing lost or twice;
- nats-server SIGKILLed: restarted on its store and port; the leader and fellow reconnect and the same
  load serves again within 60 s;
- the fellow SIGSTOPped past its heartbeat timeout: the stream ends with `load_failed` within 30 s;
  after SIGCONT the fellow rejoins, its orphaned stage is stopped, and a new load serves;
- the fellow SIGKILLed: the leader answers throughout; the stream ends with `load_failed` within 30 s;
  the fellow is back within 60 s and serves the same reply.
After each, SQL holds a final state for every request.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from tests.processes import SwarmProcess, children_of, pid_alive, swarm_env, wait_until
from tests.request_helpers import (
    FINAL,
    chat,
    content,
    read_events,
    servables,  # noqa: F401 (a fixture)
    start_stream,
)

pytestmark = pytest.mark.slow
BODY = chat("hello", max_tokens=4, temperature=0)


def child_pid(up: SwarmProcess, role: str) -> int | None:
    """The pid of `swarm up`'s child running `swarm <role>`, or nats-server."""
    for pid in children_of(up.proc.pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"core.cli" in args and role.encode() in args) or (role == "nats-server" and
                                                                 args[0].endswith(b"nats-server")):
            return pid
    return None


def fellow_row(up: SwarmProcess) -> dict | None:
    return next((f for f in up.get("/api/v1/fellows").json()["data"] if f["id"] == "local-0"), None)


def all_final(db: Path) -> list[tuple] | None:
    with sqlite3.connect(db) as conn:
        got = conn.execute("SELECT request_id, status, error_code FROM requests").fetchall()
    return got if got and all(status in FINAL for _, status, _ in got) else None


def healthy(up: SwarmProcess) -> bool:
    r = up.get("/healthz")
    return r.status_code == 200 and r.json()["nats"]


def settled(up: SwarmProcess) -> None:
    """The leader answers and the fellow is online: each test starts from a whole stack, whatever the one
    before it left (a failure midway through a restart, say)."""
    wait_until(lambda: healthy(up) and (f := fellow_row(up)) and f["status"] == "online", 90, "the stack whole")


@pytest.fixture(scope="module")
def up(tmp_path_factory, servables):  # noqa: F811
    tmp = tmp_path_factory.mktemp("up")
    env = swarm_env(tmp, None, f"sqlite+aiosqlite:///{tmp / 'swarm.db'}", SWARM_SERVABLE_MODELS_ROOT=servables,
                    SWARM_AUTOLOAD=1, SWARM_MODEL_IDLE_UNLOAD_S=0)
    proc = SwarmProcess(["up", "--no-demo"], env, tmp / "up.log").start()
    proc.db = tmp / "swarm.db"
    try:
        wait_until(lambda: (f := fellow_row(proc)) and f["status"] == "online", 90, "the local fellow")
        proc.first = httpx.post(proc.base_url + "/v1/chat/completions", json=BODY, timeout=120)
        assert proc.first.status_code == 200, proc.first.text
        yield proc
    finally:
        proc.stop()


async def test_its_nats_server_refuses_anonymous_clients_and_each_part_has_its_user(up):
    """The stack above served its first reply with NATS auth on: the leader and the fellow log in with
    their own users (SWARM_DATA_DIR/nats-auth), and a client without one is refused."""
    from core.bus import BusUnavailable, connect
    from core.nats_auth import AuthDir, fellow_user

    url = re.search(r"\(nats (nats://[^,]+),", (up.log_path.read_text())).group(1)
    with pytest.raises(BusUnavailable, match="Authorization Violation"):
        await connect(url, name="anonymous", timeout=3, allow_reconnect=False)
    env = {pid: Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in children_of(up.proc.pid)}
    arenas = {v.split(b"=", 1)[1].decode(): e for e in env.values() for v in e if v.startswith(b"SWARM_NATS_USER=")}
    users = set(arenas)  # the NATS user of each part
    assert users == {"leader", fellow_user("local-0")}
    assert b"MALLOC_ARENA_MAX=2" in arenas["leader"]  # its RSS kept flat (docs/reliability.md)
    assert b"MALLOC_ARENA_MAX=2" not in arenas[fellow_user("local-0")]  # torch's threads keep glibc's default
    auth = AuthDir(Path(up.env["SWARM_DATA_DIR"]) / "nats-auth")
    assert set(auth.passwords()) >= users
    # the leader manages this server: the fellow may pull the request queue of its load, and no other
    assert b"SWARM_NATS_AUTH_DIR=" + str(auth.path).encode() in arenas["leader"]
    with sqlite3.connect(up.db) as conn:
        placed = [load_id for load_id, in conn.execute(
            "SELECT load_id FROM load_stages WHERE stage = 0 AND state IN ('loading', 'ready')")]
    assert auth.grants() == {"local-0": placed} and len(placed) == 1


async def test_a_killed_leader_is_restarted_and_its_streaming_client_resumes(up):
    await asyncio.to_thread(settled, up)
    # long enough that the reply cannot all be sent before the client reads its first token (300 tokens could)
    leader, body = child_pid(up, "leader"), chat("story", max_tokens=2000, temperature=0, stream=True)
    got: list = []
    async with httpx.AsyncClient(base_url=up.base_url, timeout=120) as http:
        async def read() -> None:  # the leader killed as the first token comes: the reply surely under way
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                await read_events(r, out=got, on_first_text=lambda: os.kill(leader, signal.SIGKILL))

        with pytest.raises(httpx.HTTPError):  # the connection breaks at once
            await asyncio.wait_for(read(), 60)
        assert content(got) and got[-1][1] != "[DONE]"
        await asyncio.to_thread(wait_until, lambda: healthy(up), 60, "the leader back")
        assert child_pid(up, "leader") not in (None, leader)
        async with http.stream("POST", "/v1/chat/completions", json=body, headers={"Last-Event-ID": got[-1][0]}) as r:
            assert r.status_code == 200
            rest = await read_events(r)  # from the restarted leader, read back from SWARM_TOKENS
        whole = httpx.post(up.base_url + "/v1/chat/completions", json=dict(body, stream=False), timeout=120)
    assert whole.status_code == 200, (whole.text, up.tail())
    assert content(got) + content(rest) == whole.json()["choices"][0]["message"]["content"]  # nothing lost or twice
    assert rest[-1][1] == "[DONE]" and rest[-2][1]["choices"][0]["finish_reason"] == "length"
    assert await asyncio.to_thread(wait_until, lambda: all_final(up.db), 90, "every row final")


def test_a_killed_nats_server_is_restarted_on_its_store_and_port(up):
    settled(up)
    nats, served_before = child_pid(up, "nats-server"), up.get("/api/v1/models/tiny-a").json()["load_id"]
    assert served_before is not None
    os.kill(nats, signal.SIGKILL)
    wait_until(lambda: child_pid(up, "nats-server") not in (None, nats), 30, "nats-server restarted")
    wait_until(lambda: healthy(up) and fellow_row(up)["status"] == "online", 60, "leader and fellow reconnected")
    again = httpx.post(up.base_url + "/v1/chat/completions", json=BODY, timeout=120)
    assert again.status_code == 200, (again.text, up.tail())
    assert again.json()["choices"][0]["message"]["content"] == up.first.json()["choices"][0]["message"]["content"]
    assert up.get("/api/v1/models/tiny-a").json()["load_id"] == served_before  # the same load: the store kept it
    assert "nats-server died (killed by SIGKILL); restarting it in" in up.tail(10**6)


def ended_whole_or_failed(events: list[dict]) -> bool:
    """A stream whose fellow stopped ends one of two ways: failed with its load (``load_failed``), or whole,
    its 4,000 tokens made by a stage that ran on (a paused fellow's) or by the load that healed the failed one
    once the fellow was back (leader.moves). Never another error, never a hang."""
    last = events[-1]
    if "error" in last:
        return last["error"]["code"] == "load_failed"
    return last["choices"][0]["finish_reason"] == "length"


async def test_a_paused_fellow_rejoins_without_serving_as_a_zombie(up):
    await asyncio.to_thread(settled, up)
    fellow = child_pid(up, "fellow")
    async with httpx.AsyncClient(base_url=up.base_url, timeout=120) as http:
        stream = await start_stream(http, chat("story", max_tokens=4000, stream=True))
        stage = fellow_row(up)["loaded_models"][0]["pid"]
        os.kill(fellow, signal.SIGSTOP)
        try:
            events = await asyncio.wait_for(stream, 30)
            assert ended_whole_or_failed(events), events[-1]
            await asyncio.to_thread(wait_until, lambda: fellow_row(up)["status"] == "lost", 30, "fellow lost")
        finally:
            os.kill(fellow, signal.SIGCONT)
    await asyncio.to_thread(wait_until, lambda: fellow_row(up)["status"] == "online", 30, "fellow rejoined")
    await asyncio.to_thread(wait_until, lambda: not pid_alive(stage), 30, "its orphaned stage stopped")
    assert child_pid(up, "fellow") == fellow  # paused, never dead: not restarted
    again = httpx.post(up.base_url + "/v1/chat/completions", json=BODY, timeout=120)  # a new load
    assert again.status_code == 200, (again.text, up.tail())
    assert again.json()["choices"][0]["message"]["content"] == up.first.json()["choices"][0]["message"]["content"]
    assert [m["pid"] for m in fellow_row(up)["loaded_models"]] != [stage]
    assert await asyncio.to_thread(wait_until, lambda: all_final(up.db), 30, "every row final")


async def test_a_killed_fellow_is_restarted_while_the_leader_answers(up):
    await asyncio.to_thread(settled, up)
    fellow, joined = child_pid(up, "fellow"), fellow_row(up)["joined_at"]
    async with httpx.AsyncClient(base_url=up.base_url, timeout=120) as http:
        stream = await start_stream(http, chat("story", max_tokens=4000, stream=True))
        os.kill(fellow, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # the leader answers at every poll while the fellow is down and back
            assert healthy(up)
            row = fellow_row(up)
            model = up.get("/api/v1/models/tiny-a").json()
            if row["status"] == "online" and row["joined_at"] != joined and model["load_state"] != "ready":
                break
            assert time.monotonic() < deadline, (row, model, up.tail())
            await asyncio.sleep(0.1)
        events = await asyncio.wait_for(stream, 30)
        assert ended_whole_or_failed(events), events[-1]
    assert child_pid(up, "fellow") not in (None, fellow)
    assert "fellow local-0 died (killed by SIGKILL); restarting it in" in up.tail(10**6)

    again = httpx.post(up.base_url + "/v1/chat/completions", json=BODY, timeout=120)  # autoloads anew
    assert again.status_code == 200, (again.text, up.tail())
    assert again.json()["choices"][0]["message"]["content"] == up.first.json()["choices"][0]["message"]["content"]
    assert await asyncio.to_thread(wait_until, lambda: all_final(up.db), 30, "every row final")
