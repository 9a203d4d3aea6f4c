"""Answer nats-server's authorization requests: who a connection is, and what it may do now.

nats-server (configured by core.nats_callout) sends each new connection's credentials, signed by the
server, on `$SYS.REQ.USER.AUTH`; this service answers with an authorization response that carries a
user JWT signed by the callout's issuer key. A user is known by its password (the `swarm nats-auth`
folder's users.json) or by a `.creds` login (its JWT as the token, issued by the same key, and the
server's nonce signed by the JWT's nkey). Its permissions are core.nats_auth's for its role; a fellow's
request queues are those of the loads whose stage 0 is placed on it (`grants`, from the SQL rows:
leader.serving.grants), a leaf link's the union of its fellows'.

A grant is fixed for a connection's life. When the grants change (`follow`), every connection whose
grant it no longer holds is kicked (`$SYS.REQ.SERVER.<id>.KICK`, on the leader's `system` connection,
in nats-server's system account); its client reconnects and is asked about again. A fellow whose grant
only grew keeps its connections: a new stage connects anew. A leaf link is kicked on any change.
Several leaders share the callout (a queue group), each remembering what it answered; the one that
changed the grants tells the others on `swarm.auth.follow`, and each kicks its own.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

import nkeys
from nats.aio.client import Client

from core import nats_jwt
from core.nats_auth import (
    HUB_DOMAIN,
    LEADER_USER,
    OPS_USER,
    fellow_permissions,
    inbox_prefix,
    leader_permissions,
    leaf_permissions,
    ops_permissions,
)
from core.nats_callout import APP_ACCOUNT, CALLOUT_QUEUE, CALLOUT_SUBJECT, FOLLOW_SUBJECT, SYSTEM_ACCOUNT, SYSTEM_USER

log = logging.getLogger(__name__)

Grants = Mapping[str, list[str]]  # fellow id -> loads whose request queues it may use
KEPT = 100_000  # connections remembered for kicks; the oldest are forgotten first


class Refused(Exception):
    """Why a connection is refused (sent back to the server, which logs it)."""


@dataclass(frozen=True)
class Granted:
    """One connection this service authorized: where it is, who, and the grant it got."""

    server_id: str
    cid: int
    user: str
    grant: frozenset  # a fellow's loads; a leaf's (fellow, load) pairs; empty for others


class AuthCallout:
    """`issuer`: the callout's account key; `passwords` and `leaves` read the `swarm nats-auth`
    folder (user -> password, leaf -> its fellows); `grants` reads the placements now."""

    def __init__(self, issuer: nkeys.KeyPair, passwords: Callable[[], Mapping[str, str]],
                 leaves: Callable[[], Mapping[str, list[str]]], grants: Callable[[], Awaitable[Grants]]):
        self.issuer, self.passwords, self.leaves, self.grants = issuer, passwords, leaves, grants
        self.connections: dict[tuple[str, int], Granted] = {}
        self.nc: Client | None = None
        self.system: Client | None = None
        self._sub = self._follow_sub = None

    async def start(self, nc: Client, system: Client | None) -> None:
        """Answer on `nc` (the leader's connection, which the server does not ask about); kick through
        `system` (None: no kicks, a withdrawn grant lasts as long as its connection)."""
        self.nc, self.system = nc, system
        self._sub = await nc.subscribe(CALLOUT_SUBJECT, queue=CALLOUT_QUEUE, cb=self._on_request)
        self._follow_sub = await nc.subscribe(FOLLOW_SUBJECT, cb=self._on_follow)
        await nc.flush()

    async def stop(self) -> None:
        for sub in (self._sub, self._follow_sub):
            if sub is not None:
                await sub.unsubscribe()
        self._sub = self._follow_sub = None

    async def _on_follow(self, msg) -> None:
        """Another leader changed the grants: kick what this one authorized that they withdrew."""
        try:
            await self.follow(await self.grants())
        except Exception:
            log.exception("auth callout: following another leader's grants failed")

    async def _on_request(self, msg) -> None:
        try:
            answer = await self.authorize(msg.data.decode())
        except Exception:  # never leave the server waiting for its timeout
            log.exception("auth callout: a request could not be answered")
            return
        await msg.respond(answer.encode())

    async def authorize(self, request_jwt: str) -> str:
        """The signed authorization response to one request: a user JWT, or the reason it is refused."""
        try:
            claims = nats_jwt.decode(request_jwt)
        except nats_jwt.JwtError as exc:
            log.warning("auth callout: an authorization request that is not one: %s", exc)
            raise
        req = claims.get("nats") or {}
        server_id = (req.get("server_id") or {}).get("id", "")
        user_nkey = req.get("user_nkey", "")
        client = req.get("client_info") or {}
        response: dict = {"sub": user_nkey, "aud": server_id}
        try:
            user = self._identify(req.get("connect_opts") or {}, client)
            account, permissions, grant = await self._rights(user)
            token = nats_jwt.user_claims(self.issuer, user_nkey, user, account, permissions)
            response["nats"] = {"jwt": token, "type": "authorization_response", "version": 2}
            self._remember(Granted(server_id, int(client.get("id") or 0), user, grant))
        except Refused as exc:
            log.warning("auth callout: refused %s from %s: %s", client.get("kind", "a client"),
                        client.get("host", "?"), exc)
            response["nats"] = {"error": str(exc), "type": "authorization_response", "version": 2}
        return nats_jwt.encode(response, self.issuer)

    def _identify(self, opts: dict, client: dict) -> str:
        """The user a connection proves it is: by password, or by a `.creds` JWT and nonce signature."""
        token = opts.get("auth_token") or ""
        if token:
            try:
                user_claims = nats_jwt.decode(token)
            except nats_jwt.JwtError as exc:
                raise Refused(f"its token: {exc}") from None
            if user_claims.get("iss") != nats_jwt.public(self.issuer):
                raise Refused("its JWT was not issued by this swarm's callout key")
            nonce, sig = client.get("nonce") or "", opts.get("sig") or ""
            if not (nonce and sig and nats_jwt.verify_nonce(user_claims.get("sub", ""), nonce, sig)):
                raise Refused(f"{user_claims.get('name')!r}: the nonce is not signed by its JWT's key")
            return str(user_claims.get("name") or "")
        user, password = opts.get("user") or "", opts.get("pass") or ""
        known = self.passwords()
        expected = known.get(LEADER_USER if user == SYSTEM_USER else user)
        if not user or expected is None or not hmac.compare_digest(expected.encode(), password.encode()):
            raise Refused(f"unknown user or wrong password ({user or 'no user'})")
        return user

    async def _rights(self, user: str) -> tuple[str, dict, frozenset]:
        if user == SYSTEM_USER:  # the leader's kicks, nothing else
            return SYSTEM_ACCOUNT, {"publish": {"allow": ["$SYS.REQ.SERVER.*.KICK"]},
                                    "subscribe": {"allow": [inbox_prefix(SYSTEM_USER) + ".>"]}}, frozenset()
        if user == LEADER_USER:
            return APP_ACCOUNT, leader_permissions(), frozenset()
        if user == OPS_USER:
            return APP_ACCOUNT, ops_permissions(), frozenset()
        grants = await self.grants()
        if user.startswith("fellow-"):
            fellow_id = user[len("fellow-"):]
            loads = sorted(grants.get(fellow_id, []))
            try:
                return APP_ACCOUNT, fellow_permissions(fellow_id, loads=loads), frozenset(loads)
            except ValueError as exc:
                raise Refused(str(exc)) from None
        leaves = self.leaves()
        if user.startswith("leaf-") and user[len("leaf-"):] in leaves:
            fellows = leaves[user[len("leaf-"):]]
            perms = leaf_permissions(fellows, HUB_DOMAIN, {f: sorted(grants.get(f, [])) for f in fellows})
            return APP_ACCOUNT, perms, _leaf_grant(fellows, grants)
        raise Refused(f"unknown user {user!r} (ops, fellow-<id>, leaf-<name>)")

    def _remember(self, granted: Granted) -> None:
        self.connections[(granted.server_id, granted.cid)] = granted
        while len(self.connections) > KEPT:
            self.connections.pop(next(iter(self.connections)))

    def stale(self, grants: Grants) -> list[Granted]:
        """The connections whose grant `grants` no longer holds."""
        leaves = self.leaves()
        out = []
        for g in self.connections.values():
            if g.user.startswith("fellow-"):
                if not g.grant <= frozenset(grants.get(g.user[len("fellow-"):], [])):
                    out.append(g)
            elif g.user.startswith("leaf-") and g.grant != _leaf_grant(leaves.get(g.user[len("leaf-"):], []), grants):
                out.append(g)
        return out

    async def announce(self) -> None:
        """Tell every leader (this one too) to follow the grants: each kicks the connections it answered."""
        if self.nc is not None:
            await self.nc.publish(FOLLOW_SUBJECT, b"")

    async def follow(self, grants: Grants) -> list[Granted]:
        """Kick every connection whose grant `grants` withdrew (or, a leaf link's, changed); those kicked."""
        stale = self.stale(grants)
        if not stale or self.system is None:
            return []
        await asyncio.gather(*(self._kick(g) for g in stale))
        log.info("auth callout: reconnecting %s for their new grants",
                 ", ".join(sorted({g.user for g in stale})))
        return stale

    async def _kick(self, g: Granted) -> None:
        self.connections.pop((g.server_id, g.cid), None)  # its reconnect is asked about afresh
        try:
            reply = await self.system.request(f"$SYS.REQ.SERVER.{g.server_id}.KICK",
                                              json.dumps({"cid": g.cid}).encode(), timeout=5)
        except Exception as exc:  # the server is gone (its clients with it) or the request timed out
            log.warning("auth callout: could not kick %s (cid %d on %s): %s", g.user, g.cid, g.server_id[:8], exc)
            return
        error = (json.loads(reply.data or b"{}").get("error") or {}).get("description")
        if error and "no such" not in error.lower():  # one that is gone already needs no kick
            log.warning("auth callout: kicking %s (cid %d): %s", g.user, g.cid, error)


def _leaf_grant(fellows: list[str], grants: Grants) -> frozenset:
    return frozenset((f, load) for f in fellows for load in grants.get(f, []))
