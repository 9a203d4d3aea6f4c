"""The logs request: the leader asks a fellow on core NATS (``swarm.logs.<fellow>``) for its log tails."""

from __future__ import annotations

import msgspec

MAX_TAIL = 5000


class LogsRequest(msgspec.Struct, frozen=True, kw_only=True):
    tail: int = 200  # lines from each log's end
    stage: int | None = None  # only this stage's logs (and the fellow's own); None: every stage's


class StageLog(msgspec.Struct, frozen=True, kw_only=True):
    load_id: str
    model_id: str
    stage: int
    replica: int = 0
    lines: list[str] = []


class LogsReply(msgspec.Struct, frozen=True, kw_only=True):
    fellow_id: str
    lines: list[str] = []  # the fellow agent's own log
    stages: list[StageLog] = []
    error: str = ""  # set when the request was refused (a bad body)
