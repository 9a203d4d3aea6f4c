"""How the compiled decode step (``compiled.DecodeGraph``) multiplies by each of a stage's weights.

- A plain float32 weight (``fused.Linear``, MKL's or oneDNN's form), at one row: a product and a sum
  over its plain form, frozen, which inductor writes as one parallel loop that streams the weight at
  twice the speed of MKL's one-row GEMV on two cores (``REDUCE``); or the project's AVX2 kernel
  (``KERNEL``: ``swarm::f32_rows``, ``f32_gemv``), faster at streaming but opaque, so inductor fuses
  nothing into it; or ``F.linear`` (``LINEAR``), which inductor's GEMM templates serve under max-autotune,
  as every call of more rows. None wins on every shape (46M Qwen3 h512: a step of 8.6 ms reduced against
  10.5 with the templates, which also added 318 MB to the process against 80; 36M h384 with 20 layers:
  8.8 against 8.2; the kernel served in one of three peers runs, docs/benchmarks.md), so the background
  compile builds each and serves the fastest (``background_compile``).
- A quantized one (``quant.linear.QuantLinear``, torch's CPU int8 and int4 kernels): the same kernel
  the fused step calls (for int8 at a few rows ``swarm::int8_rows``: ``quant.int8_gemv``), on the same
  tensors (torch's kernels read the row cast to bfloat16), so inductor fuses the norms, rotary, casts and residuals
  between the kernels. A quantized fused step
  spent as long in those small ops and Python as in its matmuls (46M Qwen3, int8: 4.0 of 7.6 ms a token
  in ``_weight_int8pack_mm``).

The embedding table of a quantized stage is held in int8 rows (``quant.quantizer.QuantEmbedding``): the
graph looks a row up and scales it as that module does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fellow.runtime.model.fused import Linear

QUANT_GRAPH_KERNELS = ("int8", "int4")  # QuantLinear kernels the graph calls (torch's CPU ones)
REDUCE, KERNEL, LINEAR = "reduce", "kernel", "linear"  # how a graph multiplies one row by a float32 weight
# each form and the inductor mode it wants
GEMV_FORMS = {REDUCE: None, KERNEL: None, LINEAR: "max-autotune-no-cudagraphs"}


@dataclass(frozen=True)
class GraphLinear:
    """What the graph needs besides a weight's tensors to call it."""

    kind: str  # "float" or a QuantLinear kernel
    out_features: int
    in_features: int
    pad: int = 0  # int4: zero inputs added to a multiple of 32
    group: int = 0  # int4: inputs per scale
    few_rows: bool = False  # int8: calls of at most int8_gemv.MAX_ROWS rows go to swarm::int8_rows
    row_kernel: bool = False  # float32: one row in the kernel form goes to swarm::f32_rows


def gemv_forms() -> tuple[str, ...]:
    """The forms that can be built here: the kernel one where ``f32_gemv`` builds."""
    from fellow.runtime.kernels import f32_gemv

    return tuple(form for form in GEMV_FORMS if form != KERNEL or f32_gemv.available())


def why_not_graph(linear) -> str | None:
    """None when the graph can call this weight, else why not (one line)."""
    if type(linear) is Linear:
        return None
    from fellow.runtime.model.quant.linear import QuantLinear

    if type(linear) is not QuantLinear:
        return f"its layers carry adapters ({type(linear).__name__})"
    if linear.kernel not in QUANT_GRAPH_KERNELS:
        return f"its {linear.kernel} weights have no CPU kernel the graph can call"
    return None  # its row policy (fourbit_rows) only splits calls: each row's result is the same


def keep(module: nn.Module, name: str, linear, plain) -> GraphLinear:
    """Register ``linear``'s tensors on ``module`` as buffers under ``name`` (the same storage, not a copy,
    for quantized weights; ``plain.of`` gives a plain weight's float32 form)."""
    module.register_buffer(f"{name}_bias", linear.bias)
    if type(linear) is Linear:
        from fellow.runtime.kernels import f32_gemv  # decided here: the graph traces no library lookup

        weight = plain.of(linear)
        module.register_buffer(name, weight)
        return GraphLinear("float", linear.out_features, linear.in_features, row_kernel=f32_gemv.takes(weight))
    module.register_buffer(name, linear.weight)
    module.register_buffer(f"{name}_scales", linear.scales)
    module.register_buffer(f"{name}_scales_f32", linear.scales_f32)
    from fellow.runtime.model.quant import int8_gemv  # decided here: the graph traces no library lookup

    return GraphLinear(linear.kernel, linear.out_features, linear.in_features, linear.pad, linear.group,
                       few_rows=linear.kernel == "int8" and int8_gemv.takes(linear.in_features))


def call(module: nn.Module, name: str, spec: GraphLinear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for the weight kept under ``name``, as the fused step computes it."""
    weight, bias = getattr(module, name), getattr(module, f"{name}_bias")
    if spec.kind == "float":
        if x.numel() != spec.in_features or module.gemv == LINEAR:
            return F.linear(x, weight, bias)
        if module.gemv == KERNEL and spec.row_kernel:
            out = torch.ops.swarm.f32_rows(x.reshape(1, spec.in_features), weight).view(*x.shape[:-1], -1)
            return out if bias is None else out + bias
        # a product and a sum over each weight row, which inductor writes as one loop over the rows, both
        # threads streaming the weight (MKL's GEMV for one row ran on one thread here)
        out = (x.reshape(1, spec.in_features) * weight).sum(-1).view(*x.shape[:-1], spec.out_features)
        return out if bias is None else out + bias
    from fellow.runtime.model.quant import int8_gemv
    from fellow.runtime.model.quant.linear import ACT

    if spec.few_rows and x.numel() <= int8_gemv.MAX_ROWS * spec.in_features:
        out = torch.ops.swarm.int8_rows(x.reshape(-1, spec.in_features).float(), weight,
                                        getattr(module, f"{name}_scales_f32"))
        out = out.to(x.dtype).view(*x.shape[:-1], spec.out_features)
        return out if bias is None else out + bias
    rows = x.reshape(-1, spec.in_features).to(ACT)
    if spec.kind == "int4":
        if spec.pad:
            rows = F.pad(rows, (0, spec.pad))
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight, spec.group, getattr(module, f"{name}_scales"))
    else:
        out = torch.ops.aten._weight_int8pack_mm(rows, weight, getattr(module, f"{name}_scales"))
    if out.shape[-1] != spec.out_features:
        out = out[:, : spec.out_features]
    out = out.to(x.dtype).view(*x.shape[:-1], spec.out_features)
    return out if bias is None else out + bias


def keep_embedding(module: nn.Module, embed) -> None:
    """Register the stage's embedding table: ``embed`` (a float one) or its int8 rows and their scales."""
    if type(embed) is nn.Embedding:
        module.register_buffer("embed", embed.weight.detach())
        module.register_buffer("embed_scales", None)
    else:  # QuantEmbedding over torch's int8 rows (why_not_embedding)
        module.register_buffer("embed", embed.linear.weight)
        module.register_buffer("embed_scales", embed.row_scales)


def embedding(module: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows = F.embedding(ids, module.embed)
    if module.embed_scales is None:
        return rows
    return rows.to(dtype) * module.embed_scales[ids].to(dtype).unsqueeze(-1)


def why_not_embedding(embed) -> str | None:
    if type(embed) is nn.Embedding:
        return None
    from fellow.runtime.model.quant.quantizer import QuantEmbedding

    if type(embed) is QuantEmbedding and embed.linear.kernel == "int8":
        return None
    return f"its embeddings are a {type(embed).__name__} the graph does not read"
