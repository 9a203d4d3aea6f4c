"""Fixtures: real nats-server on port 0 with a temp store → client → JetStream; SQLite and PostgreSQL."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import uuid

import pytest

from core.bus import connect, ensure_streams
from core.nats_server import EmbeddedNats
from core.settings import Settings
from tests.services import Postgres, postgres_bin

# tests/request_helpers.py's fixtures (``servables``: a one-stage tiny-a, for the request-ending and fault
# tests) for every module that asks for them; a module with a ``servables`` of its own uses its own
pytest_plugins = ["tests.request_helpers"]


def _threads_each() -> int:
    """Under xdist, each worker's share of the cores (0: not under xdist)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    return max(1, (os.cpu_count() or 1) // workers) if workers > 1 else 0


# The workers share the machine's cores, so each one's torch, and the stage processes its tests start (they
# inherit the variable), computes on its share of them: two threads a process on two cores the other worker
# keeps busy made OpenMP's barriers spin against its threads, and the CPU tests ran 3 to 50 times slower.
THREADS_EACH = _threads_each()
if THREADS_EACH:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS_EACH))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def two_threads():
    """torch (and the kernels, which share its OpenMP pool) on two threads for the test, whatever the worker's
    share: a kernel's split over threads is what it checks."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    """Each test module starts with dynamo's caches empty, where torch is loaded at all: every stage's decode
    graph is one code object, and a worker that ran many modules' compiles passed dynamo's limit of graphs a
    code object (fellow/runtime/model/forms/compiled.py), so a later compile failed for no fault of its own."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


@pytest.fixture
def store_dir(tmp_path):
    d = tmp_path / "jetstream"
    d.mkdir()
    return d


@pytest.fixture
def nats_server(store_dir):
    srv = EmbeddedNats(store_dir).start()
    yield srv
    srv.stop()


@pytest.fixture
async def nc(nats_server):
    client = await connect(nats_server.url, name="test")
    yield client
    if not client.is_closed:
        await client.close()


@pytest.fixture
async def js(nc):
    ctx = nc.jetstream()
    await ensure_streams(ctx)
    return ctx


@pytest.fixture(scope="session")
def postgres():
    if postgres_bin() is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL binaries missing in CI (.ci/run installs them)")
        pytest.skip("PostgreSQL server binaries not installed")
    pg = Postgres().start()
    yield pg
    pg.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'swarm.db'}"
    pg = request.getfixturevalue("postgres")
    return pg.create_db("t" + uuid.uuid4().hex[:12])


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite+aiosqlite:///{tmp_path / 'swarm.db'}"


def make_settings(tmp_path, nats_url: str, database_url: str | None = None, **env) -> Settings:
    base = {
        "SWARM_DATA_DIR": str(tmp_path / "data"),
        "SWARM_NATS_URL": nats_url,
        "SWARM_HEARTBEAT_S": "0.2",
    }
    if database_url:
        base["SWARM_DATABASE_URL"] = database_url
    base.update({k: str(v) for k, v in env.items()})
    return Settings.from_env(base)


DEMO_STEPS = 40  # of the 260 steps `make run` trains: enough for the demo model's shape of a reply


@pytest.fixture(scope="session")
def demo_servables(tmp_path_factory):
    """A servables folder holding the demo model (`swarm demo-model`: its shape, tokenizer and Qwen3 chat
    template), trained once a session for DEMO_STEPS: its replies open with an empty ``<think>`` block."""
    from fellow.runtime.tools.demo_model import MODEL_ID, make_demo_model

    # under xdist, one folder for every worker of the run, trained by the first that asks (the others wait for
    # it); alone, this session's own
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    servables, done = root / "demo-models", root / "demo-models.done"
    with open(root / "demo-models.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(servables, ignore_errors=True)
            make_demo_model(servables / MODEL_ID, steps=DEMO_STEPS)
            done.touch()
    return servables
