"""The stack through real processes: leader crashes, nats-server restarts, fellows join and get lost."""

from __future__ import annotations

import asyncio
import signal
import time

from core.bus import connect, ensure_streams, publish_event
from core.nats_server import EmbeddedNats
from events.requests import RequestAccepted, RequestFinished
from leader.db.engine import make_engine, session_factory
from leader.db.tables import Request
from leader.projectors.all import all_projectors
from leader.projectors.replay import replay
from tests.dbutil import dump
from tests.processes import SwarmProcess, children_of, pid_alive, swarm_env, wait_until


def caught_up(leader: SwarmProcess, seq: int) -> bool:
    positions = leader.get("/healthz").json()["projections"]
    return bool(positions) and all(v >= seq for v in positions.values())


async def publish_requests(js, start: int, count: int):
    ack = None
    for i in range(start, start + count):
        ack = await publish_event(js, RequestAccepted(id=f"acc-{i}", request_id=f"r{i}", model_id="m", load_id="L"))
        ack = await publish_event(js, RequestFinished(id=f"fin-{i}", request_id=f"r{i}", model_id="m",
                                                      load_id="L", completion_tokens=i))
    return ack


async def assert_rows_exact(db_url: str, js, n: int) -> None:
    engine = make_engine(db_url)
    sessions = session_factory(engine)
    try:
        rows = (await dump(sessions, Request))["requests"]
        assert len(rows) == n, f"{len(rows)} request rows for {n} requests"
        assert sorted(r[0] for r in rows) == sorted(f"r{i}" for i in range(n))
        assert all(r[3] == "finished" for r in rows)
        live = await dump(sessions, Request)
        for p in all_projectors():
            await replay(js, sessions, p)
        assert await dump(sessions, Request) == live
    finally:
        await engine.dispose()


async def test_leader_sigkill_mid_stream_resumes_from_checkpoint(tmp_path, nats_server, js, sqlite_url):
    env = swarm_env(tmp_path, nats_server.url, sqlite_url)
    leader = SwarmProcess(["leader"], env, tmp_path / "leader.log").start()
    try:
        await asyncio.to_thread(leader.wait_healthy)
        flow = asyncio.create_task(publish_requests(js, 0, 150))
        await asyncio.to_thread(wait_until, lambda: leader.get("/healthz").json()["projections"]["requests"] > 40,
                                30, "some events projected")
        leader.kill(signal.SIGKILL)  # mid-stream: events keep flowing while it is down
        await flow
        await publish_requests(js, 150, 50)
        leader = SwarmProcess(["leader"], env, tmp_path / "leader2.log").start()
        await asyncio.to_thread(leader.wait_healthy)
        last = (await js.stream_info("SWARM_EVENTS")).state.last_seq
        await asyncio.to_thread(wait_until, lambda: caught_up(leader, last), 60, "projections caught up")
        await assert_rows_exact(sqlite_url, js, 200)
    finally:
        leader.stop()


async def test_nats_server_restart_with_file_store(tmp_path, sqlite_url):
    store = tmp_path / "js"
    srv = EmbeddedNats(store).start()
    port = srv.port
    env = swarm_env(tmp_path, srv.url, sqlite_url)
    leader = SwarmProcess(["leader"], env, tmp_path / "leader.log").start()
    nc = await connect(srv.url, "test")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        await asyncio.to_thread(leader.wait_healthy)
        await publish_requests(js, 0, 60)
        srv.kill()  # SIGKILL: only what the file store persisted survives
        srv = EmbeddedNats(store, port=port).start()
        await asyncio.to_thread(wait_until, lambda: nc.is_connected, 30, "client reconnect")
        await publish_requests(js, 60, 60)
        last = (await js.stream_info("SWARM_EVENTS")).state.last_seq
        assert last == 240
        await asyncio.to_thread(wait_until, lambda: caught_up(leader, last), 60, "projections caught up")
        await assert_rows_exact(sqlite_url, js, 120)
    finally:
        leader.stop()
        await nc.close()
        srv.stop()


def test_swarm_up_lists_the_local_fellow_and_stops_cleanly(tmp_path):
    env = swarm_env(tmp_path, None)  # embedded: `swarm up` starts its own nats-server
    up = SwarmProcess(["up", "--no-demo"], env, tmp_path / "up.log").start()
    try:
        fellows = wait_until(lambda: [f for f in up.get("/api/v1/fellows").json()["data"]
                                      if f["status"] == "online"], 60, "a local fellow")
        assert fellows[0]["id"] == "local-0"
        assert fellows[0]["gpus"] == [] or fellows[0]["gpus"][0]["total_bytes"] > 0
        assert fellows[0]["memory_total_bytes"] > 0
        children = children_of(up.proc.pid)
        assert len(children) == 3  # nats-server, leader, fellow
        assert up.stop() == 0
        assert not [c for c in children if pid_alive(c)]
        assert "swarm stopped" in up.tail()
    finally:
        up.kill()


def fellow_status(leader: SwarmProcess, fellow_id: str):
    for f in leader.get("/api/v1/fellows").json()["data"]:
        if f["id"] == fellow_id:
            return f
    return None


def test_fellow_joins_then_is_lost_after_three_missed_heartbeats(tmp_path, nats_server, sqlite_url):
    env = swarm_env(tmp_path, nats_server.url, sqlite_url)
    leader = SwarmProcess(["leader"], env, tmp_path / "leader.log").start()
    fellow = SwarmProcess(["fellow", "--id", "gpu-a"], env, tmp_path / "fellow.log").start()
    try:
        leader.wait_healthy()
        joined = wait_until(lambda: (f := fellow_status(leader, "gpu-a")) and f["status"] == "online" and f,
                            30, "fellow joined")
        assert joined["memory_free_bytes"] > 0 and joined["last_heartbeat_age_s"] < 5
        fellow.kill(signal.SIGKILL)
        killed_at = time.monotonic()
        lost = wait_until(lambda: (f := fellow_status(leader, "gpu-a")) and f["status"] == "lost" and f,
                          30, "fellow lost")
        # 3 heartbeats of 0.2 s plus the monitor's tick and the projection: well under the 30 s wait
        assert lost["lost_at"] is not None and time.monotonic() - killed_at < 10
        # It comes back under the same id: joined again.
        fellow = SwarmProcess(["fellow", "--id", "gpu-a"], env, tmp_path / "fellow2.log").start()
        wait_until(lambda: fellow_status(leader, "gpu-a")["status"] == "online", 30, "fellow rejoined")
        schema = leader.get("/schema/openapi.json").json()
        assert "/api/v1/fellows" in schema["paths"]
    finally:
        fellow.stop()
        leader.stop()
