"""docs/audit.md, tested: each query, read from the page, runs on SQLite and on PostgreSQL over a history
this test publishes through the real projectors, and answers what that history says."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

from sqlalchemy import text

from core.bus import publish_event
from events.api_tokens import ApiTokenMinted, ApiTokenRevoked
from events.loads import (
    LoadFailed,
    LoadPlaced,
    LoadRequested,
    ModelLoaded,
    ModelUnloaded,
    StageAssignment,
    UnloadRequested,
)
from events.requests import RequestAccepted, RequestFailed, RequestFinished
from tests.dbutil import projecting

PAGE = (Path(__file__).resolve().parents[1] / "docs" / "audit.md").read_text()
NOW = time.time()
DAY = 86400.0


def queries(dialect: str) -> dict[str, str]:
    """name -> the page's query for this database (its own variant, else the one for both)."""
    out: dict[str, str] = {}
    for block in re.findall(r"```sql\n(.*?)```", PAGE, re.S):
        name = re.search(r"^-- audit: (\w+)$", block, re.M).group(1)
        only = re.search(r"^-- dialect: (\w+)$", block, re.M)
        if only is None or only.group(1) == dialect:
            out[name] = block
    return out


# The history: (accepted at, request id, token id, ended after s, outcome, prompt, completion, fellow, route/code)
REQUESTS = [
    (NOW - 2 * DAY, "r-old", "t-alice", 3.0, "finished", 10, 5, "f1", "local"),
    (NOW - 7000, "r-early", "t-alice", 60.0, "finished", 4, 30, "f1", "local"),
    (NOW - 600, "r1", "t-alice", 2.0, "finished", 7, 4, "f1", "local"),
    (NOW - 500, "r2", "t-alice", 5.0, "finished", 8, 9, "f2", "relay"),
    (NOW - 400, "r3", "", 1.0, "finished", 3, 2, "f1", "local"),
    (NOW - 300, "r4", "t-alice", 0.5, "failed", 5000, 0, "f1", "context_too_long"),
    (NOW - 200, "r5", "", 600.0, "failed", 0, 0, "", "timeout"),
    (NOW - 150, "r6", "t-alice", 600.0, "failed", 0, 0, "", "timeout"),
]
TOKENS = [("t-alice", "alice", ["operate"], NOW - 9000, None), ("t-bob", "bob", ["read"], NOW - 8900, NOW - 3000)]
LOADS = [  # load, model, by, requested at, outcome, unloaded by, ended at, reason
    ("L1", "m1", "t-alice", NOW - 8000, "unloaded", "open", NOW - 90, "requested"),
    ("L2", "m2", "t-alice", NOW - 6000, "failed", "", NOW - 5990, "out of memory"),
    ("L3", "m3", "t-bob", NOW - 5000, "failed", "", NOW - 4990, "out of memory"),
]


def history() -> list:
    evts = []
    for token_id, label, scopes, at, revoked in TOKENS:
        evts.append(ApiTokenMinted(at=at, token_id=token_id, label=label, scopes=scopes, token_hash=token_id * 2,
                                   prefix=token_id[:8]))
        if revoked:
            evts.append(ApiTokenRevoked(at=revoked, token_id=token_id))
    for load_id, model, by, at, outcome, unload_by, ended, reason in LOADS:
        evts.append(LoadRequested(at=at, load_id=load_id, model_id=model, requested_by=by))
        evts.append(LoadPlaced(at=at + 1, load_id=load_id, model_id=model,
                               stages=[StageAssignment(stage=0, fellow_id="f1", layers=(0, 4))]))
        if outcome == "failed":
            evts.append(LoadFailed(at=ended, load_id=load_id, model_id=model, reason=reason))
            continue
        evts.append(ModelLoaded(at=at + 2, load_id=load_id, model_id=model))
        evts.append(UnloadRequested(at=ended - 1, load_id=load_id, model_id=model, requested_by=unload_by))
        evts.append(ModelUnloaded(at=ended, load_id=load_id, model_id=model, reason=reason, fellow_id="f1"))
    for at, rid, token, took, outcome, prompt, completion, fellow, detail in REQUESTS:
        evts.append(RequestAccepted(at=at, request_id=rid, model_id="m1", load_id="L1", token_id=token))
        if outcome == "finished":
            evts.append(RequestFinished(at=at + took, request_id=rid, model_id="m1", load_id="L1", prompt_tokens=prompt,
                                        completion_tokens=completion, ttft_s=0.25, duration_s=took,
                                        timing={"route": detail}, fellow_id=fellow))
        else:
            evts.append(RequestFailed(at=at + took, request_id=rid, model_id="m1", load_id="L1", code=detail,
                                      prompt_tokens=prompt, fellow_id=fellow))
    return evts


def expected(name: str) -> list[tuple]:
    labels = {t[0]: t[1] for t in TOKENS}
    if name == "loads":
        return [(model, load, by, labels.get(by, ""), at, outcome, unload_by, ended, reason)
                for load, model, by, at, outcome, unload_by, ended, reason in LOADS]
    if name == "usage_per_token_per_day":
        sums: dict = {}
        for at, _, token, _, _, prompt, completion, _, _ in REQUESTS:
            key = (time.strftime("%Y-%m-%d", time.gmtime(at)), token, labels.get(token, ""))
            n, p, c = sums.get(key, (0, 0, 0))
            sums[key] = (n + 1, p + prompt, c + completion)
        return [(*k, *v) for k, v in sorted(sums.items())]
    if name == "request_failures":
        count = Counter((r[8], r[7]) for r in REQUESTS if r[4] == "failed")
        return [(code, fellow, n) for (code, fellow), n in sorted(count.items(), key=lambda kv: (-kv[1], kv[0]))]
    if name == "load_failures":
        count = Counter(reason for *_, outcome, _, _, reason in LOADS if outcome == "failed")
        return sorted(count.items(), key=lambda kv: (-kv[1], kv[0]))
    if name == "api_tokens":
        return [(token_id, label, scopes, at, None, revoked) for token_id, label, scopes, at, revoked in TOKENS]
    if name == "slowest_last_hour":
        recent = [r for r in REQUESTS if r[4] == "finished" and r[0] >= NOW - 3600]
        recent.sort(key=lambda r: (-r[3], r[1]))
        return [(rid, "m1", took, 0.25, completion, route, fellow)
                for _, rid, _, took, _, _, completion, fellow, route in recent]
    raise AssertionError(f"no expected answer for {name}")


def plain(row) -> tuple:
    """Floats to 3 places, JSON text to values, so both databases compare alike."""
    out = []
    for v in row:
        if isinstance(v, float):
            v = round(v, 3)
        elif isinstance(v, str) and v[:1] == "[":
            v = json.loads(v)
        out.append(v)
    return tuple(out)


async def test_every_audit_query_answers_on_this_database(js, database_url):
    dialect = "postgresql" if database_url.startswith("postgresql") else "sqlite"
    found = queries(dialect)
    assert set(found) == {"loads", "usage_per_token_per_day", "request_failures", "load_failures", "api_tokens",
                          "slowest_last_hour"}
    async with projecting(js, database_url) as (sessions, runner):
        for evt in history():
            last = await publish_event(js, evt)
        await runner.wait_for(last.seq, timeout=20)
        async with sessions() as session:
            for name, sql in found.items():
                rows = [plain(r) for r in (await session.execute(text(sql))).all()]
                assert rows == [plain(r) for r in expected(name)], (name, dialect)
