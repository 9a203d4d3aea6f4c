"""Device plans are data: a stage's layers over inventories of cards that are not here (two 6 GB cards,
a 24 GB and an 8 GB, a GTX 1060), sized from a Qwen3-14B-shaped config, 4-bit or not."""

from __future__ import annotations

import pytest
import torch

from core.quantization import NF4, NONE
from fellow.runtime.model.load.device_split import Card, by_free_memory, plan_devices
from fellow.runtime.model.load.weights import config_sizes

GIB, MIB, G = 1 << 30, 1 << 20, 10**9
TWO_6GB = [Card("cuda:0", 6 * GIB - 300 * MIB, (7, 5), "GTX 1660 SUPER"),
           Card("cuda:1", 6 * GIB - 200 * MIB, (7, 5), "GTX 1660 SUPER"), Card("cpu", 32 * GIB)]
BIG_SMALL = [Card("cuda:0", 8 * GIB, (8, 6), "RTX 3070"), Card("cuda:1", 24 * GIB, (8, 9), "RTX 4090"),
             Card("cpu", 32 * GIB)]
GTX_1060 = [Card("cuda:0", 6 * GIB - 300 * MIB, (6, 1), "GTX 1060 6GB"), Card("cpu", 32 * GIB)]


@pytest.fixture(scope="module")
def qwen3_14b():
    """Qwen3-14B's shape (40 layers, hidden 5120, 151,936 tokens), on the meta device: no weights."""
    import transformers

    return transformers.Qwen3Config(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                                    num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                                    vocab_size=151936, tie_word_embeddings=False)


def plan(config, inventory, quantization=NF4, kv_tokens=4096):
    sizes = config_sizes(config, (0, config.num_hidden_layers), torch.float16, quantization, first=True, last=True)
    return plan_devices(by_free_memory(inventory), sizes.layer_bytes, embed_bytes=sizes.embed_bytes,
                        head_bytes=sizes.head_bytes, kv_token_bytes=sizes.kv_token_bytes, kv_tokens=kv_tokens)


def shares(split, inventory) -> dict[str, float]:
    usable = {c.name: c.usable_bytes for c in inventory}
    return {p.device: p.bytes / usable[p.device] for p in split.parts}


def test_qwen3_14b_in_4_bits_over_two_6gb_cards_is_balanced(qwen3_14b):
    split = plan(qwen3_14b, TWO_6GB)
    # the card with more free memory first, each card about the same share, nothing on the CPU
    assert split.devices == ["cuda:1", "cuda:0"]
    assert [p.layers for p in split.parts] == [(0, 20), (20, 40)]
    assert split.embed_device == "cuda:1" and split.head_device == "cuda:0"
    assert sum(p.weight_bytes for p in split.parts) < 9 * G  # 4-bit: about 8.9 GB, in float16 26 GB
    share = shares(split, TWO_6GB)
    assert max(share.values()) <= 1 and max(share.values()) - min(share.values()) < 0.06


def test_the_same_model_in_float16_does_not_fit_two_6gb_cards_and_offloads(qwen3_14b):
    split = plan(qwen3_14b, TWO_6GB, NONE)
    assert split.devices == ["cuda:1", "cuda:0", "cpu"]  # each card filled, the rest on the CPU
    assert split.head_device == "cpu" and all(v <= 1 for v in shares(split, TWO_6GB).values())
    assert shares(split, TWO_6GB)["cuda:1"] > 0.95


def test_a_24gb_and_an_8gb_card_take_the_same_share_not_the_same_bytes(qwen3_14b):
    split = plan(qwen3_14b, BIG_SMALL)
    assert split.devices == ["cuda:1", "cuda:0"]  # the 24 GB card first
    first, second = split.parts
    assert first.layers[1] - first.layers[0] > 3 * (second.layers[1] - second.layers[0])
    share = shares(split, BIG_SMALL)
    assert abs(share["cuda:1"] - share["cuda:0"]) < 0.06 and max(share.values()) < 0.5


def test_a_gtx_1060_holds_what_it_can_and_the_cpu_the_rest(qwen3_14b):
    split = plan(qwen3_14b, GTX_1060)
    assert split.devices == ["cuda:0", "cpu"] and split.embed_device == "cuda:0" and split.head_device == "cpu"
    assert shares(split, GTX_1060)["cuda:0"] > 0.9


def test_a_model_that_fits_one_card_is_still_spread_over_both(qwen3_14b):
    """Balanced like training's blocks: with each card half full, each card keeps room for more KV."""
    small = [Card("cuda:0", 24 * GIB, (8, 9)), Card("cuda:1", 24 * GIB, (8, 9))]
    split = plan(qwen3_14b, small)
    assert [p.layers for p in split.parts] == [(0, 20), (20, 40)]


def test_inventory_order_the_most_free_card_first_the_cpu_last():
    inventory = [Card("cpu", 64 * G), Card("cuda:0", 4 * G), Card("cuda:1", 8 * G), Card("cuda:2", 8 * G)]
    assert [c.name for c in by_free_memory(inventory)] == ["cuda:1", "cuda:2", "cuda:0", "cpu"]


def test_usable_bytes_keep_the_margins():
    assert Card("cuda:0", 6 * G).usable_bytes == int(0.85 * 6 * G) - 300 * MIB
    assert Card("cpu", 10 * G).usable_bytes == 8 * G
    assert Card("cpu", 10 * G, take=3).usable_bytes == 3
    assert Card("cuda:0", 100 * MIB).usable_bytes == 0


def test_cards_too_small_for_a_layer_leave_it_to_the_cpu():
    split = plan_devices([Card("cuda:0", 100 * MIB), Card("cpu", 16 * G)], [G] * 3)
    assert split.devices == ["cpu"]


def test_a_card_older_than_ampere_computes_in_float16_not_emulated_bfloat16():
    from fellow.runtime.model.load.device_split import half_dtype

    assert [half_dtype(c.capability) for c in (*TWO_6GB[:2], *BIG_SMALL[:2], GTX_1060[0])] == [
        "float16", "float16", "bfloat16", "bfloat16", "float16"]
    assert half_dtype(None) == "float16"
