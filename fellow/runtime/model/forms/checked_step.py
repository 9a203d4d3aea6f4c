"""A decode step a stage may serve in place of its fused one: checked against the fused step and timed first.

Two forms share this (``steps.protocol.DecodeStep`` with ``build``): inductor's graph of the step
(``compiled.CompiledDecode``) and one C call a step (``native_step.NativeStep``). Each says how it decodes;
this base checks its logits against the fused step's on random caches, times both, and keeps the batch sizes
where it agrees (and, by default, is faster). The background compile (``background_compile``) builds them.
"""

from __future__ import annotations

import logging
import time

import torch

from fellow.runtime.model.forms.rotary_rows import RotaryRows
from fellow.runtime.model.kv_cache import random_caches
from fellow.runtime.steps.protocol import StepReport

log = logging.getLogger(__name__)

TIMING_REPEATS = 5  # timed steps per path and batch size; the fastest counts
CHECK_CONTEXT = 64  # positions in each cache when a step's logits are checked and timed
LOGIT_TOLERANCE = 1e-3  # a step's logits may differ from the fused step's by this, relative
# where the stage's kernels round their rows (int8 and int4: to bfloat16 in torch's kernels, to int8 blocks in
# quant.int8_gemv), inductor's norms, summing in another order, can round an activation the other way: on a
# 20-layer h384 model graphs differed from the fused step by 7.8e-3 to 0.056, about what the fused step differs
# by between a batch of 8 and each session alone (0.016-0.018 of logits up to 2: its slab sums in another order)
QUANTIZED_LOGIT_TOLERANCE = 3e-2


class CheckedStep:
    """What both step forms share: the batch sizes served, the steps taken, the check and the timing."""

    name = "checked"  # the form, in the log

    def __init__(self, stage, vocab: int, reads_float32: bool) -> None:
        self.stage = stage
        self.serving: set[int] = set()
        self.steps = 0  # decode steps it served
        self.given_up = ""  # why it last gave a batch size up
        self.rotary = RotaryRows(stage.rotary_emb, stage.dtype)
        self.vocab = vocab  # ids drawn below it when it is checked
        self.tolerance = LOGIT_TOLERANCE if reads_float32 else QUANTIZED_LOGIT_TOLERANCE

    def takes(self, caches) -> bool:
        return len(caches) in self.serving

    def give_up(self, caches, exc: Exception) -> None:
        """The step failed over ``caches`` (nothing of it stands: no cache advanced); the next form serves that
        batch size from now on."""
        rows = len(caches)
        self.serving.discard(rows)
        self.given_up = one_line(exc)
        log.warning("%s decode step at batch %d given up, the next form serves: %s", self.name, rows,
                    self.given_up)

    def report(self) -> StepReport:
        return StepReport(form=self.name, steps=self.steps, batches=sorted(self.serving), given_up=self.given_up)

    def decode(self, caches, ids: torch.Tensor) -> torch.Tensor:
        """One new position per session, as ``StageModel.decode``: logits [B, V]."""
        raise NotImplementedError

    def first_decode(self, caches, ids: torch.Tensor, compiled: bool) -> torch.Tensor:
        """The first step ``build`` takes (``CompiledDecode`` compiles there unless ``compiled``)."""
        return self.decode(caches, ids)

    @torch.inference_mode()
    def build(self, rows: int, only_faster: bool = True, compiled: bool = False) -> dict:
        """Check the step's logits for ``rows`` sessions against the fused step's, time both; serve it where it
        is faster (``only_faster=False``: wherever it agrees). What it found, for the status."""
        caches = random_caches(self.stage.new_cache, rows, CHECK_CONTEXT, 1, torch.Generator().manual_seed(rows))
        try:
            return self._build(rows, caches, only_faster, compiled)
        finally:  # released, so the stage's decode slab (where they were its rows) holds none of them
            for cache in caches:
                cache.release()

    def _build(self, rows: int, caches: list, only_faster: bool, compiled: bool) -> dict:
        ids = torch.randint(0, self.vocab, (rows,))
        started = time.perf_counter()
        got = self.first_decode(caches, ids, compiled)
        compile_s = time.perf_counter() - started
        crop(caches)
        want = self.stage.steps.eager.decode(caches, ids)
        crop(caches)
        diff = float((got - want).abs().max())
        entry = {"max_logit_diff": float(f"{diff:.2e}"), **({} if compiled else {"compile_s": round(compile_s, 1)})}
        if not diff <= self.tolerance * (1.0 + float(want.abs().max())):
            entry.update(serving=False, why=f"its logits differ from the fused step's by {diff:.3g}")
            return entry
        fused_ms = best_ms(lambda: self.stage.steps.eager.decode(caches, ids), caches)
        compiled_ms = best_ms(lambda: self.decode(caches, ids), caches)
        entry.update(fused_ms=round(fused_ms, 3), compiled_ms=round(compiled_ms, 3),
                     serving=compiled_ms < fused_ms or not only_faster)
        if entry["serving"]:
            self.serving.add(rows)
        else:
            entry["why"] = "not faster than the fused step here"
        return entry


def best_ms(step, caches) -> float:
    """The fastest of TIMING_REPEATS calls of ``step``, in ms, each cache cropped back after each."""
    best = float("inf")
    for _ in range(TIMING_REPEATS):
        started = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - started)
        crop(caches)
    return best * 1e3


def crop(caches) -> None:
    for cache in caches:
        cache.crop_to(CHECK_CONTEXT)


def one_line(exc: Exception) -> str:
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
