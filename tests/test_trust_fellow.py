"""A compromised fellow (issue 38): inside its own NATS user's rights, it tries what a probe did to the
loads of another fellow. A real stack: nats-server with a user per role, a leader, fellows f1 and f2,
"alpha" placed on f1 and "beta" on f2; the attacker logs in as f2 (beta's fellow). Each attempt is
refused by NATS or ignored by the leader and kept in `dead_letters` with the reason; the victim's
request is served as it would be without it, and its SQL row is true.

Another load's queued requests it cannot pull (tests/test_trust_requests.py), nor read other requests'
frames through SWARM_TOKENS, nor list the requests in flight by stream info (attack 5): it learns only
whether a request whose id it knows has frames stored.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from core.bus import publish_event
from core.nats_auth import LEADER_USER, fellow_user
from events import subjects
from events.api_tokens import ApiTokenMinted
from events.base import encode
from events.frames import DoneFrame, StartFrame, TokenFrame, frame_decoder, frame_msg_id
from events.loads import LoadFailed, ModelUnloaded, ReplicaLost
from events.requests import RequestFinished
from fellow.token_batcher import stored_beyond
from tests.processes import wait_until
from tests.trust_fixtures import PROMPT, chat, load_state, two_loads

pytestmark = pytest.mark.slow

FORGED = "FORGED"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with two_loads(tmp_path_factory.mktemp("trust")) as s:
        yield s


async def stored(nc, subject: str, evt) -> int:
    """Publish `evt` as raw JSON on `subject` through JetStream; its stream sequence."""
    return (await nc.jetstream().publish(subject, encode(evt), timeout=5)).seq


async def test_a_fellow_cannot_take_another_fellows_model_offline(swarm):
    s, alpha = swarm, swarm.loads["alpha"]
    before = chat(s, "alpha")["choices"][0]["message"]["content"]
    evil = await swarm.login(fellow_user("f2"))
    try:
        # the leader's own subject: NATS refuses it
        with pytest.raises(nats.errors.TimeoutError):
            await evil.jetstream().publish(subjects.event("load.failed"), encode(LoadFailed(
                load_id=alpha, model_id="alpha", reason="forged", fellow_id="f1")), timeout=1.0)
        # its own subjects: stored, and refused by the leader
        attempts = [
            LoadFailed(load_id=alpha, model_id="alpha", reason="as f1", fellow_id="f1"),
            LoadFailed(load_id=alpha, model_id="alpha", reason="as itself", fellow_id="f2"),
            ReplicaLost(load_id=alpha, model_id="alpha", replica=0, fellow_id="f2", reason="forged"),
            ModelUnloaded(load_id=alpha, model_id="alpha", reason="evicted", fellow_id="f2"),
        ]
        seqs = [(await publish_event(evil.jetstream(), evt)).seq for evt in attempts]
        # an admin token smuggled in on a subject it may publish on
        token = ApiTokenMinted(token_id="forged", label="x", scopes=["admin"], token_hash="f" * 64, prefix="sk-f")
        seqs.append(await stored(evil, subjects.event("load.failed", "f2"), token))
    finally:
        await evil.close()
    assert any("permissions violation" in e.lower() for e in evil.denials), evil.denials
    wait_until(lambda: len(s.sql("SELECT seq FROM dead_letters WHERE seq >= %d" % seqs[0])) == len(seqs), 30,
               "every attempt kept as a dead letter")
    letters = s.dead_letters()
    assert letters[subjects.event("load.failed", "f2")] == [
        "refused: fellow f2 reported for fellow 'f1'", f"refused: fellow f2 does not serve load '{alpha}'",
        "refused: a api_token.minted event on another type's subject"], letters
    assert letters[subjects.event("load.replica_lost", "f2")] == [f"refused: fellow f2 does not serve load '{alpha}'"]
    assert letters[subjects.event("load.unloaded", "f2")] == [f"refused: fellow f2 does not serve load '{alpha}'"]
    assert load_state(s, "alpha") == "ready"
    assert s.sql("SELECT state FROM load_stages WHERE load_id = '%s'" % alpha) == [("ready",)]
    assert s.sql("SELECT token_id FROM api_tokens WHERE token_id = 'forged'") == []
    assert chat(s, "alpha")["choices"][0]["message"]["content"] == before  # served, as before


async def test_forged_frames_and_usage_are_ignored(swarm):
    """The attacker hears a request of alpha start (here through the leader's eyes: it may know the id)
    and at once publishes frames 1-5 and a done frame with the ids the stage would have used before
    frames were signed, and RequestFinished reports of 999,999 tokens: the client reads the real reply,
    the row counts the real tokens."""
    s, alpha, beta = swarm, swarm.loads["alpha"], swarm.loads["beta"]
    reference = chat(s, "alpha")
    watcher = await swarm.login(LEADER_USER)
    evil = await swarm.login(fellow_user("f2"))
    forged: list[int] = []
    attacked = asyncio.Event()  # the attack's last publish answered (it may come after the reply ends)

    async def on_frame(msg):
        frame = frame_decoder.decode(msg.data)
        if not isinstance(frame, StartFrame) or forged:
            return
        rid = frame.request_id
        forged.append(0)
        for seq in range(1, 6):
            fake = TokenFrame(request_id=rid, seq=seq, texts=[FORGED], text=FORGED)
            await evil.publish(subjects.tokens(rid), encode(fake), headers={"Nats-Msg-Id": frame_msg_id(rid, seq)})
        done = DoneFrame(request_id=rid, seq=6, completion_tokens=5, prompt_tokens=1)
        await evil.publish(subjects.tokens(rid), encode(done), headers={"Nats-Msg-Id": frame_msg_id(rid, 6)})
        # with the ids the stage's report had (JetStream would drop the real one as a duplicate)
        for load_id, model, fellow, msg_id in ((alpha, "alpha", "f1", f"fin-{rid}"),
                                               (beta, "beta", "f2", f"fin-{rid}.f1")):
            report = RequestFinished(id=f"fin-{rid}", request_id=rid, model_id=model, load_id=load_id,
                                     completion_tokens=999_999, prompt_tokens=999_999, fellow_id=fellow)
            forged.append((await evil.jetstream().publish(subjects.event(report.type, "f2"), encode(report),
                                                          headers={"Nats-Msg-Id": msg_id})).seq)
        attacked.set()

    sub = await watcher.subscribe(subjects.TOKENS_ALL, cb=on_frame)
    try:
        text, rid = "", None
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
            body = {"model": "alpha", "messages": PROMPT, "temperature": 0, "max_tokens": 12, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        rid = chunk["id"].removeprefix("chatcmpl-")
                        for choice in chunk.get("choices", []):
                            text += choice.get("delta", {}).get("content") or ""
        await asyncio.wait_for(attacked.wait(), 10)  # before evil closes, its last publish answered
    finally:
        await sub.unsubscribe()
        await watcher.close()
        await evil.close()
    assert len(forged) == 3, "the attack did not run"
    assert FORGED not in text and text == reference["choices"][0]["message"]["content"], text
    wait_until(lambda: s.sql("SELECT status FROM requests WHERE request_id = '%s'" % rid) == [("finished",)], 30,
               "the victim's row finished")
    row = s.sql("SELECT completion_tokens, prompt_tokens, fellow_id FROM requests WHERE request_id = '%s'" % rid)
    usage = reference["usage"]
    assert row == [(usage["completion_tokens"], usage["prompt_tokens"], "f1")], row
    wait_until(lambda: len(s.sql("SELECT seq FROM dead_letters WHERE seq IN (%d, %d)" % tuple(forged[1:]))) == 2,
               30, "the forged usage kept as dead letters")
    reasons = s.dead_letters()[subjects.event("request.finished", "f2")]
    assert "refused: fellow f2 reported for fellow 'f1'" in reasons
    assert f"refused: request {rid} is of load '{alpha}', not '{beta}' (fellow f2)" in reasons


async def test_a_fellow_cannot_read_another_fellows_commands(swarm):
    """Its command consumer may only be filtered to its own commands (it could be to any before)."""
    evil = await swarm.login(fellow_user("f2"))
    try:
        other = ConsumerConfig(name="fellow-f2", durable_name="fellow-f2", filter_subject=subjects.commands_for("f1"),
                               ack_policy=AckPolicy.EXPLICIT)
        with pytest.raises(nats.errors.TimeoutError):
            await evil.jetstream().add_consumer(subjects.COMMANDS_STREAM, other, timeout=1.0)
        payload = msgspec.json.encode({"stream_name": subjects.COMMANDS_STREAM, "config": {
            "durable_name": "fellow-f2", "filter_subject": subjects.commands_for("f1"), "ack_policy": "explicit"}})
        for legacy in (f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.COMMANDS_STREAM}.fellow-f2",
                       f"$JS.API.CONSUMER.CREATE.{subjects.COMMANDS_STREAM}.fellow-f2"):
            with pytest.raises(nats.errors.TimeoutError):
                await evil.request(legacy, payload, timeout=1.0)
    finally:
        await evil.close()
    assert sum("permissions violation" in e.lower() for e in evil.denials) >= 3, evil.denials


async def test_a_fellow_cannot_read_another_requests_reply(swarm):
    """Attack 5: f2 asks SWARM_TOKENS for the frames of a request f1 served (the leader reads them there),
    by a message get, a direct get and a consumer, and for the requests in flight by stream info with a
    subjects filter (each request's subject and count; the other streams' likewise): NATS refuses each;
    what the intake needs of the stream, whether a request it knows has frames, it still has
    (fellow.token_batcher.stored_beyond); and requests are served as before."""
    s = swarm
    reply = chat(s, "alpha")
    rid = reply["id"].removeprefix("chatcmpl-")
    subject = subjects.tokens(rid)
    leader = await swarm.login(LEADER_USER)
    evil = await swarm.login(fellow_user("f2"))
    try:
        assert (await leader.jetstream().get_last_msg(subjects.TOKENS_STREAM, subject)).data  # stored, readable
        assert await stored_beyond(evil.jetstream(), rid) and not await stored_beyond(evil.jetstream(), "rq-none")
        asked = {f"$JS.API.STREAM.MSG.GET.{subjects.TOKENS_STREAM}": {"last_by_subj": subject},
                 f"$JS.API.DIRECT.GET.{subjects.TOKENS_STREAM}": {"last_by_subj": subject},
                 f"$JS.API.DIRECT.GET.{subjects.TOKENS_STREAM}.{subject}": {},
                 f"$JS.API.CONSUMER.CREATE.{subjects.TOKENS_STREAM}": {
                     "stream_name": subjects.TOKENS_STREAM, "config": {"filter_subject": subject}},
                 **{f"$JS.API.STREAM.INFO.{stream}": {"subjects_filter": ">"}
                    for stream in (subjects.TOKENS_STREAM, subjects.REQUESTS_STREAM, subjects.EVENTS_STREAM)}}
        for api, body in asked.items():
            with pytest.raises(nats.errors.TimeoutError):
                await evil.request(api, msgspec.json.encode(body), timeout=1.0)
        with pytest.raises(nats.errors.TimeoutError):
            await evil.jetstream().get_last_msg(subjects.TOKENS_STREAM, subject)
        with pytest.raises(nats.errors.TimeoutError):
            await evil.jetstream(timeout=1.0).stream_info(subjects.TOKENS_STREAM, subjects_filter=subject)
        assert (await leader.jetstream().stream_info(subjects.TOKENS_STREAM, subjects_filter=subject)
                ).state.subjects[subject] >= 2  # the probes stored nothing: start, tokens, done
    finally:
        await leader.close()
        await evil.close()
    denied = [e.lower() for e in evil.denials if "permissions violation" in e.lower()]
    for api in asked:
        assert any(f'"{api.lower()}"' in e for e in denied), (api, evil.denials)
    again = chat(s, "alpha")
    assert again["choices"][0]["message"]["content"] == reply["choices"][0]["message"]["content"]
