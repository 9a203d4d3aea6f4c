"""A tiny random-initialized HF checkpoint with a chat tokenizer, for tests across the project."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

FAMILIES = ("qwen3", "qwen2", "llama", "mistral")
TINY_VOCAB = 384  # 256 bytes + specials + a few merges: enough for words to be a few tokens


@lru_cache(maxsize=1)
def _tokenizer():
    from fellow.runtime.tools.calibration import default_texts
    from fellow.runtime.tools.chat_tokenizer import train_chat_tokenizer

    return train_chat_tokenizer(default_texts()[:8], TINY_VOCAB)


def _config(family: str, layers: int, hidden: int, vocab: int, tie: bool):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    heads = max(2, hidden // 16)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  max_position_embeddings=2048, tie_word_embeddings=tie)
    if family == "qwen3":
        return Qwen3Config(head_dim=hidden // heads, **common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(sliding_window=None, **common)
    raise ValueError(f"family {family!r} is not one of {', '.join(FAMILIES)}")


def make_tiny_checkpoint(dir: str | Path, family: str = "qwen3", layers: int = 4, hidden: int = 64,
                         seed: int = 0, *, tie_embeddings: bool | None = None) -> Path:
    """Write a random ``family`` causal LM and its chat tokenizer to ``dir``; returns ``dir``.

    Same seed and shape, same weights. Ties embeddings like the family's small models do
    (Qwen3 yes, the others no) unless ``tie_embeddings`` says otherwise. Takes well under 2 s.
    """
    from transformers import AutoModelForCausalLM

    from fellow.runtime.tools.chat_tokenizer import generation_config_values

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tie = family == "qwen3" if tie_embeddings is None else tie_embeddings
    config = _config(family, layers, hidden, len(tokenizer), tie)
    gen = generation_config_values(tokenizer)
    config.eos_token_id, config.pad_token_id = gen["eos_token_id"][0], gen["pad_token_id"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out
