"""How many sessions a ring keeps in flight, and in how many decode groups, from what stage 0 measured.

A token's trip round the ring takes every stage's step and every hop's one-way delay: the pipe,
``sum(step_ms) + transit_ms``. One decode group is in one place at a time, so with G groups the
slowest stage is busy G x max(step_ms) of each trip. G near pipe / max(step_ms) keeps it busy; fewer
leave every stage waiting on the links, more only queue behind it (each session's tokens slow down and
the ring's do not speed up). On one machine or a LAN the pipe is about one step per stage and G is the
number of stages, as before; over 50 ms links with 10 ms steps it is seven groups on two stages.

Each group keeps the size the plan counts on (its in flight over its stages), so a ring over slow links
holds more sessions, not bigger batches: a bigger batch costs every stage more per step, and so every
trip. The KV cache still has the last word (fellow.runtime.ring.servers.RingHeadServer lowers the
result to what every stage holds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RingSizing:
    groups: int  # decode groups in the ring at once
    in_flight: int  # sessions: groups x per_group, at most the ceiling
    per_group: int
    step_ms: tuple[float, ...]  # each stage's decode step at per_group rows, stage 0 first
    transit_ms: float  # a probe's trip round the ring with no compute: every hop, one way

    @property
    def pipe_ms(self) -> float:
        return sum(self.step_ms) + self.transit_ms

    def as_dict(self) -> dict:
        return {"groups": self.groups, "in_flight": self.in_flight, "per_group": self.per_group,
                "step_ms": [round(ms, 3) for ms in self.step_ms], "transit_ms": round(self.transit_ms, 3),
                "pipe_ms": round(self.pipe_ms, 3)}


def size_ring(step_ms: list[float], transit_ms: float, per_group: int, ceiling: int) -> RingSizing:
    """Groups and sessions in flight for a ring whose stages step in ``step_ms`` (at ``per_group`` rows)
    and whose links take ``transit_ms`` round it; never fewer groups than stages, never more sessions
    than ``ceiling`` (nor fewer than one group a stage)."""
    stages = len(step_ms)
    if stages < 2:
        raise ValueError("a ring has at least two stages")
    per_group = max(1, per_group)
    slowest = max(step_ms)
    pipe = sum(step_ms) + max(0.0, transit_ms)
    groups = max(stages, round(pipe / slowest)) if slowest > 0 else stages
    groups = max(stages, min(groups, ceiling // per_group))
    return RingSizing(groups=groups, in_flight=groups * per_group, per_group=per_group,
                      step_ms=tuple(step_ms), transit_ms=max(0.0, transit_ms))


def groups_for(in_flight: int, per_group: int, stages: int) -> int:
    """Decode groups for ``in_flight`` sessions (after the KV cache lowered them): one a stage at least."""
    return max(stages, math.ceil(in_flight / max(1, per_group)))
