"""Liveness and readiness."""

from __future__ import annotations

import asyncio

from litestar import get

from events.subjects import EVENTS_STREAM
from leader.api.deps import LeaderDep


@get("/healthz", tags=["ops"], opt={"scope": "public"},
     summary="Leader health: NATS connection, and per projection its checkpoint, lag and whether it is stuck")
async def healthz(leader: LeaderDep) -> dict:
    """``projections``: each projection's position. ``projectors``: each one's checkpoint, the stream's
    last sequence, the lag, and whether it is stuck. ``status`` is "degraded" when NATS is down, the
    stream's head cannot be read, or a projection is stuck (behind and not advancing, or failing)."""
    connected = bool(leader.nc and leader.nc.is_connected)
    if not leader.projections:
        return {"status": "ok" if connected else "degraded", "nats": connected, "projections": {}, "projectors": {}}
    positions = dict(leader.projections.positions)
    head_known = connected
    last_seq = max(positions.values(), default=0)
    if connected:
        try:
            last_seq = (await asyncio.wait_for(leader.js.stream_info(EVENTS_STREAM), 2.0)).state.last_seq
        except Exception:  # the lag is then reported against what was read
            head_known = False
    projectors = leader.projections.health(last_seq)
    ok = head_known and not any(p["stuck"] for p in projectors.values())
    return {"status": "ok" if ok else "degraded", "nats": connected, "projections": positions,
            "projectors": projectors}
