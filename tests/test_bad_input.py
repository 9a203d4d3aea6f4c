"""Bad input (issue 18): an HTTP body over the limit is a 413 with OpenAI's error object, and malformed,
oversized and wrong-schema messages on the leader's subjects are dropped with one log line while
serving goes on. Real nats-server, SQLite and Litestar app.

The other consumers have theirs: projectors (`test_projection_poison.py`), the fellow's commands
(`test_fellow_commands.py::test_poisoned_commands_leave_the_fellow_obeying`), a stage's request intake
(`test_runtime_intake.py::test_a_stage_skips_what_does_not_decode_and_serves_on`), ring lanes
(`test_ring_stack.py`).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager
from urllib.parse import urlsplit

import msgspec
import pytest

from core.bus import publish_event, settle
from core.settings import Settings
from events import subjects
from events.base import new_id
from events.fellow import Heartbeat
from events.frames import DoneFrame, TokenFrame
from events.loads import LoadFailed
from events.ring import LaneStats, encode_frame
from leader.app import create_app
from leader.relay_stats import RelayStats
from leader.token_stream import TokenStreams
from tests.chat_fixtures import ServingPeer, served
from tests.conftest import make_settings
from tests.processes import wait_until
from tests.tokens_app import TOKENS, leader_client


@contextmanager
def logged(name: str):
    """The messages logged on logger `name` (a handler of its own: the app's logging setup replaces root's)."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


JUNK = {
    "not JSON": b"\x93not json",
    "wrong schema": b'{"t": "tok", "request_id": 5}',
    "nested too deep": b"[" * 100_000 + b"]" * 100_000,
    "oversized": b'{"x": "' + b"a" * 900_000 + b'"}',  # under nats-server's 1 MiB max_payload
}


async def test_a_body_over_the_limit_is_a_413_with_an_openai_error(tmp_path, nats_server, sqlite_url):
    assert Settings.from_env({}).leader.http_max_body_bytes == 8 * 1024 * 1024
    async with leader_client(tmp_path, nats_server.url, sqlite_url, SWARM_HTTP_MAX_BODY_BYTES=4096) as (_, c):
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
        for path in ("/v1/chat/completions", TOKENS):
            r = await c.post(path, json=big)
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
            assert "4096 bytes" in err["message"] and "SWARM_HTTP_MAX_BODY_BYTES" in err["message"]

        assert (await c.post(TOKENS, json={"label": "x" * 3000, "scopes": ["read"]})).status_code != 413


async def test_a_chunked_body_is_counted_as_it_arrives(tmp_path, nats_server, sqlite_url):
    settings = make_settings(tmp_path, nats_server.url, sqlite_url, SWARM_HTTP_MAX_BODY_BYTES=4096)
    async with served(create_app(settings)) as url:
        where = urlsplit(url)
        reader, writer = await asyncio.open_connection(where.hostname, where.port)
        writer.write(f"POST {TOKENS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())  # no Content-Length
        for _ in range(10):
            writer.write(b"3e8\r\n" + b" " * 1000 + b"\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        body = await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b'"code":"request_too_large"' in body, body


async def test_junk_heartbeats_are_dropped_and_a_real_one_still_joins(tmp_path, nats_server, nc, sqlite_url):
    async with leader_client(tmp_path, nats_server.url, sqlite_url) as (_, c):
        with logged("leader.fellow_monitor") as lines:
            for data in JUNK.values():
                await nc.publish(subjects.heartbeat("fz"), data)
            await nc.publish(subjects.heartbeat("fz"), msgspec.json.encode(
                Heartbeat(fellow_id="fz", hostname="h", seq=1, interval_s=1.0, started_at=1.0)))
            await settle(nc)

            async def online() -> bool:
                fellows = (await c.get("/api/v1/fellows")).json()["data"]
                return any(f["id"] == "fz" and f["status"] == "online" for f in fellows)

            for _ in range(200):
                if await online():
                    break
                await asyncio.sleep(0.05)
            assert await online()
        assert sum("malformed heartbeat" in m for m in lines) == len(JUNK), lines


async def test_junk_lane_stats_are_dropped_and_real_ones_counted(nc):
    stats = RelayStats()
    await stats.start(nc)
    try:
        with logged("leader.relay_stats") as lines:
            for data in [*JUNK.values(), b"\x91" * 50_000]:  # and msgpack arrays nested deep
                await nc.publish("swarm.ring.ld-x.stats", data)
            await nc.publish("swarm.ring.ld-x.stats", encode_frame(LaneStats(stage=1, lanes={"act": [10, 2]})))
            await asyncio.to_thread(wait_until, lambda: stats.lanes("ld-x"), 10, "the real stats")
        assert stats.lanes("ld-x")["act"]["frames"] == 2
        assert sum("malformed lane stats" in m for m in lines) == len(JUNK) + 1, lines
    finally:
        await stats.stop()


@pytest.fixture
async def hub(nc, js):
    streams = await TokenStreams(nc, js, probe_s=0.3, gap_wait_s=0.05).start()
    yield streams
    await streams.stop()


async def test_junk_frames_and_load_events_are_dropped_and_streams_go_on(hub, nc, js):
    rid, peer = new_id(), ServingPeer(js)
    with logged("leader.token_stream") as lines:
        for data in JUNK.values():  # stored before the receiver listens: read back by a fill
            await js.publish(subjects.tokens(rid), data)
        await peer.publish(TokenFrame(request_id=rid, seq=0, texts=["a"], text="a"))
        stream = await hub.open(rid, "ld-j")
        for data in JUNK.values():
            await js.publish(subjects.tokens(rid), data)  # live
            for kind in ("load.failed", "load.replica_lost", "load.unloaded"):
                await nc.publish(subjects.event(kind), data)
        await peer.publish(TokenFrame(request_id=rid, seq=1, texts=["b"], text="b"))
        await peer.publish(DoneFrame(request_id=rid, seq=2, completion_tokens=2, prompt_tokens=1))
        frames = [await stream.next(5.0) for _ in range(3)]
        assert [f.seq for f in frames] == [0, 1, 2] and "".join(f.text for f in frames[:2]) == "ab"
        stream.close(cancel=False)

        other = await hub.open(new_id(), "ld-j")  # the load watch still works
        await publish_event(js, LoadFailed(id=new_id(), load_id="ld-j", model_id="m", reason="gone"))
        assert (await other.next(5.0)).code == "load_failed"
        other.close(cancel=False)
    assert sum("undecodable event" in m for m in lines) == 3 * len(JUNK), lines
    assert sum("undecodable frame" in m for m in lines) >= 2 * len(JUNK), lines  # live, and in the fill
