"""Grouped attention (the spec's TS5) for a stage's HF layers: each key/value head serves its query heads in
one matmul, instead of sdpa's copy of the keys and values once per query head (transformers' ``repeat_kv``,
which it takes wherever a pass has several queries and a mask: a verify pass, a masked prompt piece, fresh
prompts batched side by side).

The query heads a key/value head serves (``h = kv · G + g``, repeat_kv's order) are folded into its rows:
``[B, H, q, D]`` -> ``[B, kv, G·q, D]``, the mask tiled over the G groups, and one sdpa call over the
key/value heads as they are. Same results to rounding. Registered with transformers as
``swarm_grouped`` (``config._attn_implementation``), chosen per stage by SWARM_SERVE_ATTENTION on the
fellow: ``grouped``, ``sdpa``, or ``auto`` (grouped on float32 CUDA stages, where the spec measured it:
a 2,048-token context 168 -> 113 ms a position on a GTX 1050 Ti; a CPU stage's fused layers already attend
grouped (``fused.attend_*``), and its HF layers stay on sdpa, whose one-query step transformers packs the
same way). The fused CPU layers are not affected by the choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

GROUPED = "swarm_grouped"
CHOICES = ("auto", "grouped", "sdpa")


def grouped_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                              is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, H, q, D], key and value [B, kv, T, D], an additive or
    boolean mask [B or 1, 1 or H, q, T] (None: causal from the first key where q > 1); returns [B, q, H, D]."""
    groups = query.shape[1] // key.shape[1]
    if groups == 1 or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, q, dim = query.shape
    kv, total = key.shape[1], key.shape[2]
    mask = attention_mask
    if mask is None and q > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        # transformers' convention: no mask is a prompt from an empty past, causal from the first key
        rows = torch.arange(q, device=query.device)[:, None]
        mask = (torch.arange(total, device=query.device)[None, :] <= rows)[None, None]  # True: attended
    if mask is not None:
        mask = mask[..., :total]
        if mask.shape[1] == 1:  # one mask for every head: the same for each group's rows
            mask = mask.expand(mask.shape[0], groups, q, total).reshape(mask.shape[0], 1, groups * q, total)
        else:  # per head: each key/value head's groups side by side
            mask = mask.reshape(mask.shape[0], kv, groups * q, total)
    out = F.scaled_dot_product_attention(query.reshape(batch, kv, groups * q, dim), key, value, attn_mask=mask,
                                         dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, q, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED, grouped_attention_forward)


def choose_attention(option: str, dtype: torch.dtype, device: torch.device) -> str:
    """The HF layers' implementation for SWARM_SERVE_ATTENTION ``option`` on a stage computing in ``dtype``
    on ``device``: ``swarm_grouped`` or ``sdpa``."""
    if option not in CHOICES:
        raise ValueError(f"attention {option!r} is not one of {', '.join(CHOICES)}")
    if option == "auto":
        return GROUPED if dtype == torch.float32 and device.type == "cuda" else "sdpa"
    return GROUPED if option == "grouped" else "sdpa"
