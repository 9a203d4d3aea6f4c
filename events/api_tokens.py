"""API token lifecycle events; only hashes and display prefixes ever travel, never a secret."""

from __future__ import annotations

import unicodedata

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


# controls, bidi and other formatting, surrogates, private and unassigned code points, line separators;
# the joiners (U+200C, U+200D) stay, which scripts and emoji sequences need
_UNPRINTABLE = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


def unprintable(c: str) -> bool:
    """Whether a terminal would obey the character rather than show it (a token label must not hold one)."""
    return unicodedata.category(c) in _UNPRINTABLE and c not in "\u200c\u200d"
