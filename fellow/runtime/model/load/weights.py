"""Load one serving stage's weights from a servable and rebuild only that stage's HF modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from core.quantization import INT8, NONE, PRICE
from core.servable import BottleneckCompressor, Manifest, ServableError, load_manifest, resolve_base
from core.servable_plan import StagePlan, plan_stage
from fellow.runtime.model.bottleneck import RECV, SEND, BottleneckDecoder, BottleneckEncoder
from fellow.runtime.model.boundary import InnerBoundary
from fellow.runtime.model.fused import RECURRENT_KINDS
from fellow.runtime.model.load.checkpoint import Checkpoint
from fellow.runtime.model.load.device_split import DeviceSplit
from fellow.runtime.model.load.lora_merge import dora_factors, merge_lora

INNER = "inner."  # a trained cut inside the stage: inner.<first layer after it>.bottleneck.send.weight, ...


class _Tensors:
    """Named tensors read from their files only when taken, so a stage never holds all of them at once.

    ``where`` maps each name to (file, key in the file); a file not in safetensors (a legacy ``weights.pt``,
    a ``.bin``) loads whole when first read.
    """

    def __init__(self) -> None:
        self.where: dict[str, tuple[Path, str]] = {}
        self._whole: dict[Path, dict[str, torch.Tensor]] = {}

    def add_file(self, path: Path, rename) -> None:
        """Every key of ``path`` that ``rename(key)`` names (None: not wanted)."""
        if path.suffix != ".safetensors":  # weights.pt, pytorch_model.bin: loaded whole
            keys = list(self._load_whole(path))
        else:
            with safe_open(str(path), framework="pt") as fh:
                keys = list(fh.keys())
        for key in keys:
            if (name := rename(key)) is not None:
                self.where[name] = (path, key)

    def _load_whole(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._whole:
            self._whole[path] = torch.load(path, map_location="cpu", weights_only=True)
        return self._whole[path]

    def take(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The tensors whose names start with ``prefix``, read now and forgotten here."""
        names = [n for n in self.where if n.startswith(prefix)]
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.where[name][0], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, wanted in by_file.items():
            if path.suffix != ".safetensors":  # weights.pt, pytorch_model.bin: loaded whole
                out.update({n: self._load_whole(path)[self.where[n][1]] for n in wanted})
            else:
                with safe_open(str(path), framework="pt") as fh:
                    out.update({n: fh.get_tensor(self.where[n][1]) for n in wanted})
        for name in names:
            del self.where[name]
        return out


def _absolute(key: str, shard_range: tuple[int, int], plan: StagePlan) -> str | None:
    """The key under absolute layer numbering if this serving stage needs it, else None."""
    head, _, rest = key.partition(".")
    if head == "layers":
        rel, _, name = rest.partition(".")
        layer = shard_range[0] + int(rel)
        return f"layers.{layer}.{name}" if plan.layers[0] <= layer < plan.layers[1] else None
    if head == "embed_tokens":
        return key if plan.is_first else None
    if head in ("norm", "lm_head"):
        return key if plan.is_last else None
    if key.startswith(SEND):
        if shard_range[1] == plan.layers[1] and isinstance(plan.send, BottleneckCompressor):
            return key
        return _inner_key(key, SEND, shard_range[1], plan)
    if key.startswith(RECV):
        if shard_range[0] == plan.layers[0] and isinstance(plan.recv, BottleneckCompressor):
            return key
        return _inner_key(key, RECV, shard_range[0], plan)
    raise ServableError(f"shard tensor {key!r} is not part of the servable format")


def _inner_key(key: str, half: str, cut: int, plan: StagePlan) -> str | None:
    """A bottleneck half on a cut inside the stage, as ``inner.<layer>.<bottleneck half>``; None elsewhere."""
    if any(layer == cut and isinstance(codec, BottleneckCompressor) for layer, codec in plan.inner):
        return f"{INNER}{cut}.{key}"
    return None


def _stage_tensors(m: Manifest, servable_dir: Path, plan: StagePlan) -> _Tensors:
    exported = m.stage_ranges()
    tensors = _Tensors()
    for shard in plan.shards:
        for f in m.shards[shard].files:
            tensors.add_file(servable_dir / f.path, lambda key, r=exported[shard]: _absolute(key, r, plan))
    return tensors


def load_stage_state(servable_dir: str | Path, stage: int, num_stages: int | None = None) -> dict[str, torch.Tensor]:
    """Every tensor serving stage ``stage`` of ``num_stages`` reads from the shards, by absolute name.

    Layers are ``layers.<absolute index>.<name>``; the pieces are ``embed_tokens.weight``,
    ``norm.weight``, ``lm_head.weight``; codec halves ``bottleneck.send.*`` / ``bottleneck.recv.*``
    only where this stage's cut is a trained one. For export "adapters" these are the LoRA tensors.
    """
    m = load_manifest(servable_dir)
    return _stage_tensors(m, Path(servable_dir), plan_stage(m, stage, num_stages)).take()


class _StageState:
    """One stage's tensors, taken piece by piece (a layer, the embeddings, ...); over an adapters export
    each piece's base tensors are read from the base checkpoint and its adapters merged as it is taken."""

    def __init__(self, m: Manifest, servable_dir: Path, plan: StagePlan, model_cache) -> None:
        self.own = _stage_tensors(m, servable_dir, plan)
        self.base: _Tensors | None = None
        self.adapter_config = m.adapter_config or {}
        if m.export == "adapters":
            self.base = _base_tensors(m, plan, model_cache)

    def take(self, prefix: str) -> dict[str, torch.Tensor]:
        own = self.own.take(prefix)
        if self.base is None:
            return own
        return merge_lora(self.base.take(prefix), own, self.adapter_config)

    def take_unmerged(self, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the piece's weights, its LoRA tensors kept apart, named below ``prefix``): saved module copies
        still replace their base tensors; only the lora_A / lora_B pairs stay out of the weights."""
        own = self.own.take(prefix)
        if self.base is None:
            return own, {}
        lora = {k[len(prefix):]: v for k, v in own.items() if ".lora_" in k}
        rest = {k: v for k, v in own.items() if ".lora_" not in k}
        weights = merge_lora(self.base.take(prefix), rest, self.adapter_config)
        return weights, dora_factors(weights, lora, prefix, self.adapter_config)


def _base_tensors(m: Manifest, plan: StagePlan, model_cache) -> _Tensors:
    """The base checkpoint's tensors for this stage, by stage name, read when taken (adapters-only exports)."""
    base_dir = resolve_base(m.base, model_cache)
    if base_dir is None:
        raise ServableError(f"{m.model_id}: base checkpoint {m.base!r} is not on this machine")
    checkpoint = Checkpoint(base_dir)
    tensors = _Tensors()
    names = checkpoint.stage_names(*plan.layers, is_first=plan.is_first, is_last=plan.is_last)
    for key, name in names.items():
        path, full = checkpoint.locate(key)
        tensors.where[name] = (path, full)
    if plan.is_last and "lm_head.weight" not in tensors.where:  # tied: the head is a copy of the embeddings
        tensors.where["lm_head.weight"] = checkpoint.locate("model.embed_tokens.weight")
    return tensors


def hf_config(manifest: Manifest):
    from transformers import AutoConfig

    values = dict(manifest.config)
    return AutoConfig.for_model(values.pop("model_type"), **values)


@dataclass
class StageModules:
    """One serving stage's modules; a layer's ``self_attn.layer_idx`` is its absolute index."""

    plan: StagePlan
    config: object  # the HF PretrainedConfig of the whole model
    embed: nn.Module | None
    layers: list[nn.Module]
    layer_indices: list[int]
    norm: nn.Module | None
    lm_head: nn.Module | None
    rotary_emb: nn.Module
    encoder: BottleneckEncoder | None  # sender half of the boundary after this stage
    decoder: BottleneckDecoder | None  # receiver half of the boundary before this stage
    inner: dict[int, InnerBoundary] = field(default_factory=dict)  # trained cuts inside, by the layer after

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A whole-sequence pass without a KV cache: the reference the serving loop must match.

        Stage 0 takes ids [B, S]; a later stage what the previous one sent ([B, S, hidden] or
        [B, S, dim]). The last stage returns logits, another stage what it sends on.
        """
        h = self.embed(x) if self.embed is not None else self.decoder(x) if self.decoder is not None else x
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, position_ids)
        masks = _causal_masks(self.config, h, position_ids)
        for index, layer in zip(self.layer_indices, self.layers):
            if index in self.inner:
                h = self.inner[index](h)
            h = layer(h, attention_mask=masks[index], position_ids=position_ids,
                      position_embeddings=position_embeddings)
        if self.lm_head is not None:
            return self.lm_head(self.norm(h))
        return self.encoder(h) if self.encoder is not None else h


def _causal_masks(config, h: torch.Tensor, position_ids: torch.Tensor) -> dict[int, object]:
    """Each layer's mask for a cache-free causal pass, chosen as the HF model chooses it (none for a
    linear-attention layer: it takes a padding mask only, and this pass has no padding)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    args = dict(config=config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids)
    full = create_causal_mask(**args)
    sliding = create_sliding_window_causal_mask(**args) if getattr(config, "sliding_window", None) else full
    kinds = getattr(config, "layer_types", None)
    if kinds is None:  # Mistral: one window for every layer when it has one
        return {i: sliding for i in range(config.num_hidden_layers)}
    return {i: None if kind in RECURRENT_KINDS else sliding if kind == "sliding_attention" else full
            for i, kind in enumerate(kinds)}


def _materialize(module: nn.Module, state: dict[str, torch.Tensor], prefix: str, dtype, device) -> nn.Module:
    sub = {k[len(prefix):]: v.contiguous() for k, v in state.items() if k.startswith(prefix)}
    missing = set(module.state_dict()) - set(sub)
    if missing:
        raise ServableError(f"shards lack {prefix}{sorted(missing)[0]} (and {len(missing) - 1} more)")
    module.load_state_dict(sub, strict=True, assign=True)
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _skeleton(config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@dataclass(frozen=True)
class StageSizes:
    """What one serving stage's pieces take in a dtype, known before any weight is read (device_split)."""

    first_layer: int
    layer_bytes: list[int]
    embed_bytes: int  # 0 past stage 0
    head_bytes: int  # the final norm and the head; 0 before the last stage
    kv_token_bytes: int  # one layer's keys and values for one token


def stage_sizes(manifest: Manifest, stage_index: int, num_stages: int | None, dtype: torch.dtype,
                quantization: str = NONE) -> StageSizes:
    """The stage's sizes from its config's shapes on the meta device (config_sizes)."""
    plan = plan_stage(manifest, stage_index, num_stages)
    return config_sizes(hf_config(manifest), plan.layers, dtype, quantization, first=plan.is_first,
                        last=plan.is_last)


def config_sizes(config, layers: tuple[int, int], dtype: torch.dtype, quantization: str = NONE, *,
                 first: bool, last: bool) -> StageSizes:
    """What the layers [lo, hi) of a model of ``config`` take, with the embeddings where ``first`` and the
    norm and head where ``last``. Full precision in ``dtype``; quantized (core.quantization's method),
    each layer's linear weights at the spec's price a parameter (0.55 bytes at 4 bits, 1.05 at 8) and
    the rest in ``dtype``, the embeddings and head in int8 rows (quant.HEAD_METHOD)."""
    inner = (skeleton := _skeleton(config)).model
    element = torch.tensor([], dtype=dtype).element_size()

    def size(module: nn.Module, price: float | None = None) -> int:
        if price is None:
            return sum(p.numel() for p in module.parameters()) * element
        linear = sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
        return int(linear * price) + (sum(p.numel() for p in module.parameters()) - linear) * element

    price = PRICE.get(quantization)
    rows = None if price is None else PRICE[INT8]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return StageSizes(
        first_layer=layers[0], layer_bytes=[size(inner.layers[i], price) for i in range(*layers)],
        embed_bytes=size(inner.embed_tokens, rows) if first else 0,
        head_bytes=size(inner.norm) + size(skeleton.lm_head, rows) if last else 0,
        kv_token_bytes=2 * config.num_key_value_heads * head_dim * element)


def build_stage_modules(manifest: Manifest, stage_index: int, servable_dir: str | Path, *,
                        num_stages: int | None = None, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu", model_cache=None,
                        on_layer: Callable[[int, nn.Module, dict], None] | None = None,
                        keep_adapters: bool = False, split: DeviceSplit | None = None) -> StageModules:
    """Build the model skeleton on the meta device and materialize only this stage's pieces, layer by layer.

    ``on_layer(index, layer, adapters)`` runs on each layer as soon as it is built, before the next is
    read (a quantized load quantizes it there), so the stage's full-precision weights never exist all at
    once. ``keep_adapters``: an adapters export's LoRA pairs are not merged into the layers but handed
    to ``on_layer`` (``{"self_attn.q_proj.lora_A.weight": ...}``); otherwise ``adapters`` is empty.
    ``split``: each layer on its planned device (device_split), the embeddings and rotary tables with
    the first, the norm and head with the last; without one, everything on ``device``.
    """
    plan = plan_stage(manifest, stage_index, num_stages)
    state = _StageState(manifest, Path(servable_dir), plan, model_cache)
    config = hf_config(manifest)
    inner = (skeleton := _skeleton(config)).model
    indices = list(range(*plan.layers))
    if split is not None and len(split.layer_devices()) != len(indices):
        raise ValueError(f"a split of {len(split.layer_devices())} layers for a stage of {len(indices)}")
    layer_devices = split.layer_devices() if split is not None else [device] * len(indices)
    first = split.embed_device if split is not None else device
    last = split.head_device if split is not None else device
    layers = []
    if keep_adapters and on_layer is None:
        raise ValueError("adapters kept unmerged go to on_layer; pass one")
    for i, layer_device in zip(indices, layer_devices):  # one layer at a time: read, built, handed on, dropped
        prefix = f"layers.{i}."
        weights, adapters = state.take_unmerged(prefix) if keep_adapters else (state.take(prefix), {})
        layers.append(_materialize(inner.layers[i], weights, prefix, dtype, layer_device))
        if on_layer is not None:
            on_layer(i, layers[-1], adapters)
    rotary = type(inner.rotary_emb)(config=config).to(first)
    codec = {p: {k[len(p):]: v for k, v in state.take(p).items()} for p in (SEND, RECV)}

    def cast(t: torch.Tensor, where) -> torch.Tensor:
        return t.to(device=where, dtype=dtype or t.dtype)

    send, recv = codec[SEND], codec[RECV]  # the sender after the last layer, the receiver before the first
    cuts = {}
    for cut, compressor in plan.inner:  # on the device of the layer after the cut, where the hidden state is then
        halves = {p: {k.rpartition(".")[2]: v for k, v in state.take(f"{INNER}{cut}.{p}").items()}
                  for p in (SEND, RECV)}
        cuts[cut] = InnerBoundary.of(compressor, halves[SEND], halves[RECV], dtype,
                                      layer_devices[indices.index(cut)])
    return StageModules(
        plan=plan, config=config,
        embed=_materialize(inner.embed_tokens, state.take("embed_tokens."), "embed_tokens.", dtype, first)
        if plan.is_first else None,
        layers=layers, layer_indices=indices,
        norm=_materialize(inner.norm, state.take("norm."), "norm.", dtype, last) if plan.is_last else None,
        lm_head=_materialize(skeleton.lm_head, state.take("lm_head."), "lm_head.", dtype, last)
        if plan.is_last else None,
        rotary_emb=rotary,
        encoder=BottleneckEncoder(cast(send["weight"], layer_devices[-1]), cast(send["mean"], layer_devices[-1]))
        if send else None,
        decoder=BottleneckDecoder(cast(recv["weight"], layer_devices[0]), cast(recv["mean"], layer_devices[0]))
        if recv else None,
        inner=cuts,
    )
