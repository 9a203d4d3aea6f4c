"""The gateway's frame receiver against frames on a real nats-server: order, gaps, silence, failure, cancel."""

from __future__ import annotations

import asyncio

import pytest

from core.bus import publish_event, settle
from events import subjects
from events.base import new_id
from events.frames import DoneFrame, ErrorFrame, TokenFrame
from events.loads import LoadFailed
from leader.token_stream import FrameTimeout, TokenStreams
from tests.chat_fixtures import ServingPeer, wait_cancel


@pytest.fixture
async def hub(nc, js):
    streams = await TokenStreams(nc, js, probe_s=0.3, gap_wait_s=0.05).start()
    yield streams
    await streams.stop()


def token(rid: str, seq: int, text: str) -> TokenFrame:
    return TokenFrame(request_id=rid, seq=seq, texts=[text], text=text)


def done(rid: str, seq: int) -> DoneFrame:
    return DoneFrame(request_id=rid, seq=seq, completion_tokens=seq, prompt_tokens=3)


async def drain(stream, timeout: float = 5.0) -> list:
    frames = []
    while not frames or isinstance(frames[-1], TokenFrame):
        frames.append(await stream.next(timeout))
    return frames


async def test_frames_arrive_in_seq_order_whatever_order_they_were_published(hub, js):
    rid, peer = new_id(), ServingPeer(js)
    stream = await hub.open(rid, "ld-a")
    for seq in (2, 0, 3, 1):
        await peer.publish(token(rid, seq, f"t{seq}"))
    await peer.publish(done(rid, 4))
    await peer.publish(token(rid, 1, "t1"))  # a retried publish after the fact is ignored
    frames = await drain(stream)
    assert [f.seq for f in frames] == [0, 1, 2, 3, 4]
    assert [f.text for f in frames[:4]] == ["t0", "t1", "t2", "t3"]
    assert isinstance(frames[-1], DoneFrame) and stream.ended
    stream.close(cancel=False)


async def test_a_frame_the_subscription_missed_is_read_back_from_the_stream(hub, js):
    rid, peer = new_id(), ServingPeer(js)
    await peer.publish(token(rid, 1, "missed"))  # persisted before the receiver listened
    stream = await hub.open(rid, "ld-a")
    await peer.publish(token(rid, 0, "first"))
    await peer.publish(token(rid, 2, "third"))
    await peer.publish(done(rid, 3))
    frames = await drain(stream)
    assert [f.seq for f in frames] == [0, 1, 2, 3]
    assert frames[1].text == "missed"
    stream.close(cancel=False)


async def test_a_missed_last_frame_is_found_when_the_stream_goes_quiet(hub, js):
    rid, peer = new_id(), ServingPeer(js)
    await peer.publish(token(rid, 0, "a"))
    await peer.publish(done(rid, 1))
    stream = await hub.open(rid, "ld-a")  # everything was sent before it subscribed
    frames = await drain(stream)
    assert [type(f).__name__ for f in frames] == ["TokenFrame", "DoneFrame"]
    stream.close(cancel=False)


async def test_error_frame_ends_the_stream(hub, js):
    rid, peer = new_id(), ServingPeer(js)
    stream = await hub.open(rid, "ld-a")
    await peer.publish(token(rid, 0, "x"))
    await peer.fail(rid, 1, "this conversation needs 900 tokens", "context_too_long")
    frames = await drain(stream)
    assert isinstance(frames[-1], ErrorFrame) and frames[-1].code == "context_too_long"
    assert stream.ended
    stream.close(cancel=False)


async def test_load_failure_ends_only_the_requests_of_that_load(hub, js):
    peer = ServingPeer(js)
    hit, spared = await hub.open(new_id(), "ld-lost"), await hub.open(new_id(), "ld-fine")
    await peer.publish(token(hit.request_id, 0, "partial"))
    assert (await hit.next(5)).text == "partial"
    await publish_event(js, LoadFailed(load_id="ld-lost", model_id="m", reason="fellow f0 was lost",
                                       code="fellow_lost", fellow_id="f0"))
    failure = await hit.next(5)
    assert isinstance(failure, ErrorFrame) and failure.code == "load_failed"
    assert "fellow f0 was lost" in failure.message and failure.data["fellow_id"] == "f0"
    await peer.publish(token(spared.request_id, 0, "still here"))
    assert (await spared.next(5)).text == "still here"
    hit.close(cancel=True)
    spared.close(cancel=False)


async def test_a_request_opened_on_a_load_that_already_failed_fails_at_once(hub, js):
    """Accepted from a ready view a moment old: its load failed, its queue was purged, no stage will
    take it. It fails with load_failed at once, not after the client's own timeout."""
    first = await hub.open(new_id(), "ld-gone")
    await publish_event(js, LoadFailed(load_id="ld-gone", model_id="m", reason="fellow f0 was lost",
                                       code="fellow_lost", fellow_id="f0"))
    assert (await first.next(5)).code == "load_failed"  # the receiver has seen the failure
    late = await hub.open(new_id(), "ld-gone")
    failure = await late.next(0.5)
    assert isinstance(failure, ErrorFrame) and failure.code == "load_failed"
    assert "fellow f0 was lost" in failure.message and failure.data["load_code"] == "fellow_lost"
    first.close(cancel=False)
    late.close(cancel=False)


async def test_the_ready_view_is_told_each_load_that_ended(hub, js):
    told = []
    hub.on_ended.append(told.append)
    watcher = await hub.open(new_id(), "ld-x")
    await publish_event(js, LoadFailed(load_id="ld-x", model_id="m", reason="no", code="fellow_lost"))
    assert (await watcher.next(5)).code == "load_failed"
    assert told == ["ld-x"]
    watcher.close(cancel=False)


async def test_silence_times_out(hub):
    stream = await hub.open(new_id(), "ld-a")
    with pytest.raises(FrameTimeout):
        await stream.next(0.5)
    stream.close(cancel=False)


async def test_closing_before_the_end_publishes_a_cancel_and_after_it_does_not(hub, nc, js):
    peer = ServingPeer(js)
    unfinished = await hub.open(new_id(), "ld-a")
    cancelled = await wait_cancel(nc, unfinished.request_id)
    unfinished.close(cancel=True)
    assert await asyncio.wait_for(cancelled, 5) == subjects.cancel("ld-a", unfinished.request_id)

    finished = await hub.open(new_id(), "ld-a")
    await peer.publish(done(finished.request_id, 0))
    await drain(finished)
    not_cancelled = await wait_cancel(nc, finished.request_id)
    finished.close(cancel=True)
    marker = await wait_cancel(nc, "marker")
    await nc.publish(subjects.cancel("ld-a", "marker"), b"")  # after close's own publish would have gone out
    await asyncio.wait_for(marker, 5)
    await settle(nc)
    assert not not_cancelled.done()
