"""The boundary between a fellow's agent and one of its stage processes.

The agent starts ``python -m fellow.runtime`` with a StageConfig (JSON, the one argument); the stage
writes its reports to stdout, one JSON line each: ready, metrics, or failed. The process's exit is not
a report: the agent sees it as the process ending.
"""

from __future__ import annotations

import msgspec

from events.stage_kernels import StageKernels


class StageOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How a stage serves: what placement planned for it (events.loads.TransportPlan) and its fellow's
    serving settings, built once by the fellow (fellow.manager.stage_options) and read whole by the stage
    process and its loader (fellow.runtime.model.load.loader.build_stage)."""

    # placement's plan, where the fellow's own settings may fill what it left open
    max_in_flight: int = 8
    kv_tokens: int = 0  # the KV tokens placement planned; 0: what it measures
    kv_tokens_max: int = 0  # where it measures room, it grows past kv_tokens up to this (0: holds at most kv_tokens)
    max_batch: int = 0  # 0: no cap, 1: no batching
    prefill_chunk: int = 256
    step_costs: bool = False  # time the step costs the spec names before ready (model.step_report)
    step_profile: bool = False  # ... and profile a one-token step
    prefix_cache: bool = True  # keep finished sessions' positions for prompts that start the same way
    speculative: int = 0  # tokens drafted per decode pass by prompt lookup (0: off); on a ring, stage 0 drafts
    in_flight_max: int = 0  # a ring: stage 0 sizes in flight up to this from measured steps and links (0: fixed)
    quantization: str = "none"  # the weights' method placement chose (core.quantization): none, int8, int4-fast, nf4
    # the fellow's (core.settings.ServingSettings)
    packed_linear: bool = True  # float32 CPU stages pack their linear weights for oneDNN
    threads: int = 0  # torch's CPU threads in this stage; 0: torch's default, one per core
    links: str = "direct"  # a ring stage dials the next one directly where that beats the relay; or "relay"
    link_host: str = "127.0.0.1"  # where a ring stage listens for its predecessor, and the address it gives
    link_port: int = 0  # 0: an ephemeral port
    draft_model_dir: str = ""  # a drafting load's last stage: its draft model (SWARM_SERVE_DRAFT_MODEL)
    devices: str = "auto"  # what the layers are split over (auto: every GPU, then the CPU)
    lora: str = "lean"  # adapters kept apart over quantized weights: lean, lean16 or peft
    attention: str = "auto"  # the HF layers' attention: auto, grouped or sdpa (model.grouped_attention)
    # decode batch sizes compiled at load (fellow.runtime.model.forms.compiled); None: batch 1 compiled in the
    # background
    # once the stage serves, swapped in where faster (fellow.runtime.model.forms.background_compile)
    compile: tuple[int, ...] | None = ()
    cuda_graphs: bool = True  # a whole-model CUDA stage's decode replays graphs where faster
    fourbit_rows: str = "auto"  # auto, off, or a fixed row limit "1".."8" (model.fourbit_rows)
    fourbit_float32: str = "auto"  # 4-bit matmuls in float32 where measured faster, or off
    stream_interval_ms: float = 25.0  # a request's token frames after its first: at most one this often

    @property
    def batch_cap(self) -> int:
        """The most sessions one decode step runs: the batch cap, else everything in flight."""
        return self.max_batch if self.max_batch > 0 else max(1, self.max_in_flight)


class StageConfig(msgspec.Struct, frozen=True, kw_only=True):
    load_id: str
    model_id: str
    model_dir: str
    nats_url: str
    fellow_id: str
    stage: int = 0
    num_stages: int = 1
    replica: int = 0
    replicas: int = 1  # read by the agent: a replica of several is lost alone
    options: StageOptions = StageOptions()
    report_s: float = 1.0  # how often it writes a metrics report
    agent_pid: int = 0  # the stage exits at once when its parent is not this process


class Report(msgspec.Struct, frozen=True, kw_only=True, tag_field="event"):
    """Base of what a stage writes to its agent."""


class ReadyReport(Report, frozen=True, tag="ready"):
    """Loaded, connected and serving."""

    kv_tokens: int  # what it holds
    kv_tokens_planned: int  # what placement planned (or kv_tokens, when it left that to the stage)
    max_in_flight: int
    vram_bytes: int
    load_s: float
    kernels: StageKernels = StageKernels()  # StageModel.kernels: path, kernel choices and timings, step costs
    weights: dict = {}  # StageModel.weights: the quantization it serves, measured weight bytes, float bytes


class MetricsReport(Report, frozen=True, tag="metrics"):
    """Every ``report_s`` seconds while it serves."""

    tokens_per_s: float = 0.0
    last_ttft_s: float | None = None
    requests: int = 0
    idle_s: float = 0.0
    vram_bytes: int = 0
    in_flight: int = 0
    waiting: int = 0
    prefix_cached_tokens: int = 0  # positions the prefix cache holds now
    prefix_hit_rate: float = 0.0  # the share of all prompt tokens so far that came from the cache
    kv_tokens_used: int = 0  # reserved of its KV budget (stage 0 of a load), for kv_cache_usage_perc
    compiled: str = ""  # SWARM_SERVE_COMPILE=auto: where its background compile is (model.background_compile)


class FailedReport(Report, frozen=True, tag="failed"):
    """It cannot serve (its load failed, or its ring did not answer); it exits next."""

    reason: str


StageReport = ReadyReport | MetricsReport | FailedReport

_encoder = msgspec.json.Encoder()
_config = msgspec.json.Decoder(StageConfig)
_report = msgspec.json.Decoder(StageReport)


def encode(msg: StageConfig | Report) -> bytes:
    return _encoder.encode(msg)


def decode_config(data: str | bytes) -> StageConfig:
    return _config.decode(data)


def decode_report(line: bytes) -> StageReport:
    """One report line; msgspec.DecodeError when it is not one."""
    return _report.decode(line)
