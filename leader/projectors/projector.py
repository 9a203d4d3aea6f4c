"""The projector contract: apply one event to owned tables inside the caller's transaction."""

from __future__ import annotations

from typing import ClassVar

from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncSession

from events.base import Event


class Projector:
    """Subclasses name themselves, list the tables they own, and implement `apply`.

    `apply` must derive every value from the event (its `at`, never the wall clock), so a
    replay from sequence 1 rebuilds identical rows.
    """

    name: ClassVar[str]
    tables: ClassVar[tuple[type, ...]]
    handles: ClassVar[tuple[type, ...]] = (Event,)  # the event types `apply` acts on
    # Seconds the runner gathers batches for one transaction once one has come (0: each at once).
    linger_s: ClassVar[float] = 0.0

    def wants(self, evt: Event | None) -> bool:
        return evt is not None and isinstance(evt, self.handles)

    async def apply(self, session: AsyncSession, evt: Event, seq: int) -> None:
        raise NotImplementedError

    def committed(self, evt: Event, seq: int) -> None:
        """Told after the commit of each wanted event this leader had not seen, whether it applied it
        or another leader on the same database did (then `apply` was skipped). Default: nothing."""

    async def clear(self, session: AsyncSession) -> None:
        for table in self.tables:
            await session.execute(delete(table))
