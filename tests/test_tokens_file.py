"""SWARM_API_TOKENS_FILE: the leader's tokens as a file beside its database, kept in step with the event log
both ways (leader.auth.token_file)."""

from __future__ import annotations

import json
import stat
import time

import pytest

from leader.auth.token_file import TokensFileError, read_tokens
from leader.auth.token_format import display_prefix, hash_secret, new_secret
from tests.tokens_app import READ_ROUTE, TOKENS, bearer, leader_client, mint


def provisioned(path, secret: str, **extra) -> dict:
    entry = {"id": "tok-provisioned", "label": "from config", "scopes": ["operate"], "token_hash": hash_secret(secret),
             "prefix": display_prefix(secret), "created_at": time.time() - 60, "expires_at": None,
             "revoked_at": None, **extra}
    path.write_text(json.dumps({"tokens": [entry]}))
    return entry


async def test_a_provisioned_token_lets_in_and_the_file_follows_mints_and_revokes(tmp_path, nats_server):
    path = tmp_path / "tokens.json"
    secret = new_secret()
    provisioned(path, secret)
    async with leader_client(tmp_path, nats_server.url, SWARM_API_TOKENS_FILE=str(path)) as (_, c):
        assert (await c.get(READ_ROUTE)).status_code == 401  # a live token: auth is on
        assert (await c.get(READ_ROUTE, headers=bearer(secret))).status_code == 200
        assert [e["label"] for e in read_tokens(path)] == ["from config"]  # written back as the table holds it
        refused = await c.post(TOKENS, json={"label": "x", "scopes": ["read"]}, headers=bearer(secret))
        assert refused.status_code == 403
    # a second leader on a fresh database, the same file: the token is there, added once
    again = tmp_path / "again"
    again.mkdir()
    async with leader_client(again, nats_server.url, SWARM_API_TOKENS_FILE=str(path)) as (_, c):
        assert (await c.get(READ_ROUTE, headers=bearer(secret))).status_code == 200


async def test_the_file_is_written_from_the_table_with_hashes_only(tmp_path, nats_server):
    path = tmp_path / "state" / "tokens.json"
    async with leader_client(tmp_path, nats_server.url, SWARM_API_TOKENS_FILE=str(path)) as (_, c):
        assert json.loads(path.read_text()) == {"tokens": []}  # written at start
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        admin = await mint(c, "admin", ["admin"])
        reader = await mint(c, "reader", ["read"], secret=admin["token"])
        assert (await c.delete(f"{TOKENS}/{reader['id']}", headers=bearer(admin["token"]))).status_code == 200
        assert (await c.get(READ_ROUTE, headers=bearer(admin["token"]))).status_code == 200  # the table reloads
        text = path.read_text()
        assert admin["token"] not in text and reader["token"] not in text
        entries = {e["label"]: e for e in read_tokens(path)}
        assert set(entries) == {"admin", "reader"}
        assert entries["admin"]["token_hash"] == hash_secret(admin["token"]) and entries["admin"]["revoked_at"] is None
        assert entries["reader"]["revoked_at"] is not None
    # a fresh database fed the file: the revoked token stays revoked, the admin one lets in
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    async with leader_client(fresh, nats_server.url, SWARM_API_TOKENS_FILE=str(path)) as (_, c):
        assert (await c.get(READ_ROUTE, headers=bearer(admin["token"]))).status_code == 200
        refused = await c.get(READ_ROUTE, headers=bearer(reader["token"]))
        assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]


def test_a_file_that_holds_no_tokens_is_refused_with_its_name(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text("[1, 2]")
    with pytest.raises(TokensFileError, match=r"tokens.json is not a tokens file"):
        read_tokens(path)
    provisioned(path, new_secret(), token_hash="not-a-hash")
    with pytest.raises(TokensFileError, match="token tok-provisioned: token_hash must be a SHA-256 in hex"):
        read_tokens(path)
    assert read_tokens(tmp_path / "missing.json") == []
