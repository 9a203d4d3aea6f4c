"""Load a servable's stage for serving: modules, tokenizer, stop ids, on the fellow's device."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from core.quantization import INT4_FAST, INT8, NF4, NONE
from core.servable import TOKENIZER_DIR, Manifest, ServableError, load_manifest
from events.stage import StageOptions
from fellow.runtime.model.boundary import apply_inner
from fellow.runtime.model.forms.compiled import PlainWeights
from fellow.runtime.model.forms.plan_steps import compiles_in_background, plan_steps
from fellow.runtime.model.grouped_attention import GROUPED, choose_attention
from fellow.runtime.model.load.device_split import (
    Card,
    DeviceSplit,
    SplitError,
    by_free_memory,
    half_dtype,
    plan_devices,
)
from fellow.runtime.model.load.fourbit_rows import plan_4bit_rows
from fellow.runtime.model.load.half_storage import apply_half_storage
from fellow.runtime.model.load.kernels import prepare_stage, quant_chooser
from fellow.runtime.model.load.kv_budget import cpu_free_bytes, cuda_free_bytes
from fellow.runtime.model.load.weights import StageModules, build_stage_modules, hf_config, stage_sizes
from fellow.runtime.model.quant.linear import (
    QUANT_KERNELS,
    Int4Unavailable,
    bitsandbytes_functional,
    tinygemm_check_device,
)
from fellow.runtime.model.quant.quantizer import StageQuantizer
from fellow.runtime.model.quant.report import weights_report
from fellow.runtime.model.stage import StageModel

log = logging.getLogger(__name__)

AUTO = "auto"
KV_RESERVE_TOKENS = 4096  # the KV tokens each layer keeps room for in a split, when placement planned none
# devices a stage is split over: "auto" (every GPU torch sees, in order, then the CPU), or a list of
# (device, bytes it may take) in order, the CPU last where it offloads
Devices = str | Sequence[str] | Sequence[tuple[str, int]]
OPTIONS = StageOptions()  # a stage's options where its caller gives none (a test, a benchmark)


@dataclass
class LoadedStage:
    manifest: Manifest
    stage: StageModel
    tokenizer: object
    stop_ids: frozenset[int]
    device: torch.device


def pick_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU; on a card its half precision by its capability (device_split.half_dtype): torch's
    is_bf16_supported() also says yes where bfloat16 is only emulated (a GTX 10xx)."""
    if device.type == "cuda":
        return getattr(torch, half_dtype(torch.cuda.get_device_capability(device)))
    return torch.float32


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir / TOKENIZER_DIR))


def stop_ids_for(manifest: Manifest, tokenizer) -> frozenset[int]:
    ids = set(manifest.generation.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def device_inventory(devices: Devices = AUTO) -> list[Card]:
    """The devices a stage may split over, measured here: ``auto`` is every GPU torch sees, the most free
    memory first, then the CPU (device_split.by_free_memory); a comma list or list of names measures
    each, in its order; a list of (device, bytes) pairs is taken as what each may take (a test's
    made-up sizes)."""
    if isinstance(devices, str):
        if devices == AUTO:
            names = [f"cuda:{i}" for i in range(torch.cuda.device_count())] + ["cpu"]
            return by_free_memory([_measured(name) for name in names])
        devices = [d.strip() for d in devices.split(",") if d.strip()]
    return [_measured(entry) if isinstance(entry, str) else Card(str(entry[0]), int(entry[1]), take=int(entry[1]))
            for entry in devices]


def _measured(name: str) -> Card:
    device = torch.device(name)
    if device.type != "cuda":
        return Card(name, cpu_free_bytes())
    if (device.index or 0) >= torch.cuda.device_count():
        raise ServableError(f"{name} is not a GPU this fellow has ({torch.cuda.device_count()} found)")
    return Card(name, cuda_free_bytes(device), torch.cuda.get_device_capability(device),
                torch.cuda.get_device_name(device))


def split_stage(manifest: Manifest, stage_index: int, num_stages: int, devices: Devices = AUTO,
                kv_tokens: int = KV_RESERVE_TOKENS, dtype: torch.dtype | None = None,
                quantization: str = NONE) -> tuple[DeviceSplit, torch.dtype]:
    """The stage's layers over ``devices`` by free memory (device_split.plan_devices, its layers sized
    quantized where ``quantization`` asks), and the one dtype every part keeps: the first listed device's
    (bfloat16 or float16 with a GPU first), so offloaded layers compute in half precision too; float32
    where no GPU takes a layer and the stage fits so; ``dtype`` where given. ServableError when it fits
    nowhere."""
    inventory = device_inventory(devices)
    if not inventory:
        raise ServableError("no device to load the stage on")

    def plan(dtype: torch.dtype) -> DeviceSplit:
        sizes = stage_sizes(manifest, stage_index, num_stages, dtype, quantization)
        try:
            return plan_devices(inventory, sizes.layer_bytes, first_layer=sizes.first_layer,
                                embed_bytes=sizes.embed_bytes, head_bytes=sizes.head_bytes,
                                kv_token_bytes=sizes.kv_token_bytes, kv_tokens=kv_tokens)
        except SplitError as exc:
            raise ServableError(str(exc)) from None

    if dtype is not None:
        return plan(dtype), dtype
    dtype = pick_dtype(torch.device(inventory[0].name))
    split = plan(dtype)
    own = pick_dtype(torch.device(split.devices[0]))
    if own != dtype:  # no GPU took a layer: a CPU stage computes in its own dtype (float32) where that fits
        try:
            return plan(own), own
        except ServableError:
            pass
    return split, dtype


def build_stage(manifest: Manifest, stage_index: int, model_dir: Path, num_stages: int,
                device: torch.device | None, options: StageOptions = OPTIONS, *, devices: Devices | None = None,
                kv_tokens: int | None = None, dtype: torch.dtype | None = None) -> tuple[StageModules, StageModel]:
    """One serving stage's modules and its StageModel, ready to serve (kernels.prepare_stage), as ``options``
    (events.stage.StageOptions) say: its fields are the names below.

    ``device``: every piece there; None: the layers split over ``devices`` by free memory, keeping room
    for ``kv_tokens`` tokens (split_stage); the split is logged and shown in the stage's ``kernels``.
    ``dtype``: what the weights are stored and computed in (default: pick_dtype's for the first device);
    a split stage in half precision computes each matmul in float32 on the devices where that measures
    faster (half_storage).
    ``quantization`` (core.quantization's method): with int8 or int4-fast each layer is quantized as
    it loads (fellow.runtime.model.quant.quantizer); the stage's ``weights`` says what it serves and measures.
    An adapters export's LoRA pairs are merged into a full-precision stage, and kept apart over a
    quantized one, so a QLoRA run serves as it trained, without a second rounding: ``lora`` (the fellow's
    SWARM_SERVE_LORA) says how (LORA_MODES: lean or lean16 quant.lora.LeanLoRA, or PEFT's own layers).
    ``compile`` (SWARM_SERVE_COMPILE): decode batch sizes whose step is compiled where that serves and
    measures faster (fellow.runtime.model.forms.compiled); ``kernels.compiled`` says what it found.
    ``cuda_graphs`` (SWARM_SERVE_CUDA_GRAPHS): a whole-model stage on one CUDA device decodes from a pool
    of ``batch_cap`` sessions by replaying captured graphs, where they check and measure faster
    (fellow.runtime.model.forms.cuda_graphs); ``kernels.cuda_graphs`` says what it found.
    ``fourbit_rows`` / ``fourbit_float32`` (SWARM_SERVE_4BIT_ROWS / SWARM_SERVE_4BIT_FLOAT32): a 4-bit stage
    splits its matmuls of a few rows, and computes row counts in float32, where that measures faster at
    load, timing float32 at a prompt piece's width (``prefill_chunk``) too (fellow.runtime.model.load.fourbit_rows);
    ``kernels.fourbit_rows`` says what it found.
    """
    packed, batch_cap, quantization, lora = options.packed_linear, options.batch_cap, options.quantization, options.lora
    compile, prefill_chunk = options.compile, options.prefill_chunk
    fourbit_rows, fourbit_float32 = options.fourbit_rows, options.fourbit_float32
    devices = options.devices if devices is None else devices  # or a test's (device, bytes) pairs
    kv_tokens = (options.kv_tokens or KV_RESERVE_TOKENS) if kv_tokens is None else kv_tokens
    split = None
    if device is None:  # a quantized stage is planned at its quantized sizes
        split, dtype = split_stage(manifest, stage_index, num_stages, devices, kv_tokens, dtype, quantization)
        device = torch.device(split.devices[0])
        if len(split.parts) == 1:
            split = None  # one device: today's load, every piece there
    asked, reason = quantization, None
    try:
        quantizer, mods = _load_layers(manifest, stage_index, model_dir, num_stages, device, dtype, split,
                                       quantization, batch_cap, lora)
    except Int4Unavailable as exc:  # the spec's fallback: bitsandbytes NF4 rather than failing
        reason = f"int4-fast cannot run here ({exc}); reloaded as nf4"
        log.warning("stage %d: %s", stage_index, reason)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the first attempt's layers are gone
        quantization = NF4
        quantizer, mods = _load_layers(manifest, stage_index, model_dir, num_stages, device, dtype, split,
                                       quantization, batch_cap, lora)
    attention = choose_attention(options.attention, dtype or pick_dtype(device), device)
    mods.config._attn_implementation = attention
    stage = StageModel(config=mods.config, layers=mods.layers, first_layer=mods.layer_indices[0],
                       rotary_emb=mods.rotary_emb, embed=mods.embed, norm=mods.norm, head=mods.lm_head)
    # the plain weights a compiled step is built from: at load where asked, or (auto) in the background once
    # a whole float32 CPU stage serves (fellow.runtime.model.forms.background_compile); an int8 or int4 stage's
    # graph calls its quantized weights as they are, so it keeps nothing more
    background = compiles_in_background(options, num_stages, device, quantization)
    prepare_stage(stage, packed=packed, batch_cap=batch_cap, quantizer=quantizer,
                  keep_plain=bool(compile) or background)
    if quantizer is not None and (background or compile):
        stage.plain_weights = PlainWeights(None)
    apply_inner(stage, mods.inner)  # cuts training made inside the stage, where they were trained
    # the HF layers' attention (SWARM_SERVE_ATTENTION); fused layers attend grouped on their own
    stage.note(attention="fused" if stage.fused is not None else "grouped" if attention == GROUPED else attention)
    if quantizer is not None and (rows := plan_4bit_rows(stage, fourbit_rows, fourbit_float32,
                                                         prefill_chunk=prefill_chunk,
                                                         label=f"stage{stage_index}")) is not None:
        stage.note(fourbit_rows=rows)  # None: no 4-bit weight, or both off
    plan_steps(stage, options, background)  # its decode forms: the one chooser
    if split is not None:
        stage.note(devices=split.as_dicts())
        log.info("layers split over %d devices: %s", len(split.parts), split.describe())
        if half := apply_half_storage(stage):  # half-precision layers that compute faster upcast
            stage.note(half_storage=half)
    stage.weights = weights_report(stage, quantization)
    if reason is not None:
        stage.weights.update(requested=asked, reason=reason)
    log.info("weights: %s, %.1f MB measured (%.1f MB at %s)", quantization, stage.weights["bytes"] / 1e6,
             stage.weights["float_bytes"] / 1e6, str(stage.dtype).removeprefix("torch."))
    return mods, stage


def _load_layers(manifest: Manifest, stage_index: int, model_dir: Path, num_stages: int, device: torch.device,
                 dtype: torch.dtype | None, split: DeviceSplit | None, quantization: str, batch_cap: int,
                 lora: str) -> tuple[StageQuantizer | None, StageModules]:
    """The stage's layers read and built one by one, each quantized as it is built where ``quantization``
    asks (StageQuantizer); Int4Unavailable where the int4 kernel cannot run on ``device``."""
    quantizer = None
    if quantization != NONE:
        if quantization not in QUANT_KERNELS:
            raise ServableError(f"{quantization} weights are not served by this fellow's stages "
                                f"(served: {', '.join(QUANT_KERNELS)})")
        if quantization == INT4_FAST and device.type == "cuda":
            tinygemm_check_device(device)  # before any layer is read
        if quantization == NF4 or (quantization == INT8 and device.type == "cuda"):
            try:
                bitsandbytes_functional()
            except ImportError as exc:
                raise ServableError(f"{quantization} weights on {device.type} need bitsandbytes, which this "
                                    f"fellow lacks ({exc})") from None
        adapter_config = (manifest.adapter_config or {}) if manifest.export == "adapters" else None
        quantizer = StageQuantizer(quantization, hf_config(manifest), device,
                                   quant_chooser(quantization, batch_cap, device), adapter_config, lora=lora)
    mods = build_stage_modules(manifest, stage_index, model_dir, num_stages=num_stages,
                               dtype=dtype or pick_dtype(device), device=device, split=split,
                               on_layer=quantizer.layer if quantizer else None,
                               keep_adapters=quantizer is not None and manifest.export == "adapters")
    return quantizer, mods


def load_one_stage(model_dir: str | Path, device: str | None = None, options: StageOptions = OPTIONS, *,
                   devices: Devices | None = None, kv_tokens: int | None = None,
                   dtype: torch.dtype | None = None) -> LoadedStage:
    """The whole model as one stage (embeddings, every layer, norm and head): a ring of one.

    ``device``: all of it there; None: split over the options' devices (``build_stage``, which reads
    ``options``, ``devices``, ``kv_tokens`` and ``dtype``).
    """
    model_dir = Path(model_dir)
    manifest = load_manifest(model_dir)
    dev = torch.device(device) if device else None
    _, stage = build_stage(manifest, 0, model_dir, 1, dev, options, devices=devices, kv_tokens=kv_tokens, dtype=dtype)
    tokenizer = load_tokenizer(model_dir)
    return LoadedStage(manifest, stage, tokenizer, stop_ids_for(manifest, tokenizer), stage_device(stage))


def stage_device(stage: StageModel) -> torch.device:
    """The device a stage is reported by (its memory, a draft model beside it): its first layer's."""
    return stage.layer_devices[0]
