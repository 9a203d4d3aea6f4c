"""Read whole tables as sorted plain rows, to compare projections row for row."""

from __future__ import annotations

from contextlib import asynccontextmanager

from sqlalchemy import select


async def dump(sessions, *tables) -> dict[str, list[tuple]]:
    out = {}
    async with sessions() as session:
        for table in tables:
            cols = list(table.__table__.columns)
            rows = (await session.execute(select(*cols))).all()
            out[table.__tablename__] = sorted((tuple(r) for r in rows), key=repr)
    return out


@asynccontextmanager
async def projecting(js, database_url: str):
    """A migrated database with every projector following SWARM_EVENTS; yields (sessions, runner)."""
    from leader.db.engine import make_engine, session_factory, upgrade
    from leader.projectors.all import all_projectors
    from leader.projectors.runner import ProjectionRunner

    await upgrade(database_url)
    engine = make_engine(database_url)
    runner = ProjectionRunner(js, session_factory(engine), all_projectors())
    try:
        await runner.start()
        yield runner.sessions, runner
    finally:
        await runner.stop()
        await engine.dispose()
