"""Run one fellow agent until it is stopped (SIGTERM, SIGINT or a stop command)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import signal
import sys

from core.settings import Settings
from core.tasks import cancel_and_wait
from events.fellow import CAP_CONCURRENT, CAP_DRAFT_MODEL, CAP_KV_BUDGET, CAP_N_STAGE, CAP_ONE_STAGE, CAP_SPECULATIVE
from fellow.agent import FellowAgent
from fellow.manager import ModelManager

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 120.0


def capabilities() -> list[str]:
    """What this fellow can do: serving needs the torch side installed."""
    if importlib.util.find_spec("torch") is None:
        return []
    return [CAP_ONE_STAGE, CAP_N_STAGE, CAP_CONCURRENT, CAP_KV_BUDGET, CAP_SPECULATIVE, CAP_DRAFT_MODEL]


async def probed_capabilities(fourbit_rows: str = "auto") -> list[str]:
    """What ``python -m fellow.runtime.probe`` finds runs here (quantized kernels, and 4-bit row limits on
    CUDA unless ``fourbit_rows``, SWARM_SERVE_4BIT_ROWS, is off); [] when it fails."""
    if importlib.util.find_spec("torch") is None:
        return []
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fellow.runtime.probe",
                                                "--4bit-rows", fourbit_rows,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT_S)
    except asyncio.CancelledError:  # the fellow stops first
        proc.kill()
        raise
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        log.warning("the kernel probe took over %.0f s; no quantized capability declared", PROBE_TIMEOUT_S)
        return []
    lines = out.decode().strip().splitlines()
    try:
        found = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except json.JSONDecodeError:
        found = None
    if not isinstance(found, list):
        log.warning("the kernel probe failed (exit %s): %s", proc.returncode, err.decode().strip()[-300:])
        return []
    for line in err.decode().strip().splitlines():
        log.info("kernel probe: %s", line)
    return [str(c) for c in found]


async def probe_first(agent: FellowAgent) -> bool:
    """Add what the probe finds to the agent's capabilities before it first beats, so a load placed as soon
    as the fellow is online gets the quantization it asks (its kernels are declared from the first
    heartbeat on). False when the fellow is stopped while probing."""
    probing = asyncio.create_task(probed_capabilities(agent.settings.serving.fourbit_rows), name="probe")
    stopping = asyncio.create_task(agent.stopped.wait(), name="stop while probing")
    try:
        await asyncio.wait({probing, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(probing, stopping)
    if not probing.done() or probing.cancelled():
        return False
    if probing.exception() is not None:  # the probe could not start: no quantized kernel declared
        log.warning("the kernel probe did not run: %s", probing.exception())
        return True
    found = probing.result()
    if found:
        agent.capabilities = sorted(set(agent.capabilities) | set(found))
        log.info("fellow %s declares %s after probing its kernels", agent.fellow_id, ",".join(found))
    return True


async def run_fellow(settings: Settings, fellow_id: str | None = None) -> int:
    """0 once stopped as asked; 1 when a loop of the agent ended on its own (it stopped rather than linger)."""
    agent = FellowAgent(settings, fellow_id=fellow_id, capabilities=capabilities())
    manager = ModelManager(agent)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stopped.set)
    if settings.serving.quantized and not await probe_first(agent):
        return 0
    await agent.start()
    manager.start()
    try:
        await agent.stopped.wait()
    finally:
        await agent.stop()
    return 1 if agent.failure else 0
