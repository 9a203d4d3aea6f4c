"""One serving subprocess as the agent sees it: started, reporting JSON lines, stopped by PID."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time

from core.procs import die_with_parent

log = logging.getLogger(__name__)


class StageProcess:
    """The torch side runs in `python -m fellow.runtime.serve CONFIG`; it dies with its agent."""

    def __init__(self, load_id: str, model_id: str, stage: int, cfg: dict, on_report, log_path=None):
        self.load_id = load_id
        self.model_id = model_id
        self.stage = stage
        self.cfg = cfg
        self.on_report = on_report  # async callable(StageProcess, dict)
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.state = "loading"  # loading | ready | stopping | ended
        self.metrics: dict = {}
        self.ready_info: dict = {}
        self.started_at = time.time()
        self.stop_reason: str | None = None
        self.exited = asyncio.Event()
        self._reader: asyncio.Task | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    @property
    def replica(self) -> int:
        return int(self.cfg.get("replica", 0))

    @property
    def replicas(self) -> int:
        return int(self.cfg.get("replicas", 1))

    async def start(self) -> None:
        parent = os.getpid()

        def pre() -> None:  # between fork and exec: SIGKILL when the agent dies, however it dies
            die_with_parent(signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(1)

        stderr = open(self.log_path, "ab") if self.log_path else None
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fellow.runtime.serve", json.dumps(self.cfg),
            stdout=asyncio.subprocess.PIPE, stderr=stderr, stdin=asyncio.subprocess.DEVNULL, preexec_fn=pre)
        if stderr:
            stderr.close()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc and self.proc.stdout
        async for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            kind = msg.get("event")
            if kind == "ready":
                self.state = "ready"
                self.ready_info = msg
            elif kind == "metrics":
                self.metrics = msg
            await self.on_report(self, msg)
        code = await self.proc.wait()
        self.state = "ended"
        try:  # the report (an event on the bus) goes out before anyone waiting on the exit goes on
            await self.on_report(self, {"event": "exited", "code": code})
        except Exception:
            log.exception("the exit of stage %s of %s was not reported", self.stage, self.load_id)
        finally:
            self.exited.set()

    async def stop(self, reason: str, timeout: float = 10.0) -> None:
        """Ask it to exit (SIGTERM), then kill it after `timeout` seconds."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self.stop_reason = self.stop_reason or reason
        self.state = "stopping"
        try:
            self.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(self.exited.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("stage %s of %s ignored SIGTERM for %.0fs; killing it", self.stage, self.load_id, timeout)
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            await self.exited.wait()
