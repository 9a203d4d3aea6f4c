"""Ending asyncio tasks for good, on the Python versions we support."""

from __future__ import annotations

import asyncio

RECANCEL_S = 0.1


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again while one goes on.

    One cancel is not always enough on Python 3.11: ``asyncio.wait_for`` (nats-py's fetch and requests
    use it) returns its result instead of raising when the result arrives together with the cancel,
    and a loop around it then carries on. A single cancel and a gather would then wait for ever.
    """
    pending = {t for t in tasks if t is not None}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for task in tasks:  # their outcome is taken, so none is logged as never retrieved
        if task is not None and not task.cancelled():
            task.exception()
