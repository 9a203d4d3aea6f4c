"""Every SWARM_* variable, read once from the environment into typed groups and validated with a clear error.

Each setting is one field of one group, declared with ``setting(variable, default, parser)``: the field
is the registry (``variables()`` lists them for the README's table and its test), the default is the value
an unset variable means (``$SWARM_DATA_DIR`` and ``$SWARM_LEADER_PORT`` stand for the values read before
it), and the parser turns the text into the field's value or raises a one-line SettingsError.
Over 350 lines: the one registry of every variable, a line each, on purpose.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace as _replace
from pathlib import Path
from string import Template
from typing import Any, Callable, Mapping, NamedTuple

from core.quantization import LORA_MODES, SPLIT_MAX_ROWS, fourbit_rows_value


class SettingsError(ValueError):
    """A bad SWARM_* value; the message names the variable and is one line."""


Parser = Callable[[str, str], Any]  # (variable, its text or its default) -> the field's value


def setting(variable: str, default: str, parse: Parser, shown: bool = True) -> Any:
    """A field read from ``variable``; ``default`` where unset or blank; ``shown=False``: not in the repr."""
    return field(repr=shown, metadata={"variable": variable, "default": default, "parse": parse})


# --- parsers ---------------------------------------------------------------------------------------


def whole(minimum: int | None = 0, maximum: int | None = None, beyond: str = "") -> Parser:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise SettingsError(f"{name}={raw!r} is not a whole number") from None
        if minimum is not None and value < minimum:
            raise SettingsError(f"{name}={raw!r} must be at least {minimum}")
        if maximum is not None and value > maximum:
            raise SettingsError(f"{name}={value} {beyond}")
        return value
    return parse


def number(minimum: float = 0.0) -> Parser:
    def parse(name: str, raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise SettingsError(f"{name}={raw!r} is not a number") from None
        if value < minimum:
            raise SettingsError(f"{name}={raw!r} must be at least {minimum}")
        return value
    return parse


def flag(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean (use 1 or 0)")


def step_costs_mode(name: str, raw: str) -> str:  # SWARM_SERVE_STEP_COSTS: off, on, or profile (on, profiled)
    v = {"0": "off", "false": "off", "no": "off", "1": "on", "true": "on", "yes": "on"}.get(raw.strip().lower(), raw)
    return choice("off", "on", "profile")(name, v)


def choice(*choices: str) -> Parser:
    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v not in choices:
            raise SettingsError(f"{name}={raw!r} must be one of: {', '.join(choices)}")
        return v
    return parse


def is_on(on: str, off: str = "off") -> Parser:
    """A two-way choice read as a bool: True for ``on``."""
    pick = choice(on, off)
    return lambda name, raw: pick(name, raw) == on


def optional(parse: Parser) -> Parser:
    """None where unset (its default is empty), else ``parse``'s value."""
    return lambda name, raw: None if not raw.strip() else parse(name, raw)


def text(name: str, raw: str) -> str:
    return raw.strip()


def secret(name: str, raw: str) -> str | None:
    return raw or None  # a password or token as written, spaces included


def path(name: str, raw: str) -> Path:
    return Path(raw).expanduser()


_DB_SCHEMES = ("sqlite+aiosqlite", "postgresql+asyncpg")


def database_url(name: str, raw: str) -> str:
    scheme = raw.split("://", 1)[0] if "://" in raw else ""
    if scheme not in _DB_SCHEMES:
        raise SettingsError(f"{name} scheme {scheme or raw!r} is not supported (use one of: {', '.join(_DB_SCHEMES)})")
    return raw


def tokens_path(name: str, raw: str) -> Path | str | None:
    """SWARM_API_TOKENS_FILE: auto (beside a SQLite database: LeaderSettings), off (none), or a path."""
    v = raw.strip()
    return v.lower() if v.lower() == "auto" else None if v.lower() in ("off", "none", "0") else path(name, v)


def beside_database(url: str) -> Path | None:
    """api_tokens.json beside a SQLite database's file; None for PostgreSQL or a database in memory."""
    db = url.split(":///", 1)[1].split("?", 1)[0] if url.startswith("sqlite+aiosqlite:///") else ""
    return Path(db).expanduser().parent / "api_tokens.json" if db not in ("", ":memory:") else None


def nats_urls(name: str, raw: str) -> str | None:
    for url in raw.split(",") if raw.strip() else []:
        if not url.strip().startswith(("nats://", "tls://", "ws://", "wss://")):
            raise SettingsError(f"{name} entry {url.strip()!r} is not a nats:// URL")
    return raw.strip() or None


COMPILE_MAX_BATCH = 64


def compile_sizes(name: str, raw: str) -> tuple[int, ...] | None:
    """auto (None: batch 1, in the background), off, on (batch 1 at load), or batch sizes at load (``1,8``)."""
    if (v := raw.strip().lower()) == "auto":
        return None
    if v in ("off", "0", "no", "false"):
        return ()
    if v in ("on", "yes", "true"):
        return (1,)
    try:
        sizes = sorted({int(part) for part in v.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or not all(1 <= n <= COMPILE_MAX_BATCH for n in sizes):
        raise SettingsError(f"{name}={raw!r} must be auto, off, on, or batch sizes from 1 to {COMPILE_MAX_BATCH} "
                            f"separated by commas (like 1,8)")
    return tuple(sizes)


def devices(name: str, raw: str) -> str:
    """auto, or devices in the order a stage's layers fill them, the CPU last."""
    v = raw.strip().lower()
    if v == "auto":
        return v
    names = [d.strip() for d in v.split(",")]
    bad = [d for d in names if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit())]
    if bad or "cpu" in names[:-1] or len(set(names)) != len(names):
        raise SettingsError(f"{name}={v!r} must be auto or distinct devices like cuda:0,cuda:1,cpu (the CPU last)")
    return ",".join(names)


def speculative(name: str, raw: str) -> int:
    from events.loads import MAX_SPECULATIVE

    v = raw.strip()
    if not v.isdigit() or int(v) > MAX_SPECULATIVE:
        raise SettingsError(f"{name}={v!r} must be a whole number of drafted tokens per decode pass from 0 (off) "
                            f"to {MAX_SPECULATIVE}")
    return int(v)


def fourbit_rows(name: str, raw: str) -> str:
    """auto (measured at load), off, or a fixed row limit from 1 to 8, as a string."""
    value = fourbit_rows_value(raw)
    if value is None:
        raise SettingsError(f"{name}={raw!r} must be auto, off, or a row limit from 1 to {SPLIT_MAX_ROWS}")
    return str(value)


# --- the groups ------------------------------------------------------------------------------------


class Group:
    """A frozen dataclass of settings; ``from_env`` reads this group alone."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, lenient: bool = False):
        """``lenient``: a bad value reads as its default (Settings.from_env refuses it at start, with the
        reason); for code that runs before or without the whole check (log lines, a stage's login)."""
        return _read_group(cls, os.environ if env is None else env, {}, lenient)


@dataclass(frozen=True)
class NatsSettings(Group):
    url: str | None = setting("SWARM_NATS_URL", "", nats_urls)  # None: `swarm up` starts its own
    user: str | None = setting("SWARM_NATS_USER", "", optional(text))  # this process's NATS user
    password: str | None = setting("SWARM_NATS_PASSWORD", "", secret, shown=False)
    replicas: int = setting("SWARM_NATS_REPLICAS", "1", whole(1, 5, "must be at most 5 (JetStream's limit)"))
    auth_dir: Path | None = setting("SWARM_NATS_AUTH_DIR", "", optional(path))  # users of a server the leader manages
    creds: Path | None = setting("SWARM_NATS_CREDS", "", optional(path))  # a .creds file: core.nats_callout

    def __post_init__(self):
        if bool(self.user) != bool(self.password):
            raise SettingsError("SWARM_NATS_USER and SWARM_NATS_PASSWORD go together: set both or neither")
        if self.creds and self.user:
            raise SettingsError("SWARM_NATS_CREDS or SWARM_NATS_USER and SWARM_NATS_PASSWORD: set one, not both")
        if self.creds:
            self.credentials  # a file that is not one is refused at start  # noqa: B018

    @property
    def credentials(self):
        from core.nats_auth import Credentials
        from core.nats_jwt import JwtError, creds_user

        if self.creds:
            try:
                return Credentials(creds_user(self.creds), "", self.creds)
            except JwtError as exc:
                raise SettingsError(f"SWARM_NATS_CREDS: {exc}") from None
        return Credentials(self.user, self.password) if self.user else None


@dataclass(frozen=True)
class LeaderSettings(Group):
    host: str = setting("SWARM_LEADER_HOST", "127.0.0.1", text)
    port: int = setting("SWARM_LEADER_PORT", "8000", whole(0, 65535, "is not a TCP port"))
    url: str = setting("SWARM_LEADER_URL", "http://127.0.0.1:$SWARM_LEADER_PORT",
                       lambda name, raw: raw.strip().rstrip("/"))
    database_url: str = setting("SWARM_DATABASE_URL", "sqlite+aiosqlite:///$SWARM_DATA_DIR/swarm.db", database_url)
    api_token: str | None = setting("SWARM_API_TOKEN", "", secret, shown=False)
    tokens_file: Path | None = setting("SWARM_API_TOKENS_FILE", "auto", tokens_path)  # leader.auth.token_file
    require_api_token: bool = setting("SWARM_REQUIRE_API_TOKEN", "0", flag)
    autoload: bool = setting("SWARM_AUTOLOAD", "0", flag)
    servable_models_root: Path = setting("SWARM_SERVABLE_MODELS_ROOT", "$SWARM_DATA_DIR/servable_models", path)
    fellow_timeout_s: float = setting("SWARM_FELLOW_TIMEOUT_S", "0", number())  # 0: three of its heartbeats
    http_max_body_bytes: int = setting("SWARM_HTTP_MAX_BODY_BYTES", "8388608", whole(1))  # larger: a 413
    stream_resume_s: float = setting("SWARM_STREAM_RESUME_S", "10", number())  # a hung-up stream may resume
    verify_share: float = setting("SWARM_VERIFY_SHARE", "0.02", number())  # leader.verify; 1 and more: all

    def __post_init__(self):  # auto: the tokens file beside the state database, where that is a file
        if self.tokens_file == "auto":
            object.__setattr__(self, "tokens_file", beside_database(self.database_url))


@dataclass(frozen=True)
class FellowSettings(Group):
    model_cache: Path = setting("SWARM_FELLOW_MODEL_CACHE", "$SWARM_DATA_DIR/models", path)
    fetch: str = setting("SWARM_FELLOW_FETCH", "auto", choice("auto", "always"))
    max_loaded_models: int = setting("SWARM_MAX_LOADED_MODELS", "1", whole(1))
    model_idle_unload_s: float = setting("SWARM_MODEL_IDLE_UNLOAD_S", "900", number())
    heartbeat_s: float = setting("SWARM_HEARTBEAT_S", "2", number(0.05))


@dataclass(frozen=True)
class ServingSettings(Group):
    """SWARM_SERVE_*: what the leader plans a load with, and how a fellow's stages serve."""

    in_flight: int | None = setting("SWARM_SERVE_IN_FLIGHT", "", optional(whole(1)))
    typical_tokens: int = setting("SWARM_SERVE_TYPICAL_TOKENS", "1024", whole(1))
    context_tokens: int = setting("SWARM_SERVE_CONTEXT_TOKENS", "4096", whole(1))
    max_batch: int | None = setting("SWARM_SERVE_MAX_BATCH", "", optional(whole(0)))
    stream_interval_ms: float = setting("SWARM_SERVE_STREAM_INTERVAL_MS", "25", number())  # fellow.token_batcher
    prefill_chunk: int | None = setting("SWARM_SERVE_PREFILL_CHUNK", "", optional(whole(0)))  # unset: 256 planned
    max_in_flight: int | None = setting("SWARM_SERVE_MAX_IN_FLIGHT", "", optional(whole(1)))  # unset: 8 planned
    packed_linear: bool = setting("SWARM_SERVE_PACKED_LINEAR", "auto", is_on("auto"))
    step_costs: str = setting("SWARM_SERVE_STEP_COSTS", "0", step_costs_mode)  # off, on or profile
    prefix_cache: bool = setting("SWARM_SERVE_PREFIX_CACHE", "on", is_on("on"))
    links: str = setting("SWARM_SERVE_LINKS", "direct", choice("direct", "relay"))
    link_host: str = setting("SWARM_SERVE_LINK_HOST", "127.0.0.1", text)  # where ring stages listen
    link_port: int = setting("SWARM_SERVE_LINK_PORT", "0", whole())  # 0: an ephemeral port per stage
    threads: int = setting("SWARM_SERVE_THREADS", "0", whole())  # torch CPU threads per stage; 0: one a core
    quantized: bool = setting("SWARM_SERVE_QUANTIZED", "auto", is_on("auto"))  # probe and declare kernels
    speculative: int = setting("SWARM_SERVE_SPECULATIVE", "0", speculative)  # tokens drafted per pass
    draft_model: str = setting("SWARM_SERVE_DRAFT_MODEL", "", text)  # auto, an id or a folder that drafts
    devices: str = setting("SWARM_SERVE_DEVICES", "auto", devices)  # what a stage's layers are split over
    lora: str = setting("SWARM_SERVE_LORA", "lean", choice(*LORA_MODES))  # adapters over quantized weights
    attention: str = setting("SWARM_SERVE_ATTENTION", "auto", choice("auto", "grouped", "sdpa"))  # the HF layers'
    compile: tuple[int, ...] | None = setting("SWARM_SERVE_COMPILE", "auto", compile_sizes)  # None: in the background
    cuda_graphs: bool = setting("SWARM_SERVE_CUDA_GRAPHS", "auto", is_on("auto"))
    fourbit_rows: str = setting("SWARM_SERVE_4BIT_ROWS", "auto", fourbit_rows)  # auto, off, or "1".."8"
    fourbit_float32: str = setting("SWARM_SERVE_4BIT_FLOAT32", "auto", choice("auto", "off"))


@dataclass(frozen=True)
class LoggingSettings(Group):
    format: str = setting("SWARM_LOG_FORMAT", "text", choice("text", "json"))
    stage_stats_s: float = setting("SWARM_STAGE_STATS_S", "30", number(0.05))  # a stage's stats line period


def group(cls: type) -> Any:
    return field(metadata={"group": cls})


@dataclass(frozen=True)
class Settings:
    data_dir: Path = setting("SWARM_DATA_DIR", "~/.silent-swarm", path)
    nats: NatsSettings = group(NatsSettings)
    leader: LeaderSettings = group(LeaderSettings)
    fellow: FellowSettings = group(FellowSettings)
    serving: ServingSettings = group(ServingSettings)
    logging: LoggingSettings = group(LoggingSettings)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        _refuse_not_implemented(env)
        return _read_group(cls, env, {}, lenient=False)

    def replace(self, **groups: dict) -> "Settings":
        """A copy with fields changed by group (``s.replace(serving={"speculative": 4})``), ``data_dir=`` as is."""
        changes = {name: (_replace(getattr(self, name), **value) if isinstance(value, dict) else value)
                   for name, value in groups.items()}
        return _replace(self, **changes)

    @property
    def nats_store_dir(self) -> Path:
        return self.data_dir / "jetstream"


def _read_group(cls: type, env: Mapping[str, str], known: dict[str, str], lenient: bool):
    """``cls``'s fields from ``env`` in order; ``known`` collects each variable's value as text for the
    defaults after it that name it."""
    values = {}
    for f in fields(cls):
        if "group" in f.metadata:
            values[f.name] = _read_group(f.metadata["group"], env, known, lenient)
            continue
        name, default, parse = f.metadata["variable"], f.metadata["default"], f.metadata["parse"]
        default = Template(default).safe_substitute(known)
        raw = env.get(name)
        try:
            value = parse(name, default if raw is None or not raw.strip() else raw)
        except SettingsError:
            if not lenient:
                raise
            value = parse(name, default)
        values[f.name] = value
        known[name] = "" if value is None else str(value)
    return cls(**values)


class Variable(NamedTuple):
    name: str
    group: str  # Settings' field that holds it ("" for data_dir, at the top)
    field: str
    default: str  # the value it has unset, as text


def variables() -> list[Variable]:
    """Every variable Settings reads, in the order it reads them."""
    out = []
    for f in fields(Settings):
        if "group" in f.metadata:
            out += [Variable(g.metadata["variable"], f.name, g.name, g.metadata["default"])
                    for g in fields(f.metadata["group"])]
        else:
            out.append(Variable(f.metadata["variable"], "", f.name, f.metadata["default"]))
    return out


# Variables the spec names whose feature is not built yet, and the issue that builds it. Setting one is
# refused at start rather than validated and ignored.
NOT_IMPLEMENTED: dict[str, str] = {}


def _refuse_not_implemented(env: Mapping[str, str]) -> None:
    for name, by in NOT_IMPLEMENTED.items():
        if (env.get(name) or "").strip():
            raise SettingsError(f"{name} is not implemented yet ({by}); unset it")
