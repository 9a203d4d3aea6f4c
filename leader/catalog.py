"""The catalog: discovers servables under SWARM_SERVABLE_MODELS_ROOT and publishes what changed."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from pathlib import Path

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.servable import MANIFEST_NAME, ServableError, load_manifest, param_count
from core.settings import Settings
from events.catalog import CatalogEntry, ModelCataloged, ModelUncataloged
from leader.db.tables import Model
from leader.projectors.runner import ProjectionRunner
from leader.services import Publish

log = logging.getLogger(__name__)


def scan_entry(model_dir: Path, model_cache: Path | None = None) -> CatalogEntry:
    """One folder as a catalog entry, under its manifest's model_id (what a client asks for, whatever the
    folder is called); a broken servable is listed unavailable under the folder's name, with the reason."""
    model_id = model_dir.name
    manifest_path = model_dir / MANIFEST_NAME
    sha = hashlib.sha256(manifest_path.read_bytes()).hexdigest() if manifest_path.is_file() else ""
    try:
        m = load_manifest(model_dir)
        return CatalogEntry(
            model_id=m.model_id or model_id, available=True, path=str(model_dir), architecture=m.architecture,
            num_stages=m.num_stages, boundaries=[list(r) for r in m.boundaries] if m.boundaries else None,
            num_layers=m.num_layers, hidden_size=m.hidden_size,
            parameters=param_count(model_dir, model_cache), size_bytes=m.size_bytes,
            quantization=m.quantization, export=m.export, manifest_sha256=sha,
        )
    except (ServableError, OSError, ValueError) as exc:
        return CatalogEntry(model_id=model_id, available=False, reason=str(exc), path=str(model_dir),
                            manifest_sha256=sha)


def scan(root: Path, model_cache: Path | None = None) -> dict[str, CatalogEntry]:
    """model_id -> entry. Of two folders whose manifests name one model_id, the first by name serves it;
    the other is listed unavailable under its folder's name, saying so."""
    if not root.is_dir():
        return {}
    found: dict[str, CatalogEntry] = {}
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name.startswith("."):
            continue
        entry = scan_entry(d, model_cache)
        if entry.model_id in found:
            entry = CatalogEntry(model_id=d.name, available=False, path=str(d), manifest_sha256=entry.manifest_sha256,
                                 reason=f"its manifest's model_id {entry.model_id!r} is the servable in "
                                        f"{found[entry.model_id].path} already")
        found.setdefault(entry.model_id, entry)
    return found


def _row_entry(row: Model) -> CatalogEntry:
    fields = {f: getattr(row, f) for f in CatalogEntry.__struct_fields__}
    return CatalogEntry(**fields)


class Catalog:
    """Rescans on demand (at most every `min_interval_s`) and publishes only differences."""

    def __init__(self, settings: Settings, sessions: async_sessionmaker, publish: Publish,
                 projections: ProjectionRunner, min_interval_s: float = 2.0):
        self.settings = settings
        self.sessions = sessions
        self.publish = publish
        self.projections = projections  # the catalog projection, waited for after a change
        self.min_interval_s = min_interval_s
        self._scanned_at = 0.0
        self._lock = asyncio.Lock()

    async def refresh(self, force: bool = False) -> None:
        async with self._lock:
            if not force and time.monotonic() - self._scanned_at < self.min_interval_s:
                return
            s = self.settings
            found = await asyncio.to_thread(scan, s.leader.servable_models_root, s.fellow.model_cache)
            async with self.sessions() as session:
                known = {r.model_id: _row_entry(r) for r in await session.scalars(select(Model))}
            events = [ModelCataloged(entry=e) for mid, e in found.items()
                      if msgspec.to_builtins(known.get(mid)) != msgspec.to_builtins(e)]
            events += [ModelUncataloged(model_id=mid) for mid in known if mid not in found]
            last = None
            for evt in events:
                last = await self.publish(evt)
            if last is not None:
                await self.projections.wait_for(last.seq, ["catalog"], timeout=10)
                log.info("catalog: %d change(s)", len(events))
            self._scanned_at = time.monotonic()

    async def get(self, model_id: str) -> Model | None:
        await self.refresh()
        async with self.sessions() as session:
            return await session.get(Model, model_id)

    async def all(self) -> list[Model]:
        await self.refresh()
        async with self.sessions() as session:
            return list(await session.scalars(select(Model).order_by(Model.model_id)))
