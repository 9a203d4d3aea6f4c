"""The forms a stage decodes with, fastest first, the eager form last: ``StageModel.decode`` is one call here.

Each slot holds one form (``put``): the checked steps (``compiled``: inductor's graphs or the native C step,
by batch size), CUDA-graph replay (``cuda_graphs``), then the stage's own eager forms, the last of which takes
every batch. A step runs on the first form that takes its caches; where one fails, it gives up and the next
serves the same step (the protocol's contract). ``model.plan_steps`` fills the table at load; the background
compile only puts its steps into it, between two steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fellow.runtime.steps.protocol import DecodeStep, StepReport

# the slots in the order they are tried; an eager form's slot is its name, after these
FAST_SLOTS = ("compiled", "cuda_graphs")


class StepTable:
    """The stage's decode forms in the order they are tried."""

    def __init__(self, eager: Sequence[DecodeStep]) -> None:
        """``eager``: the stage's own forms, the last taking every batch."""
        if not eager:
            raise ValueError("a step table needs an eager form that takes every batch")
        self._fast: dict[str, DecodeStep] = {}
        self.eager_forms = list(eager)
        self.forms: list[DecodeStep] = list(eager)  # the order ``decode`` tries them in

    @property
    def eager(self) -> DecodeStep:
        """The form that takes every batch: what every other form is checked and timed against."""
        return self.eager_forms[-1]

    def get(self, slot: str) -> DecodeStep | None:
        return self._fast.get(slot)

    def put(self, slot: str, form: DecodeStep | None) -> None:
        """Serve ``slot`` (one of FAST_SLOTS) with ``form`` from the next step on (None: empty it)."""
        if slot not in FAST_SLOTS:
            raise ValueError(f"no step slot {slot!r}: one of {FAST_SLOTS}")
        if form is None:
            self._fast.pop(slot, None)
        else:
            self._fast[slot] = form
        self.forms = [self._fast[s] for s in FAST_SLOTS if s in self._fast] + self.eager_forms

    def choose(self, caches: Sequence) -> DecodeStep:
        """The form that would serve a step over ``caches`` now (which code runs this step)."""
        return next(form for form in self.forms if form is self.eager or form.takes(caches))

    def decode(self, caches: Sequence, inputs: torch.Tensor) -> torch.Tensor:
        for form in self.forms:
            if form is self.eager:
                return form.decode(caches, inputs)
            if form.takes(caches):
                try:
                    return form.decode(caches, inputs)
                except Exception as exc:  # noqa: BLE001 (the contract: nothing advanced, the next form serves)
                    form.give_up(caches, exc)
        raise AssertionError("unreachable: the eager form is last")

    def report(self) -> list[StepReport]:
        return [form.report() for form in self.forms]
