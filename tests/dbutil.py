"""Read whole tables as sorted plain rows, to compare projections row for row."""

from __future__ import annotations

from sqlalchemy import select


async def dump(sessions, *tables) -> dict[str, list[tuple]]:
    out = {}
    async with sessions() as session:
        for table in tables:
            cols = list(table.__table__.columns)
            rows = (await session.execute(select(*cols))).all()
            out[table.__tablename__] = sorted((tuple(r) for r in rows), key=repr)
    return out
