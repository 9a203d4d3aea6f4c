"""POST load/unload through the real app: who asked (requested_by), refused fields, conflicting reloads."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest
from nats.js.errors import NotFoundError

from events.loads import LoadRequested, UnloadRequested
from events.subjects import EVENTS_STREAM, event
from events.union import decode_event
from leader.api.deps import OPEN_CALLER
from tests.chat_fixtures import cataloged_servable
from tests.serving_fixtures import Stack, make_servable
from tests.tokens_app import TOKENS, bearer, leader_client, mint


async def last_event(js, kind: str):
    return decode_event((await js.get_last_msg(EVENTS_STREAM, event(kind))).data)


def error_of(r, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


async def test_refused_fields_and_open_mode_caller(tmp_path, nats_server, js, sqlite_url):
    root = tmp_path / "servables"
    cataloged_servable(root, "cataloged")
    async with leader_client(tmp_path, nats_server.url, sqlite_url, SWARM_SERVABLE_MODELS_ROOT=root) as (app, c):
        load = "/api/v1/models/cataloged/load"
        for quantization, says in (({"bits": 3}, "4 or 8"), ({"method": "fp4"}, "not served"),
                                   ({"method": "nf4", "group": 64}, "not group"), ("nf4", "object")):
            err = error_of(await c.post(load, json={"quantization": quantization}), 400, "quantization",
                           "invalid_value")
            assert says in err["message"], err
        for timeout in (-1, 0):
            err = error_of(await c.post(load, json={"wait": True, "timeout_s": timeout}), 400, "timeout_s")
            assert "above 0" in err["message"]
        error_of(await c.post(load, json={"replicas": 0}), 400, "replicas")
        for bad in (9, -1):
            err = error_of(await c.post(load, json={"speculative": bad}), 400, "speculative", "invalid_value")
            assert "from 0 (off) to 8" in err["message"]
        error_of(await c.post(load, json={"speculative": "four"}), 400, "speculative", "invalid_value")
        error_of(await c.post(load, json={"num_stages": "two"}), 400, "num_stages", "invalid_value")
        error_of(await c.post(load, json={"colour": "red"}), 400, None, "invalid_request")
        with pytest.raises(NotFoundError):  # nothing was requested for the refused bodies
            await js.get_last_msg(EVENTS_STREAM, event("load.requested"))

        # No fellow: placement fails, but the request was recorded with its caller, in open mode "open".
        error_of(await c.post(load, json={}), 409, None, "placement_failed")
        requested = await last_event(js, "load.requested")
        assert isinstance(requested, LoadRequested) and requested.requested_by == OPEN_CALLER == "open"


@pytest.fixture(scope="module")
def servables(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_servable(root, "tiny", layers=2, hidden=64, stages=1, seed=1)
    return root / "servables"


async def test_loads_name_the_token_and_conflicting_reloads_are_409(tmp_path, nats_server, js, servables):
    stack = await asyncio.to_thread(Stack(tmp_path, nats_server.url, servables).start)
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as c:
            admin = (await c.post(TOKENS, json={"label": "admin", "scopes": ["admin"]})).json()
            op = await mint(c, "operator", ["operate"], secret=admin["token"])
            auth = bearer(op["token"])
            loaded = (await c.post("/api/v1/models/tiny/load", json={"wait": True, "speculative": 3},
                                   headers=auth)).json()
            assert loaded["state"] == "ready", loaded
            fellow = loaded["stages"][0]["fellow_id"]
            reply = await c.post("/v1/chat/completions", headers=bearer(admin["token"]), json={
                "model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "ab ab ab ab ab ab"}]})
            assert reply.status_code == 200, reply.text
            timing = reply.json()["swarm"]["timing"]
            assert timing["spec_k"] == 3 and timing["spec_passes"] <= timing["completion_tokens"], timing
            assert {"spec_tokens", "spec_drafted", "spec_accepted"} <= set(timing)
            error_of(await c.post("/api/v1/models/tiny/load", json={"speculative": 0}, headers=auth), 409,
                     "speculative", "load_conflict")

            again = await c.post("/api/v1/models/tiny/load", json={"fellow_id": fellow}, headers=auth)
            assert again.status_code == 200 and again.json()["load_id"] == loaded["load_id"]  # same shape: same load
            for body, param in (({"num_stages": 2}, "num_stages"), ({"replicas": 2}, "replicas"),
                                ({"quantization": {"bits": 8}}, "quantization"),
                                ({"fellow_id": "elsewhere"}, "fellow_id"), ({"fellow_ids": ["a", "b"]}, "fellow_ids")):
                err = error_of(await c.post("/api/v1/models/tiny/load", json=body, headers=auth), 409, param,
                               "load_conflict")
                assert loaded["load_id"] in err["message"] and "unload it first" in err["message"]

            unloaded = await c.post("/api/v1/models/tiny/unload", headers=auth)
            assert unloaded.status_code == 200, unloaded.text

        requested = await last_event(js, "load.requested")
        unload = await last_event(js, "load.unload_requested")
        assert isinstance(requested, LoadRequested) and isinstance(unload, UnloadRequested)
        assert requested.load_id == unload.load_id == loaded["load_id"]
        assert requested.requested_by == unload.requested_by == op["id"]  # the token's id ...
        for evt in (requested, unload):
            assert op["token"] not in msgspec.json.encode(evt).decode()  # ... never its secret
        rows = await asyncio.to_thread(stack.sql, "SELECT model_id, state, requested_by, unload_requested_by "
                                       "FROM loads WHERE load_id = ?", loaded["load_id"])
        assert rows and rows[0][0] == "tiny" and rows[0][1] in ("unloading", "unloaded"), rows
        assert rows[0][2:] == (op["id"], op["id"]), rows  # the SQL audit names who loaded and who unloaded
    finally:
        await asyncio.to_thread(stack.stop)
