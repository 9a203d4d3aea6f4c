"""`swarm replay`: rebuild projections from sequence 1, outside a running leader's projectors."""

from __future__ import annotations

from core.bus import connect, ensure_streams
from core.cli_errors import CliError
from core.settings import Settings
from leader.db.engine import make_engine, session_factory, upgrade
from leader.projectors.all import all_projectors
from leader.projectors.replay import replay


async def replay_projections(settings: Settings, name: str | None = None) -> dict[str, int]:
    projectors = [p for p in all_projectors() if name in (None, p.name)]
    if not projectors:
        known = ", ".join(p.name for p in all_projectors())
        raise CliError(f"no projection named {name!r} (known: {known})")
    await upgrade(settings.leader.database_url)
    engine = make_engine(settings.leader.database_url)
    nc = await connect(settings.nats.url or "nats://127.0.0.1:4222", name="swarm-replay",
                       credentials=settings.nats.credentials)
    try:
        js = nc.jetstream()
        await ensure_streams(js, settings.nats.replicas)
        sessions = session_factory(engine)
        return {p.name: await replay(js, sessions, p) for p in projectors}
    finally:
        await nc.close()
        await engine.dispose()
