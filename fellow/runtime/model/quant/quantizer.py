"""A stage quantized layer by layer as it loads (StageQuantizer), and the modules it swaps in for nn.Linear."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from core.quantization import INT8, LORA_MODES, NONE
from fellow.runtime.model.fused import FusedLayer, bias_of, fusable, strip_linears
from fellow.runtime.model.load.lora_merge import LORA_BIAS, lora_scale
from fellow.runtime.model.quant.linear import HEAD_METHOD, QuantLinear
from fellow.runtime.model.quant.lora import LEAN16_DTYPE, LEAN_CANNOT, PEFT_UNFUSED, LeanLoRA, lora_pairs, peft_lora


class QuantModule(nn.Module):
    """A QuantLinear where an ``nn.Linear`` was, for layers that run through their HF forward."""

    def __init__(self, linear: QuantLinear) -> None:
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.linear.kernel}"


class QuantEmbedding(nn.Module):
    """An embedding table held as an int8 QuantLinear's rows (one scale a row), each looked-up row scaled
    back to ``dtype``. Over a tied head it is the head's own int8 weight: one table for both. torch's int8
    rows keep their scale; bitsandbytes' keep their absmax, so a row's scale is that over 127."""

    INT8_ROWS = ("int8", "bnb-int8")

    def __init__(self, linear: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if linear.kernel not in self.INT8_ROWS or linear.bias is not None:
            raise ValueError(f"an embedding table is held in int8 rows, not {linear.kernel}")
        self.linear = linear
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = linear.out_features, linear.in_features
        # torch's int8 rows: the linear's own scales; bitsandbytes': a vector of its own (stage_weights counts it)
        self.row_scales = linear.scales if linear.kernel == "int8" else linear.scales.float() / 127

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.linear.weight[ids].to(self.dtype)
        return rows.mul_(self.row_scales[ids].to(self.dtype).unsqueeze(-1))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows"


def quantize_children(module: nn.Module, method: str) -> int:
    """Swap every plain ``nn.Linear`` under ``module`` for its quantized QuantModule; returns how many."""
    swapped = 0
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, QuantModule(QuantLinear(child.weight.detach(), bias_of(child), method)))
            swapped += 1
        else:
            swapped += quantize_children(child, method)
    return swapped


class StageQuantizer:
    """Quantizes a stage's layers one by one as ``build_stage_modules`` materializes them.

    Llama-family layers become fused layers over quantized weights at once (fellow.runtime.model.fused);
    others keep their HF forward with each ``nn.Linear`` swapped for a QuantModule. ``make`` makes
    each quantized weight: ``chooser.linear`` (kernels.quant_chooser's, which times each shape for the status).
    """

    def __init__(self, method: str, config, device: torch.device, chooser, adapter_config: dict | None = None,
                 lora: str = "lean") -> None:
        if lora not in LORA_MODES:
            raise ValueError(f"LoRA adapters are served {' or '.join(LORA_MODES)}, not {lora!r}")
        if method == NONE:
            raise ValueError("StageQuantizer quantizes; a 'none' stage takes the float path")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"{method} weight-only kernels are served on a CPU or a CUDA card, not {device.type}")
        self.method = method
        self.config = config
        self.device = device
        self.chooser = chooser
        self.make = chooser.linear
        self.fused: dict[int, object] = {}  # absolute layer index -> FusedLayer
        self.swapped = 0  # nn.Linear swapped in layers that keep their HF forward
        self.why_not_fused: str | None = None
        self.adapter_config = adapter_config  # of the adapters kept unmerged, each module's scale (None: none)
        self.adapted = 0  # modules whose adapters stay apart
        self.lora = lora  # SWARM_SERVE_LORA: lean, lean16 (LEAN16_DTYPE adapters) or peft (PEFT's layers, HF forward)
        self.peft = lora == "peft" and adapter_config is not None  # no layer fuses: PEFT's layers are HF modules
        self.to_peft: dict[str, int] = {}  # LoRA kind lean does not compute -> modules served through PEFT instead

    def layer(self, index: int, layer: nn.Module, adapters: dict[str, torch.Tensor] | None = None) -> None:
        pairs = lora_pairs(adapters or {})
        if pairs and self.adapter_config is None:
            raise ValueError("LoRA adapters kept apart need their scale (the adapter config)")
        scales = {name: lora_scale(self.adapter_config, f"layers.{index}.{name}") for name in pairs}
        # a LoRA kind lean does not compute (PEFT's lora_bias): that module through PEFT's layer, in any mode
        biases = {name: adapters[name + LORA_BIAS] for name in pairs if name + LORA_BIAS in adapters}
        if any(pairs[name][2] is not None for name in biases):
            raise ValueError(f"DoRA with a LoRA bias on {', '.join(sorted(biases))} is not served unmerged")
        if biases and not self.peft:
            self.to_peft["lora_bias"] = self.to_peft.get("lora_bias", 0) + len(biases)
        why = PEFT_UNFUSED if self.peft else LEAN_CANNOT if biases else fusable([layer], self.config, self.device)
        dtype = LEAN16_DTYPE if self.lora == "lean16" else torch.float32
        if why is None:
            heads = self.config.num_attention_heads
            offsets = {name: _rows_before(layer, group, name) for group in FUSED_GROUPS.values() for name in group}
            fused = FusedLayer(layer, self.make, heads, self.config.num_key_value_heads)
            for attr, group in FUSED_GROUPS.items():
                names = [name for name in group if name in pairs]
                if names:
                    parts = [(offsets[name], *pairs.pop(name)) for name in names]
                    setattr(fused, attr, LeanLoRA(getattr(fused, attr), parts, [scales[n] for n in names], dtype))
                    self.adapted += len(parts)
            self.fused[index] = fused
            strip_linears(layer)
        else:
            self.why_not_fused = why
            self.swapped += quantize_children(layer, self.method)
            for name in list(pairs):
                module = layer.get_submodule(name)
                if (self.peft and pairs[name][2] is None) or name in biases:  # DoRA stays lean: PEFT's reads
                    parent, _, child = name.rpartition(".")                   # no quantized weight
                    a, b, _ = pairs.pop(name)
                    setattr(layer.get_submodule(parent), child,
                            peft_lora(module, a, b, scales[name], biases.get(name)))
                else:
                    module.linear = LeanLoRA(module.linear, [(0, *pairs.pop(name))], scales[name], dtype)
                self.adapted += 1
        if pairs:
            raise ValueError(f"LoRA adapters on {', '.join(sorted(pairs))} are not served unmerged")

    def fused_layers(self, indices: Sequence[int]):
        """The fused layers in order, or None when some layer kept its HF forward."""
        if self.why_not_fused is not None or any(i not in self.fused for i in indices):
            return None
        return [self.fused[i] for i in indices]

    def head(self, head: nn.Module) -> nn.Module:
        """The head, quantized with HEAD_METHOD (a tied head's copy: ``embed`` then shares it)."""
        if type(head) is not nn.Linear:
            return head
        return QuantModule(QuantLinear(head.weight.detach(), bias_of(head), HEAD_METHOD[self.method]))

    def embed(self, embed: nn.Module, head: nn.Module | None = None) -> nn.Module:
        """The embedding table in int8 rows (QuantEmbedding); ``head``: the quantized head of a tied model,
        whose int8 weight then serves both. Another kind of embedding module stays as it is."""
        if type(embed) is not nn.Embedding or embed.max_norm is not None:
            return embed
        linear = head.linear if isinstance(head, QuantModule) and head.linear.kernel in QuantEmbedding.INT8_ROWS else \
            QuantLinear(embed.weight.detach(), None, INT8)
        return QuantEmbedding(linear, embed.weight.dtype)


# the fused layer's weights and the HF modules each stacks, in output order
FUSED_GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
                "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def _rows_before(layer: nn.Module, group: Sequence[str], name: str) -> int:
    """The first output row of module ``name`` in its fused weight (the modules before it, stacked)."""
    return sum(layer.get_submodule(n).out_features for n in group[: group.index(name)])
