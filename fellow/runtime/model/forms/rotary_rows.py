"""The rotary cos and sin of a decode step's positions, looked up in a table rather than computed each step.

A compiled decode step took its cos and sin from the model's rotary module (``rotary_emb``) each step, then
signed and reshaped them (``fused.rotary_tables``): about 0.2 ms of small ops and Python, where the whole
compiled step of a 46M model takes 8 (docs/benchmarks.md). A position's values do not depend on the others
asked with it, so this computes them for TABLE_CHUNK positions at once (more as sessions grow) and a step
takes its rows, contiguous, as the graph wants them. Rotary kinds whose values depend on the longest
position asked (HF's "dynamic" and "longrope" scaling) are computed each step as before.
"""

from __future__ import annotations

import torch

from fellow.runtime.model.fused import rotary_tables

TABLE_CHUNK = 1024  # positions the table holds at first; it doubles past the largest position asked


class RotaryRows:
    def __init__(self, rotary_emb, dtype: torch.dtype) -> None:
        self.rotary_emb = rotary_emb
        self._like = torch.empty(0, dtype=dtype)
        kind = str(getattr(rotary_emb, "rope_type", "default"))
        self.tabled = "dynamic" not in kind and kind != "longrope"
        self.cos: torch.Tensor | None = None  # [positions, 1, 1, D], and sin beside it
        self.sin: torch.Tensor | None = None

    def __call__(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [len(positions), 1, 1, D], contiguous, as ``rotary_tables`` gives them for these positions."""
        if not self.tabled:
            cos, sin = rotary_tables(*self.rotary_emb(self._like, torch.tensor([[p] for p in positions])))
            return cos.contiguous(), sin.contiguous()
        top = max(positions)
        if self.cos is None or top >= self.cos.shape[0]:
            size = max(TABLE_CHUNK, 2 * (top + 1))
            cos, sin = rotary_tables(*self.rotary_emb(self._like, torch.arange(size)[None]))  # [1, size, 1, D]
            self.cos, self.sin = cos[0, :, None].contiguous(), sin[0, :, None].contiguous()
        if len(positions) == 1:
            p = positions[0]
            return self.cos[p : p + 1], self.sin[p : p + 1]
        index = torch.tensor(positions)
        return self.cos[index], self.sin[index]
