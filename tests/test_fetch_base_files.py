"""A fellow fetching an adapters export's base checkpoint for one stage of a 2-stage split takes, of a base
sharded into several safetensors files, only the shards that hold that stage's tensors (and every
weight-free file), from a real leader's per-file routes; a second stage on the same cache takes only what it
still lacks; the stage built over that partial base computes what the tuned model does; a file that does not
match its listed sha256 fails the fetch."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from core.nats_server import EmbeddedNats
from core.servable import fetched_base_dir, load_manifest
from core.servable_plan import plan_stage
from fellow.base_fetch import ensure_base, stage_files
from fellow.fetch import FetchError
from fellow.runtime.model.load.weights import build_stage_modules
from fellow.runtime.tools.export import export
from leader.archive import base_file
from tests.conftest import make_settings
from tests.serving_fixtures import Stack
from tests.test_servable_adapters import IDS, tiny_lora

BASE = "org/sharded-base"


@pytest.fixture(scope="module")
def leader(tmp_path_factory):
    root = tmp_path_factory.mktemp("basefiles")
    sharded, (_, _, expected) = tuned_over_sharded_base(root)
    nats = EmbeddedNats(root / "js").start()
    stack = Stack(root, nats.url, root / "servables", fellows=0,
                  SWARM_FELLOW_MODEL_CACHE=sharded.parent.parent).start()
    yield stack, root, sharded, expected
    stack.stop()
    nats.stop()


def tuned_over_sharded_base(root: Path) -> tuple[Path, tuple]:
    """(the base, tiny_lora's (checkpoint, adapters, logits)): tiny_lora's base saved again at
    ``root/leader-cache/BASE`` in several shards, a layer over two or three of them (the embeddings alone in
    one), and its adapters exported over it as the 2-stage servable ``root/servables/tuned``."""
    hf, lora, expected = tiny_lora(root)
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    sharded = save_beside(model, hf, root / "leader-cache" / BASE, max_shard_size="64KB")
    export(hf, root / "servables" / "tuned", stages=2, adapters=lora, base_id=BASE, model_id="tuned")
    return sharded, (hf, lora, expected)


def save_beside(model, hf: Path, out: Path, **save) -> Path:
    """``model`` saved at ``out`` (``save``: save_pretrained's options) with the weight-free files of ``hf``
    (its tokenizer) it did not write."""
    model.save_pretrained(str(out), **save)
    for f in hf.iterdir():
        if not (out / f.name).exists() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def fellow_settings(root: Path, stack: Stack, name: str):
    return make_settings(root / name, "nats://127.0.0.1:1", SWARM_LEADER_URL=stack.url,
                         SWARM_FELLOW_MODEL_CACHE=root / name / "models")


def held_by(sharded: Path, *, layers: range, embed: bool, head: bool) -> set[str]:
    """The shards holding those tensors, read from the index the way the test's own eyes do."""
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    return {file for key, file in weight_map.items()
            if any(key.startswith(f"model.layers.{i}.") for i in layers)
            or (embed and key == "model.embed_tokens.weight") or (head and key == "model.norm.weight")}


def files_of(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def test_the_leader_lists_the_base_and_serves_its_files_with_range(leader):
    stack, _, sharded, _ = leader
    listing = stack.get("/api/v1/models/tuned/base/files").json()["data"]
    assert {f["path"]: f["bytes"] for f in listing} == files_of(sharded)
    config = next(f for f in listing if f["path"] == "config.json")
    whole = stack.get("/api/v1/models/tuned/base/files/config.json")
    assert whole.status_code == 200 and whole.content == (sharded / "config.json").read_bytes()
    assert whole.headers["x-swarm-sha256"] == config["sha256"]
    tail = httpx.get(stack.url + "/api/v1/models/tuned/base/files/config.json", headers={"Range": "bytes=10-"})
    assert tail.status_code == 206 and tail.content == whole.content[10:]
    for bad in ("..%2Fservable.json", "..%2F..%2Fswarm.db", "tokenizer.json%2F..%2F..%2Fx"):  # upwards: refused
        refused = stack.get(f"/api/v1/models/tuned/base/files/{bad}")
        assert refused.status_code == 400, (bad, refused.text)
        assert refused.json()["error"]["code"] == "invalid_value" and "not a path inside" in refused.text
    # an absolute path reaches the route without its leading slashes, so it names a file inside the base
    assert stack.get("/api/v1/models/tuned/base/files/%2Fetc%2Fpasswd").json()["error"]["code"] == "file_not_found"
    for bad in ("/etc/passwd", "../x", "a/../../x", "C:/x", "a\\..\\..\\x"):
        with pytest.raises(ValueError, match="not a path inside"):
            base_file(sharded, bad)
    assert stack.get("/api/v1/models/tuned/base/files/nothing.json").status_code == 404


def test_a_stage_fetches_only_its_shards_then_the_other_stage_only_what_it_lacks(leader):
    stack, root, sharded, expected = leader
    settings = fellow_settings(root, stack, "fellow-a")
    manifest = load_manifest(root / "servables" / "tuned")
    shards = {n for n in files_of(sharded) if n.endswith(".safetensors")}
    assert len(shards) >= 4, shards
    weightless = {n for n in files_of(sharded) if not n.endswith(".safetensors")}
    last = held_by(sharded, layers=range(2, 4), embed=True, head=True)  # the head is tied to the embeddings
    first = held_by(sharded, layers=range(0, 2), embed=True, head=False)
    assert last < shards and first < shards and first - last

    target = ensure_base(settings, "tuned", root / "servables" / "tuned", stage=1, num_stages=2)
    assert target == fetched_base_dir(BASE, settings.fellow.model_cache)
    got = files_of(target)
    assert set(got) == weightless | last
    whole = sum(files_of(sharded).values())
    assert sum(got.values()) < whole
    print(f"base {whole} bytes; stage 1 of 2 fetched {sum(got.values())} bytes")  # noqa: T201

    # the last stage over its partial base: with a stage 0 over the whole base, the tuned model's logits
    stage0 = build_stage_modules(manifest, 0, root / "servables" / "tuned", model_cache=sharded.parent.parent)
    stage1 = build_stage_modules(manifest, 1, root / "servables" / "tuned", model_cache=settings.fellow.model_cache)
    logits = stage1.forward(stage0.forward(IDS))
    assert torch.allclose(logits, expected, atol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))

    kept = {n: (target / n).stat().st_mtime_ns for n in got}
    ensure_base(settings, "tuned", root / "servables" / "tuned", stage=0, num_stages=2)
    now = files_of(target)
    assert set(now) == weightless | last | first  # only the first stage's missing shards came
    assert {n: (target / n).stat().st_mtime_ns for n in got} == kept  # those here were kept, not fetched again
    assert not (target.parent / f"{target.name}.parts").exists()
    # all a stage needs is here: the listing kept beside it answers, and the leader is not asked
    offline = make_settings(root / "fellow-a", "nats://127.0.0.1:1", SWARM_LEADER_URL="http://127.0.0.1:1",
                            SWARM_FELLOW_MODEL_CACHE=settings.fellow.model_cache)
    assert ensure_base(offline, "tuned", root / "servables" / "tuned", stage=1, num_stages=2, attempts=1) == target


def test_a_file_that_does_not_match_its_sha256_fails_the_fetch(leader):
    stack, root, sharded, _ = leader
    settings = fellow_settings(root, stack, "fellow-b")
    listing = stack.get("/api/v1/models/tuned/base/files").json()["data"]  # hashed by the leader now
    victim = sharded / sorted(held_by(sharded, layers=range(0, 1), embed=False, head=False))[0]
    original, stat = victim.read_bytes(), victim.stat()
    try:  # the bytes change under the leader, its size and mtime do not: it serves them as listed
        victim.write_bytes(original[:-4] + bytes(b ^ 0xFF for b in original[-4:]))
        os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        with pytest.raises(FetchError, match=f"{victim.name} of the base of tuned does not match its checksum"):
            ensure_base(settings, "tuned", root / "servables" / "tuned", stage=0, num_stages=2)
    finally:
        victim.write_bytes(original)
        os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    target = fetched_base_dir(BASE, settings.fellow.model_cache)
    assert not (target / victim.name).exists()
    assert {f["path"] for f in listing} >= set(files_of(target))


def test_which_files_a_stage_needs_from_an_index(leader):
    _, root, _, _ = leader
    manifest = load_manifest(root / "servables" / "tuned")
    listing = [{"path": p, "bytes": 1, "sha256": ""} for p in
               ("config.json", "tokenizer.json", "model.safetensors.index.json", "a.safetensors", "b.safetensors",
                "c.safetensors", "original/consolidated.pth")]
    index = {"weight_map": {"model.embed_tokens.weight": "a.safetensors", "model.layers.0.mlp.w": "a.safetensors",
                            "model.layers.1.mlp.w": "b.safetensors", "model.layers.2.mlp.w": "b.safetensors",
                            "model.layers.3.mlp.w": "c.safetensors", "model.norm.weight": "c.safetensors",
                            "lm_head.weight": "c.safetensors"}}
    weightless = {"config.json", "tokenizer.json", "model.safetensors.index.json"}
    first, last = plan_stage(manifest, 0, 2), plan_stage(manifest, 1, 2)
    assert stage_files(listing, index, first) == (weightless | {"a.safetensors", "b.safetensors"}, "")
    assert stage_files(listing, index, last) == (weightless | {"b.safetensors", "c.safetensors"}, "")
    tied = {k: v for k, v in index["weight_map"].items() if k != "lm_head.weight"}  # the head: the embeddings
    assert stage_files(listing, {"weight_map": tied}, last)[0] == weightless | {"a.safetensors", "b.safetensors",
                                                                                   "c.safetensors"}
    needed, why = stage_files(listing, None, last)  # no index: every top-level safetensors file, and why
    assert needed == weightless | {"a.safetensors", "b.safetensors", "c.safetensors"} and "index" in why
    single = [f for f in listing if f["path"] in weightless | {"a.safetensors"}]
    assert stage_files(single, None, last) == (weightless | {"a.safetensors"}, "")
