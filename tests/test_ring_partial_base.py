"""A 2-stage ring of an adapters export whose base neither fellow had: a real leader holds the base, sharded
into several safetensors files; two real fellows, each with its own empty model cache, load the stages and
fetch, each, only the shards its stage reads (and every weight-free file); the ring's greedy reply through
the gateway is, token for token, the tuned model's own (its adapters merged into the base, run by
transformers)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.nats_server import EmbeddedNats
from core.servable import fetched_base_dir, resolve_base
from tests.processes import SwarmProcess
from tests.serving_fixtures import Stack, hf_greedy
from tests.test_fetch_base_files import BASE, files_of, held_by, save_beside, tuned_over_sharded_base

pytestmark = pytest.mark.slow

FELLOWS = ["f0", "f1"]
LAYERS = 4  # tiny_lora's
PROMPT = "hello"  # the tuned model: three newlines, then "@" and byte pieces
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    root = tmp_path_factory.mktemp("ring-partial-base")
    sharded, (hf, lora, _) = tuned_over_sharded_base(root)
    base = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    tuned = save_beside(PeftModel.from_pretrained(base, str(lora)).merge_and_unload(), hf, root / "tuned-hf")
    nats = EmbeddedNats(root / "js").start()
    stack = Stack(root, nats.url, root / "servables", fellows=0, SWARM_FELLOW_MODEL_CACHE=sharded.parent.parent,
                  OMP_NUM_THREADS=1)
    # each fellow its own empty model cache, as on machines of their own
    stack.fellows = [SwarmProcess(["fellow", "--id", f], {**stack.env, "SWARM_FELLOW_MODEL_CACHE": str(root / f)},
                                  root / f"{f}.log") for f in FELLOWS]
    try:
        stack.start()
        yield stack, root, sharded, tuned
    finally:
        stack.stop()
        nats.stop()


def test_a_ring_over_a_base_neither_fellow_had_fetches_each_stage_its_shards_and_replies_as_the_tuned_model(ring):
    stack, root, sharded, tuned = ring
    assert all(resolve_base(BASE, root / f) is None for f in FELLOWS)
    load = stack.load("tuned", num_stages=2, fellow_ids=FELLOWS)
    assert [s["fellow_id"] for s in load["stages"]] == FELLOWS, load

    want = hf_greedy(tuned, PROMPT, MAX_TOKENS)
    assert want  # some tokens, not an end of turn at once
    reply = stack.post("/v1/chat/completions", {"model": "tuned", "max_tokens": MAX_TOKENS, "temperature": 0,
                                                "logprobs": True, "messages": [{"role": "user", "content": PROMPT}]})
    assert reply.status_code == 200, (reply.text, stack.logs())
    choice = reply.json()["choices"][0]
    tokenizer = AutoTokenizer.from_pretrained(str(tuned))
    assert [e["token"] for e in choice["logprobs"]["content"]] == [tokenizer.decode([t]) for t in want]
    assert choice["message"]["content"] == tokenizer.decode(want, skip_special_tokens=False)
    assert reply.json()["usage"]["completion_tokens"] == len(want)

    whole = files_of(sharded)
    weightless = {n for n in whole if not n.endswith(".safetensors")}
    needs = []
    for s in load["stages"]:
        lo, hi = s["layers"]
        cache = root / s["fellow_id"]
        need = held_by(sharded, layers=range(lo, hi), embed=True, head=hi == LAYERS)  # the head: the embeddings
        have = files_of(fetched_base_dir(BASE, cache))
        assert set(have) == weightless | need, (s["fellow_id"], sorted(have))
        assert have == {n: whole[n] for n in have}  # each file whole
        assert all(n.startswith("bases/") for n in files_of(cache))  # the base's files, nothing else
        needs.append(need)
        print(f"{s['fellow_id']} (layers {lo}-{hi}): {len(need)} of {len(whole) - len(weightless)} shards, "  # noqa: T201
              f"{sum(have.values())} of {sum(whole.values())} bytes")
    first, last = needs
    assert first - last and last - first  # each fellow lacks a shard only the other stage reads
