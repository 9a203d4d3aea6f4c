"""The compiled decode step (fellow.runtime.model.forms.compiled, SWARM_SERVE_COMPILE): on two shapes it
gives HF generate's greedy reply token for token, a compiled batch equals each session alone, and what
it cannot compile it says why.

A compile in the mode a stage uses (max-autotune: inductor times and builds its own GEMM kernels) took
40-50 s per batch size even for these tiny models on two cores; these tests compile in inductor's
default mode (5-17 s), which builds the same graph around the same attention op and calls torch's
GEMMs instead. bench/bench_compile.py checks the max-autotune step's logits on every shape of the matrix.
"""

import copy

import pytest
import torch
import transformers

from fellow.runtime.model.forms.compiled import compile_decode, why_not
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel
from tests.tiny import make_tiny_checkpoint

# a tied Qwen3 with per-head norms and grouped attention 2:1; a Qwen2 with biases whose upper layers slide
SHAPES = {"qwen3-wide": dict(family="qwen3", layers=2, hidden=128),
          "qwen2-window": dict(family="qwen2", layers=4, hidden=64, window=16)}
BATCHES = {"qwen3-wide": [1], "qwen2-window": [1, 2]}
PROMPT, NEW = 23, 32  # the window's 16 positions are passed well before the reply ends


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Per shape: the HF model, and a fused stage whose decode step is compiled at BATCHES (kept whether
    or not it measured faster here, so the compiled path is what the tests run)."""
    out = {}
    for name, shape in SHAPES.items():
        ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp(name), **shape)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        stage = StageModel.from_causal_lm(copy.deepcopy(model))
        prepare_stage(stage, batch_cap=2, keep_plain=True)
        report = compile_decode(stage, BATCHES[name], stage.plain_weights, only_faster=False, mode=None)
        out[name] = (model, stage, report)
    return out


def greedy(stage: StageModel, ids: list[int], new_tokens: int) -> list[int]:
    cache = stage.new_cache()
    logits = stage.prefill(cache, torch.tensor(ids), prefill_chunk=7)
    out = []
    for _ in range(new_tokens):
        out.append(int(logits.argmax()))
        logits = stage.decode([cache], torch.tensor([out[-1]]))[0]
    return out


@pytest.mark.parametrize("name", SHAPES)
def test_the_compiled_step_gives_generates_greedy_reply(compiled, name):
    model, stage, report = compiled[name]
    assert report["serving"] == BATCHES[name] and report["mode"] == "default", report
    for rows in BATCHES[name]:
        entry = report["batches"][str(rows)]
        assert entry["compile_s"] > 0 and entry["fused_ms"] > 0 and entry["compiled_ms"] > 0, entry
        assert entry["max_logit_diff"] < 1e-3, entry
    ids = torch.randint(0, model.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        inputs = torch.tensor([ids])
        want = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=NEW,
                              min_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
    steps = stage.compiled.steps
    assert greedy(stage, ids, NEW) == want
    assert stage.compiled.steps == steps + NEW  # every decode step ran compiled


def test_a_compiled_batch_equals_each_session_alone(compiled):
    _, stage, _ = compiled["qwen2-window"]
    prompts = [list(range(3, 3 + n)) for n in (5, 19)]  # one past the window before long, one not
    alone = [greedy(stage, ids, 12) for ids in prompts]
    caches = [stage.new_cache() for _ in prompts]
    outs = [[int(stage.prefill(cache, torch.tensor(ids)).argmax())] for cache, ids in zip(caches, prompts)]
    steps = stage.compiled.steps
    for _ in range(11):
        logits = stage.decode(caches, torch.tensor([o[-1] for o in outs]))
        for out, token in zip(outs, logits.argmax(-1).tolist()):
            out.append(token)
    assert outs == alone
    assert stage.compiled.steps == steps + 11
    # a batch size it did not compile runs the fused step, and compiles nothing
    three = [stage.new_cache() for _ in range(3)]
    for cache in three:
        stage.prefill(cache, torch.tensor([4, 5, 6]))
    before = stage.compiled.steps
    stage.decode(three, torch.tensor([7, 8, 9]))
    assert stage.compiled.steps == before and not stage.compiled.takes([None] * 3)


def test_what_cannot_compile_says_why(compiled, tmp_path):
    model, _, _ = compiled["qwen3-wide"]
    ring = StageModel.from_causal_lm(copy.deepcopy(model), 0, 1)  # the first of two stages
    prepare_stage(ring, keep_plain=True)
    assert "ring stage" in why_not(ring)
    report = compile_decode(ring, [1], ring.plain_weights)
    assert report == {"asked": [1], "why": why_not(ring)} and ring.compiled is None
    hf = StageModel.from_causal_lm(copy.deepcopy(model))  # not fused: the HF layers
    assert "not fused" in why_not(hf)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("name", SHAPES)
def test_one_sessions_attention_equals_sdpa_over_its_cache(compiled, name, kernel, monkeypatch):
    """attend_one (how the fused and the compiled step attend for one session) against sdpa over the same
    cache written position by position: the same outputs on every layer, sliding ones past their window
    included, and the same cache; through the C kernel, and through torch where it is not built."""
    import torch.nn.functional as F

    from fellow.runtime.kernels import attend_kernel
    from fellow.runtime.model.forms.attend_one import attend_one
    from fellow.runtime.model.kv_cache import random_caches

    if kernel and not attend_kernel.available():
        pytest.skip(f"no attention kernel: {attend_kernel.unavailable_reason()}")
    if not kernel:
        monkeypatch.setattr(attend_kernel, "takes", lambda buffer: False)

    _, stage, _ = compiled[name]
    fused = stage.fused
    generator = torch.Generator().manual_seed(3)
    ours, theirs = (random_caches(stage.new_cache, 1, 40, 1, torch.Generator().manual_seed(5))[0] for _ in "ab")
    shape = (1, fused.num_heads, 1, fused.head_dim), (1, fused.num_kv_heads, 1, fused.head_dim)

    def reference(layer, q, k, v):
        keys, values = theirs.write(layer.layer_idx, k, v)
        window = fused.windows[layer.layer_idx] or keys.shape[2]
        out = F.scaled_dot_product_attention(q, keys[:, :, -window:], values[:, :, -window:], scale=layer.scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).reshape(1, 1, -1)

    with torch.inference_mode():
        for cache in (ours, theirs):
            cache.reserve(1)
        one = fused.attend_decode([ours])
        assert one.__qualname__ == attend_one(fused, ours).__qualname__  # the fused step's one-session path
        assert ("_kernel_attend" in one.__qualname__) == kernel
        for layer in fused.layers:
            q, k, v = torch.randn(*shape[0], generator=generator), *(torch.randn(*shape[1], generator=generator)
                                                                     for _ in "kv")
            torch.testing.assert_close(one(layer, q, k, v), reference(layer, q, k, v), rtol=1e-5, atol=1e-6)
        for cache in (ours, theirs):
            cache.advance(1)
        for slot in range(len(fused.layers)):
            for a, b in zip(ours.layer(slot), theirs.layer(slot)):
                assert torch.equal(a, b)
    if name == "qwen2-window":  # its cache was past a sliding layer's window
        assert any(w is not None and w < 41 for w in fused.windows.values())


@pytest.mark.skipif(not __import__("fellow.runtime.kernels.f32_gemv", fromlist=["x"]).available(),
                    reason="the float32 row kernel does not build here")
def test_the_kernel_form_multiplies_through_the_row_kernel_and_gives_generates_reply(compiled):
    """The kernel form (graph_linear.KERNEL): every float32 weight at one row through swarm::f32_rows (the
    profiler sees it run), biases and a sliding window included, and the reply is generate's."""
    from torch.profiler import profile

    from fellow.runtime.model.forms.compiled import CompiledDecode
    from fellow.runtime.model.forms.graph_linear import KERNEL

    model, stage, _ = compiled["qwen2-window"]
    kernel = CompiledDecode(stage, stage.plain_weights, None, KERNEL)
    assert all(spec.row_kernel for spec in kernel.graph.linears.values())
    entry = kernel.build(1, only_faster=False)
    assert entry["serving"] and entry["max_logit_diff"] < 1e-3, entry
    ids = list(range(9, 9 + PROMPT))
    with torch.inference_mode():
        inputs = torch.tensor([ids])
        want = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=NEW,
                              min_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
    before = stage.compiled
    stage.steps.put("compiled", kernel)
    try:
        with profile() as prof:
            assert greedy(stage, ids, NEW) == want
    finally:
        stage.steps.put("compiled", before)
    calls = sum(e.count for e in prof.key_averages() if e.key == "swarm::f32_rows")
    assert calls == NEW * len(kernel.graph.linears), calls
