"""A linear bottleneck on a stage boundary, fitted at export: PCA halves, their tensors and their error."""

from __future__ import annotations

import torch

from fellow.runtime.model.bottleneck import RECV, SEND, BottleneckDecoder, BottleneckEncoder


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
