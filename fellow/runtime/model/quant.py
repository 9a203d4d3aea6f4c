"""Weight-only int8 and int4 linear layers on the CPU, through torch's own kernels, quantized as a stage loads.

- int8 (``{"bits": 8}``): symmetric, one scale per output row; ``aten._weight_int8pack_mm``.
- int4 (``{"method": "int4-fast"}``): asymmetric in groups of INT4_GROUP inputs (a scale and a zero per
  group and row), packed once by ``aten._convert_weight_to_int4pack_for_cpu``; ``aten._weight_int4pack_mm_for_cpu``.

Both kernels are vectorised for bfloat16 activations only: called with float32 rows they ran 6-40
times slower than a float32 matmul on this project's 2-core AVX-512 EPYC, with bfloat16 rows 2-5 times
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
  (a test compares the bytes; that config's other defaults: no double quantization, uint8 storage). On a CPU each call dequantizes its weight with bitsandbytes and multiplies in float32:
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
from collections.abc import Sequence
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from core.quantization import INT4_FAST, INT8, LORA_MODES, NF4, NONE, SPLIT_MAX_ROWS
from events.fellow import CAP_CPU_INT4, CAP_CPU_INT8, CAP_INT4_FAST, CAP_QUANTIZED
from fellow.runtime.model.fused import FusedLayer, bias_of, fusable, strip_linears

log = logging.getLogger(__name__)

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
                 "row_limit", "float32_rows")

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
        if kernel == "int8":
            self.weight, self.scales = quantize_int8(weight)
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
                    raise Int4Unavailable(_one_line(exc)) from exc
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
        return self.weight.numel() * self.weight.element_size() + scales.numel() * scales.element_size() + extra


PEFT_UNFUSED = "SWARM_SERVE_LORA=peft: adapters through PEFT's LoRA layers, in the layers' HF forward"
LEAN16_DTYPE = torch.bfloat16  # lean16's adapters on a stage that computes in float32 (every CPU stage)


class LeanLoRA:
    """A linear with LoRA adapters kept apart (lean LoRA, the spec's TS7): ``base(x) + (x A^T) B^T`` with
    PEFT's scale folded into B, the add one ``addmm``, and no per-call Python beyond that. One weight of
    a fused layer ([q; k; v], [gate; up]) takes its modules' adapters side by side: their A's stacked,
    their B's block-diagonal, each in its module's rows of the output.

    ``dtype``: what A and B are held and multiplied in. float32 (``lean``): the product as PEFT computes
    it over a float32 stage. A half dtype (``lean16``): half the adapters' memory, the product rounded in
    half precision, then added to the base's float32 result."""

    __slots__ = ("base", "a", "b", "kernel", "in_features", "out_features")

    def __init__(self, base, parts: Sequence[tuple[int, torch.Tensor, torch.Tensor]], scale: float,
                 dtype: torch.dtype = torch.float32) -> None:
        """``parts``: (first output row, A [r, in], B [rows, r]) per adapted module of ``base``."""
        self.base = base
        self.kernel = f"{base.kernel}+lora" if dtype == torch.float32 else f"{base.kernel}+lora16"
        self.in_features, self.out_features = base.in_features, base.out_features
        device = _device_of(base)  # the adapters sit beside the base weight (on its card)
        self.a = torch.cat([a.detach().float() for _, a, _ in parts]).to(device=device, dtype=dtype).contiguous()
        b_full = torch.zeros(self.out_features, self.a.shape[0], device=device)
        col = 0
        for row, a, b in parts:
            b_full[row : row + b.shape[0], col : col + a.shape[0]] = b.detach().to(device).float() * scale
            col += a.shape[0]
        self.b = b_full.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows = x.reshape(-1, self.in_features)
        flat = out.view(-1, self.out_features)
        if self.a.dtype == flat.dtype:
            torch.addmm(flat, rows @ self.a.t(), self.b.t(), out=flat)
        else:  # lean16: the product in half precision, one cast in and one add out
            flat.add_((rows.to(self.a.dtype) @ self.a.t()) @ self.b.t())
        return out

    @property
    def bytes(self) -> int:
        return self.base.bytes + self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()


def peft_lora(base: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float) -> nn.Module:
    """``SWARM_SERVE_LORA=peft``: PEFT's own LoRA layer over ``base`` (a QuantModule), holding this
    module's A [r, in] and B [out, r] at PEFT's scale (alpha = scale x r), in float32."""
    import warnings

    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as PeftLinear

    rank = a.shape[0]
    with warnings.catch_warnings():  # PEFT warns of any base it does not know; a QuantModule is called alike
        warnings.filterwarnings("ignore", message="Unsupported layer type")
        layer = PeftLinear(base, "default", LoraConfig(r=rank, lora_alpha=scale * rank), r=rank,
                           lora_alpha=scale * rank)
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(a.detach().float())
        layer.lora_B["default"].weight.copy_(b.detach().float())
    layer.lora_A.to(_device_of(base)), layer.lora_B.to(_device_of(base))
    return layer.eval().requires_grad_(False)


def _device_of(base) -> torch.device:
    """Where a linear's weight is (a QuantModule's, a QuantLinear's, a fused Linear's)."""
    base = getattr(base, "linear", base)
    weight = getattr(base, "weight", None)
    return weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")


class QuantModule(nn.Module):
    """A QuantLinear where an ``nn.Linear`` was, for layers that run through their HF forward."""

    def __init__(self, linear: QuantLinear) -> None:
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.linear.kernel}"


class QuantEmbedding(nn.Module):
    """An embedding table held as an int8 QuantLinear's rows (one scale a row), each looked-up row scaled
    back to ``dtype``. Over a tied head it is the head's own int8 weight: one table for both. torch's int8
    rows keep their scale; bitsandbytes' keep their absmax, so a row's scale is that over 127."""

    INT8_ROWS = ("int8", "bnb-int8")

    def __init__(self, linear: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if linear.kernel not in self.INT8_ROWS or linear.bias is not None:
            raise ValueError(f"an embedding table is held in int8 rows, not {linear.kernel}")
        self.linear = linear
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = linear.out_features, linear.in_features
        # torch's int8 rows: the linear's own scales; bitsandbytes': a vector of its own (stage_weights counts it)
        self.row_scales = linear.scales if linear.kernel == "int8" else linear.scales.float() / 127

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.linear.weight[ids].to(self.dtype)
        return rows.mul_(self.row_scales[ids].to(self.dtype).unsqueeze(-1))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows"


def quantize_children(module: nn.Module, method: str) -> int:
    """Swap every plain ``nn.Linear`` under ``module`` for its quantized QuantModule; returns how many."""
    swapped = 0
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, QuantModule(QuantLinear(child.weight.detach(), bias_of(child), method)))
            swapped += 1
        else:
            swapped += quantize_children(child, method)
    return swapped


# --- what this machine runs ----------------------------------------------------------------------

def _kernel_runs(method: str, device: torch.device) -> bool:
    """Whether ``method``'s kernel on ``device`` computes what it should: on a small weight at 1 and 3 rows,
    against float32 over its own dequantized weight (the input as the kernel reads it), and a row's result
    the same alone as beside others (exactly for torch's CPU kernels; to rounding for bitsandbytes', and
    on a card, whose kernels may differ by row count)."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 128, generator=generator) * 0.05).to(device)
    x = torch.randn(3, 128, generator=generator).to(device)
    linear = QuantLinear(weight, None, method)
    rows = x.to(ACT).float() if linear.kernel in ("int8", "int4", "int4-tinygemm") else \
        x.half().float() if linear.kernel == "bnb-int8" else x
    want = F.linear(rows, linear.dequantized())
    got = linear(x).float()
    alone = linear(x[:1]).float()
    exact = linear.kernel in ("int8", "int4")
    ok = torch.allclose(got, want, atol=0.05, rtol=0.02) and (
        torch.equal(alone, got[:1]) if exact else torch.allclose(alone, got[:1], atol=1e-2 if device.type == "cuda" else 1e-5))
    if linear.kernel == "bnb-nf4":  # the weight it dequantizes is the one it was given, within NF4's steps
        ok = ok and float((linear.dequantized() - weight).abs().max()) < 0.2 * float(weight.abs().max())
    return bool(ok)


PROBE_ERRORS = (ImportError, RuntimeError, ValueError, AttributeError, NotImplementedError, TypeError)


def probe() -> list[str]:
    """The weight-only capabilities whose kernels run here and compute what they should (_kernel_runs).

    A fellow without CUDA: torch's CPU int8 and int4 kernels (CAP_CPU_INT8, CAP_CPU_INT4), and NF4
    (CAP_QUANTIZED) where bitsandbytes' CPU NF4 and the int8 head's kernel run. A fellow with CUDA, whose
    quantized loads placement puts on its cards: CAP_QUANTIZED where bitsandbytes' NF4 and int8 run on
    every card, CAP_INT4_FAST where the int4 kernel does (every card Ampere or newer)."""
    caps: list[str] = []

    def runs(method: str, device: torch.device, cap: str) -> bool:
        try:
            if _kernel_runs(method, device):
                return True
            log.info("%s not declared: %s on %s differs from float32 over the same weight", cap, method, device)
        except PROBE_ERRORS as exc:
            log.info("%s not declared: %s on %s: %s", cap, method, device, _one_line(exc))
        return False

    cpu = torch.device("cpu")
    for method, cap in ((INT8, CAP_CPU_INT8), (INT4_FAST, CAP_CPU_INT4)):
        if runs(method, cpu, cap):
            caps.append(cap)
    if not torch.cuda.is_available():
        if CAP_CPU_INT8 in caps and runs(NF4, cpu, CAP_QUANTIZED):  # its head is int8
            caps.append(CAP_QUANTIZED)
        return caps
    cards = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if all(runs(NF4, card, CAP_QUANTIZED) and runs(INT8, card, CAP_QUANTIZED) for card in cards):
        caps.append(CAP_QUANTIZED)
    if all(runs(INT4_FAST, card, CAP_INT4_FAST) for card in cards):
        caps.append(CAP_INT4_FAST)
    return caps


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


# --- a stage, quantized as it loads ----------------------------------------------------------------

class StageQuantizer:
    """Quantizes a stage's layers one by one as ``build_stage_modules`` materializes them.

    Llama-family layers become fused layers over quantized weights at once (fellow.runtime.model.fused);
    others keep their HF forward with each ``nn.Linear`` swapped for a QuantModule. ``make`` makes
    each quantized weight: ``chooser.linear`` (kernels.quant_chooser's, which times each shape for the status).
    """

    def __init__(self, method: str, config, device: torch.device, chooser, lora_scale: float | None = None,
                 lora: str = "lean") -> None:
        if lora not in LORA_MODES:
            raise ValueError(f"LoRA adapters are served {' or '.join(LORA_MODES)}, not {lora!r}")
        if method == NONE:
            raise ValueError("StageQuantizer quantizes; a 'none' stage takes the float path")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"{method} weight-only kernels are served on a CPU or a CUDA card, not {device.type}")
        self.method = method
        self.config = config
        self.device = device
        self.chooser = chooser
        self.make = chooser.linear
        self.fused: dict[int, object] = {}  # absolute layer index -> FusedLayer
        self.swapped = 0  # nn.Linear swapped in layers that keep their HF forward
        self.why_not_fused: str | None = None
        self.lora_scale = lora_scale  # PEFT's alpha / r of the adapters kept unmerged (None: no adapters)
        self.adapted = 0  # modules whose adapters stay apart
        self.lora = lora  # SWARM_SERVE_LORA: lean, lean16 (LEAN16_DTYPE adapters) or peft (PEFT's layers, HF forward)
        self.peft = lora == "peft" and lora_scale is not None  # no layer fuses: PEFT's layers are HF modules

    def layer(self, index: int, layer: nn.Module, adapters: dict[str, torch.Tensor] | None = None) -> None:
        pairs = _lora_pairs(adapters or {})
        if pairs and self.lora_scale is None:
            raise ValueError("LoRA adapters kept apart need their scale (the adapter config)")
        why = PEFT_UNFUSED if self.peft else fusable([layer], self.config, self.device)
        lean = {"scale": self.lora_scale, "dtype": LEAN16_DTYPE if self.lora == "lean16" else torch.float32}
        if why is None:
            heads = self.config.num_attention_heads
            offsets = {name: _rows_before(layer, group, name) for group in FUSED_GROUPS.values() for name in group}
            fused = FusedLayer(layer, self.make, heads, self.config.num_key_value_heads)
            for attr, group in FUSED_GROUPS.items():
                parts = [(offsets[name], *pairs.pop(name)) for name in group if name in pairs]
                if parts:
                    setattr(fused, attr, LeanLoRA(getattr(fused, attr), parts, **lean))
                    self.adapted += len(parts)
            self.fused[index] = fused
            strip_linears(layer)
        else:
            self.why_not_fused = why
            self.swapped += quantize_children(layer, self.method)
            for name in list(pairs):
                module = layer.get_submodule(name)
                if self.peft:
                    parent, _, child = name.rpartition(".")
                    setattr(layer.get_submodule(parent), child, peft_lora(module, *pairs.pop(name), self.lora_scale))
                else:
                    module.linear = LeanLoRA(module.linear, [(0, *pairs.pop(name))], **lean)
                self.adapted += 1
        if pairs:
            raise ValueError(f"LoRA adapters on {', '.join(sorted(pairs))} are not served unmerged")

    def fused_layers(self, indices: Sequence[int]):
        """The fused layers in order, or None when some layer kept its HF forward."""
        if self.why_not_fused is not None or any(i not in self.fused for i in indices):
            return None
        return [self.fused[i] for i in indices]

    def head(self, head: nn.Module) -> nn.Module:
        """The head, quantized with HEAD_METHOD (a tied head's copy: ``embed`` then shares it)."""
        if type(head) is not nn.Linear:
            return head
        return QuantModule(QuantLinear(head.weight.detach(), bias_of(head), HEAD_METHOD[self.method]))

    def embed(self, embed: nn.Module, head: nn.Module | None = None) -> nn.Module:
        """The embedding table in int8 rows (QuantEmbedding); ``head``: the quantized head of a tied model,
        whose int8 weight then serves both. Another kind of embedding module stays as it is."""
        if type(embed) is not nn.Embedding or embed.max_norm is not None:
            return embed
        linear = head.linear if isinstance(head, QuantModule) and head.linear.kernel in QuantEmbedding.INT8_ROWS else \
            QuantLinear(embed.weight.detach(), None, INT8)
        return QuantEmbedding(linear, embed.weight.dtype)


# the fused layer's weights and the HF modules each stacks, in output order
FUSED_GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
                "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def _rows_before(layer: nn.Module, group: Sequence[str], name: str) -> int:
    """The first output row of module ``name`` in its fused weight (the modules before it, stacked)."""
    return sum(layer.get_submodule(n).out_features for n in group[: group.index(name)])


def _lora_pairs(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A, B) from ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``."""
    pairs = {}
    for key, a in adapters.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise ValueError(f"adapter tensor {key} is of a LoRA kind not served unmerged")
            continue
        module = key.split(".lora_A.")[0]
        b = adapters.get(f"{module}.lora_B.weight")
        if b is None:
            raise ValueError(f"LoRA weight {key} has no partner lora_B")
        pairs[module] = (a, b)
    return pairs


def weights_report(stage, method: str) -> dict:
    """What the load's status shows of a stage's weights: the method it really serves, the bytes it
    measures its weights take, and what the same parameters take in its compute dtype."""
    measured, parameters = stage_weights(stage)
    return {"quantization": method, "bytes": measured, "parameters": parameters,
            "float_bytes": parameters * torch.finfo(stage.dtype).bits // 8}


def stage_weights(stage) -> tuple[int, int]:
    """(bytes, parameters) of every weight the stage holds: its layers (fused or not), embeddings, norm
    and head. A quantized weight counts its packed bytes and scales, and its float weight's parameters;
    a tensor shared by two pieces (a tied head's embedding table) counts its bytes once and its parameters
    for each piece, as the float32 stage, which holds two copies, counts them."""
    seen: set[int] = set()
    totals = [0, 0]

    def add(t: torch.Tensor | None, parameters: int | None = None) -> None:
        if t is None or t.device.type == "meta":
            return
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a oneDNN-packed weight has no plain storage
            key = id(t)
        if key in seen:
            return
        seen.add(key)
        totals[0] += t.numel() * t.element_size()
        totals[1] += t.numel() if parameters is None else parameters

    def add_linear(linear) -> None:
        if isinstance(linear, LeanLoRA):
            add(linear.a, 0), add(linear.b, 0)  # held beside the base weights; not base parameters
            linear = linear.base
        if isinstance(linear, QuantLinear):
            add(linear.weight, linear.out_features * linear.in_features)
            add(linear.scale_tensor, 0)
        else:
            add(linear.weight, linear.out_features * linear.in_features)
        add(linear.bias)

    embed, head = stage.embed, stage.head
    if isinstance(embed, QuantEmbedding) and isinstance(head, QuantModule) and embed.linear is head.linear:
        totals[1] += head.linear.out_features * head.linear.in_features  # one table held for two: both counted
    for module in (*stage.layers, stage.embed, stage.norm, stage.head):
        if module is None:
            continue
        if isinstance(module, QuantEmbedding):
            add(module.row_scales, 0)
        for name, t in module.named_parameters():
            add(t, 0 if "lora_" in name else None)  # PEFT's adapter layers: held, not base parameters
        for t in module.buffers():
            add(t)
        for sub in module.modules():
            linear = getattr(sub, "linear", None)  # QuantModule, the fused head (_HeadLinear)
            if linear is not None and hasattr(linear, "in_features"):
                add_linear(linear)
    if stage.fused is not None:
        for layer in stage.fused.layers:
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                add_linear(linear)
            add(layer.input_norm[0]), add(layer.post_norm[0])
            if layer.qk_norm is not None:
                add(layer.qk_norm[0], 0)  # a row per head, expanded from the HF norms' weights
    return totals[0], totals[1]
