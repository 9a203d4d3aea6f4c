"""The additive attention masks a stage's HF layers take: a prompt piece's, and fresh prompts batched side by side."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def piece_mask(past: int, positions: int, hidden: torch.Tensor, window: int | None = None,
               attention: str = "sdpa") -> torch.Tensor | None:
    """The mask [1, 1, q, past + q] of ``positions`` new positions after ``past``: causal, and within
    ``window`` positions where the layer has one; None where plain causal serves (sdpa does it itself)."""
    windowed = window is not None and past + positions > window  # some query has a key out of its window
    if not windowed and (positions == 1 or (past == 0 and attention == "sdpa")):
        return None  # one query sees everything; an empty past is plain causal
    rows = torch.arange(past, past + positions, device=hidden.device)[:, None]
    columns = torch.arange(past + positions, device=hidden.device)[None, :]
    hidden_keys = columns > rows
    if windowed:
        hidden_keys |= columns <= rows - window
    mask = torch.zeros(1, 1, positions, past + positions, dtype=hidden.dtype, device=hidden.device)
    return mask.masked_fill_(hidden_keys[None, None], torch.finfo(hidden.dtype).min)


def fresh_masks(windows: Sequence[int | None], pads: Sequence[int], width: int, dtype: torch.dtype,
                device: torch.device) -> tuple[dict, torch.Tensor]:
    """(masks by window [B, 1, width, width], position ids [B, width]) of prompts left-padded to ``width``
    (``pads`` each), each row causal over its own positions: a real query sees real keys up to itself (and
    within its window); a padding row sees only itself (no empty softmax)."""
    pad = torch.tensor(list(pads), device=device)[:, None, None]  # [B, 1, 1]
    rows = torch.arange(width, device=device)[None, :, None]
    columns = torch.arange(width, device=device)[None, None, :]
    masks = {}
    for window in windows:
        seen = (columns <= rows) & (columns >= pad)
        if window is not None:
            seen &= columns > rows - window
        mask = torch.zeros(len(pads), 1, width, width, dtype=dtype, device=device)
        masks[window] = mask.masked_fill_(~(seen | (columns == rows))[:, None], torch.finfo(dtype).min)
    position_ids = (torch.arange(width, device=device)[None, :] - pad[:, :, 0]).clamp(min=0)
    return masks, position_ids
