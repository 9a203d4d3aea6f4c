"""The life of a load: requested, placed, each stage ready, loaded, failed, unloaded."""

from __future__ import annotations

import msgspec

from events.base import Event
from events.stage_kernels import StageKernels


class StageAssignment(msgspec.Struct, frozen=True, kw_only=True):
    stage: int
    fellow_id: str
    replica: int = 0  # which copy of the load: replicas share its request queue, one fellow each
    layers: tuple[int, int] = (0, 0)  # [first, last) decoder layers
    shards: list[int] = []  # trained shard indices this stage reads
    weights_estimate: int = 0  # what placement priced its weights at, in bytes (its share of parameters x price)


MAX_SPECULATIVE = 8  # the most tokens a decode pass may draft (SWARM_SERVE_SPECULATIVE, a load's speculative)
PREFILL_CHUNK = 256  # prompt tokens per piece a load is planned with, the leader's SWARM_SERVE_PREFILL_CHUNK unset


class TransportPlan(msgspec.Struct, frozen=True, kw_only=True):
    max_in_flight: int = 1
    kv_tokens: int = 0
    kv_tokens_max: int = 0  # a stage that measures room grows its budget up to this (0: kv_tokens at most)
    max_batch: int = 0
    speculative: int = 0  # tokens drafted per decode pass by prompt lookup (0: off); one-stage loads only
    prefill_chunk: int = PREFILL_CHUNK
    step_costs: bool = False  # every stage times its decode step at load (SWARM_SERVE_STEP_COSTS)
    step_profile: bool = False  # ... and profiles a one-token step (SWARM_SERVE_STEP_COSTS=profile)
    # the servable a drafting load's last stage drafts with (SWARM_SERVE_DRAFT_MODEL on the leader); "": none
    draft_model: str = ""
    draft_asked: str = ""  # the leader's SWARM_SERVE_DRAFT_MODEL where it chose (a fellow's own then stays unused)
    in_flight_max: int = 0  # a ring's stage 0 may raise max_in_flight to this, sized from the ring's measured
    # step costs and link transit (fellow.runtime.ring.sizing); 0: max_in_flight is fixed


class LoadRequested(Event, frozen=True, tag="load.requested"):
    load_id: str
    model_id: str
    num_stages: int | None = None
    fellow_ids: list[str] = []
    quantization: dict | None = None
    requested_by: str = ""
    replicas: int = 1


class LoadPlaced(Event, frozen=True, tag="load.placed"):
    load_id: str
    model_id: str
    stages: list[StageAssignment]
    transport: TransportPlan = TransportPlan()
    quantization: dict | None = None  # what the stages are told to serve (core.quantization.as_request)
    quantization_reason: str = ""  # why that differs from what was asked, when it does
    # what placement chose that the request did not say (fewer stages than trained, a decode-batch cap, a
    # plan for older fellows), one clause each; the load's status shows it as its reason
    reason: str = ""


class StageReady(Event, frozen=True, tag="load.stage_ready"):
    load_id: str
    stage: int
    fellow_id: str
    replica: int = 0
    pid: int = 0
    kv_tokens: int = 0
    kv_tokens_planned: int = 0
    max_in_flight: int = 1
    vram_bytes: int = 0
    load_s: float = 0.0
    kernels: StageKernels = StageKernels()  # how it computes: its path, kernel per weight shape, step costs
    weights: dict = {}  # the quantization it really serves, its measured weight bytes and their float size
    bounds: list[str] = []  # a ring's stage 0: where its fellow's own settings changed the plan (fellow.manager)


class ModelLoaded(Event, frozen=True, tag="load.loaded"):
    load_id: str
    model_id: str


class LoadFailed(Event, frozen=True, tag="load.failed"):
    load_id: str
    model_id: str
    reason: str
    code: str = "load_failed"
    fellow_id: str = ""


def replica_part(replica: int) -> str:
    """What a replica adds to the ids derived from a load's stage ("" for replica 0, as before replicas)."""
    return f"-r{replica}" if replica else ""


def load_failed_id(load_id: str) -> str:
    """One LoadFailed per load, whoever reports it (the fellow, the leader): JetStream keeps the first."""
    return f"failed-{load_id}"


def replica_lost_id(load_id: str, replica: int) -> str:
    """One id whoever reports the loss (the fellow, or the leader on FellowLost): JetStream keeps one."""
    return f"lost-{load_id}-r{replica}"


STAGE_RESTARTING = "stage_restarting"  # a ReplicaLost code: its fellow restarts the stage; its row goes loading


def stage_restart_id(event_id: str, restart: int) -> str:
    """The id of a replica's event (lost, ready) for its `restart`-th restart; the first start keeps `event_id`."""
    return f"{event_id}-restart{restart}" if restart else event_id


class ReplicaLost(Event, frozen=True, tag="load.replica_lost"):
    """One replica of a load of several stopped serving (its fellow failed, was lost, evicted it or
    let it idle out). The requests it had started fail; the others keep serving the queue. When
    none is left the leader ends the load (LoadFailed, or ModelUnloaded for idle / evicted / stopped).
    With STAGE_RESTARTING (a one-stage load) its fellow starts the stage again: a StageReady follows."""

    load_id: str
    model_id: str
    replica: int
    fellow_id: str = ""
    reason: str = ""
    code: str = "load_failed"  # load_failed | fellow_lost | idle | evicted | stopped | stage_restarting


class UnloadRequested(Event, frozen=True, tag="load.unload_requested"):
    load_id: str
    model_id: str
    requested_by: str = ""


class ModelUnloaded(Event, frozen=True, tag="load.unloaded"):
    load_id: str
    model_id: str
    reason: str = "requested"  # requested | idle | evicted | stopped | fellow_lost
    fellow_id: str = ""


class StageReplaced(Event, frozen=True, tag="load.stage_replaced"):
    """A later stage of a ring lost its fellow, and the leader placed that stage on another one (which
    gets a LoadStage command next). Stage 0 pauses the ring's sessions; once the new stage is ready,
    it replays each session's tokens to rebuild every stage's cache, and the sessions go on."""

    load_id: str
    model_id: str
    stage: int
    fellow_id: str  # the fellow that takes the stage now
    lost_fellow_id: str
    replica: int = 0
    reason: str = ""


def stage_replaced_id(load_id: str, stage: int, replica: int, lost_fellow_id: str) -> str:
    """One re-placement per lost (stage, fellow): a second leader deciding the same is deduplicated."""
    return f"replaced-{load_id}-{stage}{replica_part(replica)}-{lost_fellow_id}"
