"""Rebuild a projection from stream sequence 1 into the same rows the live projector wrote."""

from __future__ import annotations

import asyncio

from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sqlalchemy.ext.asyncio import async_sessionmaker

from events.subjects import EVENTS_ALL, EVENTS_STREAM
from leader.db.tables import ProjectorCheckpoint
from leader.projectors.authority import Authority
from leader.projectors.batch import apply_batch, decode_batch
from leader.projectors.projector import Projector


async def replay(js: JetStreamContext, sessions: async_sessionmaker, projector: Projector) -> int:
    """Clear the projector's tables and re-apply the whole log in one transaction.

    One transaction means readers never see a half-built table, and the live projector, which
    skips what is at or below the checkpoint, continues after it. Returns the new checkpoint.
    """
    info = await js.stream_info(EVENTS_STREAM)
    last = info.state.last_seq
    sub = await js.pull_subscribe(
        EVENTS_ALL, stream=EVENTS_STREAM,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE,
                              inactive_threshold=60.0),
    )
    authority = Authority(sessions)  # what the live reader refused stays out
    try:
        async with sessions() as session, session.begin():
            await projector.clear(session)
            row = await session.get(ProjectorCheckpoint, projector.name)
            if row is not None:
                row.seq = 0
            await session.flush()
            seq = 0
            while seq < last:
                try:
                    msgs = await sub.fetch(1024, timeout=5)
                except (NatsTimeout, asyncio.TimeoutError):  # nats-py raises either, by timing
                    break  # the stream's head was trimmed below `last`; nothing more to read
                if not msgs:
                    continue  # an empty fetch: ask again
                seq = await apply_batch(session, projector, await authority.screen(decode_batch(msgs)))
        return seq
    finally:
        await sub.unsubscribe()
