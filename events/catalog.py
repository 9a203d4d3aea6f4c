"""The model catalog: what the leader's registry found under SWARM_SERVABLE_MODELS_ROOT."""

from __future__ import annotations

import msgspec

from events.base import Event


class CatalogEntry(msgspec.Struct, frozen=True, kw_only=True):
    model_id: str
    available: bool
    reason: str = ""  # why it is unavailable
    path: str = ""
    architecture: str = ""
    num_stages: int = 1
    boundaries: list[list[int]] | None = None
    num_layers: int = 0
    hidden_size: int = 0
    parameters: int = 0
    size_bytes: int = 0
    quantization: dict | None = None
    export: str = "full"  # full | adapters
    manifest_sha256: str = ""


class ModelCataloged(Event, frozen=True, tag="catalog.model_cataloged"):
    entry: CatalogEntry


class ModelUncataloged(Event, frozen=True, tag="catalog.model_uncataloged"):
    model_id: str
