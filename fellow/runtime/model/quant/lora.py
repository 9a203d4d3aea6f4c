"""LoRA adapters kept apart from a quantized stage's weights: lean (LeanLoRA, one addmm) or PEFT's own layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fellow.runtime.model.load.lora_merge import DORA_FACTOR

PEFT_UNFUSED = "SWARM_SERVE_LORA=peft: adapters through PEFT's LoRA layers, in the layers' HF forward"
LEAN_CANNOT = "LoRA with a bias of its own (PEFT's lora_bias), which lean does not compute: through PEFT's " \
    "LoRA layers, in the layers' HF forward"
LEAN16_DTYPE = torch.bfloat16  # lean16's adapters on a stage that computes in float32 (every CPU stage)


class LeanLoRA:
    """A linear with LoRA adapters kept apart (lean LoRA, the spec's TS7): ``base(x) + (x A^T) B^T`` with
    PEFT's scale folded into B, the add one ``addmm``, and no per-call Python beyond that. One weight of
    a fused layer ([q; k; v], [gate; up]) takes its modules' adapters side by side: their A's stacked,
    their B's block-diagonal, each in its module's rows of the output.

    ``dtype``: what A and B are held and multiplied in. float32 (``lean``): the product as PEFT computes
    it over a float32 stage. A half dtype (``lean16``): half the adapters' memory, the product rounded in
    half precision, then added to the base's float32 result.

    DoRA (a part with a row factor g): PEFT's ``g ⊙ (W x + s·B A x) + bias``, computed as
    ``g ⊙ out + (1 - g) ⊙ bias`` over the output (g is 1 in rows of modules without DoRA)."""

    __slots__ = ("base", "a", "b", "kernel", "in_features", "out_features", "rows_scale", "rows_shift")

    def __init__(self, base, parts: Sequence[tuple], scale: float | Sequence[float],
                 dtype: torch.dtype = torch.float32) -> None:
        """``parts``: (first output row, A [r, in], B [rows, r][, DoRA's row factor [rows] or None]) per
        adapted module of ``base``; ``scale``: PEFT's scale of each part's product (rank_pattern and
        alpha_pattern give modules their own), or one for all."""
        self.base = base
        self.kernel = f"{base.kernel}+lora" if dtype == torch.float32 else f"{base.kernel}+lora16"
        self.in_features, self.out_features = base.in_features, base.out_features
        device = _device_of(base)  # the adapters sit beside the base weight (on its card)
        self.a = torch.cat([a.detach().float() for _, a, *_ in parts]).to(device=device, dtype=dtype).contiguous()
        b_full = torch.zeros(self.out_features, self.a.shape[0], device=device)
        col, g = 0, None
        scales = [scale] * len(parts) if isinstance(scale, (int, float)) else list(scale)
        for (row, a, b, *dora), part_scale in zip(parts, scales, strict=True):
            b_full[row : row + b.shape[0], col : col + a.shape[0]] = b.detach().to(device).float() * part_scale
            col += a.shape[0]
            if dora and dora[0] is not None:
                g = torch.ones(self.out_features, device=device) if g is None else g
                g[row : row + b.shape[0]] = dora[0].to(device).float()
        self.b = b_full.to(dtype)
        bias = getattr(base, "bias", None)
        self.rows_scale = g
        self.rows_shift = None if g is None or bias is None else ((1 - g) * bias.float().to(device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows = x.reshape(-1, self.in_features)
        flat = out.view(-1, self.out_features)
        if self.a.dtype == flat.dtype:
            torch.addmm(flat, rows @ self.a.t(), self.b.t(), out=flat)
        else:  # lean16: the product in half precision, one cast in and one add out
            flat.add_((rows.to(self.a.dtype) @ self.a.t()) @ self.b.t())
        if self.rows_scale is not None:  # DoRA
            flat.mul_(self.rows_scale)
            if self.rows_shift is not None:
                flat.add_(self.rows_shift)
        return out

    @property
    def bytes(self) -> int:
        extra = (t for t in (self.a, self.b, self.rows_scale, self.rows_shift) if t is not None)
        return self.base.bytes + sum(t.numel() * t.element_size() for t in extra)


def peft_lora(base: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float,
              bias: torch.Tensor | None = None) -> nn.Module:
    """``SWARM_SERVE_LORA=peft``: PEFT's own LoRA layer over ``base`` (a QuantModule), holding this
    module's A [r, in] and B [out, r] at PEFT's scale (alpha = scale x r), in float32; ``bias``: B's own
    (PEFT's lora_bias), which any mode serves so."""
    import warnings

    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as PeftLinear

    rank = a.shape[0]
    with warnings.catch_warnings():  # PEFT warns of any base it does not know; a QuantModule is called alike
        warnings.filterwarnings("ignore", message="Unsupported layer type")
        warnings.filterwarnings("ignore", message=".*lora_bias=True.*has no bias")  # merging, not serving
        config = LoraConfig(r=rank, lora_alpha=scale * rank, lora_bias=bias is not None)
        layer = PeftLinear(base, "default", config, r=rank, lora_alpha=scale * rank)
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(a.detach().float())
        layer.lora_B["default"].weight.copy_(b.detach().float())
        if bias is not None:
            layer.lora_B["default"].bias.copy_(bias.detach().float())
    layer.lora_A.to(_device_of(base)), layer.lora_B.to(_device_of(base))
    return layer.eval().requires_grad_(False)


def _device_of(base) -> torch.device:
    """Where a linear's weight is (a QuantModule's, a QuantLinear's, a fused Linear's)."""
    base = getattr(base, "linear", base)
    weight = getattr(base, "weight", None)
    return weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")



def lora_pairs(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """module -> (A, B, DoRA's row factor or None) from ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``
    (and ``<module>.lora_dora_factor``, lora_merge.dora_factors)."""
    pairs = {}
    for key, a in adapters.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key and not key.endswith(DORA_FACTOR):
                raise ValueError(f"adapter tensor {key} is of a LoRA kind not served unmerged")
            continue
        module = key.split(".lora_A.")[0]
        b = adapters.get(f"{module}.lora_B.weight")
        if b is None:
            raise ValueError(f"LoRA weight {key} has no partner lora_B")
        pairs[module] = (a, b, adapters.get(module + DORA_FACTOR))
    return pairs
