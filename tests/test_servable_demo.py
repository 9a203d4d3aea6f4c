"""The demo model: a few training steps, exported as swarm-demo, and the same seed gives the same bytes."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from core.servable import load_manifest
from fellow.runtime.model.load.weights import build_stage_modules
from fellow.runtime.tools.demo_model import demo_examples, make_demo_model

ROOT = Path(__file__).resolve().parents[1]
# A shrunken shape so the test trains in seconds; the real demo uses the defaults.
SMALL = dict(vocab=512, hidden=64, layers=2, seq_len=64, batch=8)


def shard_bytes(servable):
    return [(servable / "shards" / f"stage-{i}" / "weights.safetensors").read_bytes() for i in range(2)]


def test_same_seed_same_model_and_it_learns(tmp_path):
    losses = []
    first = make_demo_model(tmp_path / "a", seed=3, steps=12,
                            progress=lambda s, n, loss: losses.append((s, n, loss)), **SMALL)
    # The second run is another process: hash seeds and thread pools start afresh there.
    code = (f"from fellow.runtime.tools.demo_model import make_demo_model; "
            f"make_demo_model({str(tmp_path / 'b')!r}, seed=3, steps=12, **{SMALL!r})")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    make_demo_model(tmp_path / "c", seed=4, steps=12, **SMALL)
    assert first.model_id == "swarm-demo" and first.num_stages == 2 and first.boundaries == [[0, 1], [1, 2]]
    assert [s for s, _, _ in losses] == list(range(1, 13)) and all(n == 12 for _, n, _ in losses)
    assert all(math.isfinite(loss) for _, _, loss in losses)
    assert sum(x for *_, x in losses[-3:]) < sum(x for *_, x in losses[:3])
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    tokenizers = [(tmp_path / run / "tokenizer" / "tokenizer.json").read_bytes() for run in "ab"]
    assert tokenizers[0] == tokenizers[1]
    assert shard_bytes(tmp_path / "a") != shard_bytes(tmp_path / "c")


def test_demo_servable_chats_in_chatml_with_think(tmp_path):
    manifest = make_demo_model(tmp_path / "sv", seed=0, steps=2, **SMALL)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "sv" / "tokenizer"))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is assert?"}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in manifest.generation.eos_token_ids
    # The prompt tokenizes as the same text did in training, so the model continues where it learned to.
    example = demo_examples()[0]
    assert example.startswith(prompt)  # the first training conversation asks just this
    trained = tokenizer(example, add_special_tokens=False)["input_ids"]
    asked = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert trained[: len(asked)] == asked
    ids = torch.tensor([asked])
    x = ids
    for stage in range(2):
        x = build_stage_modules(load_manifest(tmp_path / "sv"), stage, tmp_path / "sv").forward(x)
    assert x.shape == (1, ids.shape[1], len(tokenizer))


def test_the_demo_draft_shares_the_demo_models_tokenizer_and_drafts_for_it(tmp_path):
    """`swarm demo-model --draft`: a smaller model trained on the same text, with the same tokenizer,
    exported in one stage; it loads as the demo model's draft model, and greedy replies stay the same."""
    from events.requests import Sampling
    from fellow.runtime.engine.draft_model import load_draft_model
    from fellow.runtime.engine.engine import local_engine
    from fellow.runtime.engine.session import Session
    from fellow.runtime.model.load.loader import load_one_stage
    from fellow.runtime.tools.demo_model import DRAFT_SHAPE, make_demo_draft

    make_demo_model(tmp_path / "demo", seed=0, steps=2, **SMALL)
    small = {k: v for k, v in SMALL.items() if k not in DRAFT_SHAPE}
    manifest = make_demo_draft(tmp_path / "draft", seed=0, steps=2, **small)
    assert manifest.model_id == "swarm-demo-draft" and manifest.num_stages == 1
    target = load_one_stage(tmp_path / "demo", "cpu")
    draft = load_draft_model(tmp_path / "draft", target.stage, target.tokenizer, target.device)
    assert len(draft.stage.layers) == DRAFT_SHAPE["layers"] and draft.stage.config.hidden_size == DRAFT_SHAPE["hidden"]

    def replies(**spec):
        engine = local_engine(target.stage, kv_tokens=4096, **spec)
        sessions = [Session(f"s{i}", target.tokenizer(demo_examples()[i], add_special_tokens=False)["input_ids"][:24],
                            10, Sampling(temperature=0.0)) for i in range(2)]
        for session in sessions:
            engine.add(session)
        while engine.busy:
            engine.step()
        return [s.output_ids for s in sessions], sessions

    off, _ = replies()
    on, sessions = replies(speculative=2, draft=draft)
    assert on == off and sum(s.spec_model_drafted for s in sessions) > 0


def test_demo_model_command_trains_the_draft(tmp_path):
    swarm = str(Path(sys.executable).parent / "swarm")
    out = subprocess.run([swarm, "demo-model", "--draft", str(tmp_path / "draft"), "--steps", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "training the demo draft model" in out.stderr and "swarm-demo-draft written" in out.stdout
    assert load_manifest(tmp_path / "draft").num_stages == 1
