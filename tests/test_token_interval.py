"""A request's token frames after its first ride together, at most one an interval
(SWARM_SERVE_STREAM_INTERVAL_MS, fellow.token_batcher); the first token and the end go out at once.

A real nats-server; what the batcher published is read off the request's subject on the tokens stream."""

from __future__ import annotations

import asyncio

from events import subjects
from events.frames import DoneFrame, TokenFrame, TokenLogprob, frame_decoder
from fellow.token_batcher import TokenBatcher


async def stored(js, rid: str) -> int:
    subject = subjects.tokens(rid)
    info = await js.stream_info(subjects.TOKENS_STREAM, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def test_held_tokens_ride_in_one_frame_and_the_end_does_not_wait(nc, js):
    rid = "rq-interval-end"
    batcher = TokenBatcher(nc, js, rid, interval=600.0)  # only the end can send what it holds
    assert await batcher.start("f-1", 0)
    sub = await nc.subscribe(subjects.tokens(rid))
    batcher.add(["a"], [1])
    first = frame_decoder.decode((await sub.next_msg(timeout=5)).data)
    assert isinstance(first, TokenFrame) and first.texts == ["a"] and first.seq == 1
    for i in range(2, 6):
        batcher.add([str(i)], [i], [TokenLogprob(str(i), -float(i), [48 + i])])
    await asyncio.sleep(0)  # the sender's turn, had it one: its publish would precede the flush's ping
    await nc.flush()
    assert await stored(js, rid) == 2  # the start and the first token: the rest is held
    batcher.done(5, 3, "stop", {})
    await asyncio.wait_for(batcher.closed.wait(), 5)
    held = frame_decoder.decode((await sub.next_msg(timeout=5)).data)
    end = frame_decoder.decode((await sub.next_msg(timeout=5)).data)
    assert held.texts == ["2", "3", "4", "5"] and held.token_ids == [2, 3, 4, 5] and held.seq == 2
    assert [p.logprob for p in held.logprobs] == [-2.0, -3.0, -4.0, -5.0]
    assert isinstance(end, DoneFrame) and end.seq == 3 and end.completion_tokens == 5
    assert await stored(js, rid) == 4


async def test_the_interval_sends_what_it_held(nc, js):
    rid = "rq-interval-timer"
    batcher = TokenBatcher(nc, js, rid, interval=0.05)
    assert await batcher.start("f-1", 0)
    sub = await nc.subscribe(subjects.tokens(rid))
    batcher.add(["a"], [1])
    assert frame_decoder.decode((await sub.next_msg(timeout=5)).data).texts == ["a"]
    batcher.add(["b"], [2])
    batcher.add(["c"], [3])
    later = frame_decoder.decode((await sub.next_msg(timeout=5)).data)  # the timer's, with no end asked
    assert later.texts == ["b", "c"] and later.seq == 2
    batcher.add(["d"], [4])
    batcher.error("gone", "model_unloaded")
    await asyncio.wait_for(batcher.closed.wait(), 5)
    assert frame_decoder.decode((await sub.next_msg(timeout=5)).data).texts == ["d"]
    assert frame_decoder.decode((await sub.next_msg(timeout=5)).data).code == "model_unloaded"


async def test_no_interval_sends_each_token_as_it_comes(nc, js):
    rid = "rq-interval-none"
    batcher = TokenBatcher(nc, js, rid)
    assert await batcher.start("f-1", 0)
    sub = await nc.subscribe(subjects.tokens(rid))
    for i in range(3):
        batcher.add([str(i)], [i])
        assert frame_decoder.decode((await sub.next_msg(timeout=5)).data).texts == [str(i)]


async def test_no_interval_sends_a_frame_a_token_even_when_they_wait_together(nc, js):
    """SWARM_SERVE_STREAM_INTERVAL_MS=0 is a frame a token also when several steps' tokens reach the bus
    thread before the sender's turn (a busy machine); a closing piece of no token rides with the last."""
    rid = "rq-interval-waiting"
    batcher = TokenBatcher(nc, js, rid)
    assert await batcher.start("f-1", 0)
    sub = await nc.subscribe(subjects.tokens(rid))
    batcher.add(["a"], [1], [TokenLogprob("a", -1.0, [97])])
    batcher.add(["b", ""], [2, 3], [TokenLogprob("b", -2.0, [98]), TokenLogprob("", -3.0, [])])
    batcher.add(["!"], [], [])  # the detokenizer's tail at the end: a piece of no token
    batcher.done(3, 2, "stop", {})
    await asyncio.wait_for(batcher.closed.wait(), 5)
    frames = [frame_decoder.decode((await sub.next_msg(timeout=5)).data) for _ in range(4)]
    assert [(f.texts, f.token_ids) for f in frames[:3]] == [(["a"], [1]), (["b"], [2]), (["", "!"], [3])]
    assert [[p.logprob for p in f.logprobs] for f in frames[:3]] == [[-1.0], [-2.0], [-3.0]]
    assert [f.seq for f in frames] == [1, 2, 3, 4] and isinstance(frames[3], DoneFrame)
