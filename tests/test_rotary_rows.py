"""The rotary rows a compiled decode step reads (fellow.runtime.model.forms.rotary_rows): the same values, bit for bit,
as the model's rotary module gives each position alone, past the table's first size, for a batch of
positions, and for a rotary kind that depends on the longest position (not tabled)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import Qwen3Config

from fellow.runtime.model.forms.rotary_rows import TABLE_CHUNK, RotaryRows
from fellow.runtime.model.fused import rotary_tables


@pytest.mark.parametrize("scaling,tabled", [(None, True), ({"rope_type": "linear", "factor": 2.0}, True),
                                            ({"rope_type": "dynamic", "factor": 2.0}, False)])
def test_rows_equal_the_rotary_module_position_by_position(scaling, tabled):
    config = Qwen3Config(hidden_size=64, num_attention_heads=2, head_dim=32, num_hidden_layers=1,
                         intermediate_size=64, vocab_size=64, max_position_embeddings=512, rope_scaling=scaling)
    rotary = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    rows = RotaryRows(rotary, torch.float32)
    assert rows.tabled == tabled
    like = torch.empty(0)
    for positions in ([0], [1], [37], [TABLE_CHUNK - 1], [TABLE_CHUNK], [3 * TABLE_CHUNK + 5], [2, 900, 17]):
        want = rotary_tables(*rotary(like, torch.tensor([[p] for p in positions])))
        got = rows(positions)
        for a, b in zip(got, want):
            assert a.is_contiguous() and a.shape == (len(positions), 1, 1, 32)
            assert torch.equal(a, b), positions
    if tabled:
        assert rows.cos.shape[0] >= 3 * TABLE_CHUNK + 6
