"""Before and after a change to the stage core, in one sitting: engine, one-stage serving and ring tok/s.

    .venv/bin/python bench/bench_core.py --before REV [--after WORKTREE] [--rounds 3]

Each round runs bench_engine.py (the engine alone, batches 1 and 8) and bench_ring.py (the whole stack:
a one-stage load and a 2-stage ring, 1 and 4 streams) once on each tree, in alternating order, so a
machine that slows down mid-run slows both sides alike. ``--before`` is checked out into a temporary
git worktree; ``--after`` is this tree unless given. Prints every round, then the median of each figure
per side and after / before.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ["bench/bench_engine.py", "--layers", "8", "--hidden", "512", "--vocab", "8000", "--new-tokens", "48",
          "--repeats", "2", "--batches", "1", "8"]
RING = ["bench/bench_ring.py", "--in-flight", "1", "4", "--tokens", "48"]
ENGINE_ROW = re.compile(r"^batch (\d+): generate\s+[\d.]+ tok/s\s+engine\s+([\d.]+) tok/s", re.M)
RING_ROW = re.compile(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \|", re.M)


def run(tree: Path, args: list[str]) -> str:
    out = subprocess.run([sys.executable, *args], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{' '.join(args)} failed in {tree}:\n{out.stderr[-2000:]}")
    return out.stdout


def figures(tree: Path) -> dict[str, float]:
    found = {f"engine b{b}": float(v) for b, v in ENGINE_ROW.findall(run(tree, ENGINE))}
    for n, one, ring in RING_ROW.findall(run(tree, RING)):
        found[f"serving {n}"] = float(one)
        found[f"ring {n}"] = float(ring)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="a git revision of this repository")
    ap.add_argument("--after", type=Path, default=ROOT)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-bench-core-") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True,
                       capture_output=True)
        try:
            trees = {"before": before, "after": args.after}
            rows: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
            for r in range(args.rounds):
                for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    got = figures(trees[side])
                    print(f"round {r + 1} {side}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
                    for k, v in got.items():
                        rows[side].setdefault(k, []).append(v)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], capture_output=True)
    print("\n| tok/s | before (median) | after (median) | after / before |\n|---|---|---|---|")
    for key in rows["after"]:
        b, a = statistics.median(rows["before"][key]), statistics.median(rows["after"][key])
        print(f"| {key} | {b:.1f} | {a:.1f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
