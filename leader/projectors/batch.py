"""A fetched batch of SWARM_EVENTS, decoded once and shared by every projector; dead letters."""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from events.base import Event
from events.union import PoisonEvent, decode_event
from leader.db.tables import DeadLetter, ProjectorCheckpoint
from leader.projectors.projector import Projector

log = logging.getLogger(__name__)


class Entry(NamedTuple):
    """One message of a batch: its stream position, and its event (None: unknown type or poison)."""

    seq: int
    subject: str
    event: Event | None
    poison: str = ""  # why it could not be decoded; "" when it could


def decode_batch(msgs: list) -> list[Entry]:
    out = []
    for msg in msgs:
        seq = msg.metadata.sequence.stream
        try:
            out.append(Entry(seq, msg.subject, decode_event(msg.data)))
        except PoisonEvent as exc:
            out.append(Entry(seq, msg.subject, None, str(exc) or type(exc).__name__))
    return out


async def record_dead_letters(session: AsyncSession, batch: list[Entry]) -> int:
    """Record each poison message of the batch once; returns how many were new."""
    new = 0
    for e in batch:
        if e.poison and await session.get(DeadLetter, e.seq) is None:
            session.add(DeadLetter(seq=e.seq, subject=e.subject[:255], reason=e.poison, recorded_at=time.time()))
            log.warning("dead letter at stream sequence %d on %s: %s", e.seq, e.subject, e.poison)
            new += 1
    return new


async def read_checkpoint(session: AsyncSession, name: str) -> int:
    row = await session.get(ProjectorCheckpoint, name)
    return row.seq if row else 0


async def apply_batch(session: AsyncSession, projector: Projector, batch: list[Entry],
                      applied: list | None = None) -> int:
    """Apply every event above the checkpoint and advance it past the whole batch; returns the new
    checkpoint. Events applied are appended to `applied` when given (for reactions after the commit).

    The checkpoint row is read FOR UPDATE (PostgreSQL): two leaders on one database take each batch
    in turn, and the second finds the first's checkpoint and skips what it applied, so each event is
    projected once across them. (SQLite takes one writer at a time anyway.)"""
    row = await session.get(ProjectorCheckpoint, projector.name, with_for_update=True)
    if row is None:  # its first batch; another leader may be creating the row right now
        insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
        await session.execute(insert(ProjectorCheckpoint).values(name=projector.name, seq=0).on_conflict_do_nothing())
        row = await session.get(ProjectorCheckpoint, projector.name, with_for_update=True)
    checkpoint = row.seq
    for e in batch:
        if e.seq <= checkpoint:
            continue  # a redelivery or an overlap with a replay: already applied
        if e.event is not None:
            await projector.apply(session, e.event, e.seq)
            if applied is not None:
                applied.append(e.event)
        checkpoint = e.seq
    row.seq = checkpoint
    return checkpoint
