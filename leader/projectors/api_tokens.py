"""API tokens projection: hashes, prefixes, scopes and expiry; never a secret."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from events.api_tokens import ApiTokenMinted, ApiTokenPruned, ApiTokenRevoked
from events.base import Event
from leader.db.tables import ApiToken
from leader.projectors.projector import Projector


class ApiTokensProjector(Projector):
    """Also remembers the stream sequence of the last token event committed (`changed_seq`), by this
    leader or by another one on the same database.

    The auth hot path keeps the table in memory and reloads it only once the projection's committed
    position has reached `changed_seq`; every other event on the log leaves it untouched.
    """

    name = "api_tokens"
    tables = (ApiToken,)
    handles = (ApiTokenMinted, ApiTokenRevoked, ApiTokenPruned)

    def __init__(self) -> None:
        self.changed_seq = 0

    async def apply(self, session: AsyncSession, evt: Event, seq: int) -> None:
        match evt:
            case ApiTokenMinted():
                if await session.get(ApiToken, evt.token_id) is None:
                    session.add(ApiToken(token_id=evt.token_id, label=evt.label,
                                         scopes=list(evt.scopes), token_hash=evt.token_hash,
                                         prefix=evt.prefix, created_at=evt.at,
                                         expires_at=evt.expires_at, revoked_at=None))
            case ApiTokenRevoked():
                row = await session.get(ApiToken, evt.token_id)
                if row is not None and row.revoked_at is None:
                    row.revoked_at = evt.at
            case ApiTokenPruned():
                row = await session.get(ApiToken, evt.token_id)
                if row is not None:
                    await session.delete(row)
            case _:
                return
        self.changed_seq = max(self.changed_seq, seq)

    def committed(self, evt: Event, seq: int) -> None:
        self.changed_seq = max(self.changed_seq, seq)
