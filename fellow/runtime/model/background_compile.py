"""SWARM_SERVE_COMPILE=auto, the default: the compiled decode step without a load that waits for it.

A whole-model float32 CPU stage that ``compiled.why_not`` lets compile keeps its weights' plain form
while it loads, where the host has room for it and the compiled graph (``why_not_here``), and serves
its fused step at once. Once it serves, a thread compiles its step at batch 1
(``CompiledDecode.warm``: no cache and no decode slab, nothing the serving thread holds; inductor's
cache under the fellow's data dir makes a later load's compile take a fraction as long). At the first
step boundary after that, the serving thread checks the compiled step's logits against the fused
step's and times both (``CompiledDecode.build(compiled=True)``), and from that step on its batch-1
steps run compiled where that measured faster. ``state`` says where it is: the stage's metrics carry
it to the load's status, and ``report`` lands in ``kernels["compiled"]``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from fellow.runtime.model.compiled import (COMPILE_MODE, CompiledDecode, PlainWeights, _one_line, _resident_bytes,
                                           why_not)
from fellow.runtime.model.kv_budget import cpu_free_bytes

log = logging.getLogger(__name__)

ROWS = (1,)  # batch 1: where the compiled step gained most (batch 8 gained at most 1.17x, docs/benchmarks.md)
ROOM = 2.0  # free host memory it wants after loading, in weight bytes: the graph's frozen copy and more
COMPILING = "compiling"
NICE = 19  # the compile thread's (and its compile workers') priority: the serving threads go first
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

    def __init__(self, stage, plain: PlainWeights, mode: str | None = COMPILE_MODE, only_faster: bool = True) -> None:
        """``mode``: inductor's (None: its default, a third of the compile; tests); ``only_faster=False``: serve
        the compiled step wherever its logits agree (tests, on models too small for it to pay)."""
        self.stage = stage
        self.compiled = CompiledDecode(stage, plain, mode)
        self.only_faster = only_faster
        self.state = COMPILING
        self.report: dict = {"asked": list(ROWS), "background": True, "state": COMPILING}
        self._seconds: dict[int, float] = {}
        self._error = ""
        self._resident = _resident_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._compile, name="compile", daemon=True)

    def start(self) -> None:
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_S)
        self._thread.start()
        log.info("[compiled] decode step at batch %s compiling in the background; the fused step serves meanwhile",
                 ",".join(map(str, ROWS)))

    def _compile(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)  # this thread alone (Linux)
        except (OSError, AttributeError):
            pass
        try:
            for rows in ROWS:
                self._seconds[rows] = self.compiled.warm(rows)
        except Exception as exc:  # inductor could not build it here: the fused step goes on serving
            self._error = _one_line(exc)
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the thread is done (a test's or a benchmark's wait; serving never waits)."""
        return self._done.wait(timeout)

    def poll(self) -> bool:
        """On the serving thread, between steps: once the step is built, check and time it and serve it where
        faster. Whether it changed anything (cheap, and False, until then and after)."""
        if self.state != COMPILING or not self._done.is_set():
            return False
        sys.setswitchinterval(self._switch)
        found: dict[str, dict] = {}
        for rows, seconds in self._seconds.items():
            try:
                found[str(rows)] = {"compile_s": round(seconds, 1),
                                    **self.compiled.build(rows, self.only_faster, compiled=True)}
            except Exception as exc:
                found[str(rows)] = {"compile_s": round(seconds, 1), "serving": False, "why": _one_line(exc)}
        if self._error:
            found[str(ROWS[len(self._seconds)])] = {"serving": False, "why": self._error}
        self.stage.compiled = self.compiled if self.compiled.serving else None
        self.report.update(batches=found, serving=sorted(self.compiled.serving))
        if self._resident is not None and (after := _resident_bytes()) is not None:
            self.report["resident_added_bytes"] = after - self._resident
        self.state = self.report["state"] = self.summary(found)
        log.info("[compiled] decode step: %s", self.state)
        return True

    def summary(self, found: dict[str, dict]) -> str:
        """One line for the status: what serves each batch size, and why."""
        parts = []
        for rows, e in found.items():
            if e.get("serving"):
                parts.append(f"batch {rows} compiled, {e['compiled_ms']:.2f} ms against the fused "
                             f"{e['fused_ms']:.2f} (compiled in {e['compile_s']:.0f} s)")
            else:
                parts.append(f"batch {rows} fused: {e.get('why', 'not compiled')}")
        return "; ".join(parts)
