"""Run one fellow agent until it is stopped (SIGTERM, SIGINT or a stop command)."""

from __future__ import annotations

import asyncio
import importlib.util
import signal

from core.settings import Settings
from events.fellow import CAP_CONCURRENT, CAP_KV_BUDGET, CAP_N_STAGE, CAP_ONE_STAGE
from fellow.agent import FellowAgent
from fellow.manager import ModelManager


def capabilities() -> list[str]:
    """What this fellow can do: serving needs the torch side installed."""
    if importlib.util.find_spec("torch") is None:
        return []
    return [CAP_ONE_STAGE, CAP_N_STAGE, CAP_CONCURRENT, CAP_KV_BUDGET]


async def run_fellow(settings: Settings, fellow_id: str | None = None) -> int:
    """0 once stopped as asked; 1 when a loop of the agent ended on its own (it stopped rather than linger)."""
    agent = FellowAgent(settings, fellow_id=fellow_id, capabilities=capabilities())
    manager = ModelManager(agent)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stopped.set)
    await agent.start()
    manager.start()
    try:
        await agent.stopped.wait()
    finally:
        await agent.stop()
    return 1 if agent.failure else 0
