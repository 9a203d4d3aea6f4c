"""NATS JWTs and nkeys, as far as Swarm needs them: an account key that issues user JWTs (the auth
callout's issuer, leader.auth_callout), the user JWTs themselves, reading a server's authorization
request, and `.creds` files (a user JWT and its nkey seed: SWARM_NATS_CREDS).

A NATS JWT is three base64url parts, header `{"typ":"JWT","alg":"ed25519-nkey"}`, claims, and the
ed25519 signature of the first two by the nkey named in `iss` (github.com/nats-io/jwt, v2 claims).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import time
from pathlib import Path

import nacl.exceptions
import nacl.signing
import nkeys

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_CREDS = re.compile(r"-{3,}[^\n]*BEGIN ([A-Z ]+?)-{3,}\s*\n\s*([^\s-][^\n]*)\s*\n\s*-{3,}[^\n]*END")


class JwtError(ValueError):
    """A token or a .creds file that is not what it should be; the message says what."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise JwtError("not base64url") from None


def new_key(prefix: int = nkeys.PREFIX_BYTE_ACCOUNT) -> nkeys.KeyPair:
    """A fresh nkey (an account's by default: `A...`, seed `SA...`)."""
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def key_from_seed(seed: str | bytes) -> nkeys.KeyPair:
    try:
        return nkeys.from_seed(bytearray(seed.encode() if isinstance(seed, str) else seed))
    except nkeys.NkeysError as exc:
        raise JwtError(f"not an nkey seed: {exc}") from None


def public(kp: nkeys.KeyPair) -> str:
    return kp.public_key.decode()


def verify_key(public_key: str) -> nacl.signing.VerifyKey:
    """The ed25519 key behind a public nkey (`U...`, `A...`, `N...`), its checksum checked."""
    try:
        raw = base64.b32decode(public_key + "=" * (-len(public_key) % 8))
    except (binascii.Error, ValueError):
        raise JwtError(f"not a public nkey: {public_key[:12]!r}") from None
    if len(raw) != 35 or nkeys.crc16(raw[:-2]) != int.from_bytes(raw[-2:], "little"):
        raise JwtError(f"not a public nkey: {public_key[:12]!r}")
    return nacl.signing.VerifyKey(raw[1:33])


def encode(claims: dict, kp: nkeys.KeyPair) -> str:
    """Sign `claims` (their `iss` set to this key, `iat` and `jti` filled in) as a NATS JWT."""
    claims = {"iat": int(time.time()), **claims, "iss": public(kp)}
    claims.pop("jti", None)
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()).decode()
    head = _b64(json.dumps(HEADER, separators=(",", ":")).encode())
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    return f"{head}.{body}.{_b64(kp.sign(f'{head}.{body}'.encode()))}"


def decode(token: str, now: float | None = None) -> dict:
    """The claims of a NATS JWT whose signature is by its `iss` and which has not expired."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise JwtError("a JWT has three parts")
    try:
        header, claims = json.loads(_unb64(parts[0])), json.loads(_unb64(parts[1]))
    except json.JSONDecodeError:
        raise JwtError("a JWT part is not JSON") from None
    if not isinstance(header, dict) or header.get("alg") not in ("ed25519-nkey", "ed25519"):
        raise JwtError(f"not a NATS JWT (alg {header.get('alg') if isinstance(header, dict) else header!r})")
    if not isinstance(claims, dict) or not isinstance(claims.get("iss"), str):
        raise JwtError("a NATS JWT names its issuer")
    try:
        verify_key(claims["iss"]).verify(f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2]))
    except nacl.exceptions.BadSignatureError:
        raise JwtError("the JWT's signature is not its issuer's") from None
    if claims.get("exp") and claims["exp"] <= (time.time() if now is None else now):
        raise JwtError("the JWT has expired")
    return claims


def verify_nonce(user_nkey: str, nonce: str, sig: str) -> bool:
    """Whether `sig` (base64, url-safe or standard) signs the server's `nonce` with `user_nkey`."""
    for decoder in (_unb64, base64.b64decode):
        try:
            verify_key(user_nkey).verify(nonce.encode(), decoder(sig))
            return True
        except (JwtError, binascii.Error, ValueError, nacl.exceptions.BadSignatureError):
            continue
    return False


def user_claims(issuer: nkeys.KeyPair, user_nkey: str, name: str, account: str, permissions: dict,
                expires_s: float | None = None) -> str:
    """A user JWT for `user_nkey` in `account` (its placement, config mode: `aud`), named `name`, with
    `permissions` in nats-server's config shape ({"publish": {"allow": [...]}, "subscribe": ...,
    "allow_responses": bool}), expiring after `expires_s` (None: never)."""
    nats: dict = {"pub": dict(permissions.get("publish") or {}), "sub": dict(permissions.get("subscribe") or {}),
                  "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}
    if permissions.get("allow_responses"):
        nats["resp"] = {"max": 1, "ttl": 0}
    claims = {"sub": user_nkey, "name": name, "aud": account, "nats": nats}
    if expires_s is not None:
        claims["exp"] = int(time.time() + expires_s)
    return encode(claims, issuer)


def write_creds(path: Path, user_jwt: str, seed: bytes | bytearray | str) -> Path:
    """A `.creds` file as nats-py and the nats CLI read it (mode 0600)."""
    seed = bytes(seed).decode() if isinstance(seed, (bytes, bytearray)) else seed
    text = (f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(path)


def read_creds(path: Path) -> tuple[str, str]:
    """(user JWT, nkey seed) of a `.creds` file; JwtError naming the file where it is not one."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise JwtError(f"cannot read the .creds file {path}: {exc.strerror or exc}") from None
    blocks = {kind.strip(): body.strip() for kind, body in _CREDS.findall(text)}
    token, seed = blocks.get("NATS USER JWT"), blocks.get("USER NKEY SEED")
    if not token or not seed:
        raise JwtError(f"{path} is not a NATS .creds file (it needs a user JWT and a user nkey seed)")
    return token, seed


def creds_user(path: Path) -> str:
    """The user a `.creds` file logs in as: its JWT's `name` (Swarm's `fellow-<id>`, `ops`, ...)."""
    token, seed = read_creds(path)
    try:
        claims = json.loads(_unb64(token.split(".")[1]))
    except (IndexError, json.JSONDecodeError):
        raise JwtError(f"{path}: its user JWT is not a JWT") from None
    if claims.get("sub") != public(key_from_seed(seed)):
        raise JwtError(f"{path}: its nkey seed is not the key its JWT was issued to")
    name = claims.get("name")
    if not isinstance(name, str) or not name:
        raise JwtError(f"{path}: its user JWT names no user")
    return name
