"""Placement: which fellow serves which stage, from the fellows' last heartbeats and the model's size."""

from __future__ import annotations

from dataclasses import dataclass

from events.fellow import Heartbeat
from events.loads import StageAssignment

ONE_STAGE = "serve-one-stage"
QUANTIZED = "serve-quantized"

# Bytes per parameter of the base checkpoint, as the spec prices them.
PRICE_4BIT = 0.55
PRICE_8BIT = 1.05
HEADROOM = 1.2  # activations, allocator slack


class PlacementError(Exception):
    """No fellow can take the load; the message says why, naming fellows where it helps."""


@dataclass(frozen=True)
class Candidate:
    fellow_id: str
    free_bytes: int
    loaded: int
    has_gpu: bool


def bytes_per_param(quantization: dict | None, has_gpu: bool) -> float:
    q = quantization or {}
    method = str(q.get("method", "")).lower()
    bits = q.get("bits")
    if method in ("nf4", "int4-fast", "fp4") or bits == 4:
        return PRICE_4BIT
    if method in ("int8", "llm.int8") or bits == 8:
        return PRICE_8BIT
    return 2.0 if has_gpu else 4.0  # half precision on a GPU, float32 on a CPU


def candidate(hb: Heartbeat) -> Candidate:
    if hb.gpus:
        free = sum(g.free_bytes for g in hb.gpus)
    else:
        free = hb.memory_free_bytes
    return Candidate(hb.fellow_id, free, len(hb.loaded_models), bool(hb.gpus))


def place_one_stage(parameters: int, num_layers: int, fellows: dict[str, Heartbeat], online: set[str],
                    pinned: str | None = None, quantization: dict | None = None) -> StageAssignment:
    """The fellow with the most free memory among those that declare serve-one-stage and fit it."""
    if pinned is not None:
        if pinned not in online or pinned not in fellows:
            raise PlacementError(f"fellow {pinned!r} is not online")
        pool = {pinned: fellows[pinned]}
    else:
        pool = {fid: hb for fid, hb in fellows.items() if fid in online}
    if not pool:
        raise PlacementError("no fellow is online")
    lacking = sorted(fid for fid, hb in pool.items() if ONE_STAGE not in hb.capabilities)
    able = [candidate(hb) for fid, hb in pool.items() if fid not in lacking]
    if not able:
        raise PlacementError(f"fellow(s) {', '.join(lacking)} do not declare {ONE_STAGE}")
    fitting = [c for c in able
               if c.free_bytes >= parameters * bytes_per_param(quantization, c.has_gpu) * HEADROOM]
    if not fitting:
        best = max(able, key=lambda c: c.free_bytes)
        need = parameters * bytes_per_param(quantization, best.has_gpu) * HEADROOM
        raise PlacementError(f"no fellow has room: the model needs about {need / 2**30:.2f} GiB, "
                             f"the most free is {best.free_bytes / 2**30:.2f} GiB on {best.fellow_id}")
    best = max(fitting, key=lambda c: (c.free_bytes, -c.loaded, c.fellow_id))
    return StageAssignment(stage=0, fellow_id=best.fellow_id, layers=(0, num_layers), shards=[])
