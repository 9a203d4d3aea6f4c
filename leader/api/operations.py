"""Operators' routes: `GET /metrics` (Prometheus) and a fellow's log tails (asked over NATS)."""

from __future__ import annotations

import msgspec
from litestar import Response, get
from litestar.params import FromPath, FromQuery
from nats.errors import Error as NatsError
from prometheus_client import CONTENT_TYPE_LATEST

from events import subjects
from events.logs import MAX_TAIL, LogsReply, LogsRequest
from leader.api.deps import Db, LeaderDep
from leader.db.tables import Fellow
from leader.errors import ApiError

LOGS_TIMEOUT_S = 5.0


@get("/metrics", opt={"scope": "read"}, tags=["operations"],
     summary="Prometheus metrics: requests, tokens, latencies, KV cache, fellows, ring links (text format)")
async def metrics(leader: LeaderDep) -> Response:
    if leader.metrics is None:
        raise ApiError(503, "The leader is still starting", code="unavailable")
    return Response(leader.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@get(["/api/v1/fellows/{fellow_id:str}/logs", "/api/v1/workers/{fellow_id:str}/logs"], opt={"scope": "read"},
     tags=["fellows"], summary="The tail of a fellow's log and of its stages' logs, asked of the fellow")
async def fellow_logs(leader: LeaderDep, db: Db, fellow_id: FromPath[str], tail: FromQuery[int] = 200,
                      stage: FromQuery[int | None] = None) -> dict:
    if not 1 <= tail <= MAX_TAIL:
        raise ApiError(400, f"tail must be between 1 and {MAX_TAIL}", code="invalid_value", param="tail")
    if stage is not None and stage < 0:
        raise ApiError(400, "stage must be 0 or more", code="invalid_value", param="stage")
    row = await db.get(Fellow, fellow_id)
    if row is None:
        raise ApiError(404, f"No fellow {fellow_id!r}", code="fellow_not_found", param="fellow_id")
    try:
        body = msgspec.json.encode(LogsRequest(tail=tail, stage=stage))
        msg = await leader.nc.request(subjects.logs(fellow_id), body, timeout=LOGS_TIMEOUT_S)
        reply = msgspec.json.decode(msg.data, type=LogsReply)
    except (NatsError, TimeoutError) as exc:
        raise ApiError(504, f"Fellow {fellow_id!r} did not answer ({row.status}): {type(exc).__name__}",
                       code="fellow_unreachable") from None
    except msgspec.DecodeError as exc:
        raise ApiError(502, f"Fellow {fellow_id!r} answered something else than logs: {exc}",
                       code="bad_fellow_reply") from None
    return {"fellow_id": fellow_id, "status": row.status, "tail": tail, "lines": reply.lines,
            "stages": msgspec.to_builtins(reply.stages)}


ROUTES = [metrics, fellow_logs]
