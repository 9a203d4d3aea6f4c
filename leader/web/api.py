"""The JSON the dashboard reads: a model's performance, recent requests, and active loads."""

from __future__ import annotations

import time

from litestar import get, post
from litestar.params import FromPath, FromQuery
from sqlalchemy import func, select

from leader.api.deps import Caller, Db, FellowsDep, ServingDep, StreamsDep
from leader.api.views import load_view
from leader.auth.scopes import grants
from leader.db.tables import Load, Request as RequestRow
from leader.errors import ApiError
from leader.serving import ACTIVE, model_not_found
from leader.web.performance import BUCKET_S, WINDOW_S, aggregate, buckets_since, topology

MAX_WINDOW_S = 6 * 3600
MAX_LIMIT = 500


def request_view(r: RequestRow) -> dict:
    return {"id": r.request_id, "model_id": r.model_id, "load_id": r.load_id, "status": r.status,
            "stream": r.stream, "max_tokens": r.max_tokens, "accepted_at": r.accepted_at, "ended_at": r.ended_at,
            "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "finish_reason": r.finish_reason or None, "ttft_s": r.ttft_s, "duration_s": r.duration_s,
            "tokens_per_s": r.tokens_per_s, "error_code": r.error_code or None,
            "error_message": r.error_message or None, "timing": r.timing or {}}


@get("/api/v1/models/{model_id:str}/performance", opt={"scope": "read"}, tags=["models"],
     summary="Throughput, TTFT, the time split per token (per minute) and the stages of the model's load")
async def model_performance(db: Db, serving: ServingDep, fellows: FellowsDep, model_id: FromPath[str],
                            window_s: FromQuery[int] = WINDOW_S) -> dict:
    if not BUCKET_S <= window_s <= MAX_WINDOW_S:
        raise ApiError(400, f"window_s must be between {BUCKET_S} and {MAX_WINDOW_S}", code="invalid_value",
                       param="window_s")
    if await serving.registry.get(model_id) is None:
        raise model_not_found(model_id)
    now = time.time()
    since = buckets_since(now, window_s, BUCKET_S)
    rows = list(await db.scalars(
        select(RequestRow).where(RequestRow.model_id == model_id,
                                 func.coalesce(RequestRow.ended_at, RequestRow.accepted_at) >= since)))
    figures = aggregate(rows, now, window_s, BUCKET_S)
    load = await serving.active_load(model_id)
    stages = await serving.stages(load.load_id) if load else []
    relay = getattr(serving, "relay", None)  # a ring's lane counts, where the leader keeps them
    lanes = relay.lanes(load.load_id) if relay is not None and load is not None else None
    return {"model_id": model_id, **figures,
            "load": topology(load, stages, fellows.latest, figures["totals"]["split_ms"], lanes)}


@get("/api/v1/requests", opt={"scope": "read"}, tags=["requests"],
     summary="Recent chat requests, newest first: status, tokens, TTFT, tokens/s, finish reason, error code")
async def list_requests(db: Db, limit: FromQuery[int] = 50, model: FromQuery[str | None] = None) -> dict:
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(400, f"limit must be between 1 and {MAX_LIMIT}", code="invalid_value", param="limit")
    query = select(RequestRow).order_by(RequestRow.accepted_at.desc()).limit(limit)
    if model:
        query = query.where(RequestRow.model_id == model)
    rows = (await db.scalars(query)).all()
    return {"object": "list", "data": [request_view(r) for r in rows]}


@get("/api/v1/loads", opt={"scope": "read"}, tags=["models"],
     summary="Active loads (requested, loading, ready) with their stages and live serving metrics")
async def list_loads(db: Db, serving: ServingDep, fellows: FellowsDep) -> dict:
    loads = (await db.scalars(select(Load).where(Load.state.in_(ACTIVE)).order_by(Load.requested_at))).all()
    return {"object": "list", "data": [load_view(load, await serving.stages(load.load_id), fellows.latest)
                                       for load in loads]}


@post("/api/v1/requests/{request_id:str}/cancel", opt={"scope": "operate"}, status_code=200, tags=["requests"],
      summary="Stop a request in flight now: its stage ends it with finish_reason cancelled")
async def cancel_request(db: Db, streams: StreamsDep, caller: Caller, request_id: FromPath[str]) -> dict:
    """A streaming client that hangs up cancels only after SWARM_STREAM_RESUME_S, so that it can resume;
    this cancels at once. A token may cancel its own requests; an admin token, anyone's."""
    row = await db.get(RequestRow, request_id)
    if row is None or (caller is not None and row.token_id != caller.token_id and not grants(caller.scopes, "admin")):
        raise ApiError(404, f"No request '{request_id}' of yours is known", code="request_not_found",
                       param="request_id")
    if row.status != "accepted":
        raise ApiError(409, f"The request '{request_id}' has ended already ({row.status})", code="request_ended")
    await streams.cancel(row.load_id, request_id)
    return {"id": request_id, "object": "request.cancel", "status": "cancelling"}


ROUTES = [model_performance, list_requests, list_loads, cancel_request]
