"""Load a servable's stage for serving: modules, tokenizer, stop ids, on the fellow's device."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from core.servable import TOKENIZER_DIR, Manifest, load_manifest
from fellow.runtime.model.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel
from fellow.runtime.model.weights import build_stage_modules

log = logging.getLogger(__name__)


@dataclass
class LoadedStage:
    manifest: Manifest
    stage: StageModel
    tokenizer: object
    stop_ids: frozenset[int]
    device: torch.device


def pick_device(requested: str | None = None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir / TOKENIZER_DIR))


def stop_ids_for(manifest: Manifest, tokenizer) -> frozenset[int]:
    ids = set(manifest.generation.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def load_one_stage(model_dir: str | Path, device: str | None = None, attention: str = "sdpa",
                   packed: bool = True, batch_cap: int = 8) -> LoadedStage:
    """The whole model as one stage (embeddings, every layer, norm and head): a ring of one.

    ``packed``: float32 CPU stages may hold weights packed for oneDNN; ``batch_cap``: the most sessions
    a decode step runs, which the kernel choice times (fellow.runtime.model.kernels.prepare_stage).
    """
    model_dir = Path(model_dir)
    manifest = load_manifest(model_dir)
    dev = pick_device(device)
    mods = build_stage_modules(manifest, 0, model_dir, num_stages=1, dtype=pick_dtype(dev), device=dev)
    mods.config._attn_implementation = attention
    stage = StageModel(config=mods.config, layers=mods.layers, first_layer=mods.layer_indices[0],
                       rotary_emb=mods.rotary_emb, embed=mods.embed, norm=mods.norm, head=mods.lm_head)
    prepare_stage(stage, packed=packed, batch_cap=batch_cap)
    tokenizer = load_tokenizer(model_dir)
    return LoadedStage(manifest, stage, tokenizer, stop_ids_for(manifest, tokenizer), dev)
