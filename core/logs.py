"""Log lines for people and machines: `SWARM_LOG_FORMAT=json` writes one JSON object per line.

A line that concerns a request carries its id: log it with ``extra=for_request(rid)``, and the JSON
line has a ``request_id`` field (the text format shows it as ``[request <id>]``). `LogTail` keeps a
process's last lines in memory, for the fellow's logs request.
"""

from __future__ import annotations

import collections
import json
import logging
import sys
import time

from core.settings import LoggingSettings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def for_request(request_id: str) -> dict:
    """The `extra` of a log call about one request."""
    return {"request_id": request_id}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id (where it applies), exc."""

    def __init__(self, fields: dict | None = None):
        super().__init__()
        self.fields = fields or {}  # constant fields of this process (e.g. its stage and load)

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 6),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "logger": record.name, "message": record.getMessage(), **self.fields}
        rid = getattr(record, "request_id", None)
        if rid:
            line["request_id"] = rid
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{text} [request {rid}]" if rid else text


class LogTail(logging.Handler):
    """The last `size` formatted lines of this process, in memory."""

    def __init__(self, size: int = 2000):
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=size)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # a line that cannot be formatted is not worth a crash
            self.handleError(record)

    def tail(self, n: int) -> list[str]:
        return list(self.lines)[-n:] if n > 0 else []


def log_format(env=None) -> str:
    """SWARM_LOG_FORMAT (text | json); anything else counts as text here (Settings refuses it at start)."""
    return LoggingSettings.from_env(env, lenient=True).format


def formatter(fmt: str, text_format: str = TEXT_FORMAT, fields: dict | None = None) -> logging.Formatter:
    return JsonFormatter(fields) if fmt == "json" else TextFormatter(text_format)


def setup_logging(level: int = logging.INFO, fmt: str | None = None, text_format: str = TEXT_FORMAT,
                  fields: dict | None = None, stream=None) -> logging.Handler:
    """The root logger writes to stderr in the chosen format; returns its handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(fmt or log_format(), text_format, fields))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return handler


def stage_stats_s(env=None) -> float:
    """SWARM_STAGE_STATS_S: how often a stage with traffic writes its stats line (30 s, the spec's); a bad
    value counts as that here (Settings refuses it at start)."""
    return LoggingSettings.from_env(env, lenient=True).stage_stats_s
