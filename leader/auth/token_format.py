"""The token string: `sk-swarm-<base62 secret><base62 CRC32>`, its SHA-256 hash and display prefix."""

from __future__ import annotations

import hashlib
import secrets
import zlib

TOKEN_PREFIX = "sk-swarm-"
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
SECRET_BYTES = 32  # 256 random bits
BODY_CHARS = 43  # the fewest base62 digits that hold 256 bits
CHECKSUM_CHARS = 6  # the fewest base62 digits that hold a CRC32
TOKEN_CHARS = len(TOKEN_PREFIX) + BODY_CHARS + CHECKSUM_CHARS
DISPLAY_CHARS = len(TOKEN_PREFIX) + 4
_DIGITS = frozenset(ALPHABET)


def base62(value: int, width: int) -> str:
    """`value` in base62, left-padded with zeros to `width` digits."""
    out = []
    while value:
        value, digit = divmod(value, 62)
        out.append(ALPHABET[digit])
    if len(out) > width:
        raise ValueError(f"{len(out)} base62 digits do not fit in {width}")
    return "".join(reversed(out)).rjust(width, ALPHABET[0])


def checksum(body: str) -> str:
    """CRC32 of the body: lets secret scanners tell a real token from look-alike text offline."""
    return base62(zlib.crc32(body.encode("ascii")), CHECKSUM_CHARS)


def new_secret() -> str:
    body = base62(int.from_bytes(secrets.token_bytes(SECRET_BYTES), "big"), BODY_CHARS)
    return TOKEN_PREFIX + body + checksum(body)


def well_formed(token: str) -> bool:
    """Right prefix, length, alphabet and checksum; says nothing about whether the token exists."""
    if len(token) != TOKEN_CHARS or not token.startswith(TOKEN_PREFIX):
        return False
    rest = token[len(TOKEN_PREFIX):]
    if not _DIGITS.issuperset(rest):
        return False
    body, check = rest[:BODY_CHARS], rest[BODY_CHARS:]
    return checksum(body) == check


def hash_secret(token: str) -> str:
    """What the event log and the database keep instead of the token: its SHA-256, hex."""
    return hashlib.sha256(token.encode("ascii")).hexdigest()


def display_prefix(token: str) -> str:
    """The few leading characters that name a token in lists and error messages."""
    return token[:DISPLAY_CHARS]


def new_token_id() -> str:
    return "tok_" + secrets.token_hex(8)
