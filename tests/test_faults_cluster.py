"""Scale-out on the engines themselves (issue 18): a 3-node NATS cluster with every stream R3
(SWARM_NATS_REPLICAS=3) and NATS auth, one PostgreSQL, two leaders and a fellow, as real processes.

A token minted on one leader is honoured by the other (and the API is closed on both). During
traffic one nats-server node and one leader are SIGKILLed. The other leader answers
throughout; every request it accepted is answered and ends `finished`; every request row (the dead
leader's too) reaches a final state; each event is projected once across the two leaders (the
checkpoints reach the log's end, the fellow's join counter equals its joins in the log).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from core.nats_auth import LEADER_USER, AuthDir, fellow_user
from core.nats_server import local_cluster
from tests.processes import SwarmProcess, eventually, swarm_env, wait_until
from tests.request_helpers import (
    FINAL,
    chat,
    servables,  # noqa: F401 (a fixture)
)

pytestmark = pytest.mark.slow
BODY = chat("hello", max_tokens=4, temperature=0)


@pytest.fixture
def cluster(tmp_path):
    auth = AuthDir(tmp_path / "auth")
    auth.ensure(["f0"])
    nodes = local_cluster(tmp_path / "nats", 3, config=auth.config)
    try:
        for node in nodes:
            node.start()
        yield nodes, auth
    finally:
        for node in nodes:
            node.stop()


async def rows(database_url: str, query: str) -> list[tuple]:
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as conn:
            return [tuple(r) for r in await conn.execute(text(query))]
    finally:
        await engine.dispose()


async def post(http: httpx.AsyncClient, url: str, headers: dict) -> int | str:
    try:
        r = await http.post(url + "/v1/chat/completions", json=BODY, timeout=120, headers=headers)
        return r.status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def test_two_leaders_on_one_database_survive_a_lost_nats_node_and_a_lost_leader(
        tmp_path, cluster, postgres, servables):  # noqa: F811
    nodes, auth = cluster
    db = postgres.create_db("two_leaders")
    urls = ",".join(n.url for n in nodes)
    # a node's loss moves stream leaders for a few seconds: a fellow is lost only after 15 s of silence
    base = dict(SWARM_SERVABLE_MODELS_ROOT=servables, SWARM_NATS_REPLICAS=3, SWARM_MODEL_IDLE_UNLOAD_S=0,
                SWARM_HEARTBEAT_S=1, SWARM_FELLOW_TIMEOUT_S=15, SWARM_AUTOLOAD=1)
    leaders = [SwarmProcess(["leader"], swarm_env(tmp_path / f"l{i}", urls, db, **base,
                                                  **auth.credentials(LEADER_USER).env()), tmp_path / f"leader{i}.log")
               for i in range(2)]
    fellow = SwarmProcess(["fellow", "--id", "f0"], swarm_env(tmp_path / "f0", urls, db, **base,
                                                              **auth.credentials(fellow_user("f0")).env()),
                          tmp_path / "fellow.log")
    procs = [*leaders, fellow]
    try:
        for p in procs:
            p.start()
        for leader in leaders:
            leader.wait_healthy(90)
        survivor, doomed = leaders[1], leaders[0]
        for leader in leaders:  # each has the fellow's heartbeat in hand (its placement needs it)
            wait_until(lambda: "swarm:fellows_online 1.0" in leader.get("/metrics").text, 60, "the fellow online")
        async with httpx.AsyncClient() as http:  # first requests on both leaders at once: one load between them
            first = await asyncio.gather(*(post(http, leader.base_url, {}) for _ in range(3) for leader in leaders))
        assert first == [200] * 6, first
        assert await rows(db, "SELECT model_id, state FROM loads") == [("tiny-a", "ready")]
        # a token minted on one leader is honoured by the other, and the API is closed on both
        minted = httpx.post(doomed.base_url + "/api/v1/api-tokens", json={"label": "ops", "scopes": ["admin"]})
        assert minted.status_code == 201, minted.text
        bearer = {"Authorization": "Bearer " + minted.json()["token"]}
        # the other leader serves the load placed by the first, once its own projectors have seen it
        wait_until(lambda: httpx.post(survivor.base_url + "/v1/chat/completions", json=BODY, timeout=60,
                                      headers=bearer).status_code == 200, 30, "the other leader serving", interval=0.2)
        assert httpx.post(survivor.base_url + "/v1/chat/completions", json=BODY, timeout=60).status_code == 401
        async with httpx.AsyncClient() as http:
            traffic = [asyncio.create_task(post(http, leader.base_url, bearer)) for _ in range(6) for leader in leaders]
            await asyncio.sleep(0)
            os.kill(nodes[0].process.pid, signal.SIGKILL)  # one of three nats-server nodes
            doomed.kill(signal.SIGKILL)
            during = await asyncio.gather(*traffic)
            after = await asyncio.gather(*(post(http, survivor.base_url, bearer) for _ in range(6)))
        served = during[1::2] + list(after)  # the survivor's answers
        assert served == [200] * len(served), (served, survivor.tail())
        assert survivor.get("/healthz").status_code == 200

        async def settled():
            # every row final, with the survivor's replies among them: after the node's loss its projectors
            # re-subscribe, and until they catch up the rows of the last requests are not there yet
            got = await rows(db, "SELECT request_id, status FROM requests")
            finished = sum(status == "finished" for _, status in got)
            return got if got and all(status in FINAL for _, status in got) and finished >= len(served) else None

        final = await eventually(settled, 90, "every request row final, the survivor's replies finished")
        assert sum(status == "finished" for _, status in final) >= len(served)
        # projected once across both leaders: every checkpoint at the log's end, no event applied twice
        health = wait_until(lambda: (h := survivor.get("/healthz").json()) and all(
            p["lag"] == 0 for p in h["projectors"].values()) and h, 30, "projections caught up")
        assert health["status"] == "ok", health
        assert await rows(db, "SELECT joins, status FROM fellows WHERE fellow_id = 'f0'") == [(1, "online")]
        assert (await rows(db, "SELECT count(*) FROM dead_letters"))[0][0] == 0
        for leader in leaders:  # neither leader applied a batch the other had (a conflict, tried again)
            assert "batch not applied" not in leader.tail(10**7)
    finally:
        for p in procs:
            p.stop()


async def test_the_documented_commands_form_a_cluster_with_users(tmp_path):
    """docs/deploy.md sections 1 and 2: `swarm nats-auth`, then `swarm nats` on three nodes with
    --config, --server-name, --cluster-port and --routes; the leader creates R3 streams."""
    from core.bus import BusUnavailable, connect, ensure_streams
    from core.nats_server import free_port

    env = swarm_env(tmp_path, None)
    made = subprocess.run([sys.executable, "-m", "core.cli", "nats-auth", str(tmp_path / "auth"), "--fellow", "gpu1"],
                          env=env, capture_output=True, text=True)
    assert made.returncode == 0 and "3 NATS users" in made.stdout, made.stderr
    auth = AuthDir(tmp_path / "auth")
    ports, routes = [free_port() for _ in range(3)], [free_port() for _ in range(3)]
    nodes = [SwarmProcess(["nats", "--port", str(ports[i]), "--store-dir", str(tmp_path / f"n{i}"),
                           "--config", str(auth.config), "--server-name", f"n{i}", "--cluster-port", str(routes[i]),
                           "--routes", ",".join(f"nats://127.0.0.1:{r}" for r in routes if r != routes[i])],
                          env, tmp_path / f"n{i}.log") for i in range(3)]
    try:
        for n in nodes:
            n.start()
        urls = ",".join(f"nats://127.0.0.1:{p}" for p in ports)

        async def refused() -> bool:  # False while the nodes start; an anonymous login must never pass
            try:
                nc = await connect(urls, "anonymous", timeout=2, allow_reconnect=False)
            except BusUnavailable as exc:
                return "Authorization Violation" in str(exc)
            await nc.close()
            raise AssertionError("an anonymous client logged in")

        await eventually(refused, 30, "the nodes refusing anonymous clients")
        nc = await connect(urls, "leader", credentials=auth.credentials(LEADER_USER), timeout=30)
        try:
            js = nc.jetstream()
            await ensure_streams(js, replicas=3)
            info = await js.stream_info("SWARM_EVENTS")
            assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2, info.cluster
        finally:
            await nc.close()
    finally:
        for n in nodes:
            n.stop()


def test_swarm_nats_stopped_by_sigterm_stops_its_nats_server(tmp_path):
    """`kill`, systemd's stop and docker's stop send SIGTERM: `swarm nats` then stops its nats-server and
    exits 0, as on Ctrl-C. (It used to exit at once, leaving the server running with its port and store.)"""
    from tests.processes import children_of, pid_alive

    proc = SwarmProcess(["nats", "--port", "0", "--store-dir", str(tmp_path / "store")], swarm_env(tmp_path, None),
                        tmp_path / "nats.log").start()
    servers: list[int] = []
    try:
        wait_until(lambda: " at nats://" in proc.tail(), 30, "the server's URL")
        servers = children_of(proc.proc.pid)
        assert len(servers) == 1 and pid_alive(servers[0])
        assert proc.stop() == 0, proc.tail()
        assert not pid_alive(servers[0]), "the nats-server outlived `swarm nats`"
    finally:
        proc.kill()
        for pid in servers:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
