"""Speculative decoding (prompt lookup) against plain decoding, in one run: tokens/s of the engine at
k in {2, 4, 8} over k = 0, on shapes of bench/bench_matrix.py, for a copying workload and free chat.

    .venv/bin/python bench/bench_spec.py [--shapes llama-gqa8 q2-wide-mlp] [--ks 2 4 8] [--streams 1 4]

- copying: the prompt holds a code file (one of this repository's) and asks for it back with one
  change. Random weights never copy, so the model of each shape gets a bigram table of that file
  planted in its embeddings and head (tests/copying.py): its greedy reply walks the file by each
  token's most frequent successor, copying runs of it as a model returning the file would. Its
  decoder layers keep their random weights and their full cost.
- chat: the speed matrix's questions to the same shape with random weights (nothing planted).
  Random weights fall into loops, which prompt lookup then drafts: this overstates what a trained
  model's free chat would gain.
- failing: the worst case, where every draft falls. The model walks a chain of distinct tokens
  (planted as above) and the prompt holds every pair of the chain followed by another token, so
  each drafting pass drafts and loses all of it: what DraftGuard leaves of the cost.

The stage is the one a fellow serves (fused layers, kernels chosen at load), driven in this process;
decode tokens/s is timed from the step after every reply's first token to the last, in CPU time of
this process on one thread (``time.process_time``): on a machine shared with other work, wall time
swung by 2x between identical runs, CPU time far less. Best of ``--rounds`` rounds that each run
every k in turn.
Also printed: what one verify pass of M positions costs against a one-position step (one session,
on a cache of the copying prompt's length), the price of each drafted position.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, make_checkpoint, prompts_for  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from fellow.runtime.engine.prefix_cache import PrefixCache  # noqa: E402
from tests.copying import plant_bigrams  # noqa: E402

WORKLOADS = ("copying", "chat", "failing")
CODE_FILE = ROOT / "fellow" / "runtime" / "engine" / "budget.py"
CODE_CHARS = 1200  # the head of the file: about 900 tokens of the tiny tokenizer


def copying_prompt(tok) -> tuple[list[int], list[int]]:
    """(the chat prompt's ids, the file's ids): the file in a user turn asking for it back changed."""
    code = CODE_FILE.read_text()[:CODE_CHARS]
    ask = "Return this file with one change: rename `reserved` to `held`. Only the file.\n\n```python\n"
    messages = [{"role": "user", "content": ask + code + "```"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return prompt, tok(code, add_special_tokens=False)["input_ids"]


def failing_prompt(vocab: int, hidden: int, tokens: int) -> tuple[list[int], list[int]]:
    """(prompt, chain): a chain of distinct ids long enough for the reply, and a prompt in which each
    of its pairs is followed by the id five further on."""
    length = min(hidden, tokens + 80)
    chain = torch.randperm(vocab - 8, generator=torch.Generator().manual_seed(0))[:length].add(8).tolist()
    prompt = [t for i in range(length - 6) for t in (chain[i], chain[i + 1], chain[i + 5])] + chain[:2]
    return prompt, chain


def make_stage(ckpt: Path, plant: list[int] | None, batch_cap: int):
    from transformers import AutoModelForCausalLM

    from fellow.runtime.model.kernels import prepare_stage
    from fellow.runtime.model.stage import StageModel

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="sdpa").eval()
    if plant is not None:
        plant_bigrams(model, plant)
    stage = StageModel.from_causal_lm(model)
    prepare_stage(stage, batch_cap=batch_cap)
    return stage


def decode_rate(stage, prompts: list[list[int]], tokens: int, k: int, prefix) -> tuple[float, dict]:
    """(decode tokens/s, the sessions' spec counters summed) of greedy replies of ``tokens`` tokens.

    ``prefix`` is a PrefixCache kept over the runs of one stage, so a prompt is computed once, not
    once per run (prompts are not timed)."""
    from fellow.runtime.engine.engine import Engine
    from fellow.runtime.engine.sampling import SamplingParams
    from fellow.runtime.engine.session import Session

    engine = Engine(stage, kv_tokens=1 << 20, speculative=k)
    engine.prefix = prefix
    sessions = [Session(f"s{i}", ids, tokens, SamplingParams(temperature=0.0)) for i, ids in enumerate(prompts)]
    for session in sessions:
        engine.add(session)
    while any(s.first_token_at is None for s in sessions):  # the prompts and first tokens, not timed
        engine.step()
    started = time.process_time()
    while engine.busy:
        engine.step()
    elapsed = time.process_time() - started
    decoded = sum(len(s.output_ids) - 1 for s in sessions)
    counts = {name: sum(getattr(s, name) for s in sessions)
              for name in ("spec_passes", "spec_tokens", "spec_drafted", "spec_accepted")}
    counts["decode_steps"] = sum(s.decode_steps for s in sessions)
    return decoded / elapsed, counts


@torch.inference_mode()
def pass_costs(stage, context: int, widths: list[int], repeats: int = 5) -> dict[int, float]:
    """ms of one verify pass of M positions for one session on a cache of ``context`` positions."""
    cache = stage.new_cache()
    stage.forward_piece(cache, torch.randint(0, 200, (context,)))
    costs = {}
    for width in widths:
        best = float("inf")
        for _ in range(repeats):
            started = time.process_time()
            stage.verify([cache], [[5] * width])
            best = min(best, time.process_time() - started)
            cache.crop_to(context)
        costs[width] = best * 1e3
    cache.release()
    return costs


def run_shape(name: str, tmp: Path, ks: list[int], streams: list[int], tokens: int, rounds: int,
              chosen: list[str]) -> dict:
    from transformers import AutoTokenizer

    ckpt = make_checkpoint(tmp / name, SHAPES[name])
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    prompt, code = copying_prompt(tok)
    family, hidden, layers, mlp, vocab, heads, kv_heads, tied = SHAPES[name]
    failing, chain = failing_prompt(vocab, hidden, tokens)
    workloads = {"copying": (lambda: make_stage(ckpt, code, max(streams)), [prompt]),
                 "chat": (lambda: make_stage(ckpt, None, max(streams)), None),
                 "failing": (lambda: make_stage(ckpt, chain, max(streams)), [failing])}
    workloads = {w: workloads[w] for w in chosen}
    row: dict = {"name": name, "copy_prompt_tokens": len(prompt), "tokens": tokens}
    row["pass_ms"] = pass_costs(make_stage(ckpt, None, max(streams)), len(prompt), [1] + [k + 1 for k in ks])
    for workload, (build, prompts) in workloads.items():
        stage = build()
        prefix = PrefixCache()
        for b in streams:
            batch = [prompts[0]] * b if prompts else prompts_for(tok, b)
            best: dict[int, tuple[float, dict]] = {}
            for _ in range(rounds):
                for k in [0, *ks]:
                    rate, counts = decode_rate(stage, batch, tokens, k, prefix)
                    if k not in best or rate > best[k][0]:
                        best[k] = (rate, counts)
            row[f"{workload}/{b}"] = {k: {"tok_s": rate, **counts} for k, (rate, counts) in best.items()}
            print(name, workload, b, {k: round(v[0], 1) for k, v in best.items()}, flush=True)
    return row


def table(rows: list[dict], ks: list[int], streams: list[int], workloads: list[str]) -> str:
    head = ("| shape | workload | streams | off tok/s | "
            + " | ".join(f"k={k} tok/s | k={k} / off | k={k} accepted | k={k} tokens/pass" for k in ks) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        for workload in workloads:
            for b in streams:
                cell = r[f"{workload}/{b}"]
                off = cell[0]["tok_s"]
                parts = [r["name"], workload, str(b), f"{off:.1f}"]
                for k in ks:
                    c = cell[k]
                    accepted = c["spec_accepted"] / c["spec_drafted"] if c["spec_drafted"] else 0.0
                    per_pass = b * (r["tokens"] - 1) / c["decode_steps"]  # decode tokens over passes
                    parts += [f"{c['tok_s']:.1f}", f"{c['tok_s'] / off:.2f}x", f"{accepted:.0%}", f"{per_pass:.2f}"]
                lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines)


def costs_table(rows: list[dict]) -> str:
    widths = sorted(rows[0]["pass_ms"])
    head = "| shape | context | " + " | ".join(f"M={m} ms" for m in widths) + " | " + " | ".join(
        f"M={m} / M=1" for m in widths[1:]) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ms = r["pass_ms"]
        lines.append("| " + " | ".join([r["name"], str(r["copy_prompt_tokens"])] + [f"{ms[m]:.1f}" for m in widths]
                                       + [f"{ms[m] / ms[1]:.2f}x" for m in widths[1:]]) + " |")
    return "\n".join(lines)


def summary(rows: list[dict], ks: list[int], streams: list[int], workloads: list[str]) -> str:
    out = []
    for workload in workloads:
        for k in ks:
            ratios = sorted(r[f"{workload}/{b}"][k]["tok_s"] / r[f"{workload}/{b}"][0]["tok_s"]
                            for r in rows for b in streams)
            out.append(f"{workload} k={k} / off over shapes and streams: min {ratios[0]:.2f}x, "
                       f"median {statistics.median(ratios):.2f}x")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["llama-gqa8", "q2-wide-mlp"],
                    choices=[n for n, s in SHAPES.items() if not s[-1]], help="untied shapes (the bigram table "
                    "needs a head of its own)")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per reply")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default); 1 by default: "
                    "the times are CPU times, which stand for wall time only on one thread")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads, {args.tokens} new tokens per reply", flush=True)
    tmp = scratch_dir("swarm-bench-spec-")
    rows = [run_shape(name, tmp, args.ks, args.streams, args.tokens, args.rounds, args.workloads)
            for name in args.shapes]
    for r in rows:
        print(json.dumps(r, default=str), flush=True)
    print()
    print(costs_table(rows))
    print()
    print(table(rows, args.ks, args.streams, args.workloads))
    print()
    print(summary(rows, args.ks, args.streams, args.workloads))


if __name__ == "__main__":
    main()
