"""A second load of the same shape builds nothing (issue 56): the native kernels' libraries and inductor's
graphs come back from the caches under the fellow's data dir (TORCHINDUCTOR_CACHE_DIR, as a fellow sets it
for its stages). Each load runs in a fresh process, as a stage does; the test counts builds, not seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fellow.runtime.kernels import native
from tests.serving_fixtures import make_servable

ROOT = Path(__file__).resolve().parents[1]

# one load's background compile: the native step (its check made to fail, so the graphs compile too) and the
# reduce graph at batch 1, polled as a stage's loop polls it until settled; prints what it built
LOAD = """
import json, sys, time
from events.stage import StageOptions
from fellow.runtime.model.forms.background_compile import BackgroundCompile
from fellow.runtime.model.forms.graph_linear import REDUCE
from fellow.runtime.model.forms.native_step import NATIVE
from fellow.runtime.model.load.loader import load_one_stage
stage = load_one_stage(sys.argv[1], "cpu", StageOptions(compile=None)).stage
background = BackgroundCompile(stage, stage.plain_weights, forms=(REDUCE, NATIVE), only_faster=False, rows=(1,))
background.candidates[NATIVE].tolerance = -1.0
background.start()
deadline = time.monotonic() + 600
while not background.settled and time.monotonic() < deadline:
    background.poll()
    background.wait(0.05)
print(json.dumps({"built": background.report.get("built"), "state": background.state}))
"""


def one_load(servable: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARM_", "TORCHINDUCTOR_"))}
    env.update(PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", LOAD, str(servable)], capture_output=True, text=True, env=env,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not native.cpu_has_avx2_fma(), reason="the native kernels need AVX2 and FMA")
def test_a_second_load_of_the_same_shape_builds_no_library_and_no_graph(tmp_path):
    _, servable = make_servable(tmp_path / "models", "tiny", layers=2, hidden=64, stages=1)
    first = one_load(servable, tmp_path / "inductor")
    assert first["state"].startswith("batch 1 compiled (reduce)"), first
    assert first["built"]["libraries_compiled"] >= 2, first  # the step's library and the stage's row kernels
    assert first["built"]["graphs_compiled"] >= 1, first
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "inductor" / "swarm-kernels").glob("*.so"))
    second = one_load(servable, tmp_path / "inductor")
    assert second["state"].startswith("batch 1 compiled (reduce)"), second
    assert second["built"]["libraries_compiled"] == 0, second
    assert second["built"]["graphs_compiled"] == 0 and second["built"]["graphs_cached"] >= 1, second
    other = one_load(servable, tmp_path / "elsewhere")  # another cache: built again (the count can fail)
    assert other["built"]["libraries_compiled"] >= 2 and other["built"]["graphs_compiled"] >= 1, other
