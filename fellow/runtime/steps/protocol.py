"""What a form of the decode step is: one position for each of a batch of sessions.

Modelled on ``engine/scheduler.py``'s ``Runner``: a Protocol with its contract written down, which every form
implements (the eager forms of ``model.eager_steps``, the checked steps of ``model.checked_step`` and their
by-batch-size set ``model.forms.compiled_steps.CompiledSteps``, CUDA-graph replay ``model.cuda_graphs``, and a draft
model's fixed-shape decoder ``model.forms.draft_graph.FixedStep``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec
import torch


class StepReport(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a form says of itself, for the status and the log: its name, the steps it served, the batch sizes
    it takes (empty: any) and, once given up, why."""

    form: str
    steps: int = 0
    batches: list[int] = []
    given_up: str = ""


class DecodeStep(Protocol):
    """One decode step over a batch of sessions' caches.

    Contract:
    - ``takes(caches)`` is cheap and has no effect: whether this form serves a step over these caches now.
    - ``decode(caches, inputs)`` (ids [B] on stage 0, hidden [B, 1, H] after it) advances every cache by
      exactly one position and returns logits [B, V] on the last stage, hidden [B, 1, H] before it; it is
      called only where ``takes`` said yes.
    - If ``decode`` raises, no cache advanced (a form writes its new keys where the next position goes and
      advances the caches only once the whole step is done). ``give_up(caches, exc)`` is then called: the form
      stops taking what failed and the table's next form serves the same step. A form that cannot promise
      this re-raises ``exc`` from ``give_up``, and the step fails.
    - ``report()`` says what it did, as a ``StepReport``.
    """

    name: str

    def takes(self, caches: Sequence) -> bool: ...
    def decode(self, caches: Sequence, inputs: torch.Tensor) -> torch.Tensor: ...
    def give_up(self, caches: Sequence, exc: Exception) -> None: ...
    def report(self) -> StepReport: ...
