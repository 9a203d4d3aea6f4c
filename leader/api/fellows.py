"""GET /api/v1/fellows: the fellows projection joined with each one's latest heartbeat."""

from __future__ import annotations

import time

import msgspec
from litestar import get
from sqlalchemy import select

from leader.api.deps import Db, FellowsDep
from leader.db.tables import Fellow


def fellow_view(row: Fellow, hb, now: float) -> dict:
    view = {
        "id": row.fellow_id, "hostname": row.hostname, "version": row.version, "status": row.status,
        "gpus": row.gpus, "memory_total_bytes": row.memory_total_bytes,
        "capabilities": row.capabilities, "joined_at": row.joined_at, "lost_at": row.lost_at,
        "last_heartbeat_at": row.last_seen, "memory_free_bytes": None, "loaded_models": [],
    }
    if hb is not None and hb.started_at == row.started_at:
        view.update(gpus=msgspec.to_builtins(hb.gpus), memory_free_bytes=hb.memory_free_bytes,
                    capabilities=list(hb.capabilities), last_heartbeat_at=hb.at,
                    loaded_models=msgspec.to_builtins(hb.loaded_models))
    view["last_heartbeat_age_s"] = round(max(0.0, now - view["last_heartbeat_at"]), 3)
    return view


@get("/api/v1/fellows", tags=["fellows"], opt={"scope": "read"},
     summary="Fellows with hardware, capabilities and last heartbeat")
async def list_fellows(db: Db, fellows: FellowsDep) -> dict:
    rows = (await db.scalars(select(Fellow).order_by(Fellow.fellow_id))).all()
    now = time.time()
    return {"object": "list", "data": [fellow_view(r, fellows.latest.get(r.fellow_id), now) for r in rows]}
