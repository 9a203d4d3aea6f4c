"""Per-load authority through NATS auth callout (issue 54): the nats-server config that hands every
connection but the leader's to the leader's callout service (leader.auth_callout), and the keys and
`.creds` files for it.

With `callout.nk` in a `swarm nats-auth` folder (`swarm nats-auth --callout`), that folder's `auth.conf`
no longer lists the fellows: it names the leader (an `auth_users` member, which the callout does not
ask about) and the callout's issuer, an account nkey whose seed is `callout.nk`. Every other
connection (ops, fellows, a leaf node's link, the leader's `system` connection) is sent by the server
to `$SYS.REQ.USER.AUTH`; the leader answers with a user JWT signed by that key whose permissions are
core.nats_auth's for that user, with the request queues of the loads placed on it now. Because the
server asks the leader, the same config serves a single server, every node of a cluster and a hub
whose leaf nodes link in, and no file changes when placement does: the leader disconnects a
connection whose grant it withdrew, and the server asks again when it reconnects.

A fellow may log in with a `.creds` file (`<user>.creds`, SWARM_NATS_CREDS) instead of a password: a
user JWT issued by the same key, for the fellow's own nkey. The client sends the JWT as its token
and signs the server's nonce with the nkey; the callout checks both.
"""

from __future__ import annotations

import json
from pathlib import Path

import nkeys

from core import nats_jwt
from core.nats_auth import LEADER_USER, AuthDir, leader_permissions

CALLOUT_SEED = "callout.nk"
SYSTEM_USER = "system"  # the leader's second connection, in nats-server's system account: it kicks
SYSTEM_ACCOUNT = "$SYS"
APP_ACCOUNT = "$G"  # where every other user is placed: the config's one account
CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"
CALLOUT_QUEUE = "swarm-auth-callout"  # several leaders answer in turn
FOLLOW_SUBJECT = "swarm.auth.follow"  # core NATS, leaders only: every leader kicks what it authorized


def _deny_all() -> dict:
    return {"publish": {"deny": [">"]}, "subscribe": {"deny": [">"]}}


def callout_config(leader_password: str, issuer: str, nonce_nkey: str) -> str:
    """The `authorization` block: the leader as the one user the server knows, everyone else asked of
    the callout whose user JWTs `issuer` signs. `nonce_nkey`: a user nkey nobody holds the seed of,
    listed so that the server sends a nonce (a `.creds` login signs it) and refused everything."""
    block = {
        "users": [{"user": LEADER_USER, "password": leader_password, "permissions": leader_permissions()},
                  {"nkey": nonce_nkey, "permissions": _deny_all()}],
        "auth_callout": {"issuer": issuer, "auth_users": [LEADER_USER]},
    }
    return "authorization: " + json.dumps(block, indent=1) + "\n"


class CalloutDir:
    """The callout's half of a `swarm nats-auth` folder: `callout.nk` (the issuer's seed; its presence
    turns the callout on) and `<user>.creds` (a user JWT and nkey seed per fellow and for ops)."""

    def __init__(self, auth: AuthDir | Path):
        self.auth = auth if isinstance(auth, AuthDir) else AuthDir(Path(auth))

    @property
    def seed_file(self) -> Path:
        return self.auth.path / CALLOUT_SEED

    def enabled(self) -> bool:
        return self.seed_file.exists()

    def issuer(self) -> nkeys.KeyPair:
        try:
            return nats_jwt.key_from_seed(self.seed_file.read_text().strip())
        except OSError as exc:
            raise nats_jwt.JwtError(f"cannot read the callout's key {self.seed_file}: {exc.strerror or exc}") from None

    def creds(self, user: str) -> Path:
        return self.auth.path / f"{user}.creds"

    def ensure(self) -> Path:
        """Turn the callout on for this folder (a new issuer key where none is), write its `auth.conf`
        and a `.creds` file per fellow and for ops; the config's path. Run after AuthDir.ensure."""
        passwords = self.auth.passwords()
        if LEADER_USER not in passwords:
            raise ValueError(f"{self.auth.path} has no users yet: run `swarm nats-auth` first")
        if not self.enabled():
            self.auth._write(CALLOUT_SEED, nats_jwt.new_key().seed.decode() + "\n")
        issuer = self.issuer()
        nonce_key = nats_jwt.public(nats_jwt.new_key(nkeys.PREFIX_BYTE_USER))
        config = callout_config(passwords[LEADER_USER], nats_jwt.public(issuer), nonce_key)
        self.auth._write(self.auth.config.name, config)
        for user in passwords:
            if user.startswith("fellow-") or user == "ops":
                self.write_creds(user, issuer)
        return self.auth.config

    def write_creds(self, user: str, issuer: nkeys.KeyPair) -> Path:
        """`<user>.creds`: a fresh nkey and a user JWT for it (no permissions of its own: the callout
        gives them at each login), kept where one exists."""
        target = self.creds(user)
        if not target.exists():
            key = nats_jwt.new_key(nkeys.PREFIX_BYTE_USER)
            token = nats_jwt.user_claims(issuer, nats_jwt.public(key), user, APP_ACCOUNT, {})
            nats_jwt.write_creds(target, token, key.seed)
        return target
