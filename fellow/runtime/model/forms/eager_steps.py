"""The stage's own decode forms, which run its layers as they are (``steps.protocol.DecodeStep`` each).

Which of them a stage has is fixed by how it loaded (``eager_forms``): fused layers run one form
(``FusedStep``: the fused stack's attention picks its own kernel, ``attend_one`` for one session, the
grouped slab otherwise); HF layers run one session straight over its cache (``HFAlone``) and a batch over
padded keys (``HFPadded``); recurrent layers run a batch whose sessions all hold positions batched
(``RecurrentBatched``) and any other batch each session alone, in order (``RecurrentAlone``). The last form of
each list takes every batch. None of them can promise that a failure advanced no cache (HF layers write their
caches as they go), so each re-raises from ``give_up``: their failure is the step's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fellow.runtime.model.kv_cache import BatchedView, SessionView
from fellow.runtime.model.masks import piece_mask
from fellow.runtime.model.recurrent import RecurrentBatchedView
from fellow.runtime.steps.protocol import DecodeStep, StepReport


class EagerStep:
    """What the eager forms share: the stage, the steps served, a failure that is the step's."""

    name = "eager"

    def __init__(self, stage) -> None:
        self.stage = stage
        self.steps = 0

    def takes(self, caches: Sequence) -> bool:
        return True

    def give_up(self, caches: Sequence, exc: Exception) -> None:
        raise exc  # its layers may have written some caches: the step fails rather than run twice

    def report(self) -> StepReport:
        return StepReport(form=self.name, steps=self.steps)

    def _begin(self, caches: Sequence, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's hidden states in and each session's position: every cache holds room for one more."""
        stage = self.stage
        hidden = stage.embed_ids(inputs.view(-1, 1)) if stage.is_first else inputs
        for cache in caches:
            cache.reserve(1)
        return hidden, torch.tensor([[cache.length] for cache in caches], device=hidden.device)

    def _end(self, caches: Sequence, hidden: torch.Tensor) -> torch.Tensor:
        for cache in caches:
            cache.advance(1)
        self.steps += 1
        return self.stage.head_last(hidden) if self.stage.is_last else hidden


class FusedStep(EagerStep):
    name = "fused"

    def decode(self, caches: Sequence, inputs: torch.Tensor) -> torch.Tensor:
        hidden, position_ids = self._begin(caches, inputs)
        hidden = self.stage.run_fused(hidden, position_ids, self.stage.fused.attend_decode(caches))
        return self._end(caches, hidden)


class HFAlone(EagerStep):
    """One session through the HF layers: it attends straight to its cache, nothing to pad (a window may mask)."""

    name = "hf_alone"

    def takes(self, caches: Sequence) -> bool:
        return len(caches) == 1

    def decode(self, caches: Sequence, inputs: torch.Tensor) -> torch.Tensor:
        stage = self.stage
        hidden, position_ids = self._begin(caches, inputs)
        masks = {window: piece_mask(caches[0].length, 1, hidden, window, stage.attention) for window in stage.windows}
        return self._end(caches, stage.run_layers(hidden, position_ids, masks, SessionView(caches[0])))


class HFPadded(EagerStep):
    """A batch through the HF layers, each session's keys padded to the longest (``kv_cache.BatchedView``)."""

    name = "hf_padded"
    view_class = BatchedView

    def decode(self, caches: Sequence, inputs: torch.Tensor) -> torch.Tensor:
        stage = self.stage
        hidden, position_ids = self._begin(caches, inputs)
        view = self.view_class(list(caches))
        masks = {window: view.attention_mask(hidden.dtype, hidden.device, window) for window in stage.windows}
        hidden = stage.run_layers(hidden, position_ids, masks, view)
        view.commit()
        return self._end(caches, hidden)


class RecurrentBatched(HFPadded):
    """Sessions that have each run some positions, batched through every layer (``RecurrentBatchedView``): the
    attention layers over padded keys, the linear ones over stacked states."""

    name = "recurrent_batched"
    view_class = RecurrentBatchedView

    def takes(self, caches: Sequence) -> bool:
        return RecurrentBatchedView.batchable(caches)


class RecurrentAlone(EagerStep):
    """Each session in a forward of its own, in order (a fresh session's state cannot join a batch)."""

    name = "recurrent_alone"

    def decode(self, caches: Sequence, inputs: torch.Tensor) -> torch.Tensor:
        out = self.stage.each_alone(caches, [inputs[row : row + 1] for row in range(len(caches))])
        self.steps += 1
        return out


def eager_forms(stage) -> list[DecodeStep]:
    """The stage's own forms, in the order they are tried; the last takes every batch."""
    if stage.recurrent is not None:
        return [RecurrentBatched(stage), RecurrentAlone(stage)]
    if stage.fused is not None:
        return [FusedStep(stage)]
    return [HFAlone(stage), HFPadded(stage)]
