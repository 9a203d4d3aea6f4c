"""Which matmul kernel each weight shape gets, chosen by timing it on this machine at load.

A stage's fused layers (fellow.runtime.model.fused) hold a handful of weight shapes. For each new
shape the chooser times the real weight under every kernel available here (torch's default, which
is MKL on this build, and oneDNN's packed form), at one row (a lone decode step) and at the stage's
batch cap, and keeps the fastest by the sum of the two. Each timed call reads the weight from memory,
as a decode step does: timed in a warm loop, small weights stayed in cache and favoured MKL, and a
16-layer stage of hidden 256 then took 33.6 ms a batch-8 step against 20.8 ms (docs/benchmarks.md).
A kernel whose calls already add up past CLEAR_LOSER times the best one's is timed no further (on a
1B model, MKL's calls of the head at eight rows were a fifth of the whole choice). What was
chosen, with its timings, goes into the load's status and the stage's log.
"""

from __future__ import annotations

import logging
import time

import torch

from events.stage_kernels import StageKernels
from fellow.runtime.model.forms.compiled import PlainWeights
from fellow.runtime.model.fused import Linear, fusable, onednn_available
from fellow.runtime.model.kv_cache import random_caches
from fellow.runtime.model.load.packed_linear import pack_stage
from fellow.runtime.model.quant import int8_gemv
from fellow.runtime.model.quant.linear import QUANT_KERNELS, QuantLinear, quant_kernel
from fellow.runtime.model.quant.lora_modes import MODES, adapters_as
from fellow.runtime.model.quant.quantizer import StageQuantizer

log = logging.getLogger(__name__)

def available_kernels(device: torch.device, dtype: torch.dtype, packed: bool = True) -> list[str]:
    """The kernels to time, the likeliest winner first (oneDNN's packed form won most shapes measured
    here), so that a clear loser's calls are cut short (CLEAR_LOSER)."""
    kernels = ["mkl"]
    if packed and device.type == "cpu" and dtype == torch.float32 and onednn_available():
        kernels.insert(0, "onednn")
    return kernels


SAMPLES = 7  # at most, timed calls per kernel and row count; the fastest counts
MIN_SAMPLES = 3  # at least
SAMPLE_BUDGET_S = 0.02  # past this much time (flushes included) spent on one kernel and row count, MIN_SAMPLES do
FLUSH_BYTES = 64 << 20  # read before each timed call, so the weight comes from memory as in a decode step
FLUSH_BIG = False  # flush before a weight as big as the flush too (bench/bench_load.py's "before")
CLEAR_LOSER = 1.5  # a kernel whose timed calls add up past this times the best kernel's sum is timed no further
WARM_BIG = False  # True: an untimed first call for a weight as big as the flush too (bench/bench_load.py's "last")


def _time(linear: Linear, x: torch.Tensor, flush: torch.Tensor | None, give_up: float = float("inf")) -> float:
    """Seconds of one call with the weight out of the caches: a decode step reads every other weight
    between two reads of this one, so a cache-warm loop would favour the wrong kernel. ``flush`` is
    None for a weight at least as big as it: reading the weight itself then evicts the last read.

    SAMPLES calls, or MIN_SAMPLES once they took over SAMPLE_BUDGET_S: a big weight's calls are long
    and steady, and a 1B model's shapes took 2.2-2.4 s to choose at seven calls each (docs/benchmarks.md).
    One call only where it took over ``give_up`` seconds: the kernel has lost already.

    A first, untimed call readies the kernel (oneDNN makes its primitive) for a small weight, whose
    calls are short enough for that to count. A big weight's first call is timed like the rest: it
    is slow anyway and the fastest call counts. On TinyLlama's shape the choice took 0.84-1.19 s
    without those untimed calls, against 0.92-1.63 s with them (docs/benchmarks.md), the same kernels.
    """
    if flush is not None or WARM_BIG:
        linear(x)
    best = float("inf")
    spent = 0.0
    for sample in range(SAMPLES):
        if (sample >= MIN_SAMPLES and spent > SAMPLE_BUDGET_S) or (sample > 0 and best > give_up):
            break
        began = time.perf_counter()
        if flush is not None:
            flush.sum()
        started = time.perf_counter()
        linear(x)
        ended = time.perf_counter()
        best = min(best, ended - started)
        spent += ended - began
    return best


class KernelChooser:
    """Makes each ``Linear`` in the kernel that measured fastest for its shape (one timing per shape)."""

    def __init__(self, kernels: list[str], batch_cap: int, make=Linear) -> None:
        self.kernels = kernels
        self.make = make  # (weight, bias, kernel) -> the linear; quant.linear.QuantLinear's maker for a quantized stage
        self.rows = sorted({1, max(1, batch_cap)})
        self.choices: dict[tuple[int, int], str] = {}
        self.timings: dict[tuple[int, int], dict[str, list[float]]] = {}
        self.seconds = 0.0
        self._flush: torch.Tensor | None = None

    @torch.inference_mode()
    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        shape = tuple(weight.shape)
        kernel = self.choices.get(shape)
        if kernel is not None:
            return self.make(weight, bias, kernel)
        started = time.perf_counter()
        best: tuple[float, Linear] | None = None
        timings: dict[str, list[float]] = {}
        if self._flush is None or self._flush.device != weight.device:
            self._flush = torch.ones(FLUSH_BYTES // 4, device=weight.device)
        big = weight.numel() * weight.element_size() >= FLUSH_BYTES and not FLUSH_BIG  # evicts itself
        flush = None if big else self._flush
        for name in self.kernels:
            candidate = self.make(weight, bias, name)
            costs: list[float] = []
            for rows in self.rows:  # a clear loser's timing stops: its ms then list fewer row counts
                give_up = float("inf") if best is None else CLEAR_LOSER * best[0] - sum(costs)
                x = torch.randn(rows, shape[1], dtype=weight.dtype, device=weight.device)
                costs.append(_time(candidate, x, flush, give_up))
                if best is not None and sum(costs) > CLEAR_LOSER * best[0]:
                    break
            timings[name] = [round(cost * 1e3, 4) for cost in costs]
            if len(costs) == len(self.rows) and (best is None or sum(costs) < best[0]):
                best = (sum(costs), candidate)
        self.choices[shape] = best[1].kernel
        self.timings[shape] = timings
        self.seconds += time.perf_counter() - started
        return best[1]

    def done(self) -> None:
        self._flush = None  # its memory back

    def summary(self) -> dict:
        """What the status shows: per shape (out x in), the kernel and its ms at each row count."""
        return {
            "rows": self.rows,
            "seconds": round(self.seconds, 3),
            "shapes": {f"{out}x{inp}": {"kernel": self.choices[(out, inp)], "ms": self.timings[(out, inp)]}
                       for (out, inp) in self.choices},
        }

    def log_line(self) -> str:
        parts = [f"{shape} {entry['kernel']} " + "/".join(f"{k}:{','.join(f'{v:.3f}' for v in ms)}"
                                                          for k, ms in entry["ms"].items())
                 for shape, entry in self.summary()["shapes"].items()]
        return f"kernels chosen in {self.seconds:.2f} s (ms at rows {self.rows}): " + "; ".join(parts)


def quant_chooser(method: str, batch_cap: int, device: torch.device = torch.device("cpu")) -> KernelChooser:
    """The chooser of a quantized stage: one kernel per method and device, timed per shape for the status."""
    kernel = quant_kernel(method, device)
    return KernelChooser([kernel], batch_cap, make=lambda weight, bias, _: QuantLinear(weight, bias, method))


def prepare_stage(stage, *, packed: bool = True, batch_cap: int = 8, quantizer: StageQuantizer | None = None,
                  keep_plain: bool = False) -> StageKernels:
    """Make a freshly loaded StageModel ready to serve: fused layers with measured kernels where the
    family allows (fellow.runtime.model.fused), else the HF layers, packed for oneDNN where that serves.
    ``quantizer``: the StageQuantizer its layers went through as they loaded (a quantized stage); its
    head is quantized here.

    Returns what the load's status shows of it: the path, and the kernel choices with their timings
    (or why the layers could not be fused). ``keep_plain``: fused weights stored in another form keep
    their plain one too, in ``stage.plain_weights``, for a compiled decode step (fellow.runtime.model.forms.compiled).
    """
    stage.plain_weights = None
    if quantizer is not None:
        return _prepare_quantized(stage, quantizer)
    devices = set(stage.layer_devices)
    why = "layers spread over several devices" if len(devices) > 1 else \
        fusable(stage.layers, stage.config, stage.layer_devices[0])
    if why is None:
        chooser = KernelChooser(available_kernels(stage.layer_devices[0], stage.dtype, packed), batch_cap)
        if keep_plain:
            stage.plain_weights = PlainWeights(chooser.linear)
        stage.fuse(stage.plain_weights.make if keep_plain else chooser.linear)
        chooser.done()
        log.info("fused layers; %s", chooser.log_line())
        return stage.note(path="fused", **chooser.summary())
    packed_layers = pack_stage(stage) if packed else 0
    log.info("HF layers (%s)%s", why, ", packed for oneDNN" if packed_layers else "")
    return stage.note(path="hf+onednn" if packed_layers else "hf", why=why)


def tied_head(stage) -> bool:
    """Whether the stage holds a head with the same weights as its embedding table: a tied model served
    as one stage, where each is loaded as its own copy of the checkpoint's table."""
    head, embed = stage.head, stage.embed
    if type(head) is not torch.nn.Linear or type(embed) is not torch.nn.Embedding or head.bias is not None:
        return False
    return head.weight.shape == embed.weight.shape and torch.equal(head.weight, embed.weight)


def _prepare_quantized(stage, quantizer: StageQuantizer) -> StageKernels:
    chooser = quantizer.chooser
    tied = tied_head(stage)
    if stage.head is not None:
        stage.head = quantizer.head(stage.head)
    if stage.embed is not None:
        stage.embed = quantizer.embed(stage.embed, stage.head if tied else None)
    layers = quantizer.fused_layers([stage.first_layer + i for i in range(len(stage.layers))])
    if layers is not None:
        stage.fuse(quantizer.make, layers)
        chooser.done()
        log.info("fused %s layers; %s", quantizer.method, chooser.log_line())
        stage.note(path="fused", **chooser.summary())
    else:
        chooser.done()
        log.info("HF layers (%s), %d linear weights %s", quantizer.why_not_fused, quantizer.swapped, quantizer.method)
        stage.note(path="hf", why=quantizer.why_not_fused)
    if stage.head is not None:
        stage.note(head=getattr(getattr(stage.head, "linear", None), "kernel", "float"))
    on_cpu = stage.layer_devices[0].type == "cpu"
    if on_cpu and "int8" in (stage.kernels.head, QUANT_KERNELS.get(quantizer.method)):
        stage.note(int8_rows=int8_gemv.rows_kernel())  # what multiplies its int8 weights in decode steps
    if quantizer.adapted:
        stage.note(lora={"mode": quantizer.lora, "modules": quantizer.adapted,
                         **({"peft": quantizer.to_peft} if quantizer.to_peft else {})})
        log.info("LoRA adapters on %d modules kept apart, served %s", quantizer.adapted, quantizer.lora)
        for kind, modules in quantizer.to_peft.items():  # what lean does not compute goes to PEFT, not refused
            log.info("LoRA %s on %d modules served through PEFT's layers: %s does not compute it", kind, modules,
                     quantizer.lora)
    return stage.kernels


STEP_COST_CONTEXT = 256  # positions already in each session's cache when a step is timed
STEP_COST_BUDGET_S = 0.1  # a batch size's steps stop repeating once the timed ones took this long
STEP_WARM_EACH = False  # True: a first, untimed step at every batch size (bench/bench_load.py's "before")
STEP_SLAB_FIRST = True  # False: an untimed step readies the largest batch even where a slab rebuild would
STEP_COST_TILE = 16  # positions of random keys and values drawn per cache, repeated over the rest


@torch.inference_mode()
def step_costs(stage, batches: list[int], repeats: int = 3) -> dict[str, float]:
    """ms of one decode step at each batch size, on caches of STEP_COST_CONTEXT random positions: the
    best of ``repeats`` steps, or fewer (at least one) once they took STEP_COST_BUDGET_S (a 1B
    model's step is over 0.2 s on a CPU). The largest batch goes first. On fused layers its sessions are
    first put in the decode slab, as a first step would (a rebuild), so no untimed step is needed: on
    TinyLlama's shape the step after that took what the following ones did (242 against 241-307 ms at
    batch 8), and an untimed step cost 0.24-0.53 s. Elsewhere (the HF layers, a compiled step) an
    untimed step goes first. The smaller batches follow with every kernel warm, an untimed step spared
    each (a batch-1 step of TinyLlama's shape took 0.18-0.32 s on the 2-core machine).

    Every position it adds is dropped with the caches, so the stage serves exactly as before.
    """
    costs: dict[str, float] = {}
    for n, rows in enumerate(sorted(batches, reverse=True)):
        caches = random_caches(stage.new_cache, rows, STEP_COST_CONTEXT, repeats + 1, tile=STEP_COST_TILE)
        if stage.is_first:
            inputs = torch.ones(rows, dtype=torch.long, device=stage.input_device)
        else:
            inputs = torch.zeros(rows, 1, stage.config.hidden_size, dtype=stage.dtype, device=stage.input_device)
        if n == 0 or STEP_WARM_EACH:
            slab = stage.fused.slab if stage.fused is not None else None
            # the sessions put in the slab (None where it would not take them): the first timed step finds them there
            slabbed = STEP_SLAB_FIRST and not STEP_WARM_EACH and slab is not None and stage.compiled is None \
                and slab.step(caches) is not None
            if not slabbed:
                stage.decode(caches, inputs)
        best, spent = float("inf"), 0.0
        for _ in range(repeats):
            if spent > STEP_COST_BUDGET_S:
                break
            started = time.perf_counter()
            stage.decode(caches, inputs)
            took = time.perf_counter() - started
            best, spent = min(best, took), spent + took
        costs[str(rows)] = round(best * 1e3, 3)
        for cache in caches:
            cache.release()
    return {str(rows): costs[str(rows)] for rows in batches}


@torch.inference_mode()
def lora_costs(stage, repeats: int = 3) -> dict[str, float] | None:
    """The spec's ``[stageN lora-cost]``: ms of one decode step (batch 1) with the adapters a quantized
    stage keeps apart served each way side by side (``peft_ms``, ``lean_ms``, ``lean16_ms``) and with them
    switched off (``off_ms``), over the same quantized weights (quant.lora_modes: the way the stage serves
    them is its own step). None where it keeps none. The adapters are back in place when it returns."""
    if not stage.kernels.lora:
        return None
    costs = {}
    for mode in MODES:
        with adapters_as(stage, mode):
            costs[f"{mode}_ms"] = step_costs(stage, [1], repeats)["1"]
    return costs
