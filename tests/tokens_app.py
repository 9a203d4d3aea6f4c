"""A real leader app (lifespan, nats-server, SQL) behind Litestar's async test client, for token tests."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from litestar.testing import AsyncTestClient

from leader.app import create_app
from leader.context import Leader
from tests.conftest import make_settings

TOKENS = "/api/v1/api-tokens"
READ_ROUTE = "/api/v1/fellows"  # read scope; a route every leader has


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


@asynccontextmanager
async def leader_client(tmp_path, nats_url: str, database_url: str | None = None, clock=None,
                        prune_interval_s: float = 600.0, **env):
    settings = make_settings(tmp_path, nats_url, database_url, **env)
    leader = Leader(settings, clock=clock or time.time, prune_interval_s=prune_interval_s)
    app = create_app(settings, leader)
    async with AsyncTestClient(app) as client:
        yield app, client


async def mint(client, label: str, scopes: list[str], secret: str | None = None, **extra) -> dict:
    resp = await client.post(TOKENS, json={"label": label, "scopes": scopes, **extra},
                             headers=bearer(secret) if secret else {})
    assert resp.status_code == 201, resp.text
    return resp.json()


async def on_app(client, fn, *args):
    """Run `fn(*args)` on the app's own event loop (the test client serves it from another thread)."""
    return await asyncio.to_thread(client.blocking_portal.call, fn, *args)
