"""The database away for 10 s under a running leader (issue 18): chat requests keep flowing (the
gateway's path needs NATS, not SQL), and once PostgreSQL is back the projections catch up: every
request accepted during the outage has its final row, and /healthz is `ok` again."""

from __future__ import annotations

import time

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from core.nats_server import EmbeddedNats
from tests.processes import SwarmProcess, swarm_env, wait_until
from tests.request_helpers import (
    chat,
    servables,  # noqa: F401 (a fixture)
)
from tests.services import Postgres, postgres_bin

pytestmark = pytest.mark.slow
OUTAGE_S = 10.0


@pytest.fixture
def own_postgres():
    """A PostgreSQL of this test's own: it is stopped and started again."""
    if postgres_bin() is None:
        pytest.skip("PostgreSQL server binaries not installed")
    pg = Postgres().start()
    yield pg
    pg.stop()


async def final_rows(url: str) -> dict[str, str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return dict((await conn.execute(text("SELECT request_id, status FROM requests"))).all())
    finally:
        await engine.dispose()


async def test_requests_flow_while_the_database_is_away_and_the_projections_catch_up(
        tmp_path, own_postgres, servables):  # noqa: F811
    db = own_postgres.create_db("swarm")
    nats = EmbeddedNats(tmp_path / "js").start()
    env = swarm_env(tmp_path, nats.url, db, SWARM_SERVABLE_MODELS_ROOT=servables, SWARM_MODEL_IDLE_UNLOAD_S=0)
    leader = SwarmProcess(["leader"], env, tmp_path / "leader.log")
    fellow = SwarmProcess(["fellow", "--id", "f0"], env, tmp_path / "fellow.log")
    try:
        leader.start(), fellow.start()
        leader.wait_healthy(60)
        wait_until(lambda: any(f["status"] == "online" for f in leader.get("/api/v1/fellows").json()["data"]),
                   60, "the fellow online")
        r = httpx.post(leader.base_url + "/api/v1/models/tiny-a/load", json={"wait": True}, timeout=120)
        assert r.status_code == 200 and r.json()["state"] == "ready", r.text
        async with httpx.AsyncClient(base_url=leader.base_url, timeout=60) as http:
            own_postgres.halt()
            away_until = time.monotonic() + OUTAGE_S
            during = []
            while time.monotonic() < away_until:  # one request after another, for the whole outage
                r = await http.post("/v1/chat/completions", json=chat(f"hi {len(during)}", max_tokens=3, temperature=0))
                assert r.status_code == 200, r.text
                during.append(r.json()["id"])
            assert (await http.get("/healthz")).status_code == 200  # the leader answers without its database
            own_postgres.resume()
            after = await http.post("/v1/chat/completions", json=chat("back", max_tokens=3, temperature=0))
            assert after.status_code == 200, after.text
        assert len(during) >= 2

        def caught_up():
            h = leader.get("/healthz").json()
            return h["status"] == "ok" and all(p["lag"] == 0 for p in h["projectors"].values()) and h

        wait_until(caught_up, 60, "the projections caught up", interval=0.5)
        rows = await final_rows(db)
        ids = [i.removeprefix("chatcmpl-") for i in [*during, after.json()["id"]]]
        missing = [i for i in ids if rows.get(i) != "finished"]
        assert not missing, (missing, rows)
    finally:
        fellow.stop()
        leader.stop()
        nats.stop()
