"""Catalog projection: the servable models the catalog found, available or not (with why)."""

from __future__ import annotations

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from events.base import Event
from events.catalog import ModelCataloged, ModelUncataloged
from leader.db.tables import Model
from leader.projectors.projector import Projector


class CatalogProjector(Projector):
    name = "catalog"
    tables = (Model,)
    handles = (ModelCataloged, ModelUncataloged)

    async def apply(self, session: AsyncSession, evt: Event, seq: int) -> None:
        match evt:
            case ModelCataloged():
                values = msgspec.to_builtins(evt.entry)
                row = await session.get(Model, evt.entry.model_id)
                if row is None:
                    row = Model(model_id=evt.entry.model_id)
                    session.add(row)
                for key, value in values.items():
                    setattr(row, key, value)
                row.cataloged_at = evt.at
            case ModelUncataloged():
                row = await session.get(Model, evt.model_id)
                if row is not None:
                    await session.delete(row)
