"""API token lifecycle events; only hashes and display prefixes ever travel, never a secret."""

from __future__ import annotations

from events.base import Event


class ApiTokenMinted(Event, frozen=True, tag="api_token.minted"):
    token_id: str
    label: str
    scopes: list[str]
    token_hash: str  # SHA-256 hex of the secret
    prefix: str  # a short display prefix, e.g. "sk-swarm-ab12"
    expires_at: float | None = None


class ApiTokenRevoked(Event, frozen=True, tag="api_token.revoked"):
    token_id: str


class ApiTokenPruned(Event, frozen=True, tag="api_token.pruned"):
    token_id: str
    expired_at: float
