"""A tiny random-initialized HF checkpoint with a chat tokenizer, for tests across the project."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

FAMILIES = ("qwen3", "qwen2", "llama", "mistral")  # the dense families every fused path serves
MOE_FAMILIES = ("qwen3_moe",)  # served by the HF layers
HYBRID_FAMILIES = ("qwen3_next",)  # linear-attention layers too: the HF layers, one session at a time
TINY_VOCAB = 384  # 256 bytes + specials + a few merges: enough for words to be a few tokens


def _template_variants():
    """Qwen3's template (the tiny tokenizer's) made DeepSeek-R1 style (the generation prompt opens a
    ``<think>`` block) and made plain (no thinking at all)."""
    from fellow.runtime.tools.chat_tokenizer import CHAT_TEMPLATE

    off = ("{%- if enable_thinking is defined and enable_thinking is false %}"  # a closed, empty block
           "{{- '<think>\\n\\n</think>\\n\\n' }}")
    qwen_end = off + "{%- endif %}"
    assert qwen_end in CHAT_TEMPLATE
    return (CHAT_TEMPLATE.replace(qwen_end, off + "{%- else %}{{- '<think>\\n' }}{%- endif %}"),
            CHAT_TEMPLATE.replace(qwen_end, ""))


R1_TEMPLATE, PLAIN_TEMPLATE = _template_variants()


@lru_cache(maxsize=1)
def _tokenizer():
    from fellow.runtime.tools.calibration import default_texts
    from fellow.runtime.tools.chat_tokenizer import train_chat_tokenizer

    return train_chat_tokenizer(default_texts()[:8], TINY_VOCAB)


def _config(family: str, layers: int, hidden: int, vocab: int, tie: bool, window: int | None):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig

    heads = max(2, hidden // 16)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  max_position_embeddings=2048, tie_word_embeddings=tie)
    if window is not None and family not in ("qwen2", "mistral"):
        raise ValueError(f"a sliding window is made for qwen2 and mistral, not {family}")
    if family == "qwen3":
        return Qwen3Config(head_dim=hidden // heads, **common)
    if family == "qwen2":  # with a window: the first half of the layers full, the rest sliding (max_window_layers)
        return Qwen2Config(use_sliding_window=window is not None, sliding_window=window,
                           max_window_layers=layers // 2, **common)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":  # with a window: every layer slides
        return MistralConfig(sliding_window=window, **common)
    if family == "qwen3_moe":  # four experts of half the dense width, two per token
        return Qwen3MoeConfig(head_dim=hidden // heads, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=hidden, **common)
    if family == "qwen3_next":  # linear attention (Gated DeltaNet) and full attention in turn; MoE MLPs
        return Qwen3NextConfig(head_dim=hidden // heads, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
                               shared_expert_intermediate_size=hidden,
                               layer_types=[("full_attention" if i % 2 else "linear_attention")
                                            for i in range(layers)], **common)
    raise ValueError(f"family {family!r} is not one of {', '.join(FAMILIES + MOE_FAMILIES + HYBRID_FAMILIES)}")


def make_tiny_checkpoint(dir: str | Path, family: str = "qwen3", layers: int = 4, hidden: int = 64,
                         seed: int = 0, *, tie_embeddings: bool | None = None, window: int | None = None,
                         shape: dict | None = None) -> Path:
    """Write a random ``family`` causal LM and its chat tokenizer to ``dir``; returns ``dir``.

    Same seed and shape, same weights. Ties embeddings like the family's small models do
    (Qwen3 yes, the others no) unless ``tie_embeddings`` says otherwise. ``window``: a sliding window of
    that many positions (qwen2, mistral). ``shape``: config values set over the tiny ones (heads, widths).
    Takes well under 2 s at the tiny shapes.
    """
    from transformers import AutoModelForCausalLM

    from fellow.runtime.tools.chat_tokenizer import generation_config_values

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tie = family == "qwen3" if tie_embeddings is None else tie_embeddings
    config = _config(family, layers, hidden, len(tokenizer), tie, window)
    for key, value in (shape or {}).items():
        setattr(config, key, value)
    gen = generation_config_values(tokenizer)
    config.eos_token_id, config.pad_token_id = gen["eos_token_id"][0], gen["pad_token_id"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def small_qwen3(vocab: int = 512):
    """A random 3-layer Qwen3 of hidden 64 with grouped attention 2:1, built from its config (the engine tests')."""
    import torch
    import transformers

    config = transformers.Qwen3Config(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()
