"""How long a request waits for a model that heals (leader.serving.heal), on a real SQLite database."""

from __future__ import annotations

import asyncio
import time

import pytest

from leader.db.engine import make_engine, session_factory, upgrade
from leader.db.tables import Load
from leader.errors import ApiError
from leader.serving.heal import HEALS_MAX, Healer


class View:
    loads: dict = {}


@pytest.fixture
async def sessions(sqlite_url):
    await upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    yield session_factory(engine)
    await engine.dispose()


async def add_load(sessions, load_id: str, **row) -> None:
    async with sessions() as session, session.begin():
        session.add(Load(load_id=load_id, model_id="m", requested_at=time.time(), **row))


async def test_a_request_waits_for_a_failed_load_that_heals_then_gets_a_clear_error(sessions):
    healer = Healer(sessions, None, View(), asyncio.Condition())
    assert await healer.wait("m", bound_s=0) is None  # never loaded: not loaded, at once
    await add_load(sessions, "ld-1", state="failed", ready_at=time.time(), ended_at=time.time(), reason="killed")
    with pytest.raises(ApiError) as err:  # it had served and just failed: its heal is coming
        await healer.wait("m", bound_s=0)
    assert err.value.status_code == 503 and err.value.code == "model_loading", err.value
    assert "healing" in str(err.value)
    healer._heals["m"] = [time.monotonic()] * HEALS_MAX  # healed too often: nothing is coming
    assert await healer.wait("m", bound_s=0) is None


async def test_a_load_that_never_served_or_was_unloaded_is_not_waited_for(sessions):
    healer = Healer(sessions, None, View(), asyncio.Condition())
    await add_load(sessions, "ld-1", state="failed", ended_at=time.time(), reason="placement failed")
    assert await healer.wait("m", bound_s=0) is None
    await add_load(sessions, "ld-2", state="failed", ready_at=time.time(), ended_at=time.time(),
                   unload_requested_by="tok")
    assert await healer.wait("m", bound_s=0) is None
