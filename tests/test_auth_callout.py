"""Per-load authority through the leader's auth callout (issue 54), on real nats-servers: one server, a
3-node JetStream cluster, a hub and a leaf node. alpha is placed on f1, beta on f2, gamma on h1 (at
the leaf "home"); the attacker is f2 (logging in with its `.creds` file) or h1. It is refused the
create, info, pull and ack of alpha's request consumer while f1 takes and acks alpha's request; its
own load's consumer it may use. When alpha moves (its stage row names another fellow), the fellow
that lost it is disconnected and, reconnected, refused; the one that got it is granted at its next
login. The measured times are printed (run with -s)."""

from __future__ import annotations

import asyncio
import time

import pytest

from core.bus import BusUnavailable, connect, connection_fellow
from core.nats_auth import HUB_DOMAIN, fellow_user, leaf_user
from core.nats_callout import CalloutDir
from core.nats_server import EmbeddedNats, LeafRemote, local_cluster
from events import subjects
from tests.callout_fixtures import (
    PLACED,
    PULL,
    STREAM,
    api,
    attempts,
    callout_folder,
    callout_leader,
    create_payload,
    login,
    move,
    placed_db,
    refused,
)
from tests.conftest import make_settings


async def _victim_is_served(leader, victim) -> None:
    """f1 creates alpha's consumer, the leader queues a request, f1 pulls and acks it."""
    js = victim.nc.jetstream()
    sub = await js.pull_subscribe(subjects.request("alpha"), durable=subjects.request_consumer("alpha"), stream=STREAM)
    await leader.jetstream().publish(subjects.request("alpha"), b"the victim's prompt")
    [msg] = await sub.fetch(1, timeout=30)
    assert msg.data == b"the victim's prompt"
    await msg.ack_sync(timeout=30)


async def _attacker_refused(attacker, load: str = "alpha", own: str = "beta", domain: str | None = None) -> None:
    for what, (subject, payload) in attempts(load).items():
        if domain and subject.startswith("$JS.API."):
            subject = subject.replace("$JS.API.", f"$JS.{domain}.API.", 1)
        assert await refused(attacker, subject, payload), (what, attacker.denials)
    own_create = api("CREATE", own, subjects.request(own), domain=domain)
    assert not await refused(attacker, own_create, create_payload(own)), attacker.denials  # its own: answered


async def _follows(grants, sessions, loser, load: str, to: str, domain: str | None = None) -> dict[str, float]:
    """Move `load` to `to`; the times from the sync to the loser's disconnect and to its first refusal."""
    await move(sessions, load, to)
    t0 = time.monotonic()
    loser.back.clear()
    await grants.sync()
    await loser.gone.wait()
    kicked = loser.disconnects[-1] - t0
    await loser.back.wait()
    subject = api("MSG.NEXT", load, domain=domain)
    assert await refused(loser, subject, PULL), loser.denials
    return {"kicked_s": kicked, "refused_s": time.monotonic() - t0}


async def test_single_server_grants_per_load_and_follow_placement(tmp_path):
    auth = callout_folder(tmp_path)
    db_url, sessions = await placed_db(tmp_path)
    server = EmbeddedNats(tmp_path / "js", config=auth.config).start()
    try:
        async with callout_leader(tmp_path, auth, server.url, db_url) as (leader, grants, _):
            victim = await login(server.url, fellow_user("f1"), auth.passwords()[fellow_user("f1")])
            attacker = await login(server.url, fellow_user("f2"), creds=CalloutDir(auth).creds(fellow_user("f2")))
            await _attacker_refused(attacker)
            await _victim_is_served(leader, victim)
            took = await _follows(grants, sessions, victim, "alpha", "f2")
            fresh = await login(server.url, fellow_user("f2"), creds=CalloutDir(auth).creds(fellow_user("f2")))
            assert not await refused(fresh, api("INFO", "alpha")), fresh.denials  # the new grant, at login
            print(f"\nsingle server: old grant kicked after {took['kicked_s'] * 1e3:.1f} ms, "
                  f"refused after {took['refused_s'] * 1e3:.1f} ms")
            for lg in (victim, attacker, fresh):
                await lg.nc.close()
    finally:
        server.stop()


async def test_a_three_node_cluster(tmp_path):
    """Each login is asked of the leader whichever node it reaches; kicks reach every node."""
    auth = callout_folder(tmp_path)
    db_url, sessions = await placed_db(tmp_path)
    nodes = local_cluster(tmp_path / "cluster", 3, config=auth.config)
    for n in nodes:
        n.start()
    try:
        async with callout_leader(tmp_path, auth, nodes[0].url, db_url) as (leader, grants, _):
            victim = await login(nodes[1].url, fellow_user("f1"), auth.passwords()[fellow_user("f1")])
            attacker = await login(nodes[2].url, fellow_user("f2"), creds=CalloutDir(auth).creds(fellow_user("f2")))
            await _attacker_refused(attacker)
            await _victim_is_served(leader, victim)
            took = await _follows(grants, sessions, victim, "alpha", "f2")
            fresh = await login(nodes[1].url, fellow_user("f2"), auth.passwords()[fellow_user("f2")])
            assert not await refused(fresh, api("INFO", "alpha")), fresh.denials
            print(f"\ncluster: old grant kicked after {took['kicked_s'] * 1e3:.1f} ms, "
                  f"refused after {took['refused_s'] * 1e3:.1f} ms")
            for lg in (victim, attacker, fresh):
                await lg.nc.close()
    finally:
        for n in nodes:
            n.stop()


async def test_through_a_leaf_node(tmp_path):
    """The leaf's link is authorized by the callout with its fellows' grants: h1, at the leaf, is
    refused alpha's consumer (on f1, at the hub); alpha moved to h1, the link is kicked and redials with
    alpha granted; moved back, h1 is refused again."""
    auth = callout_folder(tmp_path)
    db_url, sessions = await placed_db(tmp_path)
    hub = EmbeddedNats(tmp_path / "hub", config=auth.config, leaf_port=0).start()
    leaf = None
    try:
        async with callout_leader(tmp_path, auth, hub.url, db_url) as (leader, grants, _):
            link = LeafRemote((f"nats-leaf://127.0.0.1:{hub.leaf_port}",), auth.credentials(leaf_user("home")))
            leaf = EmbeddedNats(tmp_path / "leaf", config=auth.leaf_config("home"), leaf=link).start()
            victim = await login(hub.url, fellow_user("f1"), auth.passwords()[fellow_user("f1")])
            h1 = await login(leaf.url, fellow_user("h1"), auth.passwords()[fellow_user("h1")])
            while await refused(h1, api("INFO", "gamma", domain=HUB_DOMAIN)):  # until the link is up
                await asyncio.sleep(0.05)
            await _attacker_refused(h1, own="gamma", domain=HUB_DOMAIN)
            await _victim_is_served(leader, victim)
            await move(sessions, "alpha", "h1")
            t0 = time.monotonic()
            await grants.sync()
            while await refused(h1, api("INFO", "alpha", domain=HUB_DOMAIN)):  # the link redials, granted
                await asyncio.sleep(0.05)
            granted_s = time.monotonic() - t0
            await move(sessions, "alpha", "f1")
            t0 = time.monotonic()
            await grants.sync()
            while not await refused(h1, api("INFO", "alpha", domain=HUB_DOMAIN)):  # the old link: kicked
                await asyncio.sleep(0.05)
            cut_s = time.monotonic() - t0
            while await refused(h1, api("INFO", "gamma", domain=HUB_DOMAIN)):  # until the link is back
                await asyncio.sleep(0.05)
            assert await refused(h1, api("INFO", "alpha", domain=HUB_DOMAIN))  # and it came back without alpha
            await _attacker_refused(h1, own="gamma", domain=HUB_DOMAIN)
            print(f"\nleaf: a new grant reached the leaf after {granted_s * 1e3:.0f} ms; a withdrawn one was cut "
                  f"after {cut_s * 1e3:.0f} ms, the link back without it after {(time.monotonic() - t0) * 1e3:.0f} ms")
            for lg in (victim, h1):
                await lg.nc.close()
    finally:
        if leaf is not None:
            leaf.stop()
        hub.stop()


async def test_a_grant_withdrawn_by_one_leader_is_kicked_by_the_leader_that_granted_it(tmp_path):
    """Two leaders on one database: B answered f1's login, A moves alpha away; B kicks f1."""
    auth = callout_folder(tmp_path)
    db_url, sessions = await placed_db(tmp_path)
    server = EmbeddedNats(tmp_path / "js", config=auth.config).start()
    try:
        async with callout_leader(tmp_path / "b", auth, server.url, db_url):
            victim = await login(server.url, fellow_user("f1"), auth.passwords()[fellow_user("f1")])
            async with callout_leader(tmp_path / "a", auth, server.url, db_url) as (_, grants_a, _):
                assert grants_a.callout.connections == {} or all(
                    g.user != fellow_user("f1") for g in grants_a.callout.connections.values())
                await move(sessions, "alpha", "f2")
                await grants_a.sync()
                await asyncio.wait_for(victim.gone.wait(), 30)  # a guard: without the word to B it never comes
                await asyncio.wait_for(victim.back.wait(), 30)
                assert await refused(victim, api("MSG.NEXT", "alpha"), PULL), victim.denials
            await victim.nc.close()
    finally:
        server.stop()


async def test_a_fellow_logs_in_with_swarm_nats_creds(tmp_path):
    """SWARM_NATS_CREDS: the settings' credentials connect as the fellow the JWT names, with its rights
    (its own heartbeat, its load's consumer); a .creds file of another issuer is refused."""
    auth = callout_folder(tmp_path)
    db_url, _ = await placed_db(tmp_path)
    server = EmbeddedNats(tmp_path / "js", config=auth.config).start()
    try:
        async with callout_leader(tmp_path, auth, server.url, db_url):
            creds = CalloutDir(auth).creds(fellow_user("f2"))
            settings = make_settings(tmp_path, server.url, SWARM_NATS_CREDS=creds)
            nc = await connect(server.url, name="f2", credentials=settings.nats.credentials)
            js = nc.jetstream()
            assert connection_fellow(js) == "f2"
            await js.publish(subjects.heartbeat("f2"), b"{}")  # only fellow-f2 may
            await js.pull_subscribe(subjects.request("beta"), durable=subjects.request_consumer("beta"), stream=STREAM)
            await nc.close()
            other = callout_folder(tmp_path / "elsewhere")
            stranger = make_settings(tmp_path, server.url, SWARM_NATS_CREDS=CalloutDir(other).creds(fellow_user("f2")))
            with pytest.raises(BusUnavailable, match="refused"):
                await connect(server.url, name="f2", credentials=stranger.nats.credentials, allow_reconnect=False)
    finally:
        server.stop()


async def test_with_the_old_rights_the_attack_is_not_refused(tmp_path):
    """The control: the callout answering with any load's queues (what `swarm nats-auth` wrote before)
    lets f2 at alpha's consumer, so the refusals above are the callout's doing."""
    auth = callout_folder(tmp_path)
    db_url, _ = await placed_db(tmp_path)
    server = EmbeddedNats(tmp_path / "js", config=auth.config).start()
    try:
        async with callout_leader(tmp_path, auth, server.url, db_url) as (leader, grants, _):
            async def every_load():
                return {f: list(PLACED) for f in ("f1", "f2", "h1")}

            grants.callout.grants = every_load
            attacker = await login(server.url, fellow_user("f2"), auth.passwords()[fellow_user("f2")])
            subject, payload = attempts("alpha")["create"]
            assert not await refused(attacker, subject, payload)
            await attacker.nc.close()
    finally:
        server.stop()
