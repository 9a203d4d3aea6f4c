"""The request sweeper's rules (issue 21 item 5), on a real leader, bus and SQLite, with its clock set."""

from __future__ import annotations

import time

import msgspec

from events import subjects
from events.frames import DoneFrame, TokenFrame
from events.loads import LoadRequested
from events.requests import RequestAccepted
from leader.context import Leader
from leader.db.tables import Request
from tests.conftest import make_settings


async def outcomes(leader: Leader, *rids: str) -> dict[str, tuple]:
    info = await leader.js.stream_info(subjects.EVENTS_STREAM)
    await leader.projections.wait_for(info.state.last_seq, ["requests"], timeout=10)
    async with leader.sessions() as session:
        rows = [await session.get(Request, rid) for rid in rids]
    return {r.request_id: (r.status, r.error_code, r.completion_tokens) for r in rows}


async def test_the_sweeper_ends_what_can_no_longer_finish_and_nothing_else(tmp_path, nats_server, sqlite_url):
    leader = Leader(make_settings(tmp_path, nats_server.url, sqlite_url))
    await leader.start()
    try:
        sweeper = leader.serving.sweeper
        await sweeper.stop()  # driven by hand below, at chosen times
        await leader.publish(LoadRequested(load_id="ld-live", model_id="m"), wait=["loads"])
        now = time.time()
        long_ago = now - sweeper.quiet_s - 10
        accepted = {"done-gone": ("ld-gone", now), "young-gone": ("ld-gone", now), "quiet-gone": ("ld-gone", long_ago),
                    "quiet-live": ("ld-live", long_ago), "talking-live": ("ld-live", long_ago)}
        for rid, (load_id, at) in accepted.items():
            await leader.publish(RequestAccepted(request_id=rid, model_id="m", load_id=load_id, at=at),
                                 wait=["requests"])
        frames = [DoneFrame(request_id="done-gone", seq=0, completion_tokens=3, prompt_tokens=2),
                  TokenFrame(request_id="talking-live", seq=0, texts=["hi"])]
        for frame in frames:
            await leader.js.publish(subjects.tokens(frame.request_id), msgspec.json.encode(frame))
        sweeper.started_at = 0.0  # every row's gateway is this leader's

        sweeper.clock = lambda: now
        # the ended load's request with a final frame, and the two silent for the frame timeout; not the
        # young one (its gateway still waits), nor the one whose last frame came just now
        assert await sweeper.sweep() == 3
        assert (await outcomes(leader, "young-gone", "talking-live")) == {
            "young-gone": ("accepted", "", 0), "talking-live": ("accepted", "", 0)}
        sweeper.clock = lambda: time.time() + sweeper.quiet_s + 1
        assert await sweeper.sweep() == 2  # now those two are silent as long
        assert await outcomes(leader, *accepted) == {
            "done-gone": ("finished", "", 3), "quiet-gone": ("failed", "model_not_loaded", 0),
            "quiet-live": ("failed", "timeout", 0), "talking-live": ("failed", "timeout", 0),
            "young-gone": ("failed", "model_not_loaded", 0)}
    finally:
        await leader.stop()
