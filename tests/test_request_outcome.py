"""A request ends once: the first final event sets its row, a later one changes nothing (issue 21 item 6)."""

from __future__ import annotations

from core.bus import publish_event
from events.requests import RequestAccepted, RequestFailed, RequestFinished, request_failed_id, request_finished_id
from leader.db.engine import make_engine, session_factory, upgrade
from leader.db.tables import Request
from leader.projectors.all import all_projectors
from leader.projectors.runner import ProjectionRunner


def failed(rid: str) -> RequestFailed:
    return RequestFailed(id=request_failed_id(rid), request_id=rid, model_id="m", load_id="L1", code="load_failed",
                         message="the fellow was lost")


def finished(rid: str) -> RequestFinished:
    return RequestFinished(id=request_finished_id(rid), request_id=rid, model_id="m", load_id="L1", prompt_tokens=5,
                           completion_tokens=9, finish_reason="length", fellow_id="f1")


async def test_the_first_final_event_wins_and_fields_never_mix(js, sqlite_url):
    await upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    sessions = session_factory(engine)
    runner = ProjectionRunner(js, sessions, all_projectors())
    await runner.start()
    try:
        story = []
        for rid in ("failed-first", "finished-first", "no-accepted"):
            if rid != "no-accepted":
                story.append(RequestAccepted(request_id=rid, model_id="m", load_id="L1"))
        story += [failed("failed-first"), finished("failed-first"),
                  finished("finished-first"), failed("finished-first"),
                  failed("no-accepted"), finished("no-accepted")]
        for evt in story:
            last = await publish_event(js, evt)
        await runner.wait_for(last.seq, timeout=20)
        async with sessions() as session:
            rows = {rid: await session.get(Request, rid) for rid in ("failed-first", "finished-first", "no-accepted")}
        for rid in ("failed-first", "no-accepted"):
            row = rows[rid]
            assert (row.status, row.error_code, row.finish_reason, row.completion_tokens) == \
                ("failed", "load_failed", "", 0), rid
        row = rows["finished-first"]
        assert (row.status, row.error_code, row.error_message, row.finish_reason, row.completion_tokens) == \
            ("finished", "", "", "length", 9)
    finally:
        await runner.stop()
        await engine.dispose()
