"""The compromised-fellow suites' stack (issue 38): a real nats-server with a user per role whose request
grants the leader manages (as `swarm up`'s), a leader, fellows f1 and f2, "alpha" placed on f1 and "beta"
on f2; and what the tests read of it (SQL rows, dead letters, a login as any user)."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import httpx

from core.bus import connect
from core.nats_auth import AuthDir
from core.nats_server import EmbeddedNats
from tests.processes import SwarmProcess
from tests.serving_fixtures import make_servable, secured_processes, stop_all

PROMPT = [{"role": "user", "content": "Tell me about lists."}]


class Swarm:
    def __init__(self, root, auth: AuthDir, nats_url: str, leader: SwarmProcess, fellows: list[SwarmProcess]):
        self.root, self.auth, self.nats_url, self.leader, self.fellows = root, auth, nats_url, leader, fellows
        self.url = leader.base_url
        self.loads: dict[str, str] = {}

    def sql(self, query: str) -> list[tuple]:
        import sqlite3

        db = sqlite3.connect(self.root / "swarm.db")
        try:
            return db.execute(query).fetchall()
        finally:
            db.close()

    def dead_letters(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for subject, reason in self.sql("SELECT subject, reason FROM dead_letters ORDER BY seq"):
            out.setdefault(subject, []).append(reason)
        return out

    async def login(self, user: str):
        """A connection as `user`; the permission errors NATS sends it collect in `.denials`, and set
        the event `.denied`."""
        errors: list[str] = []
        denied = asyncio.Event()

        async def on_error(exc):
            errors.append(str(exc))
            denied.set()

        nc = await connect(self.nats_url, name=user, credentials=self.auth.credentials(user), error_cb=on_error)
        nc.denials, nc.denied = errors, denied
        return nc


@contextmanager
def two_loads(root):
    """The stack, alpha ready on f1 and beta on f2; stopped after the block."""
    for model_id, seed in (("alpha", 1), ("beta", 2)):
        make_servable(root / "models", model_id, layers=2, hidden=64, stages=1, seed=seed)
    auth = AuthDir(root / "auth")
    auth.ensure(["f1", "f2"], per_load=True)
    server = EmbeddedNats(root / "js", config=auth.config, pid_file=auth.pid_file).start()
    leader, fellows = None, []
    try:
        leader, fellows = secured_processes(root, auth, server.url, root / "models" / "servables", ["f1", "f2"],
                                            manages_nats=True)
        s = Swarm(root, auth, server.url, leader, fellows)
        for model_id, fellow in (("alpha", "f1"), ("beta", "f2")):
            r = httpx.post(f"{s.url}/api/v1/models/{model_id}/load", json={"fellow_ids": [fellow], "wait": True},
                           timeout=180)
            assert r.status_code == 200 and r.json()["state"] == "ready", (r.text, fellows[0].tail())
            s.loads[model_id] = r.json()["load_id"]
        yield s
    finally:
        if leader is not None:
            stop_all(leader, fellows)
        server.stop()


def chat(s: Swarm, model: str, **body) -> dict:
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": PROMPT, "temperature": 0, "max_tokens": 12, **body})
    assert r.status_code == 200, r.text
    return r.json()


def load_state(s: Swarm, model: str) -> str:
    return httpx.get(f"{s.url}/api/v1/models/{model}", timeout=10).json()["load_state"]
