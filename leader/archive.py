"""Servable archives: a deterministic tar of a model folder, built once, served with Range and a checksum;
and a base checkpoint's files one by one, each with its sha256 (hashed once per size and mtime)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import tarfile
import threading
from pathlib import Path

from core.servable import load_manifest, resolve_base

CHUNK = 1 << 20
_BUILDING: dict[Path, threading.Lock] = {}  # one build of an archive at a time (fellows fetch at once)
_GUARD = threading.Lock()


def _reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Same bytes for the same files: no owners, no times."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def build_archive(model_dir: Path, cache_dir: Path, manifest_sha256: str) -> tuple[Path, str]:
    """(tar path, its sha256); cached per manifest, so a changed model gets a new archive. Callers that ask
    for one archive at once (the fellows of a ring fetching it) wait for one build."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"{model_dir.name}-{manifest_sha256[:16]}.tar"
    with _GUARD:
        lock = _BUILDING.setdefault(target, threading.Lock())
    with lock:
        return _build(model_dir, target)


def _build(model_dir: Path, target: Path) -> tuple[Path, str]:
    digest_file = target.with_suffix(".sha256")
    if target.is_file() and digest_file.is_file():
        return target, digest_file.read_text().strip()
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
            tar.add(path, arcname=str(path.relative_to(model_dir)), recursive=False, filter=_reset)
    digest = sha256_of(tmp)
    tmp.replace(target)
    digest_file.write_text(digest + "\n")
    return target, digest


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


async def archive_for(model_dir: Path, cache_dir: Path, manifest_sha256: str) -> tuple[Path, str]:
    return await asyncio.to_thread(build_archive, model_dir, cache_dir, manifest_sha256)


def base_dir_of(model_dir: Path, model_cache: Path) -> Path:
    """The base checkpoint an adapters export is served over, as the leader holds it (a path, or an id
    under its SWARM_FELLOW_MODEL_CACHE); ValueError with the reason where there is none to send."""
    manifest = load_manifest(model_dir)
    if manifest.export != "adapters" or not manifest.base:
        raise ValueError(f"{manifest.model_id} carries its own weights; it has no base checkpoint to send")
    found = resolve_base(manifest.base, model_cache)
    if found is None:
        raise ValueError(f"the base checkpoint {manifest.base!r} of {manifest.model_id} is not on the leader")
    return found


async def base_archive_for(model_dir: Path, cache_dir: Path, model_cache: Path,
                           manifest_sha256: str) -> tuple[Path, str]:
    """(tar path, sha256) of an adapters export's base checkpoint, cached beside the servables' archives."""
    base = await asyncio.to_thread(base_dir_of, model_dir, model_cache)
    return await asyncio.to_thread(build_archive, base, cache_dir / "bases", manifest_sha256)


_HASHED: dict[tuple[Path, int, int], str] = {}  # (file, size, mtime_ns) -> sha256


def file_sha256(path: Path) -> str:
    """The file's sha256, remembered while its size and mtime stay (a base's shards are hashed once)."""
    stat = path.stat()
    key = (path.resolve(), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHED:
        with _GUARD:
            lock = _BUILDING.setdefault(key[0], threading.Lock())
        with lock:
            if key not in _HASHED:
                _HASHED[key] = sha256_of(path)
    return _HASHED[key]


def list_base_files(base: Path) -> list[dict]:
    """Every file of a base checkpoint: its path below the base (``/`` between parts), bytes and sha256."""
    files = sorted(p for p in base.rglob("*") if p.is_file())
    return [{"path": p.relative_to(base).as_posix(), "bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in files]


def base_file(base: Path, relative: str) -> Path:
    """The base's file at ``relative``; ValueError for a path that leaves the base (``..``, absolute), and
    FileNotFoundError for one the base has not."""
    parts = relative.replace("\\", "/").split("/")
    if parts[0] == "" or ".." in parts or ":" in parts[0]:  # absolute, upwards, a drive
        raise ValueError(f"{relative!r} is not a path inside the base checkpoint")
    path = base.joinpath(*parts)  # checked by its parts, not resolved: a base may link its files elsewhere (HF's cache)
    if not path.is_file():
        raise FileNotFoundError(f"the base checkpoint has no file {relative!r}")
    return path


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """`bytes=a-b` / `bytes=a-` / `bytes=-n` → inclusive (start, end); None for the whole file.

    Raises ValueError for a range that cannot be satisfied (answered with 416).
    """
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        raise ValueError(header)
    first, _, last = spec.strip().partition("-")
    if first == "":
        n = int(last)
        if n <= 0:
            raise ValueError(header)
        start, end = max(0, size - n), size - 1
    else:
        start = int(first)
        end = int(last) if last else size - 1
    end = min(end, size - 1)
    if start > end or start >= size:
        raise ValueError(header)
    return start, end


async def read_range(path: Path, start: int, end: int):
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start + 1
        while left > 0:
            block = await asyncio.to_thread(f.read, min(CHUNK, left))
            if not block:
                return
            left -= len(block)
            yield block
