"""The leader's own tasks (projections, serving's reactions, fellow monitor) exist while it runs and
none is left once it stopped."""

from __future__ import annotations

import asyncio

from leader.context import Leader
from tests.conftest import make_settings

OURS = ("projections-reader", "projector-", "serving-reactions", "fellow-monitor", "request-sweeper",
        "serving-reconcile")


def ours() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith(OURS) and not t.done()]


async def test_every_leader_task_is_stopped_with_the_leader(tmp_path, nats_server, sqlite_url):
    leader = Leader(make_settings(tmp_path, nats_server.url, sqlite_url))
    await leader.start()
    try:
        names = sorted(t.get_name() for t in ours())
        assert names == sorted(["projections-reader", "serving-reactions", "fellow-monitor", "request-sweeper",
                                "serving-reconcile",
                                *(f"projector-{n}" for n in leader.projections.projectors)])
    finally:
        await leader.stop()
    assert ours() == []
