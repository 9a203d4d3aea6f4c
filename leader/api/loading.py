"""The load request's body: its type, its checks, and how it may differ from the model's active load."""

from __future__ import annotations

import math

import msgspec

from events.loads import MAX_SPECULATIVE
from leader.api.body import StructBody
from leader.db.tables import Load
from leader.errors import ApiError
from leader.openai.schema import decode_struct


class LoadBody(msgspec.Struct, forbid_unknown_fields=True):
    num_stages: int | None = None
    fellow_id: str | None = None
    fellow_ids: list[str] | None = None  # one per stage of a ring, in ring order
    quantization: dict | None = None  # refused until quantized serving lands
    replicas: int | None = None  # copies (one-stage, or rings of num_stages) sharing the request queue (default 1)
    speculative: int | None = None  # tokens drafted per decode pass (0 off, at most 8); default SWARM_SERVE_SPECULATIVE
    wait: bool = False
    timeout_s: float = 600.0  # with wait: the longest wait for ready or failed, above 0


_decoder = msgspec.json.Decoder(LoadBody)


def decode_load(raw: bytes) -> LoadBody:
    return decode_struct(raw, _decoder) if raw.strip() else LoadBody()


class LoadBodyDTO(StructBody[LoadBody]):
    decode = staticmethod(decode_load)


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def check_load(body: LoadBody) -> None:
    """Refuse what no load can honour, before anything is requested."""
    if body.num_stages is not None and body.num_stages < 1:
        raise _bad("num_stages", "num_stages must be at least 1")
    if body.replicas is not None and body.replicas < 1:
        raise _bad("replicas", "replicas must be at least 1")
    if not (math.isfinite(body.timeout_s) and body.timeout_s > 0):
        raise _bad("timeout_s", f"timeout_s must be a number of seconds above 0 (got {body.timeout_s:g})")
    if body.speculative is not None and not 0 <= body.speculative <= MAX_SPECULATIVE:
        raise _bad("speculative", f"speculative must be a whole number of drafted tokens per decode pass from 0 "
                                  f"(off) to {MAX_SPECULATIVE} (got {body.speculative})")
    if body.speculative and body.num_stages is not None and body.num_stages > 1:
        raise _bad("speculative", "speculative decoding runs on one-stage loads; a ring does not draft",
                   code="unsupported_parameter")
    if body.quantization is not None:
        raise _bad("quantization", "quantization is not supported yet: stages serve the weights at their exported "
                                   "precision; leave it out", code="unsupported_parameter")


def conflict(body: LoadBody, load: Load, stages: list) -> ApiError | None:
    """A 409 when the body asks for a different shape than the active load has; None when it fits.

    Stage rows exist once the load is placed; before that only num_stages is compared.
    """
    def differs(param: str, asked, has) -> ApiError:
        return ApiError(409, f"'{load.model_id}' is already loaded ({load.load_id}) with {param} {has}, not {asked}; "
                             "unload it first to load it differently", code="load_conflict", param=param)

    if body.num_stages is not None and load.num_stages and body.num_stages != load.num_stages:
        return differs("num_stages", body.num_stages, load.num_stages)
    planned = (load.transport or {}).get("speculative", 0)
    if body.speculative is not None and load.transport is not None and body.speculative != planned:
        return differs("speculative", body.speculative, planned)
    if not stages:
        return None
    replicas = len({s.replica for s in stages})
    if body.replicas is not None and body.replicas != replicas:
        return differs("replicas", body.replicas, replicas)
    on = sorted({s.fellow_id for s in stages})
    if body.fellow_id is not None and body.fellow_id not in on:
        return differs("fellow_id", f"'{body.fellow_id}'", "on " + ", ".join(on))
    if body.fellow_ids is not None:
        ring = [s.fellow_id for s in stages if s.replica == stages[0].replica]  # stages() orders by replica, stage
        has, asked = (ring, list(body.fellow_ids)) if replicas == 1 else (on, sorted(set(body.fellow_ids)))
        if asked != has:
            return differs("fellow_ids", asked, has)
    return None
