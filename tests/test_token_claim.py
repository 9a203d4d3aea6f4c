"""Frame 0, a replica's claim on a request (fellow.token_batcher): stored only on an empty subject, under
an id of the claimant's own, so a second claimant is refused and a claimant whose ack was lost learns
that the stored frame is its own without reading SWARM_TOKENS (which a fellow may not, issue 38).

A real nats-server, one node or a cluster of three (which finds a duplicate before it checks the
expected subject sequence; one node checks that first). A lost ack is the real server storing the frame
while its answer never reaches the publisher."""

from __future__ import annotations

import asyncio

import nats
import pytest

from core.bus import connect, ensure_streams
from core.nats_server import local_cluster
from events import subjects
from events.frames import DoneFrame, ErrorFrame, StartFrame, frame_decoder, frame_key, frame_signed
from fellow.token_batcher import TokenBatcher, stored_beyond
from leader.frames_in import read_frame

KEY = frame_key(b"leader-secret", "rq-claim")


class LosesAnswer:
    """A JetStream context whose next publish reaches the server (`stored`) or not, and whose answer is
    lost: raises `lost` instead (a timeout is retried by core.bus; anything else makes start() raise)."""

    def __init__(self, js, lost: Exception, stored: bool = True):
        self._js, self.lost, self.stored, self.pending = js, lost, stored, True

    async def publish(self, *args, **kwargs):
        if not self.pending:
            return await self._js.publish(*args, **kwargs)
        self.pending = False
        if self.stored:
            await self._js.publish(*args, **kwargs)
        raise self.lost

    def __getattr__(self, name):
        return getattr(self._js, name)


@pytest.fixture
async def cluster_js(tmp_path):
    nodes = local_cluster(tmp_path / "nats", 3)
    client = None
    try:
        for node in nodes:
            node.start()
        client = await connect(nodes[0].url, name="test")
        js = client.jetstream()
        await ensure_streams(js, replicas=3)
        yield client, js
    finally:
        if client is not None and not client.is_closed:
            await client.close()
        for node in nodes:
            node.stop()


async def frames(js, rid: str) -> list:
    """Every stored frame of `rid`, in order (as many as the stream counts on its subject)."""
    subject = subjects.tokens(rid)
    info = await js.stream_info(subjects.TOKENS_STREAM, subjects_filter=subject)
    count = (info.state.subjects or {}).get(subject, 0)
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        return [frame_decoder.decode((await sub.next_msg(timeout=5)).data) for _ in range(count)]
    finally:
        await sub.unsubscribe()


async def claim_race(nc, js) -> None:
    rid = "rq-claim"
    first = TokenBatcher(nc, LosesAnswer(js, nats.errors.TimeoutError()), rid, KEY)
    assert await first.start("f0", 0) is True  # stored, its ack lost: the retry learns the frame is its own
    second = TokenBatcher(nc, js, rid, KEY)
    assert await second.start("f1", 1) is False  # frozen past the ack wait, it comes second: refused
    late = TokenBatcher(nc, LosesAnswer(js, nats.errors.TimeoutError(), stored=False), rid, KEY)
    assert await late.start("f2", 0) is False  # its first try lost on the way, its retry refused
    first.done(3, 2, "stop", {})
    await asyncio.wait_for(first.closed.wait(), 10)
    assert await frames(js, rid) == [StartFrame(request_id=rid, seq=0, fellow_id="f0", replica=0),
                                     DoneFrame(request_id=rid, seq=1, completion_tokens=3, prompt_tokens=2)]
    stored = await js.get_last_msg(subjects.TOKENS_STREAM, subjects.tokens(rid))  # the test reads as the leader
    assert frame_signed(KEY, stored.data, stored.headers)  # still signed with the request's key


async def probe_race(nc, js) -> None:
    """stored_beyond: whether the subject holds a frame after a stream sequence, told by a publish the
    stream refuses (a fellow may not ask stream info); it stores nothing, and the gateway, which sees
    it live, takes it for no frame."""
    rid = "rq-probe"
    sub = await nc.subscribe(subjects.tokens(rid))
    assert await stored_beyond(js, rid) is False
    batcher = TokenBatcher(nc, js, rid, KEY)
    assert await batcher.start("f0", 0) is True
    assert await stored_beyond(js, rid) is True  # the start frame: a redelivery is not served again
    start_seq = (await js.get_last_msg(subjects.TOKENS_STREAM, subjects.tokens(rid))).seq
    assert await stored_beyond(js, rid, start_seq) is False  # a move's `after`: nothing since
    batcher.done(1, 2, "stop", {})
    await asyncio.wait_for(batcher.closed.wait(), 10)
    assert await stored_beyond(js, rid, start_seq) is True
    assert await frames(js, rid) == [StartFrame(request_id=rid, seq=0, fellow_id="f0", replica=0),
                                     DoneFrame(request_id=rid, seq=1, completion_tokens=1, prompt_tokens=2)]
    live = [await sub.next_msg(timeout=5) for _ in range(6)]  # four probes and two frames, seen live
    await sub.unsubscribe()
    assert [type(read_frame(m, KEY)).__name__ for m in live] == [
        "NoneType", "StartFrame", "NoneType", "NoneType", "DoneFrame", "NoneType"]


async def test_a_second_claimant_is_refused_and_a_claim_whose_ack_was_lost_is_still_ours(nc, js):
    await claim_race(nc, js)


async def test_a_request_with_frames_is_told_by_a_publish_that_stores_nothing(nc, js):
    await probe_race(nc, js)


@pytest.mark.slow
async def test_the_same_on_a_cluster(cluster_js):
    await claim_race(*cluster_js)
    await probe_race(*cluster_js)


async def test_a_start_that_raised_then_ends_after_its_own_stored_claim(nc, js):
    """start() raised (its frame may be stored or not) and the intake refuses the request: the end goes
    after our start frame if it was stored, and nowhere if another replica's claim is there."""
    ours = TokenBatcher(nc, LosesAnswer(js, nats.errors.ConnectionReconnectingError()), "rq-mine")
    with pytest.raises(nats.errors.ConnectionReconnectingError):
        await ours.start("f0", 0)
    ours.error("the start frame was not published", "intake_failed")
    await asyncio.wait_for(ours.closed.wait(), 10)
    assert await frames(js, "rq-mine") == [
        StartFrame(request_id="rq-mine", seq=0, fellow_id="f0", replica=0),
        ErrorFrame(request_id="rq-mine", seq=1, message="the start frame was not published", code="intake_failed")]

    other = TokenBatcher(nc, js, "rq-theirs")
    assert await other.start("f1", 1) is True
    lost = TokenBatcher(nc, LosesAnswer(js, nats.errors.ConnectionReconnectingError(), stored=False), "rq-theirs")
    with pytest.raises(nats.errors.ConnectionReconnectingError):
        await lost.start("f0", 0)
    lost.error("the start frame was not published", "intake_failed")
    await asyncio.wait_for(lost.closed.wait(), 10)
    assert await frames(js, "rq-theirs") == [StartFrame(request_id="rq-theirs", seq=0, fellow_id="f1", replica=1)]


async def test_a_request_refused_before_its_start_ends_once_and_never_after_a_claim(nc, js):
    for fellow in ("f0", "f1"):  # two replicas refuse it (a prompt too long for both): one error frame
        refuser = TokenBatcher(nc, js, "rq-refused")
        refuser.error(f"too long for {fellow}", "context_length_exceeded")
        await asyncio.wait_for(refuser.closed.wait(), 10)
    assert await frames(js, "rq-refused") == [
        ErrorFrame(request_id="rq-refused", seq=0, message="too long for f0", code="context_length_exceeded")]

    assert await TokenBatcher(nc, js, "rq-served").start("f0", 0) is True
    refuser = TokenBatcher(nc, js, "rq-served")  # refuses it after another replica took it: not stored
    refuser.error("too long", "context_length_exceeded")
    await asyncio.wait_for(refuser.closed.wait(), 10)
    assert await frames(js, "rq-served") == [StartFrame(request_id="rq-served", seq=0, fellow_id="f0", replica=0)]


async def test_what_comes_while_the_start_frame_is_acked_waits_for_it_and_goes_nowhere_if_refused(nc, js):
    """Tokens and the end given while start() waits for JetStream's answer follow the stored start frame
    in order; a claimant refused sends none of what it was given (the intake drops the request)."""
    ours = TokenBatcher(nc, js, "rq-early")
    claim = asyncio.create_task(ours.start("f0", 0))
    await asyncio.sleep(0)  # start() is waiting for the answer
    ours.add(["a", "b"], [5, 6])
    ours.done(2, 3, "length", {})
    assert await claim is True
    await asyncio.wait_for(ours.closed.wait(), 10)
    got = await frames(js, "rq-early")
    assert [type(f).__name__ for f in got] == ["StartFrame", "TokenFrame", "TokenFrame", "DoneFrame"]  # a frame a token
    assert [f.seq for f in got] == [0, 1, 2, 3] and (got[1].token_ids, got[2].token_ids) == ([5], [6])

    assert await TokenBatcher(nc, js, "rq-taken").start("f1", 1) is True
    refused = TokenBatcher(nc, js, "rq-taken")
    claim = asyncio.create_task(refused.start("f0", 0))
    await asyncio.sleep(0)
    refused.add(["x"], [7])
    refused.error("should not be sent", "internal_error")
    assert await claim is False
    await asyncio.wait_for(refused.closed.wait(), 10)
    assert await frames(js, "rq-taken") == [StartFrame(request_id="rq-taken", seq=0, fellow_id="f1", replica=1)]
