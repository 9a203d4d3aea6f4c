"""A session as stage 0 of a ring keeps it: what is in the ring, and where its token's time went."""

from __future__ import annotations

from dataclasses import dataclass, field

from fellow.runtime.engine.session import Session


class RingFailure(ValueError):
    """A request the ring could not serve (a later stage failed on it, or the ring is gone).

    A ValueError, so a job refused at admission becomes that request's error like any refusal.
    """

    def __init__(self, message: str, code: str = "ring_failed", data: dict | None = None):
        super().__init__(message)
        self.code = code
        self.data = data or {}


@dataclass(eq=False)
class RingSession(Session):
    """A Session plus its ring bookkeeping; ``timing()`` adds the split of a token's time."""

    in_ring: int = field(default=0, init=False)  # frames sent and not answered yet
    ready: bool = field(default=False, init=False)  # its token is back: its next position can go
    confirming: bool = field(default=False, init=False)  # its first piece reused a prefix: unanswered yet
    routes: str = field(default="", init=False)  # its latest answer's hops: "d" direct or "r" relay each
    first_pos: int = field(default=0, init=False)  # where its first frame starts (after a reused prefix)
    history: list[int] | None = field(default=None, init=False)  # what a replay prefills: prompt + reply so far
    must_replay: bool = field(default=False, init=False)  # a paused ring lost its frames: replay on resume
    replays: int = field(default=0, init=False)
    attempt: int = field(default=0, init=False)  # its frames' try: what older frames answer is dropped

    @property
    def feed(self) -> list[int]:
        """The positions its prefill sends: the prompt, or on a replay the prompt and the reply so far."""
        return self.history if self.history is not None else self.prompt_ids

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.feed)
    decode_sent_at: float | None = field(default=None, init=False)  # when its decode frame left
    last_sent_at: float = field(default=0.0, init=False)
    stage0_s: float = field(default=0.0, init=False)
    stage0_steps: int = field(default=0, init=False)
    later_s: list[float] = field(default_factory=list, init=False)  # per later stage, summed
    link_s: float = field(default=0.0, init=False)
    replies: int = field(default=0, init=False)
    wire_bytes: int = field(default=0, init=False)
    wire_positions: int = field(default=0, init=False)

    @classmethod
    def adopt(cls, session: Session) -> "RingSession":
        return cls(session.session_id, session.prompt_ids, session.max_new_tokens, sampling=session.sampling,
                   stop_ids=session.stop_ids)

    def sent(self, data_bytes: int, positions: int, now: float) -> None:
        self.in_ring += 1
        self.wire_bytes += data_bytes
        self.wire_positions += positions
        self.last_sent_at = now

    def answered(self, compute_ms: list[float], now: float) -> None:
        """A decode position's token came back: stage i's compute, and the rest is the link's."""
        if self.decode_sent_at is None:
            return
        round_trip = now - self.decode_sent_at
        later = [ms / 1e3 for ms in compute_ms]
        if len(self.later_s) < len(later):
            self.later_s += [0.0] * (len(later) - len(self.later_s))
        for i, seconds in enumerate(later):
            self.later_s[i] += seconds
        self.link_s += max(0.0, round_trip - sum(later))
        self.replies += 1
        self.decode_s += round_trip
        self.decode_steps += 1
        self.decode_sent_at = None

    def timing(self, now: float | None = None) -> dict:
        timing = super().timing(now)
        timing["route"] = route_name(self.routes)
        if self.stage0_steps:
            timing["stage0_ms"] = round(self.stage0_s * 1e3 / self.stage0_steps, 3)
            timing["decode_ms"] = round((self.stage0_s + self.decode_s) * 1e3 / self.stage0_steps, 3)
        if self.replies:
            timing["link_ms"] = round(self.link_s * 1e3 / self.replies, 3)
            for i, seconds in enumerate(self.later_s, start=1):
                timing[f"stage{i}_ms"] = round(seconds * 1e3 / self.replies, 3)
        if self.wire_positions:
            timing["bytes_per_token"] = round(self.wire_bytes / self.wire_positions, 3)
        if self.replays:
            timing["replays"] = self.replays  # a lost stage was re-placed, and this session replayed
        return timing


def route_name(routes: str) -> str:
    """``direct`` or ``relay`` where every hop went one way; else each hop's, in ring order ("direct,relay")."""
    names = ["direct" if c == "d" else "relay" for c in routes] or ["relay"]  # "?" (still dialing): relay
    return names[0] if len(set(names)) == 1 else ",".join(names)
