"""Who may report what: a fellow's event counts only for the loads placed on it and their requests.

NATS permissions let a fellow publish events only on ``swarm.evt.<type>.<its id>`` (core.nats_auth), so
the subject says who sent one; the leader's go on ``swarm.evt.<type>``. An event from a fellow must name
that fellow, be about a load the leader placed on it (LoadPlaced, StageReplaced), about a stage or
replica of it placed there (a ring's later stage cannot report for stage 0), and, for a request's end,
about a request of that load (RequestAccepted) reported by a fellow of its stage 0, which takes them.
Anything else becomes a dead letter with the reason, and no projection, reaction or metric sees it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.nats_auth import FELLOW_EVENTS
from events.base import Event
from events.loads import LoadPlaced, ReplicaLost, StageReady, StageReplaced
from events.requests import RequestAccepted, RequestFailed, RequestFinished
from events.subjects import event_sender
from leader.db.tables import LoadStage, Request
from leader.projectors.batch import Entry

log = logging.getLogger(__name__)

REQUESTS_KEPT = 100_000  # requests whose load is remembered; an older one is looked up in SQL


class Authority:
    """Follows the log in order and screens each event by its subject. What was placed or accepted before
    the position it started at is read from the SQL projections on a miss (`sessions`)."""

    def __init__(self, sessions: async_sessionmaker | None = None):
        self.sessions = sessions
        # load_id -> fellow -> every (stage, replica) of the load ever placed on it
        self.placed: dict[str, dict[str, set[tuple[int, int]]]] = {}
        self.load_of: OrderedDict[str, str] = OrderedDict()  # request_id -> its load, the latest REQUESTS_KEPT

    async def screen(self, batch: list[Entry]) -> list[Entry]:
        """The batch with each event that its sender may not publish turned into a dead letter."""
        out = []
        for e in batch:
            if e.event is not None and (reason := await self.refusal(e.subject, e.event)):
                log.warning("refused %s at stream sequence %d: %s", e.subject, e.seq, reason)
                e = Entry(e.seq, e.subject, None, "refused: " + reason)
            out.append(e)
        return out

    async def refusal(self, subject: str, evt: Event) -> str:
        """Why `evt` on `subject` does not count ("" when it does)."""
        sender = event_sender(subject, evt.type)
        if sender is None:
            return f"a {evt.type} event on another type's subject"
        if not sender:  # the leader's (or, without NATS auth, anyone's)
            self._learn(evt)
            return ""
        if evt.type not in FELLOW_EVENTS:
            return f"fellow {sender} may not report {evt.type}"
        named = getattr(evt, "fellow_id", "")
        if named != sender:
            return f"fellow {sender} reported for fellow {named!r}"
        load_id = getattr(evt, "load_id", "")
        stages = (await self._placements(load_id)).get(sender)
        if not stages:
            return f"fellow {sender} does not serve load {load_id!r}"
        if isinstance(evt, (RequestFinished, RequestFailed)):
            if not any(stage == 0 for stage, _ in stages):
                return f"fellow {sender} does not serve stage 0 of load {load_id!r}, which takes its requests"
            owner = await self._load_of(evt.request_id)
            if owner is not None and owner != load_id:
                return f"request {evt.request_id} is of load {owner!r}, not {load_id!r} (fellow {sender})"
        elif isinstance(evt, StageReady) and (evt.stage, evt.replica) not in stages:
            return f"fellow {sender} does not serve stage {evt.stage} replica {evt.replica} of load {load_id!r}"
        elif isinstance(evt, ReplicaLost) and all(replica != evt.replica for _, replica in stages):
            return f"fellow {sender} does not serve replica {evt.replica} of load {load_id!r}"
        return ""

    def _learn(self, evt: Event) -> None:
        if isinstance(evt, LoadPlaced):
            for a in evt.stages:
                self._place(evt.load_id, a.fellow_id, a.stage, a.replica)
        elif isinstance(evt, StageReplaced):
            self._place(evt.load_id, evt.fellow_id, evt.stage, evt.replica)
        elif isinstance(evt, RequestAccepted):
            self.load_of[evt.request_id] = evt.load_id
            if len(self.load_of) > REQUESTS_KEPT:
                self.load_of.popitem(last=False)

    def _place(self, load_id: str, fellow_id: str, stage: int, replica: int) -> None:
        self.placed.setdefault(load_id, {}).setdefault(fellow_id, set()).add((stage, replica))

    async def _placements(self, load_id: str) -> dict[str, set[tuple[int, int]]]:
        if load_id not in self.placed and self.sessions is not None:
            async with self.sessions() as session:
                rows = (await session.execute(select(LoadStage).where(LoadStage.load_id == load_id))).scalars().all()
            for row in rows:  # its fellow now, and those it was moved from (whose late reports still count)
                for fellow_id in (row.fellow_id, *(r.get("from", "") for r in row.replaced or ())):
                    self._place(load_id, fellow_id, row.stage, row.replica or 0)
        return self.placed.get(load_id, {})

    async def _load_of(self, request_id: str) -> str | None:
        """The load a request was accepted for; None when none is known (a request the log has not
        accepted: no row it could change)."""
        load_id = self.load_of.get(request_id)
        if load_id is None and self.sessions is not None:
            async with self.sessions() as session:
                row = await session.get(Request, request_id)
            load_id = row.load_id if row is not None else None
        return load_id
