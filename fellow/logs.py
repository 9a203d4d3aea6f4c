"""A fellow's answer to ``swarm.logs.<fellow>``: the tail of its own log and of its stages' logs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from core.logs import LogTail, formatter, log_format
from events import subjects
from events.logs import MAX_TAIL, LogsReply, LogsRequest, StageLog

log = logging.getLogger(__name__)
READ_BYTES = 1 << 20  # a stage log's tail is read from at most its last MiB


def stage_log_path(data_dir: Path, load_id: str, stage: int) -> Path:
    """Where the manager writes a stage process's stderr."""
    return data_dir / "logs" / f"{load_id}-stage{stage}.log"


def file_tail(path: Path, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - READ_BYTES))
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > READ_BYTES:
        lines = lines[1:]  # the first may be cut
    return lines[-n:] if n > 0 else []


class FellowLogs:
    """Keeps the agent's last lines in memory and answers the leader's logs requests."""

    def __init__(self, agent):
        self.agent = agent
        self.tail = LogTail()
        self.tail.setFormatter(formatter(log_format()))
        self._sub = None

    async def start(self) -> None:
        logging.getLogger().addHandler(self.tail)
        self._sub = await self.agent.nc.subscribe(subjects.logs(self.agent.fellow_id), cb=self._on_request)

    def close(self) -> None:
        logging.getLogger().removeHandler(self.tail)

    def reply(self, req: LogsRequest) -> LogsReply:
        n = max(0, min(req.tail, MAX_TAIL))
        stages = [StageLog(load_id=lm.load_id, model_id=lm.model_id, stage=lm.stage, replica=lm.replica,
                           lines=file_tail(stage_log_path(self.agent.settings.data_dir, lm.load_id, lm.stage), n))
                  for lm in self.agent.loaded_models() if req.stage is None or lm.stage == req.stage]
        return LogsReply(fellow_id=self.agent.fellow_id, lines=self.tail.tail(n), stages=stages)

    async def _on_request(self, msg) -> None:
        try:
            req = msgspec.json.decode(msg.data or b"{}", type=LogsRequest)
            out = self.reply(req)
        except (msgspec.DecodeError, RecursionError) as exc:
            out = LogsReply(fellow_id=self.agent.fellow_id, error=f"not a logs request: {exc}")
        if msg.reply:
            await msg.respond(msgspec.json.encode(out))
