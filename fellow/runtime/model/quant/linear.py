"""The quantized weight (QuantLinear) and its kernels: torch's CPU int8 / int4, bitsandbytes', tinygemm.

- int8 (``{"bits": 8}``): symmetric, one scale per output row; calls of at most 8 rows (decode steps)
  through this project's AVX2 kernel (``quant.int8_gemv``: the rows quantized to int8 in blocks of 32, as
  llama.cpp's q8_0 does), more rows, or where it cannot build, through ``aten._weight_int8pack_mm``.
- int4 (``{"method": "int4-fast"}``): asymmetric in groups of INT4_GROUP inputs (a scale and a zero per
  group and row), packed once by ``aten._convert_weight_to_int4pack_for_cpu``; ``aten._weight_int4pack_mm_for_cpu``.

Both kernels are vectorised for bfloat16 activations only: called with float32 rows they ran 6-40
times slower than a float32 matmul on this project's 2-core EPYC, with bfloat16 rows 2-5 times
faster (a 3,072 x 512 weight, one row, weight out of cache: float32 MKL 590 us, oneDNN packed 198 us,
int8 111 us, int4 80 us). So a quantized linear casts its input rows to bfloat16 and its result back:
the stage keeps computing norms, attention and its KV cache in float32. Each row's result is the same
whatever the number of rows in the call, so a batch equals each session alone.

What stays in full precision: the norms and the biases. The head is quantized too (a float32 head of
a small vocabulary is most of a small model's decode step); int4 stages keep it in int8 (HEAD_METHOD),
as llama.cpp keeps its output weight at more bits. The embedding table is held in int8 rows
(QuantEmbedding: a lookup scales one row a token); a tied model's table is its int8 head's weight, so
the stage holds it once. In float32 it was the largest piece left: an int4 46M Qwen3 with a tied 4k
vocabulary held 0.18x of its float32 bytes with it, 0.139x without (docs/benchmarks.md).

- NF4 (``{"method": "nf4"}``): bitsandbytes' 4-bit NormalFloat, blocks of NF4_BLOCK weights with a
  float32 scale each, quantized by ``bitsandbytes.functional.quantize_4bit`` exactly as
  ``from_pretrained`` with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` does
  (a test compares the bytes; that config's other defaults: no double quantization, uint8 storage). On a CPU each
  call dequantizes its weight with bitsandbytes and multiplies in float32:
  bitsandbytes' own CPU ``matmul_4bit`` (without its optional ``kernels`` package) took 3.5-5.5x a
  float32 matmul on this machine, dequantize-then-multiply 1.7x. NF4 on a CPU saves memory, not time.
  Its head is int8, as an int4 stage's (``from_pretrained`` leaves ``lm_head`` in full precision; a
  float head of a large vocabulary would hold more bytes than the layers saved), so a fellow declares
  NF4 only where the int8 kernel runs too.

On a CUDA card (CUDA_KERNELS; none of it has run on a card in this project's tests yet): NF4 through
``bitsandbytes.matmul_4bit`` in the stage's dtype; int8 held as ``from_pretrained(load_in_8bit=True)``
holds it and multiplied as its Linear8bitLt does without outliers (``bnb-int8``; it runs on a CPU too,
where tests drive it); int4-fast through torch's CUDA int4 kernel (tinygemm, the one torchao's int4
weight-only tile-packed layout calls) on Ampere or newer, else Int4Unavailable and the loader reloads
the stage as NF4. A stage on a card keeps its layers' HF forward (fused layers are CPU-only).

A stage is quantized layer by layer as it loads (``StageQuantizer.layer``, called by
``weights.build_stage_modules`` once each layer is materialized), so its full-precision copy never
exists whole: at most one layer's float weights at a time.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F

from core.quantization import INT4_FAST, INT8, NF4, SPLIT_MAX_ROWS
from fellow.runtime.model.quant import int8_gemv

QUANT_KERNELS = {INT8: "int8", INT4_FAST: "int4", NF4: "bnb-nf4"}  # on the CPU
CUDA_KERNELS = {INT8: "bnb-int8", INT4_FAST: "int4-tinygemm", NF4: "bnb-nf4"}  # on a CUDA card
FOUR_BIT_KERNELS = frozenset({"int4", "int4-tinygemm", "bnb-nf4"})  # what fourbit_rows may split / upcast
HEAD_METHOD = {INT8: INT8, INT4_FAST: INT8, NF4: INT8}  # the head's own method, per stage method
NF4_BLOCK = 64  # weights per NF4 scale: BitsAndBytesConfig's default
INT4_GROUPS = (64, 32)  # inputs per int4 group, the first that divides in_features
ACT = torch.bfloat16  # what the kernels read rows in


@cache
def bitsandbytes_functional():
    """``bitsandbytes.functional``, looked up once (every NF4 call dequantizes through it) and imported
    without its one warning: lacking the optional ``kernels`` package (which fetches a CPU kernel from the
    Hugging Face hub), it logs that at import, then computes NF4 as this module uses it anyway."""
    quiet = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import bitsandbytes.functional as functional
    finally:
        quiet.setLevel(level)
    return functional


@cache
def bitsandbytes_module():
    """``bitsandbytes`` (its ``matmul_4bit`` and ``matmul``), imported quietly as ``bitsandbytes_functional``."""
    bitsandbytes_functional()
    import bitsandbytes

    return bitsandbytes


class Int4Unavailable(RuntimeError):
    """The CUDA int4 kernel cannot run here (no CUDA card, one older than Ampere, or the kernel failed):
    the loader then reloads the stage as NF4 and says so."""


TINYGEMM_FLOOR = (8, 0)  # the CUDA int4 kernel's compute capability floor (Ampere)


def tinygemm_check_device(device: torch.device) -> None:
    """Raises Int4Unavailable where torch's CUDA int4 kernel (tinygemm, the one torchao's int4 weight-only
    tile-packed layout calls) cannot run on ``device``."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise Int4Unavailable(f"the CUDA int4 kernel needs a CUDA card; this weight is on {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < TINYGEMM_FLOOR:
        raise Int4Unavailable(f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; the CUDA int4 kernel "
                              f"needs sm_{TINYGEMM_FLOOR[0]}{TINYGEMM_FLOOR[1]} (Ampere) or newer")


def quant_kernel(method: str, device: torch.device) -> str:
    """The kernel a ``method`` weight gets on ``device``: torch's CPU kernels and bitsandbytes' NF4 on a
    CPU; bitsandbytes' NF4 and int8 and torch's int4 (tinygemm) on a CUDA card."""
    table = CUDA_KERNELS if torch.device(device).type == "cuda" else QUANT_KERNELS
    if method not in table:
        raise ValueError(f"no weight-only kernel for {method!r}")
    return table[method]


def int4_layout(in_features: int) -> tuple[int, int] | None:
    """(group size, inner K tiles) the int4 kernel takes for ``in_features`` inputs; None where none fits
    (QuantLinear pads a weight's inputs to a multiple of 32 first)."""
    for group in INT4_GROUPS:
        if in_features % group == 0:
            tiles = next(t for t in (8, 4, 2) if in_features % (t * 16) == 0) if in_features % 32 == 0 else None
            return (group, tiles) if tiles else None
    return None


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and bfloat16 scales [N]: weight ≈ q * scale, symmetric per output row."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-10).to(ACT)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 values 0..15 [N, K] and bfloat16 scales and zeros [K / group, N, 2]:
    weight ≈ (q - 8) * scale + zero, asymmetric per group of ``group`` inputs (the layout torch's test uses)."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    grouped = w.reshape(out_features, in_features // group, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scales = ((high - low).clamp(min=1e-6) / 15).to(ACT).float()  # rounded first: the kernel reads these
    zeros = (low + scales * 8).to(ACT).float()
    q = ((grouped - (zeros - scales * 8)) / scales).round().clamp_(0, 15).to(torch.int32)
    scales_and_zeros = torch.stack([scales[..., 0], zeros[..., 0]], dim=-1).transpose(0, 1).contiguous().to(ACT)
    return q.reshape(out_features, in_features), scales_and_zeros


class QuantLinear:
    """A weight quantized to int8, int4 or NF4 and called like ``F.linear`` (fused.Linear's protocol)."""

    __slots__ = ("kernel", "weight", "scales", "bias", "out_features", "in_features", "group", "pad", "state",
                 "row_limit", "float32_rows", "scales_f32")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, method: str, kernel: str | None = None) -> None:
        """``kernel``: default, the method's kernel on the weight's device (quant_kernel). bitsandbytes'
        kernels run on a CPU too, so tests drive a CUDA stage's ``bnb-int8`` there."""
        self.kernel = kernel = kernel or quant_kernel(method, weight.device)
        if kernel not in (QUANT_KERNELS.get(method), CUDA_KERNELS.get(method)):
            raise ValueError(f"no {kernel!r} kernel for {method!r} weights")
        if kernel in ("int8", "int4") and weight.device.type != "cpu":
            raise ValueError(f"the {kernel} weight-only kernel runs on the CPU; this weight is on {weight.device}")
        if kernel == "int4-tinygemm":
            tinygemm_check_device(weight.device)
        self.out_features, self.in_features = weight.shape
        on_cpu = weight.device.type == "cpu"
        # a CPU kernel adds a float32 bias to its float32 result; bitsandbytes' add the bias in the weight's dtype
        self.bias = None if bias is None else bias.detach().float() if on_cpu else bias.detach().to(weight.dtype)
        self.group = self.pad = self.row_limit = 0
        self.float32_rows: frozenset[int] = frozenset()
        self.state = None
        self.scales_f32: torch.Tensor | None = None  # int8: the scales in float32, for int8_gemv
        if kernel == "int8":
            self.weight, self.scales = quantize_int8(weight)
            self.scales_f32 = self.scales.float()
        elif kernel == "bnb-int8":
            # as BitsAndBytesConfig(load_in_8bit=True) (bitsandbytes' Int8Params): row-wise absmax over the
            # float16 weight; served as its Linear8bitLt without outliers (threshold 0): each input row
            # quantized by its own absmax, an int8 matmul, then both scales
            import bitsandbytes as bnb

            self.weight, self.scales, _ = bitsandbytes_functional().int8_vectorwise_quant(
                weight.detach().to(torch.float16).contiguous())
            self.state = bnb.MatmulLtState()
            self.state.CB, self.state.SCB = self.weight, self.scales
            self.state.has_fp16_weights = self.state.is_training = False
            self.state.threshold = 0.0
            if self.bias is not None:
                self.bias = self.bias.to(torch.float16)
        elif method == INT4_FAST:
            # the kernels take inputs in multiples of 32 and outputs in multiples of 16: zeros fill up
            self.pad = -self.in_features % 32
            if self.pad or self.out_features % 16:
                weight = F.pad(weight.detach(), (0, self.pad, 0, -self.out_features % 16))
            self.group, tiles = int4_layout(self.in_features + self.pad)
            values, self.scales = quantize_int4(weight, self.group)
            if kernel == "int4":
                self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, tiles)
            else:  # CUDA's packing takes two values a byte, the even input in the high nibble
                packed = (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8)
                try:
                    self.weight = torch.ops.aten._convert_weight_to_int4pack(packed, tiles)
                except (RuntimeError, NotImplementedError) as exc:  # this build has no kernel for the card
                    raise Int4Unavailable(one_line(exc)) from exc
        elif method == NF4:
            # as BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"): no double quantization,
            # over the weight in the dtype it loaded in (float32 on a CPU stage)
            self.weight, self.scales = bitsandbytes_functional().quantize_4bit(
                (weight.detach().float() if on_cpu else weight.detach()).contiguous(), blocksize=NF4_BLOCK,
                compress_statistics=False, quant_type="nf4")
        else:
            raise ValueError(f"no weight-only kernel for {method!r}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` through the kernel, under the row policy fourbit_rows set:
        a call of more than ``row_limit`` (and at most SPLIT_MAX_ROWS) rows is split into calls of at most
        ``row_limit``; a call (or split part) whose row count is in ``float32_rows`` (0 there: any count past
        SPLIT_MAX_ROWS) computes in float32, its input cast up and its result back."""
        if not (self.row_limit or self.float32_rows):
            return self._call(x)
        n = x.numel() // self.in_features
        if self.row_limit and self.row_limit < n <= SPLIT_MAX_ROWS:
            rows = x.reshape(n, self.in_features)
            parts = [self._policy_call(rows[i : i + self.row_limit]) for i in range(0, n, self.row_limit)]
            return torch.cat(parts).view(*x.shape[:-1], self.out_features)
        return self._policy_call(x)

    def _policy_call(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // self.in_features
        if (n if n <= SPLIT_MAX_ROWS else 0) in self.float32_rows and x.dtype != torch.float32:
            return self._call(x.float()).to(x.dtype)
        return self._call(x)

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel
        if kernel == "bnb-nf4":
            if self.weight.device.type == "cpu":  # dequantized, then multiplied in float32 (module docstring)
                return F.linear(x.float(), self.dequantized(), self.bias).to(x.dtype)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return bitsandbytes_module().matmul_4bit(x, self.weight.t(), quant_state=self.scales, bias=bias)
        if kernel == "bnb-int8":
            rows = x.reshape(-1, self.in_features).to(torch.float16)
            out = bitsandbytes_module().matmul(rows, self.weight, bias=self.bias, state=self.state)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if (kernel == "int8" and x.numel() <= int8_gemv.MAX_ROWS * self.in_features
                and int8_gemv.takes(self.in_features)):
            out = int8_gemv.int8_gemv(x.reshape(-1, self.in_features).float(), self.weight, self.scales_f32)
            out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out.add_(self.bias)
        rows = x.reshape(-1, self.in_features).to(ACT)
        if self.pad:
            rows = F.pad(rows, (0, self.pad))
        if kernel == "int4":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group, self.scales)
        elif kernel == "int4-tinygemm":
            out = torch.ops.aten._weight_int4pack_mm(rows, self.weight, self.group, self.scales)
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)
        if out.shape[-1] != self.out_features:
            out = out[:, : self.out_features]
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out.add_(self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this one multiplies by (NF4 computes with it; tests and error reports)."""
        if self.kernel == "bnb-nf4":
            return bitsandbytes_functional().dequantize_4bit(self.weight, self.scales).float()
        if self.kernel == "bnb-int8":
            return self.weight.float() * (self.scales.float()[:, None] / 127)
        eye = torch.eye(self.in_features, device=self.weight.device)
        bias, self.bias = self.bias, None
        try:
            return self(eye.float()).t().contiguous()
        finally:
            self.bias = bias

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The scales as a tensor (NF4's are its QuantState's absmax)."""
        return self.scales.absmax if self.kernel == "bnb-nf4" else self.scales

    @property
    def bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        scales = self.scale_tensor
        if self.scales_f32 is not None:
            extra += self.scales_f32.numel() * self.scales_f32.element_size()
        return self.weight.numel() * self.weight.element_size() + scales.numel() * scales.element_size() + extra



def one_line(exc: BaseException) -> str:
    """An exception as one line of a log or a status: its type and its message's first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
