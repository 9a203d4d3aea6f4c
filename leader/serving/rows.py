"""The load rows every part of serving reads, and the states that group them."""

from __future__ import annotations

from sqlalchemy import select

from leader.db.tables import Load, LoadStage
from leader.errors import ApiError

ACTIVE = ("requested", "loading", "ready")
SERVING = ("loading", "ready")  # a stage row that still counts
UNLOADED_CODES = ("idle", "evicted", "stopped")  # a replica that went away without failing


def model_not_found(model_id: str) -> ApiError:
    return ApiError(404, f"The model '{model_id}' does not exist", code="model_not_found", param="model")


async def get_load(sessions, load_id: str) -> Load | None:
    async with sessions() as session:
        return await session.get(Load, load_id)


async def active_load(sessions, model_id: str) -> Load | None:
    async with sessions() as session:
        return (await session.scalars(select(Load).where(Load.model_id == model_id, Load.state.in_(ACTIVE))
                                      .order_by(Load.requested_at.desc()))).first()


async def latest_load(sessions, model_id: str) -> Load | None:
    """The model's most recently requested load, whatever its state."""
    async with sessions() as session:
        return (await session.scalars(select(Load).where(Load.model_id == model_id)
                                      .order_by(Load.requested_at.desc()).limit(1))).first()


async def load_stages(sessions, load_id: str) -> list[LoadStage]:
    async with sessions() as session:
        return list(await session.scalars(select(LoadStage).where(LoadStage.load_id == load_id)
                                          .order_by(LoadStage.replica, LoadStage.stage)))
