"""Two leaders on one PostgreSQL (issue 18): each projects the whole log, and each event is applied
once across them. The checkpoint row is taken FOR UPDATE in the batch's transaction, so the second
leader waits for the first's commit and then skips what it applied."""

from __future__ import annotations

import asyncio
import uuid

from sqlalchemy import func, select

from core.bus import publish_event
from events.requests import RequestAccepted, RequestFinished
from leader.db.engine import make_engine, session_factory, upgrade
from leader.db.tables import Request
from leader.projectors.requests import RequestsProjector
from leader.projectors.runner import ProjectionRunner


class Counted(RequestsProjector):
    """The real requests projector, counting the events it applies."""

    def __init__(self) -> None:
        self.applied = 0

    async def apply(self, session, evt, seq) -> None:
        self.applied += 1
        await super().apply(session, evt, seq)


async def test_two_leaders_project_each_event_once(js, postgres):
    url = postgres.create_db("t" + uuid.uuid4().hex[:12])
    await upgrade(url)
    engines = [make_engine(url) for _ in range(2)]
    projectors = [Counted(), Counted()]
    runners = [ProjectionRunner(js, session_factory(e), [p]) for e, p in zip(engines, projectors)]
    try:
        events = []
        for i in range(400):
            rid = f"r{i}"
            events += [RequestAccepted(request_id=rid, model_id="m", load_id="l"),
                       RequestFinished(request_id=rid, model_id="m", load_id="l", completion_tokens=i)]
        acks = await asyncio.gather(*(publish_event(js, e) for e in events))
        last = max(a.seq for a in acks)
        await asyncio.gather(*(r.start() for r in runners))  # both take the same batches at once
        for r in runners:
            await r.wait_for(last, timeout=30)
        assert sum(p.applied for p in projectors) == len(events)
        assert all(s.failures == 0 for r in runners for s in r.states.values())
        async with session_factory(engines[0])() as session:
            done = await session.scalar(select(func.count()).select_from(Request).where(Request.status == "finished"))
            tokens = await session.scalar(select(func.sum(Request.completion_tokens)))
        assert (done, tokens) == (400, sum(range(400)))
    finally:
        for r in runners:
            await r.stop()
        for e in engines:
            await e.dispose()


async def test_a_token_either_leader_projected_is_known_to_both(js, postgres):
    """Each leader's token table follows every token event, also those the other leader applied."""
    from events.api_tokens import ApiTokenMinted
    from leader.auth.registry import TokenRegistry
    from leader.projectors.api_tokens import ApiTokensProjector

    url = postgres.create_db("t" + uuid.uuid4().hex[:12])
    await upgrade(url)
    engines = [make_engine(url) for _ in range(2)]
    runners = [ProjectionRunner(js, session_factory(e), [ApiTokensProjector()]) for e in engines]
    try:
        await asyncio.gather(*(r.start() for r in runners))
        registries = [TokenRegistry(r.sessions, r) for r in runners]
        assert [(await reg.current()).live for reg in registries] == [0, 0]
        ack = await publish_event(js, ApiTokenMinted(token_id="t1", label="ops", scopes=["read"],
                                                     token_hash="a" * 64, prefix="sk-a"))
        for r in runners:
            await r.wait_for(ack.seq, timeout=10)
        assert [sorted((await reg.current()).by_id) for reg in registries] == [["t1"], ["t1"]]
    finally:
        for r in runners:
            await r.stop()
        for e in engines:
            await e.dispose()
