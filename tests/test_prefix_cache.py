"""The prefix cache: multi-turn chats and shared system prompts start from kept positions, replies stay
what they are without it, and kept blocks never keep a request out."""

import pytest
import torch
import transformers

from events.requests import Sampling
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.prefix_cache import BLOCK, PrefixCache
from fellow.runtime.engine.scheduler import Scheduler
from fellow.runtime.engine.session import Session
from fellow.runtime.model.kv_cache import KVCache
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel

VOCAB = 256
GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def stage() -> StageModel:
    config = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB)
    torch.manual_seed(0)
    stage = StageModel.from_causal_lm(transformers.AutoModelForCausalLM.from_config(config).eval())
    prepare_stage(stage)
    return stage


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Scheduler, *sessions: Session) -> dict[str, Session]:
    for session in sessions:
        engine.add(session)
    done = {}
    while engine.busy:
        done.update({s.session_id: s for s in engine.step().finished})
    return done


def chat(engine: Scheduler, turns: int, seed: int = 0, system: list[int] | None = None) -> list[Session]:
    """A chat whose every turn sends the whole conversation again, plus a new user message."""
    history, out = list(system or []), []
    for turn in range(turns):
        prompt = history + ids(9 + turn, seed * 100 + turn)
        session = run(engine, Session(f"c{seed}-{turn}", prompt, 12, GREEDY))[f"c{seed}-{turn}"]
        out.append(session)
        history = prompt + session.output_ids
    return out


def test_multi_turn_replies_equal_the_cache_off_and_reuse_exactly_the_last_turn(stage):
    on = chat(local_engine(stage, kv_tokens=4096), 5)
    off = chat(local_engine(stage, kv_tokens=4096, prefix_cache=False), 5)
    assert [s.output_ids for s in on] == [s.output_ids for s in off]
    assert on[0].cached_tokens == 0 and all(s.cached_tokens == 0 for s in off)
    for before, after in zip(on, on[1:]):
        # every position the last turn's cache held: its prompt and reply, less the last token never fed
        assert after.cached_tokens == len(before.prompt_ids) + len(before.output_ids) - 1
        assert after.timing()["cached_tokens"] == after.cached_tokens


def test_batched_sessions_with_and_without_a_prefix_equal_the_cache_off(stage):
    system = ids(40, 7)
    def batch(engine):
        run(engine, Session("warm", system + ids(5, 1), 4, GREEDY))
        sessions = [Session(f"s{i}", (system if i % 2 else []) + ids(6 + i, 10 + i), 10, GREEDY) for i in range(4)]
        done = run(engine, *sessions)
        return {k: (s.output_ids, s.cached_tokens) for k, s in done.items()}
    on, off = batch(local_engine(stage, kv_tokens=4096)), batch(local_engine(stage, kv_tokens=4096, prefix_cache=False))
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    # the system prompt's two whole blocks: its last 8 tokens share a block with the warm-up's own words
    assert [on[f"s{i}"][1] for i in range(4)] == [0, 2 * BLOCK, 0, 2 * BLOCK]


def test_one_system_prompt_is_held_once_for_many_users(stage):
    system = ids(3 * BLOCK, 3)  # three whole blocks
    engine = local_engine(stage, kv_tokens=4096)
    users = [chat(engine, 1, seed=s, system=system)[0] for s in (1, 2, 3)]
    assert [u.cached_tokens for u in users] == [0, len(system), len(system)]
    kept = engine.stats()
    own = sum(len(u.prompt_ids) + len(u.output_ids) - 1 - len(system) for u in users)
    assert kept["prefix_cached_tokens"] == len(system) + own  # the shared blocks once, each user's own after
    assert kept["prefix_hit_rate"] == pytest.approx(2 * len(system) / sum(len(u.prompt_ids) for u in users),
                                                    abs=1e-4)


def test_kept_blocks_never_keep_out_a_request_that_fits_without_them(stage):
    engine = local_engine(stage, kv_tokens=300)
    for seed in range(6):  # fill the cache with finished chats of ~80 positions each
        run(engine, Session(f"old{seed}", ids(70, seed), 10, GREEDY))
    assert engine.prefix.tokens > 0
    big = Session("big", ids(250, 99), 50, GREEDY)  # needs the whole budget
    done = run(engine, big)
    assert done["big"].finish_reason == "length" and len(done["big"].output_ids) == 50
    assert engine.budget.reserved == 0 and engine.prefix.tokens <= engine.kv_tokens
    alone = run(local_engine(stage, kv_tokens=300, prefix_cache=False), Session("big", ids(250, 99), 50, GREEDY))
    assert done["big"].output_ids == alone["big"].output_ids


def test_eviction_takes_leaves_first_and_a_mismatch_is_a_miss():
    cache = PrefixCache()
    assert cache.match([1, 2, 3]) == []
    kv = KVCache(0, 1, 1, 2, torch.float32, ["cpu"])
    tokens = list(range(40))
    kv.reserve(40)
    kv.keys[0][:, :, :40] = torch.arange(40.0)[None, None, :, None]
    kv.values[0][:, :, :40] = -torch.arange(40.0)[None, None, :, None]
    kv.advance(40)
    assert cache.insert(tokens, kv) == 40 and len(cache.blocks) == 3  # two whole blocks and a tail of 8
    reused, chain = cache.lookup(tokens + [99])
    assert reused == 40
    fresh = KVCache(0, 1, 1, 2, torch.float32, ["cpu"])
    PrefixCache.fill(fresh, chain, 35)
    assert fresh.length == 35 and torch.equal(fresh.keys[0][0, 0, :35, 0], torch.arange(35.0))
    assert cache.lookup(tokens[:20] + [7] * 30)[0] == BLOCK  # diverges inside the second block
    assert cache.evict(1) == 8 and cache.tokens == 32  # the tail goes first: the others have children
    assert cache.evict(100) == 32 and not cache.blocks
