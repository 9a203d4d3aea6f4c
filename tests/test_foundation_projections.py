"""Projector framework against real nats-server and real SQLite / PostgreSQL."""

from __future__ import annotations

import pytest

from core.bus import publish_event
from events.fellow import FellowJoined, FellowLost, Gpu
from events.loads import LoadPlaced, LoadRequested, StageAssignment, StageReady
from events.requests import RequestAccepted, RequestFailed, RequestFinished
from leader.db.engine import make_engine, session_factory, upgrade
from leader.db.tables import Fellow, Load, LoadStage, ProjectorCheckpoint, Request
from leader.projectors.all import all_projectors
from leader.projectors.batch import apply_batch, decode_batch
from leader.projectors.replay import replay
from leader.projectors.runner import ProjectionRunner
from tests.dbutil import dump

TABLES = (Fellow, Load, LoadStage, Request)


def story(n: int) -> list:
    """A mix of events touching every projection, n requests long."""
    evts = [
        FellowJoined(fellow_id="f1", hostname="h1", gpus=[Gpu(index=0, name="T4", total_bytes=16 << 30,
                                                             free_bytes=15 << 30)], capabilities=["serve-one-stage"]),
        LoadRequested(load_id="L1", model_id="m"),
        LoadPlaced(load_id="L1", model_id="m", stages=[StageAssignment(stage=0, fellow_id="f1", layers=(0, 4))]),
        StageReady(load_id="L1", stage=0, fellow_id="f1", kv_tokens=4096),
    ]
    for i in range(n):
        evts.append(RequestAccepted(request_id=f"r{i}", model_id="m", load_id="L1"))
        if i % 3 == 2:
            evts.append(RequestFailed(request_id=f"r{i}", model_id="m", load_id="L1", code="context_too_long"))
        else:
            evts.append(RequestFinished(request_id=f"r{i}", model_id="m", load_id="L1", completion_tokens=i,
                                        timing={"prefill_ms": 1.5}))
    evts.append(FellowLost(fellow_id="f1", last_seen=1.0))
    return evts


@pytest.fixture
async def sessions(database_url):
    await upgrade(database_url)
    engine = make_engine(database_url)
    yield session_factory(engine)
    await engine.dispose()


async def test_projections_follow_the_log_and_replay_identically(js, sessions):
    runner = ProjectionRunner(js, sessions, all_projectors())
    await runner.start()
    try:
        evts = story(20)
        last = None
        for e in evts:
            last = await publish_event(js, e)
        await runner.wait_for(last.seq, timeout=20)
        live = await dump(sessions, *TABLES)
        assert len(live["requests"]) == 20
        assert sum(r[3] == "too_long" for r in live["requests"]) == 6  # status column
        assert live["fellows"][0][3] == "lost"
        assert live["load_stages"][0][8] == 4096  # kv_tokens (after load_id, stage, replica, fellow_id, ...)
        for p in all_projectors():
            assert await replay(js, sessions, p) == last.seq
        assert await dump(sessions, *TABLES) == live
        # A retried publish of the same event is dropped by JetStream: no duplicate row.
        again = await publish_event(js, evts[5])
        assert again.duplicate
    finally:
        await runner.stop()


async def test_redelivered_events_are_no_ops(js, sessions):
    acks = [await publish_event(js, e) for e in story(3)]
    sub = await js.pull_subscribe("swarm.evt.>", stream="SWARM_EVENTS")
    msgs = await sub.fetch(len(acks), timeout=5)
    projector = next(p for p in all_projectors() if p.name == "requests")
    async with sessions() as s, s.begin():
        assert await apply_batch(s, projector, decode_batch(msgs)) == acks[-1].seq
    first = await dump(sessions, Request)
    async with sessions() as s, s.begin():  # the same batch again, as after a crash before ack
        assert await apply_batch(s, projector, decode_batch(msgs)) == acks[-1].seq
    assert await dump(sessions, Request) == first
    async with sessions() as s:
        assert (await s.get(ProjectorCheckpoint, "requests")).seq == acks[-1].seq


async def test_a_request_that_ends_within_the_linger_is_written_in_one_transaction(js, database_url):
    """The requests projection gathers what comes within its linger: a request's accepted and finished
    events, read in two batches, make one commit; other projections do not wait for it."""
    from sqlalchemy import event

    from leader.projectors.requests import RequestsProjector

    class Lingering(RequestsProjector):
        linger_s = 1.0  # long enough for a loaded machine; the served one lingers RequestsProjector's

    assert RequestsProjector.linger_s > 0
    await upgrade(database_url)
    engine = make_engine(database_url)
    commits = []
    event.listen(engine.sync_engine, "commit", lambda conn: commits.append(conn))
    runner = ProjectionRunner(js, session_factory(engine),
                              [p for p in all_projectors() if p.name != "requests"] + [Lingering()])
    await runner.start()
    before = len(commits)
    try:
        accepted = await publish_event(js, RequestAccepted(request_id="r1", model_id="m", load_id="L1"))
        await runner.wait_for(accepted.seq, ["loads"], timeout=5)  # the reader handed its batch on
        assert runner.positions["requests"] < accepted.seq  # ... and the requests projection lingers
        finished = await publish_event(js, RequestFinished(request_id="r1", model_id="m", load_id="L1",
                                                           completion_tokens=3))
        await runner.wait_for(finished.seq, ["requests"], timeout=5)
        assert len(commits) - before == 1
        async with session_factory(engine)() as s:
            row = await s.get(Request, "r1")
        assert (row.status, row.completion_tokens) == ("finished", 3)
    finally:
        await runner.stop()
        await engine.dispose()


async def test_wait_for_times_out_with_the_lag_named(js, sessions):
    from leader.projectors.runner import ProjectionLagging

    runner = ProjectionRunner(js, sessions, all_projectors())
    await runner.start()
    try:
        with pytest.raises(ProjectionLagging, match="have not reached sequence 999"):
            await runner.wait_for(999, ["fellows"], timeout=0.3)
    finally:
        await runner.stop()


async def test_migration_0002_rebuilds_load_stages_from_the_log(js, database_url):
    """0002 re-keys load_stages by replica: the loads projection is dropped and replayed from the
    log into the new shape; requests keep their rows and gain an empty fellow_id."""
    import sqlalchemy as sa

    await upgrade(database_url, "0001")
    engine = make_engine(database_url)
    sessions = session_factory(engine)
    try:
        last = None
        for e in story(3):
            last = await publish_event(js, e)
        async with sessions() as session:  # what 0001's projectors left: a load, its stage, checkpoints
            await session.execute(sa.text("INSERT INTO loads (load_id, model_id, state, requested_at, reason) "
                                          "VALUES ('L1', 'm', 'ready', 0, '')"))
            await session.execute(sa.text(
                "INSERT INTO load_stages (load_id, stage, fellow_id, layer_first, layer_last, state, pid, kv_tokens, "
                "kv_tokens_planned, max_in_flight, vram_bytes) VALUES ('L1', 0, 'f1', 0, 4, 'ready', 0, 1, 0, 1, 0)"))
            await session.execute(sa.text("INSERT INTO requests (request_id, model_id, load_id, status, stream, "
                                          "max_tokens, token_id, accepted_at, prompt_tokens, completion_tokens, "
                                          "finish_reason, duration_s, tokens_per_s, error_code, error_message) "
                                          "VALUES ('old', 'm', 'L1', 'finished', false, 0, '', 0, 0, 0, '', 0, 0, "
                                          "'', '')"))
            await session.execute(sa.text("INSERT INTO projector_checkpoints (name, seq) VALUES ('loads', :s), "
                                          "('requests', :s)"), {"s": last.seq})
            await session.commit()
        await upgrade(database_url)
        async with sessions() as session:
            assert await session.get(ProjectorCheckpoint, "loads") is None
            assert (await session.get(ProjectorCheckpoint, "requests")).seq == last.seq
            assert (await session.get(Request, "old")).fellow_id == ""
            assert await session.get(Load, "L1") is None
        runner = ProjectionRunner(js, sessions, all_projectors())
        await runner.start()
        try:
            await runner.wait_for(last.seq, timeout=20)
        finally:
            await runner.stop()
        async with sessions() as session:
            stage = await session.get(LoadStage, ("L1", 0, 0))
            assert stage is not None and stage.kv_tokens == 4096 and stage.fellow_id == "f1"
            assert (await session.get(Load, "L1")).state == "loading"  # placed, its stage ready: as on the log
    finally:
        await engine.dispose()


async def test_migration_0004_fills_who_loaded_and_unloaded_from_the_log(js, database_url):
    """0004 adds loads.requested_by and unload_requested_by; the loads projection replays the log to fill them."""
    import sqlalchemy as sa

    from events.loads import UnloadRequested

    await upgrade(database_url, "0003")
    engine = make_engine(database_url)
    sessions = session_factory(engine)
    try:
        await publish_event(js, LoadRequested(load_id="L9", model_id="m", requested_by="tok-a"))
        last = await publish_event(js, UnloadRequested(load_id="L9", model_id="m", requested_by="tok-b"))
        async with sessions() as session:  # what 0003's projector left: the row without its askers
            await session.execute(sa.text("INSERT INTO loads (load_id, model_id, state, requested_at, reason) "
                                          "VALUES ('L9', 'm', 'unloading', 0, '')"))
            await session.execute(sa.text("INSERT INTO projector_checkpoints (name, seq) VALUES ('loads', :s)"),
                                  {"s": last.seq})
            await session.commit()
        await upgrade(database_url)
        runner = ProjectionRunner(js, sessions, all_projectors())
        await runner.start()
        try:
            await runner.wait_for(last.seq, ["loads"], timeout=20)
        finally:
            await runner.stop()
        async with sessions() as session:
            load = await session.get(Load, "L9")
            assert (load.state, load.requested_by, load.unload_requested_by) == ("unloading", "tok-a", "tok-b")
    finally:
        await engine.dispose()
