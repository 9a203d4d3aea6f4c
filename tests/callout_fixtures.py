"""What the auth callout tests share: a `swarm nats-auth --callout` folder, a real SQLite whose stage
rows place the loads, the leader's RequestGrants answering the callout, and logins that tell a refusal
(the server's permissions error, or, through a leaf node, no responders) from an answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import nats
from nats.errors import NoRespondersError
from sqlalchemy import update
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.bus import connect, ensure_streams
from core.nats_auth import LEADER_USER, AuthDir, Credentials, inbox_prefix
from core.nats_callout import CalloutDir
from events import subjects
from leader.db.engine import make_engine, upgrade
from leader.db.tables import Load, LoadStage
from leader.serving.grants import RequestGrants
from tests.conftest import make_settings

STREAM = subjects.REQUESTS_STREAM
PLACED = {"alpha": "f1", "beta": "f2", "gamma": "h1"}  # load -> the fellow its stage 0 is on


def callout_folder(root) -> AuthDir:
    auth = AuthDir(root / "auth")
    auth.ensure(["f1", "f2"], leaves={"home": ["h1"]})
    CalloutDir(auth).ensure()
    return auth


async def placed_db(root) -> tuple[str, async_sessionmaker]:
    url = f"sqlite+aiosqlite:///{root / 'swarm.db'}"
    await upgrade(url)
    sessions = async_sessionmaker(make_engine(url), expire_on_commit=False)
    async with sessions() as s:
        for load_id, fellow in PLACED.items():
            s.add(Load(load_id=load_id, model_id=load_id, state="ready", num_stages=1))
            s.add(LoadStage(load_id=load_id, stage=0, replica=0, fellow_id=fellow, state="ready"))
        await s.commit()
    return url, sessions


async def move(sessions: async_sessionmaker, load_id: str, fellow: str) -> None:
    async with sessions() as s:
        await s.execute(update(LoadStage).where(LoadStage.load_id == load_id).values(fellow_id=fellow))
        await s.commit()


@dataclass
class Login:
    """A connection that records the server's permission errors and its disconnects, as events."""

    nc: object = None
    denials: list[str] = field(default_factory=list)
    denied: asyncio.Event = field(default_factory=asyncio.Event)
    disconnects: list[float] = field(default_factory=list)
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    back: asyncio.Event = field(default_factory=asyncio.Event)


async def login(url: str, user: str, password: str | None = None, creds=None) -> Login:
    lg = Login()

    async def on_error(exc):
        lg.denials.append(str(exc))
        lg.denied.set()

    async def on_disconnect():
        lg.disconnects.append(time.monotonic())
        lg.gone.set()

    async def on_reconnect():
        lg.back.set()

    callbacks = dict(error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect)
    if creds is not None:
        token = creds.read_text().split("-----BEGIN NATS USER JWT-----")[1].split("---")[0].strip()
        lg.nc = await connect(url, name=user, user_credentials=str(creds), token=token,
                              inbox_prefix=inbox_prefix(user), **callbacks)
    else:
        lg.nc = await connect(url, name=user, credentials=Credentials(user, password), **callbacks)
    return lg


async def refused(lg: Login, subject: str, payload: bytes = b"") -> bool:
    """True where NATS refuses this request for want of rights (a permissions error naming the subject,
    or no responders: what a hub shows a leaf for a subject its link may not use); False where it is
    answered. Whichever comes first."""
    answer = asyncio.ensure_future(lg.nc.request(subject, payload, timeout=30))
    seen = len(lg.denials)
    try:
        while True:
            if any(f'"{subject.lower()}"' in e.lower() for e in lg.denials[seen:]):
                return True
            if answer.done():
                try:
                    answer.result()
                except NoRespondersError:
                    return True
                return False
            lg.denied.clear()
            denied = asyncio.ensure_future(lg.denied.wait())
            await asyncio.wait([answer, denied], return_when=asyncio.FIRST_COMPLETED)
            denied.cancel()
    finally:
        if not answer.done():
            answer.cancel()
            with contextlib.suppress(asyncio.CancelledError, nats.errors.Error):
                await answer


def api(kind: str, load_id: str, *rest: str, domain: str | None = None) -> str:
    prefix = f"$JS.{domain}.API" if domain else "$JS.API"
    return ".".join([f"{prefix}.CONSUMER.{kind}.{STREAM}", subjects.request_consumer(load_id), *rest])


def create_payload(load_id: str) -> bytes:
    durable = subjects.request_consumer(load_id)
    return json.dumps({"stream_name": STREAM, "config": {
        "name": durable, "durable_name": durable, "filter_subject": subjects.request(load_id),
        "ack_policy": "explicit"}}).encode()


PULL = json.dumps({"batch": 1, "no_wait": True}).encode()


def attempts(load_id: str) -> dict[str, tuple[str, bytes]]:
    """Every way at a load's request consumer, as a fellow would send it."""
    return {"create": (api("CREATE", load_id, subjects.request(load_id)), create_payload(load_id)),
            "info": (api("INFO", load_id), b""), "pull": (api("MSG.NEXT", load_id), PULL),
            "ack": (f"$JS.ACK.{STREAM}.{subjects.request_consumer(load_id)}.1.1.1.0.0", b"+ACK")}


@contextlib.asynccontextmanager
async def callout_leader(root, auth: AuthDir, nats_url: str, sessions_url: str):
    """The leader's side: its connection, the streams, and RequestGrants answering the callout."""
    settings = make_settings(root, nats_url, sessions_url, SWARM_NATS_AUTH_DIR=auth.path)
    sessions = async_sessionmaker(make_engine(sessions_url), expire_on_commit=False)
    nc = await connect(nats_url, name="leader", credentials=auth.credentials(LEADER_USER))
    grants = RequestGrants(settings, sessions)
    try:
        await ensure_streams(nc.jetstream())
        await grants.start(nc)
        yield nc, grants, sessions
    finally:
        await grants.stop()
        await nc.close()
