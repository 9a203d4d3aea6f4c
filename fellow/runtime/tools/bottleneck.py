"""A linear bottleneck on a stage boundary: PCA-fitted encoder and decoder halves."""

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


def relative_error(hidden: torch.Tensor, rebuilt: torch.Tensor) -> float:
    """sum((h - ĥ)²) / sum(h²), in float64 so the number is reproducible."""
    h, r = hidden.double(), rebuilt.double()
    return float(((h - r) ** 2).sum() / (h**2).sum())


def fit_pca(fit: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``dim`` principal directions of ``fit`` [tokens, hidden]: (W_e [dim, hidden], mean)."""
    if dim < 1 or dim > fit.shape[1]:
        raise ValueError(f"bottleneck dim {dim} must be between 1 and hidden size {fit.shape[1]}")
    x = fit.double()
    mean = x.mean(0)
    # Rows of Vh are the principal directions, strongest first.
    _, _, vh = torch.linalg.svd(x - mean, full_matrices=False)
    return vh[:dim].contiguous(), mean


def codec_tensors(weight: torch.Tensor, mean: torch.Tensor, dtype: torch.dtype) -> tuple[dict, dict]:
    """The sender's and the receiver's halves as shard tensors (decoder = encoderᵀ for PCA)."""
    send = {SEND + "weight": weight.to(dtype).contiguous(), SEND + "mean": mean.to(dtype).contiguous()}
    recv = {RECV + "weight": weight.T.to(dtype).contiguous(), RECV + "mean": mean.to(dtype).contiguous()}
    return send, recv


def codec_error(weight: torch.Tensor, mean: torch.Tensor, held_out: torch.Tensor, dtype: torch.dtype) -> float:
    """The relative error of the stored (``dtype``-rounded) codec on held-out activations."""
    send, recv = codec_tensors(weight, mean, dtype)
    encoder = BottleneckEncoder(send[SEND + "weight"], send[SEND + "mean"])
    decoder = BottleneckDecoder(recv[RECV + "weight"], recv[RECV + "mean"])
    with torch.no_grad():
        return relative_error(held_out, decoder(encoder(held_out.to(dtype))))
