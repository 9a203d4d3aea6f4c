"""Through the real stack: a model trained over two stages, with one fellow online, is served as one
stage; the load's status says so (its reason), and the stage keeps the trained bottleneck inside it."""

from __future__ import annotations

import pytest

from core.nats_server import EmbeddedNats
from fellow.runtime.tools.export import export
from tests.serving_fixtures import Stack
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("fallback")
    hf = make_tiny_checkpoint(root / "hf-bn", layers=4, hidden=64, seed=2)
    export(hf, root / "servables" / "tiny-bn", stages=2, bottleneck=16, model_id="tiny-bn", calib_sequences=8,
           calib_seq_len=32)
    nats = EmbeddedNats(root / "js").start()
    stack = Stack(root, nats.url, root / "servables").start()
    yield stack
    stack.stop()
    nats.stop()


def test_one_fellow_serves_a_two_stage_model_as_one_stage_and_says_so(stack):
    load = stack.load("tiny-bn")
    assert load["num_stages"] == 1 and load["state"] == "ready"
    assert "served as one stage: the model trained over 2 stages and 1 online fellow(s)" in load["reason"]
    assert load["stages"][0]["kernels"]["inner"] == {"2": "bottleneck"}
    reply = stack.post("/v1/chat/completions", {"model": "tiny-bn", "max_tokens": 5, "temperature": 0,
                                                "messages": [{"role": "user", "content": "hello"}]})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
