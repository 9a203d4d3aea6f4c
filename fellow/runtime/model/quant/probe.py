"""What this machine runs: each weight-only kernel checked on a small weight against float32 (probe)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from core.quantization import INT4_FAST, INT8, NF4
from events.fellow import CAP_CPU_INT4, CAP_CPU_INT8, CAP_INT4_FAST, CAP_QUANTIZED
from fellow.runtime.model.quant.linear import ACT, QuantLinear, one_line

log = logging.getLogger(__name__)


def _kernel_runs(method: str, device: torch.device) -> bool:
    """Whether ``method``'s kernel on ``device`` computes what it should: on a small weight at 1 and 3 rows,
    against float32 over its own dequantized weight (the input as the kernel reads it), and a row's result
    the same alone as beside others (exactly for torch's CPU kernels; to rounding for bitsandbytes', and
    on a card, whose kernels may differ by row count)."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 128, generator=generator) * 0.05).to(device)
    x = torch.randn(3, 128, generator=generator).to(device)
    linear = QuantLinear(weight, None, method)
    rows = x.to(ACT).float() if linear.kernel in ("int8", "int4", "int4-tinygemm") else \
        x.half().float() if linear.kernel == "bnb-int8" else x
    want = F.linear(rows, linear.dequantized())
    got = linear(x).float()
    alone = linear(x[:1]).float()
    exact = linear.kernel in ("int8", "int4")
    ok = torch.allclose(got, want, atol=0.05, rtol=0.02) and (
        torch.equal(alone, got[:1]) if exact
        else torch.allclose(alone, got[:1], atol=1e-2 if device.type == "cuda" else 1e-5))
    if linear.kernel == "bnb-nf4":  # the weight it dequantizes is the one it was given, within NF4's steps
        ok = ok and float((linear.dequantized() - weight).abs().max()) < 0.2 * float(weight.abs().max())
    return bool(ok)


PROBE_ERRORS = (ImportError, RuntimeError, ValueError, AttributeError, NotImplementedError, TypeError)


def probe() -> list[str]:
    """The weight-only capabilities whose kernels run here and compute what they should (_kernel_runs).

    A fellow without CUDA: torch's CPU int8 and int4 kernels (CAP_CPU_INT8, CAP_CPU_INT4), and NF4
    (CAP_QUANTIZED) where bitsandbytes' CPU NF4 and the int8 head's kernel run. A fellow with CUDA, whose
    quantized loads placement puts on its cards: CAP_QUANTIZED where bitsandbytes' NF4 and int8 run on
    every card, CAP_INT4_FAST where the int4 kernel does (every card Ampere or newer)."""
    caps: list[str] = []

    def runs(method: str, device: torch.device, cap: str) -> bool:
        try:
            if _kernel_runs(method, device):
                return True
            log.info("%s not declared: %s on %s differs from float32 over the same weight", cap, method, device)
        except PROBE_ERRORS as exc:
            log.info("%s not declared: %s on %s: %s", cap, method, device, one_line(exc))
        return False

    cpu = torch.device("cpu")
    for method, cap in ((INT8, CAP_CPU_INT8), (INT4_FAST, CAP_CPU_INT4)):
        if runs(method, cpu, cap):
            caps.append(cap)
    if not torch.cuda.is_available():
        if CAP_CPU_INT8 in caps and runs(NF4, cpu, CAP_QUANTIZED):  # its head is int8
            caps.append(CAP_QUANTIZED)
        return caps
    cards = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if all(runs(NF4, card, CAP_QUANTIZED) and runs(INT8, card, CAP_QUANTIZED) for card in cards):
        caps.append(CAP_QUANTIZED)
    if all(runs(INT4_FAST, card, CAP_INT4_FAST) for card in cards):
        caps.append(CAP_INT4_FAST)
    return caps
