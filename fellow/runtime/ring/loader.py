"""Load one stage of a ring: its layers (plus embeddings or head), its boundary codecs, its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from core.servable import Manifest, load_manifest
from core.servable_plan import StagePlan
from events.stage import StageOptions
from fellow.runtime.model.load.loader import OPTIONS, build_stage, load_tokenizer, stage_device, stop_ids_for
from fellow.runtime.model.stage import StageModel
from fellow.runtime.ring.codec import WireCodec


@dataclass
class RingStage:
    """What a ring's stage process serves with; the tokenizer and stop ids on stage 0, and on the last
    stage once a request brings a grammar (``grammar_tokenizer``)."""

    manifest: Manifest
    plan: StagePlan
    stage: StageModel
    device: torch.device
    sender: WireCodec | None  # the boundary after this stage (None on the last)
    receiver: WireCodec | None  # the boundary before it (None on stage 0)
    tokenizer: object = None
    stop_ids: frozenset[int] = frozenset()
    model_dir: Path | None = None

    def grammar_tokenizer(self) -> tuple[object, frozenset[int]]:
        """The tokenizer and stop ids a grammar is compiled with, loaded at the first one that comes."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.model_dir)
            self.stop_ids = stop_ids_for(self.manifest, self.tokenizer)
        return self.tokenizer, self.stop_ids

    @property
    def index(self) -> int:
        return self.plan.stage

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages


def load_ring_stage(model_dir: str | Path, stage: int, num_stages: int, device: str | None = None,
                    options: StageOptions = OPTIONS) -> RingStage:
    """Stage ``stage`` of ``num_stages``: the trained split when the counts match, else an even one
    reading every overlapping shard (an untrained cut is served uncompressed); a servable without
    recorded boundaries refuses any count but its own (ServableError). ``device``: all of it there;
    None: its layers split over the options' devices (fellow.runtime.model.load.loader.build_stage)."""
    model_dir = Path(model_dir)
    manifest = load_manifest(model_dir)
    mods, model = build_stage(manifest, stage, model_dir, num_stages, torch.device(device) if device else None,
                              options)
    dev = stage_device(model)
    plan = mods.plan
    hidden = manifest.hidden_size
    loaded = RingStage(
        manifest=manifest, plan=plan, stage=model, device=dev,
        sender=None if plan.is_last else WireCodec(plan.send, hidden, encoder=mods.encoder),
        receiver=None if plan.is_first else WireCodec(plan.recv, hidden, decoder=mods.decoder))
    loaded.model_dir = model_dir
    if plan.is_first:
        loaded.tokenizer = load_tokenizer(model_dir)
        loaded.stop_ids = stop_ids_for(manifest, loaded.tokenizer)
    return loaded
