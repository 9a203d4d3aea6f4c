"""Alembic environment: runs migrations over the async engine named in the config."""

import asyncio

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from leader.db.engine import make_engine
from leader.db.tables import Base

config = context.config
target_metadata = Base.metadata
MIGRATION_LOCK = 0x5357524D  # "SWRM": the advisory lock a PostgreSQL migration holds


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":  # leaders starting together migrate one at a time
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        context.run_migrations()


async def _online() -> None:
    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    async with engine.connect() as conn:
        await conn.run_sync(_run)
        await conn.commit()
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_online())
