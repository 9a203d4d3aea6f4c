"""Fellow presence: heartbeats (SWARM_HEARTBEATS) and the joined/lost events the leader derives."""

from __future__ import annotations

import msgspec

from events.base import Event, now

# What a fellow can do, declared in its heartbeats; placement asks for them by these names.
CAP_ONE_STAGE = "serve-one-stage"
CAP_N_STAGE = "serve-n-stage"
CAP_CONCURRENT = "serve-concurrent"
CAP_KV_BUDGET = "serve-kv-budget"
CAP_SPECULATIVE = "serve-speculative"  # its ring stages crop drafts a later stage rejected (a frame's pos)
CAP_QUANTIZED = "serve-quantized"  # bitsandbytes NF4 / int8 kernels run here
CAP_INT4_FAST = "serve-int4-fast"  # the CUDA int4 weight-only kernel (tinygemm) runs on every GPU here
CAP_CPU_INT8 = "serve-cpu-int8"  # torch's CPU int8 weight-only matmul runs here (aten._weight_int8pack_mm)
CAP_CPU_INT4 = "serve-cpu-int4"  # torch's CPU int4 weight-only matmul runs here (aten._weight_int4pack_mm_for_cpu)
CAP_DRAFT_MODEL = "serve-draft-model"  # its ring's last stage drafts with a draft model the leader names
CAP_4BIT_ROWS = "serve-4bit-rows"  # its CUDA stages split 4-bit matmuls of a few rows (SWARM_SERVE_4BIT_ROWS)


class Gpu(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: str = ""


class LoadedModel(msgspec.Struct, frozen=True, kw_only=True):
    """One stage a fellow serves, with the spec's per-model metrics."""

    load_id: str
    model_id: str
    stage: int = 0
    replica: int = 0
    pid: int = 0
    state: str = "loading"  # loading | ready | failed
    tokens_per_s: float = 0.0
    last_ttft_s: float | None = None
    requests: int = 0
    idle_s: float = 0.0
    vram_bytes: int = 0
    in_flight: int = 0
    waiting: int = 0
    kv_tokens: int = 0
    kv_tokens_planned: int = 0
    prefix_cached_tokens: int = 0
    prefix_hit_rate: float = 0.0
    kv_tokens_used: int = 0  # reserved of kv_tokens now (0 from a fellow that predates it)
    compiled: str = ""  # its decode step compiling in the background, or what serves it since (MetricsReport)


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """What a fellow publishes every `interval_s` on ``swarm.hb.<fellow>``.

    A CPU-only fellow reports no GPUs and its free system memory in `memory_*`.
    """

    fellow_id: str
    hostname: str
    seq: int
    interval_s: float
    at: float = msgspec.field(default_factory=now)
    version: str = ""
    gpus: list[Gpu] = []
    memory_total_bytes: int = 0
    memory_free_bytes: int = 0
    capabilities: list[str] = []
    loaded_models: list[LoadedModel] = []
    started_at: float = 0.0


class FellowJoined(Event, frozen=True, tag="fellow.joined"):
    fellow_id: str
    hostname: str = ""
    version: str = ""
    gpus: list[Gpu] = []
    memory_total_bytes: int = 0
    capabilities: list[str] = []
    started_at: float = 0.0


class FellowLost(Event, frozen=True, tag="fellow.lost"):
    fellow_id: str
    last_seen: float
    reason: str = "missed heartbeats"
