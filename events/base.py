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
    ignored on decode, so an older reader keeps working when a newer writer adds fields.
    """

    id: str = msgspec.field(default_factory=new_id)
    at: float = msgspec.field(default_factory=now)

    @property
    def type(self) -> str:
        return self.__struct_config__.tag  # type: ignore[return-value]


class _Header(msgspec.Struct):
    type: str = ""


_header_decoder = msgspec.json.Decoder(_Header)
_encoder = msgspec.json.Encoder()
_decoders: dict[str, msgspec.json.Decoder] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def event_types() -> dict[str, type[Event]]:
    """Every Event subclass imported so far, by tag."""
    found: dict[str, type[Event]] = {}
    todo = list(Event.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        tag = cls.__struct_config__.tag
        if isinstance(tag, str):
            found[tag] = cls
    return found


def decode_event(data: bytes) -> Event | None:
    """Decode one event; None for a type this reader does not know (newer writer)."""
    kind = _header_decoder.decode(data).type
    dec = _decoders.get(kind)
    if dec is None:
        cls = event_types().get(kind)
        if cls is None:
            return None
        dec = _decoders[kind] = msgspec.json.Decoder(cls)
    return dec.decode(data)
