"""Load a servable's stage for serving: modules, tokenizer, stop ids, on the fellow's device."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from core.quantization import NONE
from core.servable import TOKENIZER_DIR, Manifest, ServableError, load_manifest
from fellow.runtime.model.kernels import prepare_stage, quant_chooser
from fellow.runtime.model.lora_merge import lora_scale
from fellow.runtime.model.quant import QUANT_KERNELS, StageQuantizer, weights_report
from fellow.runtime.model.stage import StageModel
from fellow.runtime.model.weights import StageModules, build_stage_modules, hf_config

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


def build_stage(manifest: Manifest, stage_index: int, model_dir: Path, num_stages: int, device: torch.device,
                attention: str = "sdpa", packed: bool = True, batch_cap: int = 8,
                quantization: str = NONE) -> tuple[StageModules, StageModel]:
    """One serving stage's modules and its StageModel, ready to serve (kernels.prepare_stage).

    ``quantization`` (core.quantization's method): with int8 or int4-fast each layer is quantized as
    it loads (fellow.runtime.model.quant); the stage's ``weights`` says what it serves and measures.
    An adapters export's LoRA pairs are merged into a full-precision stage, and kept apart over a
    quantized one (quant.LeanLoRA), so a QLoRA run serves as it trained, without a second rounding.
    """
    quantizer = None
    if quantization != NONE:
        if quantization not in QUANT_KERNELS:
            raise ServableError(f"{quantization} weights are not served by this fellow's stages "
                                f"(served: {', '.join(QUANT_KERNELS)} on the CPU)")
        scale = lora_scale(manifest.adapter_config or {}) if manifest.export == "adapters" else None
        quantizer = StageQuantizer(quantization, hf_config(manifest), device, quant_chooser(quantization, batch_cap),
                                   lora_scale=scale)
    mods = build_stage_modules(manifest, stage_index, model_dir, num_stages=num_stages, dtype=pick_dtype(device),
                               device=device, on_layer=quantizer.layer if quantizer else None,
                               keep_adapters=quantizer is not None and manifest.export == "adapters")
    mods.config._attn_implementation = attention
    stage = StageModel(config=mods.config, layers=mods.layers, first_layer=mods.layer_indices[0],
                       rotary_emb=mods.rotary_emb, embed=mods.embed, norm=mods.norm, head=mods.lm_head)
    prepare_stage(stage, packed=packed, batch_cap=batch_cap, quantizer=quantizer)
    stage.weights = weights_report(stage, quantization)
    log.info("weights: %s, %.1f MB measured (%.1f MB at %s)", quantization, stage.weights["bytes"] / 1e6,
             stage.weights["float_bytes"] / 1e6, str(stage.dtype).removeprefix("torch."))
    return mods, stage


def load_one_stage(model_dir: str | Path, device: str | None = None, attention: str = "sdpa",
                   packed: bool = True, batch_cap: int = 8, quantization: str = NONE) -> LoadedStage:
    """The whole model as one stage (embeddings, every layer, norm and head): a ring of one.

    ``packed``: float32 CPU stages may hold weights packed for oneDNN; ``batch_cap``: the most sessions
    a decode step runs, which the kernel choice times (fellow.runtime.model.kernels.prepare_stage);
    ``quantization``: see ``build_stage``.
    """
    model_dir = Path(model_dir)
    manifest = load_manifest(model_dir)
    dev = pick_device(device)
    _, stage = build_stage(manifest, 0, model_dir, 1, dev, attention, packed, batch_cap, quantization)
    tokenizer = load_tokenizer(model_dir)
    return LoadedStage(manifest, stage, tokenizer, stop_ids_for(manifest, tokenizer), dev)
