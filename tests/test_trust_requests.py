"""A compromised fellow cannot take another load's queued prompts (issue 38, attack 2).

The stack of tests/trust_fixtures.py: its leader manages the nats-server's request grants, "alpha" is
on f1 and "beta" on f2; the attacker logs in as f2. Every way at alpha's request consumer (create, info,
pull, ack, and its own consumer filtered to alpha's subject) is refused by NATS, while alpha's requests
are served by f1 and end `finished`; its own queue it may still use. The grants follow the loads: an
unloaded load's fellow loses its grant, a new load's fellow gets one before its stage pulls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import nats
import pytest

from core.nats_auth import fellow_user
from events import subjects
from tests.processes import wait_until
from tests.trust_fixtures import PROMPT, chat, load_state, two_loads

pytestmark = pytest.mark.slow

STREAM = subjects.REQUESTS_STREAM


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with two_loads(tmp_path_factory.mktemp("trust-requests")) as s:
        yield s


def api(kind: str, load_id: str, *rest: str) -> str:
    return ".".join([f"$JS.API.CONSUMER.{kind}.{STREAM}", subjects.request_consumer(load_id), *rest])


async def refused(nc, subject: str, payload: bytes = b"") -> bool:
    """True where NATS refuses this request for want of rights (its error names the subject), False
    where it is answered: whichever comes first (the server sends the error on its own time)."""
    answer = asyncio.Event()

    async def on_answer(msg):
        answer.set()

    sub = await nc.subscribe(nc.new_inbox(), cb=on_answer)
    seen = len(nc.denials)
    try:
        await nc.publish(subject, payload, reply=sub.subject)
        async with asyncio.timeout(10):
            while True:
                if any(f'"{subject.lower()}"' in e.lower() for e in nc.denials[seen:]):
                    return True
                if answer.is_set():
                    return False
                nc.denied.clear()
                waits = [asyncio.ensure_future(answer.wait()), asyncio.ensure_future(nc.denied.wait())]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
    finally:
        await sub.unsubscribe()


async def answered(nc, subject: str, payload: bytes = b"") -> bool:
    return (await nc.request(subject, payload, timeout=10.0)) is not None


def create_payload(load_id: str, filter_load: str) -> bytes:
    durable = subjects.request_consumer(load_id)
    return json.dumps({"stream_name": STREAM, "config": {
        "name": durable, "durable_name": durable, "filter_subject": subjects.request(filter_load),
        "ack_policy": "explicit"}}).encode()


async def test_a_fellow_cannot_pull_or_ack_another_loads_requests(swarm):
    s, alpha, beta = swarm, swarm.loads["alpha"], swarm.loads["beta"]
    assert s.auth.grants() == {"f1": [alpha], "f2": [beta]}
    reference = chat(s, "alpha")
    evil = await s.login(fellow_user("f2"))
    pull = json.dumps({"batch": 1, "no_wait": True}).encode()
    try:
        # its own queue: answered (the rights are per load, not gone)
        assert await answered(evil, api("INFO", beta)) and not await refused(evil, api("INFO", beta))
        assert await answered(evil, api("MSG.NEXT", beta), pull)
        attempts = {
            "info": (api("INFO", alpha), b""),
            "create": (api("CREATE", alpha, subjects.request(alpha)), create_payload(alpha, alpha)),
            "pull": (api("MSG.NEXT", alpha), pull),
            # its own consumer's name, filtered to the victim's requests
            "own name, victim's filter": (api("CREATE", beta, subjects.request(alpha)), create_payload(beta, alpha)),
            "legacy create": (f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.{subjects.request_consumer(alpha)}",
                              create_payload(alpha, alpha)),
        }
        for what, (subject, payload) in attempts.items():
            assert await refused(evil, subject, payload), (what, evil.denials)

        # while it pulls at alpha's queue over and over, alpha's requests come in and are served by f1
        stop = asyncio.Event()

        async def keep_pulling() -> int:
            tries = 0
            while not stop.is_set():
                assert await refused(evil, api("MSG.NEXT", alpha), pull)
                tries += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.05)  # paced: a few hundred tries, not a busy loop
            return tries

        thief = asyncio.create_task(keep_pulling())
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
            r = await http.post("/v1/chat/completions", json={
                "model": "alpha", "messages": PROMPT,
                "temperature": 0, "max_tokens": 12})
        stop.set()
        assert await thief >= 1
        # an ack of a delivery of alpha's consumer (as a stolen one would carry)
        assert await refused(evil, f"$JS.ACK.{STREAM}.{subjects.request_consumer(alpha)}.1.1.1.0.0", b"+ACK")
    finally:
        await evil.close()
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
    rid = body["id"].removeprefix("chatcmpl-")
    wait_until(lambda: s.sql("SELECT status, fellow_id FROM requests WHERE request_id = '%s'" % rid)
               == [("finished", "f1")], 30, "the victim's row finished, served by f1")


async def test_the_grants_follow_the_loads(swarm):
    """beta unloaded: f2 loses its grant at once; beta loaded again: f2 is granted the new load only,
    and serves it."""
    s, alpha, old = swarm, swarm.loads["alpha"], swarm.loads["beta"]
    r = httpx.post(f"{s.url}/api/v1/models/beta/unload", json={"wait": True}, timeout=60)
    assert r.status_code == 200, r.text
    wait_until(lambda: load_state(s, "beta") in (None, "unloaded"), 30, "beta ended")
    wait_until(lambda: s.auth.grants() == {"f1": [alpha]}, 30, "f2's grant taken away")
    f2 = await s.login(fellow_user("f2"))
    try:
        # the leader signals the reload right after it wrote the file: the server applies it soon after
        for _ in range(100):
            if await refused(f2, api("INFO", old)):
                break
            with contextlib.suppress(nats.errors.TimeoutError):
                await answered(f2, api("INFO", old))  # a not-found answer, meanwhile (or refused by now)
        else:
            pytest.fail("f2 may still use the ended load's queue")
    finally:
        await f2.close()
    r = httpx.post(f"{s.url}/api/v1/models/beta/load", json={"fellow_ids": ["f2"], "wait": True}, timeout=180)
    assert r.status_code == 200 and r.json()["state"] == "ready", r.text
    new = r.json()["load_id"]
    assert new != old and s.auth.grants() == {"f1": [alpha], "f2": [new]}
    assert chat(s, "beta")["choices"][0]["message"]["content"]


def test_the_users_file_grants_per_load_once_on(tmp_path):
    """`ensure(per_load=True)`: no fellow may use any load's queue until the leader grants it one; a grant
    is its load's consumer, filtered to its load's requests alone. Without, any load's (an external server)."""
    from core.nats_auth import AuthDir, fellow_permissions

    def queues(perms: dict) -> list[str]:
        return [s for s in perms["publish"]["allow"] if STREAM in s]

    wildcard = queues(fellow_permissions("f1"))
    assert f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.*" in wildcard
    granted = queues(fellow_permissions("f1", loads=["ld-a"]))
    assert granted == [f"$JS.API.CONSUMER.INFO.{STREAM}.load-ld-a",
                       f"$JS.API.CONSUMER.CREATE.{STREAM}.load-ld-a.swarm.req.ld-a",
                       f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.load-ld-a", f"$JS.ACK.{STREAM}.load-ld-a.>"]
    auth = AuthDir(tmp_path / "auth")
    auth.ensure(["f1", "f2"])
    assert auth.grants() is None and f"CONSUMER.MSG.NEXT.{STREAM}.*" in auth.config.read_text()
    auth.ensure(["f1", "f2"], per_load=True)
    assert auth.grants() == {} and STREAM not in auth.config.read_text().replace(f"STREAM.INFO.{STREAM}", "")
    assert auth.set_grants({"f1": ["ld-a"], "f2": []}) and not auth.set_grants({"f1": ["ld-a"]})
    assert auth.grants() == {"f1": ["ld-a"]}
    auth.ensure(["f1", "f2", "f3"])  # a fellow added later: the grants stay on, and as they were
    text = auth.config.read_text()
    assert auth.grants() == {"f1": ["ld-a"]} and text.count(f"CONSUMER.MSG.NEXT.{STREAM}") == 1, text


def test_a_ring_head_is_granted_its_queue_and_loses_it_when_unloaded(tmp_path):
    """A 2-stage ring over f1 and f2 on a managed server: only the head's fellow is granted the load's
    queue (the later stage pulls no requests), and that is enough to serve; unloaded, no grant is left."""
    from core.nats_auth import AuthDir
    from core.nats_server import EmbeddedNats
    from tests.serving_fixtures import make_servable, secured_processes, stop_all, stream_a_reply

    _, servable = make_servable(tmp_path / "models", "tiny", layers=4, hidden=64, stages=2)
    auth = AuthDir(tmp_path / "auth")
    auth.ensure(["f1", "f2"], per_load=True)
    server = EmbeddedNats(tmp_path / "js", config=auth.config, pid_file=auth.pid_file).start()
    leader, fellows = None, []
    try:
        leader, fellows = secured_processes(tmp_path, auth, server.url, servable.parent, ["f1", "f2"],
                                            manages_nats=True)
        r = httpx.post(leader.base_url + "/api/v1/models/tiny/load",
                       json={"num_stages": 2, "fellow_ids": ["f1", "f2"], "wait": True}, timeout=180)
        assert r.status_code == 200 and r.json()["state"] == "ready", (r.text, fellows[0].tail())
        head = next(s["fellow_id"] for s in r.json()["stages"] if s["stage"] == 0)
        assert auth.grants() == {head: [r.json()["load_id"]]}
        stream_a_reply(leader.base_url)
        r = httpx.post(leader.base_url + "/api/v1/models/tiny/unload", json={"wait": True}, timeout=60)
        assert r.status_code == 200, r.text
        wait_until(lambda: auth.grants() == {}, 30, "the head's grant taken away")
    finally:
        if leader is not None:
            stop_all(leader, fellows)
        server.stop()
