"""The event envelope: tagged, frozen msgspec Structs encoded as JSON, tolerant of unknown fields."""

from __future__ import annotations

import time
import uuid

import msgspec


def new_id() -> str:
    """A fresh event id (also the JetStream Nats-Msg-Id, so a retried publish is deduplicated)."""
    return uuid.uuid4().hex


def now() -> float:
    return time.time()


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every past-tense event on SWARM_EVENTS.

    The tag (``type``) doubles as the subject suffix: ``swarm.evt.<type>``. Unknown fields are
    ignored on decode, so an older reader keeps working when a newer writer adds fields. Every
    concrete type is listed in `events.union`, which decodes them.
    """

    id: str = msgspec.field(default_factory=new_id)
    at: float = msgspec.field(default_factory=now)

    @property
    def type(self) -> str:
        return self.__struct_config__.tag  # type: ignore[return-value]


_encoder = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)
