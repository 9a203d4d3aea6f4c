"""The padded-batch fit (the spec's ``_fits_padded``): a batched decode step over HF layers pads every
session's cache to the longest for one layer at a time, so a batch stops growing where that copy would pass
the KV budget. Every batcher asks here: the one-stage engine's decode batches, a ring's stage 0 decode
groups (fellow.runtime.ring.units) and its later stages' batches (fellow.runtime.ring.worker)."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def padded_layers(stage) -> int:
    """The layers a batch of ``stage`` pads, over which a budget token counts one position; 0 where none
    does (fused layers attend row by row in each session's own cache). A stage with recurrent layers pads
    its attention layers' keys only (model.recurrent.RecurrentBatchedView), each of which a budget token
    counts (model.load.kv_budget.bytes_per_token)."""
    if stage.fused is not None:
        return 0
    return sum(stage.attends) if stage.recurrent is not None else len(stage.layers)


def fits_padded(layers: int, rows: int, longest: int, room: int) -> bool:
    """Whether one layer's padded copy of ``rows`` sessions, the longest ``longest`` positions, fits in
    ``room`` budget tokens: rows x (longest + 1) positions of one of ``layers`` layers. The room is what is
    unreserved plus one prompt piece's: a decode step never runs beside a piece."""
    return layers == 0 or rows * (longest + 1) / layers <= room


def padded_batches(items: list[T], length: Callable[[T], int], cap: int,
                   fits: Callable[[int, int], bool]) -> list[list[T]]:
    """``items`` in batches of at most ``cap`` (0: no cap), of similar ``length`` together so padding stays
    small, each cut where ``fits(rows, longest)`` says the next one would not fit."""
    batches: list[list[T]] = []
    current: list[T] = []
    for item in sorted(items, key=length):
        if current and ((cap and len(current) == cap) or not fits(len(current) + 1, length(item))):
            batches.append(current)
            current = []
        current.append(item)
    if current:
        batches.append(current)
    return batches
