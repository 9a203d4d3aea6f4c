"""Which fellow may pull which load's requests (issue 38), on a nats-server this leader manages.

A fellow's NATS user may pull from, and ack on, the request consumer (`load-<id>`) of a load only where
the leader placed that load's stage 0 on it (a one-stage load, a ring's head; each replica's): one
compromised fellow cannot take another load's queued prompts. The grants follow the loads' SQL rows
(stage 0 rows still loading or ready, of loads not ended); this module is their one owner. It writes
them into the server's users (core.nats_auth.AuthDir.set_grants) and reloads the server:

- before a LoadStage command goes out (`sync` in LoadCommands), so the stage never pulls before its
  grant is there (the stage still retries a refused first pull briefly: fellow.runtime.server.intake);
- after a load ended or lost a replica (the reactions), so the fellow loses the grant;
- at the leader's start, whatever was written before.

Only with SWARM_NATS_AUTH_DIR (`swarm up` sets it for the nats-server it starts); without it, the
server's users are not the leader's to change, and any fellow may pull any load's requests.

Where that folder holds the callout's key (`swarm nats-auth --callout`, core.nats_callout), no file is
rewritten: the leader answers the server's auth callout itself (leader.auth_callout) with the grants
the rows say at each login, and `sync` disconnects the connections whose grant was withdrawn, on a
single server, a cluster or a hub with leaf nodes alike.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.bus import connect
from core.nats_auth import AuthDir, Credentials
from core.nats_callout import SYSTEM_USER, CalloutDir
from core.nats_server import reload_server
from core.settings import Settings
from leader.auth_callout import AuthCallout
from leader.db.tables import Load, LoadStage
from leader.serving.rows import ACTIVE, SERVING

log = logging.getLogger(__name__)

GRANTED = (*ACTIVE, "unloading")  # an unloading load's stage still acks what it took


class RequestGrants:
    def __init__(self, settings: Settings, sessions: async_sessionmaker):
        self.sessions = sessions
        folder = settings.nats.auth_dir
        self.auth = AuthDir(folder) if folder else None
        self.url = settings.nats.url or ""
        self._lock = asyncio.Lock()
        self.callout: AuthCallout | None = None
        self._system = None

    async def start(self, nc) -> None:
        """Answer the auth callout where the folder turns it on (on `nc`, kicking through a `system`
        connection of its own); then sync what the rows say, whatever the server had from before."""
        if self.auth is not None and CalloutDir(self.auth).enabled():
            auth = self.auth
            self.callout = AuthCallout(CalloutDir(auth).issuer(), auth.passwords, auth.leaves, self.placed)
            await self.callout.start(nc, None)
            creds = Credentials(SYSTEM_USER, auth.passwords()["leader"])
            self._system = self.callout.system = await connect(self.url or nc.connected_url.geturl(),
                                                               "leader-system", credentials=creds)
        await self.sync(force=True)

    async def stop(self) -> None:
        if self.callout is not None:
            await self.callout.stop()
        if self._system is not None and not self._system.is_closed:
            await self._system.close()

    async def placed(self) -> dict[str, list[str]]:
        """fellow id -> the loads whose stage 0 it runs (loading or ready), from the loads' rows."""
        async with self.sessions() as session:
            rows = await session.execute(
                select(LoadStage.fellow_id, LoadStage.load_id).join(Load, Load.load_id == LoadStage.load_id)
                .where(LoadStage.stage == 0, LoadStage.state.in_(SERVING), Load.state.in_(GRANTED)))
        grants: dict[str, list[str]] = {}
        for fellow_id, load_id in rows.all():
            grants.setdefault(fellow_id, []).append(load_id)
        return grants

    async def sync(self, force: bool = False) -> None:
        """Write the grants the rows say and reload the server, where they changed (`force`: anyway)."""
        if self.auth is None:
            return
        async with self._lock:
            grants = await self.placed()
            if self.callout is not None:  # the server asks at each login; withdrawn grants are kicked
                await self.callout.follow(grants)
                await self.callout.announce()  # the other leaders' connections too
                return
            try:
                changed = await asyncio.to_thread(self.auth.set_grants, grants)
            except (OSError, ValueError) as exc:  # its stages' first pulls are refused: the load fails
                log.error("request grants could not be written to %s: %s", self.auth.config, exc)
                return
            if not (changed or force):
                return
            if not reload_server(self.auth.pid_file):
                log.warning("request grants written to %s, but no nats-server runs under %s to reload them",
                            self.auth.config, self.auth.pid_file)
                return
            said = "; ".join(f"{f}: {', '.join(sorted(loads))}" for f, loads in sorted(grants.items()))
            log.info("request grants: %s", said or "none")
