"""Fellows across sites (issue 20): a home's nats-server is a leaf node of the hub's (`swarm nats --leaf`),
so the home's fellows talk to a local server and only the leaf link crosses the internet, here a
delay proxy in front of the hub's leafnode port.

The hub takes leaf nodes (`--leaf-port`) in JetStream domain `swarm`; the leaf runs no JetStream and
maps its clients' `$JS.API.>` into that domain, so a fellow on the leaf publishes with acks and pulls
from the hub's streams as if connected to the hub. Users: the leaf checks its fellows with its own
config (only their users); the link logs in as `leaf-<name>`, which may forward only what those
fellows may do.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError

from core.bus import connect, ensure_streams, settle
from core.nats_auth import LEADER_USER, AuthDir, fellow_user, inbox_prefix, leaf_user
from core.nats_server import EmbeddedNats, LeafRemote
from events import subjects
from events.subjects import EVENTS_STREAM, HEARTBEATS_STREAM, REQUESTS_STREAM, TOKENS_STREAM
from tests.delay_proxy import DelayProxy
from tests.processes import SwarmProcess, free_port, swarm_env, wait_until

DELAY_S = 0.05  # each way on the leaf link


@pytest.fixture
def auth(tmp_path):
    a = AuthDir(tmp_path / "auth")
    a.ensure([], {"home": ["f1"]})
    return a


@pytest.fixture
def hub(tmp_path, auth):
    srv = EmbeddedNats(tmp_path / "hub", config=auth.config, leaf_port=0).start()
    yield srv
    srv.stop()


@pytest.fixture
def link(hub):
    with DelayProxy(("127.0.0.1", hub.leaf_port), delay_s=DELAY_S) as proxy:
        yield proxy


@pytest.fixture
def leaf(tmp_path, auth, link):
    """`swarm nats --leaf` itself, a real process, with the leaf's credentials and its own users."""
    env = swarm_env(tmp_path / "home", None, **auth.credentials(leaf_user("home")).env())
    proc = SwarmProcess(["nats", "--leaf", f"nats-leaf://{link.address}", "--port", "0",
                         "--config", str(auth.leaf_config("home")), "--store-dir", str(tmp_path / "home-nats")],
                        env, tmp_path / "leaf.log")
    proc.start()
    try:
        url = wait_until(lambda: re.search(r" at (nats://\S+) ", proc.tail()), 20, "the leaf's URL").group(1)
        yield url
    finally:
        proc.stop()


async def link_up(js, timeout: float = 20.0) -> None:
    """The hub's JetStream answers through the leaf: the link is up (a stream's name, what a fellow may ask)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await js.find_stream_name_by_subject(subjects.heartbeat("f1"))
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_a_fellow_on_the_leaf_uses_the_hubs_streams_through_the_slow_link(hub, auth, leaf):
    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    leader = await connect(hub.url, name="leader", credentials=auth.credentials(LEADER_USER))
    fellow = await connect(leaf, name="f1", credentials=auth.credentials(fellow_user("f1")), error_cb=on_error)
    try:
        await ensure_streams(leader.jetstream())
        js = fellow.jetstream()
        await link_up(js)
        t0 = time.monotonic()
        ack = await js.publish(subjects.heartbeat("f1"), b"{}")
        took = time.monotonic() - t0
        assert ack.stream == HEARTBEATS_STREAM and ack.domain == "swarm"
        assert took >= 2 * DELAY_S, took  # there and back over the link

        # the leader queues a request on the hub; the fellow pulls it through the leaf and acks it
        await leader.jetstream().publish(subjects.request("ld1"), b"work")
        sub = await js.pull_subscribe(subjects.request("ld1"), durable=subjects.request_consumer("ld1"),
                                      stream=REQUESTS_STREAM)
        [msg] = await sub.fetch(1, timeout=10)
        assert msg.data == b"work"
        await msg.ack_sync()
        info = await leader.jetstream().consumer_info(REQUESTS_STREAM, subjects.request_consumer("ld1"))
        assert info.ack_floor.stream_seq == 1 and info.num_ack_pending == 0

        # the leaf still checks the fellow's own rights: another fellow's heartbeat is refused there
        heard: list[str] = []

        async def on_heartbeat(msg):
            heard.append(msg.subject)

        await leader.subscribe("swarm.hb.*", cb=on_heartbeat)
        await settle(leader)
        await fellow.publish(subjects.heartbeat("f2"), b"{}")
        await fellow.publish(subjects.heartbeat("f1"), b"{}")
        await settle(fellow)
        await asyncio.wait_for(_until(lambda: errors and heard), 10)
        assert heard == [subjects.heartbeat("f1")] and "swarm.hb.f2" in errors[0], (heard, errors)
    finally:
        await fellow.close()
        await leader.close()


async def test_the_leaf_redials_a_link_that_went_down(hub, auth, link, leaf):
    """The home's internet goes away and comes back: JetStream through the leaf fails while the link is
    down (no responders, not a hang), and works again once the leaf has dialled the hub anew."""
    leader = await connect(hub.url, name="leader", credentials=auth.credentials(LEADER_USER))
    fellow = await connect(leaf, name="f1", credentials=auth.credentials(fellow_user("f1")))
    try:
        await ensure_streams(leader.jetstream())
        js = fellow.jetstream(timeout=2)
        await link_up(js)
        link.stop()  # the listener and the link's connection: gone

        async def link_down():
            while True:
                try:
                    await js.find_stream_name_by_subject(subjects.heartbeat("f1"))
                except ServiceUnavailableError:  # the leaf knows: no hub behind it
                    return
                except NatsTimeoutError:  # asked while the link was going: lost with it
                    pass
                await asyncio.sleep(0.02)

        await asyncio.wait_for(link_down(), 10)
        with DelayProxy(("127.0.0.1", hub.leaf_port), delay_s=DELAY_S, port=link.port) as back:  # same address
            await link_up(js)
            assert (await js.publish(subjects.heartbeat("f1"), b"{}")).stream == HEARTBEATS_STREAM
            assert back.bytes > 0  # through the link it was given, not straight to the hub
    finally:
        await fellow.close()
        await leader.close()


async def _until(check, interval: float = 0.02):
    while not check():
        await asyncio.sleep(interval)


async def test_the_leaf_link_forwards_no_more_than_its_fellows_may_do(tmp_path, hub, auth, link):
    """A leaf whose own server checks nobody (an open home server) still cannot do more on the hub than
    its fellows: what `leaf-home` may not send never reaches the hub, what it may arrives."""
    open_leaf = EmbeddedNats(tmp_path / "open-leaf", leaf=LeafRemote((f"nats-leaf://{link.address}",),
                                                                    auth.credentials(leaf_user("home")))).start()
    leader = await connect(hub.url, name="leader", credentials=auth.credentials(LEADER_USER))
    # no user on an open leaf; replies on f1's inbox, the only inbox the link may take from the hub
    anyone = await connect(open_leaf.url, name="anyone", inbox_prefix=inbox_prefix(fellow_user("f1")))
    try:
        await ensure_streams(leader.jetstream())
        await link_up(anyone.jetstream())
        heard: list[str] = []

        async def on_event(msg):
            heard.append(msg.subject)

        await leader.subscribe("swarm.>", cb=on_event)
        await settle(leader)
        allowed = subjects.event("request.finished", "f1")  # a fellow's report, on its own subject
        for subject in ("swarm.evt.load.placed", "swarm.hb.f2", "swarm.cmd.f2.stop", "swarm.evt.request.finished",
                        subjects.event("request.finished", "f9"), allowed):
            await anyone.publish(subject, b"{}")
        await settle(anyone)
        await asyncio.wait_for(_until(lambda: allowed in heard), 10)
        assert heard == [allowed], heard  # in order on one link: the others were dropped
        # a fellow may learn the streams' names, never read a token frame back (issue 38), nor the event
        # log, nor list the requests in flight (stream info with a subjects filter)
        await leader.jetstream().publish(subjects.tokens("rq1"), b"frame")
        await leader.jetstream().publish(subjects.event("load.placed"), b"{}")
        js = anyone.jetstream(timeout=2)
        assert await js.find_stream_name_by_subject(subjects.tokens("rq1")) == TOKENS_STREAM
        for stream in (TOKENS_STREAM, EVENTS_STREAM):
            with pytest.raises(ServiceUnavailableError):  # the hub never offers the leaf that subject: no responders
                await js.get_msg(stream, 1)
            with pytest.raises(ServiceUnavailableError):
                await js.stream_info(stream, subjects_filter=">")
    finally:
        await anyone.close()
        await leader.close()
        open_leaf.stop()


@pytest.mark.slow
def test_a_fellow_at_home_serves_a_leader_at_the_hub(tmp_path, hub, auth, leaf):
    """The real serving path across the leaf: the leader on the hub, the fellow on the leaf, each with
    its own user; load a tiny model, stream a reply, ask the fellow for its logs (a core NATS request)."""
    from tests.serving_fixtures import make_servable, stream_a_reply

    _, servable = make_servable(tmp_path / "models", "tiny", layers=2, hidden=32, stages=1)
    db = f"sqlite+aiosqlite:///{tmp_path / 'swarm.db'}"
    port = free_port()

    def env(url: str, user: str) -> dict:
        # SWARM_FELLOW_TIMEOUT_S: a heartbeat's stall on a busy test machine is not the point here
        return swarm_env(tmp_path, url, db, port=port, SWARM_SERVABLE_MODELS_ROOT=servable.parent,
                         OMP_NUM_THREADS=1, SWARM_FELLOW_TIMEOUT_S=10, **auth.credentials(user).env())

    leader = SwarmProcess(["leader"], env(hub.url, LEADER_USER), tmp_path / "leader.log")
    fellow = SwarmProcess(["fellow", "--id", "f1"], env(leaf, fellow_user("f1")), tmp_path / "f1.log")
    try:
        leader.start()
        fellow.start()
        leader.wait_healthy()
        wait_until(lambda: [f["status"] for f in leader.get("/api/v1/fellows").json()["data"]] == ["online"],
                   60, "the fellow at home online")
        r = httpx.post(leader.base_url + "/api/v1/models/tiny/load", json={"wait": True}, timeout=120)
        assert r.status_code == 200 and r.json()["state"] == "ready", (r.text, fellow.tail())
        stream_a_reply(leader.base_url)
        logs = leader.get("/api/v1/fellows/f1/logs?tail=5")
        assert logs.status_code == 200 and logs.json()["lines"], logs.text
    finally:
        fellow.stop()
        leader.stop()


def test_nats_auth_writes_the_leaf_user_and_the_leafs_own_users(tmp_path):
    a = AuthDir(tmp_path / "auth")
    a.ensure(["f9"], {"home": ["f1", "f2"]})
    a.ensure([])  # a later run keeps the leaf and its fellows (leaves.json)
    passwords = a.passwords()
    assert {leaf_user("home"), fellow_user("f1"), fellow_user("f2"), fellow_user("f9")} <= set(passwords)
    hub_users = {u["user"]: u for u in json.loads(a.config.read_text().split(":", 1)[1])["users"]}
    link = hub_users[leaf_user("home")]["permissions"]
    assert "$JS.swarm.API.CONSUMER.MSG.NEXT.SWARM_COMMANDS.fellow-f2" in link["publish"]["allow"]
    assert "swarm.hb.f1" in link["publish"]["allow"] and "swarm.hb.f9" not in link["publish"]["allow"]
    leaf_users = json.loads(a.leaf_config("home").read_text().split(":", 1)[1])["users"]
    assert sorted(u["user"] for u in leaf_users) == [fellow_user("f1"), fellow_user("f2")]  # never the leader's
    assert all(not s.startswith("$JS.API.") for u in leaf_users for s in u["permissions"]["publish"]["allow"])
    with pytest.raises(ValueError):
        a.ensure([], {"bad.name": ["f1"]})


def test_the_cli_refuses_what_a_leaf_cannot_be(tmp_path, capsys):
    from core.cli import main

    assert main(["nats", "--leaf", "nats-leaf://hub:7422", "--leaf-port", "7422"]) == 2
    assert main(["nats-auth", str(tmp_path / "auth"), "--leaf", "home"]) == 2  # no fellows named
    err = capsys.readouterr().err
    assert "neither a cluster node nor a hub" in err and "NAME=FELLOW" in err
    assert main(["nats-auth", str(tmp_path / "auth"), "--leaf", "home=f1,f2"]) == 0
    assert AuthDir(tmp_path / "auth").leaves() == {"home": ["f1", "f2"]}
