"""The ready-model view: what the chat hot path reads to send a request to a loaded model."""

from __future__ import annotations

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.servable import ServableError, load_manifest
from core.settings import Settings
from leader.db.tables import Load, LoadStage, Model


class ReadyLoad(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway needs to send a chat request to a loaded model."""

    load_id: str
    model_id: str
    generation: dict
    context_tokens: int
    kv_tokens: int = 0
    model_dir: str = ""  # the servable's folder (its tokenizer, for /tokenize and completions)
    stages: int = 1  # a ring's stages (leader.moves: what a request moved onto it can keep)


class ReadyView:
    """model_id -> its ready load, rebuilt from SQL whenever a load becomes ready or ends."""

    def __init__(self, settings: Settings, sessions: async_sessionmaker) -> None:
        self.settings = settings
        self.sessions = sessions
        self.loads: dict[str, ReadyLoad] = {}

    async def refresh(self) -> None:
        async with self.sessions() as session:
            rows = await session.execute(select(Load, Model).join(Model, Model.model_id == Load.model_id)
                                         .where(Load.state == "ready"))
            pairs = rows.all()
            stages: dict[str, LoadStage] = {}  # stage 0 admits; of several replicas the smallest budget
            for s in await session.scalars(
                    select(LoadStage).where(LoadStage.load_id.in_([load.load_id for load, _ in pairs]),
                                            LoadStage.stage == 0, LoadStage.state == "ready")):
                if s.load_id not in stages or s.kv_tokens < stages[s.load_id].kv_tokens:
                    stages[s.load_id] = s
        ready = {}
        for load, model in sorted(pairs, key=lambda p: p[0].ready_at or 0):
            try:
                gen = load_manifest(model.path).generation
            except (ServableError, OSError):
                continue
            kv = stages[load.load_id].kv_tokens if load.load_id in stages else 0
            ready[model.model_id] = ReadyLoad(
                load_id=load.load_id, model_id=model.model_id, generation=msgspec.to_builtins(gen),
                context_tokens=kv or self.settings.serving.context_tokens, kv_tokens=kv,
                model_dir=str(model.path), stages=load.num_stages or 1)
        self.loads = ready

    def drop(self, load_id: str) -> None:
        """The load ended (the gateway saw its LoadFailed or ModelUnloaded): no new request goes to it, ahead
        of the refresh that follows the projection."""
        self.loads = {m: r for m, r in self.loads.items() if r.load_id != load_id}
