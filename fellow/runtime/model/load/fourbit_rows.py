"""4-bit matmuls of a few rows: split into calls of the row count this card runs fastest, and computed in
float32 where that is clearly faster, both measured at load (SWARM_SERVE_4BIT_ROWS, SWARM_SERVE_4BIT_FLOAT32).

- Row limits. bitsandbytes picks its 4-bit kernel by architecture and row count: on a GTX 1660 SUPER
  (Turing, no tensor cores) the one it takes from 4 rows on was 4.5 times slower than the one for 3,
  so a decode step of 4 sessions cost more than two steps of 3. A stage times one block (one call of
  each 4-bit weight of its first layer) at 1 to SPLIT_MAX_ROWS rows, and takes as its limit the row
  count whose time per row is least (the largest within ROW_TIE of it, so a flat curve is not split);
  a call of more rows than the limit, and at most SPLIT_MAX_ROWS, then runs as calls of at most the
  limit. Calls of more rows (prompt pieces) are never split. Each row's result is the same either way.
- float32 (TS12). A stage that does not compute in float32 already also times the block with its input
  cast to float32 and its result back, at 1 to SPLIT_MAX_ROWS rows and at a prompt piece's width
  (SWARM_SERVE_PREFILL_CHUNK), and computes in float32 the row counts where that saves at least
  FLOAT32_SAVING. Only the input and the result change dtype: weights, adapters and the KV cache stay
  as they were. The row limit is chosen over the faster of the two at each count.
- Measured on CUDA only (the pathology is a card's kernel choice): on a CPU stage ``auto`` keeps every
  call whole and in its dtype, and says so. A fixed limit (SWARM_SERVE_4BIT_ROWS=N) applies on any
  device without measuring. A quantized stage is never split over devices, so one card's block speaks
  for the stage.

``quant.linear.QuantLinear`` applies the policy (``row_limit``, ``float32_rows``); this module measures,
chooses, sets it on every 4-bit weight of the stage (the int8 head is left as it is), logs the spec's
``[stageN 4bit-rows]`` line and returns what ``kernels.fourbit_rows`` shows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from core.quantization import SPLIT_MAX_ROWS, fourbit_rows_value
from events.fellow import CAP_4BIT_ROWS
from fellow.runtime.model.quant.linear import FOUR_BIT_KERNELS, QuantLinear
from fellow.runtime.model.quant.lora import LeanLoRA
from fellow.runtime.model.quant.quantizer import QuantModule

log = logging.getLogger(__name__)

AUTO, OFF = "auto", "off"
ROW_COUNTS = tuple(range(1, SPLIT_MAX_ROWS + 1))
FLOAT32_SAVING = 0.15  # float32 at a row count saving at least this share of the stage dtype's time
ROW_TIE = 0.05  # time per row within this share of the least counts as a tie; the largest count wins
DEFAULT_PIECE = 256  # a prompt piece's width where SWARM_SERVE_PREFILL_CHUNK is 0 (the prompt at once)
WARMUP, REPEATS = 2, 5  # calls before timing; timed rounds, the best kept
CALLS = {"cuda": 10, "cpu": 2}  # calls of the block per timed round

# (linears, rows, float32) -> ms of one call of each linear at ``rows`` rows
TimeBlock = Callable[[Sequence[QuantLinear], int, bool], float]


def capabilities(has_cuda: bool, rows: str) -> list[str]:
    """What a fellow declares of this module: ``serve-4bit-rows`` where its stages run on CUDA (whose
    4-bit kernels the row limit is measured for) and SWARM_SERVE_4BIT_ROWS is not off."""
    return [CAP_4BIT_ROWS] if has_cuda and str(rows).strip().lower() != OFF else []


def _base(linear) -> QuantLinear | None:
    linear = linear.base if isinstance(linear, LeanLoRA) else linear
    return linear if isinstance(linear, QuantLinear) and linear.kernel in FOUR_BIT_KERNELS else None


def stage_blocks(stage) -> list[list[QuantLinear]]:
    """The 4-bit QuantLinears of each of the stage's layers, in order: a fused layer's qkv, o, gate_up and
    down, or the QuantModules of a layer that keeps its HF forward (under LeanLoRA or PEFT's layers too)."""
    blocks = []
    if stage.fused is not None:
        for layer in stage.fused.layers:
            blocks.append([b for b in (_base(getattr(layer, a)) for a in ("qkv", "o", "gate_up", "down")) if b])
    else:
        for layer in stage.layers:
            blocks.append([b for b in (_base(m.linear) for m in layer.modules() if isinstance(m, QuantModule)) if b])
    return blocks


def measure_block(linears: Sequence[QuantLinear], rows: int, float32: bool, dtype: torch.dtype) -> float:
    """ms of one call of each of ``linears`` at ``rows`` rows of ``dtype`` (float32: cast up, and the
    result back, as ``QuantLinear`` does), the best of REPEATS rounds, synchronized on CUDA."""
    device = linears[0].weight.device
    generator = torch.Generator(device=device).manual_seed(rows)
    inputs = [torch.randn(rows, lin.in_features, generator=generator, device=device).to(dtype) for lin in linears]
    cuda = device.type == "cuda"

    def block() -> None:
        for lin, x in zip(linears, inputs):
            if float32 and dtype != torch.float32:
                lin._call(x.float()).to(dtype)
            else:
                lin._call(x)

    calls = CALLS.get(device.type, 2)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(WARMUP):
            block()
        for _ in range(REPEATS):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                block()
            if cuda:
                torch.cuda.synchronize(device)
            best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def choose_row_limit(ms: dict[int, float]) -> int:
    """The row count of least time per row, the largest within ROW_TIE of it; 0 (no split) where that is
    SPLIT_MAX_ROWS. ``ms``: the block's time at each of ROW_COUNTS."""
    per_row = {m: ms[m] / m for m in ROW_COUNTS}
    least = min(per_row.values())
    limit = max(m for m, t in per_row.items() if t <= least * (1 + ROW_TIE))
    return 0 if limit >= SPLIT_MAX_ROWS else limit


def choose_float32(ms: dict[int, float], ms32: dict[int, float]) -> frozenset[int]:
    """The row counts (0: a prompt piece, the widest count timed) where float32 saves FLOAT32_SAVING."""
    piece = max(ms32)
    return frozenset((0 if m == piece and m > SPLIT_MAX_ROWS else m) for m in ms32
                     if m in ms and ms32[m] <= (1 - FLOAT32_SAVING) * ms[m])


def describe_float32(rows: frozenset[int]) -> str:
    """The log's verdict: ``float32 from 4 rows up``, ``float32 at M=1,2``, ``float32 nowhere``..."""
    counts = sorted(r for r in rows if r)
    pieces = 0 in rows
    if not counts:
        return "float32 for prompt pieces only" if pieces else "float32 nowhere"
    if pieces and counts == list(range(counts[0], SPLIT_MAX_ROWS + 1)):
        return f"float32 from {counts[0]} row{'s' if counts[0] > 1 else ''} up"
    return f"float32 at M={','.join(map(str, counts))}" + (" and prompt pieces" if pieces else "")


def _curve(ms: dict[int, float]) -> str:
    return " ".join(f"M={m}:{t:.3f}" for m, t in ms.items())


def parse_rows(rows: str | int) -> str | int:
    """``auto``, ``off`` or a row limit 1..SPLIT_MAX_ROWS (ValueError otherwise)."""
    value = fourbit_rows_value(rows) if str(rows).strip() else None
    if value is not None:
        return value
    raise ValueError(f"4-bit row limit {rows!r}: auto, off, or 1 to {SPLIT_MAX_ROWS}")


def plan_4bit_rows(stage, rows: str | int = AUTO, float32: str = AUTO, *, prefill_chunk: int = DEFAULT_PIECE,
                   label: str = "stage0", measure_cpu: bool = False,
                   time_block: TimeBlock | None = None) -> dict | None:
    """Measure, choose and set the row policy of the stage's 4-bit weights (module docstring); what
    ``kernels.fourbit_rows`` shows, or None where there is nothing to do (no 4-bit weight, both off).

    ``rows``: SWARM_SERVE_4BIT_ROWS (auto, off, or a fixed limit); ``float32``: SWARM_SERVE_4BIT_FLOAT32
    (auto or off); ``prefill_chunk``: the width of a prompt piece float32 is timed at too (0: DEFAULT_PIECE);
    ``measure_cpu``: measure on a CPU stage as on CUDA (tests); ``time_block``: the timer (measure_block
    over the stage's dtype by default)."""
    rows = parse_rows(rows)
    float32 = str(float32).strip().lower()
    if float32 not in (AUTO, OFF):
        raise ValueError(f"4-bit float32 {float32!r}: auto or off")
    blocks = [b for b in stage_blocks(stage) if b]
    if not blocks or (rows == OFF and float32 == OFF):
        return None
    linears = [lin for block in blocks for lin in block]
    device = linears[0].weight.device
    status: dict = {"device": str(device), "rows": str(rows), "float32": float32}
    fixed = rows if isinstance(rows, int) else None
    limit = fixed if fixed and fixed < SPLIT_MAX_ROWS else 0  # a limit of SPLIT_MAX_ROWS splits nothing
    upcast: frozenset[int] = frozenset()
    want_rows = rows == AUTO
    want_float32 = float32 == AUTO and stage.dtype != torch.float32
    measurable = device.type == "cuda" or measure_cpu
    parts = []
    if (want_rows or want_float32) and not measurable:
        status["why"] = f"measured on CUDA only: a {device.type} stage keeps its 4-bit calls whole and in its dtype"
        parts.append("not measured (CUDA only)")
    elif want_rows or want_float32:
        timer = time_block or (lambda lins, m, up: measure_block(lins, m, up, stage.dtype))
        block = blocks[0]
        piece = prefill_chunk if prefill_chunk > 0 else DEFAULT_PIECE
        counts = ROW_COUNTS + ((piece,) if want_float32 and piece > SPLIT_MAX_ROWS else ())
        started = time.perf_counter()
        ms = {m: timer(block, m, False) for m in counts}
        try:
            ms32 = {m: timer(block, m, True) for m in counts} if want_float32 else {}
        except (RuntimeError, ValueError, NotImplementedError) as exc:  # a kernel that takes no float32 rows
            want_float32, ms32 = False, {}
            status["why"] = f"float32 failed on this card ({type(exc).__name__}: {str(exc)[:200]}): not used"
            log.warning("[%s 4bit-rows] %s", label, status["why"])
        status["seconds"] = round(time.perf_counter() - started, 3)
        status["ms"] = {str(m): round(t, 4) for m, t in ms.items()}
        parts.append(f"one block ms {_curve(ms)}")
        if want_float32:
            upcast = choose_float32(ms, ms32)
            status["float32_ms"] = {str(m): round(t, 4) for m, t in ms32.items()}
            parts.append(f"float32 {_curve(ms32)}")
        if want_rows:  # over the faster way at each count
            limit = choose_row_limit({m: ms32[m] if m in upcast else ms[m] for m in ROW_COUNTS})
    elif stage.dtype == torch.float32 and float32 == AUTO:
        status["why"] = "the stage computes in float32 already"
    if fixed:
        parts.append(f"fixed limit {rows} (SWARM_SERVE_4BIT_ROWS)")
    parts.append(f"calls of more rows split into {limit}" if limit else "no split")
    if float32 == AUTO and stage.dtype != torch.float32 and measurable:
        parts.append(describe_float32(upcast))
    for lin in linears:
        lin.row_limit, lin.float32_rows = limit, upcast
    status.update(row_limit=limit, float32_rows=sorted(r for r in upcast if r), float32_prompt_pieces=0 in upcast,
                  linears=len(linears))
    log.info("[%s 4bit-rows] %s %s", label, device, "; ".join(parts))
    return status
