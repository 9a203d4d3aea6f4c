"""An adapters export's base checkpoint on a fellow that lacks it: fetched from the leader file by file, and of
its weights only the files that hold the tensors of the stage it serves (the index's weight_map says which
file holds which tensor); every other file (config, tokenizer, the index) comes too. Each file is checked
against the sha256 the leader lists. A later stage on the same cache fetches only the files it still lacks."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
from pathlib import Path
from urllib.parse import quote

import httpx

from core.servable import Manifest, ServableError, fetched_base_dir, load_manifest, resolve_base
from core.servable_plan import StagePlan, plan_stage
from core.settings import Settings
from fellow.fetch import FetchError, check_sha256, download

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
INDEX_SUFFIX = ".safetensors.index.json"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_UNREAD = re.compile(r"(?:^|\.)rotary_emb\.|^mtp\.")  # the stage loader skips these (checkpoint.classify)


def ensure_base(settings: Settings, model_id: str, model_dir: Path, attempts: int = 3, *, stage: int | None = None,
                num_stages: int | None = None) -> Path | None:
    """An adapters export's base checkpoint on this fellow: where it already is (core.servable.resolve_base),
    else fetched into the model cache's ``bases``, of its weights those serving stage ``stage`` of
    ``num_stages`` reads (all where no stage is named). None for a servable that carries its own weights;
    FetchError where the leader has no base or a file does not match its sha256."""
    manifest = load_manifest(model_dir)
    if manifest.export != "adapters" or not manifest.base:
        return None
    target = fetched_base_dir(manifest.base, settings.fellow.model_cache)
    found = resolve_base(manifest.base, settings.fellow.model_cache)
    if found is not None and found != target:  # a whole checkpoint this machine holds
        return found
    plan, why = None, "no stage was named"
    if stage is not None:
        try:
            plan = plan_stage(manifest, stage, num_stages)
        except ServableError as exc:
            why = str(exc)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:  # fellows sharing the cache fetch once
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch(settings, model_id, manifest, target, plan, why, attempts)


def stage_files(listing: list[dict], index: dict | None, plan: StagePlan | None) -> tuple[set[str], str]:
    """(the base's files a stage needs, why it needs every weight file the loader reads, or "").

    The loader reads the weights an index names, else every top-level ``*.safetensors`` (else ``*.bin``);
    with an index only the files that hold the stage's layers, and on the first stage the embeddings, on the
    last the final norm and head (or the embeddings where the head is tied to them)."""
    names = {f["path"] for f in listing}
    others = {n for n in names if not n.endswith(WEIGHT_SUFFIXES)}
    top = sorted(n for n in names if "/" not in n)
    read = [n for n in top if n.endswith(".safetensors")] or [n for n in top if n.endswith(".bin")]
    if index is None or plan is None:
        why = "" if len(read) <= 1 else ("the stage's layers are not known" if plan is None
                                          else "no model.safetensors.index.json says which file holds which tensor")
        return others | set(read), why
    weight_map: dict[str, str] = index.get("weight_map", {})
    tied = plan.is_last and not any(_piece(key) == "lm_head" for key in weight_map)
    wanted = {file for key, file in weight_map.items() if _needed(key, plan, tied)}
    if unlisted := wanted - names:
        raise FetchError(f"the base's index names {sorted(unlisted)}, which the leader does not list")
    return others | wanted, ""


def _piece(key: str) -> str | None:
    """"layers", "embed_tokens", "norm", "lm_head", "unread", or None for a key the loader does not know."""
    if _UNREAD.search(key):
        return "unread"
    if _LAYER.search(key):
        return "layers"
    for piece in ("embed_tokens", "norm", "lm_head"):
        if re.search(rf"(?:^|\.){piece}\.", key):
            return piece
    return None


def _needed(key: str, plan: StagePlan, tied: bool) -> bool:
    piece = _piece(key)
    if piece == "layers":
        return plan.layers[0] <= int(_LAYER.search(key).group(1)) < plan.layers[1]
    if piece == "embed_tokens":
        return plan.is_first or tied
    if piece in ("norm", "lm_head"):
        return plan.is_last
    return piece is None  # a key the loader does not know: its file comes, to let the loader say so


def _present(target: Path, entry: dict) -> bool:
    path = target / entry["path"]
    return path.is_file() and path.stat().st_size == entry["bytes"]


def _needed_files(listing: list[dict], target: Path, plan: StagePlan | None) -> tuple[list[dict], str]:
    """The listing's entries the stage needs, once the weight-free files (the index among them) are here."""
    indexes = sorted(f["path"] for f in listing if "/" not in f["path"] and f["path"].endswith(INDEX_SUFFIX))
    try:
        index = json.loads((target / indexes[0]).read_text()) if indexes else None
    except ValueError as exc:
        raise FetchError(f"the base's {indexes[0]} is not JSON: {exc}") from None
    wanted, why = stage_files(listing, index, plan)
    return [f for f in listing if f["path"] in wanted], why


def _fetch(settings: Settings, model_id: str, manifest: Manifest, target: Path, plan: StagePlan | None, why: str,
           attempts: int) -> Path:
    saved = target.parent / f"{target.name}.files.json"  # the leader's listing, kept before any file comes
    if saved.is_file():
        listing = json.loads(saved.read_text())
        if all(_present(target, f) for f in listing if not f["path"].endswith(WEIGHT_SUFFIXES)):
            needed, _ = _needed_files(listing, target, plan)
            if all(_present(target, f) for f in needed):
                return target
    try:
        listing = _listing(settings, model_id)
    except FetchError:
        if target.is_dir() and not saved.is_file():  # a whole base an older fellow unpacked from the archive
            log.warning("the leader does not list the base of %s: using %s as it is", model_id, target)
            return target
        raise
    tmp = saved.with_name(f"{saved.name}.tmp")
    tmp.write_text(json.dumps(listing))
    tmp.replace(saved)
    parts = target.parent / f"{target.name}.parts"
    weightless = [f for f in listing if not f["path"].endswith(WEIGHT_SUFFIXES)]
    fetched = _get_files(settings, model_id, weightless, target, parts, attempts)
    needed, all_why = _needed_files(listing, target, plan)
    if plan is None or all_why:
        log.info("fetching every weight file the loader reads of the base of %s: %s", model_id, all_why or why)
    fetched += _get_files(settings, model_id, [f for f in needed if f not in weightless], target, parts, attempts)
    shutil.rmtree(parts, ignore_errors=True)
    total = sum(f["bytes"] for f in listing)
    log.info("the base of %s (%s): fetched %d bytes in %d files; the stage needs %d of its %d bytes",
             model_id, manifest.base, sum(f["bytes"] for f in fetched), len(fetched),
             sum(f["bytes"] for f in needed), total)
    return target


def _listing(settings: Settings, model_id: str) -> list[dict]:
    url = f"{settings.leader.url}/api/v1/models/{model_id}/base/files"
    headers = {"Authorization": f"Bearer {settings.leader.api_token}"} if settings.leader.api_token else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=httpx.Timeout(30.0, read=600.0))  # it may hash first
    except httpx.HTTPError as exc:
        raise FetchError(f"cannot list the base of {model_id} at {settings.leader.url}: {exc}") from None
    if resp.status_code != 200:
        raise FetchError(f"the leader answered {resp.status_code} for {url}: {resp.text[:200]}")
    try:
        return [{"path": str(f["path"]), "bytes": int(f["bytes"]), "sha256": str(f["sha256"])}
                for f in resp.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise FetchError(f"the leader's listing of the base of {model_id} is not one: {exc}") from None


def _get_files(settings: Settings, model_id: str, entries: list[dict], target: Path, parts: Path,
               attempts: int) -> list[dict]:
    """Download the entries not here yet, each checked against the listed sha256; returns those fetched."""
    fetched = []
    for entry in entries:
        if _present(target, entry):
            continue
        rel = entry["path"]
        part_file = parts / f"{rel}.part"
        part_file.parent.mkdir(parents=True, exist_ok=True)
        what = f"{rel} of the base of {model_id}"
        sent = download(settings, f"{settings.leader.url}/api/v1/models/{model_id}/base/files/{quote(rel)}",
                        part_file, what, attempts)
        if sent != entry["sha256"]:
            part_file.unlink(missing_ok=True)
            raise FetchError(f"{what} changed on the leader since it was listed (sha256 {sent}, listed "
                             f"{entry['sha256']})")
        check_sha256(part_file, entry["sha256"], what)
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(part_file, target / rel)
        fetched.append(entry)
    return fetched
