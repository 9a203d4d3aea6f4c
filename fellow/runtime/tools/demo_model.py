"""`swarm demo-model`: train a small Qwen3-architecture chat model on CPU and export it as a servable."""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path
from typing import Callable

import torch

from core.servable import Manifest
from fellow.runtime.tools.calibration import default_texts
from fellow.runtime.tools.chat_tokenizer import chat_turn, generation_config_values, train_chat_tokenizer

MODEL_ID = "swarm-demo"
DEFAULT_STEPS = 260  # about two minutes on two CPU cores
DRAFT_ID = "swarm-demo-draft"
DRAFT_SHAPE = {"hidden": 96, "layers": 2}  # the demo model's draft: 1/4 of its KV a position
_QUESTIONS = ("What is {}?", "Tell me about {}.", "Explain {} in Python.", "How does {} work?")

Progress = Callable[[int, int, float], None]  # (step, steps, loss)


def _topic_chunks(chunk_chars: int) -> list[tuple[str, str]]:
    """(topic name, answer text) pairs: each help topic cut at paragraph ends into short answers."""
    from pydoc_data.topics import topics

    pairs = []
    for name in sorted(topics):
        chunk = ""
        for para in re.split(r"\n\s*\n", topics[name]):
            para = " ".join(para.split())
            if chunk and len(chunk) + len(para) > chunk_chars:
                pairs.append((name.replace("-", " "), chunk))
                chunk = ""
            chunk = f"{chunk}\n\n{para}" if chunk else para
        if chunk:
            pairs.append((name.replace("-", " "), chunk))
    return pairs


def demo_examples(chunk_chars: int = 600) -> list[str]:
    """The training conversations: a user asks about a topic, the assistant answers with its text."""
    return [chat_turn(_QUESTIONS[i % len(_QUESTIONS)].format(name), answer)
            for i, (name, answer) in enumerate(_topic_chunks(chunk_chars))]


def _config(vocab: int, hidden: int, layers: int, intermediate: int | None = None):
    from transformers import Qwen3Config

    heads = hidden // 32
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=intermediate or hidden * 8 // 3 // 32 * 32,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 3),
                       head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True)


def _batches(rows: list[list[int]], pad: int, batch: int, seed: int):
    """Endless shuffled batches of padded rows, labels -100 on padding; seeded, so repeatable."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        picked = [rows[i] for i in torch.randperm(len(rows), generator=gen)[:batch].tolist()]
        ids = torch.full((batch, max(len(r) for r in picked)), pad)
        for i, r in enumerate(picked):
            ids[i, : len(r)] = torch.tensor(r)
        yield ids, ids.masked_fill(ids == pad, -100)


def train_demo(seed: int = 0, steps: int = DEFAULT_STEPS, progress: Progress | None = None, *,
               vocab: int = 3072, hidden: int = 192, layers: int = 4, seq_len: int = 192, batch: int = 16,
               lr: float = 3e-3, threads: int = 2, intermediate: int | None = None):
    """Train and return (model, tokenizer). Same seed, steps and threads: identical weights.
    ``intermediate``: the MLP's width (default 8/3 of ``hidden``, down to a multiple of 32)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)  # the CPU kernels split work by thread count; fix it for repeatability
    examples = demo_examples()
    tokenizer = train_chat_tokenizer(default_texts() + examples[:64], vocab)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = [ids if len(ids) <= seq_len else ids[: seq_len - 1] + [end]
            for ids in tokenizer(examples, add_special_tokens=False)["input_ids"]]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(len(tokenizer), hidden, layers, intermediate), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))))
    model.train()
    batches = _batches(rows, tokenizer.pad_token_id, batch, seed)
    for step in range(1, steps + 1):
        ids, labels = next(batches)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if progress is not None:
            progress(step, steps, float(loss.detach()))
    return model.eval(), tokenizer


def make_demo_model(out_dir: str | Path, seed: int = 0, steps: int = DEFAULT_STEPS,
                    progress: Progress | None = None, *, checkpoint_dir: str | Path | None = None,
                    **train_options) -> Manifest:
    """Train the demo model and export it to ``out_dir`` as servable "swarm-demo" over 2 stages.

    The HF checkpoint goes to ``checkpoint_dir`` when given, else to a temporary folder.
    """
    model, tokenizer = train_demo(seed, steps, progress, **train_options)
    return _export(model, tokenizer, out_dir, 2, MODEL_ID, checkpoint_dir)


def make_demo_draft(out_dir: str | Path, seed: int = 0, steps: int = DEFAULT_STEPS,
                    progress: Progress | None = None, **train_options) -> Manifest:
    """Train a small draft model for the demo model (SWARM_SERVE_DRAFT_MODEL) on the same text, and
    export it to ``out_dir`` as servable "swarm-demo-draft" in one stage. The tokenizer is trained
    from the same texts at the same size, so it is the demo model's (a fellow checks that at load)."""
    model, tokenizer = train_demo(seed, steps, progress, **{**DRAFT_SHAPE, **train_options})
    return _export(model, tokenizer, out_dir, 1, DRAFT_ID, None)


def _export(model, tokenizer, out_dir: str | Path, stages: int, model_id: str,
            checkpoint_dir: str | Path | None) -> Manifest:
    from fellow.runtime.tools.export import export

    with tempfile.TemporaryDirectory(prefix="swarm-demo-") as tmp:
        ckpt = Path(checkpoint_dir) if checkpoint_dir else Path(tmp)
        ckpt.mkdir(parents=True, exist_ok=True)
        model.config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        model.config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(str(ckpt))
        tokenizer.save_pretrained(str(ckpt))
        (ckpt / "generation_config.json").write_text(json.dumps(generation_config_values(tokenizer), indent=2))
        return export(ckpt, out_dir, stages=stages, model_id=model_id)
