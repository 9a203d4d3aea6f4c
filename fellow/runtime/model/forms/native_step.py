"""The decode step of up to eight sessions as one C call (``step_kernel``): the background compile's ``native`` form.

A compiled one-session step still called about six opaque ops a layer (products, attention) with
inductor's Python wrapper between them: 1.5-2 ms of a 5-9 ms step on two cores went to dispatch, not to
streaming weights (docs/benchmarks.md), and a deep, narrow model paid it most. This step runs every
layer, the head included, in one C call over the stage's own tensors (float32 weights in their plain
form, int8 ones as ``quant.int8_gemv`` reads them; int4 ones in rows of their own, ``int4_rows``, half a
byte a weight more held beside torch's packing), writing each session's new key and value into its
``KVCache`` as ``attend_one`` does. It takes the same stages as the compiled step (``compiled.why_not``)
whose shapes the kernel's loops take; ``why_not`` says otherwise. Nothing is compiled: the background
compile builds it beside its graphs at each batch size, checks its logits against the fused step's and
times it like them (``checked_step.CheckedStep.build``), and serves whichever is fastest.
"""

from __future__ import annotations

import ctypes
import functools
import time
import weakref

import torch
from torch import nn
from torch.nn import functional as F

from fellow.runtime.kernels import native, step_kernel
from fellow.runtime.model.forms.attend_one import _addresses_of
from fellow.runtime.model.forms.checked_step import CheckedStep
from fellow.runtime.model.forms.compiled import PlainWeights, why_not as why_not_compiled
from fellow.runtime.model.forms.rotary_rows import RotaryRows
from fellow.runtime.model.fused import Linear, _norm

NATIVE = "native"
_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # by cache: (its addresses, NativeStep._layout)
NAMES = ("qkv", "o", "gate_up", "down")


def why_not(stage) -> str | None:
    """None where ``NativeStep`` can serve the stage's one-session step, else why not (one line)."""
    why = why_not_compiled(stage)
    if why is not None:
        return why
    # the library is built on the compile thread (``warm``: 3 s of the C compiler once per cache), not here,
    # before the stage is ready; only a build that failed already, or a CPU it cannot run on, rules it out
    if not native.cpu_has_avx2_fma():
        return "this CPU lacks AVX2 or FMA"
    if step_kernel.STEP.failed():
        return step_kernel.unavailable_reason()
    fused = stage.fused
    if fused.head_dim % 2 or fused.head_dim > step_kernel.MAX_DIM:
        return f"its head size {fused.head_dim} is not one the step kernel rotates"
    linears = [getattr(layer, name) for layer in fused.layers for name in NAMES] + [stage.head.linear]
    for linear in linears:
        if type(linear) is Linear:
            if linear.in_features % 8:
                return f"a float32 weight of {linear.in_features} inputs (the kernel reads eights)"
        elif linear.kernel not in ("int8", "int4"):
            return f"its {linear.kernel} weights (the kernel reads float32, int8 or int4)"
        elif linear.kernel == "int4" and linear.out_features % 32:
            return f"an int4 weight of {linear.out_features} outputs (torch packs them in 32s)"
        elif linear.kernel == "int4" and int4_packing() is None:
            return "torch's int4 packing on this CPU is not one the kernel reads"
    if type(stage.embed) is nn.Embedding and stage.embed.weight.dtype != torch.float32:
        return "its embeddings are not float32"
    cos, _ = RotaryRows(stage.rotary_emb, stage.dtype)([0])
    if cos.shape[-1] != fused.head_dim:
        return "its rotary covers part of each head"
    return None


class NativeStep(CheckedStep):
    """The step's protocol (``checked_step``: build, decode, serves, give_up) over one C call a step of 1 to
    ``step_kernel.MAX_ROWS`` sessions."""

    name = "native"

    def __init__(self, stage, plain: PlainWeights) -> None:
        fused, head = stage.fused, stage.head.linear
        linears = [getattr(layer, name) for layer in fused.layers for name in NAMES] + [head]
        super().__init__(stage, head.out_features, all(type(linear) is Linear for linear in linears))
        self._kept: list[torch.Tensor] = []  # every tensor whose address the structs hold
        self._weight_bytes = 0
        self.layers = (step_kernel.Layer * len(fused.layers))()
        widths, outs = [fused.num_heads * fused.head_dim], []
        for layer, spec in zip(fused.layers, self.layers):
            for name in NAMES:
                setattr(spec, name, self._lin(getattr(layer, name), plain))
                widths.append(getattr(spec, name).k)
            outs += [layer.qkv.out_features, layer.gate_up.out_features]
            spec.in_norm, spec.in_eps = self._ptr(layer.input_norm[0]), layer.input_norm[1]
            spec.post_norm, spec.post_eps = self._ptr(layer.post_norm[0]), layer.post_norm[1]
            if layer.qk_norm is not None:
                spec.qk_norm, spec.qk_eps = self._ptr(layer.qk_norm[0]), layer.qk_norm[1]
            spec.scaling = layer.scaling
            spec.window = fused.windows.get(layer.layer_idx) or 0
        norm_weight, norm_eps = _norm(stage.norm)
        head_lin = self._lin(head, plain)
        width = max(widths + [head_lin.k])
        if type(stage.embed) is nn.Embedding:
            embed, embed_scale = self._ptr(stage.embed.weight.detach()), None
        else:  # QuantEmbedding: int8 rows and a scale a row
            embed, embed_scale = self._ptr(stage.embed.linear.weight, torch.int8), self._ptr(stage.embed.row_scales)
        hidden = stage.config.hidden_size
        self.model = step_kernel.Model(
            layers=len(fused.layers), hidden=hidden, heads=fused.num_heads, kv_heads=fused.num_kv_heads,
            dim=fused.head_dim, embed=embed, embed_scale=embed_scale, norm=self._ptr(norm_weight),
            norm_eps=norm_eps, head=head_lin, width=width,
            parallel=int(self._weight_bytes >= step_kernel.PARALLEL_BYTES))
        self.model.most = max(outs)
        self._work = torch.empty(step_kernel.MAX_ROWS * (hidden + width + fused.num_heads * fused.head_dim
                                                          + max(outs)))
        self._args = (ctypes.byref(self.model), ctypes.addressof(self.layers))

    def _ptr(self, tensor: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> int | None:
        if tensor is None:
            return None
        tensor = tensor.detach().to(dtype).contiguous()
        self._kept.append(tensor)
        return tensor.data_ptr()

    def _lin(self, linear, plain: PlainWeights) -> step_kernel.Lin:
        """A quantized weight whose inputs are not a multiple of 32 is read as one padded with zero columns
        (int4: QuantLinear's own padding; int8: a padded copy): its ``k`` the padded count, ``kin`` the real
        one, past which the kernel quantizes the inputs as zeros."""
        n, kin = linear.out_features, linear.in_features
        bits = 32 if type(linear) is Linear else 8 if linear.kernel == "int8" else 4
        k = kin if bits == 32 else kin + -kin % 32
        self._weight_bytes += n * k * bits // 8
        if bits == 32:
            return step_kernel.Lin(w=self._ptr(plain.of(linear)), scale=None, bias=self._ptr(linear.bias), n=n, k=k,
                                   bits=32, kin=kin)
        if bits == 8:
            weight = F.pad(linear.weight, (0, k - kin)) if k > kin else linear.weight  # padded: a copy
            return step_kernel.Lin(w=self._ptr(weight, torch.int8),
                                   scale=self._ptr(linear.scales_f32), bias=self._ptr(linear.bias), n=n, k=k, bits=8,
                                   kin=kin)
        weight, scales = int4_rows(linear)
        return step_kernel.Lin(w=self._ptr(weight, torch.uint8), scale=self._ptr(scales), bias=self._ptr(linear.bias),
                               n=n, k=k, bits=4, group=linear.group, kin=kin)

    def warm(self, rows: int) -> float:
        """No graph to compile: the kernel's library built, where it was not yet (on the compile thread); the
        seconds that took. Where it does not build, ``build`` says why."""
        started = time.perf_counter()
        step_kernel.available()
        return time.perf_counter() - started

    def build(self, rows: int, only_faster: bool = True, compiled: bool = False) -> dict:
        if not step_kernel.available():
            raise RuntimeError(step_kernel.unavailable_reason())
        if not 1 <= rows <= step_kernel.MAX_ROWS:
            raise RuntimeError(f"the native step takes 1 to {step_kernel.MAX_ROWS} sessions")
        return super().build(rows, only_faster, compiled)

    def decode(self, caches, ids: torch.Tensor) -> torch.Tensor:
        """One new position per session, as ``StageModel.decode``: logits [B, V]."""
        rows = len(caches)
        pointers = (ctypes.c_void_p * rows)()
        for i, cache in enumerate(caches):
            cache.reserve(1)
            pointers[i] = self._layout(cache).data_ptr()
        lengths = [cache.length for cache in caches]
        cos, sin = self.rotary(lengths)
        tokens = ids.reshape(-1).to(torch.int64).contiguous()
        where = torch.tensor(lengths, dtype=torch.int64)
        logits = torch.empty(rows, self.vocab)
        step_kernel.STEP.fn(*self._args, rows, tokens.data_ptr(), where.data_ptr(), pointers, cos.data_ptr(),
                            sin.data_ptr(), logits.data_ptr(), self._work.data_ptr())
        for cache in caches:
            cache.advance(1)
        self.steps += 1
        return logits

    def _layout(self, cache) -> torch.Tensor:
        """The session's cache as the kernel reads it: [layers, 4] int64 (keys and values addresses, head and
        position strides), kept per cache until its buffers change (``attend_one._addresses_of``)."""
        addresses = _addresses_of(cache)
        if addresses is None:
            raise RuntimeError("a session's cache holds buffers the kernel does not read")
        kept = _layouts.get(cache)
        if kept is None or kept[0] is not addresses:
            layout = torch.tensor([addresses[layer.layer_idx] for layer in self.stage.fused.layers], dtype=torch.int64)
            kept = _layouts[cache] = (addresses, layout)
        return kept[1]


def int4_rows(linear) -> tuple[torch.Tensor, torch.Tensor]:
    """An int4 QuantLinear's weight as the step kernel reads it: uint8 [N, K / 2], each 32 inputs' 16 bytes
    holding input i low and input i + 16 high; and float32 [N, K / group, 2], each group's scale and offset
    (a weight is q * scale + offset). From torch's CPU packing (``int4_values``)."""
    n, k = linear.out_features, linear.in_features + linear.pad  # as packed: the inputs padded to 32s
    values = int4_values(linear.weight.view(torch.uint8), n, k).reshape(n, k // 32, 2, 16)
    rows = (values[:, :, 0] | (values[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    scale, zero = linear.scales[:, :n].float().unbind(-1)  # [K / group, N] each: q * scale + zero - 8 * scale
    return rows, torch.stack([scale, zero - 8 * scale], dim=-1).transpose(0, 1).contiguous()


def int4_values(packed: torch.Tensor, n: int, k: int, packing: tuple[int, bool] | None = None) -> torch.Tensor:
    """The uint8 [N, K] values (0-15) that ``aten._convert_weight_to_int4pack_for_cpu`` packed. Its layout
    follows the CPU capability torch dispatches to (``int4_packing``): blocks of ``block`` outputs, one input
    after another, block / 2 bytes an input; a whole block's byte b holds output b low and b + block / 2
    high where the capability vectorizes (``halves``), else outputs 2b and 2b + 1, as a last, short block
    always does."""
    block, halves = packing or int4_packing()
    whole = n // block * block
    out = torch.empty(n, k, dtype=torch.uint8)
    if whole:
        part = packed.reshape(-1)[:whole * k // 2].reshape(whole // block, k, block // 2)
        nibbles = (torch.cat if halves else torch.stack)([part & 15, part >> 4], dim=-1)
        out[:whole] = nibbles.reshape(whole // block, k, block).permute(0, 2, 1).reshape(whole, k)
    if n > whole:
        part = packed.reshape(-1)[whole * k // 2:].reshape(k, (n - whole) // 2)
        out[whole:] = torch.stack([part & 15, part >> 4], dim=-1).reshape(k, n - whole).t()
    return out


PACKINGS = ((64, True), (32, True), (32, False))  # AVX-512, AVX2, no vectors


@functools.cache
def int4_packing() -> tuple[int, bool] | None:
    """(block, halves) of torch's CPU int4 packing in this process, read once off a packed probe whose last
    block is short; None where none of ``PACKINGS`` reads it back."""
    probe = torch.randint(0, 16, (176, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 2).view(torch.uint8)
    return next((p for p in PACKINGS if torch.equal(int4_values(packed, 176, 64, p).int(), probe)), None)
