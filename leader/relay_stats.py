"""The relay's statistics: bytes and frames each ring stage sent per lane, as the stages report them."""

from __future__ import annotations

import logging

import msgspec
from nats.aio.client import Client

from core.bus import unsubscribe_quietly
from events.ring import STATS_ALL, LaneStats, decode_frame

log = logging.getLogger(__name__)


class RelayStats:
    """Every stage of a ring publishes its running totals now and then on ``swarm.ring.<load>.stats``.

    The leader keeps the latest per stage, so the activations themselves never pass through it.
    """

    def __init__(self) -> None:
        self.loads: dict[str, dict[int, LaneStats]] = {}  # load_id -> stage -> its latest totals
        self._sub = None

    async def start(self, nc: Client) -> None:
        self._sub = await nc.subscribe(STATS_ALL, cb=self._on_stats)

    async def stop(self) -> None:
        await unsubscribe_quietly(self._sub)
        self._sub = None

    async def _on_stats(self, msg) -> None:
        try:
            frame = decode_frame(msg.data)
        except (msgspec.DecodeError, RecursionError):  # not a frame, or nested too deep
            log.warning("dropped malformed lane stats on %s", msg.subject)
            return
        if isinstance(frame, LaneStats):
            self.loads.setdefault(msg.subject.split(".")[2], {})[(frame.replica, frame.stage)] = frame

    def lanes(self, load_id: str) -> dict[str, dict]:
        """lane -> {"stage", "bytes", "frames"} for one load; empty before its stages reported."""
        stages = self.loads.get(load_id, {})
        out = {}
        last = max(stage for _, stage in stages) if stages else 0
        for _, stats in sorted(stages.items()):
            for lane, (sent_bytes, frames) in stats.lanes.items():
                entry = out.setdefault(lane, {"stage": _owner(lane, last), "bytes": 0, "frames": 0})
                entry["bytes"] += sent_bytes  # a middle stage's error answers ride on tok too
                entry["frames"] += frames
        return out

    def forget(self, load_id: str) -> None:
        self.loads.pop(load_id, None)


def _owner(lane: str, last_stage: int) -> int:
    """The stage whose lane it is: act is stage 0's, act<i> stage i's, tok the last stage's (a ring
    replica's lanes are prefixed: r1-act ...)."""
    lane = lane.split("-", 1)[-1]
    if lane == "act":
        return 0
    if lane.startswith("act") and lane[3:].isdigit():
        return int(lane[3:])
    return last_stage
