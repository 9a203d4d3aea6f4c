"""One serving subprocess as the agent sees it: started with a StageConfig, reporting, stopped by PID."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from typing import Awaitable, Callable

import msgspec

from events.stage import MetricsReport, ReadyReport, StageConfig, StageReport, decode_report, encode

log = logging.getLogger(__name__)


class StageProcess:
    """The torch side runs in `python -m fellow.runtime CONFIG`, in a session of its own; it dies with
    its agent (it asks the kernel for SIGKILL on its parent's death, see fellow.runtime.__main__).

    ``on_report(proc, report)`` gets each report it writes; ``on_exit(proc, code)`` its exit, after the
    last report.
    """

    def __init__(self, cfg: StageConfig, on_report: Callable[["StageProcess", StageReport], Awaitable[None]],
                 on_exit: Callable[["StageProcess", int], Awaitable[None]], log_path=None, restarts: int = 0,
                 env: dict | None = None):
        self.cfg = cfg
        self.env = env  # its environment (None: its fellow's); carries the fellow's NATS credentials
        self.restarts = restarts  # how many times its fellow started this stage again after it died
        self.on_report = on_report
        self.on_exit = on_exit
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.state = "loading"  # loading | ready | stopping | ended
        self.ready: ReadyReport | None = None
        self.metrics: MetricsReport | None = None
        self.started_at = time.time()
        self.stop_reason: str | None = None
        self.exited = asyncio.Event()
        self._reader: asyncio.Task | None = None

    @property
    def load_id(self) -> str:
        return self.cfg.load_id

    @property
    def model_id(self) -> str:
        return self.cfg.model_id

    @property
    def stage(self) -> int:
        return self.cfg.stage

    @property
    def replica(self) -> int:
        return self.cfg.replica

    @property
    def replicas(self) -> int:
        return self.cfg.replicas

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    async def start(self) -> None:
        cfg = msgspec.structs.replace(self.cfg, agent_pid=os.getpid())
        stderr = open(self.log_path, "ab") if self.log_path else None
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fellow.runtime", encode(cfg).decode(),
                stdout=asyncio.subprocess.PIPE, stderr=stderr, stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True, env=self.env)
        finally:
            if stderr:
                stderr.close()
        self._reader = asyncio.create_task(self._read(), name=f"stage-{self.load_id}-{self.stage}")
        if self.stop_reason is not None:  # stopped while it was starting (an unload during a restart)
            self.proc.send_signal(signal.SIGTERM)

    async def _read(self) -> None:
        assert self.proc and self.proc.stdout
        async for line in self.proc.stdout:
            try:
                msg = decode_report(line)
            except msgspec.DecodeError:
                log.warning("stage %s of %s wrote a line that is not a report: %.200r", self.stage, self.load_id, line)
                continue
            if isinstance(msg, ReadyReport):
                self.state = "ready"
                self.ready = msg
            elif isinstance(msg, MetricsReport):
                self.metrics = msg
            try:
                await self.on_report(self, msg)
            except Exception:
                log.exception("a report of stage %s of %s was not handled", self.stage, self.load_id)
        code = await self.proc.wait()
        self.state = "ended"
        try:  # the exit (an event on the bus) goes out before anyone waiting on it goes on
            await self.on_exit(self, code)
        except Exception:
            log.exception("the exit of stage %s of %s was not reported", self.stage, self.load_id)
        finally:
            self.exited.set()

    def last_log_line(self, limit: int = 4096) -> str:
        """The last non-empty line its log holds (where a crash's traceback ends), at most 300 characters."""
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
                lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines()]
        except OSError:
            return ""
        last = next((ln for ln in reversed(lines) if ln), "")
        return last[:300]

    async def stop(self, reason: str, timeout: float = 10.0) -> None:
        """Ask it to exit (SIGTERM), then kill it after `timeout` seconds."""
        if self.proc is None:  # not started yet: start() stops it once it exists
            self.stop_reason = self.stop_reason or reason
            return
        if self.proc.returncode is not None:
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

