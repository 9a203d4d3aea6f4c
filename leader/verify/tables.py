"""The verification projection's tables (migration 0010), owned by leader.verify.projector."""

from __future__ import annotations

from sqlalchemy import JSON, Boolean, Float, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from leader.db.tables import Base


class ReplyCheck(Base):
    """One check of one reply (ReplyChecked)."""

    __tablename__ = "reply_checks"
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(255), default="")
    load_id: Mapped[str] = mapped_column(String(64), default="")
    fellow_id: Mapped[str] = mapped_column(String(128), index=True)
    scorer_id: Mapped[str] = mapped_column(String(128), default="")
    mode: Mapped[str] = mapped_column(String(16), default="greedy")
    passed: Mapped[bool] = mapped_column(Boolean, default=True)
    tokens: Mapped[int] = mapped_column(Integer, default=0)
    bad: Mapped[int] = mapped_column(Integer, default=0)
    first_bad: Mapped[int] = mapped_column(Integer, default=-1)
    worst: Mapped[float] = mapped_column(Float, default=0.0)
    checked_at: Mapped[float] = mapped_column(Float, default=0.0)


class FellowTrust(Base):
    """Per fellow: its replies' checks, failures, the scorers it failed, and when it was drained."""

    __tablename__ = "fellow_trust"
    fellow_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    checks: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    failed_by: Mapped[list] = mapped_column(JSON, default=list)  # scorer ids, each once
    drained_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str] = mapped_column(String(255), default="")
