"""Placement: which fellow serves which stage, from the fellows' last heartbeats and the model's size."""

from __future__ import annotations

from dataclasses import dataclass

from msgspec import structs

from core.quantization import NONE, bytes_per_param, capability_for
from events.fellow import (
    CAP_4BIT_ROWS,
    CAP_CONCURRENT,
    CAP_DRAFT_MODEL,
    CAP_KV_BUDGET,
    CAP_N_STAGE,
    CAP_ONE_STAGE,
    CAP_SPECULATIVE,
    Heartbeat,
)
from events.loads import PREFILL_CHUNK, StageAssignment, TransportPlan

HEADROOM = 1.2  # activations, allocator slack
# a ring's requests in flight a stage, SWARM_SERVE_IN_FLIGHT unset: the spec's default and its ceiling ("four per
# stage at most"), past which stage 0 sizes only where its fellow's SWARM_SERVE_MAX_IN_FLIGHT asks for more
RING_IN_FLIGHT_PER_STAGE = 4


class PlacementError(Exception):
    """No fellow can take the load; the message says why, naming fellows where it helps."""


@dataclass(frozen=True)
class Candidate:
    fellow_id: str
    free_bytes: int
    loaded: int
    has_gpu: bool


MAX_IN_FLIGHT = 8  # requests a one-stage load holds at once, SWARM_SERVE_MAX_IN_FLIGHT unset
# Fellows whose replies failed other fellows' checks (leader.verify): placement picks them for no new stage
# (an operator may still pin one); this leader's verification tally keeps the set.
DRAINED: set[str] = set()


def transport_plan(settings, num_stages: int) -> TransportPlan:
    """How a load's stages run, for one stage or a ring of ``num_stages``.

    In flight: SWARM_SERVE_IN_FLIGHT, else SWARM_SERVE_MAX_IN_FLIGHT (MAX_IN_FLIGHT unset) for one stage,
    else RING_IN_FLIGHT_PER_STAGE per stage of a ring, so every stage has work while the others run theirs.
    KV tokens: a typical chat per request in flight, never below one whole SWARM_SERVE_CONTEXT_TOKENS
    conversation; each stage lowers it to what it measures it can hold, or grows into what it measures up to
    a full context per request in flight (``kv_tokens_max``). Speculative decoding: SWARM_SERVE_SPECULATIVE,
    one stage or a ring.

    A ring without SWARM_SERVE_IN_FLIGHT is sized by its stage 0 (``in_flight_max``, the same four a stage): it
    times its stages' steps and its links at start and keeps enough decode groups in flight to fill the pipe
    (fellow.runtime.ring.sizing), never more than every stage's KV holds, nor more than four a stage unless
    its fellow's SWARM_SERVE_MAX_IN_FLIGHT asks for more (fellow.manager.stage_options).
    """
    one = num_stages == 1
    held = settings.serving.max_in_flight or MAX_IN_FLIGHT
    in_flight = settings.serving.in_flight or (held if one else RING_IN_FLIGHT_PER_STAGE * num_stages)
    sized = not one and not settings.serving.in_flight
    chunk = settings.serving.prefill_chunk
    return TransportPlan(max_in_flight=in_flight,
                         in_flight_max=in_flight if sized else 0,
                         kv_tokens=max(settings.serving.context_tokens, in_flight * settings.serving.typical_tokens),
                         kv_tokens_max=in_flight * settings.serving.context_tokens,
                         max_batch=settings.serving.max_batch or 0, speculative=settings.serving.speculative,
                         prefill_chunk=PREFILL_CHUNK if chunk is None else chunk,
                         step_costs=settings.serving.step_costs != "off",
                         step_profile=settings.serving.step_costs == "profile")


AMPERE = (8, 0)
# the decode-batch cap of a load with a stage on a card older than Ampere, where SWARM_SERVE_MAX_BATCH is
# unset: batches of 4 took 671 ms on two GTX 1660 SUPER against about 120 ms for one session, and float16
# batches are weight-bound there too; bitsandbytes' 4-bit kernel for 4 rows and more was 4.5x slower than
# the one for 3, so batches stay at 2, unless every fellow of the load splits such calls (serve-4bit-rows)
PRE_AMPERE_BATCH, PRE_AMPERE_BATCH_SPLIT = 2, 4


def _capability(text: str) -> tuple[int, int] | None:
    """"7.5" -> (7, 5); None where nvidia-smi gave nothing readable."""
    try:
        major, minor = text.strip().split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def pre_ampere_batch_cap(transport: TransportPlan, assignments: list[StageAssignment],
                         heartbeats: dict[str, Heartbeat], method: str, explicit: bool) -> tuple[TransportPlan, str]:
    """(the transport, why its ``max_batch`` changed or ""): a load (4-bit, 8-bit or float16 alike) with any
    stage on a fellow that has a GPU older than Ampere decodes batches of at most PRE_AMPERE_BATCH sessions,
    or PRE_AMPERE_BATCH_SPLIT where every fellow of the load declares serve-4bit-rows, unless the leader's
    SWARM_SERVE_MAX_BATCH says otherwise (``explicit``). Loads on newer cards or CPUs are left as they are."""
    if explicit:
        return transport, ""
    fellows = [heartbeats.get(a.fellow_id) for a in assignments]
    old = sorted({f"{g.name} (sm {g.compute_capability})" for hb in fellows if hb is not None for g in hb.gpus
                  if (cc := _capability(g.compute_capability)) is not None and cc < AMPERE})
    if not old:
        return transport, ""
    split = all(hb is not None and CAP_4BIT_ROWS in hb.capabilities for hb in fellows)
    cap = PRE_AMPERE_BATCH_SPLIT if split else PRE_AMPERE_BATCH
    why = (f"decode batches of at most {cap}: a {method} load on {', '.join(old)}, older than Ampere, "
           + ("where every fellow splits 4-bit calls (serve-4bit-rows)" if split
              else "where not every fellow splits 4-bit calls (serve-4bit-rows)"))
    return structs.replace(transport, max_batch=cap), why


OLD_FELLOW_IN_FLIGHT = 2  # a stage, with a fellow that predates serve-kv-budget (SWARM_SERVE_IN_FLIGHT unset)


def for_old_fellows(transport: TransportPlan, assignments: list[StageAssignment], heartbeats: dict[str, Heartbeat],
                    settings, num_stages: int) -> tuple[TransportPlan, list[str]]:
    """(the transport, why each change): the spec's plan where a fellow of the load predates a capability.
    Without serve-kv-budget it admits by count alone: in flight 2 a stage (SWARM_SERVE_IN_FLIGHT where
    set), a full SWARM_SERVE_CONTEXT_TOKENS conversation of KV per request in flight, no growth nor ring
    sizing. A ring drafts (speculative) only where every fellow declares serve-speculative: a stage from
    before would keep rejected drafts in its cache; a one-stage load drafts on its own. A load drafts with
    a draft model only where every fellow declares serve-draft-model."""
    fellows = {a.fellow_id: heartbeats.get(a.fellow_id) for a in assignments}

    def lacking(cap: str) -> list[str]:
        return sorted(fid for fid, hb in fellows.items() if hb is None or cap not in hb.capabilities)

    why = []
    if old := lacking(CAP_KV_BUDGET):
        in_flight = settings.serving.in_flight or OLD_FELLOW_IN_FLIGHT * num_stages
        transport = structs.replace(transport, max_in_flight=in_flight, in_flight_max=0, kv_tokens_max=0,
                                    kv_tokens=in_flight * settings.serving.context_tokens)
        why.append(f"{in_flight} in flight with a full context each: fellow {', '.join(old)} does not "
                   f"declare {CAP_KV_BUDGET}")
    if num_stages > 1 and transport.speculative and (old := lacking(CAP_SPECULATIVE)):
        transport = structs.replace(transport, speculative=0, draft_model="")
        why.append(f"no drafting: fellow {', '.join(old)} does not declare {CAP_SPECULATIVE}")
    if transport.draft_model and (old := lacking(CAP_DRAFT_MODEL)):
        transport = structs.replace(transport, draft_model="")
        why.append(f"no draft model: fellow {', '.join(old)} does not declare {CAP_DRAFT_MODEL}")
    return transport, why


def candidate(hb: Heartbeat) -> Candidate:
    if hb.gpus:
        free = sum(g.free_bytes for g in hb.gpus)
    else:
        free = hb.memory_free_bytes
    return Candidate(hb.fellow_id, free, len(hb.loaded_models), bool(hb.gpus))


def _lacks(hb: Heartbeat, needs: tuple[str, ...], method: str = NONE) -> list[str]:
    """What of ``needs``, and of what serving ``method`` on its device takes, the fellow does not declare."""
    quant = capability_for(method, bool(hb.gpus))
    return [cap for cap in (*needs, *((quant,) if quant else ())) if cap not in hb.capabilities]


def weights_estimate(parameters: float, method: str, has_gpu: bool) -> int:
    """The bytes a stage's weights are priced at (no headroom): what status shows beside the measured bytes."""
    return int(parameters * bytes_per_param(method, has_gpu))


def place_one_stage(parameters: int, num_layers: int, fellows: dict[str, Heartbeat], online: set[str],
                    pinned: str | None = None, method: str = NONE) -> StageAssignment:
    """The fellow with the most free memory among those that declare CAP_ONE_STAGE (and what ``method``
    takes on their device: core.quantization.capability_for) and fit it at ``method``'s price."""
    if pinned is not None:
        if pinned not in online or pinned not in fellows:
            raise PlacementError(f"fellow {pinned!r} is not online")
        pool = {pinned: fellows[pinned]}
    else:
        pool = {fid: hb for fid, hb in fellows.items() if fid in online and fid not in DRAINED}
    if not pool:
        raise PlacementError("no fellow is online")
    lacking = {fid: _lacks(hb, (CAP_ONE_STAGE,), method) for fid, hb in pool.items()
               if _lacks(hb, (CAP_ONE_STAGE,), method)}
    able = [candidate(hb) for fid, hb in pool.items() if fid not in lacking]
    if not able:
        raise PlacementError("; ".join(f"fellow {fid} does not declare {', '.join(caps)}"
                                       for fid, caps in sorted(lacking.items())))
    fitting = [c for c in able
               if c.free_bytes >= parameters * bytes_per_param(method, c.has_gpu) * HEADROOM]
    if not fitting:
        best = max(able, key=lambda c: c.free_bytes)
        need = parameters * bytes_per_param(method, best.has_gpu) * HEADROOM
        raise PlacementError(f"no fellow has room: the model needs about {need / 2**30:.2f} GiB, "
                             f"the most free is {best.free_bytes / 2**30:.2f} GiB on {best.fellow_id}")
    best = max(fitting, key=lambda c: (c.free_bytes, -c.loaded, c.fellow_id))
    return StageAssignment(stage=0, fellow_id=best.fellow_id, layers=(0, num_layers), shards=[],
                           weights_estimate=weights_estimate(parameters, method, best.has_gpu))


def place_replicas(parameters: int, num_layers: int, replicas: int, fellows: dict[str, Heartbeat],
                   online: set[str], pinned: list[str] | None = None,
                   method: str = NONE) -> list[StageAssignment]:
    """``replicas`` one-stage copies of a model, each on its own fellow: pinned in order, else the
    fellows with the most free memory that fit it. A refusal says how many could take one."""
    if pinned:
        if len(pinned) != replicas:
            raise PlacementError(f"{len(pinned)} fellow_ids for {replicas} replicas")
        if len(set(pinned)) != replicas:
            raise PlacementError(f"each replica needs its own fellow; fellow_ids {pinned} repeat one")
        out = [place_one_stage(parameters, num_layers, fellows, online, fid, method) for fid in pinned]
        return [structs.replace(a, replica=i) for i, a in enumerate(out)]
    out: list[StageAssignment] = []
    taken: set[str] = set()
    for replica in range(replicas):
        rest = {fid: hb for fid, hb in fellows.items() if fid not in taken}
        try:
            a = place_one_stage(parameters, num_layers, rest, online - taken, None, method)
        except PlacementError as exc:
            raise PlacementError(f"{replicas} replicas need {replicas} fellows with room, "
                                 f"{replica} found ({exc})") from None
        taken.add(a.fellow_id)
        out.append(structs.replace(a, replica=replica))
    return out


# --- rings -----------------------------------------------------------------------------------

def ring_needs(max_in_flight: int) -> tuple[str, ...]:
    """The capabilities every fellow of a ring must declare."""
    return (CAP_N_STAGE, CAP_CONCURRENT) if max_in_flight > 1 else (CAP_N_STAGE,)


def ring_stage_count(manifest_stages: int, fellows: dict[str, Heartbeat], online: set[str]) -> int:
    """The servable's own count when that many online fellows can form a ring, else one stage."""
    return manifest_stages if manifest_stages > 1 and _ring_able(fellows, online) >= manifest_stages else 1


def _ring_able(fellows: dict[str, Heartbeat], online: set[str]) -> int:
    return sum(1 for fid, hb in fellows.items() if fid in online and CAP_N_STAGE in hb.capabilities)


def fewer_stages_note(manifest_stages: int, fellows: dict[str, Heartbeat], online: set[str]) -> str:
    """What the load's status says when ring_stage_count falls back to one stage."""
    able = _ring_able(fellows, online)
    return (f"served as one stage: the model trained over {manifest_stages} stages and {able} online fellow(s) "
            f"declare {CAP_N_STAGE}; its trained cuts are kept inside the stage")


def place_ring(parameters: int, ranges: list[tuple[int, int]], shards: list[list[int]],
               fellows: dict[str, Heartbeat], online: set[str], pinned: list[str] | None = None,
               method: str = NONE, needs: tuple[str, ...] = (CAP_N_STAGE,)) -> list[StageAssignment]:
    """One fellow per stage: pinned in order, else the heaviest stage on the fellow with the most room.

    Every fellow must declare ``needs`` and what ``method`` takes on its device; a refusal names the
    fellow that lacks one.
    """
    n = len(ranges)
    num_layers = ranges[-1][1]
    if pinned:
        if len(pinned) != n:
            raise PlacementError(f"{len(pinned)} fellow_ids for a ring of {n} stages")
        if len(set(pinned)) != n:
            raise PlacementError(f"each stage of a ring needs its own fellow; fellow_ids {pinned} repeat one")
        for fid in pinned:
            if fid not in online or fid not in fellows:
                raise PlacementError(f"fellow {fid!r} is not online")
            if missing := _lacks(fellows[fid], needs, method):
                raise PlacementError(f"fellow {fid} does not declare {', '.join(missing)}, "
                                     f"which a ring of {n} stages needs")
        order = [candidate(fellows[fid]) for fid in pinned]
    else:
        pool = {fid: hb for fid, hb in fellows.items() if fid in online and fid not in DRAINED}
        lacking = {fid: _lacks(hb, needs, method) for fid, hb in pool.items() if _lacks(hb, needs, method)}
        able = sorted((candidate(hb) for fid, hb in pool.items() if fid not in lacking),
                      key=lambda c: (-c.free_bytes, c.loaded, c.fellow_id))
        if len(able) < n:
            why = "; ".join(f"fellow {fid} does not declare {', '.join(caps)}" for fid, caps in sorted(lacking.items()))
            quant = {capability_for(method, False), capability_for(method, True)} - {None}
            asked = ", ".join([*needs, *([" or ".join(sorted(quant))] if quant else [])])
            raise PlacementError(f"a ring of {n} stages needs {n} fellows that declare {asked}, "
                                 f"{len(able)} online do" + (f" ({why})" if why else ""))
        heaviest = sorted(range(n), key=lambda i: ranges[i][0] - ranges[i][1])
        order = [None] * n
        for stage, fellow in zip(heaviest, able):
            order[stage] = fellow
    out = []
    for stage, (c, layers) in enumerate(zip(order, ranges)):
        share = parameters * (layers[1] - layers[0]) / num_layers
        need = share * bytes_per_param(method, c.has_gpu) * HEADROOM
        if c.free_bytes < need:
            raise PlacementError(f"fellow {c.fellow_id} has no room for stage {stage}: it needs about "
                                 f"{need / 2**30:.2f} GiB, {c.free_bytes / 2**30:.2f} GiB are free")
        out.append(StageAssignment(stage=stage, fellow_id=c.fellow_id, layers=tuple(layers), shards=list(shards[stage]),
                                   weights_estimate=weights_estimate(share, method, c.has_gpu)))
    return out


def place_ring_replicas(parameters: int, ranges: list[tuple[int, int]], shards: list[list[int]], replicas: int,
                        fellows: dict[str, Heartbeat], online: set[str], pinned: list[str] | None = None,
                        method: str = NONE,
                        needs: tuple[str, ...] = (CAP_N_STAGE,)) -> list[StageAssignment]:
    """``replicas`` rings of ``len(ranges)`` stages, no fellow in two of them: ``pinned`` lists every
    replica's fellows in turn (replica 0's stages, then replica 1's ...), else each ring is placed as
    ``place_ring`` places one, on the fellows the rings before it left."""
    n = len(ranges)
    if pinned:
        if len(pinned) != n * replicas:
            raise PlacementError(f"{len(pinned)} fellow_ids for {replicas} rings of {n} stages (give {n * replicas})")
        if len(set(pinned)) != len(pinned):
            raise PlacementError(f"each stage of each ring needs its own fellow; fellow_ids {pinned} repeat one")
    out: list[StageAssignment] = []
    for replica in range(replicas):
        used = {a.fellow_id for a in out}
        try:
            ring = place_ring(parameters, ranges, shards, {f: hb for f, hb in fellows.items() if f not in used},
                              online, pinned[replica * n:(replica + 1) * n] if pinned else None, method, needs)
        except PlacementError as exc:
            raise PlacementError(f"{replicas} rings of {n} stages: ring {replica} could not be placed "
                                 f"({exc})") from None
        out += [structs.replace(a, replica=replica) for a in ring]
    return out


def place_replacement(parameters: int, layers: tuple[int, int], num_layers: int, fellows: dict[str, Heartbeat],
                      online: set[str], exclude: set[str], method: str = NONE,
                      needs: tuple[str, ...] = (CAP_N_STAGE,)) -> str:
    """The fellow that takes over a ring stage whose fellow was lost: the one with the most room among
    the online ones outside the ring that declare ``needs`` (and what ``method`` takes) and hold the
    stage's layers at ``method``'s price."""
    share = parameters * (layers[1] - layers[0]) / num_layers
    able = sorted((candidate(hb) for fid, hb in fellows.items()
                   if fid in online and fid not in exclude | DRAINED and not _lacks(hb, needs, method)),
                  key=lambda c: (-c.free_bytes, c.loaded, c.fellow_id))
    for c in able:
        if c.free_bytes >= share * bytes_per_param(method, c.has_gpu) * HEADROOM:
            return c.fellow_id
    raise PlacementError(f"no online fellow outside the ring declares {', '.join(needs)} and has room for "
                         f"layers {layers[0]}-{layers[1]} ({len(able)} without room)")
