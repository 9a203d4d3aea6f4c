"""What fellows download: a servable's archive, and an adapters export's base checkpoint as a tar or file by
file (a listing with each file's size and sha256, then the files a stage needs); all resumable with Range,
each with its sha256 in X-Swarm-Sha256."""

from __future__ import annotations

import asyncio
from pathlib import Path

from litestar import Request, Response, get
from litestar.params import FromPath, FromQuery
from litestar.response import Stream

from leader.api.deps import ServingDep, SettingsDep
from leader.api.models import _model
from leader.archive import (
    archive_for,
    base_archive_for,
    base_dir_of,
    base_file,
    file_sha256,
    list_base_files,
    parse_range,
    read_range,
)
from leader.db.tables import Model
from leader.errors import ApiError


def ranged(request: Request, path: Path, digest: str, filename: str, media_type: str) -> Response:
    """``path`` whole (200) or the span its Range header asks (206; 416 where it cannot be met)."""
    size = path.stat().st_size
    headers = {"Accept-Ranges": "bytes", "X-Swarm-Sha256": digest, "ETag": f'"{digest}"',
               "Content-Disposition": f'attachment; filename="{filename}"'}
    try:
        span = parse_range(request.headers.get("range"), size)
    except ValueError:
        raise ApiError(416, f"Range not satisfiable for {size} bytes", code="range_not_satisfiable",
                       headers={"Content-Range": f"bytes */{size}"}) from None
    start, end = span or (0, size - 1)
    headers["Content-Length"] = str(end - start + 1)
    if span:
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    return Stream(read_range(path, start, end), status_code=206 if span else 200, headers=headers,
                  media_type=media_type)


async def _servable(serving: ServingDep, model_id: str) -> Model:
    m = await _model(serving, model_id)
    if not m.available:
        raise ApiError(409, f"The model '{model_id}' is not servable: {m.reason}", code="model_unavailable")
    return m


async def _base(serving: ServingDep, settings: SettingsDep, model_id: str) -> Path:
    m = await _servable(serving, model_id)
    try:
        return await asyncio.to_thread(base_dir_of, Path(m.path), settings.fellow.model_cache)
    except ValueError as exc:
        raise ApiError(404, str(exc), code="base_not_found") from None


@get("/api/v1/models/{model_id:str}/archive", opt={"scope": "read"}, tags=["models"],
     summary="The servable (or with part=base an adapters export's base checkpoint) as a tar: sha256 in "
             "X-Swarm-Sha256, resumable with Range")
async def model_archive(request: Request, serving: ServingDep, settings: SettingsDep,
                        model_id: FromPath[str], part: FromQuery[str] = "") -> Response:
    m = await _servable(serving, model_id)
    if part not in ("", "base"):
        raise ApiError(400, f"part must be base or absent, not {part!r}", code="invalid_value", param="part")
    if part == "base":
        try:
            path, digest = await base_archive_for(Path(m.path), settings.data_dir / "archives",
                                                  settings.fellow.model_cache, m.manifest_sha256)
        except ValueError as exc:
            raise ApiError(404, str(exc), code="base_not_found") from None
    else:
        path, digest = await archive_for(Path(m.path), settings.data_dir / "archives", m.manifest_sha256)
    return ranged(request, path, digest, f"{model_id}.tar", "application/x-tar")


@get("/api/v1/models/{model_id:str}/base/files", opt={"scope": "read"}, tags=["models"],
     summary="An adapters export's base checkpoint, file by file: each file's path, bytes and sha256")
async def base_files(serving: ServingDep, settings: SettingsDep, model_id: FromPath[str]) -> dict:
    base = await _base(serving, settings, model_id)
    return {"object": "list", "data": await asyncio.to_thread(list_base_files, base)}


@get("/api/v1/models/{model_id:str}/base/files/{file_path:path}", opt={"scope": "read"}, tags=["models"],
     summary="One file of an adapters export's base checkpoint: sha256 in X-Swarm-Sha256, resumable with Range")
async def base_file_download(request: Request, serving: ServingDep, settings: SettingsDep,
                             model_id: FromPath[str], file_path: FromPath[str]) -> Response:
    base = await _base(serving, settings, model_id)
    try:
        path = base_file(base, file_path.removeprefix("/"))
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_value", param="file_path") from None
    except FileNotFoundError as exc:
        raise ApiError(404, str(exc), code="file_not_found") from None
    digest = await asyncio.to_thread(file_sha256, path)
    return ranged(request, path, digest, path.name, "application/octet-stream")


ROUTES = [model_archive, base_files, base_file_download]
