"""What a background compile serves (``CompiledSteps``: the checked steps, by batch size, in the stage's step
table's ``compiled`` slot), how it picks among the forms that check (``choose``), and what it built
(``builds``)."""

from __future__ import annotations

import sys

from fellow.runtime.kernels import native
from fellow.runtime.model.forms.checked_step import one_line
from fellow.runtime.model.forms.compiled import CompiledDecode
from fellow.runtime.steps.protocol import StepReport


def builds() -> dict:
    """What this process built rather than found in its caches: C libraries compiled (``native.COMPILED``), and
    inductor's graphs compiled and those its FX graph cache under the fellow's data dir gave back."""
    inductor = sys.modules.get("torch._dynamo.utils")
    counts = inductor.counters["inductor"] if inductor is not None else {}
    return {"libraries_compiled": sum(native.COMPILED.values()), "graphs_compiled": counts.get("fxgraph_cache_miss", 0),
            "graphs_cached": counts.get("fxgraph_cache_hit", 0)}



class CompiledSteps:
    """The checked steps that serve, by batch size: one ``steps.protocol.DecodeStep`` in the stage's step
    table's ``compiled`` slot."""

    name = "compiled"

    def __init__(self, by_rows: dict[int, CompiledDecode]) -> None:
        self.by_rows = by_rows
        self.given_up = ""

    @property
    def serving(self) -> set[int]:
        return set(self.by_rows)

    @property
    def steps(self) -> int:
        return sum(compiled.steps for compiled in {id(c): c for c in self.by_rows.values()}.values())

    def takes(self, caches) -> bool:
        return len(caches) in self.by_rows

    def decode(self, caches, ids):
        return self.by_rows[len(caches)].decode(caches, ids)

    def give_up(self, caches, exc: Exception) -> None:
        self.by_rows.pop(len(caches)).give_up(caches, exc)
        self.given_up = one_line(exc)

    def report(self) -> StepReport:
        forms = sorted({step.name for step in self.by_rows.values()})
        return StepReport(form="compiled" + (f" ({', '.join(forms)})" if forms else ""), steps=self.steps,
                          batches=sorted(self.by_rows), given_up=self.given_up)


def choose(tried: dict[str, dict], error: str) -> dict:
    """What serves ``rows`` sessions: the fastest form that serves (its entry, with ``form`` and every form's
    time), else the first entry, with why none serves."""
    serving = {form: e for form, e in tried.items() if e.get("serving")}
    if not serving:
        if not tried:
            return {"serving": False, "why": error or "not compiled"}
        entry = dict(next(iter(tried.values())))
        if len(tried) > 1:
            entry["why"] = "; ".join(f"{f}: {e.get('why', 'not serving')}" for f, e in tried.items())
        return entry
    form = min(serving, key=lambda f: serving[f]["compiled_ms"])
    entry = {**serving[form], "form": form}
    if len(tried) > 1:
        entry["forms_ms"] = {f: e.get("compiled_ms") for f, e in tried.items()}
    return entry
