"""GET /api/v1/fellows: the fellows projection joined with each one's latest heartbeat and its reply checks
(``trust``: the verification projection's ``fellow_trust`` row, leader.verify)."""

from __future__ import annotations

import time

import msgspec
from litestar import get
from sqlalchemy import select

from leader.api.deps import Db, FellowsDep
from leader.db.tables import Fellow
from leader.verify.tables import FellowTrust


def trust_view(row: FellowTrust | None) -> dict:
    """Its replies' checks by other fellows, the failed ones, and when and why it was drained (None: not)."""
    if row is None:
        return {"checks": 0, "failed": 0, "failed_by": [], "drained_at": None, "reason": None}
    return {"checks": row.checks, "failed": row.failed, "failed_by": list(row.failed_by or []),
            "drained_at": row.drained_at, "reason": row.reason or None}


def fellow_view(row: Fellow, hb, now: float, trust: FellowTrust | None = None) -> dict:
    view = {
        "id": row.fellow_id, "hostname": row.hostname, "version": row.version, "status": row.status,
        "gpus": row.gpus, "memory_total_bytes": row.memory_total_bytes,
        "capabilities": row.capabilities, "joined_at": row.joined_at, "lost_at": row.lost_at,
        "last_heartbeat_at": row.last_seen, "memory_free_bytes": None, "loaded_models": [],
        "trust": trust_view(trust),
    }
    if hb is not None and hb.started_at == row.started_at:
        view.update(gpus=msgspec.to_builtins(hb.gpus), memory_free_bytes=hb.memory_free_bytes,
                    capabilities=list(hb.capabilities), last_heartbeat_at=hb.at,
                    loaded_models=msgspec.to_builtins(hb.loaded_models))
    view["last_heartbeat_age_s"] = round(max(0.0, now - view["last_heartbeat_at"]), 3)
    return view


@get("/api/v1/fellows", tags=["fellows"], opt={"scope": "read"},
     summary="Fellows with hardware, capabilities, last heartbeat, reply checks and whether drained")
async def list_fellows(db: Db, fellows: FellowsDep) -> dict:
    rows = (await db.scalars(select(Fellow).order_by(Fellow.fellow_id))).all()
    trust = {t.fellow_id: t for t in (await db.scalars(select(FellowTrust))).all()}
    now = time.time()
    return {"object": "list", "data": [fellow_view(r, fellows.latest.get(r.fellow_id), now, trust.get(r.fellow_id))
                                       for r in rows]}
