"""Every event on SWARM_EVENTS as one tagged union, and its one decoder.

The list is explicit: decoding never depends on which modules happened to be imported. A new event
type is added here, or readers skip it as a newer writer's.
"""

from __future__ import annotations

from typing import Union

import msgspec

from events.api_tokens import ApiTokenMinted, ApiTokenPruned, ApiTokenRevoked
from events.base import Event
from events.catalog import ModelCataloged, ModelUncataloged
from events.fellow import FellowJoined, FellowLost
from events.loads import (
    LoadFailed,
    LoadPlaced,
    LoadRequested,
    ModelLoaded,
    ModelUnloaded,
    ReplicaLost,
    StageReady,
    StageReplaced,
    UnloadRequested,
)
from events.moves import RequestMoved
from events.requests import RequestAccepted, RequestFailed, RequestFinished
from events.verify import FellowDrained, ReplyChecked

EVENT_TYPES: tuple[type[Event], ...] = (
    FellowJoined, FellowLost,
    ModelCataloged, ModelUncataloged,
    LoadRequested, LoadPlaced, StageReady, ModelLoaded, UnloadRequested, LoadFailed, ModelUnloaded, ReplicaLost,
    StageReplaced,
    RequestAccepted, RequestFinished, RequestFailed, RequestMoved,
    ApiTokenMinted, ApiTokenRevoked, ApiTokenPruned,
    ReplyChecked, FellowDrained,
)
AnyEvent = Union[EVENT_TYPES]  # type: ignore[valid-type]
TAGS = frozenset(t.__struct_config__.tag for t in EVENT_TYPES)


class PoisonEvent(ValueError):
    """A message on SWARM_EVENTS that no reader can decode; the message says why, in one line."""


class _Header(msgspec.Struct):
    type: str = ""


_decoder = msgspec.json.Decoder(AnyEvent)
_header = msgspec.json.Decoder(_Header)


def decode_event(data: bytes) -> Event | None:
    """One event; None for a type this reader does not know (a newer writer's).

    Raises PoisonEvent for anything else that does not decode: not JSON, the wrong schema for a
    known type, no type at all, or nesting too deep to read.
    """
    try:
        return _decoder.decode(data)
    except RecursionError:
        raise PoisonEvent("nested too deeply to decode") from None
    except msgspec.DecodeError as exc:
        reason = str(exc)
    try:
        kind = _header.decode(data).type
    except (msgspec.DecodeError, RecursionError):
        kind = ""
    if kind and kind not in TAGS:
        return None
    raise PoisonEvent(reason)
