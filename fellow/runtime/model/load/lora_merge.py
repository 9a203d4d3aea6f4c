"""Fold LoRA adapter weights (export: adapters) into a full-precision stage's base weights; DoRA's too.

DoRA (PEFT's ``use_dora``) keeps a magnitude per output row beside A and B: PEFT computes
``m / ||W + s·B A||`` over each output row of the adapted weight (detached) and scales that row's output,
so the merged weight is ``(m / ||W + s·B A||) ⊙ (W + s·B A)``; the bias is not scaled."""

from __future__ import annotations

import math

import torch

from core.servable import ServableError


def lora_scale(adapter_config: dict) -> float:
    """alpha / r (alpha / sqrt(r) with rsLoRA), as PEFT scales the adapter's product."""
    for unsupported in ("rank_pattern", "alpha_pattern"):
        if adapter_config.get(unsupported):
            raise ServableError(f"LoRA {unsupported} is not supported by the serving merge")
    r, alpha = int(adapter_config["r"]), float(adapter_config.get("lora_alpha", adapter_config["r"]))
    return alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r


MAGNITUDE = ".lora_magnitude_vector"  # DoRA's saved magnitude, [out], as PEFT names it in an adapter file
DORA_FACTOR = ".lora_dora_factor"  # its row factor, where adapters stay apart from a quantized weight


def adapted(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + s·B A`` in float64: B [out, r] @ A [r, in]."""
    return weight.double() + (b.double() @ a.double()) * scale


def dora_factor(full: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """DoRA's factor for each output row of the adapted weight ``full``, float32: ``m / ||row||``."""
    return (magnitude.double() / torch.linalg.norm(full.double(), dim=1)).float()


def merge_lora(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
               adapter_config: dict) -> dict[str, torch.Tensor]:
    """W += scale · B @ A for every ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` pair, then each
    row times DoRA's factor where the module has a ``<module>.lora_magnitude_vector``.

    Keys share one naming (e.g. ``layers.3.self_attn.q_proj``); a non-LoRA adapter tensor
    (a saved module copy) replaces the base tensor of the same name.
    """
    scale = lora_scale(adapter_config)
    merged = dict(base)
    for key, tensor in adapters.items():
        if ".lora_embedding_" in key:
            raise ServableError(f"adapter tensor {key} is of a LoRA kind the serving merge does not support")
        if ".lora_A." in key:
            module = key.split(".lora_A.")[0]
            b = adapters.get(f"{module}.lora_B.weight")
            target = f"{module}.weight"
            if b is None or target not in merged:
                raise ServableError(f"LoRA weight {key} has no partner lora_B or base weight {target}")
            w = merged[target]
            full = adapted(w, tensor, b, scale)
            if (magnitude := adapters.get(module + MAGNITUDE)) is not None:
                full = full * dora_factor(full, magnitude).double()[:, None]
            merged[target] = full.to(w.dtype)
        elif ".lora_" in key:
            continue  # lora_B and DoRA's magnitude are consumed with their lora_A
        else:
            merged[key] = tensor
    return merged


def dora_factors(weights: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], prefix: str,
                 scale: float) -> dict[str, torch.Tensor]:
    """``lora`` with each DoRA magnitude replaced by its row factor ``<module>.lora_dora_factor``, computed
    over the full-precision base weight (the adapters stay apart from a quantized one)."""
    out = {}
    for key, tensor in lora.items():
        if not key.endswith(MAGNITUDE):
            out[key] = tensor
            continue
        module = key[: -len(MAGNITUDE)]
        full = adapted(weights[f"{prefix}{module}.weight"], lora[f"{module}.lora_A.weight"],
                       lora[f"{module}.lora_B.weight"], scale)
        out[f"{module}{DORA_FACTOR}"] = dora_factor(full, tensor)
    return out
