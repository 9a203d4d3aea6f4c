"""NATS auth (issue 18): a real nats-server with the users and permissions of core/nats_auth.py.

An anonymous client is refused; a fellow's user may publish its own heartbeat and the events a fellow
reports, and take its own commands, but not another fellow's heartbeat or commands, a forged
`api_token.*` or `load.placed` event, the event log, or the leader's inbox; a forged event never
reaches a projection.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import httpx
import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from sqlalchemy import select

from core.bus import BusUnavailable, connect, ensure_streams, publish_event, publish_struct, settle
from core.nats_auth import LEADER_USER, OPS_USER, AuthDir, Credentials, fellow_user
from core.nats_server import EmbeddedNats
from events import subjects
from events.api_tokens import ApiTokenMinted
from events.base import encode
from events.commands import StopFellow
from events.loads import LoadFailed, LoadPlaced, StageReady, StageReplaced
from events.requests import RequestFinished
from events.subjects import COMMANDS_STREAM, EVENTS_ALL, EVENTS_STREAM, HEARTBEATS_STREAM
from tests.dbutil import projecting

DENIED_WAIT_S = 1.0  # a denied JetStream publish gets no acknowledgement: how long to wait for one


@pytest.fixture
def auth(tmp_path):
    a = AuthDir(tmp_path / "auth")
    a.ensure(["f1", "f2"])
    return a


@pytest.fixture
def secured(tmp_path, auth):
    srv = EmbeddedNats(tmp_path / "js", config=auth.config).start()
    yield srv
    srv.stop()


class Client:
    """A connection as one user, keeping every error the server sent it."""

    def __init__(self, nc, errors: list[str]):
        self.nc, self.errors = nc, errors
        self.js = nc.jetstream()

    def denied(self, what: str) -> bool:
        return any("permissions violation" in e.lower() and what.lower() in e.lower() for e in self.errors)


async def login(url: str, creds: Credentials) -> Client:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return Client(await connect(url, name=creds.user, credentials=creds, error_cb=on_error), errors)


async def leader_and_fellow(srv, auth):
    leader = await login(srv.url, auth.credentials(LEADER_USER))
    await ensure_streams(leader.js)
    return leader, await login(srv.url, auth.credentials(fellow_user("f1")))


async def stored(js, stream: str, subject: str) -> bool:
    try:
        await js.get_last_msg(stream, subject)
        return True
    except NotFoundError:
        return False


async def wait_denied(client: Client, what: str) -> None:
    for _ in range(100):
        if client.denied(what):
            return
        await settle(client.nc)
        await asyncio.sleep(0.02)
    raise AssertionError(f"no permissions violation for {what}: {client.errors}")


async def test_anonymous_clients_and_wrong_passwords_are_refused(secured, auth):
    for creds in (None, Credentials("fellow-f1", "not-its-password"), Credentials("nobody", "x")):
        with pytest.raises(BusUnavailable, match="Authorization Violation"):
            await connect(secured.url, name="intruder", credentials=creds, timeout=3, allow_reconnect=False)
    ok = await connect(secured.url, name="ops", credentials=auth.credentials(OPS_USER))
    await ok.close()


async def test_a_fellow_publishes_what_a_fellow_reports_and_takes_its_own_commands(secured, auth):
    leader, fellow = await leader_and_fellow(secured, auth)
    try:
        assert (await fellow.js.publish(subjects.heartbeat("f1"), b"{}")).stream == HEARTBEATS_STREAM
        ack = await publish_event(fellow.js, RequestFinished(request_id="r1", model_id="m", load_id="l"))
        assert ack.stream == EVENTS_STREAM
        await publish_struct(leader.js, subjects.command("f1", "stop"), StopFellow(), "cmd-1")
        durable = subjects.command_consumer("f1")
        sub = await fellow.js.pull_subscribe(
            subjects.commands_for("f1"), durable=durable, stream=COMMANDS_STREAM,
            config=ConsumerConfig(durable_name=durable, deliver_policy=DeliverPolicy.ALL,
                                  ack_policy=AckPolicy.EXPLICIT))
        msgs = await sub.fetch(1, timeout=5)
        await msgs[0].ack_sync()
        assert msgs[0].subject == subjects.command("f1", "stop")
        # core NATS: it answers the leader's logs request, hears cancels, sends and hears ring frames
        heard: list[str] = []

        async def answer(msg):
            await msg.respond(b"lines")

        async def hear(msg):
            heard.append(msg.subject)

        await fellow.nc.subscribe(subjects.logs("f1"), cb=answer)
        await fellow.nc.subscribe(subjects.cancels_of("l"), cb=hear)
        await fellow.nc.subscribe(subjects.ring("l", "1"), cb=hear)
        watched = [subjects.event(kind.__struct_config__.tag) for kind in (LoadFailed, StageReplaced, StageReady)]
        for subject in watched:  # a ring stage's watches
            await fellow.nc.subscribe(subject, cb=hear)
        await settle(fellow.nc)
        assert (await leader.nc.request(subjects.logs("f1"), b"", timeout=5)).data == b"lines"
        await leader.nc.publish(subjects.cancel("l", "r1"), b"")
        await fellow.nc.publish(subjects.ring("l", "1"), b"frame")
        for subject in watched:
            await leader.nc.publish(subject, b"")
        for _ in range(500):
            if len(heard) == 5:
                break
            await asyncio.sleep(0.02)
        assert sorted(heard) == sorted([subjects.cancel("l", "r1"), subjects.ring("l", "1"), *watched]), fellow.errors
        assert fellow.errors == []
    finally:
        await fellow.nc.close()
        await leader.nc.close()


@pytest.mark.parametrize("subject", [
    subjects.heartbeat("f2"),  # another fellow's heartbeat
    subjects.event("api_token.minted"),  # a forged token
    subjects.event("load.placed"),  # a forged placement
    subjects.event("fellow.joined"),
    subjects.command("f2", "stop"),  # a command to another fellow
    subjects.request("some-load"),  # a request only the gateway publishes
])
async def test_a_fellow_cannot_publish_what_is_not_its_own(secured, auth, subject):
    leader, fellow = await leader_and_fellow(secured, auth)
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await fellow.js.publish(subject, b'{"type":"api_token.minted"}', timeout=DENIED_WAIT_S)
        await wait_denied(fellow, subject)
        stream = next(s.name for s in subjects.STREAMS if subject.startswith(s.subjects[0].rstrip(">*.")))
        assert not await stored(leader.js, stream, subject)
    finally:
        await fellow.nc.close()
        await leader.nc.close()


async def test_a_fellow_cannot_read_the_log_another_fellows_commands_or_the_leaders_inbox(secured, auth):
    leader, fellow = await leader_and_fellow(secured, auth)
    try:
        got: list = []

        async def keep(msg):
            got.append(msg.subject)

        for subject in ("_INBOX.>", EVENTS_ALL, "swarm.cmd.f2.*", "swarm.hb.*", "swarm.logs.f2"):
            await fellow.nc.subscribe(subject, cb=keep)
            await wait_denied(fellow, subject)
        # the leader's own replies and events flow, and none of them reaches the fellow
        await publish_event(leader.js, LoadPlaced(load_id="l", model_id="m", stages=[]))
        await leader.js.stream_info(EVENTS_STREAM)
        await leader.nc.publish("swarm.logs.f2", b"")
        await settle(leader.nc)
        for denied in (f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}", f"$JS.API.CONSUMER.INFO.{COMMANDS_STREAM}.fellow-f2",
                       f"$JS.API.STREAM.MSG.GET.{EVENTS_STREAM}", f"$JS.API.STREAM.DELETE.{HEARTBEATS_STREAM}"):
            with pytest.raises(nats.errors.TimeoutError):
                await fellow.nc.request(denied, b"{}", timeout=DENIED_WAIT_S)
            await wait_denied(fellow, denied)
        await settle(fellow.nc)
        assert got == []
        assert (await leader.js.stream_info(HEARTBEATS_STREAM)).config.name == HEARTBEATS_STREAM
    finally:
        await fellow.nc.close()
        await leader.nc.close()


async def test_ops_reads_the_log_and_heartbeats_and_publishes_nothing(secured, auth):
    leader = await login(secured.url, auth.credentials(LEADER_USER))
    await ensure_streams(leader.js)
    ops = await login(secured.url, auth.credentials(OPS_USER))
    try:
        ack = await publish_event(leader.js, RequestFinished(request_id="r1", model_id="m", load_id="l"))
        # an ephemeral consumer by the legacy subject (what `nats stream view` makes), read by pulls
        info = await ops.js.add_consumer(EVENTS_STREAM, ConsumerConfig(ack_policy=AckPolicy.NONE,
                                                                       inactive_threshold=30.0))
        sub = await ops.js.pull_subscribe_bind(info.name, stream=EVENTS_STREAM)
        assert [m.metadata.sequence.stream for m in await sub.fetch(1, timeout=5)] == [ack.seq]
        assert (await ops.js.get_last_msg(EVENTS_STREAM, subjects.event("request.finished"))).seq == ack.seq
        for subject in (subjects.event("api_token.minted"), subjects.heartbeat("f1")):
            with pytest.raises(nats.errors.TimeoutError):
                await ops.js.publish(subject, b"{}", timeout=DENIED_WAIT_S)
            await wait_denied(ops, subject)
        with pytest.raises(nats.errors.TimeoutError):  # nor the work queues
            await ops.nc.request(f"$JS.API.CONSUMER.INFO.{COMMANDS_STREAM}.fellow-f1", b"", timeout=DENIED_WAIT_S)
    finally:
        await ops.nc.close()
        await leader.nc.close()


async def test_ops_changes_no_stream_or_consumer(secured, auth):
    """Issue 38: the "read-only" ops user deleted the leader's consumers and made a durable one."""
    leader = await login(secured.url, auth.credentials(LEADER_USER))
    await ensure_streams(leader.js)
    ops = await login(secured.url, auth.credentials(OPS_USER))
    try:
        theirs = await leader.js.add_consumer(EVENTS_STREAM, ConsumerConfig(
            name="projections", ack_policy=AckPolicy.NONE, inactive_threshold=60.0))
        durable = '{"stream_name": "%s", "config": {"durable_name": "mine", "ack_policy": "none"}}' % EVENTS_STREAM
        for subject, payload in ((f"$JS.API.CONSUMER.DELETE.{EVENTS_STREAM}.{theirs.name}", b""),
                                 (f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.mine", durable.encode()),
                                 (f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.{theirs.name}.swarm.evt.x", b"{}"),
                                 (f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENTS_STREAM}.mine", durable.encode()),
                                 (f"$JS.API.STREAM.PURGE.{EVENTS_STREAM}", b"{}"),
                                 (f"$JS.API.STREAM.DELETE.{HEARTBEATS_STREAM}", b""),
                                 (f"$JS.API.STREAM.UPDATE.{EVENTS_STREAM}", b"{}"),
                                 (f"$JS.API.STREAM.MSG.DELETE.{EVENTS_STREAM}", b'{"seq": 1}'),
                                 (f"$JS.API.CONSUMER.CREATE.{COMMANDS_STREAM}", b"{}")):
            with pytest.raises(nats.errors.TimeoutError):
                await ops.nc.request(subject, payload, timeout=DENIED_WAIT_S)
            await wait_denied(ops, subject)
        # the one create it has, the legacy ephemeral subject, makes no durable: the server refuses the name
        reply = await ops.nc.request(f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}", durable.encode(), timeout=5)
        assert b'"error"' in reply.data, reply.data
        names = [c.name for c in await leader.js.consumers_info(EVENTS_STREAM)]
        assert names == [theirs.name], names
    finally:
        await ops.nc.close()
        await leader.nc.close()


async def test_a_forged_event_never_reaches_a_projection(secured, auth, sqlite_url):
    from leader.db.tables import ApiToken

    leader, fellow = await leader_and_fellow(secured, auth)
    try:
        async with projecting(leader.js, sqlite_url) as (sessions, runner):
            forged = ApiTokenMinted(token_id="forged", label="x", scopes=["admin"], token_hash="f" * 64,
                                    prefix="sk-forged")
            await fellow.nc.publish(subjects.event(forged.type), encode(forged))
            await wait_denied(fellow, subjects.event(forged.type))
            real = ApiTokenMinted(token_id="real", label="ops", scopes=["read"], token_hash="a" * 64, prefix="sk-a")
            ack = await publish_event(leader.js, real)
            await runner.wait_for(ack.seq, timeout=10)
            async with sessions() as session:
                ids = (await session.execute(select(ApiToken.token_id))).scalars().all()
            assert ids == ["real"]
            assert (await leader.js.stream_info(EVENTS_STREAM)).state.messages == 1
    finally:
        await fellow.nc.close()
        await leader.nc.close()


def test_the_config_keeps_passwords_and_adds_fellows(tmp_path):
    a = AuthDir(tmp_path / "auth")
    first = a.ensure(["f1"])
    again = a.ensure(["f1", "f2"])
    assert {u: again[u] for u in first} == first and set(again) == {"leader", "ops", "fellow-f1", "fellow-f2"}
    assert (a.path / "fellow-f2.env").read_text().startswith("SWARM_NATS_USER=fellow-f2\n")
    assert oct(a.config.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ValueError, match="subject token"):
        a.ensure(["bad*id"])


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A private CA and a certificate for 127.0.0.1 signed by it, made with the openssl command."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=swarm-test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
        "-extfile", "san.ext", "-out", "server.pem")
    return d / "ca.pem", d / "server.pem", d / "server.key"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command is not installed")
async def test_tls_with_a_private_ca_and_the_users(tmp_path, auth, monkeypatch):
    """docs/deploy.md's TLS: nats-server with a `tls` block, clients on tls:// URLs trusting the CA
    through SSL_CERT_FILE; a client that does not trust it is refused, and auth still applies."""
    ca, cert, key = make_certs(tmp_path)
    conf = tmp_path / "nats.conf"
    conf.write_text(f'include "{auth.config.relative_to(tmp_path)}"\n'  # relative to this file
                    f'tls {{\n cert_file: "{cert}"\n key_file: "{key}"\n}}\n')
    srv = EmbeddedNats(tmp_path / "js", config=conf).start()
    url = srv.url.replace("nats://", "tls://")
    try:
        with pytest.raises(BusUnavailable):  # the system's CAs do not know ours
            await connect(url, name="untrusting", credentials=auth.credentials(LEADER_USER), timeout=3,
                          allow_reconnect=False)
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        with pytest.raises(BusUnavailable, match="Authorization Violation"):
            await connect(url, name="anonymous", timeout=3, allow_reconnect=False)
        leader = await login(url, auth.credentials(LEADER_USER))
        await ensure_streams(leader.js)
        fellow = await login(url, auth.credentials(fellow_user("f1")))
        assert (await fellow.js.publish(subjects.heartbeat("f1"), b"{}")).stream == HEARTBEATS_STREAM
        await fellow.nc.close()
        await leader.nc.close()
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_ring_over_two_fellows_serves_with_their_own_users(tmp_path, auth, secured):
    """Every right a fellow and its stage processes need, end to end: a leader and two fellows, each
    with its own user, load a 2-stage ring, stream a whole reply through it, and unload it."""
    from tests.processes import wait_until
    from tests.serving_fixtures import make_servable, secured_processes, stop_all, stream_a_reply

    _, servable = make_servable(tmp_path / "models", "tiny", layers=4, hidden=64, stages=2)
    leader, fellows = secured_processes(tmp_path, auth, secured.url, servable.parent, ["f1", "f2"])
    try:
        r = httpx.post(leader.base_url + "/api/v1/models/tiny/load",
                       json={"num_stages": 2, "fellow_ids": ["f1", "f2"], "wait": True}, timeout=180)
        assert r.status_code == 200 and r.json()["state"] == "ready", (r.text, fellows[1].tail())
        stream_a_reply(leader.base_url)
        r = httpx.post(leader.base_url + "/api/v1/models/tiny/unload", json={"wait": True}, timeout=60)
        assert r.status_code == 200, r.text
        wait_until(lambda: leader.get("/api/v1/models/tiny").json()["load_state"] in (None, "unloaded"), 30,
                   "the load ended")
    finally:
        stop_all(leader, fellows)
