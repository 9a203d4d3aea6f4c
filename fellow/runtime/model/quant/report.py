"""What a stage's weights take: measured bytes and parameters for the load's status."""

from __future__ import annotations

import torch

from fellow.runtime.model.quant.linear import QuantLinear
from fellow.runtime.model.quant.lora import LeanLoRA
from fellow.runtime.model.quant.quantizer import QuantEmbedding, QuantModule


def weights_report(stage, method: str) -> dict:
    """What the load's status shows of a stage's weights: the method it really serves, the bytes it
    measures its weights take, and what the same parameters take in its compute dtype."""
    measured, parameters = stage_weights(stage)
    return {"quantization": method, "bytes": measured, "parameters": parameters,
            "float_bytes": parameters * torch.finfo(stage.dtype).bits // 8}


def stage_weights(stage) -> tuple[int, int]:
    """(bytes, parameters) of every weight the stage holds: its layers (fused or not), embeddings, norm
    and head. A quantized weight counts its packed bytes and scales, and its float weight's parameters;
    a tensor shared by two pieces (a tied head's embedding table) counts its bytes once and its parameters
    for each piece, as the float32 stage, which holds two copies, counts them."""
    seen: set[int] = set()
    totals = [0, 0]

    def add(t: torch.Tensor | None, parameters: int | None = None) -> None:
        if t is None or t.device.type == "meta":
            return
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a oneDNN-packed weight has no plain storage
            key = id(t)
        if key in seen:
            return
        seen.add(key)
        totals[0] += t.numel() * t.element_size()
        totals[1] += t.numel() if parameters is None else parameters

    def add_linear(linear) -> None:
        if isinstance(linear, LeanLoRA):
            add(linear.a, 0), add(linear.b, 0)  # held beside the base weights; not base parameters
            linear = linear.base
        if isinstance(linear, QuantLinear):
            add(linear.weight, linear.out_features * linear.in_features)
            add(linear.scale_tensor, 0)
        else:
            add(linear.weight, linear.out_features * linear.in_features)
        add(linear.bias)

    embed, head = stage.embed, stage.head
    if isinstance(embed, QuantEmbedding) and isinstance(head, QuantModule) and embed.linear is head.linear:
        totals[1] += head.linear.out_features * head.linear.in_features  # one table held for two: both counted
    for module in (*stage.layers, stage.embed, stage.norm, stage.head):
        if module is None:
            continue
        if isinstance(module, QuantEmbedding):
            add(module.row_scales, 0)
        for name, t in module.named_parameters():
            add(t, 0 if "lora_" in name else None)  # PEFT's adapter layers: held, not base parameters
        for t in module.buffers():
            add(t)
        for sub in module.modules():
            linear = getattr(sub, "linear", None)  # QuantModule, the fused head (_HeadLinear)
            if linear is not None and hasattr(linear, "in_features"):
                add_linear(linear)
    if stage.fused is not None:
        for layer in stage.fused.layers:
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                add_linear(linear)
            add(layer.input_norm[0]), add(layer.post_norm[0])
            if layer.qk_norm is not None:
                add(layer.qk_norm[0], 0)  # a row per head, expanded from the HF norms' weights
    return totals[0], totals[1]
