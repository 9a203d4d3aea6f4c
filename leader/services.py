"""The one signature the leader's parts share: publishing an event, optionally waiting for projections.

leader.context.Leader builds each service with the few things it uses (the bus, SQL sessions, the
projection runner, the fellow monitor, settings) passed in; a service that records an event gets the
leader's ``publish`` as a ``Publish``. This module imports no leader module, so nothing here can close
an import circle.
"""

from __future__ import annotations

from typing import Protocol

from nats.js.api import PubAck

from events.base import Event


class Publish(Protocol):
    """``Leader.publish``: publish an event; with `wait`, return only once those projections applied it."""

    async def __call__(self, evt: Event, wait: list[str] | None = None, timeout: float = 5.0) -> PubAck: ...
