"""Linear layers with their weights packed once for oneDNN, on stages that compute in float32 on a CPU.

torch's default CPU matmul (MKL here) multiplies a few rows by a weight it reads in the weight's own
layout every call. oneDNN takes the weight re-laid out once ("packed") for its kernels instead.
Measured on the 2-core EPYC this project is built on (bench/bench_engine.py's 45M Qwen3, fp32): the
32,000 x 512 head took 4.0 ms for one row with MKL and 1.0 ms packed; a 512 -> 1,792 projection
157 us against 53 us for 8 rows; a whole decode step 12.3 -> 6.0 ms alone and 20 -> 8 ms for 8
sessions. Results agree with F.linear to float32 rounding (a few 1e-6), not bit for bit.

The packed weight replaces the module's own: a stage holds each weight once, except a head tied to
the embeddings, which keeps the embedding table and adds its packed copy.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

PACK_ROWS = 16  # the row count oneDNN lays the weight out for; 8 to 256 rows all ran at the same speed


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing serves float32 on a CPU, where torch was built with it."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a weight packed for oneDNN; the same inputs and outputs."""

    def __init__(self, linear: nn.Linear, rows: int = PACK_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, rows), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _pack_children(module: nn.Module, rows: int) -> int:
    packed = 0
    for name, child in module.named_children():
        if type(child) is nn.Linear:  # subclasses (quantized, LoRA) keep their own forward
            setattr(module, name, PackedLinear(child, rows))
            packed += 1
        else:
            packed += _pack_children(child, rows)
    return packed


def pack_stage(stage, rows: int = PACK_ROWS) -> int:
    """Pack every plain linear layer of ``stage`` (a StageModel) that computes in float32 on a CPU.

    Returns how many were packed; 0 where oneDNN does not serve the stage's device and dtype.
    """
    packed = 0
    for layer, device in zip(stage.layers, stage.layer_devices):
        if can_pack(device, stage.dtype):
            packed += _pack_children(layer, rows)
    head = stage.head
    if type(head) is nn.Linear and can_pack(head.weight.device, head.weight.dtype):
        stage.head = PackedLinear(head, rows)
        packed += 1
    if packed:
        log.info("packed %d linear layers for oneDNN (float32 on the CPU)", packed)
    return packed
