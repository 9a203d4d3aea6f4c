"""NATS connection, JetStream streams, and the publish helpers every side uses."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging

import msgspec
import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NoStreamResponseError, ServiceUnavailableError

from core.nats_auth import Credentials
from events.base import Event, encode
from events.subjects import STREAMS, StreamSpec, event

log = logging.getLogger(__name__)


class BusUnavailable(RuntimeError):
    """NATS could not be reached; the message names the URL."""


async def connect(url: str, name: str, timeout: float = 5.0, credentials: Credentials | None = None,
                  **options) -> Client:
    """Connect to one or more comma-separated NATS URLs, failing fast with a clear error.

    With `credentials` the client logs in as that user and takes its replies on its own inbox."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    errors: list[str] = []

    async def _err(e: Exception) -> None:
        errors.append(str(e) or type(e).__name__)

    opts = dict(
        name=name, connect_timeout=min(timeout, 2.0), allow_reconnect=True,
        max_reconnect_attempts=-1, reconnect_time_wait=0.5, error_cb=_err,
    )
    if credentials is not None:
        opts.update(credentials.connect_options())
    opts.update(options)
    try:
        return await asyncio.wait_for(nats.connect(servers, **opts), timeout)
    except (asyncio.TimeoutError, OSError, nats.errors.NoServersError) as exc:
        reason = errors[-1] if errors else exc or type(exc).__name__
        raise BusUnavailable(f"cannot reach NATS at {url}: {reason}") from None
    except nats.errors.Error as exc:  # refused: an authorization violation, a bad server answer
        raise BusUnavailable(f"NATS at {url} refused {name}: {errors[-1] if errors else exc}") from None


async def settle(nc: Client, timeout: float = 5.0) -> None:
    """Return once the server has processed everything this connection sent so far (its SUBs above
    all), so another connection may count on that interest.

    nats-py's flush() alone is not that barrier: it writes its PING straight to the socket, while the
    commands queued before it (a subscribe's SUB) go out later through the flusher task, so the PONG
    can come back before the server has seen them. By the time the first flush returns the flusher
    has written them, and a second PING goes out behind them."""
    await nc.flush(timeout=timeout)
    await nc.flush(timeout=timeout)


async def close_quietly(nc: Client, timeout: float = 2.0) -> None:
    """Flush what was published, then close. (drain() can wait out its whole timeout on a pull
    subscription with a fetch in flight; what we publish is acked already, so close is enough.)"""
    try:
        await nc.flush(timeout=timeout)
    except Exception:
        pass
    try:
        await nc.close()
    except Exception:
        pass


async def unsubscribe_quietly(sub) -> None:
    """End a subscription, if any; a connection already closed has ended it."""
    if sub is None:
        return
    try:
        await sub.unsubscribe()
    except Exception:
        pass


def stream_config(spec: StreamSpec, replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        num_replicas=replicas,
        name=spec.name,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.WORK_QUEUE if spec.retention == "workqueue" else RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=spec.max_age_s or None,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        duplicate_window=spec.duplicate_window_s,
    )


async def ensure_streams(js: JetStreamContext, replicas: int = 1, wait_s: float = 30.0) -> None:
    """Create every stream, or bring an existing one to the declared configuration (`replicas`
    copies of each in a cluster: SWARM_NATS_REPLICAS). A cluster that is still electing its JetStream
    leader does not answer yet: each step is tried again for up to `wait_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    for spec in STREAMS:
        cfg = stream_config(spec, replicas)
        while True:
            try:
                try:
                    await js.add_stream(cfg)
                except BadRequestError as exc:
                    if exc.err_code == NO_PEERS_YET:  # a cluster whose nodes have not all joined: not yet
                        raise _NotPlaced(exc.description) from None
                    await js.update_stream(cfg)  # it exists: bring it to this configuration
                break
            except (*_RETRYABLE, _NotPlaced) as exc:
                if loop.time() > deadline:
                    if isinstance(exc, _NotPlaced):
                        raise BusUnavailable(f"JetStream cannot place stream {spec.name} with {replicas} replicas "
                                             f"after {wait_s:g}s ({exc}): are {replicas} cluster nodes up? "
                                             f"(SWARM_NATS_REPLICAS)") from None
                    raise
                log.info("JetStream not ready for stream %s (%s); trying again", spec.name, exc or type(exc).__name__)
                await asyncio.sleep(0.5)


NO_PEERS_YET = 10005  # JetStream's "no suitable peers for placement": too few cluster nodes up for its replicas


class _NotPlaced(Exception):
    """A stream the cluster cannot place yet (too few of its nodes have joined)."""


async def wait_streams(js: JetStreamContext, timeout: float = 60.0) -> None:
    """Wait until every stream exists: what a fellow does when it may not create them (NATS auth
    on: the leader creates them). By their names (`$JS.API.STREAM.NAMES`): a fellow may not ask
    stream info (core.nats_auth.fellow_permissions)."""
    deadline = asyncio.get_running_loop().time() + timeout
    for spec in STREAMS:
        while True:
            try:
                if await js.find_stream_name_by_subject(spec.subjects[0]) != spec.name:
                    raise BusUnavailable(f"{spec.subjects[0]} is another stream's")
                break
            except Exception as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise BusUnavailable(f"stream {spec.name} does not exist after {timeout:.0f}s "
                                         f"(the leader creates it): {exc or type(exc).__name__}") from None
                await asyncio.sleep(0.5)


# What a retry can cure: no answer in time, or JetStream not (yet) answering, as while a
# nats-server restarts and recovers its streams, or a cluster that lost a node elects new stream
# leaders (up to about 10 s). Nats-Msg-Id makes a retry that did land a no-op.
_RETRYABLE = (nats.errors.TimeoutError, nats.errors.NoRespondersError, NoStreamResponseError,
              ServiceUnavailableError)
RETRY_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0)  # about 15 s in all


async def publish_with_id(js: JetStreamContext, subject: str, payload: bytes, msg_id: str,
                          timeout: float = 5.0, headers: dict | None = None) -> PubAck:
    """A JetStream publish with its id, retried on timeouts and unavailable JetStream."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            return await js.publish(subject, payload, timeout=timeout,
                                    headers={**(headers or {}), "Nats-Msg-Id": msg_id})
        except _RETRYABLE as exc:
            if delay is None:
                raise
            log.warning("publish of %s on %s not acknowledged (%s); retrying", msg_id, subject,
                        type(exc).__name__)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


async def publish_event(js: JetStreamContext, evt: Event, timeout: float = 5.0) -> PubAck:
    """Publish an event on ``swarm.evt.<type>`` with its id as Nats-Msg-Id (retries dedupe).

    A fellow's connection (NATS user ``fellow-<id>``) publishes on ``swarm.evt.<type>.<id>``, the one
    subject its permissions give it, so the subject says who sent the event (leader.projectors.authority).
    With a password the id carries a mark made with it: JetStream drops a second message of an id
    whatever its subject, and no one else can take an id the publisher will use."""
    fellow_id = connection_fellow(js)
    return await publish_with_id(js, event(evt.type, fellow_id), encode(evt), _marked(js, evt.id), timeout)


def _options(js: JetStreamContext) -> dict:
    return getattr(getattr(js, "_nc", None), "options", None) or {}


def connection_fellow(js: JetStreamContext) -> str:
    """The fellow a connection logs in as (NATS user ``fellow-<id>``); "" for any other or no user."""
    user = _options(js).get("user") or ""
    return user[len("fellow-"):] if user.startswith("fellow-") else ""


def _marked(js: JetStreamContext, msg_id: str) -> str:
    password = _options(js).get("password") or ""
    if not password:
        return msg_id
    return msg_id + "." + hmac.new(password.encode(), msg_id.encode(), hashlib.sha256).hexdigest()[:16]


async def publish_struct(js: JetStreamContext, subject: str, msg: msgspec.Struct, msg_id: str,
                         timeout: float = 5.0, headers: dict | None = None) -> PubAck:
    return await publish_with_id(js, subject, encode(msg), msg_id, timeout, headers)
