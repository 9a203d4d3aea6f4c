"""What the bus can carry: a chat request over the server's max_payload is refused before it is recorded."""

from __future__ import annotations

import msgspec
from nats.aio.client import Client

from events.base import encode
from leader.errors import ApiError

HEADROOM = 1024  # bytes left for the message's headers (its Nats-Msg-Id), which count against the limit


def check_payload(nc: Client, msg: msgspec.Struct | bytes) -> None:
    """413 request_too_large when `msg`, encoded, would not fit in one message on this NATS server."""
    size = len(msg if isinstance(msg, bytes) else encode(msg))
    limit = nc.max_payload - HEADROOM
    if size > limit:
        raise ApiError(413, f"The request is {size:,} bytes once encoded; the message bus carries at most "
                            f"{limit:,}. Send fewer or shorter messages.", code="request_too_large",
                       param="messages")
