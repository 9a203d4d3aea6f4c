"""API tokens through the real app: open mode, enforcement by existence, scopes, revoke, replay."""

from __future__ import annotations

import asyncio
import sys

import pytest
from litestar import Request, get

from leader.auth.guard import token_of, undeclared_handlers
from leader.auth.token_format import new_secret
from leader.db.tables import ApiToken
from leader.projectors.api_tokens import ApiTokensProjector
from leader.projectors.replay import replay
from tests.dbutil import dump
from tests.tokens_app import READ_ROUTE, TOKENS, bearer, leader_client, mint, on_app


def error_of(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code, err
    return err


async def test_tokens_lifecycle_enforced_by_existence(tmp_path, nats_server, database_url):
    async with leader_client(tmp_path, nats_server.url, database_url) as (app, c):
        # Open first-run mode: no header, or an OpenAI SDK's placeholder key, both pass.
        assert (await c.get(READ_ROUTE)).status_code == 200
        assert (await c.get(READ_ROUTE, headers=bearer("sk-placeholder"))).status_code == 200
        assert (await c.get(TOKENS)).json()["data"] == []

        first = await mint(c, "ops", ["read"])
        assert first["scopes"] == ["read", "admin"]  # the first token is the admin
        assert first["token"].startswith(first["prefix"]) and first["revoked_at"] is None
        admin = first["token"]

        # Read-your-writes: the very next request already needs the token, and it works.
        error_of(await c.get(READ_ROUTE), 401, "invalid_api_key")
        assert (await c.get(READ_ROUTE, headers=bearer(admin))).status_code == 200
        error_of(await c.post(TOKENS, json={"label": "sneak", "scopes": ["admin"]}), 401, "invalid_api_key")

        op = await mint(c, "gateway", ["operate"], secret=admin)
        assert op["scopes"] == ["operate"]  # not the first: no admin added
        ro = await mint(c, "dashboard", ["read"], secret=admin, expires_in=3600)
        assert ro["expires_at"] == pytest.approx(ro["created_at"] + 3600)

        # operate implies read; neither reaches admin routes.
        assert (await c.get(READ_ROUTE, headers=bearer(op["token"]))).status_code == 200
        assert (await c.get(READ_ROUTE, headers=bearer(ro["token"]))).status_code == 200
        err = error_of(await c.get(TOKENS, headers=bearer(op["token"])), 403, "insufficient_scope")
        assert "admin" in err["message"] and op["token"] not in err["message"]
        error_of(await c.delete(f"{TOKENS}/{op['id']}", headers=bearer(ro["token"])), 403, "insufficient_scope")
        error_of(await c.post(TOKENS, json={"label": "x", "scopes": ["read"]}, headers=bearer(op["token"])),
                 403, "insufficient_scope")

        listing = await c.get(TOKENS, headers=bearer(admin))
        assert listing.status_code == 200
        assert [t["label"] for t in listing.json()["data"]] == ["ops", "gateway", "dashboard"]
        for secret in (admin, op["token"], ro["token"]):
            assert secret not in listing.text
        assert "hash" not in listing.text

        error_of(await c.delete(f"{TOKENS}/tok_nope", headers=bearer(admin)), 404, "token_not_found")
        gone = await c.delete(f"{TOKENS}/{op['id']}", headers=bearer(admin))
        assert gone.status_code == 200 and gone.json()["revoked_at"] is not None
        err = error_of(await c.get(READ_ROUTE, headers=bearer(op["token"])), 401, "invalid_api_key")
        assert "revoked" in err["message"] and op["prefix"] in err["message"]
        assert op["token"] not in err["message"]

        # Revoking every token returns to open mode; the next mint is the first again.
        answers = [await c.delete(f"{TOKENS}/{t['id']}", headers=bearer(admin)) for t in (ro, first)]
        assert [a.status_code for a in answers] == [200, 200]
        assert answers[0].json()["api_open"] is False and answers[0].json()["message"] is None
        assert answers[1].json()["api_open"] is True and "open to anyone" in answers[1].json()["message"]
        assert (await c.get(READ_ROUTE)).status_code == 200
        again = await mint(c, "fresh start", ["operate"])
        assert again["scopes"] == ["operate", "admin"]
        error_of(await c.get(READ_ROUTE), 401, "invalid_api_key")

        # Replaying the event log rebuilds exactly the table the live projector wrote.
        leader = app.state.leader
        live = await on_app(c, dump, leader.sessions, ApiToken)
        assert len(live["api_tokens"]) == 4
        assert await on_app(c, replay, leader.js, leader.sessions, ApiTokensProjector()) > 0
        assert await on_app(c, dump, leader.sessions, ApiToken) == live


async def test_required_token_without_any_only_allows_bootstrap(tmp_path, nats_server, database_url):
    async with leader_client(tmp_path, nats_server.url, database_url, SWARM_REQUIRE_API_TOKEN=1) as (app, c):
        error_of(await c.get(READ_ROUTE), 401, "invalid_api_key")
        error_of(await c.get(TOKENS), 401, "invalid_api_key")
        assert (await c.get("/healthz")).status_code == 200  # public routes stay public
        assert (await c.get("/schema/openapi.json")).status_code == 200
        boot = await mint(c, "bootstrap", ["read"])  # nothing to authenticate with yet
        assert "admin" in boot["scopes"]
        assert (await c.get(READ_ROUTE, headers=bearer(boot["token"]))).status_code == 200
        last = await c.delete(f"{TOKENS}/{boot['id']}", headers=bearer(boot["token"]))
        assert last.status_code == 200 and last.json()["api_open"] is False
        assert "SWARM_REQUIRE_API_TOKEN" in last.json()["message"]
        # Every token revoked, but SWARM_REQUIRE_API_TOKEN=1 keeps auth on.
        error_of(await c.get(READ_ROUTE), 401, "invalid_api_key")
        error_of(await c.get(READ_ROUTE, headers=bearer(boot["token"])), 401, "invalid_api_key")


BAD_BODIES = [
    (b"", None), (b"{not json", None), (b"[]", None),
    (b'{"scopes": ["read"]}', "label"), (b'{"label": "  ", "scopes": ["read"]}', "label"),
    (b'{"label": 7, "scopes": ["read"]}', "label"), (b'{"label": "' + b"x" * 256 + b'", "scopes": ["read"]}', "label"),
    (b'{"label": "a\\u0000b", "scopes": ["read"]}', "label"),  # issue 38: NUL and U+202E in a label
    (b'{"label": "ops\\u202etxt.exe", "scopes": ["read"]}', "label"),
    (b'{"label": "a\\u001b[2J", "scopes": ["read"]}', "label"),
    (b'{"label": "l"}', "scopes"), (b'{"label": "l", "scopes": []}', "scopes"),
    (b'{"label": "l", "scopes": "read"}', "scopes"), (b'{"label": "l", "scopes": ["root"]}', "scopes"),
    (b'{"label": "l", "scopes": [1]}', "scopes"),
    (b'{"label": "l", "scopes": ["read"], "expires_in": 0}', "expires_in"),
    (b'{"label": "l", "scopes": ["read"], "expires_in": -5}', "expires_in"),
    (b'{"label": "l", "scopes": ["read"], "expires_in": "1h"}', "expires_in"),
    (b'{"label": "l", "scopes": ["read"], "expires_in": true}', "expires_in"),
    (b'{"label": "l", "scopes": ["read"], "expires_in": 1e300}', "expires_in"),
    (b'{"label": "l", "scopes": ["read"], "expires_in": 1' + b"0" * 399 + b"}", "expires_in"),  # 400 digits
]


def too_deep() -> list[tuple[bytes, None]]:
    """Nesting past msgspec's limit, which is Python's recursion limit when decoding: read when called, since a
    test run in this worker before (hypothesis, torch's compiler) may have raised it past the default 1,000."""
    depth = sys.getrecursionlimit() + 200
    return [(b'{"label": "l", "scopes": ["read"], "extra": ' + b"[" * depth + b"]" * depth + b"}", None),
            (b'{"label": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b', "scopes": ["read"]}', None)]


async def test_bad_mint_bodies_name_the_parameter(tmp_path, nats_server, sqlite_url):
    async with leader_client(tmp_path, nats_server.url, sqlite_url) as (app, c):
        for body, param in BAD_BODIES + too_deep():
            resp = await c.post(TOKENS, content=body, headers={"Content-Type": "application/json"})
            err = error_of(resp, 400, "invalid_request")
            assert (err["param"], err["type"]) == (param, "invalid_request_error"), (body[:60], err)
        assert (await c.get(TOKENS)).json()["data"] == []  # nothing was minted
        ok = await c.post(TOKENS, content=b'{"label": "l", "scopes": ["read"], "expires_in": 60}')
        assert ok.status_code == 201, ok.text


async def test_malformed_authorization_headers_are_clean_401s(tmp_path, nats_server, sqlite_url):
    async with leader_client(tmp_path, nats_server.url, sqlite_url) as (app, c):
        tok = (await mint(c, "admin", ["admin"]))["token"]
        stranger = new_secret()  # well formed, checksum right, never minted
        bad = [b"", b"   ", b"Bearer", b"Bearer ", b"Basic dXNlcjpwYXNz", tok.encode(), b"Token " + tok.encode(),
               b"Bearer " + tok.encode() + b" extra", b"Bearer " + b"A" * 100_000, b"Bearer " + tok[:-1].encode(),
               "Bearer sk-swarm-é".encode("utf-8"), "Bearer ключ".encode("utf-8"), b"Bearer \x00\x01",
               b"Bearer " + tok.encode()[:-1] + (b"Z" if tok[-1] != "Z" else b"Y"), b"Bearer " + stranger.encode()]
        for value in bad:
            resp = await c.get(READ_ROUTE, headers={"Authorization": value})
            assert resp.status_code == 401, (value[:80], resp.text)
            err = error_of(resp, 401, "invalid_api_key")
            assert resp.headers.get("www-authenticate") == "Bearer"
            assert tok not in resp.text and stranger not in resp.text
        assert (await c.get(READ_ROUTE, headers={"Authorization": f"bearer  {tok} "})).status_code == 200
        err = error_of(await c.get(READ_ROUTE, headers=bearer(stranger)), 401, "invalid_api_key")
        assert stranger[:13] in err["message"]  # the display prefix, and no more of it


async def test_every_route_declares_a_scope_and_handlers_see_the_token(tmp_path, nats_server, sqlite_url):
    async with leader_client(tmp_path, nats_server.url, sqlite_url) as (app, c):
        missing = undeclared_handlers(app)
        assert missing == [], "route handlers without opt={'scope': ...}:\n" + "\n".join(missing)

        @get("/api/v1/forgotten", sync_to_thread=False)
        def forgotten() -> dict:
            return {"leaked": True}

        @get("/api/v1/misspelled", opt={"scope": "admn"}, sync_to_thread=False)
        def misspelled() -> dict:
            return {"leaked": True}

        @get("/api/v1/whoami", opt={"scope": "read"}, sync_to_thread=False)
        def whoami(request: Request) -> dict:
            identity = token_of(request)
            return {"token_id": identity.token_id if identity else None}

        app.register(forgotten)
        app.register(misspelled)
        app.register(whoami)
        listed = undeclared_handlers(app)
        assert len(listed) == 2 and any("/api/v1/forgotten" in h and "forgotten" in h for h in listed)
        assert (await c.get("/api/v1/whoami")).json() == {"token_id": None}  # open mode: anonymous
        # Two anonymous first mints at once: one wins (and is admin), the other is told to authenticate.
        racers = await asyncio.gather(*(c.post(TOKENS, json={"label": f"r{i}", "scopes": ["read"]})
                                        for i in range(2)))
        assert sorted(r.status_code for r in racers) == [201, 401], [r.text for r in racers]
        winner = next(r.json() for r in racers if r.status_code == 201)
        me = await c.get("/api/v1/whoami", headers=bearer(winner["token"]))
        assert me.json() == {"token_id": winner["id"]}
        for path in ("/api/v1/forgotten", "/api/v1/misspelled"):
            resp = await c.get(path)
            error_of(resp, 500, "route_scope_undeclared")
            assert "leaked" not in resp.text
