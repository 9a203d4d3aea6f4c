"""Liveness and readiness."""

from __future__ import annotations

from litestar import Request, get


@get("/healthz", tags=["ops"], opt={"scope": "public"},
     summary="Leader health: NATS connection and projection positions")
async def healthz(request: Request) -> dict:
    leader = request.app.state.leader
    connected = bool(leader.nc and leader.nc.is_connected)
    return {"status": "ok" if connected else "degraded", "nats": connected,
            "projections": dict(leader.projections.positions) if leader.projections else {}}
