"""SWARM_SERVE_COMPILE=auto, the default: the compiled decode step without a load that waits for it.

A whole-model CPU stage that ``compiled.why_not`` lets compile (float32, or int8 and int4 over their own
kernels) keeps its float32 weights' plain form while it loads, where the host has room for it and the
compiled graph (``why_not_here``), and serves its fused step at once. Once it serves, a thread compiles
its step at each batch size of ROWS (``CompiledDecode.warm``: no cache and no decode slab, nothing the
serving thread holds; inductor's cache under the fellow's data dir makes a later load's compile take a
fraction as long), at batch 1 once for each way of multiplying a row by a float32 weight
(``graph_linear.GEMV_FORMS``: none wins on every shape). The native step (one C call a step) is built
first, in seconds: at the first step boundary after it is, the serving thread checks and times it and
serves it where it beats the fused step, so a load is at about full speed seconds after ready, not once
inductor is done minutes later. Where it serves every batch size no graph is built at all: measured, the
reduce graph's step took 1.4-2.5x the native one's (bench_native_step, llama-deep int8 and int4), and
compiling the graphs, minutes of CPU, slowed what served meanwhile to 0.13x (bench_full_speed). Else the
graphs compile for the sizes it does not serve, and at the first step boundary after everything is built,
the serving thread checks each compiled step's logits against the fused step's and times them
(``CompiledDecode.build(compiled=True)``), and from that step on each batch size runs through the
fastest where it measured faster than the fused step; the rest are dropped. Where several serve a batch
size, it times them and the fused step again in turn (``_retime``: one form timed alone once chose the
fused step for int4 in one run, docs/benchmarks.md), all between two steps of a stage that may be busy
serving, and keeps what it found. ``state`` says where it is (``status_line`` adds how many graphs are
built and the ETA, compile_eta): the stage's metrics carry it to the load's status, and ``report``, with
the ETA known at ready, lands in the ready event's ``kernels.compiled``.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
import time
from functools import cached_property

import torch

from fellow.runtime.model.forms.checked_step import CHECK_CONTEXT, best_ms, one_line
from fellow.runtime.model.forms.compile_eta import Eta, compile_key, remember
from fellow.runtime.model.forms.compiled import CompiledDecode, PlainWeights, _resident_bytes, why_not
from fellow.runtime.model.forms.compiled_steps import CompiledSteps, builds, choose
from fellow.runtime.model.forms.graph_linear import GEMV_FORMS, LINEAR, REDUCE, gemv_forms
from fellow.runtime.model.forms.native_step import NATIVE, NativeStep, why_not as native_why_not
from fellow.runtime.model.fused import Linear
from fellow.runtime.model.kv_cache import random_caches
from fellow.runtime.model.load.kv_budget import cpu_free_bytes

log = logging.getLogger(__name__)

ROWS = (1, 8)  # batch sizes compiled: one stream, and eight (what a full decode batch of the default cap runs)
ROOM = 2.0  # free host memory it wants after loading, in weight bytes: the graph's frozen copy and more
COMPILING = "compiling"
NICE = 19  # the compile thread's (and its compile workers') priority: the serving threads go first
FUSED = "fused"
RETIME_ROUNDS = 3  # rounds in which the forms that serve a batch size are timed again, in turn
JUDGE_WAIT_S = 60.0  # how long the graphs wait for the serving thread's verdict on the native step
SWITCH_S = 0.0005  # the GIL's switch interval while it compiles (Python's 5 ms starved the serving thread)


def why_not_here(stage, weight_bytes: int) -> str | None:
    """None where the stage may compile in the background, else why not (one line, for its status)."""
    why = why_not(stage)
    if why is None and (free := cpu_free_bytes()) < ROOM * weight_bytes:
        why = (f"too little memory: compiling wants {ROOM * weight_bytes / 1e6:.0f} MB free beside the stage, "
               f"{free / 1e6:.0f} MB are")
    return why


class BackgroundCompile:
    """The stage's decode step compiled on a thread of its own while the stage serves, swapped in at a step
    boundary where it checks and measures faster."""

    def __init__(self, stage, plain: PlainWeights, forms: tuple[str, ...] | None = None, only_faster: bool = True,
                 rows: tuple[int, ...] = ROWS) -> None:
        """``forms``: how the graphs multiply one row by a float32 weight (graph_linear.GEMV_FORMS), each
        built at batch 1 and the fastest served, or ``native_step.NATIVE``, the step as one C call; default,
        each that builds here where the stage has float32 weights, else the reduce form alone (a quantized
        stage's graph calls its own kernels either way), and the native step where it takes the stage.
        Batches of more rows are built in the first form that multiplies them as it does at once (the linear
        one where planned: the others take one row only), and the native one; where the native step serves
        every size measured, it serves the sizes between them too. ``only_faster=False``: serve the compiled step
        wherever its logits agree (tests, on models too small for it to pay)."""
        self.stage = stage
        if forms is None:
            forms = gemv_forms() if has_float_weights(stage) else (REDUCE,)
            forms += (NATIVE,) if native_why_not(stage) is None else ()
        many = LINEAR if LINEAR in forms else forms[0]
        plan = [(form, 1) for form in forms if 1 in rows] + [
            (form, r) for r in rows if r != 1 for form in dict.fromkeys((many, *(f for f in forms if f == NATIVE)))]
        self.plan = sorted(plan, key=lambda entry: entry[0] != NATIVE)  # the native step first: built in seconds
        self._plain = plain
        self.compiled: CompiledSteps | None = None  # what serves, once chosen
        self.only_faster = only_faster
        self.rows = tuple(sorted(set(rows)))
        self.state = COMPILING  # the status line: what serves, and whether more is coming
        self.settled = False  # everything built is checked and timed: nothing changes from here on
        self.eta = Eta(compile_key(stage, self.plan), graphs=sum(form != NATIVE for form, _ in self.plan))
        self.report: dict = {"asked": list(self.rows), "background": True, "state": COMPILING, **self.eta.at_start()}
        self._seconds: dict[tuple[str, int], float] = {}
        self._error = ""
        self._resident = _resident_bytes()
        self._done = threading.Event()
        self._first = threading.Event()  # the native step's sizes are built (or there are none to build)
        self._judged = threading.Event()  # the serving thread has checked and timed the native step
        self.native_covers = False  # the native step serves every batch size: no graph is built
        self._started = 0.0
        self._thread = threading.Thread(target=self._compile, name="compile", daemon=True)

    @cached_property
    def candidates(self) -> dict:
        """Each planned form's step, made on first use: on the compile thread, since the first
        ``torch.compile`` imports dynamo (0.44 s, which the load's ready waited for when they were made here)."""
        return {form: NativeStep(self.stage, self._plain) if form == NATIVE else
                CompiledDecode(self.stage, self._plain, GEMV_FORMS[form], form)
                for form in dict.fromkeys(form for form, _ in self.plan)}

    def start(self) -> None:
        self._switch = sys.getswitchinterval()
        self._started = self.eta.started = time.monotonic()
        sys.setswitchinterval(SWITCH_S)
        self._thread.start()
        log.info("[compiled] decode step compiling in the background (%s); the fused step serves meanwhile",
                 ", ".join(f"batch {rows} {form}" for form, rows in self.plan))

    def _compile(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)  # this thread alone (Linux)
        except (OSError, AttributeError):
            pass
        try:
            first = [(form, rows) for form, rows in self.plan if form == NATIVE]
            graphs = [(form, rows) for form, rows in self.plan if form != NATIVE]
            try:
                for form, rows in first:
                    self._seconds[form, rows] = self.candidates[form].warm(rows)
            except Exception as exc:  # the graphs may still build
                self._error = one_line(exc)
            finally:
                self._first.set()
            if first and graphs:  # the serving thread checks and times the native step first (within 0.5 s
                self._judged.wait(JUDGE_WAIT_S)  # of it being built: an idle loop polls that often)
            if self.native_covers:
                self.report["graphs"] = "not built: the native step serves every batch size, faster than they did"
                self.eta.skipped = self.eta.graphs
                return
            native_rows = self.compiled.serving if self.compiled is not None else set()
            for form, rows in graphs:
                if rows in native_rows:  # the native step serves this size: no graph for it
                    self.eta.skipped += 1
                    continue
                self._seconds[form, rows] = self.candidates[form].warm(rows)
                self.eta.built.append(self._seconds[form, rows])
        except Exception as exc:  # inductor could not build it here: what did build still may serve
            self._error = one_line(exc)
            if "candidates" not in vars(self):  # none could be made: poll finds nothing to try
                self.candidates = {}
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the thread is done (a test's or a benchmark's wait; serving never waits)."""
        return self._done.wait(timeout)

    def poll(self) -> bool:
        """On the serving thread, between steps: once the steps are built, check and time each and serve, per
        batch size, the fastest where it beats the fused step. Whether it changed anything (cheap, and False,
        until then and after)."""
        if self.settled:
            return False
        if not self._judged.is_set() and self._first.is_set():
            try:
                if self._serve_native_first():
                    return True
            finally:
                self._judged.set()
        if not self._done.is_set():
            return False
        sys.setswitchinterval(self._switch)
        found: dict[str, dict] = {}
        by_rows: dict[int, CompiledDecode] = {}
        for rows in self.rows:
            tried = {}
            for form, planned in self.plan:
                if planned != rows or (form, rows) not in self._seconds:
                    continue
                entry = {"compile_s": round(self._seconds[form, rows], 1)}
                judged = self.report.get("first", {}).get("batches", {}).get(str(rows)) if form == NATIVE else None
                try:  # the native step was checked and timed once already: those figures stand (and _retime's)
                    entry.update(judged or self.candidates[form].build(rows, self.only_faster, compiled=True))
                except Exception as exc:
                    entry.update(serving=False, why=one_line(exc))
                tried[form] = entry
            self._retime(rows, tried)
            found[str(rows)] = choose(tried, self._error)
            if found[str(rows)].get("serving"):
                by_rows[rows] = self.candidates[found[str(rows)]["form"]]
        native = self.candidates.get(NATIVE)
        if native is not None and len(by_rows) > 1 and all(c is native for c in by_rows.values()):
            # the native step serves every size it was measured at: the sizes between take it too (one kernel)
            by_rows.update({r: native for r in range(min(by_rows), max(by_rows) + 1)})
            native.serving.update(by_rows)
        for form, candidate in self.candidates.items():  # what does not serve is dropped
            candidate.serving.intersection_update(r for r, c in by_rows.items() if c is candidate)
        self.candidates, self._plain = {}, None
        self.compiled = CompiledSteps(by_rows) if by_rows else None
        self.stage.steps.put("compiled", self.compiled)
        self.report.update(batches=found, serving=sorted(by_rows))
        if self._resident is not None and (after := _resident_bytes()) is not None:
            self.report["resident_added_bytes"] = after - self._resident
        self.state = self.report["state"] = self.summary(found)
        self.report["settled_after_s"] = round(time.monotonic() - self._started, 1)
        remember(self.eta.key, self.report["settled_after_s"], self.report.get("first", {}).get("after_s"))
        self.report["built"] = builds()
        self.settled = True
        log.info("[compiled] decode step: %s", self.state)
        return True

    def status_line(self) -> str:
        """``state``, and while it compiles, how far it is and its ETA (compile_eta.Eta)."""
        return self.state if self.settled else self.state + self.eta.line()

    def _serve_native_first(self) -> bool:
        """Once the native step is built (seconds, where the graphs take minutes), check and time it at each size
        and serve it where it beats the fused step, until the graphs are done and everything is timed again.
        Whether it serves."""
        native = vars(self).get("candidates", {}).get(NATIVE)
        sizes = [rows for form, rows in self.plan if form == NATIVE and (form, rows) in self._seconds]
        if native is None or not sizes:
            return False
        found = {}
        for rows in sizes:
            try:
                found[rows] = native.build(rows, self.only_faster, compiled=True)
            except Exception as exc:
                found[rows] = {"serving": False, "why": one_line(exc)}
        by_rows = {rows: native for rows in sizes if found[rows].get("serving")}
        if len(by_rows) > 1 and len(by_rows) == len(sizes):
            by_rows = {r: native for r in range(min(by_rows), max(by_rows) + 1)}
        native.serving = set(by_rows)
        self.native_covers = set(sizes) == set(self.rows) and len(by_rows) >= len(sizes)
        after = round(time.monotonic() - self._started, 1)
        self.report["first"] = {"form": NATIVE, "serving": sorted(by_rows), "after_s": after,
                                "batches": {str(rows): entry for rows, entry in found.items()}}
        if not by_rows:
            return False
        self.compiled = CompiledSteps(by_rows)
        self.stage.steps.put("compiled", self.compiled)
        self.state = self.report["state"] = f"{COMPILING}; meanwhile " + "; ".join(
            f"batch {rows} native, {e['compiled_ms']:.2f} ms against the fused {e['fused_ms']:.2f}"
            for rows, e in found.items() if e.get("serving"))
        log.info("[compiled] native step serving %.1f s after the compile began: %s", after, self.state)
        return True

    @torch.inference_mode()
    def _retime(self, rows: int, tried: dict[str, dict]) -> None:
        """Where several forms serve ``rows`` sessions, time them and the fused step again in turn (RETIME_ROUNDS
        rounds of each's best of checked_step.TIMING_REPEATS) and keep each one's median: each ``build`` timed its
        form alone, once, and two runs of the same stage chose differently (a busy machine moves a step by a
        third)."""
        forms = [form for form, entry in tried.items() if entry.get("serving")]
        if len(forms) < 2:
            return
        caches = random_caches(self.stage.new_cache, rows, CHECK_CONTEXT, 1, torch.Generator().manual_seed(rows))
        ids = torch.randint(0, self.candidates[forms[0]].vocab, (rows,))
        steps = {form: self.candidates[form].decode for form in forms} | {FUSED: self.stage.steps.eager.decode}
        times: dict[str, list[float]] = {form: [] for form in steps}
        try:
            for _ in range(RETIME_ROUNDS):
                for form, step in steps.items():
                    times[form].append(best_ms(lambda: step(caches, ids), caches))
        finally:
            for cache in caches:
                cache.release()
        fused_ms = round(statistics.median(times[FUSED]), 3)
        for form in forms:
            entry = tried[form]
            entry.update(compiled_ms=round(statistics.median(times[form]), 3), fused_ms=fused_ms)
            if self.only_faster and entry["compiled_ms"] >= fused_ms:
                entry.update(serving=False, why="not faster than the fused step here")

    def summary(self, found: dict[str, dict]) -> str:
        """One line for the status: what serves each batch size, and why."""
        parts = []
        for rows, e in found.items():
            if e.get("serving"):
                parts.append(f"batch {rows} compiled ({e['form']}), {e['compiled_ms']:.2f} ms against the fused "
                             f"{e['fused_ms']:.2f} (compiled in {e['compile_s']:.0f} s)")
            else:
                parts.append(f"batch {rows} fused: {e.get('why', 'not compiled')}")
        return "; ".join(parts)


def has_float_weights(stage) -> bool:
    """Whether the stage multiplies by any plain float32 weight (its graphs' GEMV form matters)."""
    layers = stage.fused.layers if stage.fused is not None else []
    return any(type(getattr(layer, name)) is Linear for layer in layers for name in ("qkv", "o", "gate_up", "down"))
