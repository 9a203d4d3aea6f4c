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
swung by 2x between identical runs, CPU time far less, but still by 10-20 % between runs a few
seconds apart. So each of ``--rounds`` rounds runs off and every k in turn (off first, then last, by
turns), and a ratio is the median over rounds of k's rate over off's in the same round; a rate shown
is the median over rounds.

Several streams are timed two ways. "wave": one reply per stream, all started together, timed to the
last one's end; the reply whose drafts stand least then sets the time, and drafts of the others
shorten nothing. "steady" (``--requests``, 3): each stream sends that many replies one after another,
the next as soon as its last ends, as clients of a busy server do; a reply that ends early frees its
row for the next, so every accepted draft counts.
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
from bench.bench_serving import QUESTIONS  # noqa: E402
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

    from fellow.runtime.model.load.kernels import prepare_stage
    from fellow.runtime.model.stage import StageModel

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="sdpa").eval()
    if plant is not None:
        plant_bigrams(model, plant)
    stage = StageModel.from_causal_lm(model)
    prepare_stage(stage, batch_cap=batch_cap)
    return stage


def decode_rate(stage, prompts: list[list[int]], streams: int, tokens: int, k: int, prefix,
                requests: int = 1) -> tuple[float, dict]:
    """(decode tokens/s, the sessions' spec counters summed) of greedy replies of ``tokens`` tokens.

    ``streams`` streams, whose n-th requests take the prompts in turn from ``prompts``. With
    ``requests`` 1 (a wave) they all start together and the time runs to the last reply's end. With
    more (steady), each stream is a client that sends ``requests`` replies one after another, the next
    added to the engine as soon as its last one ends: the engine then stays at one session per stream
    until the last client's last reply, as a server under steady load does. The later requests'
    prompts (cached by then) run inside the timed span, as many off as on.

    ``prefix`` is a PrefixCache kept over the runs of one stage, so a prompt is computed once, not
    once per run (prompts are not timed)."""
    from events.requests import Sampling
    from fellow.runtime.engine.engine import local_engine
    from fellow.runtime.engine.session import Session

    engine = local_engine(stage, kv_tokens=1 << 20, speculative=k)
    engine.prefix = prefix

    def send(stream: int, n: int) -> Session:
        session = Session(f"s{stream}.{n}", prompts[(stream + n * streams) % len(prompts)], tokens,
                          Sampling(temperature=0.0))
        engine.add(session)
        return session

    live = [send(i, 0) for i in range(streams)]
    sessions = list(live)
    sent = [1] * streams
    while any(s.first_token_at is None for s in sessions):  # the prompts and first tokens, not timed
        engine.step()
    started = time.process_time()
    while engine.busy:
        engine.step()
        for stream, session in enumerate(live):
            if session.finish_reason is not None and sent[stream] < requests:
                live[stream] = send(stream, sent[stream])
                sessions.append(live[stream])
                sent[stream] += 1
    elapsed = time.process_time() - started
    decoded = sum(len(s.output_ids) - 1 for s in sessions)
    counts = {name: sum(getattr(s, name) for s in sessions)
              for name in ("spec_passes", "spec_tokens", "spec_drafted", "spec_accepted")}
    counts["decode_steps"] = sum(s.decode_steps for s in sessions)
    counts["decoded"] = decoded
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


def arrivals(b: int, requests: int) -> list[tuple[str, int]]:
    """The ways ``b`` streams are timed: (label, requests per stream). One stream has one way."""
    return [("wave", 1)] + ([("steady", requests)] if b > 1 and requests > 1 else [])


def run_shape(name: str, tmp: Path, ks: list[int], streams: list[int], tokens: int, rounds: int,
              chosen: list[str], requests: int) -> dict:
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
        pool = prompts or prompts_for(tok, len(QUESTIONS))  # chat: every question, taken in turn
        for b in streams:
            for label, sends in arrivals(b, requests):
                rates: dict[int, list[float]] = {k: [] for k in [0, *ks]}
                counted: dict[int, dict] = {}
                for turn in range(rounds):  # off first, then every k, and the other way round the next time
                    for k in [0, *ks] if turn % 2 == 0 else [*reversed(ks), 0]:
                        rate, counted[k] = decode_rate(stage, pool, b, tokens, k, prefix, sends)
                        rates[k].append(rate)
                row[f"{workload}/{b}/{label}"] = {
                    k: {"tok_s": statistics.median(rates[k]),
                        "ratio": statistics.median(r / off for r, off in zip(rates[k], rates[0])), **counted[k]}
                    for k in rates}
                print(name, workload, b, label, {k: [round(r, 1) for r in rates[k]] for k in rates}, flush=True)
    return row


def cells(streams: list[int], requests: int) -> list[tuple[int, str]]:
    return [(b, label) for b in streams for label, _ in arrivals(b, requests)]


def table(rows: list[dict], ks: list[int], streams: list[int], workloads: list[str], requests: int) -> str:
    head = ("| shape | workload | streams | arrivals | off tok/s | "
            + " | ".join(f"k={k} tok/s | k={k} / off | k={k} accepted | k={k} tokens/pass" for k in ks) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        for workload in workloads:
            for b, label in cells(streams, requests):
                cell = r[f"{workload}/{b}/{label}"]
                off = cell[0]["tok_s"]
                parts = [r["name"], workload, str(b), label, f"{off:.1f}"]
                for k in ks:
                    c = cell[k]
                    accepted = c["spec_accepted"] / c["spec_drafted"] if c["spec_drafted"] else 0.0
                    per_pass = c["decoded"] / c["decode_steps"]  # a session's decode tokens per pass it ran in
                    parts += [f"{c['tok_s']:.1f}", f"{c['ratio']:.2f}x", f"{accepted:.0%}", f"{per_pass:.2f}"]
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


def summary(rows: list[dict], ks: list[int], streams: list[int], workloads: list[str], requests: int) -> str:
    out = []
    for workload in workloads:
        for k in ks:
            for label in ("wave", "steady"):
                # one stream is the same either way: it counts under both
                keys = [f"{workload}/{b}/{arr}" for b, arr in cells(streams, requests) if arr == label or b == 1]
                if not any(key.endswith(label) for key in keys):
                    continue
                ratios = sorted(r[key][k]["ratio"] for r in rows for key in keys)
                out.append(f"{workload} k={k} / off over shapes and streams ({label}): min {ratios[0]:.2f}x, "
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
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=3, help="replies each stream sends one after another in the "
                    "steady arrivals (timed beside the wave of one reply per stream, where streams > 1; 1: the wave "
                    "only)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default); 1 by default: "
                    "the times are CPU times, which stand for wall time only on one thread")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads, {args.tokens} new tokens per reply", flush=True)
    tmp = scratch_dir("swarm-bench-spec-")
    rows = [run_shape(name, tmp, args.ks, args.streams, args.tokens, args.rounds, args.workloads, args.requests)
            for name in args.shapes]
    for r in rows:
        print(json.dumps(r, default=str), flush=True)
    print()
    print(costs_table(rows))
    print()
    print(table(rows, args.ks, args.streams, args.workloads, args.requests))
    print()
    print(summary(rows, args.ks, args.streams, args.workloads, args.requests))


if __name__ == "__main__":
    main()
