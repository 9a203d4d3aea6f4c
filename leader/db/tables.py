"""SQLAlchemy models of every projection; each table is owned by exactly one projector."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Boolean, Float, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class ProjectorCheckpoint(Base):
    """The last stream sequence a projector applied, written in the same transaction as its rows."""

    __tablename__ = "projector_checkpoints"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, default=0)


class Fellow(Base):
    __tablename__ = "fellows"
    fellow_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255), default="")
    version: Mapped[str] = mapped_column(String(64), default="")
    status: Mapped[str] = mapped_column(String(16), default="online")  # online | lost
    gpus: Mapped[list] = mapped_column(JSON, default=list)
    memory_total_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    capabilities: Mapped[list] = mapped_column(JSON, default=list)
    started_at: Mapped[float] = mapped_column(Float, default=0.0)
    joined_at: Mapped[float] = mapped_column(Float, default=0.0)
    lost_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_seen: Mapped[float] = mapped_column(Float, default=0.0)
    joins: Mapped[int] = mapped_column(Integer, default=0)


class Model(Base):
    __tablename__ = "models"
    model_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    available: Mapped[bool] = mapped_column(Boolean, default=False)
    reason: Mapped[str] = mapped_column(Text, default="")
    path: Mapped[str] = mapped_column(Text, default="")
    architecture: Mapped[str] = mapped_column(String(128), default="")
    num_stages: Mapped[int] = mapped_column(Integer, default=1)
    boundaries: Mapped[list | None] = mapped_column(JSON, nullable=True)
    num_layers: Mapped[int] = mapped_column(Integer, default=0)
    hidden_size: Mapped[int] = mapped_column(Integer, default=0)
    parameters: Mapped[int] = mapped_column(BigInteger, default=0)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    quantization: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    export: Mapped[str] = mapped_column(String(16), default="full")
    manifest_sha256: Mapped[str] = mapped_column(String(64), default="")
    cataloged_at: Mapped[float] = mapped_column(Float, default=0.0)


class Load(Base):
    __tablename__ = "loads"
    load_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(255), index=True)
    state: Mapped[str] = mapped_column(String(16), default="requested")
    num_stages: Mapped[int | None] = mapped_column(Integer, nullable=True)
    requested_at: Mapped[float] = mapped_column(Float, default=0.0)
    placed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    ready_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    transport: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    quantization: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # what the stages serve (LoadPlaced)
    quantization_requested: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # asked, or the manifest's
    quantization_reason: Mapped[str] = mapped_column(Text, default="")  # why the two differ, when they do
    requested_by: Mapped[str] = mapped_column(String(128), default="")  # the API token id that asked
    unload_requested_by: Mapped[str] = mapped_column(String(128), default="")


class LoadStage(Base):
    __tablename__ = "load_stages"
    load_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    stage: Mapped[int] = mapped_column(Integer, primary_key=True)
    replica: Mapped[int] = mapped_column(Integer, primary_key=True, default=0)
    fellow_id: Mapped[str] = mapped_column(String(128), index=True)
    layer_first: Mapped[int] = mapped_column(Integer, default=0)
    layer_last: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(16), default="placed")
    pid: Mapped[int] = mapped_column(Integer, default=0)
    kv_tokens: Mapped[int] = mapped_column(Integer, default=0)
    kv_tokens_planned: Mapped[int] = mapped_column(Integer, default=0)
    max_in_flight: Mapped[int] = mapped_column(Integer, default=1)
    vram_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    kernels: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # the stage's StageReady.kernels
    # its quantization and priced weight bytes (LoadPlaced), then what it serves and measures (StageReady.weights)
    weights: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    replaced: Mapped[list | None] = mapped_column(JSON, nullable=True)  # [{from, to, at, reason}] per StageReplaced


class Request(Base):
    __tablename__ = "requests"
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(255), index=True)
    load_id: Mapped[str] = mapped_column(String(64), default="")
    status: Mapped[str] = mapped_column(String(16), default="accepted")
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    max_tokens: Mapped[int] = mapped_column(Integer, default=0)
    token_id: Mapped[str] = mapped_column(String(64), default="")
    api: Mapped[str] = mapped_column(String(16), default="")  # openai, anthropic, ollama ("" before 0008)
    accepted_at: Mapped[float] = mapped_column(Float, default=0.0, index=True)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    finish_reason: Mapped[str] = mapped_column(String(32), default="")
    ttft_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    duration_s: Mapped[float] = mapped_column(Float, default=0.0)
    tokens_per_s: Mapped[float] = mapped_column(Float, default=0.0)
    error_code: Mapped[str] = mapped_column(String(64), default="")
    fellow_id: Mapped[str] = mapped_column(String(128), default="")
    error_message: Mapped[str] = mapped_column(Text, default="")
    timing: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class RequestMove(Base):
    """One move of a request off a stage that died mid-reply (RequestMoved, leader.moves)."""

    __tablename__ = "request_moves"
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    move: Mapped[int] = mapped_column(Integer, primary_key=True)  # 1, 2, ...
    fellow_id: Mapped[str] = mapped_column(String(128), index=True)  # whose stage died under it
    load_id: Mapped[str] = mapped_column(String(64), default="")
    seq: Mapped[int] = mapped_column(Integer, default=0)  # the frame the next stage started at
    tokens: Mapped[int] = mapped_column(Integer, default=0)  # reply tokens sent before the move
    at: Mapped[float] = mapped_column(Float, default=0.0)


class ApiToken(Base):
    __tablename__ = "api_tokens"
    token_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    label: Mapped[str] = mapped_column(String(255), default="")
    scopes: Mapped[list] = mapped_column(JSON, default=list)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(32), default="")
    created_at: Mapped[float] = mapped_column(Float, default=0.0)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class DeadLetter(Base):
    """A message on SWARM_EVENTS that could not be decoded, or that its sender may not publish (reason
    "refused: ...", leader.projectors.authority): recorded once, then skipped by every projector."""

    __tablename__ = "dead_letters"
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # its stream sequence
    subject: Mapped[str] = mapped_column(String(255), default="")
    reason: Mapped[str] = mapped_column(Text, default="")
    recorded_at: Mapped[float] = mapped_column(Float, default=0.0)
