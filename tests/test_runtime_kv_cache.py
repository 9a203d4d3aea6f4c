"""The KV cache grows in place by chunks and crops; the batched view pads, masks and appends per session."""

import pytest
import torch
import transformers

from fellow.runtime.model.kv_cache import GROW_CHUNK, BatchedView, KVCache
from fellow.runtime.model.load.kv_budget import CPU_CAP_TOKENS, bytes_per_token, kv_tokens_for, measured_kv_tokens
from fellow.runtime.model.stage import StageModel

HEADS, DIM = 2, 4


def cache(layers: int = 2, first: int = 5) -> KVCache:
    return KVCache(first, layers, HEADS, DIM, torch.float32, ["cpu"] * layers)


def positions(n: int, start: float = 0.0) -> torch.Tensor:
    values = torch.arange(float(start), float(start) + n).repeat_interleave(HEADS * DIM)
    return values.view(n, HEADS, DIM).permute(1, 0, 2)[None]


def append(kv: KVCache, n: int, start: float) -> None:
    kv.reserve(n)
    for layer in range(kv.first_layer, kv.first_layer + kv.num_layers):
        kv.write(layer, positions(n, start), -positions(n, start))
    kv.advance(n)


def test_grows_in_chunks_in_place_and_crops():
    kv = cache()
    buffers = set()
    for token in range(GROW_CHUNK + 1):
        append(kv, 1, token)
        buffers.add(kv.keys[0].data_ptr())
    assert kv.length == GROW_CHUNK + 1 and kv.capacity == 2 * GROW_CHUNK
    assert len(buffers) == 2  # one allocation per chunk, not one per token
    keys, values = kv.layer(1)
    assert torch.equal(keys, positions(GROW_CHUNK + 1)) and torch.equal(values, -keys)
    assert kv.bytes == 2 * 2 * HEADS * 2 * GROW_CHUNK * DIM * 4
    kv.crop_to(10)
    append(kv, 3, 100)
    assert kv.length == 13 and torch.equal(kv.layer(0)[0][:, :, 10:], positions(3, 100))
    assert torch.equal(kv.layer(0)[0][:, :, :10], positions(10))


def test_batched_view_pads_left_masks_and_appends_to_each_session():
    short, long = cache(1, 0), cache(1, 0)
    append(short, 2, 0)
    append(long, 5, 10)
    for kv in (short, long):
        kv.reserve(1)
    view = BatchedView([short, long])
    new_keys = torch.stack([positions(1, 50)[0], positions(1, 60)[0]])  # [2, H, 1, D]
    keys, values = view.update(new_keys, -new_keys, 0)
    assert keys.shape == (2, HEADS, 6, DIM)
    assert torch.equal(keys[0, :, :3], torch.zeros(HEADS, 3, DIM))  # left padding
    assert torch.equal(keys[0:1, :, 3:], torch.cat([positions(2), positions(1, 50)], dim=2))
    assert torch.equal(keys[1:2], torch.cat([positions(5, 10), positions(1, 60)], dim=2))
    mask = view.attention_mask(torch.float32, torch.device("cpu"))
    assert (mask[:, 0, 0] < 0).tolist() == [[True] * 3 + [False] * 3, [False] * 6]
    assert BatchedView([long, long]).attention_mask(torch.float32, torch.device("cpu")) is None
    assert short.length == 2 and short.layer(0, 3)[0].shape == (1, HEADS, 3, DIM)
    view.commit()
    for kv in (short, long):
        kv.advance(1)
    assert torch.equal(short.layer(0)[0], torch.cat([positions(2), positions(1, 50)], dim=2))
    assert torch.equal(long.layer(0)[1], -torch.cat([positions(5, 10), positions(1, 60)], dim=2))


def test_budget_arithmetic_and_cpu_measure():
    config = transformers.Qwen3Config(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
    stage = StageModel.from_causal_lm(transformers.AutoModelForCausalLM.from_config(config).eval(), 0, 2)
    per_token = bytes_per_token(stage, prefill_chunk=256)
    # keys and values of 2 layers (2 heads of 16 floats) plus 4 heads x 256 scores of float32
    assert per_token == {torch.device("cpu"): 2 * 2 * 2 * 16 * 4 + 4 * 256 * 4}
    assert kv_tokens_for(10_000, 100, usable=0.85, keep_bytes=500) == 80
    assert kv_tokens_for(100, 100, usable=0.85, keep_bytes=500) == 0
    assert 0 < measured_kv_tokens(stage, 256) <= CPU_CAP_TOKENS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_measure_leaves_room():
    config = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to("cuda")
    stage = StageModel.from_causal_lm(model)
    tokens = measured_kv_tokens(stage, 256)
    (device, token_bytes), = bytes_per_token(stage, 256).items()
    _free, total = torch.cuda.mem_get_info(device)
    assert device.type == "cuda" and tokens > 0
    assert tokens * token_bytes <= 0.85 * total


def test_random_caches_draw_their_positions_or_repeat_a_drawn_tile():
    from fellow.runtime.model.kv_cache import random_caches

    new = lambda: KVCache(0, 2, 2, 4, torch.float32, ["cpu", "cpu"])  # noqa: E731
    drawn = random_caches(new, 2, 10, 3)
    tiled = random_caches(new, 3, 10, 3, tile=4)
    for cache in drawn + tiled:
        assert cache.length == 10 and cache.capacity >= 13
    assert not torch.equal(drawn[0].keys[0][:, :, :4], drawn[0].keys[0][:, :, 4:8])  # every position drawn
    for cache in tiled:
        for buffer in (cache.keys[0], cache.values[0]):
            assert torch.equal(buffer[:, :, 4:8], buffer[:, :, :4])
            assert torch.equal(buffer[:, :, 8:10], buffer[:, :, :2])
            assert buffer[:, :, :4].std() > 0.5  # drawn from a normal
    assert not torch.equal(tiled[0].keys[0][:, :, :4], tiled[1].keys[0][:, :, :4])  # each cache its own tile
