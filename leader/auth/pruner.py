"""Publishes `api token pruned` for every token that expired more than 31 days ago."""

from __future__ import annotations

import asyncio
import logging

from core.tasks import cancel_and_wait
from events.api_tokens import ApiTokenPruned
from leader.auth.registry import PROJECTION

log = logging.getLogger(__name__)

PRUNE_AFTER_S = 31 * 24 * 3600.0


class TokenPruner:
    """A background sweep on the service's clock.

    An expired token keeps auth enforced (an idle OAuth connector's access token must not reopen
    the leader); pruning it 31 days on is what lets a leader whose last token lapsed return to open
    first-run mode. The event id is derived from the token, so two leaders pruning at once publish
    one event.
    """

    def __init__(self, service, interval_s: float):
        self.service = service
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="api-token-pruner")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:  # the bus or database is down; the next sweep retries
                log.exception("API token prune sweep failed")
            await asyncio.sleep(self.interval_s)

    async def sweep(self) -> list[str]:
        """Prune what is due now; returns the pruned token ids."""
        now = self.service.clock()
        due = [r for r in (await self.service.table()).records
               if r.expires_at is not None and now >= r.expires_at + PRUNE_AFTER_S]
        for record in due:
            evt = ApiTokenPruned(id=f"pruned-{record.token_id}", token_id=record.token_id,
                                 expired_at=record.expires_at, at=now)
            await self.service.publish(evt, wait=[PROJECTION])
            log.info("pruned API token %s (%s), expired 31+ days ago", record.token_id, record.prefix)
        return [r.token_id for r in due]
