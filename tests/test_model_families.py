"""Families beyond the dense full-attention ones: sliding-window attention (Mistral's ``sliding_window``,
Qwen2's ``use_sliding_window``), Qwen3-MoE, and the hybrid Qwen3-Next (Gated DeltaNet linear attention
between gated full-attention layers, MoE MLPs). Tiny random models built from configs; every reply is
compared with Hugging Face ``generate``'s greedy one, token for token, on stages, batched engines and
rings, with prompts and replies that run well past the window."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from core.servable import ServableError
from events.ring import VERIFY, Hidden, Token
from fellow.runtime.model.fused import Linear, fusable, layer_windows
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.recurrent import SESSIONS
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
        "qwen3-next": make_tiny_checkpoint(root / "qwen3-next", "qwen3_next", layers=4, seed=3),
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
    assert prepare_stage(stage, batch_cap=3).path == "fused" and stage.layer_windows == [None, None, 8, 8]
    linear = transformers.Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
    with pytest.raises(ValueError, match="linear_attention"):
        layer_windows(linear)


def test_linear_attention_outside_qwen3_next_is_refused_at_export(tmp_path):
    """Linear-attention layers are served for the family whose layers were checked (Qwen3-Next), not by kind."""
    hybrid = transformers.Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
    hybrid.save_pretrained(str(tmp_path / "hybrid"))
    with pytest.raises(ServableError, match="'linear_attention' are served for qwen3_next only, not qwen2"):
        export(tmp_path / "hybrid", tmp_path / "out")
    (tmp_path / "mamba").mkdir()
    (tmp_path / "mamba" / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_next", "num_hidden_layers": 2, "layer_types": ["full_attention", "mamba"]}))
    with pytest.raises(ServableError, match=r"kind \['mamba'\] are not served"):
        export(tmp_path / "mamba", tmp_path / "out")
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


@pytest.mark.parametrize("family", ["qwen2-window", "qwen3-moe", "qwen3-next"])
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
    assert stage.fused is None and kernels.path.startswith("hf")
    assert greedy_batched(stage, PROMPTS) == [generate(model, prompt) for prompt in PROMPTS]


# --- the hybrid Qwen3-Next: linear-attention layers with a recurrent state, prompts one session at a time ---

def test_a_hybrid_stage_replies_as_generate_alone_and_in_batches(checkpoints):
    model = hf_model(checkpoints["qwen3-next"])
    assert model.config.layer_types == ["linear_attention", "full_attention"] * 2
    stage = StageModel.from_causal_lm(copy.deepcopy(model))
    kernels = prepare_stage(stage, batch_cap=3)
    assert stage.fused is None and kernels.path.startswith("hf") and "Qwen3NextDecoderLayer" in kernels.why
    assert stage.recurrent_layers == [0, 2] and "layers 0, 2 are linear attention" in stage.recurrent
    want = [generate(model, prompt) for prompt in PROMPTS]
    assert [greedy_alone(stage, prompt) for prompt in PROMPTS] == want  # prompts in pieces of 5
    assert greedy_batched(stage, PROMPTS) == want
    cache = stage.new_cache()
    stage.prefill(cache, torch.tensor(PROMPTS[2]))
    # keys and values for the two attention layers only; each linear layer's states beside them
    assert cache.kv.num_layers == 2 and sorted(cache.conv) == sorted(cache.state) == [0, 2]
    assert cache.bytes == cache.kv.bytes + sum(t.numel() * 4 for t in [*cache.conv.values(), *cache.state.values()])
    cache.release()
    assert cache.length == 0 and not cache.conv and not cache.state


def test_qwen3_next_exports_without_its_multi_token_prediction_head(checkpoints, tmp_path):
    """Qwen3-Next checkpoints carry ``mtp.*`` tensors (a multi-token prediction head transformers does not
    load): export leaves them out rather than refusing the checkpoint."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    hf = shutil.copytree(checkpoints["qwen3-next"], tmp_path / "hf")
    save_file({"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.input_layernorm.weight": torch.ones(64)},
              str(hf / "mtp.safetensors"))
    export(hf, tmp_path / "out", model_id="next")
    with safe_open(str(next((tmp_path / "out").rglob("*.safetensors"))), framework="pt") as fh:
        keys = list(fh.keys())
    assert keys and not any("mtp" in key for key in keys)


def test_hybrid_sessions_interleaved_in_decode_steps_get_what_each_gets_alone(checkpoints):
    """A decode step over several sessions runs them in one batch (their states stacked in the linear
    layers, their keys padded in the attention ones): each gets the logits it gets decoding by itself (to
    float32 rounding), while sessions of other lengths join, step and leave beside it."""
    stage = StageModel.from_causal_lm(hf_model(checkpoints["qwen3-next"]))
    rows_in: list[int] = []  # the rows of every forward through the first (linear-attention) layer
    stage.layers[0].register_forward_pre_hook(lambda _module, args: rows_in.append(args[0].shape[0]))

    def alone(prompt: list[int]) -> list[torch.Tensor]:
        cache = stage.new_cache()
        logits = [stage.prefill(cache, torch.tensor(prompt), prefill_chunk=4)]
        for _ in range(12):
            logits.append(stage.decode([cache], torch.tensor([int(logits[-1].argmax())]))[0])
        return logits

    want = [alone(prompt) for prompt in PROMPTS]
    joins = [0, 3, 5]  # the step at which each session's prompt goes in
    caches, got = [None] * 3, [[] for _ in PROMPTS]
    for step in range(20):
        for i, prompt in enumerate(PROMPTS):
            if joins[i] == step:
                caches[i] = stage.new_cache()
                got[i].append(stage.prefill(caches[i], torch.tensor(prompt), prefill_chunk=4))
        live = [i for i in range(3) if caches[i] is not None and len(got[i]) < 13 and joins[i] < step]
        if live:
            logits = stage.decode([caches[i] for i in live], torch.tensor([int(got[i][-1].argmax()) for i in live]))
            for i, row in zip(live, logits):
                got[i].append(row)
    assert max(rows_in) == 3 and 2 in rows_in  # steps of three and of two sessions ran batched
    for mine, theirs in zip(got, want):
        assert len(mine) == len(theirs) == 13
        for a, b in zip(mine, theirs):  # a batched step rounds its matmuls otherwise: float32 rounding apart
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            assert int(a.argmax()) == int(b.argmax())


def test_a_hybrid_stage_cannot_roll_back_and_its_engine_turns_drafts_and_prefix_reuse_off(checkpoints, servables):
    from events.requests import Sampling
    from fellow.runtime.engine.draft_model import DraftModel, DraftModelMismatch
    from fellow.runtime.engine.engine import local_engine
    from fellow.runtime.engine.session import Session
    from fellow.runtime.model.load.loader import load_one_stage
    from fellow.runtime.model.recurrent import RollbackRefused

    model = hf_model(checkpoints["qwen3-next"])
    stage = load_one_stage(servables["qwen3-next"], "cpu").stage
    cache = stage.new_cache()
    stage.prefill(cache, torch.tensor(PROMPTS[0]))
    with pytest.raises(RollbackRefused, match="cannot go back from 5 positions to 4"):
        cache.crop_to(4)
    cache.crop_to(5)  # where it is: nothing to undo
    with pytest.raises(RollbackRefused, match="no verify pass: layers 0, 2 are linear attention"):
        stage.verify([cache], [[1, 2, 3]])
    with pytest.raises(DraftModelMismatch, match="cannot draft: layers 0, 2 are linear attention"):
        DraftModel(stage, stage)
    # asked for drafts and prefix reuse, the engine serves without them and the stage's status says why
    engine = local_engine(stage, kv_tokens=4096, prefix_cache=True, speculative=4)
    assert engine.speculative == 0 and engine.prefix is None and engine.draft is None
    note = stage.kernels.recurrent
    assert note["off"] == ["speculative", "prefix_cache"] and note["layers"] == [0, 2]
    assert note["sessions"] == SESSIONS and "cannot be rolled back or cut at a position" in note["why"]
    # a prompt that repeats (prompt lookup would draft) twice: the second could have reused the first's positions
    prompt = [5, 6, 7, 8] * 6
    replies = []
    for turn in range(2):
        engine.add(Session(f"t{turn}", prompt, NEW_TOKENS, sampling=Sampling(temperature=0.0)))
        out = []
        while engine.busy:
            result = engine.step()
            out += result.tokens.get(f"t{turn}", [])
            timing = [s.timing() for s in result.finished]
        replies.append(out)
        assert timing[0]["cached_tokens"] == 0 and "spec_k" not in timing[0]
    assert replies == [generate(model, prompt)] * 2


def test_a_hybrid_ring_serves_without_drafts_or_prefix_reuse_on_any_stage(checkpoints, servables):
    """Stage 0 decides for the ring from the model's config (its own layers 0-1 and stage 1's 2-3 both hold
    a linear one); stage 1 keeps no prefix either."""
    model = hf_model(checkpoints["qwen3-next"])
    ring = LocalRing(servables["qwen3-next"], 2, prefill_chunk=6, prefix=True, speculative=3)
    try:
        assert ring.head.speculative == 0 and ring.head.prefix is None and ring.workers[0].prefix is None
        assert ring.stages[0].stage.kernels.recurrent["off"] == ["speculative", "prefix_cache"]
        assert ring.stages[1].stage.kernels.recurrent == {
            "layers": [2], "sessions": SESSIONS, "off": ["prefix_cache"], "why": ring.stages[1].stage.recurrent}
        prompts = [[5, 6, 7, 8] * 4, [5, 6, 7, 8] * 4 + [9]]
        assert ring.generate(prompts, NEW_TOKENS) == {f"s{i}": generate(model, p) for i, p in enumerate(prompts)}
        ring.settle()
    finally:
        ring.close()
    assert not any(isinstance(frame, Hidden) and (frame.kind == VERIFY or frame.reuse) for _, frame in ring.sent)


def test_a_hybrid_stages_cache_free_pass_and_step_costs(checkpoints, servables):
    """The stage modules' cache-free pass (the reference a servable is checked by) equals the HF model's
    logits over two stages; step costs time decode steps on random caches with random recurrent states."""
    from core.servable import load_manifest
    from fellow.runtime.model.kv_cache import random_caches
    from fellow.runtime.model.load.kernels import step_costs
    from fellow.runtime.model.load.weights import build_stage_modules

    model = hf_model(checkpoints["qwen3-next"])
    ids = torch.tensor([PROMPTS[2]])
    manifest = load_manifest(servables["qwen3-next"])
    x = ids
    for index in range(2):
        x = build_stage_modules(manifest, index, servables["qwen3-next"]).forward(x)
    with torch.inference_mode():
        torch.testing.assert_close(x, model(ids).logits, rtol=1e-4, atol=1e-4)
    stage = StageModel.from_causal_lm(model)
    caches = random_caches(stage.new_cache, 2, 16, 4, generator=torch.Generator().manual_seed(0))
    assert all(c.length == 16 and sorted(c.state) == [0, 2] and c.keys[0].shape[0] == 2 for c in caches)
    assert stage.decode(caches, torch.tensor([1, 2])).isfinite().all()
    costs = step_costs(stage, [1, 3])
    assert set(costs) == {"1", "3"} and all(ms > 0 for ms in costs.values())


def test_a_hybrid_stages_kv_budget_counts_keys_of_its_attention_layers_and_each_sessions_states(checkpoints):
    """A token costs the keys and values of the attention layers only; the states a session keeps in each
    linear layer, whatever its length, are what a real session's cache holds, and the budget keeps them
    free for every session that may be in flight before it counts tokens."""
    from fellow.runtime.model.load import kv_budget

    stage = StageModel.from_causal_lm(hf_model(checkpoints["qwen3-next"]))
    attention = sum(stage.attends)
    assert 0 < attention < len(stage.layers)
    element = torch.tensor([], dtype=stage.dtype).element_size()
    per_token = kv_budget.bytes_per_token(stage, 0)[torch.device("cpu")]
    scores = stage.config.num_attention_heads * stage.config.max_position_embeddings * kv_budget.SCORE_BYTES
    assert per_token - scores == attention * 2 * stage.num_kv_heads * stage.head_dim * element
    states = kv_budget.session_state_bytes(stage)[torch.device("cpu")]
    cache = stage.new_cache()
    stage.prefill(cache, torch.tensor(PROMPTS[0]))
    held = sum(t.numel() * t.element_size() for t in (*cache.conv.values(), *cache.state.values()))
    assert states == held > 0  # what one session's states really take
    cache.release()
    # every session's states come out of the usable memory before tokens are counted: as many sessions as
    # twice the usable memory holds leave no token, where a stage without recurrent layers is unmoved
    crowd = int(2 * kv_budget.CPU_USABLE * kv_budget.cpu_free_bytes() / states)
    assert kv_budget.measured_kv_tokens(stage, 0) > 0
    assert kv_budget.measured_kv_tokens(stage, 0, sessions=crowd) == 0
    moe = StageModel.from_causal_lm(hf_model(checkpoints["qwen3-moe"]))
    assert kv_budget.session_state_bytes(moe) == {}
    assert kv_budget.measured_kv_tokens(moe, 0, sessions=crowd) > 0


@pytest.mark.parametrize("method,cosine", [("int8", 0.99), ("int4-fast", 0.95), ("nf4", 0.95)])
def test_a_quantized_hybrid_stage_serves_its_linear_layers_quantized(checkpoints, servables, method, cosine):
    """Weight-only int8, int4 or NF4: every nn.Linear of the HF layers (the Gated DeltaNet's projections too)
    swapped for a quantized one; the convolution and the experts' stacked weights stay float. Its replies are
    its own (quantization rounds), the same alone and in a decode step with others, and its logits close to
    the float stage's."""
    from events.stage import StageOptions
    from fellow.runtime.model.load.loader import load_one_stage
    from fellow.runtime.model.quant.quantizer import QuantModule

    stage = load_one_stage(servables["qwen3-next"], "cpu", StageOptions(quantization=method)).stage
    assert stage.kernels.path == "hf" and stage.weights["quantization"] == method
    deltanet = stage.layers[0].linear_attn
    assert all(isinstance(getattr(deltanet, name), QuantModule) for name in ("in_proj_qkvz", "in_proj_ba", "out_proj"))
    assert isinstance(stage.layers[1].self_attn.q_proj, QuantModule) and type(deltanet.conv1d) is torch.nn.Conv1d
    replies = [greedy_alone(stage, prompt) for prompt in PROMPTS]
    assert greedy_batched(stage, PROMPTS) == replies
    float_stage = StageModel.from_causal_lm(hf_model(checkpoints["qwen3-next"]))
    for prompt in PROMPTS:
        quantized = stage.prefill(stage.new_cache(), torch.tensor(prompt))
        plain = float_stage.prefill(float_stage.new_cache(), torch.tensor(prompt))
        assert torch.nn.functional.cosine_similarity(quantized, plain, dim=0) > cosine


def test_a_hybrid_model_through_the_serving_stack_replies_as_generate(tmp_path, nats_server):
    """Leader and fellow processes: a load asking for drafts serves Qwen3-Next without them (its status says
    why), times its decode steps on random recurrent states, and a greedy chat reply is generate's."""
    from tests.serving_fixtures import Stack, hf_greedy, make_servable

    hf, served = make_servable(tmp_path / "models", "tiny", family="qwen3_next", layers=4, stages=1, seed=3)
    stack = Stack(tmp_path, nats_server.url, served.parent, SWARM_SERVE_STEP_COSTS="1").start()
    try:
        load = stack.load("tiny", speculative=2)
        kernels = load["stages"][0]["kernels"]
        assert kernels["path"].startswith("hf") and "1" in kernels["step_ms"]
        assert all(ms > 0 for ms in kernels["step_ms"].values())
        assert kernels["recurrent"]["off"] == ["speculative", "prefix_cache"]
        assert kernels["recurrent"]["layers"] == [0, 2] and kernels["recurrent"]["sessions"] == SESSIONS
        content = "Name three colours."
        body = {"model": "tiny", "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": content}]}
        reply = stack.post("/v1/chat/completions", body).json()
        want = hf_greedy(hf, content, 16)
        assert want  # a reply of some tokens, not an end of turn at once
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf))
        assert reply["choices"][0]["message"]["content"] == tokenizer.decode(want, skip_special_tokens=False)
        assert reply["usage"]["completion_tokens"] == len(want) and "spec_k" not in reply["swarm"]["timing"]
    finally:
        stack.stop()
