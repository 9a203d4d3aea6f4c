"""An adapters export on a fellow that has never seen its base: the fellow fetches the base checkpoint
from the leader's archive (checksummed, as a servable's), keeps it in its model cache, and serves."""

from __future__ import annotations

import filecmp
import shutil

import pytest

from core.nats_server import EmbeddedNats
from core.servable import fetched_base_dir, resolve_base
from fellow.runtime.tools.export import export
from tests.processes import SwarmProcess, wait_until
from tests.serving_fixtures import Stack
from tests.test_servable_adapters import tiny_lora


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    hf, lora, _ = tiny_lora(root)
    leader_cache, fellow_cache = root / "leader-cache", root / "fellow-cache"
    shutil.copytree(hf, leader_cache / "org" / "tiny-base")  # the base, known to the leader by id only
    export(hf, root / "servables" / "tuned", stages=1, adapters=lora, base_id="org/tiny-base", model_id="tuned")
    export(hf, root / "servables" / "orphan", stages=1, adapters=lora, base_id="org/nowhere", model_id="orphan")
    nats = EmbeddedNats(root / "js").start()
    stack = Stack(root, nats.url, root / "servables", SWARM_FELLOW_MODEL_CACHE=leader_cache)
    # the fellow: its own, empty model cache, and it fetches the servable too (as on another machine)
    env = {**stack.env, "SWARM_FELLOW_MODEL_CACHE": str(fellow_cache), "SWARM_FELLOW_FETCH": "always"}
    stack.fellows = [SwarmProcess(["fellow", "--id", "f0"], env, root / "fellow0.log")]
    stack.start()
    yield stack, leader_cache, fellow_cache
    stack.stop()
    nats.stop()


def test_the_fellow_fetches_the_base_and_serves_the_adapters(stack):
    stack, leader_cache, fellow_cache = stack
    assert resolve_base("org/tiny-base", fellow_cache) is None  # never seen here
    load = stack.load("tuned")
    assert load["state"] == "ready"
    fetched = fetched_base_dir("org/tiny-base", fellow_cache)
    assert resolve_base("org/tiny-base", fellow_cache) == fetched
    compared = filecmp.dircmp(leader_cache / "org" / "tiny-base", fetched)
    assert not compared.left_only and not compared.right_only and not compared.diff_files
    reply = stack.post("/v1/chat/completions", {"model": "tuned", "max_tokens": 5, "temperature": 0,
                                                "messages": [{"role": "user", "content": "hello"}]})
    assert reply.status_code == 200, reply.text
    archive = stack.get("/api/v1/models/tuned/archive?part=base")
    assert archive.status_code == 200 and len(archive.headers["x-swarm-sha256"]) == 64


def test_a_base_the_leader_lacks_fails_the_load_with_the_reason(stack):
    stack, _, _ = stack
    answer = stack.get("/api/v1/models/orphan/archive?part=base")
    assert answer.status_code == 404 and "'org/nowhere' of orphan is not on the leader" in answer.text
    assert stack.get("/api/v1/models/tuned/archive?part=weights").status_code == 400
    assert stack.post("/api/v1/models/orphan/load", {}).status_code == 200
    state, reason = wait_until(lambda: next((r for r in stack.sql("select state, reason from loads where "
                                                                 "model_id = 'orphan'") if r[0] == "failed"), None),
                               60, "the orphan load failed")
    assert "base checkpoint not on this fellow and not fetched" in reason
    assert "'org/nowhere' of orphan is not on the leader" in reason
