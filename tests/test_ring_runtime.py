"""Ring stages in one process, frames through msgpack between inboxes: greedy equals the one-stage engine."""

from __future__ import annotations

import json
import shutil
import threading

import msgspec
import pytest
import torch

from core.servable import ServableError, load_manifest
from events.requests import Sampling
from events.ring import Hidden, Token, decode_frame, encode_frame
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.session import Session
from fellow.runtime.model.load.loader import load_one_stage
from fellow.runtime.ring.head import ring_engine
from fellow.runtime.ring.inbox import Inbox
from fellow.runtime.ring.loader import load_ring_stage
from fellow.runtime.ring.worker import RingWorker
from fellow.runtime.tools.export import export
from tests.processes import wait_until
from tests.serving_fixtures import make_servable
from tests.tiny import make_tiny_checkpoint

GREEDY = Sampling(temperature=0.0)
PROMPTS = [list(range(5, 40)), [7, 8, 9], list(range(100, 117)), [3] * 21, list(range(200, 260))]


@pytest.fixture(scope="module")
def servables(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("ring")
    _, two = make_servable(root, "tiny2", layers=4, hidden=64, stages=2)
    _, three = make_servable(root, "tiny3", layers=3, hidden=64, stages=3, seed=1)
    hf = make_tiny_checkpoint(root / "hf-bn", layers=4, hidden=64, seed=2)
    bottleneck = root / "servables" / "tiny-bn"
    export(hf, bottleneck, stages=2, bottleneck=16, model_id="tiny-bn", calib_sequences=16, calib_seq_len=64)
    quantized = root / "servables" / "tiny-q8"
    shutil.copytree(two, quantized)
    manifest = json.loads((quantized / "servable.json").read_text())
    manifest.update(model_id="tiny-q8", compressors=[{"kind": "quantizer", "bits": 8}])
    (quantized / "servable.json").write_text(json.dumps(manifest))
    return {"two": two, "three": three, "bottleneck": bottleneck, "quantizer": quantized}


class LocalRing:
    """Stage 0's head and the later stages' workers on threads; every frame is encoded and decoded."""

    def __init__(self, model_dir, num_stages: int, prefill_chunk: int = 8, max_batch: int = 0,
                 prefix: bool = False, kv_tokens: int = 4096, stage_kv: list[int] | None = None,
                 speculative: int = 0, drafter=None):
        self.inboxes = [Inbox() for _ in range(num_stages)]
        self.stages = [load_ring_stage(model_dir, i, num_stages, device="cpu") for i in range(num_stages)]
        self.sent: list = []
        self.timings: dict[str, dict] = {}
        self.head = ring_engine(self.stages[0].stage, self.stages[0].sender, self._sender(0), self.inboxes[0],
                             num_stages=num_stages, kv_tokens=kv_tokens, max_batch=max_batch,
                             prefill_chunk=prefill_chunk, prefix_cache=prefix, speculative=speculative)
        self.workers = [RingWorker(self.stages[i], self.inboxes[i], self._sender(i),
                                   prefix_tokens=kv_tokens if prefix else 0,
                                   kv_tokens=stage_kv[i - 1] if stage_kv else kv_tokens,
                                   drafter=drafter if i == num_stages - 1 else None) for i in range(1, num_stages)]
        if drafter is not None:  # what stage 0 learns from the probe (RingHeadServer._fit_ring)
            self.head.runner.drafts_from(drafter.name)
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
        for i, prompt in enumerate(prompts):
            self.head.add(Session(f"s{i}", prompt, max_new_tokens, sampling=GREEDY))
        return self.drain()

    def drain(self) -> dict[str, list[int]]:
        """Step the head until the sessions it holds end: each one's tokens (timings into ``timings``)."""
        out: dict[str, list[int]] = {}
        while self.head.busy:
            result = self.head.step()
            for sid, tokens in result.tokens.items():
                out.setdefault(sid, []).extend(tokens)
            self.timings.update({session.session_id: session.timing() for session in result.finished})
        return out

    def settle(self) -> None:
        """Wait until every later stage has dropped its sessions' caches (their End frames are in)."""
        wait_until(lambda: all(not w.held for w in self.workers), 10, "every stage dropped its caches")

    def close(self):
        for w in self.workers:
            w.stop()


def one_stage(model_dir, prompts, max_new_tokens: int, max_batch: int = 1,
              prefill_chunk: int = 256) -> dict[str, list[int]]:
    engine = local_engine(load_one_stage(model_dir, "cpu").stage, kv_tokens=4096, max_batch=max_batch,
                    prefill_chunk=prefill_chunk)
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
        ring.settle()
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


def cache_free_greedy(ring: LocalRing, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The whole sequence through the same stages and boundary codecs each step, with no cache kept."""
    ids, out = list(prompt), []
    for _ in range(max_new_tokens):
        x = torch.tensor(ids)
        for before, loaded in zip([None, *ring.stages], ring.stages):
            if before is not None:  # the previous stage's output as its sender puts it on the wire
                rows = before.sender.encode(x)
                x = loaded.receiver.decode(rows, len(ids), loaded.stage.dtype, loaded.stage.input_device)
            x = loaded.stage.forward_piece(loaded.stage.new_cache(), x)
        token = int(x.argmax())
        if token in ring.stages[0].stop_ids:
            break
        ids.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize("which,stages,wire", [("bottleneck", 2, [32]), ("bottleneck", 3, [32, 128]),
                                               ("quantizer", 2, [66]), ("two", 3, [128, 128])])
def test_boundary_codecs_on_the_wire(servables, which, stages, wire):
    """A learned bottleneck sends its narrow code where training cut; a cut training lacked goes
    uncompressed; a quantizer sends int8 and a scale. Served with caches and batches, the reply is
    what a cache-free pass through the same stages and codecs gives."""
    ring = LocalRing(servables[which], stages, prefill_chunk=8)
    try:
        got = ring.generate(PROMPTS[:3], 10)
        expected = {f"s{i}": cache_free_greedy(ring, p, 10) for i, p in enumerate(PROMPTS[:3])}
    finally:
        ring.close()
    assert got == expected and all(got.values())
    per_position = [{(len(f.data) + len(f.scale)) // f.positions for s, f in ring.sent
                     if s == stage and isinstance(f, Hidden)} for stage in range(stages - 1)]
    assert per_position == [{b} for b in wire]
    assert ring.head.sessions == {} and ring.stages[0].sender.bytes_per_position == wire[0]
    assert {t["bytes_per_token"] for t in ring.timings.values()} == {wire[0]}


def test_a_frame_that_fails_on_a_later_stage_ends_only_its_own_request(servables):
    ring = LocalRing(servables["three"], 3, prefill_chunk=8)
    expected = one_stage(servables["three"], PROMPTS[:3], 12)
    try:
        for i, prompt in enumerate(PROMPTS[:3]):
            ring.head.add(Session(f"s{i}", prompt, 12, sampling=GREEDY))
        got: dict[str, list[int]] = {}
        ended = []
        while ring.head.busy:
            result = ring.head.step()
            for sid, tokens in result.tokens.items():
                got.setdefault(sid, []).extend(tokens)
            ended += result.finished
            if len(got.get("s1", [])) == 2 and not any(isinstance(f, Hidden) and f.pos == 10**6 for _, f in ring.sent):
                bad = Hidden(session="s1", pos=10**6, positions=1, data=b"\0" * 128)
                ring.sent.append((0, bad))
                ring.inboxes[1].put(bad)  # a frame stage 1 cannot run for s1
    finally:
        ring.close()
    failed = {s.session_id: s.error for s in ended if s.finish_reason == "error"}
    assert list(failed) == ["s1"] and failed["s1"].code == "stage_failed" and "stage 1" in str(failed["s1"])
    assert got["s0"] == expected["s0"] and got["s2"] == expected["s2"]
    assert len(got["s1"]) < len(expected["s1"])


def test_a_cancelled_session_leaves_no_cache_on_any_stage(servables):
    ring = LocalRing(servables["three"], 3, prefill_chunk=8)
    try:
        for i, prompt in enumerate(PROMPTS[:2]):
            ring.head.add(Session(f"s{i}", prompt, 40, sampling=GREEDY))
        finished = []
        while ring.head.busy:
            result = ring.head.step()
            finished += result.finished
            if "s0" in result.tokens:
                ring.head.cancel("s0")
        ring.settle()
    finally:
        ring.close()
    reasons = {s.session_id: s.finish_reason for s in finished}
    assert reasons["s0"] == "cancelled" and reasons["s1"] in ("length", "stop")
    assert ring.head.budget.reserved == 0


def test_sampled_ring_draws_what_one_stage_draws_with_the_same_seed(servables):
    sampled = Sampling(temperature=0.9, top_p=0.95, top_k=40, seed=7)
    engine = local_engine(load_one_stage(servables["two"], "cpu").stage, kv_tokens=4096)
    engine.add(Session("a", PROMPTS[0], 16, sampling=sampled))
    engine.add(Session("b", PROMPTS[1], 16, sampling=Sampling(temperature=0.7, seed=8)))
    expected: dict[str, list[int]] = {}
    while engine.busy:
        for sid, tokens in engine.step().tokens.items():
            expected.setdefault(sid, []).extend(tokens)
    ring = LocalRing(servables["two"], 2, prefill_chunk=8)
    try:
        ring.head.add(Session("a", PROMPTS[0], 16, sampling=sampled))
        ring.head.add(Session("b", PROMPTS[1], 16, sampling=Sampling(temperature=0.7, seed=8)))
        got: dict[str, list[int]] = {}
        while ring.head.busy:
            for sid, tokens in ring.head.step().tokens.items():
                got.setdefault(sid, []).extend(tokens)
    finally:
        ring.close()
    assert got == expected


def test_the_demo_model_over_a_ring_equals_it_on_one_stage(tmp_path):
    from fellow.runtime.tools.demo_model import make_demo_model

    make_demo_model(tmp_path / "demo", seed=0, steps=6, vocab=512, hidden=64, layers=2, seq_len=64, batch=8)
    expected = one_stage(tmp_path / "demo", PROMPTS[:3], 10)
    ring = LocalRing(tmp_path / "demo", 2, prefill_chunk=8)
    try:
        got = ring.generate(PROMPTS[:3], 10)
    finally:
        ring.close()
    assert got == expected and all(got.values())


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


def ring_chat(ring: LocalRing, turns: int, tag: str) -> list[tuple[list[int], dict]]:
    """A chat over the ring whose every turn sends the whole conversation again: (reply, timing) per turn."""
    history, out = [], []
    for turn in range(turns):
        prompt = history + PROMPTS[turn % len(PROMPTS)][:9 + turn]
        sid = f"{tag}{turn}"
        ring.head.add(Session(sid, prompt, 10, sampling=GREEDY))
        reply: list[int] = []
        while ring.head.busy:
            result = ring.head.step()
            reply += result.tokens.get(sid, [])
            ring.timings.update({s.session_id: s.timing() for s in result.finished})
        out.append((reply, ring.timings[sid]))
        history = prompt + reply
        # the End went round: every later stage kept this turn's positions before the next turn goes
        wait_until(lambda: all(not w.held for w in ring.workers), 10, "every stage ended the turn")
    return out


@pytest.mark.parametrize("stages", [2, 3])
def test_a_ring_reuses_the_last_turn_on_every_stage_and_replies_as_without(servables, stages):
    model = servables["three"]
    off, on = LocalRing(model, stages), LocalRing(model, stages, prefix=True)
    try:
        without, with_cache = ring_chat(off, 4, "c"), ring_chat(on, 4, "c")
    finally:
        off.close()
        on.close()
    assert [r for r, _ in with_cache] == [r for r, _ in without] and all(r for r, _ in without)
    assert [t["cached_tokens"] for _, t in without] == [0] * 4
    for (before, t0), (_, t1) in zip(with_cache, with_cache[1:]):
        # exactly the positions the last turn's caches held: its prompt and its reply less the token never fed
        assert t1["cached_tokens"] == t0["prompt_tokens"] + len(before) - 1
    first = [f for s, f in on.sent if s == 0 and isinstance(f, Hidden) and f.first]
    assert [len(f.reuse) for f in first][1:] == [t["cached_tokens"] for _, t in with_cache[1:]]
    assert on.head.runner.prefix_fallbacks == 0 and all(w.prefix.tokens == on.head.prefix.tokens for w in on.workers)


@pytest.mark.parametrize("lost", [0, -1])
def test_a_stage_that_lost_the_prefix_makes_the_session_start_over_with_the_same_reply(servables, lost):
    model = servables["three"]
    expected = ring_chat(ring := LocalRing(model, 3), 2, "c")
    ring.close()
    ring = LocalRing(model, 3, prefix=True)
    try:
        first = ring_chat(ring, 1, "c")
        ring.workers[lost].prefix.clear()  # idle: every stage ended the turn
        history = PROMPTS[0][:9] + first[0][0]
        second = ring_chat_turn(ring, history + PROMPTS[1][:10], "c1")
        ring.settle()
    finally:
        ring.close()
    assert second[0] == expected[1][0] and second[1]["cached_tokens"] == 0
    assert ring.head.runner.prefix_fallbacks == 1 and ring.head.budget.reserved == 0
    missing = [f for _, f in ring.sent if isinstance(f, Token) and f.error]
    assert [f.code for f in missing] == ["prefix_missing"]


def ring_chat_turn(ring: LocalRing, prompt: list[int], sid: str) -> tuple[list[int], dict]:
    ring.head.add(Session(sid, prompt, 10, sampling=GREEDY))
    reply: list[int] = []
    while ring.head.busy:
        result = ring.head.step()
        reply += result.tokens.get(sid, [])
        ring.timings.update({s.session_id: s.timing() for s in result.finished})
    return reply, ring.timings[sid]


def test_a_later_stage_evicts_by_stage_zeros_ledger(servables):
    """Kept blocks on a later stage give way to live reservations as stage 0's do."""
    ring = LocalRing(servables["two"], 2, prefix=True, kv_tokens=160)
    try:
        ring_chat(ring, 1, "a")
        kept = ring.workers[0].prefix.tokens
        assert kept and kept == ring.head.prefix.tokens
        ring.generate([list(range(100, 240))], 10)  # 150 positions reserved: almost no room left
        wait_until(lambda: not ring.workers[0].held, 10, "the stage ended the session")
    finally:
        ring.close()
    assert ring.workers[0].prefix.tokens <= 160 and ring.head.prefix.tokens <= 160


def _copy_text(seed: int = 1) -> list[int]:
    """Phrases of 6 tokens strung in a random order (no special ids): a token's successor depends on its phrase."""
    generator = torch.Generator().manual_seed(seed)
    phrases = [torch.randint(5, 300, (6,), generator=generator).tolist() for _ in range(8)]
    return [t for i in torch.randint(0, 8, (30,), generator=generator).tolist() for t in phrases[i]]


COPY_TEXT = _copy_text()


def planted_servable(root, model_id: str, layers: int, seed: int, stages: int):
    """A servable of a random llama that copies COPY_TEXT (tests/copying.py): its drafts stand and fall."""
    from transformers import AutoModelForCausalLM

    from tests.copying import plant_bigrams

    hf = make_tiny_checkpoint(root / f"hf-{model_id}", family="llama", layers=layers, hidden=64, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(str(hf))
    plant_bigrams(model, COPY_TEXT)
    model.save_pretrained(str(hf))
    out = root / "servables" / model_id
    export(hf, out, stages=stages, model_id=model_id)
    return out


@pytest.fixture(scope="module")
def copier(tmp_path_factory):
    """A 3-stage servable of the copying model."""
    return planted_servable(tmp_path_factory.mktemp("copier"), "copier", layers=3, seed=3, stages=3)


def copying_prompts(n: int) -> list[list[int]]:
    return [COPY_TEXT[: 57 + 3 * i] for i in range(n)]


def spec_ring(model, stages: int, k: int, prefix: bool = False, full: bool = True, drafter=None) -> LocalRing:
    """A ring whose stage 0 drafts up to k (with ``drafter``, its last stage's draft model guesses too);
    ``full``: also while more than one session a stage is in it (the default drafts only below that:
    SPEC_MAX_ACTIVE_PER_STAGE), so drafting and plain sessions mix."""
    ring = LocalRing(model, stages, prefill_chunk=8, prefix=prefix, speculative=k, drafter=drafter)
    if full:
        ring.head.runner.units.spec_max_active_per_stage = 8
    return ring


@pytest.mark.parametrize("stages,prefix", [(2, False), (3, True)])
def test_a_ring_that_drafts_replies_as_one_that_does_not(copier, stages, prefix):
    """Stage 0 drafts by prompt lookup, the last stage verifies, every stage crops: greedy replies are the
    one-stage engine's, token for token, with drafting and plain sessions in flight together; with a
    prefix cache, every stage keeps the same positions (a middle stage drops the drafts that fell)."""
    prompts = copying_prompts(3) + PROMPTS[:2]
    expected = one_stage(copier, prompts, 30)
    ring = spec_ring(copier, stages, 4, prefix=prefix)
    try:
        got = ring.generate(prompts, 30)
        ring.settle()
    finally:
        ring.close()
    assert got == expected
    timings = [ring.timings[f"s{i}"] for i in range(3)]
    drafted, accepted = sum(t["spec_drafted"] for t in timings), sum(t["spec_accepted"] for t in timings)
    assert 0 < accepted < drafted  # drafts stood, and some fell (so every stage cropped)
    assert all(t["spec_passes"] < 29 for t in timings)  # fewer passes than tokens
    verify = [f for s, f in ring.sent if s == 0 and isinstance(f, Hidden) and f.kind == 3]
    assert verify and all(len(f.draft) + 1 == f.positions for f in verify)
    assert ring.head.budget.reserved == 0
    if prefix:
        assert ring.head.prefix.tokens > 0
        assert all(w.prefix.tokens == ring.head.prefix.tokens for w in ring.workers)


@pytest.fixture(scope="module")
def small_copier(tmp_path_factory):
    """A 1-layer draft for the copier: the same tokenizer and planted text, other weights."""
    return planted_servable(tmp_path_factory.mktemp("small-copier"), "small-copier", layers=1, seed=9, stages=1)


@pytest.mark.parametrize("stages", [2, 3])
def test_a_ring_whose_last_stage_drafts_with_a_draft_model_replies_as_one_that_does_not(copier, small_copier,
                                                                                     stages):
    """The spec's TS9: the ring's last stage holds the draft model; after it answers a frame that asks
    (draft_k), its guesses ride back on the token frame and stage 0 sends them round as the next pass's
    drafts where prompt lookup has no full run (random prompts), lookup's where it has (copying ones).
    Greedy replies are the one-stage engine's, token for token; the guesses both stood and fell; the
    draft model's caches go with their sessions, and stage 0 holds none of its positions."""
    from fellow.runtime.engine.draft_model import DraftModel
    from fellow.runtime.ring.drafts import LastStageDrafter, RingDrafts

    prompts = copying_prompts(2) + PROMPTS[:2]
    expected = one_stage(copier, prompts, 24)
    last = load_ring_stage(copier, stages - 1, stages, device="cpu")
    draft = DraftModel(load_one_stage(small_copier, "cpu").stage, last.stage, name="small-copier")
    ring = spec_ring(copier, stages, 4, drafter=LastStageDrafter(draft, last.grammar_tokenizer()[1]))
    try:
        assert isinstance(ring.head.draft, RingDrafts) and ring.head.draft.name == "small-copier"
        got = ring.generate(prompts, 24)
        ring.settle()
    finally:
        ring.close()
    assert got == expected
    timings = [ring.timings[f"s{i}"] for i in range(4)]
    model_drafted = sum(t.get("spec_model_drafted", 0) for t in timings)
    model_accepted = sum(t.get("spec_model_accepted", 0) for t in timings)
    assert 0 < model_accepted < model_drafted
    assert all(timings[i].get("spec_model_drafted") for i in (2, 3))  # lookup found no run: the model drafted
    assert sum(t["spec_drafted"] for t in timings) > model_drafted  # and lookup drafted first where it could
    asked = [f for s, f in ring.sent if s == 0 and isinstance(f, Hidden) and f.draft_k]
    guesses = [f for s, f in ring.sent if s == stages - 1 and isinstance(f, Token) and f.draft]
    assert asked and guesses and all(len(f.draft) <= 4 for f in guesses)
    assert not draft.states and draft.positions == 0 and ring.head.budget.reserved == 0
    assert ring.head.draft.latest == {} and ring.head.stats().get("draft_positions", 0) == 0


def test_a_rings_last_stage_loads_the_draft_model_and_budgets_for_both(copier, small_copier):
    """Stage 0 of a drafting ring loads no draft model; its last stage does, and each of its budget's tokens
    holds a position of both models (fewer than placement planned), which the probe tells stage 0."""
    from events.stage import StageConfig, StageOptions
    from fellow.runtime.ring.servers import RingHeadServer, RingStageServer

    def config(stage: int) -> StageConfig:
        return StageConfig(load_id="ld-draft", model_id="copier", model_dir=str(copier), nats_url="nats://x:1",
                           fellow_id="f0", stage=stage, num_stages=3,
                           options=StageOptions(max_in_flight=3, kv_tokens=3 * 512, prefill_chunk=8, speculative=4,
                                                draft_model_dir=str(small_copier) if stage == 2 else ""))
    last = RingStageServer(config(2))
    last.load()
    assert last.draft.name == "small-copier" and last.worker.drafter.model is last.draft
    assert last.stage.kernels.draft_decoder == "eager"  # no CUDA here
    assert last.kv_tokens == last.worker.kv_tokens == last.draft.budget_tokens(3 * 512) < 3 * 512
    head = RingHeadServer(config(0))
    head.load()
    assert head.draft is None and head.engine.draft is None and head.kv_own == 3 * 512


def test_a_ring_that_drafts_samples_what_one_stage_that_drafts_samples(copier):
    """Sampled: the last stage verifies with the request's own generator as the one-stage engine does,
    so the same seed gives the same tokens."""
    params = [Sampling(temperature=0.9, top_p=0.95, top_k=40, seed=7), Sampling(temperature=0.7, seed=8)]
    prompts = copying_prompts(2)
    engine = local_engine(load_one_stage(copier, "cpu").stage, kv_tokens=4096, speculative=4, max_batch=1)
    for i, p in enumerate(params):
        engine.add(Session(f"s{i}", prompts[i], 20, sampling=p))
    expected: dict[str, list[int]] = {}
    while engine.busy:
        for sid, tokens in engine.step().tokens.items():
            expected.setdefault(sid, []).extend(tokens)
    ring = spec_ring(copier, 2, 4)
    try:
        for i, p in enumerate(params):
            ring.head.add(Session(f"s{i}", prompts[i], 20, sampling=p))
        got = ring.drain()
    finally:
        ring.close()
    assert got == expected
    assert sum(t["spec_passes"] for t in ring.timings.values()) > 0


def test_a_session_cancelled_with_a_verify_pass_in_the_ring_leaves_no_cache_on_any_stage(copier):
    ring = spec_ring(copier, 3, 4)
    try:
        prompts = copying_prompts(2)
        ring.head.add(Session("s0", prompts[0], 40, sampling=GREEDY))
        ring.head.add(Session("s1", prompts[1], 12, sampling=GREEDY))
        finished, cancelled = [], False
        while ring.head.busy:
            result = ring.head.step()
            finished += result.finished
            if not cancelled and any(isinstance(f, Hidden) and f.kind == 3 and f.session == "s0" for _, f in ring.sent):
                ring.head.cancel("s0")  # a verify pass of it is in the ring now
                cancelled = True
        ring.settle()
    finally:
        ring.close()
    assert {s.session_id: s.finish_reason for s in finished}["s0"] == "cancelled"
    assert ring.head.budget.reserved == 0


def test_a_ring_whose_middle_stage_is_replaced_replays_its_sessions_to_the_same_replies(copier):
    """Stage 0 pauses while a lost stage is re-placed (a fresh stage, no caches, an empty lane), then
    every session prefills its prompt and its reply so far again and goes on: greedy replies unchanged.

    The replay computes the reply's positions as prompt pieces rather than one by one, which rounds
    differently in the last bits: the copying model's clear margins keep greedy choices apart from that."""
    model = copier
    prompts = copying_prompts(2) + PROMPTS[1:2]
    expected = one_stage(model, prompts, 30)
    ring = LocalRing(model, 3, prefill_chunk=8)
    got: dict[str, list[int]] = {}
    finished = []
    try:
        for i, prompt in enumerate(prompts):
            ring.head.add(Session(f"s{i}", prompt, 30, sampling=GREEDY))
        replaced = False
        while ring.head.busy:
            result = ring.head.step()
            for sid, tokens in result.tokens.items():
                got.setdefault(sid, []).extend(tokens)
            finished += result.finished
            if not replaced and len(got) == len(prompts) and min(map(len, got.values())) >= 2:
                replaced = True  # every session has frames in the ring, so every one must replay
                ring.head.runner.pause("stage 1 is lost")
                paused = ring.head.step()  # what came back before the pause counts; nothing after it
                for sid, tokens in paused.tokens.items():
                    got.setdefault(sid, []).extend(tokens)
                ring.workers[0].stop()  # the lost stage, with its caches and whatever waited for it
                ring.inboxes[1] = Inbox()
                ring.workers[0] = RingWorker(ring.stages[1], ring.inboxes[1], ring._sender(1))
                threading.Thread(target=ring.workers[0].run, daemon=True).start()
                ring.head.runner.resume()
    finally:
        ring.close()
    assert replaced and got == expected, {k: (got[k], expected[k]) for k in got if got[k] != expected[k]}
    assert [s.timing().get("replays", 0) for s in finished] == [1, 1, 1] and ring.head.runner.replays == 3


def test_a_ring_that_drafts_leaves_a_grammar_row_undrafted(copier):
    """A session under a grammar drafts nothing on a drafting ring (its mask is computed one position at a
    time, on the last stage); the sessions beside it draft, and its reply follows the grammar."""
    from llguidance import LLMatcher

    from tests.tiny import _tokenizer

    tok = _tokenizer()
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    ring = spec_ring(copier, 2, 4)
    stops = ring.stages[0].stop_ids  # what the server gives a session: the servable's end-of-turn ids
    try:
        for i, prompt in enumerate(copying_prompts(2)):
            ring.head.add(Session(f"c{i}", prompt, 24, sampling=GREEDY))
        ring.head.add(Session("g", COPY_TEXT[:40], 40, sampling=Sampling(temperature=0.0, grammar=grammar),
                              stop_ids=stops))
        out = ring.drain()
    finally:
        ring.close()
    assert ring.timings["g"]["spec_drafted"] == 0
    assert not [f for s, f in ring.sent if isinstance(f, Hidden) and f.kind == 3 and f.session == "g"]
    text = tok.decode([t for t in out["g"] if t not in stops])
    assert set(json.loads(text)) == {"n", "ok"}, (out["g"], text)
    assert sum(ring.timings[f"c{i}"]["spec_drafted"] for i in range(2)) > 0


def test_a_probe_brings_back_every_stages_kv_and_stage_0_admits_by_the_smallest(servables):
    """Each later stage adds the KV tokens it holds to the probe; stage 0 holds the ring to the smallest
    and lowers the requests in flight to what that leaves room for (at the share placement planned)."""
    from events.ring import Probe
    from events.stage import StageConfig, StageOptions
    from fellow.runtime.ring.servers import RingHeadServer

    ring = LocalRing(servables["three"], 3, stage_kv=[4096, 300])
    try:
        ring._sender(0)(Probe(nonce="n1"))
        back = ring.inboxes[0].take(10.0)
    finally:
        ring.close()
    assert [(type(f).__name__, f.nonce, f.kv) for f in back] == [("Probe", "n1", [4096, 300])]

    cfg = StageConfig(load_id="ld-kv", model_id="tiny3", model_dir=str(servables["three"]), nats_url="nats://x:1",
                      fellow_id="f0", stage=0, num_stages=3,
                      options=StageOptions(max_in_flight=8, kv_tokens=8 * 128, prefill_chunk=8))
    head = RingHeadServer(cfg)
    head.load()
    assert head.kv_tokens == 1024 and head.in_flight == 8
    head._fit_ring_kv(back[0].kv)
    assert head.engine.budget.kv_tokens == head.kv_tokens == 300
    assert head.in_flight == 2  # 300 tokens hold two of the planned 128-token shares
    head._fit_ring_kv([4096, 4096])  # a re-placed stage that holds more: stage 0's own again
    assert head.engine.budget.kv_tokens == 1024 and head.in_flight == 8


def test_stage0_sizes_its_in_flight_from_steps_and_links_then_lowers_it_to_the_kv_every_stage_holds(servables):
    """With ``in_flight_max`` every stage times its step at a group's rows at load, and stage 0 keeps as many
    groups as fill the pipe (fellow.runtime.ring.sizing), at the share of KV placement planned a session;
    the stage that holds least still has the last word, and a short pipe keeps one group a stage."""
    from events.stage import StageConfig, StageOptions
    from fellow.runtime.ring.servers import RingHeadServer
    from fellow.runtime.ring.sizing import size_ring

    assert size_ring([10.0, 10.0], 50.0, 4, 32).groups == 7  # 20 ms of steps and 50 ms of links, 10 ms a slot
    assert size_ring([10.0, 10.0], 100.0, 4, 32).in_flight == 32  # no more than the ceiling
    assert size_ring([5.0, 5.0], 1.0, 4, 32).groups == 2  # a LAN: one group a stage, as without sizing
    assert size_ring([2.0, 8.0, 2.0], 4.0, 4, 64).groups == 3  # the slowest stage sets the slot

    cfg = StageConfig(load_id="ld-size", model_id="tiny3", model_dir=str(servables["three"]), nats_url="nats://x:1",
                      fellow_id="f0", stage=0, num_stages=3,
                      options=StageOptions(max_in_flight=6, kv_tokens=6 * 128, prefill_chunk=8, in_flight_max=48))
    head = RingHeadServer(cfg)
    head.load()
    assert head.per_group == 2 and head.group_ms > 0  # its own step, timed at load
    assert head.kv_own == 48 * 128 and head.in_flight == 6  # room planned for the ceiling; the plan until sized
    sizing = size_ring([1.0, 1.0, 1.0], 4.0, head.per_group, 48)
    assert (sizing.groups, sizing.in_flight) == (7, 14)
    head._fit_ring_kv([6144, 6144], sizing)
    assert (head.in_flight, head.runner.units.groups, head.kv_tokens) == (14, 7, 14 * 128)
    assert head.engine.prefix_room == 6 * 128  # finished prefixes keep to the plan's KV, not the raised one
    assert head.stage.kernels.ring["in_flight"] == 14 and head.stage.kernels.ring["transit_ms"] == 4.0
    head._fit_ring_kv([6144, 1000], sizing)  # stage 2 holds 1,000 tokens: seven 128-token shares
    assert (head.in_flight, head.runner.units.groups, head.kv_tokens) == (7, 4, 1000)
    head._fit_ring_kv([6144, 6144], size_ring([1.0, 1.0, 1.0], 0.2, head.per_group, 48))  # a short pipe
    assert (head.in_flight, head.runner.units.groups, head.kv_tokens) == (6, 3, 6 * 128)

    from fellow.runtime.ring.servers import RingStageServer

    later = RingStageServer(msgspec.structs.replace(cfg, stage=2))
    later.load()  # a later stage: room for the ceiling, its step timed and told on every probe
    assert later.kv_tokens == 48 * 128 and later.worker.kv_tokens == 48 * 128
    assert later.worker.step_ms == later.group_ms > 0
    assert later.worker.prefix_tokens == 6 * 128  # ... and no more finished prefixes than the plan's KV


def test_a_full_ring_drafts_only_once_at_most_one_session_a_stage_is_in_it(copier):
    """By default stage 0 drafts only while the ring holds at most one session a stage; replies stay exact."""
    prompts, lengths = copying_prompts(4), [6, 10, 40, 40]
    expected = one_stage(copier, prompts, 40)
    ring = spec_ring(copier, 2, 4, full=False)
    send, in_ring = ring.head.runner.send, []

    def watch(frame):  # how many sessions the head held when it sent each VERIFY frame
        if isinstance(frame, Hidden) and frame.kind == 3:
            in_ring.append(len(ring.head.sessions))
        send(frame)

    ring.head.runner.send = watch
    try:
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            ring.head.add(Session(f"s{i}", prompt, n, sampling=GREEDY))
        got = ring.drain()
    finally:
        ring.close()
    assert got == {sid: expected[sid][:n] for sid, n in zip(sorted(expected), lengths)}
    assert in_ring and max(in_ring) <= 2  # drafted once the two short replies had ended, never before
