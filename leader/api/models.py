"""Models: the catalog (`/api/v1/models`, OpenAI's `/v1/models`), load, unload and status (downloads:
`leader/api/downloads.py`)."""

from __future__ import annotations

import asyncio
import time

from litestar import get, post
from litestar.params import FromPath, JSONBody
from litestar.status_codes import HTTP_200_OK
from sqlalchemy import select

from events import subjects
from leader.api.deps import Caller, Db, FellowsDep, LeaderDep, ServingDep, requested_by
from leader.api.loading import LoadBody, LoadBodyDTO, check_load, conflict
from leader.api.views import LoadView, load_view
from leader.db.tables import Load, Model
from leader.errors import ApiError
from leader.serving import Serving, model_not_found


def model_view(m: Model, load: Load | None) -> dict:
    return {
        "id": m.model_id, "object": "model", "available": m.available, "reason": m.reason or None,
        "architecture": m.architecture, "num_stages": m.num_stages, "boundaries": m.boundaries,
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "parameters": m.parameters,
        "size_bytes": m.size_bytes, "quantization": m.quantization, "export": m.export,
        "load_state": load.state if load else "unloaded", "load_id": load.load_id if load else None,
    }


async def queued_requests(js, load_id: str) -> int:
    """Requests on the bus that no stage has taken yet (pending in the load's request consumer)."""
    from nats.js.errors import NotFoundError

    from events.subjects import REQUESTS_STREAM

    try:
        info = await js.consumer_info(REQUESTS_STREAM, subjects.request_consumer(load_id))
    except NotFoundError:
        return 0
    return int(info.num_pending or 0)


@get("/api/v1/models", opt={"scope": "read"}, tags=["models"], summary="Servable models and their load state")
async def list_models(serving: ServingDep) -> dict:
    models = await serving.registry.all()
    loads = {m.model_id: await serving.active_load(m.model_id) for m in models}
    return {"object": "list", "data": [model_view(m, loads[m.model_id]) for m in models]}


@get("/v1/models", opt={"scope": "read"}, tags=["openai"], summary="OpenAI: the models available to chat")
async def list_models_openai(serving: ServingDep) -> dict:
    models = await serving.registry.all()
    return {"object": "list", "data": [{"id": m.model_id, "object": "model", "created": int(m.cataloged_at),
                                        "owned_by": "swarm"} for m in models if m.available]}


async def _model(serving: Serving, model_id: str) -> Model:
    model = await serving.registry.get(model_id)
    if model is None:
        raise model_not_found(model_id)
    return model


@get("/v1/models/{model_id:str}", opt={"scope": "read"}, tags=["openai"], summary="OpenAI: one model")
async def get_model_openai(serving: ServingDep, model_id: FromPath[str]) -> dict:
    m = await _model(serving, model_id)
    return {"id": m.model_id, "object": "model", "created": int(m.cataloged_at), "owned_by": "swarm"}


@get("/api/v1/models/{model_id:str}", opt={"scope": "read"}, tags=["models"], summary="One model")
async def get_model(serving: ServingDep, model_id: FromPath[str]) -> dict:
    m = await _model(serving, model_id)
    return model_view(m, await serving.active_load(model_id))


async def _last_ended(db, model_id: str) -> dict | None:
    """With nothing loaded: how the model's latest load ended (failed, with the stage's exit and log line, or
    unloaded)."""
    load = (await db.scalars(select(Load).where(Load.model_id == model_id).order_by(Load.requested_at.desc())
                             .limit(1))).first()
    if load is None:
        return None
    return {"load_id": load.load_id, "state": load.state, "reason": load.reason or None, "ended_at": load.ended_at}


@get("/api/v1/models/{model_id:str}/status", opt={"scope": "read"}, tags=["models"],
     summary="Load state, stages and serving metrics (tokens_per_s, last_ttft_s, requests, idle_s, vram_bytes)")
async def model_status(leader: LeaderDep, serving: ServingDep, fellows: FellowsDep, db: Db,
                       model_id: FromPath[str]) -> dict:
    m = await _model(serving, model_id)
    load = await serving.active_load(model_id)
    view = model_view(m, load)
    view["load"] = load_view(load, await serving.stages(load.load_id), fellows.latest) if load else None
    view["last_load"] = None if load else await _last_ended(db, model_id)
    if load is not None:
        view["load"].queued = await queued_requests(leader.js, load.load_id)
        view["load"].relay = serving.relay.lanes(load.load_id)  # a ring's bytes and frames per lane
    view["checked_at"] = time.time()
    return view


@post("/api/v1/models/{model_id:str}/load", opt={"scope": "operate"}, tags=["models"], status_code=HTTP_200_OK,
      dto=LoadBodyDTO, return_dto=None,
      summary="Load a model on one stage, a ring of num_stages or as replicas one-stage copies (fellow_ids "
              "pins them); with wait, answer once it is ready or failed. A model already loaded otherwise: 409")
async def load_model(serving: ServingDep, fellows: FellowsDep, caller: Caller, model_id: FromPath[str],
                     data: JSONBody[LoadBody | None] = None) -> LoadView:
    body = data or LoadBody()
    check_load(body)
    active = await serving.active_load(model_id)
    if active is not None and (refused := conflict(body, active, await serving.stages(active.load_id))):
        raise refused
    load = await serving.load(model_id, body.num_stages, body.fellow_id, body.quantization,
                              requested_by=requested_by(caller), fellow_ids=body.fellow_ids,
                              replicas=body.replicas or 1, speculative=body.speculative)
    if body.wait:
        try:
            load = await serving.wait_settled(load.load_id, body.timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(504, f"'{model_id}' is still loading after {body.timeout_s:.0f}s",
                           code="load_timeout") from None
    return load_view(load, await serving.stages(load.load_id), fellows.latest)


@post("/api/v1/models/{model_id:str}/unload", opt={"scope": "operate"}, tags=["models"], status_code=HTTP_200_OK,
      summary="Unload a model: its stage processes stop and give their memory back")
async def unload_model(serving: ServingDep, fellows: FellowsDep, caller: Caller,
                       model_id: FromPath[str]) -> LoadView:
    load = await serving.unload(model_id, requested_by=requested_by(caller))
    return load_view(load, await serving.stages(load.load_id), fellows.latest)


ROUTES = [list_models, list_models_openai, get_model_openai, get_model, model_status, load_model, unload_model]

