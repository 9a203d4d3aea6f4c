"""Perplexity of the trained demo model on held-out text, float32 against the int8, int4-fast and NF4 stages as
a fellow serves them (each loaded by ``load_one_stage``: its own quantized layers), the way llama.cpp's
``llama-perplexity`` reports it: the text tokenized as one stream, cut into chunks of ``--ctx`` tokens, each
chunk run teacher-forced from an empty cache, and only the second half of each chunk scored (every scored
token has at least ctx/2 tokens of context). PPL = exp(mean negative log-likelihood), with its standard error.

Beside perplexity, each quantized stage against the float32 one: top-1 agreement teacher-forced (the
positions where both pick the same next token given the same text) and greedy agreement (generated
token by token, the share of positions where the two sequences hold the same token). The same is measured
on the demo model's shape with random weights (``swarm demo-model DIR --steps 1``: one step of training,
its loss still ln(vocab)), whose logits are nearly flat, so any rounding flips the argmax.

    .venv/bin/python bench/bench_perplexity.py [--model DIR] [--random DIR] [--ctx 192] [--chunks 48]
        [--decode [--native]] [--intermediate N]

``--model``: a demo servable already built (``swarm demo-model DIR``); default: trained here (about two
minutes on two cores). Held-out text: the standard library's module docstrings (never in the demo
model's training text, which is pydoc's help topics), each as an assistant's answer in the demo model's
chat template, as it was trained.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scratch import scratch_dir  # noqa: E402
from events.stage import StageOptions  # noqa: E402

METHODS = ("none", "int8", "int4-fast", "nf4")
# held-out modules, in a fixed order (their docstrings, then their public functions' and classes')
HELD_OUT = ("json", "csv", "argparse", "logging", "pathlib", "itertools", "functools", "collections", "heapq",
            "bisect", "textwrap", "string", "datetime", "calendar", "random", "statistics", "fractions",
            "decimal", "shutil", "tempfile", "glob", "fnmatch", "pickle", "copy", "pprint", "enum", "dataclasses",
            "contextlib", "abc", "typing", "threading", "queue", "sched", "subprocess", "socket", "selectors",
            "base64", "hashlib", "hmac", "secrets", "zlib", "gzip", "zipfile", "tarfile", "sqlite3", "uuid",
            "urllib.parse", "http.client", "email.message", "difflib", "unittest", "doctest", "timeit", "traceback")
PROMPTS = ("What is a list comprehension?", "Tell me about exceptions.", "Explain the with statement in Python.",
           "How does import work?", "What is a decorator?", "Tell me about classes.")


def held_out_text(chat_turn) -> str:
    """The held-out conversations: for each module of HELD_OUT, a question and its docstrings as the answer."""
    turns = []
    for name in HELD_OUT:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module) or ""]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if not attr.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)) \
                    and getattr(obj, "__module__", None) == name:
                docs.append(inspect.getdoc(obj) or "")
        answer = " ".join(" ".join(d.split()) for d in docs if d)[:3000]
        turns.append(chat_turn(f"Tell me about {name}.", answer))
    return "".join(turns)


@torch.inference_mode()
def scored_logits(stage, chunk: list[int], first: int, decode: bool) -> torch.Tensor:
    """The logits at positions ``first`` to the chunk's last but one: one verify pass over the chunk, or
    (``decode``) its first ``first + 1`` tokens as a prompt, then one decode step a token, as a reply is
    served (a quantized stage's decode steps multiply through other kernels than its prompts)."""
    if not decode:
        [logits] = stage.verify([stage.new_cache()], [chunk])
        return logits[first:-1]
    cache = stage.new_cache()
    rows = [stage.prefill(cache, torch.tensor(chunk[: first + 1])).reshape(-1)]
    for token in chunk[first + 1 : -1]:
        rows.append(stage.decode([cache], torch.tensor([token]))[0])
    return torch.stack(rows)


def perplexity(stage, ids: list[int], ctx: int, chunks: int, reference: list[torch.Tensor] | None,
               decode: bool = False):
    """(ppl, its standard error, each scored token's negative log-likelihood, the argmax at each scored
    position, the top-1 agreement with ``reference``'s argmaxes). Each chunk teacher-forced from an empty
    cache (``scored_logits``)."""
    nll, argmaxes, agree, total = [], [], 0, 0
    first = ctx // 2
    for c in range(chunks):
        chunk = ids[c * ctx : (c + 1) * ctx]
        logprobs = torch.log_softmax(scored_logits(stage, chunk, first, decode).float(), dim=-1)
        targets = torch.tensor(chunk[first + 1 :])
        nll.append(-logprobs.gather(1, targets[:, None])[:, 0].double())
        argmaxes.append(logprobs.argmax(-1))
        if reference is not None:
            agree += int((argmaxes[-1] == reference[c]).sum())
            total += len(targets)
    nll = torch.cat(nll)
    mean = float(nll.mean())
    stderr = math.exp(mean) * float(nll.std()) / math.sqrt(len(nll))  # d(exp(m)) = exp(m) dm
    return math.exp(mean), stderr, nll, argmaxes, (agree / total if total else 1.0)


@torch.inference_mode()
def greedy(stage, prompt: list[int], tokens: int) -> list[int]:
    """``tokens`` greedy tokens after ``prompt``, through the stage's prefill and one-token decode steps."""
    cache = stage.new_cache()
    logits = stage.prefill(cache, torch.tensor(prompt))
    out = [int(logits.argmax())]
    for _ in range(tokens - 1):
        logits = stage.decode([cache], torch.tensor([out[-1]]))
        out.append(int(logits[0].argmax()))
    return out


def texts(which: tuple[str, ...]) -> dict[str, str]:
    """The texts scored: ``held-out`` (HELD_OUT's docstrings) and ``training`` (the demo model's own
    training conversations, seen: how the quantized stages do where the model is confident)."""
    from fellow.runtime.tools.chat_tokenizer import chat_turn
    from fellow.runtime.tools.demo_model import demo_examples

    every = {"held-out": lambda: held_out_text(chat_turn), "training": lambda: "".join(demo_examples())}
    return {name: every[name]() for name in which}


def native(stage) -> str:
    """The stage's decode steps through the native step (``native_step``), as its background compile swaps it in
    where it measures faster; '' where it does, else why not."""
    from fellow.runtime.model.forms.native_step import NativeStep, why_not

    why = why_not(stage)
    if why is None:
        step = NativeStep(stage, stage.plain_weights)
        entry = step.build(1, only_faster=False, compiled=True)
        if not entry["serving"]:
            return f"the native step was not taken: {entry}"
        stage.steps.put("compiled", step)
    return why or ""


def measure(model_dir: Path, scored: dict[str, str], ctx: int, chunks: int, tokens: int, decode: bool = False,
            with_native: bool = False, methods: tuple[str, ...] = METHODS) -> dict:
    """{text: {method: row}} for each stage of METHODS, float32 first (every ratio is to it)."""
    from fellow.runtime.model.load.loader import load_one_stage

    rows: dict[str, dict] = {name: {} for name in scored}
    reference: dict[str, tuple] = {}
    for method in methods:
        started = time.perf_counter()
        options = StageOptions(max_batch=1, quantization=method, **({"compile": None} if with_native else {}))
        loaded = load_one_stage(model_dir, "cpu", options)
        stage, tok = loaded.stage, loaded.tokenizer
        if with_native and (why := native(stage)):
            print(f"# {method}: served without the native step: {why}", flush=True)
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False) for p in PROMPTS]
        generated = [greedy(stage, p, tokens) for p in prompts]
        for name, text in scored.items():
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) < chunks * ctx:
                raise SystemExit(f"the {name} text is {len(ids)} tokens; {chunks} chunks of {ctx} need {chunks * ctx}")
            ppl, err, nll, argmaxes, top1 = perplexity(stage, ids, ctx, chunks, reference.get(name, (None,))[0],
                                                       decode)
            reference.setdefault(name, (argmaxes, generated, nll))
            _, ref_greedy, ref_nll = reference[name]
            same = sum(a == b for g, r in zip(generated, ref_greedy) for a, b in zip(g, r))
            # the ratio to float32 over the same tokens, and its standard error (paired: each token's difference)
            diff = nll - ref_nll
            ratio = math.exp(float(diff.mean()))
            rows[name][method] = {
                "ppl": ppl, "stderr": err, "ratio": ratio,
                "ratio_stderr": ratio * float(diff.std()) / math.sqrt(len(diff)) if len(diff) > 1 else 0.0,
                "top1_agreement": top1, "greedy_agreement": same / (len(prompts) * tokens),
                "weights_mb": stage.weights["bytes"] / 1e6, "scored_tokens": len(nll)}
            print(json.dumps({"model": model_dir.name, "text": name, "method": method, **rows[name][method]}),
                  flush=True)
        print(f"# {method}: {time.perf_counter() - started:.1f} s", flush=True)
        del loaded, stage
    return rows


def table(name: str, rows: dict) -> str:
    lines = [f"{name}:", "| stage | PPL | vs float32 (paired) | top-1 agreement | greedy agreement | weights MB |",
             "|---|---|---|---|---|---|"]
    for method, r in rows.items():
        lines.append(f"| {method} | {r['ppl']:.3f} ± {r['stderr']:.3f} | "
                     f"{100 * (r['ratio'] - 1):+.2f} ± {100 * r['ratio_stderr']:.2f} % | "
                     f"{r['top1_agreement']:.3f} | {r['greedy_agreement']:.3f} | {r['weights_mb']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a demo servable (swarm demo-model DIR); default: train one")
    parser.add_argument("--random", type=Path, help="the demo shape with random weights (swarm demo-model DIR "
                                                    "--steps 1); default: made here")
    parser.add_argument("--ctx", type=int, default=192, help="tokens a chunk (the demo model trained at 192)")
    parser.add_argument("--chunks", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=None,
                        help="the MLP width of the demo models trained here (default the demo's, 512); one not a "
                             "multiple of 32 scores the quantized kernels' padded inputs")
    parser.add_argument("--decode", action="store_true",
                        help="score through one decode step a token (the kernels a reply runs) instead of one "
                             "verify pass a chunk")
    parser.add_argument("--native", action="store_true",
                        help="with --decode: each stage's decode steps through the native step where it takes the "
                             "stage (the step a served one-stage CPU load swaps in once it measures faster)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                        help="the stages measured (float32, 'none', first: every ratio is to it)")
    args = parser.parse_args()
    if args.methods[0] != "none":
        parser.error("--methods starts with none (float32): every ratio is to it")
    if args.native and not args.decode:
        parser.error("--native scores decode steps: add --decode")
    torch.set_num_threads(args.threads)
    from fellow.runtime.tools.demo_model import make_demo_model

    tmp = scratch_dir("swarm-bench-ppl-")
    if args.intermediate and (args.model or args.random):
        parser.error("--intermediate shapes the models trained here: leave out --model and --random")
    shape = {"intermediate": args.intermediate} if args.intermediate else {}
    trained = args.model or (make_demo_model(tmp / "trained", **shape), tmp / "trained")[1]
    random = args.random or (make_demo_model(tmp / "random", steps=1, **shape), tmp / "random")[1]
    results = {"trained": measure(trained, texts(("held-out", "training")), args.ctx, args.chunks, args.tokens,
                                  args.decode, args.native, tuple(args.methods)),
               "random": measure(random, texts(("held-out",)), args.ctx, args.chunks, args.tokens, args.decode,
                                 args.native, tuple(args.methods))}
    print()
    for model, by_text in results.items():
        for text, rows in by_text.items():
            print(table(f"demo model, {model} weights, {text} text", rows))
            print()


if __name__ == "__main__":
    main()
