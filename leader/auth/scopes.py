"""Token scopes: read < operate < admin, each implying those below it."""

from __future__ import annotations

from typing import Iterable

SCOPES = ("read", "operate", "admin")
PUBLIC = "public"  # a route that needs no token at all (health, OpenAPI schema, static assets)
ROUTE_SCOPES = (PUBLIC, *SCOPES)
_RANK = {name: rank for rank, name in enumerate(SCOPES, start=1)}


def canonical(scopes: Iterable[str]) -> list[str]:
    """Known scopes, deduplicated, in ascending order; unknown names are dropped."""
    wanted = set(scopes)
    return [s for s in SCOPES if s in wanted]


def grants(held: Iterable[str], needed: str) -> bool:
    """Whether a token holding `held` may call a route that needs `needed`."""
    if needed == PUBLIC:
        return True
    return max((_RANK.get(s, 0) for s in held), default=0) >= _RANK[needed]


def effective(held: Iterable[str]) -> list[str]:
    """Every scope `held` grants, implied ones included."""
    return [s for s in SCOPES if grants(held, s)]
