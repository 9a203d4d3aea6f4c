"""A stage boundary's linear bottleneck halves, as a stage holds them: the encoder sends, the decoder receives."""

from __future__ import annotations

import torch
from torch import nn

SEND = "bottleneck.send."  # the encoder half, stored with the sender stage
RECV = "bottleneck.recv."  # the decoder half, stored with the receiver stage


class BottleneckEncoder(nn.Module):
    """hidden -> code: (h - mean) @ W_eᵀ, so only ``dim`` numbers per token cross the link."""

    def __init__(self, weight: torch.Tensor, mean: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [dim, hidden]
        self.mean = nn.Parameter(mean, requires_grad=False)  # [hidden]

    @property
    def dim(self) -> int:
        return self.weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, S, hidden] -> [B, S, dim]
        return (hidden - self.mean.to(hidden.dtype)) @ self.weight.to(hidden.dtype).T


class BottleneckDecoder(nn.Module):
    """code -> hidden: c @ W_dᵀ + mean."""

    def __init__(self, weight: torch.Tensor, mean: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [hidden, dim]
        self.mean = nn.Parameter(mean, requires_grad=False)  # [hidden]

    def forward(self, code: torch.Tensor) -> torch.Tensor:  # [B, S, dim] -> [B, S, hidden]
        return code @ self.weight.to(code.dtype).T + self.mean.to(code.dtype)
