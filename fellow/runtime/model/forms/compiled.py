"""A whole stage's decode step compiled by inductor, at the batch sizes asked (SWARM_SERVE_COMPILE).

The fused layers (fellow.runtime.model.fused) run a CPU decode step as a handful of matmuls per
layer, each through MKL or oneDNN, with torch's small ops and Python between them. Inductor, with
frozen weights and ``max-autotune``, writes the step as one program: its own GEMV kernels for one
row (``cpp_CppMicroGemmFP32Vec``: 0.64 ms against MKL's 1.30 ms for a 32,000 x 256 head) and the
norms, rotary and residuals fused around them. On bench/bench_matrix.py's six shapes a batch-1 step
took 0.44-0.72 of the fused one's time at load (docs/benchmarks.md, "The compiled decode step, served").

The attention stays outside the graph, one opaque op a layer (``swarm::attend_rows``): the fused stack's
``attend_decode``, or for one session ``attend_one`` (a C kernel). Each session writes its new position
into its own ``KVCache`` and attends to exactly its past, so the graph's shapes depend on the batch size
alone and sessions join and leave as before. (A graph over fixed-size KV buffers pays for every position
up to the buffer's end each step; one with dynamic lengths ran at 0.2-0.4 of the fused step's speed.)

Compiling takes tens of seconds per batch size on a small CPU (inductor's autotuning times each
matmul), so by default it runs on a thread of its own once the stage serves (``background_compile``);
with batch sizes asked (``SWARM_SERVE_COMPILE=1,8``) the stage compiles each at load instead. Either
way it checks the compiled step's logits against the fused step's, times both, and serves with the
compiled one only where it measured faster; its ``kernels.compiled`` says what it found, or why it
did not compile (a ring stage, adapted layers, NF4 or CUDA kernels, another device). Serves CPU stages
of the Llama family whose layers are fused, i.e. what ``fused.fusable`` accepts, in float32, int8 or
int4 (``graph_linear`` says how each weight is called).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fellow.runtime.model.forms.checked_step import CHECK_CONTEXT, CheckedStep, one_line
from fellow.runtime.model.forms.graph_linear import (
    LINEAR,
    GraphLinear,
    call,
    embedding,
    keep,
    keep_embedding,
    why_not_embedding,
    why_not_graph,
)
from fellow.runtime.model.fused import Linear, _norm

log = logging.getLogger(__name__)

COMPILE_MODE = "max-autotune-no-cudagraphs"
# graphs dynamo keeps for DecodeGraph.forward: one per stage and batch size. Every stage's step is one code
# object, so a process that loads several stages (a benchmark, the tests) passed dynamo's default of 8 and
# got an error where a compile was due
RECOMPILE_LIMIT = 64

_current = threading.local()  # the decode step in progress: its attend function and fused layers


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
    """One layer's attention for the decode step in progress: q [B, heads, 1, D], k and v [B, kv_heads,
    1, D] -> [B, 1, heads * D]. Each row writes its key and value into its session's cache and attends
    to its past there (``attend_one``, the fused stack's ``attend_decode``); opaque to inductor. An op
    through torch.library.Library rather than custom_op: 5 us of dispatch a call against 10."""
    return _current.attend(_current.layers[slot], q, k, v)


_LIBRARY = torch.library.Library("swarm", "FRAGMENT")
_LIBRARY.define("attend_rows(Tensor q, Tensor k, Tensor v, int slot) -> Tensor")
_LIBRARY.impl("attend_rows", _attend_rows, "CPU")
attend_rows = torch.ops.swarm.attend_rows


@torch.library.register_fake("swarm::attend_rows")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], 1, q.shape[1] * q.shape[3])


def why_not(stage) -> str | None:
    """None when the stage's decode step can be compiled, else why not (one line)."""
    if not (stage.is_first and stage.is_last):
        return "a ring stage: the compiled step takes a whole model (embeddings to head)"
    if stage.fused is None:
        return f"its layers are not fused ({stage.kernels.why or stage.kernels.path})"
    if stage.fused.before:
        return "a cut training made inside it runs between its layers (model.boundary)"
    if len(set(stage.layer_devices)) > 1 or stage.layer_devices[0].type != "cpu":
        return "it is not on the CPU alone"
    if stage.dtype != torch.float32:
        return f"its weights are {str(stage.dtype).removeprefix('torch.')}, not float32"
    for layer in stage.fused.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            if why := why_not_graph(getattr(layer, name)):
                return why
    head = getattr(stage.head, "linear", None)
    if head is None or (why := why_not_embedding(stage.embed) or why_not_graph(head)):
        return why or "its head is not a linear weight"
    return None


class PlainWeights:
    """The plain float32 form of each fused weight a kernel stored otherwise (oneDNN's packed form),
    kept while a stage loads, so its decode step can be compiled from them; ``make`` wraps a stage's
    linear maker."""

    def __init__(self, make) -> None:
        self._make = make
        self.by_linear: dict[int, torch.Tensor] = {}

    def make(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        linear = self._make(weight, bias)
        if linear.kernel != "mkl":
            self.by_linear[id(linear)] = weight.detach()
        return linear

    def of(self, linear: Linear) -> torch.Tensor:
        return linear.weight if linear.kernel == "mkl" else self.by_linear[id(linear)]


class DecodeGraph(nn.Module):
    """One decode step of a fused stage as one traceable forward: ids [B], cos and sin [B, 1, 1, D]
    (``fused.rotary_tables``) -> logits [B, V]. The same arithmetic as ``FusedStack.forward`` and the
    stage's head, with the attention left to ``attend_rows``."""

    def __init__(self, stage, plain: PlainWeights, gemv: str = LINEAR) -> None:
        super().__init__()
        self.gemv = gemv  # graph_linear.GEMV_FORMS
        fused = stage.fused
        self.heads, self.kv_heads, self.dim = fused.num_heads, fused.num_kv_heads, fused.head_dim
        self.hidden = stage.config.hidden_size
        self.n = len(fused.layers)
        self.eps: list[tuple[float, float, float | None]] = []
        self.intermediate: list[int] = []
        self.linears: dict[str, GraphLinear] = {}
        for i, layer in enumerate(fused.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                self.linears[f"{name}{i}"] = keep(self, f"{name}{i}", getattr(layer, name), plain)
            self.register_buffer(f"in{i}", layer.input_norm[0])
            self.register_buffer(f"post{i}", layer.post_norm[0])
            self.register_buffer(f"qk{i}", None if layer.qk_norm is None else layer.qk_norm[0])
            self.eps.append((layer.input_norm[1], layer.post_norm[1],
                             None if layer.qk_norm is None else layer.qk_norm[1]))
            self.intermediate.append(layer.intermediate)
        keep_embedding(self, stage.embed)
        self.dtype = stage.dtype
        norm_weight, self.norm_eps = _norm(stage.norm)
        self.register_buffer("norm", norm_weight)
        self.linears["head"] = keep(self, "head", stage.head.linear, plain)
        self.reads_float32 = all(spec.kind == "float" for spec in self.linears.values())

    def forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, d = ids.shape[0], self.dim
        qk_heads, half = self.heads + self.kv_heads, d // 2
        def w(name: str, i: int) -> torch.Tensor:
            return getattr(self, f"{name}{i}")

        def linear(name: str, x: torch.Tensor) -> torch.Tensor:
            return call(self, name, self.linears[name], x)

        hidden = embedding(self, ids, self.dtype)[:, None]
        for i in range(self.n):
            in_eps, post_eps, qk_eps = self.eps[i]
            qkv = linear(f"qkv{i}", F.rms_norm(hidden, (self.hidden,), w("in", i), in_eps))
            qk = qkv[..., : qk_heads * d].view(batch, 1, qk_heads, d)
            if qk_eps is not None:
                qk = F.rms_norm(qk, (d,), None, qk_eps) * w("qk", i)
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)
            q, k = qk[:, :, : self.heads].transpose(1, 2), qk[:, :, self.heads :].transpose(1, 2)
            v = qkv[..., qk_heads * d :].view(batch, 1, self.kv_heads, d).transpose(1, 2)
            attended = attend_rows(q.contiguous(), k.contiguous(), v.contiguous(), i)
            hidden = hidden + linear(f"o{i}", attended)
            normed = F.rms_norm(hidden, (self.hidden,), w("post", i), post_eps)
            gate, up = linear(f"gate_up{i}", normed).split(self.intermediate[i], dim=-1)
            hidden = hidden + linear(f"down{i}", F.silu(gate) * up)
        last = F.rms_norm(hidden[:, -1], (self.hidden,), self.norm, self.norm_eps)
        return linear("head", last)


class CompiledDecode(CheckedStep):
    """The stage's decode step at the batch sizes it compiled and measured faster than the fused step."""

    name = "compiled"

    def __init__(self, stage, plain: PlainWeights, mode: str | None = COMPILE_MODE, gemv: str = LINEAR) -> None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.graph = DecodeGraph(stage, plain, gemv)
        super().__init__(stage, self.graph.embed.shape[0], self.graph.reads_float32)
        self.fn = torch.compile(self.graph, dynamic=False, mode=mode, fullgraph=True)

    def decode(self, caches: Sequence, ids: torch.Tensor, stance: str = "fail_on_recompile") -> torch.Tensor:
        """One new position per session, as ``StageModel.decode``: logits [B, V]. ``stance``: never a
        compile in the middle of serving; ``build`` compiles with "default"."""
        for cache in caches:
            cache.reserve(1)
        cos, sin = self.rotary([cache.length for cache in caches])
        fused = self.stage.fused
        _current.attend = fused.attend_decode(caches)
        _current.layers = fused.layers
        try:
            with torch.compiler.set_stance(stance):
                # a fresh copy: the graph's guards took the ids made in inference mode, and the engine's
                # may not be
                logits = self.fn(ids.reshape(-1).clone(), cos, sin)
        finally:
            _current.attend = _current.layers = None
        for cache in caches:
            cache.advance(1)
        self.steps += 1
        return logits

    def first_decode(self, caches, ids: torch.Tensor, compiled: bool) -> torch.Tensor:
        """Compiles the step here (inductor's settings, its prints off stdout) unless ``warm`` did."""
        with _quiet_compile():
            return self.decode(caches, ids, stance="fail_on_recompile" if compiled else "default")

    @torch.inference_mode()
    def warm(self, rows: int) -> float:
        """Compile the step for ``rows`` sessions without touching a cache or the stage's decode slab (each
        layer's attention a stand-in of its shape: ``attend_rows`` is opaque to the graph), so a thread may
        do it while another serves; the seconds it took. ``build(rows, compiled=True)`` checks it after."""
        ids = torch.zeros(rows, dtype=torch.long)
        cos, sin = self.rotary([CHECK_CONTEXT] * rows)
        width = self.graph.heads * self.graph.dim
        _current.attend = lambda layer, q, k, v: q.new_zeros(q.shape[0], 1, width)  # a new tensor: no alias
        _current.layers = self.stage.fused.layers
        started = time.perf_counter()
        try:
            with _quiet_compile():
                self.fn(ids, cos, sin)
        finally:
            _current.attend = _current.layers = None
        return time.perf_counter() - started

def compile_decode(stage, batches: Iterable[int], plain: PlainWeights | None, only_faster: bool = True,
                   mode: str | None = COMPILE_MODE) -> dict:
    """Compile the stage's decode step at each batch size in ``batches`` (SWARM_SERVE_COMPILE), keeping
    it where it measured faster (``only_faster=False``: wherever its logits agree): fills the stage's step
    table's ``compiled`` slot;
    returns what the status shows. ``mode``: inductor's (None: its default, which picks no GEMM kernels
    of its own, and compiles in a third of the time)."""
    batches = sorted(set(batches))
    why = why_not(stage) or (None if plain is not None else "its plain weights were not kept at load")
    if why is not None:
        log.info("decode step not compiled: %s", why)
        return {"asked": batches, "why": why}
    resident = _resident_bytes()
    compiled = CompiledDecode(stage, plain, mode)
    found: dict[str, dict] = {}
    for rows in batches:
        try:
            found[str(rows)] = compiled.build(rows, only_faster)
        except Exception as exc:  # inductor could not build it here: the fused step serves
            log.warning("decode step at batch %d not compiled: %s", rows, exc)
            found[str(rows)] = {"serving": False, "why": one_line(exc)}
            break
    stage.steps.put("compiled", compiled if compiled.serving else None)
    log.info("[compiled] decode step %s", "; ".join(
        f"batch {rows}: " + (f"compiled {e['compiled_ms']:.2f} ms against fused {e['fused_ms']:.2f} ms"
                             if "compiled_ms" in e else "") + (f" ({e['why']})" if "why" in e else " serving")
        + (f", compiled in {e['compile_s']:.0f} s" if "compile_s" in e else "") for rows, e in found.items()))
    report = {"asked": batches, "mode": mode or "default", "batches": found, "serving": sorted(compiled.serving)}
    if resident is not None and (after := _resident_bytes()) is not None:
        # what compiling added to the process: plain copies of packed weights, inductor's frozen constants
        # and its code (not in the stage's weight bytes)
        report["resident_added_bytes"] = after - resident
    return report


def _resident_bytes() -> int | None:
    """The process's resident memory (Linux), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def _quiet_compile():
    """Inductor's settings for the compile (frozen weights), and its prints kept off stdout: a stage's
    stdout carries its reports to the agent."""
    from torch._inductor import config

    with config.patch(freezing=True, autotune_num_choices_displayed=0), contextlib.redirect_stdout(sys.stderr):
        yield
