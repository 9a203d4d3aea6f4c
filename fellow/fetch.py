"""Fetch a servable the fellow lacks from the leader's archive, and an adapters export's base checkpoint
(the files a stage needs: fellow/base_fetch.py), into SWARM_FELLOW_MODEL_CACHE."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import shutil
import tarfile
from pathlib import Path

import httpx

from core.servable import MANIFEST_NAME
from core.settings import Settings

log = logging.getLogger(__name__)


class FetchError(RuntimeError):
    pass


def cached_dir(settings: Settings, model_id: str, manifest_sha256: str) -> Path:
    return settings.fellow.model_cache / f"{model_id}-{manifest_sha256[:16]}"


def local_model_dir(settings: Settings, model_id: str, model_path: str, manifest_sha256: str) -> Path | None:
    """The servable's folder if this fellow has it already (the leader's path, or the cache)."""
    if settings.fellow.fetch != "always" and model_path and (Path(model_path) / MANIFEST_NAME).is_file():
        return Path(model_path)
    cached = cached_dir(settings, model_id, manifest_sha256)
    return cached if (cached / MANIFEST_NAME).is_file() else None


def draft_model_dir(settings: Settings) -> Path:
    """SWARM_SERVE_DRAFT_MODEL's folder: a servable's path, or a servable id in the fellow's model cache."""
    value = settings.serving.draft_model
    path = Path(value).expanduser()
    if (path / MANIFEST_NAME).is_file():
        return path
    found = sorted(p.parent for p in settings.fellow.model_cache.glob(f"{value}-*/{MANIFEST_NAME}"))
    if found:
        return found[-1]
    raise FileNotFoundError(f"SWARM_SERVE_DRAFT_MODEL={value!r} is neither a servable's folder nor a servable "
                            f"in this fellow's model cache ({settings.fellow.model_cache})")


def fetch_model(settings: Settings, model_id: str, manifest_sha256: str, attempts: int = 3) -> Path:
    """Download the servable's archive (resuming a partial file with Range), check the sha256, unpack;
    returns the folder."""
    return _fetch_archive(settings, model_id, cached_dir(settings, model_id, manifest_sha256), attempts)


def _fetch_archive(settings: Settings, model_id: str, target: Path, attempts: int) -> Path:
    """GET the servable's archive into ``target``; fellows that share a model cache fetch it once (a lock
    file beside it), the others find it there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / MANIFEST_NAME).is_file():  # another fellow fetched it
            return target
        return _download(settings, model_id, target, attempts)


def _download(settings: Settings, model_id: str, target: Path, attempts: int) -> Path:
    part_file = target.with_suffix(".tar.part")
    expected = download(settings, f"{settings.leader.url}/api/v1/models/{model_id}/archive", part_file, model_id,
                        attempts)
    check_sha256(part_file, expected, f"the archive of {model_id}")
    tmp = target.with_suffix(".unpack")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(part_file) as tar:
        tar.extractall(tmp, filter="data")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    part_file.unlink(missing_ok=True)
    return target


def download(settings: Settings, url: str, part_file: Path, what: str, attempts: int) -> str | None:
    """GET ``url`` into ``part_file``, resuming what a try before left there with Range; returns the
    sha256 the leader sent in X-Swarm-Sha256 (None where it sent none)."""
    headers = {"Authorization": f"Bearer {settings.leader.api_token}"} if settings.leader.api_token else {}
    expected = None
    for attempt in range(1, attempts + 1):
        have = part_file.stat().st_size if part_file.exists() else 0
        try:
            with httpx.stream("GET", url, headers={**headers, **({"Range": f"bytes={have}-"} if have else {})},
                              timeout=httpx.Timeout(30.0, read=300.0)) as resp:
                if resp.status_code == 416:  # the partial file is complete (or stale): start over
                    part_file.unlink(missing_ok=True)
                    continue
                if resp.status_code not in (200, 206):
                    resp.read()
                    raise FetchError(f"the leader answered {resp.status_code} for {url}: {resp.text[:200]}")
                expected = resp.headers.get("x-swarm-sha256")
                mode = "ab" if resp.status_code == 206 else "wb"
                with open(part_file, mode) as f:
                    for block in resp.iter_bytes(1 << 20):
                        f.write(block)
            break
        except httpx.HTTPError as exc:
            log.warning("fetching %s (attempt %d): %s", what, attempt, exc)
            if attempt == attempts:
                raise FetchError(f"cannot fetch {what} from {settings.leader.url}: {exc}") from None
    return expected


def check_sha256(path: Path, expected: str | None, what: str) -> None:
    """FetchError (and the file removed) where ``path`` is not what ``expected`` says."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if not expected or digest.hexdigest() != expected:
        path.unlink(missing_ok=True)
        raise FetchError(f"{what} does not match its checksum (sha256 {digest.hexdigest()}, "
                         f"the leader's {expected or 'missing'})")
