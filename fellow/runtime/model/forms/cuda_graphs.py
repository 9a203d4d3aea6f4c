"""A whole-model CUDA stage's decode step replayed as CUDA graphs (SWARM_SERVE_CUDA_GRAPHS, issue 13).

On a GPU a small model's decode step is launch-bound: its time goes to launching a few hundred
kernels, not to running them. The stage's sessions keep their keys and values in one static pool
of ``slots`` x ``positions`` (the draft model's fixed-shape decoder, model.draft_graph.FixedDecoder),
and a decode step over sessions in the pool replays one captured graph per slot-count bucket (1, 2,
4, ... slots): the embedding, every layer with its attention over the pool's columns under a mask
of each row's past, and the head, writing the logits to a static buffer.

- ``StageModel.new_cache`` hands a session a slot while one is free (a ``PoolCache``), else a cache
  of its own as before. A session that grows past its slot's positions moves to buffers of its own
  (its past copied once) and frees the slot. Every other path (prompt pieces, verify passes, the
  prefix cache, crops) reads and writes a pool cache as any other cache.
- ``StageModel.decode`` replays the graph when every session of the step is in the pool; otherwise,
  or after a replay failed once, it steps eagerly over the same caches.
- At load (``graph_decode``) the stage captures the buckets, checks a replay of each against the
  eager step on the same inputs (the same argmax ids, logits close), and times both at batch 1 and
  at its batch cap. It serves replays only where they check and measure faster; ``kernels.cuda_graphs``
  says what it found, and one log line names the choice.
- The pool is allocated before the stage measures its KV budget, so the budget counts it as memory
  already taken; it takes at most half the KV tokens the card has room for after loading (POOL_SHARE),
  with fewer positions a slot where it must, and none where a slot would get under MIN_POSITIONS.

Served: whole-model stages (embeddings to head) on one CUDA device. A CPU test drives the same pool,
buckets and slots with steps that run eagerly instead of replaying (``capture``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from fellow.runtime.model.forms.draft_graph import (
    CUDA_GRAPH,
    EAGER,
    Capture,
    FixedDecoder,
    SlotCache,
    capture_cuda_graph,
)
from fellow.runtime.model.kv_cache import KVCache, random_caches
from fellow.runtime.model.load.kv_budget import measured_kv_tokens
from fellow.runtime.steps.protocol import StepReport

log = logging.getLogger(__name__)

GRAPH_POSITIONS = 2048  # a slot's positions; a longer session moves to buffers of its own
TIMED_CONTEXT = 256  # positions in each cache when the two steps are timed
TIMED_STEPS = 5  # timed steps per path and batch size; the fastest counts
POOL_SHARE = 0.5  # of the KV tokens a card has room for after loading, the most a pool takes
POOL_STEP = 64  # a slot's positions are a multiple of this
MIN_POSITIONS = 256  # with room for fewer a slot, no pool


class PoolCache(SlotCache):
    """A session's cache in a slot of the stage's pool; past the slot's positions, a cache of its own."""

    def reserve(self, positions: int) -> None:
        if self.decoder is None:
            KVCache.reserve(self, positions)
        elif self.length + positions > self.capacity:
            decoder, slot = self.decoder, self.slot
            self.decoder = None
            KVCache.reserve(self, positions)  # new buffers of its own, its past copied from the slot
            decoder.free.add(slot)

    def release(self) -> None:
        super().release()  # the slot, when it still has one
        KVCache.release(self)


class PoolDecoder(FixedDecoder):
    cache_class = PoolCache


class GraphedDecode:
    """What ``StageModel`` asks of its pool: a slot for a new session, and a step over sessions in it."""

    name = "cuda_graphs"

    def __init__(self, decoder: PoolDecoder) -> None:
        self.decoder = decoder
        self.failed: str | None = None
        self.steps = 0

    def take(self) -> PoolCache | None:
        return None if self.failed else self.decoder.take(1)

    def takes(self, caches: Sequence[KVCache]) -> bool:
        decoder = self.decoder
        return self.failed is None and all(
            type(c) is PoolCache and c.decoder is decoder and c.length < decoder.positions for c in caches)

    def decode(self, caches: Sequence[PoolCache], inputs: torch.Tensor) -> torch.Tensor:
        logits = self.decoder.step_logits(caches, inputs)
        self.steps += 1
        return logits

    def report(self) -> StepReport:
        return StepReport(form=self.name, steps=self.steps, given_up=self.failed or "")

    def give_up(self, caches: Sequence[KVCache], exc: Exception) -> None:
        """A replay failed: every step is eager from now on (the pool's caches serve as any other)."""
        self.failed = f"{type(exc).__name__}: {exc}"
        log.warning("cuda graphs: a replay failed, decode steps are eager from now on: %s", self.failed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_ms(step, device: torch.device) -> float:
    best = float("inf")
    for _ in range(TIMED_STEPS):
        _sync(device)
        started = time.perf_counter()
        step()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return round(best * 1e3, 3)


@torch.inference_mode()
def _timed(stage, decoder: PoolDecoder, rows: int) -> dict[str, float]:
    """ms of one decode step of ``rows`` sessions at TIMED_CONTEXT positions: eager over caches of their
    own, and replayed over sessions in the pool. Every position it adds is dropped with the caches."""
    device = stage.input_device
    generator = torch.Generator(device=device).manual_seed(rows)
    ids = torch.randint(stage.config.vocab_size, (rows,), generator=generator, device=device)
    context = min(TIMED_CONTEXT, decoder.positions - TIMED_STEPS - 2)
    own = random_caches(stage.new_cache, rows, context, TIMED_STEPS + 1, generator)
    pooled = random_caches(lambda: decoder.take(1), rows, context, TIMED_STEPS + 1, generator)
    try:
        stage.decode(own, ids)  # a first step of each, untimed
        decoder.step_logits(pooled, ids)
        return {"eager_ms": _best_ms(lambda: stage.decode(own, ids), device),
                "graph_ms": _best_ms(lambda: decoder.step_logits(pooled, ids), device)}
    finally:
        for cache in own + pooled:
            cache.release()


def why_not(stage) -> str | None:
    """None when the stage's decode step can be replayed from a pool, else why not (one line)."""
    if not (stage.is_first and stage.is_last):
        return "a ring stage: the replayed step takes a whole model (embeddings to head)"
    if getattr(stage, "recurrent", None) is not None:
        return "its layers keep recurrent states (linear attention), which the pool's slots do not hold"
    devices = set(stage.layer_devices) | {stage.input_device, stage.output_device}
    if len(devices) > 1:
        return "its pieces are on several devices"
    return None


def graph_decode(stage, *, slots: int, positions: int = GRAPH_POSITIONS, capture: Capture | None = None,
                 label: str = CUDA_GRAPH, choose: bool = True) -> dict | None:
    """Give ``stage`` a pool of ``slots`` x ``positions`` whose decode steps replay captured graphs, where
    they check against the eager step and (``choose``) measure faster at batch 1 and at ``slots``.
    ``capture`` defaults to ``capture_cuda_graph`` on a CUDA stage; a stage elsewhere gets no pool
    unless one is given (the CPU tests: a step that runs as written). Returns what the load's status
    shows (``kernels.cuda_graphs``); None for a CPU stage without ``capture``."""
    device = stage.input_device
    if capture is None:
        if device.type != "cuda":
            return None
        pool = torch.cuda.graph_pool_handle()
        capture = lambda step: capture_cuda_graph(step, pool)  # noqa: E731
    why = why_not(stage)
    if why is not None:
        log.info("cuda graphs: %s, %s", EAGER, why)
        return {"path": EAGER, "why": why}
    positions = min(positions, getattr(stage.config, "max_position_embeddings", positions) or positions)
    if device.type == "cuda":  # the pool takes at most POOL_SHARE of the KV tokens the card has room for
        room = int(POOL_SHARE * measured_kv_tokens(stage)) // max(1, slots) // POOL_STEP * POOL_STEP
        if room < min(positions, MIN_POSITIONS):
            why = f"too little memory for a pool ({room} positions a slot)"
            log.info("cuda graphs: %s, %s", EAGER, why)
            return {"path": EAGER, "why": why}
        positions = min(positions, room)
    started = time.perf_counter()
    try:
        decoder = PoolDecoder(stage, max(1, slots), positions)
        decoder.capture(capture)
    except Exception as exc:  # noqa: BLE001 (any failure to capture means eager steps)
        log.warning("cuda graphs: %s, the capture failed: %s: %s", EAGER, type(exc).__name__, exc)
        return {"path": EAGER, "why": f"the capture failed: {type(exc).__name__}: {exc}"}
    try:
        decoder.check()
    except Exception as exc:  # noqa: BLE001
        log.warning("cuda graphs: %s, a replayed step does not match the eager step: %s: %s", EAGER,
                    type(exc).__name__, exc)
        return {"path": EAGER, "why": f"a replayed step does not match the eager step: {exc}"}
    status = {"slots": decoder.slots, "positions": positions, "buckets": list(decoder.buckets),
              "pool_bytes": decoder.bytes}
    if choose:
        steps = {str(rows): _timed(stage, decoder, rows) for rows in sorted({1, decoder.slots})}
        status["step_ms"] = steps
        slower = [rows for rows, ms in steps.items() if ms["graph_ms"] >= ms["eager_ms"]]
        if slower:
            why = f"replayed steps measured no faster at batch {', '.join(slower)}"
            log.info("cuda graphs: %s, %s (%s)", EAGER, why, _describe(steps))
            return {"path": EAGER, "why": why, **status}
    status["load_s"] = round(time.perf_counter() - started, 3)
    stage.steps.put("cuda_graphs", GraphedDecode(decoder))
    log.info("cuda graphs: %s, %d slots of %d positions, %d captured steps, %.1f MB of static KV%s", label,
             decoder.slots, positions, len(decoder.replays), decoder.bytes / 1e6,
             f" ({_describe(status['step_ms'])})" if "step_ms" in status else "")
    return {"path": label, **status}


def _describe(steps: dict[str, dict[str, float]]) -> str:
    return "; ".join(f"batch {rows}: eager {ms['eager_ms']:.2f} ms, replayed {ms['graph_ms']:.2f} ms"
                     for rows, ms in steps.items())
