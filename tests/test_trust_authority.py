"""Who may report what (leader/projectors/authority.py), for a ring: the log on a real nats-server, projected
into SQLite, then screened by a reader that starts after the placements (as after a leader restart), so
that what it did not see is read from SQL. A fellow serving a later stage of a ring cannot report for
stage 0 or another replica, nor end the ring's requests; the fellows placed there can. The same answers
come from a reader that saw the placements go by."""

from __future__ import annotations

from core.bus import publish_event
from events import subjects
from events.loads import LoadFailed, LoadPlaced, LoadRequested, ReplicaLost, StageAssignment, StageReady, StageReplaced
from events.requests import RequestAccepted, RequestFinished
from leader.projectors.authority import Authority
from tests.dbutil import projecting

RING = [StageAssignment(stage=0, fellow_id="head", layers=[0, 2]),
        StageAssignment(stage=1, fellow_id="tail", layers=[2, 4]),
        StageAssignment(stage=0, fellow_id="head2", replica=1, layers=[0, 2]),
        StageAssignment(stage=1, fellow_id="tail2", replica=1, layers=[2, 4])]


def evt_from(fellow_id: str, evt) -> str:
    return subjects.event(evt.type, fellow_id)


async def test_a_later_stage_reports_only_for_its_own_stage_and_replica(js, sqlite_url):
    async with projecting(js, sqlite_url) as (sessions, runner):
        log = (LoadRequested(load_id="L", model_id="m"), LoadPlaced(load_id="L", model_id="m", stages=RING),
               StageReplaced(load_id="L", model_id="m", stage=1, fellow_id="spare", lost_fellow_id="tail"),
               RequestAccepted(request_id="r1", model_id="m", load_id="L"))
        for evt in log:
            ack = await publish_event(js, evt)
        await runner.wait_for(ack.seq, timeout=10)
        fresh = Authority(sessions)  # started past them: SQL tells it what was placed and accepted
        cases = [
            (("head", RequestFinished(request_id="r1", model_id="m", load_id="L", fellow_id="head")), ""),
            (("head2", RequestFinished(request_id="r1", model_id="m", load_id="L", fellow_id="head2")), ""),
            (("tail", RequestFinished(request_id="r1", model_id="m", load_id="L", fellow_id="tail")),
             "fellow tail does not serve stage 0 of load 'L', which takes its requests"),
            (("spare", StageReady(load_id="L", stage=1, fellow_id="spare")), ""),
            (("tail", StageReady(load_id="L", stage=1, fellow_id="tail")), ""),  # moved away; a late report counts
            (("tail", StageReady(load_id="L", stage=0, fellow_id="tail")),
             "fellow tail does not serve stage 0 replica 0 of load 'L'"),
            (("tail2", ReplicaLost(load_id="L", model_id="m", replica=0, fellow_id="tail2")),
             "fellow tail2 does not serve replica 0 of load 'L'"),
            (("tail2", ReplicaLost(load_id="L", model_id="m", replica=1, fellow_id="tail2")), ""),
            (("tail2", LoadFailed(load_id="L", model_id="m", reason="x", fellow_id="tail2")), ""),
            (("other", LoadFailed(load_id="L", model_id="m", reason="x", fellow_id="other")),
             "fellow other does not serve load 'L'"),
        ]
        got = [(key, await fresh.refusal(evt_from(*key), key[1])) for key, _ in cases]
        assert got == cases
        following = Authority()  # the live reader's way: it saw the leader's events go by
        for evt in log:
            assert await following.refusal(subjects.event(evt.type), evt) == ""
        assert [(key, await following.refusal(evt_from(*key), key[1])) for key, _ in cases] == cases
        # the leader's own (bare subject) always count; a payload on another type's subject never does
        own = LoadFailed(load_id="L", model_id="m", reason="x")
        assert await fresh.refusal(subjects.event("load.failed"), own) == ""
        assert await fresh.refusal(subjects.event("request.finished", "head"), LoadFailed(
            load_id="L", model_id="m", reason="x", fellow_id="head")) == "a load.failed event on another type's subject"
