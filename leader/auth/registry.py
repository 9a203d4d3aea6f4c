"""The in-memory view of the api_tokens projection that every request checks against."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from leader.db.tables import ApiToken
from leader.projectors.runner import ProjectionRunner

PROJECTION = "api_tokens"


@dataclass(frozen=True)
class TokenRecord:
    token_id: str
    label: str
    scopes: tuple[str, ...]
    token_hash: str
    prefix: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def fields(self) -> dict:
        """The public fields (ApiTokenView's): never the hash, never the secret."""
        return {"id": self.token_id, "label": self.label, "scopes": list(self.scopes), "prefix": self.prefix,
                "created_at": self.created_at, "expires_at": self.expires_at, "revoked_at": self.revoked_at}


@dataclass(frozen=True)
class TokenTable:
    """One immutable snapshot; requests read it without a lock or a query."""

    records: tuple[TokenRecord, ...] = ()
    by_id: dict[str, TokenRecord] = field(default_factory=dict)
    by_hash: dict[str, TokenRecord] = field(default_factory=dict)

    @classmethod
    def of(cls, records: list[TokenRecord]) -> "TokenTable":
        return cls(tuple(records), {r.token_id: r for r in records}, {r.token_hash: r for r in records})

    @property
    def live(self) -> int:
        """Unrevoked tokens, expired ones included: each of them keeps auth enforced."""
        return sum(r.revoked_at is None for r in self.records)


def _record(row: ApiToken) -> TokenRecord:
    return TokenRecord(token_id=row.token_id, label=row.label, scopes=tuple(row.scopes),
                       token_hash=row.token_hash, prefix=row.prefix, created_at=row.created_at,
                       expires_at=row.expires_at, revoked_at=row.revoked_at)


class TokenRegistry:
    """Reloads from SQL only when the projection has committed a token event it has not seen.

    `current()` compares two integers on the hot path. After `Leader.publish(evt, wait=[PROJECTION])`
    returns, the projection's position covers the event, so the very next `current()` reloads:
    a token works (or stops working) on the next request.
    """

    def __init__(self, sessions: async_sessionmaker, runner: ProjectionRunner):
        self._sessions = sessions
        self._runner = runner
        self._projector = runner.projectors[PROJECTION]
        self._table = TokenTable()
        self._loaded_through = -1
        self._lock = asyncio.Lock()
        self.on_reload: Callable[[TokenTable], None] | None = None  # told each new table (the tokens file)

    def _stale(self) -> bool:
        changed = self._projector.changed_seq
        committed = self._runner.positions.get(PROJECTION, 0)
        return self._loaded_through < 0 or self._loaded_through < changed <= committed

    async def current(self) -> TokenTable:
        if self._stale():
            async with self._lock:
                if self._stale():
                    await self._reload()
        return self._table

    async def _reload(self) -> None:
        through = self._projector.changed_seq  # read before the query: a later change reloads again
        async with self._sessions() as session:
            rows = (await session.scalars(select(ApiToken).order_by(ApiToken.created_at, ApiToken.token_id))).all()
        self._table = TokenTable.of([_record(r) for r in rows])
        self._loaded_through = through
        if self.on_reload is not None:
            self.on_reload(self._table)
