"""Half storage: a split stage's layers keep their float16 / bfloat16 weights, and each matmul computes
in float32 on the devices where that measures clearly faster (the spec's half_storage).

A stage split over a GPU and the CPU keeps the GPU's half precision everywhere (model/load/loader.split_stage),
and a CPU without half-precision matmul units can take several times longer in it than in float32.
Per device, one row goes through the largest weight of its first layer (an MLP's) in half precision and
upcast (input and weight cast to float32, the result back); where the upcast takes at most 70 % of the
time, that device's layers compute their linear layers so. Weights, norms, attention and the KV cache
stay as they were: no extra memory beyond one weight in float32 while a matmul runs.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

HALF = (torch.float16, torch.bfloat16)
UPCAST_GAIN = 0.3  # the upcast must save this share of the half-precision time
SAMPLES = 7  # timed calls each; the fastest counts


class UpcastLinear(nn.Module):
    """A linear layer over half-precision weights that computes in float32 and returns its input's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def _ms(call, device: torch.device) -> float:
    call()
    best = float("inf")
    for _ in range(SAMPLES):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


@torch.inference_mode()
def matmul_ms(weight: torch.Tensor) -> tuple[float, float]:
    """(half-precision ms, upcast ms) of one row through ``weight`` on its device."""
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    return (_ms(lambda: F.linear(x, weight), weight.device),
            _ms(lambda: F.linear(x.float(), weight.float()).to(x.dtype), weight.device))


def _linears(layer: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in layer.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear]


def apply_half_storage(stage, force: bool | None = None) -> dict:
    """Time each device's matmul and upcast the linear layers of the devices where that pays; ``force``:
    upcast (True) or not (False) without the verdict of the times. Returns, per device, the two times
    and whether it upcasts, for the load's status; empty where the stage is not half precision or runs
    fused layers (their kernels are chosen in kernels.prepare_stage)."""
    if stage.dtype not in HALF or stage.fused is not None:
        return {}
    report = {}
    for device in dict.fromkeys(stage.layer_devices):
        layers = [layer for layer, d in zip(stage.layers, stage.layer_devices) if d == device]
        found = _linears(layers[0])
        if not found:
            continue
        weight = max((linear.weight for _, _, linear in found), key=lambda w: w.numel())
        half_ms, upcast_ms = matmul_ms(weight.detach())
        upcast = upcast_ms <= (1 - UPCAST_GAIN) * half_ms if force is None else force
        if upcast:
            for layer in layers:
                for parent, name, linear in _linears(layer):
                    setattr(parent, name, UpcastLinear(linear))
        report[str(device)] = {"half_ms": round(half_ms, 4), "upcast_ms": round(upcast_ms, 4), "upcast": upcast}
        log.info("half storage on %s: one row through %dx%d in %s %.3f ms, upcast to float32 %.3f ms: %s",
                 device, *weight.shape, str(stage.dtype).removeprefix("torch."), half_ms, upcast_ms,
                 "computes in float32" if upcast else f"stays in {str(stage.dtype).removeprefix('torch.')}")
    return report
