"""A cut training made inside one serving stage (a model trained over more stages than it serves on),
applied between the layers where it was trained, as the ring's wire would code it (ring/codec.py)."""

from __future__ import annotations

import torch
from torch import nn

from core.servable import BottleneckCompressor, Compressor, QuantizerCompressor, ServableError
from fellow.runtime.model.bottleneck import BottleneckDecoder, BottleneckEncoder

WIRE = torch.float16  # what a ring boundary sends (ring/codec.WIRE): a one-stage load rounds the code the same
QMAX = 127  # a fixed 8-bit quantizer's largest code (ring/codec.QMAX)


class InnerBoundary(nn.Module):
    """hidden -> hidden through a trained cut: a learned bottleneck's encoder, its code rounded to the
    wire's float16, and its decoder; or a fixed 8-bit quantizer's round trip (absmax, one scale a
    position). The stage then serves the model that was trained, with the glue its layers learned around."""

    def __init__(self, kind: str, encoder: BottleneckEncoder | None = None, decoder: BottleneckDecoder | None = None):
        super().__init__()
        self.kind = kind
        self.encoder, self.decoder = encoder, decoder

    @classmethod
    def of(cls, compressor: Compressor, send: dict[str, torch.Tensor], recv: dict[str, torch.Tensor],
           dtype: torch.dtype | None, device) -> "InnerBoundary":
        """The cut's codec from its two halves' tensors (``send`` / ``recv``: weight and mean)."""
        if isinstance(compressor, BottleneckCompressor):
            if not send or not recv:
                raise ServableError("a trained bottleneck inside the stage without both its halves in the shards")

            def cast(t: torch.Tensor) -> torch.Tensor:
                return t.to(device=device, dtype=dtype or t.dtype)

            return cls("bottleneck", BottleneckEncoder(cast(send["weight"]), cast(send["mean"])),
                       BottleneckDecoder(cast(recv["weight"]), cast(recv["mean"])))
        if isinstance(compressor, QuantizerCompressor):
            if compressor.bits != 8:
                raise ServableError(f"a {compressor.bits}-bit quantizer boundary is not served (8 bits only)")
            return cls("quantizer")
        raise ServableError(f"boundary codec {compressor!r} is not known")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kind == "bottleneck":
            return self.decoder(self.encoder(hidden).to(WIRE).to(hidden.dtype))
        scale = (hidden.float().abs().amax(dim=-1, keepdim=True) / QMAX).clamp_min(1e-8).to(WIRE).float()
        return (torch.round(hidden.float() / scale).clamp_(-QMAX, QMAX) * scale).to(hidden.dtype)


def apply_inner(stage, boundaries: dict[int, InnerBoundary]) -> None:
    """Run each cut before the layer after it (absolute index), on the HF layers' path (a forward
    pre-hook) and the fused one (``FusedStack.before``); the status's ``kernels.inner`` names them."""
    if not boundaries:
        return
    for cut, boundary in boundaries.items():
        layer = stage.layers[cut - stage.first_layer]
        layer.register_forward_pre_hook(lambda _m, args, kwargs, b=boundary: ((b(args[0]), *args[1:]), kwargs),
                                        with_kwargs=True)
    if stage.fused is not None:
        stage.fused.before = dict(boundaries)
    stage.note(inner={str(cut): b.kind for cut, b in sorted(boundaries.items())})
