"""HTTP quirks found by probing the leader: odd static paths and a body that never arrives in full."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

from leader.app import create_app
from leader.web.pages import STATIC_NAMES
from tests.chat_fixtures import served
from tests.conftest import make_settings
from tests.tokens_app import TOKENS, leader_client


async def test_odd_static_paths_are_404_never_500(tmp_path, nats_server, sqlite_url):
    async with leader_client(tmp_path, nats_server.url, sqlite_url) as (app, c):
        for path in ("/static/%00", "/static/" + "a" * 10_000, "/static/a%00b.js", "/static/../leader/app.py",
                     "/static/nope.js"):
            r = await c.get(path)
            assert r.status_code in (400, 404), (path[:40], r.status_code, r.text[:200])
            assert r.json()["error"]["message"], r.text[:200]
        name = sorted(STATIC_NAMES)[0]
        ok = await c.get(f"/static/{name}")
        assert ok.status_code == 200 and ok.content and "max-age=86400" in ok.headers["cache-control"]


async def test_a_body_shorter_than_its_content_length_is_a_408(tmp_path, nats_server, sqlite_url):
    settings = make_settings(tmp_path, nats_server.url, sqlite_url)
    async with served(create_app(settings, body_timeout_s=0.5)) as url:
        where = urlsplit(url)
        reader, writer = await asyncio.open_connection(where.hostname, where.port)
        started = time.monotonic()
        writer.write(b"POST " + TOKENS.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"label": ')  # 10 of the 100 bytes, then silence
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        waited = time.monotonic() - started
        body = await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"request_timeout" in body and 0.4 < waited < 10, (body, waited)


async def test_a_body_that_is_not_json_is_a_415(tmp_path, nats_server, sqlite_url):
    """Issue 38: a text/plain body was read as JSON. Every body the API takes is JSON; none is taken,
    and nothing is minted, from another media type."""
    body = b'{"label": "l", "scopes": ["read"]}'
    async with leader_client(tmp_path, nats_server.url, sqlite_url) as (app, c):
        for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            for path in (TOKENS, "/v1/chat/completions"):
                r = await c.post(path, content=body, headers={"Content-Type": media})
                assert r.status_code == 415, (media, path, r.text)
                assert r.json()["error"]["code"] == "unsupported_media_type", r.text
        assert (await c.get(TOKENS)).json()["data"] == []
        r = await c.post(TOKENS, content=body, headers={"Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 201, r.text  # (no Content-Type at all: tests/test_tokens_api.py)
