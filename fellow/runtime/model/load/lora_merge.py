"""Fold LoRA adapter weights (export: adapters) into a full-precision stage's base weights; DoRA's too.

Each module's adapter product is scaled as PEFT scales it (``lora_scale``): its r and alpha from the
config's ``rank_pattern`` / ``alpha_pattern`` where a key matches its name, else ``r`` / ``lora_alpha``.
An embedding's LoRA (``lora_embedding_A`` [r, vocab], ``lora_embedding_B`` [dim, r]) adds PEFT's delta
``(B A)^T · s`` to the table.

DoRA (PEFT's ``use_dora``) keeps a magnitude per output row beside A and B: PEFT computes
``m / ||W + s·B A||`` over each output row of the adapted weight (detached) and scales that row's output,
so the merged weight is ``(m / ||W + s·B A||) ⊙ (W + s·B A)``; the bias is not scaled."""

from __future__ import annotations

import logging
import math
import re

import torch

from core.servable import ServableError

log = logging.getLogger(__name__)

EMBED_A, EMBED_B = ".lora_embedding_A", ".lora_embedding_B"  # an embedding's LoRA, as PEFT names it in a file


def hf_name(module: str) -> str:
    """A stage's module name (``layers.3.self_attn.q_proj``, ``embed_tokens``) as PEFT names it in the
    causal LM (``model.layers.3.self_attn.q_proj``): what its config's patterns are matched against."""
    return module if module.startswith("lm_head") else f"model.{module}"


def _pattern_value(patterns: dict | None, name: str, default):
    """PEFT's ``get_pattern_key``: the first key that matches the end of ``name`` at a dot (as a regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def lora_scale(adapter_config: dict, module: str | None = None) -> float:
    """alpha / r (alpha / sqrt(r) with rsLoRA) of one module's adapter product, as PEFT scales it: r and
    alpha from ``rank_pattern`` / ``alpha_pattern`` where a key matches the module's name (``hf_name``),
    else the config's ``r`` and ``lora_alpha`` (those alone without a ``module``)."""
    r, alpha = int(adapter_config["r"]), float(adapter_config.get("lora_alpha", adapter_config["r"]))
    if module is not None:
        name = hf_name(module)
        r = int(_pattern_value(adapter_config.get("rank_pattern"), name, r))
        alpha = float(_pattern_value(adapter_config.get("alpha_pattern"), name, alpha))
    return alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r


MAGNITUDE = ".lora_magnitude_vector"  # DoRA's saved magnitude, [out], as PEFT names it in an adapter file
LORA_BIAS = ".lora_B.bias"  # PEFT's lora_bias: B's own bias, [out], scaled with its product
DORA_FACTOR = ".lora_dora_factor"  # its row factor, where adapters stay apart from a quantized weight


def adapted(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + s·B A`` in float64: B [out, r] @ A [r, in]."""
    return weight.double() + (b.double() @ a.double()) * scale


def dora_factor(full: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """DoRA's factor for each output row of the adapted weight ``full``, float32: ``m / ||row||``."""
    return (magnitude.double() / torch.linalg.norm(full.double(), dim=1)).float()


def merge_lora(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
               adapter_config: dict) -> dict[str, torch.Tensor]:
    """W += scale · B @ A for every ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` pair (each
    module at its own scale, ``lora_scale``), then each row times DoRA's factor where the module has a
    ``<module>.lora_magnitude_vector``; an embedding table += ``(B A)^T · scale`` for its
    ``lora_embedding_A`` / ``lora_embedding_B``, as PEFT's ``Embedding.get_delta_weight``; a base bias
+= scale · ``<module>.lora_B.bias`` (PEFT's ``lora_bias``).

    Keys share one naming (e.g. ``layers.3.self_attn.q_proj``); a non-LoRA adapter tensor
    (a saved module copy; PEFT's ``<module>.base_layer.weight``, the saved embedding) replaces the base
    tensor of the same name first.
    """
    merged = dict(base)
    for key, tensor in adapters.items():
        if ".lora_" not in key:
            merged[key.replace(".base_layer.", ".")] = tensor
    for key, tensor in adapters.items():
        if ".lora_A." in key or key.endswith(EMBED_A):
            embedding = key.endswith(EMBED_A)
            module = key[: -len(EMBED_A)] if embedding else key.split(".lora_A.")[0]
            b = adapters.get(module + EMBED_B if embedding else f"{module}.lora_B.weight")
            target = f"{module}.weight"
            if b is None or target not in merged:
                raise ServableError(f"LoRA weight {key} has no partner lora_B or base weight {target}")
            magnitude = adapters.get(module + MAGNITUDE)
            if embedding and magnitude is not None:
                raise ServableError(f"DoRA on the embedding {module} is not supported by the serving merge")
            w, scale = merged[target], lora_scale(adapter_config, module)
            full = (w.double() + (b.double() @ tensor.double()).t() * scale) if embedding \
                else adapted(w, tensor, b, scale)
            if magnitude is not None:
                full = full * dora_factor(full, magnitude).double()[:, None]
            merged[target] = full.to(w.dtype)
            if embedding:  # over a quantized stage too: no lean form, and the table's int8 rows round it once
                log.info("LoRA on the embedding %s merged into its table (no embedding adapters kept apart)", module)
        elif key.endswith(LORA_BIAS):  # PEFT's lora_bias: merged into the base bias, as PEFT merges it
            target = key[: -len(LORA_BIAS)] + ".bias"
            if target not in merged:
                raise ServableError(f"LoRA bias {key} has no base bias {target} to merge into (nor does PEFT)")
            scale = lora_scale(adapter_config, key[: -len(LORA_BIAS)])
            merged[target] = (merged[target].double() + tensor.double() * scale).to(merged[target].dtype)
    return merged


def dora_factors(weights: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], prefix: str,
                 adapter_config: dict) -> dict[str, torch.Tensor]:
    """``lora`` with each DoRA magnitude replaced by its row factor ``<module>.lora_dora_factor``, computed
    over the full-precision base weight (the adapters stay apart from a quantized one) at the module's scale."""
    out = {}
    for key, tensor in lora.items():
        if not key.endswith(MAGNITUDE):
            out[key] = tensor
            continue
        module = key[: -len(MAGNITUDE)]
        full = adapted(weights[f"{prefix}{module}.weight"], lora[f"{module}.lora_A.weight"],
                       lora[f"{module}.lora_B.weight"], lora_scale(adapter_config, prefix + module))
        out[f"{module}{DORA_FACTOR}"] = dora_factor(full, tensor)
    return out
