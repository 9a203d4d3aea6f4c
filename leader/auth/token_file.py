"""SWARM_API_TOKENS_FILE: the leader's API tokens as a file beside its database (the spec's token store).

The event log stays the one owner of tokens (``api_token.*`` events, projected into ``api_tokens``);
the file is a copy kept in step with it, both ways:
- at start, a token the file holds and the log does not (tokens provisioned by hand or by a config
  tool, or carried over from another store) is published as minted, revoked where the file says so,
  under an event id of its own so two leaders that import one file add it once;
- whenever the leader's token table changes, the file is written anew (atomically, mode 0600).
Only hashes and public fields go in the file, never a secret: it lets nobody in, but it says which
tokens exist, so it is kept private all the same. A file the leader cannot read stops the leader at
start with one line saying why.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from events.api_tokens import ApiTokenMinted, ApiTokenRevoked
from leader.auth.registry import TokenRecord, TokenTable
from leader.auth.scopes import canonical

log = logging.getLogger(__name__)

FIELDS = ("id", "label", "scopes", "token_hash", "prefix", "created_at", "expires_at", "revoked_at")


class TokensFileError(ValueError):
    """The tokens file cannot be read as tokens; the message names the file and what is wrong."""


def as_entry(record: TokenRecord) -> dict:
    return {**record.fields(), "token_hash": record.token_hash}


def read_tokens(path: Path) -> list[dict]:
    """The file's tokens, checked; [] where there is no file yet."""
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        entries = data["tokens"]
        out = []
        for entry in entries:
            missing = [f for f in ("id", "label", "scopes", "token_hash", "prefix") if f not in entry]
            if missing:
                raise TokensFileError(f"a token lacks {', '.join(missing)}")
            if len(entry["token_hash"]) != 64 or any(c not in "0123456789abcdef" for c in entry["token_hash"]):
                raise TokensFileError(f"token {entry['id']}: token_hash must be a SHA-256 in hex")
            out.append({**{f: entry.get(f) for f in FIELDS}, "scopes": canonical(list(entry["scopes"]))})
        return out
    except TokensFileError as exc:
        raise TokensFileError(f"SWARM_API_TOKENS_FILE={path}: {exc}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TokensFileError(f"SWARM_API_TOKENS_FILE={path} is not a tokens file "
                              f"({{\"tokens\": [...]}}): {type(exc).__name__}: {exc}") from None


def imports(entries: list[dict], table: TokenTable) -> list:
    """The events that add the file's tokens the table lacks (minted, then revoked where it says so)."""
    events = []
    for entry in entries:
        if entry["id"] in table.by_id or entry["token_hash"] in table.by_hash:
            continue
        created = entry["created_at"] or 0.0
        events.append(ApiTokenMinted(id=f"token-file-{entry['id']}", token_id=entry["id"], label=entry["label"],
                                     scopes=entry["scopes"], token_hash=entry["token_hash"], prefix=entry["prefix"],
                                     expires_at=entry["expires_at"], **({"at": created} if created else {})))
        if entry["revoked_at"] is not None:
            events.append(ApiTokenRevoked(id=f"token-file-revoked-{entry['id']}", token_id=entry["id"],
                                          at=entry["revoked_at"]))
    return events


def write_tokens(path: Path, table: TokenTable) -> None:
    """The table into ``path``: written beside it first, then renamed over it, readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"tokens": [as_entry(r) for r in table.records]}, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
