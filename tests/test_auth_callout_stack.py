"""The auth callout with the real leader and fellows (issue 54): a `swarm nats-auth --callout` server,
the leader answering its callout, f1 logging in by password and f2 by SWARM_NATS_CREDS. alpha is on
f1, beta on f2. f2 (the attacker, by its .creds file) is refused every way at alpha's request consumer
while alpha's request is served by f1 and its row ends `finished`; beta unloaded, f2 is disconnected
and refused its old queue; beta loaded again, f2 serves it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from core.nats_auth import LEADER_USER, AuthDir, fellow_user
from core.nats_callout import CalloutDir
from core.nats_server import EmbeddedNats
from tests.callout_fixtures import PULL, api, attempts, login, refused
from tests.processes import SwarmProcess, swarm_env, wait_until
from tests.serving_fixtures import make_servable, stop_all
from tests.trust_fixtures import Swarm, chat, load_state

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("callout-stack")
    for model_id, seed in (("alpha", 1), ("beta", 2)):
        make_servable(root / "models", model_id, layers=2, hidden=64, stages=1, seed=seed)
    auth = AuthDir(root / "auth")
    auth.ensure(["f1", "f2"])
    CalloutDir(auth).ensure()
    server = EmbeddedNats(root / "js", config=auth.config).start()
    db = f"sqlite+aiosqlite:///{root / 'swarm.db'}"
    base = dict(SWARM_SERVABLE_MODELS_ROOT=root / "models" / "servables", OMP_NUM_THREADS=1)
    leader = SwarmProcess(["leader"], swarm_env(root, server.url, db, **base, **auth.credentials(LEADER_USER).env(),
                                                SWARM_NATS_AUTH_DIR=auth.path), root / "leader.log")
    port = leader.env["SWARM_LEADER_PORT"]
    logins = {"f1": auth.credentials(fellow_user("f1")).env(),
              "f2": {"SWARM_NATS_CREDS": str(CalloutDir(auth).creds(fellow_user("f2")))}}
    fellows = [SwarmProcess(["fellow", "--id", f], swarm_env(root, server.url, db, port=port, **base, **logins[f]),
                            root / f"{f}.log") for f in ("f1", "f2")]
    try:
        leader.start()
        leader.wait_healthy()  # it answers the callout before any fellow logs in
        for f in fellows:
            f.start()
        wait_until(lambda: sum(f["status"] == "online" for f in leader.get("/api/v1/fellows").json()["data"]) == 2,
                   60, "both fellows online")
        s = Swarm(root, auth, server.url, leader, fellows)
        for model_id, fellow in (("alpha", "f1"), ("beta", "f2")):
            r = httpx.post(f"{s.url}/api/v1/models/{model_id}/load", json={"fellow_ids": [fellow], "wait": True},
                           timeout=180)
            assert r.status_code == 200 and r.json()["state"] == "ready", (r.text, fellows[1].tail())
            s.loads[model_id] = r.json()["load_id"]
        yield s
    finally:
        stop_all(leader, fellows)
        server.stop()


def creds(s: Swarm, fellow: str):
    return CalloutDir(s.auth).creds(fellow_user(fellow))


async def test_the_attacker_is_refused_and_the_victim_served(swarm):
    s, alpha, beta = swarm, swarm.loads["alpha"], swarm.loads["beta"]
    evil = await login(s.nats_url, fellow_user("f2"), creds=creds(s, "f2"))
    try:
        assert not await refused(evil, api("INFO", beta))  # its own queue: answered
        for what, (subject, payload) in attempts(alpha).items():
            assert await refused(evil, subject, payload), (what, evil.denials)
        body = chat(s, "alpha")
        assert await refused(evil, api("MSG.NEXT", alpha), PULL)
    finally:
        await evil.nc.close()
    rid = body["id"].removeprefix("chatcmpl-")
    wait_until(lambda: s.sql("SELECT status, fellow_id FROM requests WHERE request_id = '%s'" % rid)
               == [("finished", "f1")], 30, "the victim's row finished, served by f1")


async def test_the_grant_follows_an_unload_and_a_load(swarm):
    s, old = swarm, swarm.loads["beta"]
    f2 = await login(s.nats_url, fellow_user("f2"), creds=creds(s, "f2"))
    try:
        assert not await refused(f2, api("INFO", old))
        r = httpx.post(f"{s.url}/api/v1/models/beta/unload", json={"wait": True}, timeout=60)
        assert r.status_code == 200, r.text
        wait_until(lambda: load_state(s, "beta") in (None, "unloaded"), 30, "beta ended")
        await asyncio.wait_for(f2.gone.wait(), 30)  # kicked: its grant was withdrawn (a guard, not a bound)
        await asyncio.wait_for(f2.back.wait(), 30)
        assert await refused(f2, api("INFO", old), b""), f2.denials
    finally:
        await f2.nc.close()
    r = httpx.post(f"{s.url}/api/v1/models/beta/load", json={"fellow_ids": ["f2"], "wait": True}, timeout=180)
    assert r.status_code == 200 and r.json()["state"] == "ready", (r.text, s.fellows[1].tail())
    s.loads["beta"] = r.json()["load_id"]
    assert chat(s, "beta")["choices"][0]["message"]["content"]
    assert chat(s, "alpha")["choices"][0]["message"]["content"]  # f1, kicked by nothing, still serves
