"""The leader's token authority: authenticate a bearer header, mint, revoke, and the enforcement rule."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

from sqlalchemy.ext.asyncio import async_sessionmaker

from events.api_tokens import ApiTokenMinted, ApiTokenRevoked
from leader.auth import token_format
from leader.auth.pruner import TokenPruner
from leader.auth.registry import PROJECTION, TokenRecord, TokenRegistry, TokenTable
from leader.auth.scopes import canonical, effective, grants
from leader.auth.token_file import imports, read_tokens, write_tokens
from leader.errors import ApiError
from leader.projectors.runner import ProjectionRunner
from leader.services import Publish

log = logging.getLogger(__name__)

MAX_HEADER_CHARS = 512  # far above a real token; anything longer is refused before hashing


@dataclass(frozen=True)
class Identity:
    """Who a request authenticated as; handlers read it with `leader.auth.guard.token_of`."""

    token_id: str
    label: str
    prefix: str
    scopes: tuple[str, ...]  # effective: implied scopes included


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def bearer_secret(header: str | None) -> str:
    """The token out of an Authorization header, or a 401 that never repeats more than its prefix."""
    if header is None or not header.strip():
        raise unauthorized("Missing API key: send the header 'Authorization: Bearer sk-swarm-...'.")
    if len(header) > MAX_HEADER_CHARS or not header.isascii() or not header.isprintable():
        raise unauthorized("Malformed Authorization header: expected 'Bearer <token>'.")
    parts = header.split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        raise unauthorized("Malformed Authorization header: expected 'Bearer <token>'.")
    token = parts[1]
    if not token_format.well_formed(token):
        raise unauthorized("Incorrect API key provided: not a Swarm API key (sk-swarm-...).")
    return token


class AuthService:
    """Enforcement is on when any unrevoked token exists (expired ones count) or it is required.

    `clock` is injectable so tests can move time past an expiry or the prune horizon.
    """

    def __init__(self, settings, sessions: async_sessionmaker, projections: ProjectionRunner, publish: Publish,
                 clock: Callable[[], float] = time.time, prune_interval_s: float = 600.0):
        self.settings = settings
        self.sessions = sessions
        self.projections = projections
        self.publish = publish
        self.clock = clock
        self.registry: TokenRegistry | None = None
        self.pruner = TokenPruner(self, prune_interval_s)
        self._mint_lock = asyncio.Lock()

    def start(self) -> None:
        """Called by Leader.start once the projections run: the registry and the prune sweep."""
        self.registry = TokenRegistry(self.sessions, self.projections)
        self.pruner.start()

    async def sync_file(self) -> None:
        """SWARM_API_TOKENS_FILE (leader.auth.token_file): add the tokens it holds that the log lacks, write
        it from the table, and again whenever the table changes. TokensFileError where it is no tokens file."""
        path = self.settings.leader.tokens_file
        if path is None:
            return
        entries = read_tokens(path)
        added = imports(entries, await self.table())
        for evt in added:
            await self.publish(evt, wait=[PROJECTION])
        if added:
            log.info("added %d API token event(s) from %s", len(added), path)
        self.registry.on_reload = lambda table: write_tokens(path, table)
        write_tokens(path, await self.table())

    async def stop(self) -> None:
        await self.pruner.stop()

    async def table(self) -> TokenTable:
        return await self.registry.current()

    def enforced(self, table: TokenTable) -> bool:
        return self.settings.leader.require_api_token or table.live > 0

    async def check(self, header: str | None, needed: str, first_run_open: bool = False) -> Identity | None:
        """The identity a request may act as for a route needing `needed`; None in open mode."""
        table = await self.table()
        if not self.enforced(table) or (first_run_open and table.live == 0):
            return None  # open first-run mode: a client's placeholder key is not an error
        identity = self.authenticate(bearer_secret(header), table)
        if not grants(identity.scopes, needed):
            raise ApiError(403, f"API key {identity.prefix}... lacks the '{needed}' scope "
                                f"(it has: {', '.join(identity.scopes)}).", code="insufficient_scope")
        return identity

    def authenticate(self, token: str, table: TokenTable) -> Identity:
        digest = token_format.hash_secret(token)
        shown = token_format.display_prefix(token)
        record = table.by_hash.get(digest)
        if record is None or not hmac.compare_digest(record.token_hash, digest):
            raise unauthorized(f"Incorrect API key provided: {shown}...")
        if record.revoked_at is not None:
            raise unauthorized(f"API key {shown}... was revoked at {_iso(record.revoked_at)}.")
        if record.expired(self.clock()):
            raise unauthorized(f"API key {shown}... expired at {_iso(record.expires_at)}.")
        return Identity(record.token_id, record.label, record.prefix, tuple(effective(record.scopes)))

    async def mint(self, label: str, scopes: list[str], expires_in: float | None,
                   caller: Identity | None) -> tuple[TokenRecord, str]:
        """Publish a new token and return it once the projection holds it, with its secret."""
        async with self._mint_lock:  # the "first token gets admin" check and its mint are one step
            table = await self.table()
            if caller is None and table.live > 0:  # another request minted since the guard let us in
                raise unauthorized("A token exists now; authenticate with an admin token to mint another.")
            wanted = canonical([*scopes, "admin"] if table.live == 0 else scopes)
            secret = token_format.new_secret()
            now = self.clock()
            evt = ApiTokenMinted(token_id=token_format.new_token_id(), label=label, scopes=wanted,
                                 token_hash=token_format.hash_secret(secret),
                                 prefix=token_format.display_prefix(secret),
                                 expires_at=None if expires_in is None else now + expires_in, at=now)
            await self.publish(evt, wait=[PROJECTION])
            record = (await self.table()).by_id[evt.token_id]
        log.info("minted API token %s (%s, scopes %s)", record.token_id, record.prefix, ",".join(wanted))
        return record, secret

    async def revoke(self, token_id: str) -> TokenRecord:
        record = (await self.table()).by_id.get(token_id)
        if record is None:
            raise ApiError(404, f"No API token with id '{token_id}'.", code="token_not_found", param="id")
        if record.revoked_at is None:
            await self.publish(ApiTokenRevoked(token_id=token_id, at=self.clock()), wait=[PROJECTION])
            record = (await self.table()).by_id[token_id]
            log.info("revoked API token %s (%s)", token_id, record.prefix)
        return record
