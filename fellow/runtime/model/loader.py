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
from fellow.runtime.model.device_split import DeviceSplit, SplitError, plan_split
from fellow.runtime.model.half_storage import apply_half_storage
from fellow.runtime.model.compiled import compile_decode
from fellow.runtime.model.cuda_graphs import graph_decode
from fellow.runtime.model.fourbit_rows import plan_4bit_rows
from fellow.runtime.model.kernels import prepare_stage, quant_chooser
from fellow.runtime.model.kv_budget import CUDA_KEEP_BYTES, CUDA_USABLE, cpu_free_bytes, cuda_free_bytes
from fellow.runtime.model.lora_merge import lora_scale
from fellow.runtime.model.quant import (QUANT_KERNELS, Int4Unavailable, StageQuantizer, bitsandbytes_functional,
                                        tinygemm_check_device, weights_report)
from fellow.runtime.model.stage import StageModel
from fellow.runtime.model.weights import StageModules, build_stage_modules, hf_config, stage_sizes

log = logging.getLogger(__name__)

AUTO = "auto"
KV_RESERVE_TOKENS = 4096  # the KV tokens each layer keeps room for in a split, when placement planned none
CPU_WEIGHTS_USABLE = 0.8  # of the host's available memory, for offloaded layers (the rest: the process, KV)
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


def device_budgets(devices: Devices = AUTO) -> list[tuple[str, int]]:
    """(device, bytes it may take) in order: ``auto`` is every GPU torch sees, then the CPU; a comma list
    or list of names measures each; a list of pairs is taken as it is (a test's made-up sizes).
    A GPU may take 85 % of what is free less 300 MiB (kv_budget's margins), the CPU 80 % of the host's
    available memory."""
    if isinstance(devices, str):
        devices = ([f"cuda:{i}" for i in range(torch.cuda.device_count())] + ["cpu"] if devices == AUTO
                   else [d.strip() for d in devices.split(",") if d.strip()])
    out = []
    for entry in devices:
        if not isinstance(entry, str):
            out.append((str(entry[0]), int(entry[1])))
            continue
        device = torch.device(entry)
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ServableError(f"{entry} is not a GPU this fellow has ({torch.cuda.device_count()} found)")
        if device.type == "cuda":
            out.append((entry, max(0, int(CUDA_USABLE * cuda_free_bytes(device)) - CUDA_KEEP_BYTES)))
        else:
            out.append((entry, int(CPU_WEIGHTS_USABLE * cpu_free_bytes())))
    return out


def split_stage(manifest: Manifest, stage_index: int, num_stages: int, devices: Devices = AUTO,
                kv_tokens: int = KV_RESERVE_TOKENS,
                dtype: torch.dtype | None = None) -> tuple[DeviceSplit, torch.dtype]:
    """The stage's layers over ``devices`` by free memory (device_split), and the one dtype every part
    keeps: the first listed device's (bfloat16 or float16 with a GPU first), so offloaded layers compute
    in half precision too; float32 where no GPU takes a layer and the stage fits so; ``dtype`` where
    given. ServableError when it fits nowhere."""
    budgets = device_budgets(devices)
    if not budgets:
        raise ServableError("no device to load the stage on")

    def plan(dtype: torch.dtype) -> DeviceSplit:
        sizes = stage_sizes(manifest, stage_index, num_stages, dtype)
        try:
            return plan_split(sizes.layer_bytes, budgets, first_layer=sizes.first_layer,
                              embed_bytes=sizes.embed_bytes, head_bytes=sizes.head_bytes,
                              kv_token_bytes=sizes.kv_token_bytes, kv_tokens=kv_tokens)
        except SplitError as exc:
            raise ServableError(str(exc)) from None

    if dtype is not None:
        return plan(dtype), dtype
    dtype = pick_dtype(torch.device(budgets[0][0]))
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
    it loads (fellow.runtime.model.quant); the stage's ``weights`` says what it serves and measures.
    An adapters export's LoRA pairs are merged into a full-precision stage, and kept apart over a
    quantized one, so a QLoRA run serves as it trained, without a second rounding: ``lora`` (the fellow's
    SWARM_SERVE_LORA) says how (quant.LORA_MODES: lean or lean16 quant.LeanLoRA, or PEFT's own layers).
    ``compile`` (SWARM_SERVE_COMPILE): decode batch sizes whose step is compiled where that serves and
    measures faster (fellow.runtime.model.compiled); ``kernels["compiled"]`` says what it found.
    ``cuda_graphs`` (SWARM_SERVE_CUDA_GRAPHS): a whole-model stage on one CUDA device decodes from a pool
    of ``batch_cap`` sessions by replaying captured graphs, where they check and measure faster
    (fellow.runtime.model.cuda_graphs); ``kernels["cuda_graphs"]`` says what it found.
    ``fourbit_rows`` / ``fourbit_float32`` (SWARM_SERVE_4BIT_ROWS / SWARM_SERVE_4BIT_FLOAT32): a 4-bit stage
    splits its matmuls of a few rows, and computes row counts in float32, where that measures faster at
    load, timing float32 at a prompt piece's width (``prefill_chunk``) too (fellow.runtime.model.fourbit_rows);
    ``kernels["4bit_rows"]`` says what it found.
    """
    packed, batch_cap, quantization, lora = options.packed_linear, options.batch_cap, options.quantization, options.lora
    compile, cuda_graphs, prefill_chunk = options.compile, options.cuda_graphs, options.prefill_chunk
    fourbit_rows, fourbit_float32, attention = options.fourbit_rows, options.fourbit_float32, "sdpa"
    devices = options.devices if devices is None else devices  # or a test's (device, bytes) pairs
    kv_tokens = (options.kv_tokens or KV_RESERVE_TOKENS) if kv_tokens is None else kv_tokens
    split = None
    if device is None and quantization != NONE:  # not split (its sizes are not the float ones): the first device
        device = torch.device(device_budgets(devices)[0][0])
    elif device is None:
        split, dtype = split_stage(manifest, stage_index, num_stages, devices, kv_tokens, dtype)
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
    mods.config._attn_implementation = attention
    stage = StageModel(config=mods.config, layers=mods.layers, first_layer=mods.layer_indices[0],
                       rotary_emb=mods.rotary_emb, embed=mods.embed, norm=mods.norm, head=mods.lm_head)
    prepare_stage(stage, packed=packed, batch_cap=batch_cap, quantizer=quantizer, keep_plain=bool(compile))
    if quantizer is not None and (rows := plan_4bit_rows(stage, fourbit_rows, fourbit_float32,
                                                         prefill_chunk=prefill_chunk,
                                                         label=f"stage{stage_index}")) is not None:
        stage.kernels = {**stage.kernels, "4bit_rows": rows}  # None: no 4-bit weight, or both off
    if compile:
        stage.kernels = {**stage.kernels, "compiled": compile_decode(stage, compile, stage.plain_weights)}
    stage.plain_weights = None  # the compiled step holds what it needs
    if cuda_graphs and (graphs := graph_decode(stage, slots=batch_cap)) is not None:  # None off CUDA
        stage.kernels = {**stage.kernels, "cuda_graphs": graphs}
    if split is not None:
        stage.kernels = {**stage.kernels, "devices": split.as_dicts()}
        log.info("layers split over %d devices: %s", len(split.parts), split.describe())
        if half := apply_half_storage(stage):  # half-precision layers that compute faster upcast
            stage.kernels["half_storage"] = half
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
        scale = lora_scale(manifest.adapter_config or {}) if manifest.export == "adapters" else None
        quantizer = StageQuantizer(quantization, hf_config(manifest), device,
                                   quant_chooser(quantization, batch_cap, device), lora_scale=scale, lora=lora)
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
