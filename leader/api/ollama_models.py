"""Ollama's model routes, read from the catalog and load projections: ``/api/tags`` (the servable models),
``/api/show`` (one model), ``/api/ps`` (what is loaded), ``/api/version``; ``/api/pull``, ``/api/delete`` and the
other catalog writes answer a 400 naming the catalog's way instead (``swarm export`` into the servables
folder, loads through ``/api/v1/models/{id}/load``)."""

from __future__ import annotations

import msgspec
from litestar import Router, delete, get, post
from litestar.params import JSONBody

from leader.api.deps import ServingDep
from leader.api.ollama import ollama_chat, ollama_errors, ollama_generate
from leader.db.tables import Model
from leader.errors import ApiError
from leader.ollama.replies import iso
from leader.openai.tokenizer import tokenizer_for
from leader.openai.tool_formats import format_of
from leader.serving import model_not_found

VERSION = "0.1.0"  # Swarm's version: no Ollama release is claimed
CATALOG_WAY = ("models come from the catalog, not a registry: export one with `swarm export` into the servables "
               "folder (SWARM_SERVABLE_MODELS_ROOT), and load or unload it through /api/v1/models/{id}/load")


def _size(parameters: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= scale:
            return f"{parameters / scale:.1f}{unit}"
    return str(parameters)


def _details(m: Model) -> dict:
    quant = (m.quantization or {}).get("method") or (m.quantization or {}).get("type") or "none"
    return {"parent_model": "", "format": "swarm", "family": m.architecture, "families": [m.architecture],
            "parameter_size": _size(m.parameters), "quantization_level": str(quant)}


def _entry(m: Model) -> dict:
    return {"name": m.model_id, "model": m.model_id, "modified_at": iso(m.cataloged_at), "size": m.size_bytes,
            "digest": m.manifest_sha256, "details": _details(m)}


@get("/api/tags", opt={"scope": "read"}, tags=["ollama"], summary="Ollama: the servable models")
async def ollama_tags(serving: ServingDep) -> dict:
    return {"models": [_entry(m) for m in await serving.registry.all() if m.available]}


class ShowBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # older clients' field
    verbose: bool | None = None


def _capabilities(m: Model) -> tuple[list[str], str]:
    try:
        template = tokenizer_for(m.path).chat_template or ""
    except ApiError:
        return ["completion"], ""
    caps = ["completion"]
    if format_of(template):
        caps.append("tools")
    if "</think>" in template:
        caps.append("thinking")
    return caps, template


@post("/api/show", opt={"scope": "read"}, status_code=200, tags=["ollama"], summary="Ollama: one model's details")
async def ollama_show(serving: ServingDep, data: JSONBody[ShowBody]) -> dict:
    model_id = data.model or data.name
    if not model_id:
        raise ApiError(400, "'model' must name a model (see GET /api/tags)", code="invalid_value", param="model")
    m = await serving.registry.get(model_id)
    if m is None:
        raise model_not_found(model_id)
    caps, template = _capabilities(m)
    info = {"general.architecture": m.architecture, "general.parameter_count": m.parameters,
            f"{m.architecture}.block_count": m.num_layers, f"{m.architecture}.embedding_length": m.hidden_size}
    return {"modelfile": "", "parameters": "", "template": template, "details": _details(m), "model_info": info,
            "capabilities": caps, "modified_at": iso(m.cataloged_at)}


@get("/api/ps", opt={"scope": "read"}, tags=["ollama"], summary="Ollama: the models loaded now (the projections)")
async def ollama_ps(serving: ServingDep) -> dict:
    """``expires_at`` is null: a fellow unloads a model after SWARM_MODEL_IDLE_UNLOAD_S without requests."""
    out = []
    for m in await serving.registry.all():
        load = await serving.active_load(m.model_id)
        if load is None or load.state != "ready":
            continue
        out.append({**_entry(m), "expires_at": None, "size_vram": 0})
    return {"models": out}


@get("/api/version", opt={"scope": "public"}, tags=["ollama"], summary="Ollama: the server's version")
async def ollama_version() -> dict:
    return {"version": VERSION}


def _refused(what: str) -> ApiError:
    return ApiError(400, f"{what} is not served by this server: {CATALOG_WAY}", code="unsupported_operation")


@post(["/api/pull", "/api/push", "/api/create", "/api/copy"], opt={"scope": "operate"}, status_code=200,
      tags=["ollama"], summary="Ollama's registry writes: refused, naming the catalog's way")
async def ollama_pull() -> None:
    raise _refused("Pulling, pushing, creating or copying a model")


@delete("/api/delete", opt={"scope": "operate"}, status_code=200, tags=["ollama"],
        summary="Ollama's delete: refused, naming the catalog's way")
async def ollama_delete() -> None:
    raise _refused("Deleting a model")


OLLAMA = Router("/", route_handlers=[ollama_chat, ollama_generate, ollama_tags, ollama_show, ollama_ps,
                                     ollama_version, ollama_pull, ollama_delete],
                exception_handlers={Exception: ollama_errors})
