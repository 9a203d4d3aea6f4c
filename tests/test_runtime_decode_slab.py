"""The decode slab (fellow.runtime.model.forms.decode_slab): a fused decode batch attends in one call per layer
over its sessions' caches side by side, and every session's greedy reply stays what it is alone, while
sessions join, leave, outgrow the slab, or have pasts too uneven to share one."""

import copy

import pytest
import torch
import transformers

from fellow.runtime.model.forms import decode_slab
from fellow.runtime.model.fused import Linear
from fellow.runtime.model.stage import StageModel
from tests.tiny import make_tiny_checkpoint

WINDOW = 8


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    out = {}
    # qwen2 with a window: full layers and sliding ones, grouped attention 2:1; llama: every layer full
    for family, window in (("qwen2", WINDOW), ("llama", None)):
        ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family, layers=4, hidden=64, window=window)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        stage = StageModel.from_causal_lm(copy.deepcopy(model))
        stage.fuse(lambda weight, bias: Linear(weight, bias, "mkl"))
        out[family] = stage
    return out


def alone(stage: StageModel, ids: list[int], new_tokens: int) -> list[int]:
    """The greedy reply of one session stepping by itself (one row: never the slab)."""
    cache = stage.new_cache()
    logits = stage.prefill(cache, torch.tensor(ids))
    out = [int(logits.argmax())]
    for _ in range(new_tokens - 1):
        out.append(int(stage.decode([cache], torch.tensor([out[-1]]))[0].argmax()))
    cache.release()
    return out


class Batch:
    """Sessions decoding together, one step at a time; a session joins after its prefill, leaves when done."""

    def __init__(self, stage: StageModel) -> None:
        self.stage, self.live, self.replies = stage, {}, {}

    def join(self, name: str, ids: list[int], new_tokens: int) -> None:
        cache = self.stage.new_cache()
        self.replies[name] = [int(self.stage.prefill(cache, torch.tensor(ids)).argmax())]
        self.live[name] = (cache, new_tokens)

    def step(self) -> None:
        names = list(self.live)
        caches = [self.live[n][0] for n in names]
        logits = self.stage.decode(caches, torch.tensor([self.replies[n][-1] for n in names]))
        for name, row in zip(names, logits):
            self.replies[name].append(int(row.argmax()))
            cache, wanted = self.live[name]
            if len(self.replies[name]) == wanted:
                cache.release()
                del self.live[name]


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefilled(stage: StageModel, prompts: list[list[int]]) -> list:
    """A cache per prompt, each with its prompt computed."""
    caches = [stage.new_cache() for _ in prompts]
    for cache, ids in zip(caches, prompts):
        stage.prefill(cache, torch.tensor(ids))
    return caches


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_sessions_that_join_leave_and_outgrow_the_slab_reply_as_alone(stages, family):
    stage = stages[family]
    slab, vocab = stage.fused.slab, stage.config.vocab_size
    # every one past the window; b and d decode together past the room of the slab d joins
    sessions = {"a": (prompt(1, 11, vocab), 20), "b": (prompt(2, 5, vocab), 2 * decode_slab.HEADROOM + 30),
                "c": (prompt(3, 14, vocab), 12), "d": (prompt(4, 3, vocab), 2 * decode_slab.HEADROOM)}
    with torch.inference_mode():
        want = {name: alone(stage, ids, n) for name, (ids, n) in sessions.items()}
        batch = Batch(stage)
        rebuilds = slab.rebuilds
        batch.join("a", *sessions["a"])
        batch.join("b", *sessions["b"])
        batch.step()
        assert slab.rebuilds == rebuilds + 1 and slab.keys is not None and len(slab.rows) == 2
        assert all(cache.home == (slab, row) for row, (cache, _) in enumerate(batch.live.values()))
        for _ in range(3):
            batch.step()
        assert slab.rebuilds == rebuilds + 1  # the same batch steps in place
        batch.join("c", *sessions["c"])  # joins: a new slab of three rows
        batch.step()
        assert slab.rebuilds == rebuilds + 2 and len(slab.rows) == 3
        while "c" in batch.live:
            batch.step()
        # c left: its row is freed, and the other two step on in the same slab (no copy)
        assert slab.rebuilds == rebuilds + 2 and slab.rows[2] is None and slab.keys is not None
        batch.step()
        assert slab.rebuilds == rebuilds + 2
        batch.join("d", *sessions["d"])
        while batch.live:
            batch.step()
    assert batch.replies == want
    # b outgrew a slab's room (it reserved buffers of its own) and the next step built a wider one
    assert slab.rebuilds >= rebuilds + 4
    assert slab.keys is None and slab.rows == []  # every session left: the stage holds no slab


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_sessions_in_several_batches_share_one_slab_in_blocks(stages, family):
    """More sessions than the batch cap: each step runs them in batches, one after another. The slab
    keeps them all, each batch a block of rows, instead of rebuilding for every batch of every step;
    a batch whose rows span two blocks steps over both; every reply stays what it is alone."""
    stage = stages[family]
    slab, vocab = stage.fused.slab, stage.config.vocab_size
    names = "abcdefg"
    sessions = {name: (prompt(20 + i, 3 + 2 * i, vocab), 24) for i, name in enumerate(names)}
    with torch.inference_mode():
        want = {name: alone(stage, ids, n) for name, (ids, n) in sessions.items()}
        batch = Batch(stage)
        for name in names:
            batch.join(name, *sessions[name])
        rebuilds = slab.rebuilds

        def step(*groups: str) -> None:
            every = dict(batch.live)
            for group in groups:  # each batch of the step decodes alone, as the engine runs them
                batch.live = {name: every[name] for name in group}
                batch.step()
                every.update(batch.live)
                for name in group:
                    if name not in batch.live:
                        del every[name]
            batch.live = every

        step("abcd", "efg")
        assert slab.rebuilds == rebuilds + 2 and len(slab.rows) == 7  # efg joined a, b, c and d in one slab
        homes = {name: cache.home[1] for name, (cache, _) in batch.live.items()}
        assert sorted(homes[n] for n in "efg") == [0, 1, 2] and sorted(homes[n] for n in "abcd") == [3, 4, 5, 6]
        for _ in range(5):
            step("abcd", "efg")
        assert slab.rebuilds == rebuilds + 2  # the two batches step in place, each over its block
        for _ in range(5):
            step("abc", "defg")  # d's batch spans both blocks: it steps over them, still no copy
        assert slab.rebuilds == rebuilds + 2
        while batch.live:
            step("abcd", "efg")
    assert batch.replies == want


def test_pasts_too_uneven_for_one_slab_attend_row_by_row(stages):
    stage = stages["llama"]
    slab, vocab = stage.fused.slab, stage.config.vocab_size
    long, short = prompt(5, 400, vocab), prompt(6, 4, vocab)
    with torch.inference_mode():
        want = {"long": alone(stage, long, 6), "short": alone(stage, short, 6)}
        batch = Batch(stage)
        rebuilds = slab.rebuilds
        batch.join("long", long, 6)
        batch.join("short", short, 6)
        batch.step()
        assert slab.rebuilds == rebuilds and slab.keys is None
        assert all(cache.home is None for cache, _ in batch.live.values())
        while batch.live:
            batch.step()
    assert batch.replies == want


def test_a_slab_row_is_a_cache_like_any_other(stages):
    """A session in the slab crops, grows and is read as its own cache; a session of the slab that is
    left out of a new batch keeps a row after the batch's, its past intact."""
    stage = stages["qwen2"]
    slab, vocab = stage.fused.slab, stage.config.vocab_size
    with torch.inference_mode():
        caches = prefilled(stage, [prompt(10 + seed, 6 + seed, vocab) for seed in range(3)])
        stage.decode(caches, torch.tensor([1, 2, 3]))
        assert [c.home for c in caches] == [(slab, 0), (slab, 1), (slab, 2)]
        past = [(c.layer(2)[0].clone(), c.layer(2)[1].clone(), c.length) for c in caches]
        stage.decode(caches[:1], torch.tensor([4]))  # one row alone: no slab step, it stays
        caches[0].crop_to(caches[0].length - 1)  # back to where it was
        stage.decode(caches[1:], torch.tensor([5, 6]))  # the first sits out: the others step in their rows
        assert [c.home for c in caches] == [(slab, 0), (slab, 1), (slab, 2)]
        newcomer = stage.new_cache()
        stage.prefill(newcomer, torch.tensor(prompt(20, 4, vocab)))
        caches.append(newcomer)
        stage.decode(caches[1:], torch.tensor([5, 6, 7]))  # a new batch without the first: a new slab
        assert [c.home for c in caches[1:]] == [(slab, 0), (slab, 1), (slab, 2)] and caches[0].home == (slab, 3)
        keys, values = caches[0].layer(2)
        assert caches[0].length == past[0][2] and torch.equal(keys, past[0][0]) and torch.equal(values, past[0][1])
        for cache, (keys, values, length) in zip(caches[1:], past[1:]):
            assert torch.equal(cache.layer(2, length)[0], keys) and torch.equal(cache.layer(2, length)[1], values)
        for cache in caches:
            cache.release()
    assert slab.keys is None


def test_a_left_out_session_that_would_make_the_slab_too_big_gets_its_own_buffers(stages):
    """Two long sessions step in the slab, then two short new ones without them: a slab holding all
    four would be mostly padding (MEMORY_SLACK), so the long ones get buffers of their own back, their
    pasts intact, and the short ones a slab of two rows."""
    stage = stages["llama"]
    slab, vocab = stage.fused.slab, stage.config.vocab_size
    with torch.inference_mode():
        long = prefilled(stage, [prompt(30 + seed, 300 + seed, vocab) for seed in range(2)])
        stage.decode(long, torch.tensor([1, 2]))
        assert [c.home for c in long] == [(slab, 0), (slab, 1)]
        past = [(c.layer(1)[0].clone(), c.layer(1)[1].clone(), c.length) for c in long]
        short = prefilled(stage, [prompt(40 + seed, 5, vocab) for seed in range(2)])
        stage.decode(short, torch.tensor([3, 4]))
        assert [c.home for c in short] == [(slab, 0), (slab, 1)] and len(slab.rows) == 2
        assert all(c.home is None for c in long)
        for cache, (keys, values, length) in zip(long, past):
            assert cache.length == length
            assert torch.equal(cache.layer(1)[0], keys) and torch.equal(cache.layer(1)[1], values)
        for cache in long + short:
            cache.release()
    assert slab.keys is None


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_verify_passes_over_the_slab_equal_each_session_on_its_own_cache(stages, family):
    """A verify pass (a session's last token and its drafts, sessions of uneven widths in one pass)
    attends over the slab in one call per layer: its logits at every position, and the caches it leaves
    after each crop, are those of each session run on buffers of its own (no slab)."""
    stage = stages[family]
    slab, vocab = stage.fused.slab, stage.config.vocab_size
    draws = torch.Generator().manual_seed(7)
    passes = [[3, 1, 2], [1, 1, 1], [5, 2, 1], [1, 4, 3], [2, 2, 2]]
    inputs = [[torch.randint(0, vocab, (w,), generator=draws).tolist() for w in widths] for widths in passes]

    def run(use_slab: bool):
        stage.fused.slab = slab if use_slab else None
        caches = [stage.new_cache() for _ in range(3)]
        for seed, (cache, length) in enumerate(zip(caches, (11, 5, 14))):  # past the window of 8, and not
            stage.prefill(cache, torch.tensor(prompt(30 + seed, length, vocab)))
        logits, homes = [], []
        for widths, ids in zip(passes, inputs):
            lengths = [c.length for c in caches]
            logits.append(stage.verify(caches, ids))
            homes.append([c.home for c in caches])
            for cache, length, width in zip(caches, lengths, widths):
                cache.crop_to(length + (width + 1) // 2)  # some drafts stood, the rest fell
        logits.append(list(stage.decode(caches, torch.tensor([1, 2, 3]))))  # a decode step reads what stood
        pasts = [(c.layer(3)[0].clone(), c.length) for c in caches]
        for cache in caches:
            cache.release()
        stage.fused.slab = slab
        return logits, homes, pasts

    with torch.inference_mode():
        rebuilds = slab.rebuilds
        got, homes, pasts = run(True)
        assert slab.rebuilds == rebuilds + 1  # one slab, built by the first pass, served every pass
        assert all(home == [(slab, 0), (slab, 1), (slab, 2)] for home in homes)
        want, plain_homes, plain_pasts = run(False)
        assert all(home == [None, None, None] for home in plain_homes)
    for got_pass, want_pass in zip(got, want):
        for g, w in zip(got_pass, want_pass):
            assert g.shape == w.shape and torch.allclose(g, w, atol=1e-5, rtol=1e-4)
    for (keys, length), (plain_keys, plain_length) in zip(pasts, plain_pasts):
        assert length == plain_length and torch.allclose(keys, plain_keys, atol=1e-5)
    assert slab.keys is None
