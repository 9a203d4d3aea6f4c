"""The catalog through the leader: broken servables listed with the reason, OpenAI's /v1/models, `swarm export`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import SwarmProcess, swarm_env


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A servables root with one good model and three broken ones, the good one made by `swarm export`."""
    from tests.tiny import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("catalog")
    hf = make_tiny_checkpoint(base / "hf", layers=2, hidden=64)
    root = base / "servables"
    swarm = str(Path(sys.executable).parent / "swarm")
    out = subprocess.run([swarm, "export", str(hf), str(root / "good"), "--stages", "2"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "exported good" in out.stdout
    shutil.copytree(root / "good", root / "missing-shard")
    (root / "missing-shard" / "shards" / "stage-1" / "weights.safetensors").unlink()
    shutil.copytree(root / "good", root / "bad-json")
    (root / "bad-json" / "servable.json").write_text("{not json")
    shutil.copytree(root / "good", root / "future")
    manifest = json.loads((root / "future" / "servable.json").read_text())
    (root / "future" / "servable.json").write_text(json.dumps(dict(manifest, format_version="2.0")))
    # issue 38: a folder named otherwise than its manifest's model_id, and a second folder of "good"
    assert manifest["model_id"] == "good"
    shutil.copytree(root / "good", root / "a-folder")
    (root / "a-folder" / "servable.json").write_text(json.dumps(dict(manifest, model_id="in-manifest")))
    shutil.copytree(root / "good", root / "good-copy")
    return root


@pytest.fixture(scope="module")
def leader(root, tmp_path_factory):
    from core.nats_server import EmbeddedNats

    tmp = tmp_path_factory.mktemp("catalog-leader")
    nats = EmbeddedNats(tmp / "js").start()
    proc = SwarmProcess(["leader"], swarm_env(tmp, nats.url, SWARM_SERVABLE_MODELS_ROOT=str(root)),
                        tmp / "leader.log").start()
    proc.wait_healthy()
    yield proc
    proc.stop()
    nats.stop()


def test_models_lists_every_servable_with_why_it_is_unavailable(leader):
    models = {m["id"]: m for m in leader.get("/api/v1/models").json()["data"]}
    assert set(models) == {"good", "missing-shard", "bad-json", "future", "in-manifest", "good-copy"}
    good = models["good"]
    assert good["available"] and good["num_stages"] == 2 and good["boundaries"] == [[0, 1], [1, 2]]
    assert good["parameters"] > 0 and good["load_state"] == "unloaded"
    assert "missing shard file" in models["missing-shard"]["reason"]
    assert "not valid JSON" in models["bad-json"]["reason"]
    assert "format_version '2.0' is not supported" in models["future"]["reason"]
    assert not any(models[m]["available"] for m in ("missing-shard", "bad-json", "future", "good-copy"))
    assert "model_id 'good' is the servable in" in models["good-copy"]["reason"]


def test_the_catalog_keys_on_the_manifests_model_id_not_the_folder(leader):
    """Issue 38: the README's swarm-demo was a 404 when its folder was named otherwise."""
    model = leader.get("/v1/models/in-manifest").json()
    assert model["id"] == "in-manifest", model
    assert leader.get("/v1/models/a-folder").status_code == 404


def test_openai_models_and_unknown_ids(leader):
    listed = leader.get("/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["good", "in-manifest"]
    assert leader.get("/v1/models/good").json()["object"] == "model"
    for path in ("/api/v1/models/nope", "/v1/models/nope", "/api/v1/models/nope/status"):
        r = leader.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", path


def test_a_broken_servable_cannot_be_loaded(leader):
    import httpx

    r = httpx.post(leader.base_url + "/api/v1/models/bad-json/load", json={}, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_unavailable"
    assert "not valid JSON" in r.json()["error"]["message"]


def test_demo_model_command_writes_a_two_stage_servable(tmp_path):
    from core.servable import load_manifest

    swarm = str(Path(sys.executable).parent / "swarm")
    out = subprocess.run([swarm, "demo-model", str(tmp_path / "swarm-demo"), "--steps", "2"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "2/2 loss" in out.stderr  # the progress bar reached its end
    m = load_manifest(tmp_path / "swarm-demo")
    assert m.model_id == "swarm-demo" and m.num_stages == 2 and m.boundaries is not None
    assert "enable_thinking" in m.chat_template


@pytest.mark.parametrize("args", [["models"], ["infer", "nope", "hi"], ["model-load", "nope", "--wait"],
                                  ["model-load", "good", "--replicas", "0"],
                                  ["model-load", "good", "--speculative", "9"],
                                  ["model-unload", "good"]])
def test_model_commands_fail_with_one_line(leader, args):
    import os

    swarm = str(Path(sys.executable).parent / "swarm")
    env = dict(os.environ, SWARM_LEADER_URL=leader.base_url)
    if args == ["models"]:  # nothing listens there: unreachable
        from tests.processes import free_port

        env["SWARM_LEADER_URL"] = f"http://127.0.0.1:{free_port()}"
    out = subprocess.run([swarm, *args], env=env, capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("swarm: error: "), out.stderr
    expected = {"models": "cannot reach the leader", "infer": "The model 'nope' does not exist",
                "model-load": "The model 'nope' does not exist", "model-unload": "is not loaded"}[args[0]]
    if "--replicas" in args:
        expected = "replicas must be at least 1"
    if "--speculative" in args:
        expected = "speculative must be a whole number of drafted tokens per decode pass from 0 (off) to 8"
    assert expected in lines[0]
