"""When a stage's background compile will be done (its ETA), for the load's ready event and its status.

A compile that ended records how long it took beside the kernels' cache (``swarm-compile-times.json``),
keyed by what decides that time: the stage's shape and weights, the plan of forms and batch sizes, torch's
version and the instruction sets it builds for. The next load of the same key starts with that figure as
its ETA (a second load finds most of what it builds in the caches, so it is an upper bound there). Where
nothing was recorded, the ETA is unknown until the first graph of this compile is built; from then on it
is the mean time a graph took times the graphs left. Two stages ending at once may each write the file:
the last one's record stands, the other's is lost (its ETA stays unknown next time, nothing more).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from fellow.runtime.kernels import native

log = logging.getLogger(__name__)

RECORD = "swarm-compile-times.json"
KEPT = 64  # records kept in the file, the latest


def record_path() -> Path:
    return native.cache_dir().parent / RECORD


def compile_key(stage, plan: list[tuple[str, int]]) -> str:
    """What a compile's time depends on, hashed: the model's config and the stage's layers, how its weights
    are held, the plan, torch's version and the instruction sets its kernels build for."""
    layers = stage.fused.layers if stage.fused is not None else []
    kinds = [[type(getattr(layer, name, None)).__name__ for name in ("qkv", "o", "gate_up", "down")]
             for layer in layers[:1]]
    what = {"config": stage.config.to_dict(), "first": stage.first_layer, "layers": len(stage.layers),
            "ends": [stage.embed is not None, stage.head is not None], "weights": stage.weights, "kinds": kinds,
            "plan": plan, "torch": torch.__version__, "isa": os.environ.get("ATEN_CPU_CAPABILITY", ""),
            "flags": sorted(native._cpu_flags())}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _read(path: Path) -> dict:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def last_time(key: str) -> dict | None:
    """The last compile of ``key`` on this host: {"first_s", "settled_s", "at"}, else None."""
    return _read(record_path()).get(key)


def remember(key: str, settled_s: float, first_s: float | None) -> None:
    """Record a compile that settled (best effort: a cache that cannot be written leaves the ETA unknown)."""
    path = record_path()
    records = _read(path)
    records[key] = {"settled_s": round(settled_s, 1), "first_s": first_s, "at": round(time.time())}
    records = dict(sorted(records.items(), key=lambda item: item[1].get("at", 0))[-KEPT:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(records, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        log.warning("[compiled] cannot record the compile's time in %s: %s", path, exc)


class Eta:
    """A running compile's ETA: from the record at start, then from the graphs this compile built."""

    def __init__(self, key: str, graphs: int) -> None:
        self.key = key
        self.last = last_time(key)
        self.graphs = graphs  # graphs planned (the native step's sizes not counted: seconds to build)
        self.built: list[float] = []  # seconds each graph took, in this compile
        self.skipped = 0  # graphs planned but not built (the native step serves their size)
        self.started = time.monotonic()

    def seconds_left(self) -> float | None:
        """Best estimate of the seconds until it settles, None where nothing says."""
        elapsed = time.monotonic() - self.started
        left = self.graphs - len(self.built) - self.skipped
        if self.built:
            return round(max(0.0, sum(self.built) / len(self.built) * left), 1)
        if self.last is not None:
            return round(max(0.0, self.last["settled_s"] - elapsed), 1)
        return None

    def at_start(self) -> dict:
        """For the ready event: the ETA in seconds (None: unknown) and one line of where it comes from."""
        if self.last is None:
            return {"eta_s": None, "eta": "unknown: no compile of this stage's shape recorded here; known once "
                                          "its first graph is built"}
        return {"eta_s": self.last["settled_s"],
                "eta": f"the last compile of this stage's shape here took {self.last['settled_s']:.0f} s"}

    def line(self) -> str:
        """The status's suffix while it compiles."""
        left = self.seconds_left()
        done = f"{len(self.built)} of {self.graphs - self.skipped} graphs built" if self.graphs else ""
        eta = "ETA unknown" if left is None else f"about {left:.0f} s left"
        return " (" + ", ".join(part for part in (done, eta) if part) + ")"
