"""Replies checked by a second fellow (docs/verification.md): checks.py judges, verifier.py asks and
drains, projector.py records; ``start_verifier`` is the leader's one call."""

from __future__ import annotations

from leader.verify.projector import ChecksProjector
from leader.verify.verifier import Verifier


async def start_verifier(settings, nc, js, sessions, streams, publish, projections) -> Verifier:
    """The leader's verifier at ``SWARM_VERIFY_SHARE``, drawing on the reply checks projector's tally."""
    projector = projections.projectors["reply_checks"]
    assert isinstance(projector, ChecksProjector)
    return await Verifier(settings.leader.verify_share, nc, js, sessions, streams, publish, projector.tally).start()
