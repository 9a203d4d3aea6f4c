"""Fellows projection: who joined, with what hardware and capabilities, and who was lost."""

from __future__ import annotations

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from events.base import Event
from events.fellow import FellowJoined, FellowLost
from leader.db.tables import Fellow
from leader.projectors.projector import Projector


class FellowsProjector(Projector):
    name = "fellows"
    tables = (Fellow,)
    handles = (FellowJoined, FellowLost)

    async def apply(self, session: AsyncSession, evt: Event, seq: int) -> None:
        match evt:
            case FellowJoined():
                row = await session.get(Fellow, evt.fellow_id)
                if row is None:
                    row = Fellow(fellow_id=evt.fellow_id, joins=0)
                    session.add(row)
                # each leader announces the join it saw (two leaders: two events); one start online is one join
                again = row.status == "online" and row.started_at == evt.started_at and row.joins
                row.hostname = evt.hostname
                row.version = evt.version
                row.status = "online"
                row.gpus = msgspec.to_builtins(evt.gpus)
                row.memory_total_bytes = evt.memory_total_bytes
                row.capabilities = list(evt.capabilities)
                row.started_at = evt.started_at
                row.joined_at = evt.at
                row.lost_at = None
                row.last_seen = evt.at
                row.joins = (row.joins or 0) + (0 if again else 1)
            case FellowLost():
                row = await session.get(Fellow, evt.fellow_id)
                if row is not None:
                    row.status = "lost"
                    row.lost_at = evt.at
                    row.last_seen = evt.last_seen
