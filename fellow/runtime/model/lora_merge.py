"""Fold LoRA adapter weights (export: adapters) into a full-precision stage's base weights."""

from __future__ import annotations

import math

import torch

from core.servable import ServableError


def lora_scale(adapter_config: dict) -> float:
    """alpha / r (alpha / sqrt(r) with rsLoRA), as PEFT scales the adapter's product."""
    for unsupported in ("rank_pattern", "alpha_pattern"):
        if adapter_config.get(unsupported):
            raise ServableError(f"LoRA {unsupported} is not supported by the serving merge")
    if adapter_config.get("use_dora"):
        raise ServableError("DoRA adapters are not supported by the serving merge")
    r, alpha = int(adapter_config["r"]), float(adapter_config.get("lora_alpha", adapter_config["r"]))
    return alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r


def merge_lora(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
               adapter_config: dict) -> dict[str, torch.Tensor]:
    """W += scale · B @ A for every ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` pair.

    Keys share one naming (e.g. ``layers.3.self_attn.q_proj``); a non-LoRA adapter tensor
    (a saved module copy) replaces the base tensor of the same name.
    """
    scale = lora_scale(adapter_config)
    merged = dict(base)
    for key, tensor in adapters.items():
        if ".lora_embedding_" in key or ".lora_magnitude" in key:
            raise ServableError(f"adapter tensor {key} is of a LoRA kind the serving merge does not support")
        if ".lora_A." in key:
            module = key.split(".lora_A.")[0]
            b = adapters.get(f"{module}.lora_B.weight")
            target = f"{module}.weight"
            if b is None or target not in merged:
                raise ServableError(f"LoRA weight {key} has no partner lora_B or base weight {target}")
            w = merged[target]
            delta = (b.double() @ tensor.double()) * scale  # [out, r] @ [r, in]
            merged[target] = (w.double() + delta).to(w.dtype)
        elif ".lora_" in key:
            continue  # lora_B is consumed with its lora_A
        else:
            merged[key] = tensor
    return merged
