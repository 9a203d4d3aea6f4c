"""The spec's step costs at load (SWARM_SERVE_STEP_COSTS): what one serving step of this stage costs on
its own devices, measured before it reports ready, into its status (``kernels.step_costs``) and its
log, one ``[stageN <name>]`` line each:

- ``verify-cost``: one session running M = 1 to 8 positions at once (its last token and M - 1 drafted
  ones), on a cache of 256 and of 2,048 positions;
- ``batch-cost``: a batched decode step of 2 and of 4 sessions;
- ``attn-cost``: sdpa against grouped attention (model.grouped_attention) on one layer's shapes at the
  longest context, one session with 1 and 3 positions and a batch of 4;
- ``graph-spike``: one block's MLP replayed as a CUDA graph against run eagerly, and what that would save
  over all blocks; CUDA stages only (a CPU stage says so);
- ``step-profile``: CPU time, kernel launches and the busiest ops of a one-token step, only with
  ``SWARM_SERVE_STEP_COSTS=profile`` (a profiled stage is not what it serves, so it is opt-in).

The decode step at batch 1 and at the cap, and the LoRA cost, stay in ``kernels.step_costs`` /
``lora_costs``. Every position a measurement adds is on random caches dropped after it, so the stage
serves exactly as before. Not built: the ring's ``link-probe``.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fellow.runtime.model.grouped_attention import grouped_attention_forward
from fellow.runtime.model.kv_cache import random_caches
from fellow.runtime.model.load.kernels import step_costs

log = logging.getLogger(__name__)

VERIFY_CONTEXTS = (256, 2048)  # positions already in the session's cache
VERIFY_WIDTHS = tuple(range(1, 9))  # positions a verify pass runs
BATCH_ROWS = (2, 4)
REPEATS = 2  # timed calls per measurement after an untimed one; the best is kept
PROFILE_TOP = 5  # ops the profile names


def _timed(call, repeats: int = REPEATS) -> float:
    """ms of the best of ``repeats`` calls after an untimed one."""
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return round(best * 1e3, 3)


def _inputs(stage, width: int) -> torch.Tensor:
    if stage.is_first:
        return torch.ones(width, dtype=torch.long, device=stage.input_device)
    return torch.zeros(1, width, stage.config.hidden_size, dtype=stage.dtype, device=stage.input_device)


def verify_contexts(config) -> list[int]:
    """VERIFY_CONTEXTS, the longer ones cut to what the model's positions take (a small model's longest)."""
    limit = int(getattr(config, "max_position_embeddings", 0) or 0) - max(VERIFY_WIDTHS)
    return sorted({min(c, limit) if limit > 0 else c for c in VERIFY_CONTEXTS})


@torch.inference_mode()
def verify_costs(stage) -> dict[str, dict[str, float]] | str:
    """ms of one session's pass over M positions, by context then M; a one-line reason where the stage
    cannot run one (a stage with recurrent layers cannot take positions back)."""
    if stage.recurrent is not None:
        return f"no verify pass: {stage.recurrent}"
    out: dict[str, dict[str, float]] = {}
    for context in verify_contexts(stage.config):
        (cache,) = random_caches(stage.new_cache, 1, context, max(VERIFY_WIDTHS), tile=16)
        try:
            def run(width: int) -> None:
                _pass(stage, cache, width)
                cache.crop_to(context)
            out[str(context)] = {str(width): _timed(lambda: run(width)) for width in VERIFY_WIDTHS}
        finally:
            cache.release()
    return out


def _pass(stage, cache, width: int) -> None:
    """One session's ``width`` positions as a verify pass runs them on this stage: with the logits at
    every position where it holds the head."""
    if stage.is_first and stage.is_last:
        stage.verify([cache], [[1] * width])
    elif stage.is_last:
        stage.piece_logits(cache, _inputs(stage, width))
    else:
        stage.forward_piece(cache, _inputs(stage, width))


@torch.inference_mode()
def attn_costs(stage, context: int) -> dict:
    """sdpa (over keys and values repeated per query head, as transformers runs a masked pass) against
    grouped attention (model.grouped_attention) on one layer's shapes at ``context`` cached positions: one
    session with 1 and 3 positions, and a batch of 4 one-position rows with a padding mask."""
    config, device, dtype = stage.config, stage.input_device, stage.dtype
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    class Layer(torch.nn.Module):
        num_key_value_groups = heads // kv
        is_causal = True

    layer, out = Layer(), {"context": context, "heads": f"{heads}/{kv}"}
    for name, forward in (("sdpa", sdpa_attention_forward), ("grouped", grouped_attention_forward)):
        times = {}
        for label, rows, width in (("1", 1, 1), ("3", 1, 3), ("batch4", 4, 1)):
            q = torch.randn(rows, heads, width, dim, dtype=dtype, device=device)
            k = torch.randn(rows, kv, context + width, dim, dtype=dtype, device=device)
            mask = torch.zeros(rows, 1, width, context + width, dtype=dtype, device=device)
            mask[1:, ..., :16] = torch.finfo(dtype).min  # rows of a batch padded on the left
            times[label] = _timed(lambda: forward(layer, q, k, k, mask, scaling=dim ** -0.5), 3)
        out[f"{name}_ms"] = times
    return out


@torch.inference_mode()
def graph_spike(stage) -> dict | str:
    """A CUDA stage: its first block's MLP on one position, eager and replayed as a CUDA graph, and the
    saving over all blocks; a reason elsewhere."""
    device = stage.input_device
    if device.type != "cuda":
        return "needs CUDA: a CPU stage launches no kernels to replay"
    mlp = getattr(stage.layers[0], "mlp", None) if stage.layers else None
    if mlp is None:
        return "the first block has no mlp module to replay"
    x = torch.randn(1, 1, stage.config.hidden_size, dtype=stage.dtype, device=device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for _ in range(3):
            mlp(x)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mlp(x)

    def synced(call):
        def run():
            call()
            torch.cuda.synchronize(device)
        return run

    eager = _timed(synced(lambda: mlp(x)), 5)
    replay = _timed(synced(graph.replay), 5)
    blocks = len(stage.layers)
    return {"eager_ms": eager, "graph_ms": replay, "blocks": blocks, "saving_ms": round((eager - replay) * blocks, 3)}


@torch.inference_mode()
def step_profile(stage) -> dict:
    """torch.profiler over a one-token step (batch 1): CPU ms in all, kernel launches (CUDA), and the
    PROFILE_TOP ops with the most CPU time of their own."""
    from torch.profiler import ProfilerActivity, profile

    (cache,) = random_caches(stage.new_cache, 1, 256, 2, tile=16)
    try:
        inputs = _inputs(stage, 1)
        stage.decode([cache], inputs)  # untimed: warm
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if stage.input_device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            stage.decode([cache], inputs)
        events = prof.key_averages()
        busiest = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:PROFILE_TOP]
        launches = sum(e.count for e in events if "LaunchKernel" in e.key)
        return {"cpu_ms": round(sum(e.self_cpu_time_total for e in events) / 1e3, 3), "kernel_launches": launches,
                "ops": {e.key: round(e.self_cpu_time_total / 1e3, 3) for e in busiest}}
    finally:
        cache.release()


def measure(stage, index: int, profiled: bool = False) -> dict:
    """Every cost above for stage ``index``, logged; what its status shows under ``kernels.step_costs``."""
    verify = verify_costs(stage)
    longest = max(verify_contexts(stage.config))
    report = {"verify_ms": verify, "batch_ms": step_costs(stage, list(BATCH_ROWS)),
              "attn": attn_costs(stage, longest) if stage.layers else None, "graph_spike": graph_spike(stage)}
    if profiled:
        report["profile"] = step_profile(stage)
    _log(index, report)
    return report


def _log(index: int, report: dict) -> None:
    verify = report["verify_ms"]
    if isinstance(verify, str):
        log.info("[stage%d verify-cost] %s", index, verify)
    else:
        for context, widths in verify.items():
            log.info("[stage%d verify-cost] context %s: %s", index, context,
                     " ".join(f"M={w}: {ms:.2f} ms" for w, ms in widths.items()))
    batches = " ".join(f"batch {r}: {ms:.2f} ms" for r, ms in report["batch_ms"].items())
    log.info("[stage%d batch-cost] %s", index, batches)
    if (attn := report["attn"]) is not None:
        log.info("[stage%d attn-cost] context %d, heads %s: %s", index, attn["context"], attn["heads"],
                 "; ".join(f"{n} " + " ".join(f"{k}={v:.3f}" for k, v in attn[f"{n}_ms"].items())
                           for n in ("sdpa", "grouped")))
    log.info("[stage%d graph-spike] %s", index, report["graph_spike"])
    if "profile" in report:
        p = report["profile"]
        log.info("[stage%d step-profile] cpu %.2f ms, %d kernel launches; %s", index, p["cpu_ms"],
                 p["kernel_launches"], " ".join(f"{k}={v:.2f}" for k, v in p["ops"].items()))
