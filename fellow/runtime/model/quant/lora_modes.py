"""A quantized stage's unmerged adapters switched, for a while, to another way of serving them: the spec's
``[stageN lora-cost]`` times one step each way (peft, lean, lean16, off) on the stage as it loaded.

Each adapted weight (a site) is found where the stage holds it: a fused layer's LeanLoRA, a QuantModule's
LeanLoRA, or PEFT's own LoRA layer in an HF layer. Its adapters are read back as the product it adds
(A [R, in] and B [out, R] with the scale folded in) and served the asked way over the same base weight:

- ``lean`` / ``lean16``: a LeanLoRA in float32 / LEAN16_DTYPE (one over a fused weight's modules);
- ``peft``: PEFT's LoRA layer over the base (over a fused weight, one for its modules, in the fused path);
- ``off``: the base alone.

What any mode serves so stays as it is: DoRA stays lean (PEFT's DoRA layer reads no quantized weight),
and a PEFT layer with a LoRA bias of its own stays PEFT's. A site already served the asked way is left
alone, so that way's step is the stage's own. Everything is put back on exit."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from fellow.runtime.model.quant.lora import LEAN16_DTYPE, LeanLoRA, peft_lora
from fellow.runtime.model.quant.quantizer import QuantModule

MODES = ("peft", "lean", "lean16", "off")
FUSED_ATTRS = ("qkv", "o", "gate_up", "down")


def _is_peft(module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "enable_adapters")


def sites(stage) -> list[tuple[object, str, object]]:
    """(owner, attribute, what serves there) for every adapted weight of the stage."""
    found = []
    for layer in stage.fused.layers if stage.fused is not None else ():
        found += [(layer, attr, getattr(layer, attr)) for attr in FUSED_ATTRS
                  if isinstance(getattr(layer, attr), LeanLoRA)]
    for layer in stage.layers:
        for owner in layer.modules():
            if isinstance(getattr(owner, "linear", None), LeanLoRA):
                found.append((owner, "linear", owner.linear))
            for name, child in owner.named_children():
                if _is_peft(child):
                    found.append((owner, name, child))
    return found


def _as_lean(lean: LeanLoRA, dtype: torch.dtype, base=None) -> LeanLoRA:
    """``lean`` (its product as it holds it, or ``base``'s) in ``dtype``, DoRA's row factor kept."""
    out = LeanLoRA(lean.base if base is None else base, [(0, lean.a.float(), lean.b.float())], 1.0, dtype)
    out.rows_scale, out.rows_shift = lean.rows_scale, lean.rows_shift
    return out


def _served(current, mode: str):
    """What serves the site ``mode``'s way (``current`` itself where it already does, or where that mode
    serves it as it is)."""
    if _is_peft(current):
        base = current.base_layer  # a QuantModule
        if mode == "off":
            return base
        if mode == "peft" or current.lora_B["default"].bias is not None:
            return current
        scale = current.scaling["default"]
        lean = LeanLoRA(base.linear, [(0, current.lora_A["default"].weight, current.lora_B["default"].weight)],
                        scale, LEAN16_DTYPE if mode == "lean16" else torch.float32)
        return QuantModule(lean)
    if mode == "off":
        return current.base
    if mode == "peft":
        if current.rows_scale is not None:  # DoRA: lean in peft mode too
            return current if current.a.dtype == torch.float32 else _as_lean(current, torch.float32)
        return peft_lora(QuantModule(current.base), current.a.float(), current.b.float(), 1.0)
    dtype = LEAN16_DTYPE if mode == "lean16" else torch.float32
    return current if current.a.dtype == dtype else _as_lean(current, dtype)


def _put(owner, attr: str, value) -> None:
    """``owner.attr = value``, where a module's child may be swapped for a plain callable and back."""
    if isinstance(owner, nn.Module) and attr in owner._modules and not isinstance(value, nn.Module):
        del owner._modules[attr]
    setattr(owner, attr, value)


@contextmanager
def adapters_as(stage, mode: str):
    """The stage's unmerged adapters served ``mode``'s way (MODES) while inside; all restored on exit."""
    if mode not in MODES:
        raise ValueError(f"adapters are timed {', '.join(MODES)}, not {mode!r}")
    found = sites(stage)
    try:
        for owner, attr, current in found:
            _put(owner, attr, _served(current, mode))
        yield
    finally:
        for owner, attr, current in found:
            _put(owner, attr, current)


def adapters_off(stage):
    """The stage's unmerged adapters switched off for a while (``adapters_as(stage, "off")``)."""
    return adapters_as(stage, "off")
