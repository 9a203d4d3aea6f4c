"""A model's performance over the last minutes: per-minute figures from the requests table, plus its ring.

The same dict feeds `GET /api/v1/models/{id}/performance` and the dashboard's charts, so what a
chart draws is exactly what the API answers.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import msgspec

from leader.db.tables import Load, LoadStage, Request

WINDOW_S = 900
BUCKET_S = 60
# The parts a token's time splits into (spec: stage0_ms, link_ms, stage1_ms ...), in ring order.
_PART = re.compile(r"^(stage(\d+)|link)_ms$")


def buckets_since(now: float, window_s: int = WINDOW_S, bucket_s: int = BUCKET_S) -> float:
    """Start of the oldest bucket: whole minutes, the newest one holding `now`."""
    count = max(1, math.ceil(window_s / bucket_s))
    return (math.floor(now / bucket_s) - count + 1) * bucket_s


def _part_order(name: str) -> tuple[int, int]:
    m = _PART.match(name)
    stage = int(m.group(2)) if m and m.group(2) else 0
    return (stage, 1 if name == "link_ms" else 0)  # the link sits between stage 0 and stage 1


class _Tally:
    """Sums over a set of requests; `figures()` turns them into the JSON both views use."""

    def __init__(self):
        self.status = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt positions the prefix cache served (timing.cached_tokens)
        self.ttfts: list[float] = []
        self.decode_weighted = 0.0  # per-request decode speed, weighted by its tokens
        self.decode_weight = 0
        self.parts: dict[str, float] = {}  # part -> sum of ms x tokens
        self.parts_weight = 0
        self.prefill_ms: list[float] = []
        self.bytes_per_token: list[float] = []
        self.routes = Counter()
        self.errors = Counter()
        self.finish_reasons = Counter()
        self.spec = Counter()  # speculative decoding: spec_drafted, spec_accepted, spec_passes, spec_tokens

    def add(self, r: Request) -> None:
        cancelled = r.status == "finished" and r.finish_reason == "cancelled"
        self.status["cancelled" if cancelled else r.status] += 1
        self.prompt_tokens += r.prompt_tokens or 0
        self.completion_tokens += r.completion_tokens or 0
        if r.finish_reason:
            self.finish_reasons[r.finish_reason] += 1
        if r.error_code:
            self.errors[r.error_code] += 1
        if r.ttft_s is not None:
            self.ttfts.append(r.ttft_s * 1e3)
        weight = max(1, r.completion_tokens or 0)
        if r.tokens_per_s:
            self.decode_weighted += r.tokens_per_s * weight
            self.decode_weight += weight
        timing = r.timing or {}
        if isinstance(timing.get("cached_tokens"), int):
            self.cached_tokens += timing["cached_tokens"]
        parts = {k: float(v) for k, v in timing.items() if _PART.match(k) and isinstance(v, (int, float))}
        if not parts and isinstance(timing.get("decode_ms"), (int, float)):
            per_token = float(timing["decode_ms"])  # one stage: its decode step is the whole token ...
            passes = timing.get("decode_passes")
            if isinstance(passes, int) and r.completion_tokens and r.completion_tokens > 1:
                per_token *= passes / (r.completion_tokens - 1)  # ... unless its passes gained drafted tokens
            parts = {"stage0_ms": per_token}
        if parts:
            for k, v in parts.items():
                self.parts[k] = self.parts.get(k, 0.0) + v * weight
            self.parts_weight += weight
        if isinstance(timing.get("prefill_ms"), (int, float)):
            self.prefill_ms.append(float(timing["prefill_ms"]))
        if isinstance(timing.get("bytes_per_token"), (int, float)):
            self.bytes_per_token.append(float(timing["bytes_per_token"]))
        if timing.get("route"):
            self.routes[str(timing["route"])] += 1
        for key in ("spec_drafted", "spec_accepted", "spec_passes", "spec_tokens"):
            if isinstance(timing.get(key), int):
                self.spec[key] += timing[key]

    def figures(self, seconds: float) -> dict:
        split = {k: round(self.parts[k] / self.parts_weight, 3) for k in sorted(self.parts, key=_part_order)}
        return {
            "requests": sum(self.status.values()),
            "finished": self.status["finished"], "cancelled": self.status["cancelled"],
            "failed": self.status["failed"], "too_long": self.status["too_long"],
            "in_flight": self.status["accepted"],
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            # the share of prompt tokens the prefix cache served, as the stages count it
            "prefix_hit_rate": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else None,
            "tokens_per_s": round(self.completion_tokens / seconds, 3) if seconds > 0 else 0.0,
            "decode_tokens_per_s": round(self.decode_weighted / self.decode_weight, 3) if self.decode_weight else None,
            "ttft_ms": _mean(self.ttfts),
            "ttft_ms_p50": _quantile(self.ttfts, 0.5), "ttft_ms_p95": _quantile(self.ttfts, 0.95),
            "prefill_ms": _mean(self.prefill_ms), "bytes_per_token": _mean(self.bytes_per_token),
            "split_ms": split, "per_token_ms": round(sum(split.values()), 3) if split else None,
            # speculative decoding: the share of drafted tokens that stood, and tokens per pass with drafts
            "spec_acceptance": (round(self.spec["spec_accepted"] / self.spec["spec_drafted"], 4)
                                if self.spec["spec_drafted"] else None),
            "spec_tokens_per_pass": (round(self.spec["spec_tokens"] / self.spec["spec_passes"], 3)
                                     if self.spec["spec_passes"] else None),
        }


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _when(r: Request) -> float:
    """A request counts in the minute it ended (in flight: the minute it was accepted)."""
    return r.ended_at if r.ended_at is not None else r.accepted_at


def aggregate(rows: list[Request], now: float, window_s: int = WINDOW_S, bucket_s: int = BUCKET_S) -> dict:
    """Totals over the window and one entry per bucket (oldest first, empty minutes included)."""
    since = buckets_since(now, window_s, bucket_s)
    count = int(round((math.floor(now / bucket_s) * bucket_s - since) / bucket_s)) + 1
    tallies = [_Tally() for _ in range(count)]
    total = _Tally()
    for r in rows:
        at = _when(r)
        if at < since:
            continue
        index = min(count - 1, int((at - since) // bucket_s))
        tallies[index].add(r)
        total.add(r)
    series = []
    for i, tally in enumerate(tallies):
        start = since + i * bucket_s
        seconds = min(bucket_s, max(1e-9, now - start))  # the newest minute is still running
        series.append({"t": start, **tally.figures(seconds)})
    totals = total.figures(max(1e-9, now - since))
    totals.update(routes=dict(total.routes), error_codes=dict(total.errors),
                  finish_reasons=dict(total.finish_reasons))
    return {"since": since, "until": now, "window_s": window_s, "bucket_s": bucket_s,
            "totals": totals, "buckets": series}


def topology(load: Load | None, stages: list[LoadStage], latest: dict, split_ms: dict,
             lanes: dict | None = None) -> dict | None:
    """The load's ring: each stage with its fellow's GPUs, and the links between neighbours.

    `lanes` is the relay's count per lane (lane -> {"stage", "bytes", "frames"}): a link carries
    what its sending stage sent.
    """
    if load is None:
        return None
    out_stages = []
    for s in stages:
        hb = latest.get(s.fellow_id)
        live = next((lm for lm in (hb.loaded_models if hb else []) if lm.load_id == load.load_id
                     and lm.stage == s.stage and lm.replica == (s.replica or 0)), None)
        out_stages.append({
            "stage": s.stage, "replica": s.replica or 0, "fellow_id": s.fellow_id,
            "hostname": hb.hostname if hb else "",
            "layers": [s.layer_first, s.layer_last], "state": s.state, "kv_tokens": s.kv_tokens,
            "max_in_flight": s.max_in_flight, "vram_bytes": s.vram_bytes,
            "gpus": msgspec.to_builtins(hb.gpus) if hb else [],
            "memory_total_bytes": hb.memory_total_bytes if hb else 0,
            "ms_per_token": split_ms.get(f"stage{s.stage}_ms"),
            "tokens_per_s": live.tokens_per_s if live else None,
            "in_flight": live.in_flight if live else None, "waiting": live.waiting if live else None,
            "replaced": list(s.replaced or []),  # the fellows it moved from, when a ring stage was re-placed
        })
    ring = [s for s in out_stages if s["replica"] == 0]  # the links of the first ring (replicas alike)
    n = len(ring)
    links = []
    if n > 1:  # hidden states go 0 -> 1 -> ... -> last; the sampled token goes straight back to 0
        for i, s in enumerate(ring):
            nxt = ring[(i + 1) % n]
            sent = [{"lane": lane, "bytes": v.get("bytes", 0), "frames": v.get("frames", 0)}
                    for lane, v in sorted((lanes or {}).items()) if v.get("stage") == s["stage"]]
            links.append({"from_stage": s["stage"], "to_stage": nxt["stage"], "from_fellow": s["fellow_id"],
                          "to_fellow": nxt["fellow_id"], "carries": "token" if i == n - 1 else "hidden",
                          "local": s["fellow_id"] == nxt["fellow_id"], "lanes": sent,
                          "bytes": sum(x["bytes"] for x in sent), "frames": sum(x["frames"] for x in sent)})
    transport = load.transport or {}
    return {"load_id": load.load_id, "state": load.state, "num_stages": load.num_stages or n,
            "ready_at": load.ready_at, "transport": transport, "stages": out_stages, "links": links,
            "link_ms": split_ms.get("link_ms")}
