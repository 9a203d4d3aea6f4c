"""The reply checks projection: a row per check, a trust row per fellow, and the tally placement reads.

``Tally`` is this leader's memory of the same facts, kept from every committed event (whichever leader
applied it) and filled from the tables at start (``load``): what the verifier drains by, and the set
``leader.placement.DRAINED`` that placement leaves out.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from events.base import Event
from events.verify import FellowDrained, ReplyChecked
from leader import placement
from leader.projectors.projector import Projector
from leader.verify.tables import FellowTrust, ReplyCheck


class Tally:
    """Per fellow: its replies' checks and, per scorer, the failed ones. A drained scorer's verdicts stop
    counting, those before its drain too: a liar's scores must not help drain an honest fellow."""

    def __init__(self) -> None:
        self.checks: dict[str, int] = {}
        self.fails: dict[str, dict[str, int]] = {}  # fellow -> scorer -> failed checks of its replies
        self._seen: set[str] = set()  # request ids counted (a check applied twice counts once)

    def standing(self, fellow_id: str) -> tuple[int, list[str]]:
        """(failed checks that count, the scorers behind them)."""
        counted = {k: n for k, n in self.fails.get(fellow_id, {}).items() if k not in placement.DRAINED}
        return sum(counted.values()), sorted(counted)

    def note(self, evt: Event) -> None:
        if isinstance(evt, ReplyChecked) and evt.request_id not in self._seen:
            self._count(evt.request_id, evt.fellow_id, evt.scorer_id, evt.passed)
        elif isinstance(evt, FellowDrained):
            placement.DRAINED.add(evt.fellow_id)

    def _count(self, request_id: str, fellow_id: str, scorer_id: str, passed: bool) -> None:
        self._seen.add(request_id)
        self.checks[fellow_id] = self.checks.get(fellow_id, 0) + 1
        if not passed:
            by = self.fails.setdefault(fellow_id, {})
            by[scorer_id] = by.get(scorer_id, 0) + 1

    async def load(self, sessions: async_sessionmaker) -> None:
        async with sessions() as session:
            placement.DRAINED.update(await session.scalars(
                select(FellowTrust.fellow_id).where(FellowTrust.drained_at.is_not(None))))
            rows = (await session.execute(select(ReplyCheck.request_id, ReplyCheck.fellow_id, ReplyCheck.scorer_id,
                                                 ReplyCheck.passed))).all()
        for row in rows:
            if row[0] not in self._seen:
                self._count(*row)


class ChecksProjector(Projector):
    name = "reply_checks"
    tables = (ReplyCheck, FellowTrust)
    handles = (ReplyChecked, FellowDrained)

    def __init__(self, tally: Tally | None = None) -> None:
        self.tally = tally or Tally()

    async def apply(self, session: AsyncSession, evt: Event, seq: int) -> None:
        match evt:
            case ReplyChecked():
                if await session.get(ReplyCheck, evt.request_id) is not None:
                    return
                session.add(ReplyCheck(request_id=evt.request_id, model_id=evt.model_id, load_id=evt.load_id,
                                       fellow_id=evt.fellow_id, scorer_id=evt.scorer_id, mode=evt.mode,
                                       passed=evt.passed, tokens=evt.tokens, bad=evt.bad, first_bad=evt.first_bad,
                                       worst=evt.worst, checked_at=evt.at))
                row = await self._trust(session, evt.fellow_id)
                row.checks += 1
                if not evt.passed:
                    row.failed += 1
                    row.failed_by = sorted({*(row.failed_by or []), evt.scorer_id})
            case FellowDrained():
                row = await self._trust(session, evt.fellow_id)
                if row.drained_at is None:
                    row.drained_at, row.reason = evt.at, evt.reason[:255]

    async def _trust(self, session: AsyncSession, fellow_id: str) -> FellowTrust:
        row = await session.get(FellowTrust, fellow_id)
        if row is None:
            row = FellowTrust(fellow_id=fellow_id, checks=0, failed=0, failed_by=[], reason="")
            session.add(row)
        return row

    def committed(self, evt: Event, seq: int) -> None:
        self.tally.note(evt)
