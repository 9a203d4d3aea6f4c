"""Run one fellow agent until it is stopped (SIGTERM, SIGINT or a stop command)."""

from __future__ import annotations

import asyncio
import signal

from core.settings import Settings
from fellow.agent import FellowAgent


def capabilities() -> list[str]:
    """What this fellow can do; features add theirs as they land."""
    return []


async def run_fellow(settings: Settings, fellow_id: str | None = None) -> None:
    agent = FellowAgent(settings, fellow_id=fellow_id, capabilities=capabilities())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stopped.set)
    await agent.run_until_stopped()
