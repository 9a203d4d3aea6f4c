"""Events decoded once, by one explicit union; poison on the log is recorded and skipped; /healthz
reports each projector's lag and whether it is stuck. Real nats-server, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import importlib
import json
import pkgutil
import sqlite3
import subprocess
import sys
import time

import sqlalchemy as sa
from litestar.testing import AsyncTestClient

import events
from core.bus import publish_event
from events.api_tokens import ApiTokenRevoked
from events.base import Event, encode
from events.catalog import ModelUncataloged
from events.fellow import FellowJoined
from events.loads import ModelUnloaded
from events.requests import RequestAccepted
from events.union import EVENT_TYPES
from leader.app import create_app
from leader.db.engine import make_engine, session_factory, upgrade
from leader.db.tables import DeadLetter, Fellow, ProjectorCheckpoint, Request
from leader.projectors.all import all_projectors
from leader.projectors.runner import ProjectionRunner
from tests.conftest import make_settings
from tests.tokens_app import on_app

POISON = {
    "swarm.evt.x": b"not json",
    "swarm.evt.fellow.joined": b'{"type":"fellow.joined","fellow_id":5}',
    "swarm.evt.deep": b'{"type":"fellow.joined","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "swarm.evt.untyped": b'{"fellow_id":"f9"}',
}


def test_the_union_lists_every_event_type():
    for mod in pkgutil.iter_modules(events.__path__):
        importlib.import_module(f"events.{mod.name}")
    found, todo = set(), list(Event.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        found.add(cls)
    assert found == set(EVENT_TYPES)


def test_decoding_needs_only_the_decoder_module():
    """A fresh interpreter that imports events.union alone decodes every kind of event on the log."""
    samples = [FellowJoined(fellow_id="f1"), RequestAccepted(request_id="r", model_id="m", load_id="L"),
               ApiTokenRevoked(token_id="t"), ModelUncataloged(model_id="m"), ModelUnloaded(load_id="L", model_id="m")]
    code = ("import sys, json; from events.union import decode_event; "
            "print(json.dumps([type(decode_event(l.encode())).__name__ for l in json.load(sys.stdin)]))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps([encode(e).decode() for e in samples]),
                         capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout) == [type(e).__name__ for e in samples]


async def test_poison_is_recorded_once_and_skipped(js, database_url):
    await upgrade(database_url)
    engine = make_engine(database_url)
    sessions = session_factory(engine)
    runner = ProjectionRunner(js, sessions, all_projectors())
    await runner.start()
    try:
        poison_seqs = {}
        for subject, data in POISON.items():
            poison_seqs[(await js.publish(subject, data)).seq] = subject
        await js.publish("swarm.evt.newer.kind", b'{"type":"newer.kind","x":1}')  # a newer writer's: quiet
        last = await publish_event(js, FellowJoined(fellow_id="f1", hostname="h1"))
        await runner.wait_for(last.seq, timeout=20)
        async with sessions() as session:
            assert (await session.get(Fellow, "f1")).hostname == "h1"
            dead = {d.seq: d for d in await session.scalars(sa.select(DeadLetter))}
            assert (await session.get(ProjectorCheckpoint, "fellows")).seq == last.seq
        assert {seq: d.subject for seq, d in dead.items()} == poison_seqs
        reasons = {d.subject: d.reason for d in dead.values()}
        assert "malformed" in reasons["swarm.evt.x"]
        assert "fellow_id" in reasons["swarm.evt.fellow.joined"]
        assert "nested" in reasons["swarm.evt.deep"]
        assert "type" in reasons["swarm.evt.untyped"]
    finally:
        await runner.stop()
    # A restart from the checkpoints re-reads nothing twice: no duplicate dead letter, rows unchanged.
    runner = ProjectionRunner(js, sessions, all_projectors())
    await runner.start()
    try:
        again = await publish_event(js, FellowJoined(fellow_id="f2"))
        await runner.wait_for(again.seq, timeout=20)
        async with sessions() as session:
            assert len(list(await session.scalars(sa.select(DeadLetter)))) == len(POISON)
            assert await session.get(Fellow, "f2") is not None
    finally:
        await runner.stop()
        await engine.dispose()


async def _health(client) -> dict:
    resp = await client.get("/healthz")
    assert resp.status_code == 200, resp.text
    return resp.json()


async def _until(client, test, what: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = await _health(client)
        if test(body):
            return body
        assert time.monotonic() < deadline, f"{what}: {body}"
        await asyncio.sleep(0.1)


async def test_healthz_reports_lag_and_a_stuck_projector(tmp_path, nats_server, js, sqlite_url):
    app = create_app(make_settings(tmp_path, nats_server.url, sqlite_url))
    async with AsyncTestClient(app) as client:
        leader = app.state.leader
        leader.projections.stuck_after_s = 3.0  # the default (10 s) only makes the test wait
        ack = await publish_event(js, RequestAccepted(request_id="r1", model_id="m", load_id="L"))
        # on the app's own loop (the test client serves it from another thread): its Condition is bound there
        await on_app(client, leader.projections.wait_for, ack.seq, None, 20)
        body = await _until(client, lambda b: b["projectors"]["requests"]["last_seq"] >= ack.seq, "head read")
        assert body["status"] == "ok"
        for name, p in body["projectors"].items():
            assert p["checkpoint"] == p["last_seq"] == body["projections"][name] and p["lag"] == 0, name
            assert p["stuck"] is False
        async with leader.sessions() as session:  # the requests projection can no longer write
            await session.execute(sa.text("ALTER TABLE requests RENAME TO requests_away"))
            await session.commit()
        ack = await publish_event(js, RequestAccepted(request_id="r2", model_id="m", load_id="L"))
        body = await _until(client, lambda b: b["projectors"]["requests"]["stuck"], "requests stuck")
        assert body["status"] == "degraded"
        stuck = body["projectors"]["requests"]
        assert stuck["lag"] >= 1 and stuck["checkpoint"] < ack.seq <= stuck["last_seq"]
        assert not body["projectors"]["fellows"]["stuck"]
        async with leader.sessions() as session:
            await session.execute(sa.text("ALTER TABLE requests_away RENAME TO requests"))
            await session.commit()
        await on_app(client, leader.projections.wait_for, ack.seq, ["requests"], 20)
        body = await _until(client, lambda b: b["status"] == "ok", "recovered")
        assert body["projectors"]["requests"]["lag"] == 0
        async with leader.sessions() as session:
            assert (await session.get(Request, "r2")) is not None


async def test_a_projector_held_behind_is_stuck_until_it_advances(js, tmp_path):
    """SQLite's write lock held by another connection: the requests projector cannot commit, has not
    advanced while behind for longer than the threshold, and is reported stuck."""
    path = tmp_path / "swarm.db"
    url = f"sqlite+aiosqlite:///{path}"
    await upgrade(url)
    engine = make_engine(url)
    runner = ProjectionRunner(js, session_factory(engine), all_projectors(), stuck_after_s=0.5)
    await runner.start()
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        first = await publish_event(js, RequestAccepted(request_id="r1", model_id="m", load_id="L"))
        await runner.wait_for(first.seq, timeout=20)
        assert not any(p["stuck"] for p in runner.health(first.seq).values())
        holder.execute("BEGIN IMMEDIATE")
        ack = await publish_event(js, RequestAccepted(request_id="r2", model_id="m", load_id="L"))
        await runner.wait_for(ack.seq, ["fellows"], timeout=20)  # nothing to write there: it advances
        deadline = time.monotonic() + 20
        while not runner.health(ack.seq)["requests"]["stuck"]:
            assert time.monotonic() < deadline, runner.health(ack.seq)
            await asyncio.sleep(0.05)
        health = runner.health(ack.seq)
        assert health["requests"]["lag"] == 1 and health["requests"]["failures"] == 0
        assert not health["fellows"]["stuck"] and health["fellows"]["lag"] == 0
        holder.execute("ROLLBACK")
        await runner.wait_for(ack.seq, timeout=20)
        assert not any(p["stuck"] for p in runner.health(ack.seq).values())
    finally:
        holder.close()
        await runner.stop()
        await engine.dispose()


async def test_an_idle_reader_takes_empty_fetches_quietly(js, sqlite_url, caplog):
    """An idle stream sometimes answers a pull with no message at all; that is no error, and the
    runner goes on projecting without recreating anything."""
    await upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    runner = ProjectionRunner(js, session_factory(engine), all_projectors(), fetch_timeout_s=0.05)
    caplog.set_level("WARNING", logger="leader.projectors")
    await runner.start()
    try:
        deadline = time.monotonic() + 60
        while runner.empty_fetches < 3:
            assert time.monotonic() < deadline, "no empty fetch came back"
            await asyncio.sleep(0.05)
        ack = await publish_event(js, FellowJoined(fellow_id="f1"))
        await runner.wait_for(ack.seq, timeout=20)
        assert [r.getMessage() for r in caplog.records if r.name.startswith("leader.projectors")] == []
    finally:
        await runner.stop()
        await engine.dispose()
