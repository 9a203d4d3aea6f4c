"""Families beyond the dense full-attention ones: sliding-window attention (Mistral's ``sliding_window``,
Qwen2's ``use_sliding_window``) and Qwen3-MoE. Tiny random models built from configs; every reply is
compared with Hugging Face ``generate``'s greedy one, token for token, on stages, batched engines and
rings, with prompts and replies that run well past the window."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from core.servable import ServableError
from events.ring import Token
from fellow.runtime.model.fused import Linear, fusable, layer_windows
from fellow.runtime.model.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel
from fellow.runtime.tools.export import export
from tests.test_ring_runtime import LocalRing, one_stage
from tests.tiny import make_tiny_checkpoint

WINDOW = 8
NEW_TOKENS = 20
# a prompt inside the window, one just past it, one of three windows; with the reply all run past it
PROMPTS = [list(range(40, 45)), list(range(60, 71)), [(7 * i) % 300 + 3 for i in range(24)]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("families")
    return {
        "mistral-window": make_tiny_checkpoint(root / "mistral-window", "mistral", layers=3, window=WINDOW),
        "qwen2-window": make_tiny_checkpoint(root / "qwen2-window", "qwen2", layers=4, window=WINDOW, seed=1),
        "qwen3-moe": make_tiny_checkpoint(root / "qwen3-moe", "qwen3_moe", layers=4, seed=2),
    }


def hf_model(hf_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


def generate(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.inference_mode():
        inputs = torch.tensor([prompt])
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def staged(model, path: str) -> StageModel:
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    if path == "fused":
        stage.fuse(lambda weight, bias: Linear(weight, bias, "mkl"))
    return stage


def greedy_alone(stage: StageModel, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    cache = stage.new_cache()
    logits = stage.prefill(cache, torch.tensor(prompt), prefill_chunk=5)  # pieces over a past longer than the window
    out = []
    for _ in range(new_tokens):
        out.append(int(logits.argmax()))
        logits = stage.decode([cache], torch.tensor([out[-1]]))[0]
    return out


def greedy_batched(stage: StageModel, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Fresh prompts left-padded into one forward, then every decode step for all sessions at once."""
    caches = [stage.new_cache() for _ in prompts]
    outs = [[int(t)] for t in stage.prefill_fresh(caches, prompts).argmax(-1)]
    for _ in range(new_tokens - 1):
        logits = stage.decode(caches, torch.tensor([out[-1] for out in outs]))
        for out, token in zip(outs, logits.argmax(-1).tolist()):
            out.append(token)
    return outs


def test_the_windows_are_read_from_each_familys_config(checkpoints):
    mistral = hf_model(checkpoints["mistral-window"]).config
    qwen2 = hf_model(checkpoints["qwen2-window"]).config
    assert layer_windows(mistral) == {0: WINDOW, 1: WINDOW, 2: WINDOW}  # no layer_types: every layer slides
    assert layer_windows(qwen2) == {0: None, 1: None, 2: WINDOW, 3: WINDOW}  # from max_window_layers on
    stage = StageModel.from_causal_lm(hf_model(checkpoints["qwen2-window"]))
    assert prepare_stage(stage, batch_cap=3)["path"] == "fused" and stage.layer_windows == [None, None, 8, 8]
    linear = transformers.Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
    with pytest.raises(ValueError, match="linear_attention"):
        layer_windows(linear)


def test_hybrid_linear_attention_is_refused_at_export(tmp_path):
    hybrid = transformers.Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
    hybrid.save_pretrained(str(tmp_path / "hybrid"))
    with pytest.raises(ServableError, match="linear_attention"):
        export(tmp_path / "hybrid", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", ["hf", "fused"])
@pytest.mark.parametrize("family", ["mistral-window", "qwen2-window"])
def test_a_sliding_window_stage_replies_as_generate_past_the_window(checkpoints, family, path):
    model = hf_model(checkpoints[family])
    stage = staged(model, path)
    assert WINDOW in stage.windows and (stage.fused is not None) == (path == "fused")
    want = [generate(model, prompt) for prompt in PROMPTS]
    assert [greedy_alone(stage, prompt) for prompt in PROMPTS] == want
    assert greedy_batched(stage, PROMPTS) == want
    # the window matters here: the same weights attending to every position reply otherwise
    config = copy.deepcopy(model.config)
    config.sliding_window, config.layer_types = None, ["full_attention"] * config.num_hidden_layers
    unwindowed = type(model)(config).eval()
    unwindowed.load_state_dict(model.state_dict())
    assert [generate(unwindowed, prompt) for prompt in PROMPTS] != want


@pytest.mark.parametrize("path", ["hf", "fused"])
def test_a_verify_pass_keeps_each_sessions_window(checkpoints, path):
    """Drafts that are generate's own continuation all stand: each position's logits pick the next one."""
    model = hf_model(checkpoints["qwen2-window"])
    stage = staged(model, path)
    replies = [generate(model, prompt) for prompt in PROMPTS]
    caches = [stage.new_cache() for _ in PROMPTS]
    for cache, prompt in zip(caches, PROMPTS):
        stage.prefill(cache, torch.tensor(prompt))
    # session 1 runs one position (its last prompt token), the others that and six drafted after it
    widths = [7, 1, 7]
    inputs = [[prompt[-1]] + reply[: width - 1] for prompt, reply, width in zip(PROMPTS, replies, widths)]
    # the verify pass writes the last prompt token again: the caches hold the prompt less that one
    for cache in caches:
        cache.crop_to(cache.length - 1)
    logits = stage.verify(caches, inputs)
    assert [rows.argmax(-1).tolist() for rows in logits] == [reply[:width] for reply, width in zip(replies, widths)]


@pytest.fixture(scope="module")
def servables(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("servables")
    out = {}
    for name, hf in checkpoints.items():
        out[name] = root / name
        export(hf, out[name], stages=2, model_id=name)
    return out


@pytest.mark.parametrize("family", ["qwen2-window", "qwen3-moe"])
def test_an_exported_family_serves_batched_and_over_a_ring_as_generate(checkpoints, servables, family):
    model = hf_model(checkpoints[family])
    want = {f"s{i}": generate(model, prompt) for i, prompt in enumerate(PROMPTS)}
    assert one_stage(servables[family], PROMPTS, NEW_TOKENS, max_batch=0, prefill_chunk=6) == want
    ring = LocalRing(servables[family], 2, prefill_chunk=6)
    try:
        assert ring.generate(PROMPTS, NEW_TOKENS) == want
    finally:
        ring.close()
    # both ways ran sessions together: decode steps of more than one session
    assert max(frame.batch for _, frame in ring.sent if isinstance(frame, Token)) > 1


def test_a_mixture_of_experts_is_served_by_the_hf_layers_and_says_why(checkpoints):
    model = hf_model(checkpoints["qwen3-moe"])
    assert "Qwen3MoeDecoderLayer" in fusable(model.model.layers, model.config, torch.device("cpu"))
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    kernels = prepare_stage(stage, batch_cap=3)
    assert stage.fused is None and kernels["path"].startswith("hf")
    assert greedy_batched(stage, PROMPTS) == [generate(model, prompt) for prompt in PROMPTS]
