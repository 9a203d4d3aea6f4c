"""Imperative commands addressed to one fellow on ``swarm.cmd.<fellow>.<verb>`` (a work queue)."""

from __future__ import annotations

import msgspec

from events.base import new_id
from events.loads import StageAssignment, TransportPlan


class Command(msgspec.Struct, frozen=True, kw_only=True, tag_field="verb"):
    id: str = msgspec.field(default_factory=new_id)


class LoadStage(Command, frozen=True, tag="load"):
    load_id: str
    model_id: str
    assignment: StageAssignment
    num_stages: int = 1
    stage_fellows: list[str] = []
    transport: TransportPlan = TransportPlan()
    quantization: dict | None = None
    model_path: str = ""  # where the leader has it; a fellow without it fetches the archive
    manifest_sha256: str = ""
    # the last stage's draft model (transport.draft_model): where the leader has it, its manifest's checksum
    draft_path: str = ""
    draft_sha256: str = ""
    replicas: int = 1  # copies of the load; with more than one a stage that stops reports ReplicaLost


class UnloadStage(Command, frozen=True, tag="unload"):
    load_id: str
    reason: str = "requested"


class StopFellow(Command, frozen=True, tag="stop"):
    purge: bool = False


class UpdateFellow(Command, frozen=True, tag="update"):
    pass


AnyCommand = LoadStage | UnloadStage | StopFellow | UpdateFellow
command_decoder = msgspec.json.Decoder(AnyCommand)
