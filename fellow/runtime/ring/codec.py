"""What crosses a ring boundary: float16 hidden states, a learned bottleneck's code, or int8 with scales."""

from __future__ import annotations

import torch

from core.servable import BottleneckCompressor, Compressor, NoCompressor, QuantizerCompressor, ServableError
from fellow.runtime.model.bottleneck import BottleneckDecoder, BottleneckEncoder

WIRE = torch.float16  # hidden × 2 bytes a position uncompressed, whatever the stage computes in
QMAX = 127


class WireCodec:
    """One half of a boundary. The sender encodes [R, q, H] into bytes per row; the receiver decodes.

    ``none`` sends hidden states as float16; ``bottleneck`` sends its ``dim``-wide code as float16
    through the servable's learned encoder and decoder; ``quantizer`` sends int8 with one float16
    scale per position (absmax). A boundary training did not have is ``none``.
    """

    def __init__(self, compressor: Compressor, hidden_size: int, encoder: BottleneckEncoder | None = None,
                 decoder: BottleneckDecoder | None = None):
        self.compressor = compressor
        self.encoder, self.decoder = encoder, decoder
        if isinstance(compressor, BottleneckCompressor):
            if encoder is None and decoder is None:
                raise ServableError("a bottleneck boundary without its trained halves in the shards")
            self.kind, self.width = "bottleneck", compressor.dim
        elif isinstance(compressor, QuantizerCompressor):
            if compressor.bits != 8:
                raise ServableError(f"a {compressor.bits}-bit quantizer boundary is not served (8 bits only)")
            self.kind, self.width = "quantizer", hidden_size
        elif isinstance(compressor, NoCompressor):
            self.kind, self.width = "none", hidden_size
        else:
            raise ServableError(f"boundary codec {compressor!r} is not known")

    @property
    def bytes_per_position(self) -> int:
        return self.width + 2 if self.kind == "quantizer" else self.width * 2

    @torch.inference_mode()
    def encode(self, hidden: torch.Tensor) -> list[tuple[bytes, bytes]]:
        """Rows of hidden [R, q, H] -> (data, scale) per row."""
        if self.kind == "bottleneck":
            hidden = self.encoder(hidden)
        if self.kind != "quantizer":
            wire = hidden.to(WIRE).cpu().contiguous()
            return [(row.numpy().tobytes(), b"") for row in wire]
        scale = (hidden.float().abs().amax(dim=-1, keepdim=True) / QMAX).clamp_min(1e-8).to(WIRE)  # [R, q, 1]
        codes = torch.round(hidden.float() / scale.float()).clamp_(-QMAX, QMAX).to(torch.int8).cpu()
        scale = scale.cpu()
        return [(c.numpy().tobytes(), s.numpy().tobytes()) for c, s in zip(codes, scale)]

    @torch.inference_mode()
    def decode(self, rows: list[tuple[bytes, bytes]], positions: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """(data, scale) per row, each of ``positions`` positions -> hidden [R, positions, H]."""
        element = 1 if self.kind == "quantizer" else 2
        for data, scale in rows:
            if len(data) != positions * self.width * element or (
                    self.kind == "quantizer" and len(scale) != positions * 2):
                raise ValueError(f"a frame of {len(data)} bytes does not hold {positions} position(s) "
                                 f"of a {self.kind} boundary {self.width} wide")
        data = bytearray(b"".join(d for d, _ in rows))
        if self.kind == "quantizer":
            codes = torch.frombuffer(data, dtype=torch.int8).view(len(rows), positions, self.width)
            scales = torch.frombuffer(bytearray(b"".join(s for _, s in rows)), dtype=WIRE)
            hidden = codes.float() * scales.float().view(len(rows), positions, 1)
            return hidden.to(device=device, dtype=dtype)
        wire = torch.frombuffer(data, dtype=WIRE).view(len(rows), positions, self.width)
        out = wire.to(device=device, dtype=dtype)
        return self.decoder(out) if self.kind == "bottleneck" else out
