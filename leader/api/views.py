"""The typed bodies the model routes answer with: a load, its stages and their live metrics."""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from leader.db.tables import Load

METRICS = ("tokens_per_s", "last_ttft_s", "requests", "idle_s", "vram_bytes", "in_flight", "waiting",
           "prefix_cached_tokens", "prefix_hit_rate")


class StageView(msgspec.Struct, kw_only=True):
    stage: int
    replica: int
    fellow_id: str
    layers: list[int]  # first and last layer served
    state: str
    pid: int
    kv_tokens: int
    kv_tokens_planned: int
    max_in_flight: int
    vram_bytes: int
    kernels: dict | None = None  # how it computes: path, kernel per weight shape, step costs when measured
    # the quantization it serves; estimate_bytes as placement priced its weights, bytes as it measured them
    weights: dict | None = None
    replaced: list[dict] | None = None  # [{from, to, at, reason}]: the fellows a ring stage was re-placed from
    metrics: dict[str, float | None] | UnsetType = UNSET  # from the fellow's latest heartbeat, when it lists the stage
    # SWARM_SERVE_COMPILE=auto: its decode step compiling in the background, or what serves it since (heartbeat)
    compiled: str | UnsetType = UNSET


class LoadView(msgspec.Struct, kw_only=True):
    load_id: str
    model_id: str
    state: str
    reason: str | None
    num_stages: int | None
    requested_at: float
    ready_at: float | None
    ended_at: float | None
    transport: dict | None
    quantization: dict | None = None  # what its stages serve
    quantization_requested: dict | None = None  # what the load asked (or the servable's manifest recorded)
    quantization_reason: str | None = None  # why the two differ, when they do
    replicas: int
    stages: list[StageView]
    metrics: dict[str, float | None]  # stage 0's, summed over replicas
    queued: int | UnsetType = UNSET  # status only: requests no stage has taken yet
    relay: dict | UnsetType = UNSET  # status only: a ring's bytes and frames per lane


def load_view(load: Load, stages, latest: dict) -> LoadView:
    admitting = []  # stage 0 of every replica
    views = []
    for s in stages:
        stage = StageView(stage=s.stage, replica=s.replica or 0, fellow_id=s.fellow_id,
                          layers=[s.layer_first, s.layer_last], state=s.state, pid=s.pid, kv_tokens=s.kv_tokens,
                          kv_tokens_planned=s.kv_tokens_planned, max_in_flight=s.max_in_flight,
                          vram_bytes=s.vram_bytes, kernels=s.kernels, weights=s.weights,
                          replaced=s.replaced or None)
        hb = latest.get(s.fellow_id)
        for lm in (hb.loaded_models if hb else []):
            if lm.load_id == load.load_id and lm.stage == s.stage and lm.replica == (s.replica or 0):
                live = msgspec.to_builtins(lm)
                stage.metrics = {k: live[k] for k in METRICS if k in live}
                if lm.compiled:
                    stage.compiled = lm.compiled
                if s.stage == 0:
                    admitting.append(stage.metrics)
        views.append(stage)
    return LoadView(load_id=load.load_id, model_id=load.model_id, state=load.state, reason=load.reason or None,
                    num_stages=load.num_stages, requested_at=load.requested_at, ready_at=load.ready_at,
                    ended_at=load.ended_at, transport=load.transport, quantization=load.quantization,
                    quantization_requested=load.quantization_requested,
                    quantization_reason=load.quantization_reason or None,
                    replicas=len({s.replica for s in stages}) or 1,
                    stages=views, metrics=admitting[0] if len(admitting) == 1 else _summed(admitting))


def _summed(replicas: list[dict]) -> dict:
    """The load's metrics over its replicas: rates, counts and memory add up; idle is the least idle's."""
    if not replicas:
        return {}
    out = {k: sum(m.get(k) or 0 for m in replicas) for k in ("tokens_per_s", "requests", "vram_bytes", "in_flight",
                                                               "waiting", "prefix_cached_tokens")}
    out["tokens_per_s"] = round(out["tokens_per_s"], 3)
    out["idle_s"] = min(m.get("idle_s", 0.0) for m in replicas)
    ttfts = [m["last_ttft_s"] for m in replicas if m.get("last_ttft_s") is not None]
    out["last_ttft_s"] = ttfts[0] if ttfts else None
    out["prefix_hit_rate"] = max((m.get("prefix_hit_rate") or 0.0) for m in replicas)  # each replica has its own
    return out
