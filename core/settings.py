"""Every SWARM_* variable, read once from the environment and validated with a clear error."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping

from core.quantization import LORA_MODES, SPLIT_MAX_ROWS, fourbit_rows_value


class SettingsError(ValueError):
    """A bad SWARM_* value; the message names the variable and is one line."""


_DB_SCHEMES = ("sqlite+aiosqlite", "postgresql+asyncpg")


def _int(env: Mapping[str, str], name: str, default: int, minimum: int | None = 0) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a whole number") from None
    if minimum is not None and value < minimum:
        raise SettingsError(f"{name}={raw!r} must be at least {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r} must be at least {minimum}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean (use 1 or 0)")


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v not in choices:
        raise SettingsError(f"{name}={raw!r} must be one of: {', '.join(choices)}")
    return v


COMPILE_MAX_BATCH = 64


def _compile(env: Mapping[str, str]) -> tuple[int, ...]:
    """SWARM_SERVE_COMPILE: off, on (batch 1), or the decode batch sizes to compile, e.g. ``1,8``."""
    raw = (env.get("SWARM_SERVE_COMPILE") or "").strip().lower()
    if raw in ("", "off", "0", "no", "false"):
        return ()
    if raw in ("on", "yes", "true"):
        return (1,)
    try:
        sizes = sorted({int(part) for part in raw.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or not all(1 <= n <= COMPILE_MAX_BATCH for n in sizes):
        raise SettingsError(f"SWARM_SERVE_COMPILE={env.get('SWARM_SERVE_COMPILE')!r} must be off, on, or batch sizes "
                            f"from 1 to {COMPILE_MAX_BATCH} separated by commas (like 1,8)")
    return tuple(sizes)


def _devices(env: Mapping[str, str]) -> str:
    """SWARM_SERVE_DEVICES: auto, or devices in the order a stage's layers fill them, the CPU last."""
    raw = (env.get("SWARM_SERVE_DEVICES") or "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    names = [d.strip() for d in raw.split(",")]
    bad = [d for d in names if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit())]
    if bad or "cpu" in names[:-1] or len(set(names)) != len(names):
        raise SettingsError(f"SWARM_SERVE_DEVICES={raw!r} must be auto or distinct devices like cuda:0,cuda:1,cpu "
                            f"(the CPU last)")
    return ",".join(names)


def _speculative(env: Mapping[str, str]) -> int:
    from events.loads import MAX_SPECULATIVE

    raw = (env.get("SWARM_SERVE_SPECULATIVE") or "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) > MAX_SPECULATIVE:
        raise SettingsError(f"SWARM_SERVE_SPECULATIVE={raw!r} must be a whole number of drafted tokens per "
                            f"decode pass from 0 (off) to {MAX_SPECULATIVE}")
    return int(raw)


def _fourbit_rows(env: Mapping[str, str]) -> str:
    """SWARM_SERVE_4BIT_ROWS: auto (measured at load), off, or a fixed row limit from 1 to 8, as a string."""
    value = fourbit_rows_value(env.get("SWARM_SERVE_4BIT_ROWS") or "")
    if value is None:
        raise SettingsError(f"SWARM_SERVE_4BIT_ROWS={env.get('SWARM_SERVE_4BIT_ROWS')!r} must be auto, off, or a "
                            f"row limit from 1 to {SPLIT_MAX_ROWS}")
    return str(value)


# Variables the spec names whose feature is not built yet, and the issue that builds it. Setting one is
# refused at start rather than validated and ignored.
NOT_IMPLEMENTED = {
    "SWARM_SERVE_ATTENTION": "a choice of attention kernels, issue 13",
    "SWARM_API_TOKENS_FILE": "no issue: API tokens are kept in the database",
    "SWARM_NATS_CREDS": "NATS .creds files, issue 18; use SWARM_NATS_USER and SWARM_NATS_PASSWORD",
}


def _refuse_not_implemented(env: Mapping[str, str]) -> None:
    for name, by in NOT_IMPLEMENTED.items():
        if (env.get(name) or "").strip():
            raise SettingsError(f"{name} is not implemented yet ({by}); unset it")


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    nats_url: str | None
    database_url: str
    leader_host: str
    leader_port: int
    leader_url: str
    api_token: str | None
    require_api_token: bool
    autoload: bool
    servable_models_root: Path
    fellow_model_cache: Path
    fellow_fetch: str
    max_loaded_models: int
    model_idle_unload_s: float
    heartbeat_s: float
    fellow_timeout_s: float  # a fellow silent this long is lost; 0: three of its own heartbeat intervals
    serve_in_flight: int | None
    serve_typical_tokens: int
    serve_context_tokens: int
    serve_max_batch: int | None
    serve_prefill_chunk: int
    serve_max_in_flight: int
    serve_packed_linear: str
    serve_step_costs: bool = False
    serve_prefix_cache: bool = True
    serve_links: str = "direct"  # SWARM_SERVE_LINKS: ring stages dial each other (relay as fallback), or relay only
    serve_link_host: str = "127.0.0.1"  # SWARM_SERVE_LINK_HOST: the address a fellow's ring stages listen on and give
    serve_link_port: int = 0  # SWARM_SERVE_LINK_PORT: 0, an ephemeral port per stage
    serve_threads: int = 0  # SWARM_SERVE_THREADS: torch CPU threads per stage process; 0: one per core
    serve_quantized: bool = True  # SWARM_SERVE_QUANTIZED: a fellow probes its quantized kernels and declares them
    http_max_body_bytes: int = 8 * 1024 * 1024  # a larger HTTP request body is refused with 413
    stream_resume_s: float = 10.0  # a streaming client that hung up may resume this long; its reply goes on
    serve_speculative: int = 0  # SWARM_SERVE_SPECULATIVE: tokens drafted per decode pass (0 off, at most 8)
    serve_draft_model: str = ""  # SWARM_SERVE_DRAFT_MODEL (fellow): a servable's folder or id that drafts
    log_format: str = "text"  # SWARM_LOG_FORMAT: text | json (core/logs.py)
    stage_stats_s: float = 30.0  # SWARM_STAGE_STATS_S: a stage's stats line, once per this much traffic
    nats_user: str | None = None  # SWARM_NATS_USER / SWARM_NATS_PASSWORD: this process's NATS user
    nats_password: str | None = None
    nats_replicas: int = 1  # SWARM_NATS_REPLICAS: each stream's replicas in a NATS cluster
    serve_devices: str = "auto"  # SWARM_SERVE_DEVICES (fellow): what a stage's layers are split over
    serve_lora: str = "lean"  # SWARM_SERVE_LORA (fellow): adapters kept apart over quantized weights (LORA_MODES)
    serve_compile: tuple[int, ...] = ()  # SWARM_SERVE_COMPILE (fellow): decode batch sizes compiled at load
    serve_cuda_graphs: bool = True  # SWARM_SERVE_CUDA_GRAPHS (fellow): auto (replayed where faster) or off
    serve_4bit_rows: str = "auto"  # SWARM_SERVE_4BIT_ROWS (fellow): auto (measured at load), off, or "1".."8"
    serve_4bit_float32: str = "auto"  # SWARM_SERVE_4BIT_FLOAT32 (fellow): auto (measured at load) or off

    @property
    def nats_credentials(self):
        from core.nats_auth import Credentials

        return Credentials(self.nats_user, self.nats_password) if self.nats_user else None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        _refuse_not_implemented(env)
        data_dir = Path(env.get("SWARM_DATA_DIR") or "~/.silent-swarm").expanduser()
        database_url = env.get("SWARM_DATABASE_URL") or f"sqlite+aiosqlite:///{data_dir / 'swarm.db'}"
        scheme = database_url.split("://", 1)[0] if "://" in database_url else ""
        if scheme not in _DB_SCHEMES:
            raise SettingsError(
                f"SWARM_DATABASE_URL scheme {scheme or database_url!r} is not supported "
                f"(use one of: {', '.join(_DB_SCHEMES)})"
            )
        nats_url = (env.get("SWARM_NATS_URL") or "").strip() or None
        if nats_url:
            for url in nats_url.split(","):
                if not url.strip().startswith(("nats://", "tls://", "ws://", "wss://")):
                    raise SettingsError(f"SWARM_NATS_URL entry {url.strip()!r} is not a nats:// URL")
        host = env.get("SWARM_LEADER_HOST") or "127.0.0.1"
        port = _int(env, "SWARM_LEADER_PORT", 8000)
        if port > 65535:
            raise SettingsError(f"SWARM_LEADER_PORT={port} is not a TCP port")
        nats_user = (env.get("SWARM_NATS_USER") or "").strip() or None
        nats_password = env.get("SWARM_NATS_PASSWORD") or None
        if bool(nats_user) != bool(nats_password):
            raise SettingsError("SWARM_NATS_USER and SWARM_NATS_PASSWORD go together: set both or neither")
        replicas = _int(env, "SWARM_NATS_REPLICAS", 1, minimum=1)
        if replicas > 5:
            raise SettingsError(f"SWARM_NATS_REPLICAS={replicas} must be at most 5 (JetStream's limit)")
        max_batch_raw = env.get("SWARM_SERVE_MAX_BATCH")
        in_flight_raw = env.get("SWARM_SERVE_IN_FLIGHT")
        return cls(
            data_dir=data_dir,
            nats_url=nats_url,
            database_url=database_url,
            leader_host=host,
            leader_port=port,
            leader_url=(env.get("SWARM_LEADER_URL") or f"http://127.0.0.1:{port}").rstrip("/"),
            api_token=env.get("SWARM_API_TOKEN") or None,
            require_api_token=_bool(env, "SWARM_REQUIRE_API_TOKEN", False),
            autoload=_bool(env, "SWARM_AUTOLOAD", False),
            servable_models_root=Path(
                env.get("SWARM_SERVABLE_MODELS_ROOT") or data_dir / "servable_models"
            ).expanduser(),
            fellow_model_cache=Path(env.get("SWARM_FELLOW_MODEL_CACHE") or data_dir / "models").expanduser(),
            fellow_fetch=_choice(env, "SWARM_FELLOW_FETCH", "auto", ("auto", "always")),
            max_loaded_models=_int(env, "SWARM_MAX_LOADED_MODELS", 1, minimum=1),
            model_idle_unload_s=_float(env, "SWARM_MODEL_IDLE_UNLOAD_S", 900.0),
            heartbeat_s=_float(env, "SWARM_HEARTBEAT_S", 2.0, minimum=0.05),
            fellow_timeout_s=_float(env, "SWARM_FELLOW_TIMEOUT_S", 0.0),
            serve_in_flight=None if not in_flight_raw else _int(env, "SWARM_SERVE_IN_FLIGHT", 0, minimum=1),
            serve_typical_tokens=_int(env, "SWARM_SERVE_TYPICAL_TOKENS", 1024, minimum=1),
            serve_context_tokens=_int(env, "SWARM_SERVE_CONTEXT_TOKENS", 4096, minimum=1),
            serve_max_batch=None if not max_batch_raw else _int(env, "SWARM_SERVE_MAX_BATCH", 0),
            serve_prefill_chunk=_int(env, "SWARM_SERVE_PREFILL_CHUNK", 256),
            serve_max_in_flight=_int(env, "SWARM_SERVE_MAX_IN_FLIGHT", 8, minimum=1),
            serve_packed_linear=_choice(env, "SWARM_SERVE_PACKED_LINEAR", "auto", ("auto", "off")),
            serve_step_costs=_bool(env, "SWARM_SERVE_STEP_COSTS", False),
            serve_threads=_int(env, "SWARM_SERVE_THREADS", 0),
            serve_quantized=_choice(env, "SWARM_SERVE_QUANTIZED", "auto", ("auto", "off")) == "auto",
            serve_prefix_cache=_choice(env, "SWARM_SERVE_PREFIX_CACHE", "on", ("on", "off")) == "on",
            serve_links=_choice(env, "SWARM_SERVE_LINKS", "direct", ("direct", "relay")),
            serve_link_host=env.get("SWARM_SERVE_LINK_HOST", "").strip() or "127.0.0.1",
            serve_link_port=_int(env, "SWARM_SERVE_LINK_PORT", 0),
            serve_speculative=_speculative(env),
            serve_draft_model=(env.get("SWARM_SERVE_DRAFT_MODEL") or "").strip(),
            log_format=_choice(env, "SWARM_LOG_FORMAT", "text", ("text", "json")),
            stage_stats_s=_float(env, "SWARM_STAGE_STATS_S", 30.0, minimum=0.05),
            http_max_body_bytes=_int(env, "SWARM_HTTP_MAX_BODY_BYTES", 8 * 1024 * 1024, minimum=1),
            stream_resume_s=_float(env, "SWARM_STREAM_RESUME_S", 10.0),
            nats_user=nats_user,
            nats_password=nats_password,
            nats_replicas=replicas,
            serve_devices=_devices(env),
            serve_lora=_choice(env, "SWARM_SERVE_LORA", "lean", LORA_MODES),
            serve_compile=_compile(env),
            serve_cuda_graphs=_choice(env, "SWARM_SERVE_CUDA_GRAPHS", "auto", ("auto", "off")) == "auto",
            serve_4bit_rows=_fourbit_rows(env),
            serve_4bit_float32=_choice(env, "SWARM_SERVE_4BIT_FLOAT32", "auto", ("auto", "off")),
        )

    def replace(self, **changes) -> "Settings":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return Settings(**values)

    @property
    def nats_store_dir(self) -> Path:
        return self.data_dir / "jetstream"
