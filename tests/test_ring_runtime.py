"""Ring stages in one process, frames through msgpack between inboxes: greedy equals the one-stage engine."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from core.servable import ServableError, load_manifest
from events.ring import Hidden, Token, decode_frame, encode_frame
from fellow.runtime.engine import Engine
from fellow.runtime.ring.head import RingHead
from fellow.runtime.ring.inbox import Inbox
from fellow.runtime.ring.loader import load_ring_stage
from fellow.runtime.ring.worker import RingWorker
from fellow.runtime.sampling import SamplingParams
from fellow.runtime.session import Session
from fellow.runtime.stage_loader import load_one_stage
from tests.processes import wait_until
from tests.serving_fixtures import make_servable

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [list(range(5, 40)), [7, 8, 9], list(range(100, 117)), [3] * 21, list(range(200, 260))]


@pytest.fixture(scope="module")
def servables(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("ring")
    _, two = make_servable(root, "tiny2", layers=4, hidden=64, stages=2)
    _, three = make_servable(root, "tiny3", layers=3, hidden=64, stages=3, seed=1)
    _, squeezed = make_servable(root, "tiny-bn", layers=4, hidden=64, stages=2, seed=2)
    return {"two": two, "three": three}


class LocalRing:
    """Stage 0's head and the later stages' workers on threads; every frame is encoded and decoded."""

    def __init__(self, model_dir, num_stages: int, prefill_chunk: int = 8, max_batch: int = 0):
        self.inboxes = [Inbox() for _ in range(num_stages)]
        self.stages = [load_ring_stage(model_dir, i, num_stages, device="cpu") for i in range(num_stages)]
        self.sent: list = []
        self.head = RingHead(self.stages[0].stage, self.stages[0].sender, self._sender(0), self.inboxes[0],
                             num_stages=num_stages, kv_tokens=4096, max_batch=max_batch, prefill_chunk=prefill_chunk)
        self.workers = [RingWorker(self.stages[i], self.inboxes[i], self._sender(i)) for i in range(1, num_stages)]
        self.threads = [threading.Thread(target=w.run, daemon=True) for w in self.workers]
        for t in self.threads:
            t.start()

    def _sender(self, stage: int):
        n = len(self.inboxes)

        def send(frame, lane=None):
            self.sent.append((stage, frame))
            target = 0 if lane == "tok" or stage == n - 1 else stage + 1
            self.inboxes[target].put(decode_frame(encode_frame(frame)))

        return send

    def generate(self, prompts, max_new_tokens: int) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            self.head.add(Session(f"s{i}", prompt, max_new_tokens, sampling=GREEDY))
        while self.head.busy:
            result = self.head.step()
            for sid, tokens in result.tokens.items():
                out.setdefault(sid, []).extend(tokens)
        return out

    def close(self):
        for w in self.workers:
            w.stop()


def one_stage(model_dir, prompts, max_new_tokens: int) -> dict[str, list[int]]:
    engine = Engine(load_one_stage(model_dir, "cpu").stage, kv_tokens=4096, max_batch=1)
    for i, prompt in enumerate(prompts):
        engine.add(Session(f"s{i}", prompt, max_new_tokens, sampling=GREEDY))
    out: dict[str, list[int]] = {}
    while engine.busy:
        for sid, tokens in engine.step().tokens.items():
            out.setdefault(sid, []).extend(tokens)
    return out


@pytest.mark.parametrize("which,stages", [("two", 2), ("three", 3), ("two", 3), ("three", 2)])
def test_greedy_ring_equals_one_stage_with_sessions_in_flight_and_pieces(servables, which, stages):
    model = servables[which]
    expected = one_stage(model, PROMPTS, 12)
    ring = LocalRing(model, stages, prefill_chunk=8)
    try:
        got = ring.generate(PROMPTS, 12)
        wait_until(lambda: all(not w.held for w in ring.workers), 10, "every stage dropped its caches")
    finally:
        ring.close()
    assert got == expected and not ring.head.sessions
    # prompts went in pieces, and decode positions went round in groups of more than one
    pieces = [f for s, f in ring.sent if s == 0 and isinstance(f, Hidden) and f.positions > 1]
    assert max(f.positions for f in pieces) == 8 and len(pieces) > len(PROMPTS)
    assert max(f.batch for s, f in ring.sent if isinstance(f, Token)) > 1
    # uncompressed: every position crosses as hidden x 2 bytes
    hidden = load_manifest(model).hidden_size
    assert {len(f.data) // f.positions for s, f in ring.sent if isinstance(f, Hidden)} == {hidden * 2}


def test_a_servable_without_boundaries_serves_only_its_own_count(servables, tmp_path):
    import shutil

    legacy = tmp_path / "legacy"
    shutil.copytree(servables["two"], legacy)
    manifest = json.loads((legacy / "servable.json").read_text())
    manifest["boundaries"] = None
    (legacy / "servable.json").write_text(json.dumps(manifest))
    with pytest.raises(ServableError, match="records no boundaries"):
        load_ring_stage(legacy, 0, 3, device="cpu")
    assert load_ring_stage(legacy, 1, 2, device="cpu").plan.layers == (2, 4)
