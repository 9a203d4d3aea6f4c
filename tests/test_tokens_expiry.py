"""Expiry, the 31-day prune on an injected clock, and secrets that never reach a log or the bus."""

from __future__ import annotations

import logging
import time

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from events.api_tokens import ApiTokenPruned
from events.subjects import EVENTS_ALL, EVENTS_STREAM, event
from events.union import decode_event
from leader.auth.pruner import PRUNE_AFTER_S
from leader.auth.token_format import TOKEN_PREFIX, hash_secret
from tests.tokens_app import READ_ROUTE, TOKENS, Clock, bearer, leader_client, mint, on_app


async def test_expired_token_keeps_auth_on_until_pruned_31_days_later(tmp_path, nats_server, js, database_url):
    clock = Clock(time.time())
    async with leader_client(tmp_path, nats_server.url, database_url, clock=clock,
                             prune_interval_s=0.05) as (app, c):
        admin = await mint(c, "admin", ["admin"])
        conn = await mint(c, "mcp connector", ["operate"], secret=admin["token"], expires_in=3600)
        assert conn["expires_at"] == clock.now + 3600
        assert (await c.delete(f"{TOKENS}/{admin['id']}", headers=bearer(admin["token"]))).status_code == 200
        assert (await c.get(READ_ROUTE, headers=bearer(conn["token"]))).status_code == 200

        clock.advance(3600)  # the connector's access token lapses while it sits idle
        expired = await c.get(READ_ROUTE, headers=bearer(conn["token"]))
        assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]
        assert conn["token"] not in expired.text
        # ...but it still counts: enforcement does not lapse, and nobody mints anonymously.
        assert (await c.get(READ_ROUTE)).status_code == 401
        assert (await c.post(TOKENS, json={"label": "grab", "scopes": ["admin"]})).status_code == 401

        service = app.state.leader.auth
        clock.advance(PRUNE_AFTER_S - 1)
        assert await on_app(c, service.pruner.sweep) == []  # a second short of 31 days: kept
        assert (await c.get(READ_ROUTE)).status_code == 401

        sub = await js.pull_subscribe(event("api_token.pruned"), stream=EVENTS_STREAM)
        clock.advance(2)  # the background sweep now finds it due
        msgs = await sub.fetch(1, timeout=10)
        pruned = decode_event(msgs[0].data)
        assert isinstance(pruned, ApiTokenPruned)
        assert (pruned.token_id, pruned.expired_at) == (conn["id"], conn["expires_at"])
        await on_app(c, app.state.leader.projections.wait_for, msgs[0].metadata.sequence.stream, ["api_tokens"])

        assert (await c.get(READ_ROUTE)).status_code == 200  # open first-run mode again
        assert [t["id"] for t in (await c.get(TOKENS)).json()["data"]] == [admin["id"]]  # revoked, kept
        fresh = await mint(c, "after prune", ["read"])
        assert fresh["scopes"] == ["read", "admin"]


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


async def test_no_secret_reaches_a_log_line_or_the_event_log(tmp_path, nats_server, js, sqlite_url):
    sink = Collect()
    sink.setFormatter(logging.Formatter("%(name)s %(message)s %(exc_info)s"))
    loggers = [logging.getLogger(), logging.getLogger("litestar")]
    levels = [lg.level for lg in loggers]
    try:
        async with leader_client(tmp_path, nats_server.url, sqlite_url) as (app, c):
            for lg in loggers:  # after startup: the app's logging config replaces root handlers
                lg.addHandler(sink)
                lg.setLevel(logging.DEBUG)
            admin = await mint(c, "admin", ["admin"])
            op = await mint(c, "op", ["operate"], secret=admin["token"], expires_in=60)
            secrets = [admin["token"], op["token"]]
            assert (await c.get(READ_ROUTE, headers=bearer(op["token"]))).status_code == 200
            assert (await c.get(TOKENS, headers=bearer(op["token"]))).status_code == 403
            wrong = op["token"][:-1] + ("a" if op["token"][-1] != "a" else "b")
            assert (await c.get(READ_ROUTE, headers=bearer(wrong))).status_code == 401
            assert (await c.delete(f"{TOKENS}/{op['id']}", headers=bearer(admin["token"]))).status_code == 200
            assert (await c.get(READ_ROUTE, headers=bearer(op["token"]))).status_code == 401
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(sink)
            lg.setLevel(level)

    logs = "\n".join(sink.lines)
    assert f"minted API token {op['id']}" in logs  # the token's own log lines were captured
    for secret in secrets:
        assert secret not in logs and secret[len(TOKEN_PREFIX):] not in logs

    sub = await js.pull_subscribe(EVENTS_ALL, stream=EVENTS_STREAM, config=ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE))
    last = (await js.stream_info(EVENTS_STREAM)).state.last_seq
    datas: list[bytes] = []
    while len(datas) < last:
        datas += [m.data for m in await sub.fetch(last - len(datas), timeout=5)]
    assert sum(hash_secret(s).encode() in d for s in secrets for d in datas) == 2  # both mints are there
    for secret in secrets:
        assert not any(secret[len(TOKEN_PREFIX):].encode() in d for d in datas)
