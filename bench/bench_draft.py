"""A draft model (SWARM_SERVE_DRAFT_MODEL) against plain decoding and prompt lookup alone, in one run:
decode tokens/s of the one-stage engine on the demo pair (`swarm demo-model` and
`swarm demo-model --draft`), greedy chat replies, k in {2, 4}, 1 and 4 streams.

    .venv/bin/python bench/bench_draft.py DEMO_DIR DRAFT_DIR [--ks 2 4] [--streams 1 4] [--tokens 64]

- seen: questions the demo model was trained on ("What is <topic>?"): it answers with the help
  text it learnt, and so does the draft, which learnt the same text.
- unseen: the same topics asked another way, and topics it never saw as questions.

Modes per k: ``lookup`` (prompt lookup alone) and ``draft`` (prompt lookup first on a full run,
the draft model otherwise). Decode tokens/s is timed from the step after every reply's first token
to the last, in CPU time of this process on one thread (``time.process_time``, as bench_spec.py):
the draft model's own reading of each prompt falls inside that time; the served model's does not.
Best of ``--rounds`` rounds that each run every mode in turn.
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

from events.requests import Sampling  # noqa: E402
from events.stage import StageOptions  # noqa: E402
from fellow.runtime.engine.draft_model import load_draft_model  # noqa: E402
from fellow.runtime.engine.engine import local_engine  # noqa: E402
from fellow.runtime.engine.prefix_cache import PrefixCache  # noqa: E402
from fellow.runtime.engine.session import Session  # noqa: E402
from fellow.runtime.model.load.loader import load_one_stage  # noqa: E402

SEEN = ["What is {}?", "Tell me about {}."]
UNSEEN = ["Could you describe {} briefly?", "I keep hearing about {}; what does it mean?"]
TOPICS = ["assert", "for", "lambda", "with", "classes", "exceptions", "import", "while"]
COUNTS = ("spec_passes", "spec_tokens", "spec_drafted", "spec_accepted", "spec_model_drafted",
          "spec_model_accepted", "decode_steps")


def prompts(tok, templates: list[str], n: int) -> list[list[int]]:
    questions = [t.format(topic) for topic in TOPICS for t in templates][:n]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in questions]


def decode_rate(stage, batch: list[list[int]], tokens: int, k: int, draft, prefix) -> tuple[float, dict, list]:
    """(decode tokens/s, the sessions' counters summed, their replies)."""
    engine = local_engine(stage, kv_tokens=1 << 20, speculative=k, draft=draft)
    engine.prefix = prefix
    sessions = [Session(f"s{i}", ids, tokens, Sampling(temperature=0.0)) for i, ids in enumerate(batch)]
    for session in sessions:
        engine.add(session)
    while any(s.first_token_at is None for s in sessions):  # the prompts and first tokens, not timed
        engine.step()
    started = time.process_time()
    while engine.busy:
        engine.step()
    elapsed = time.process_time() - started
    decoded = sum(len(s.output_ids) - 1 for s in sessions)
    counts = {name: sum(getattr(s, name) for s in sessions) for name in COUNTS}
    counts["decoded"] = decoded
    return decoded / elapsed, counts, [s.output_ids for s in sessions]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("demo")
    ap.add_argument("draft")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per reply")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_one_stage(args.demo, "cpu", StageOptions(max_batch=max(args.streams)))
    draft = load_draft_model(args.draft, target.stage, target.tokenizer, target.device, batch_cap=max(args.streams))
    print(f"{torch.get_num_threads()} thread(s), {args.tokens} new tokens per reply; draft {draft.name}: "
          f"{draft.ratio:.3f} of the served model's KV bytes a position; target path "
          f"{target.stage.kernels.path}, draft path {draft.stage.kernels.path}", flush=True)
    modes = [("off", 0)] + [(f"{name} k={k}", k) for k in args.ks for name in ("lookup", "draft")]
    rows = []
    for workload, templates in (("seen", SEEN), ("unseen", UNSEEN)):
        prefix = PrefixCache()
        for b in args.streams:
            batch = prompts(target.tokenizer, templates, b)
            best: dict[str, tuple[float, dict]] = {}
            replies = {}
            for _ in range(args.rounds):
                for mode, k in modes:
                    rate, counts, out = decode_rate(target.stage, batch, args.tokens, k,
                                                    draft if mode.startswith("draft") else None, prefix)
                    replies[mode] = out
                    if mode not in best or rate > best[mode][0]:
                        best[mode] = (rate, counts)
            assert all(out == replies["off"] for out in replies.values()), "greedy replies differ"
            row = {"workload": workload, "streams": b, **{m: {"tok_s": r, **c} for m, (r, c) in best.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    head = "| workload | streams | mode | tok/s | / off | drafted | accepted | model's accepted | tokens/pass |"
    lines = [head, "|" + "---|" * 9]
    for row in rows:
        off = row["off"]["tok_s"]
        for mode, _ in modes:
            c = row[mode]
            acc = f"{c['spec_accepted'] / c['spec_drafted']:.0%}" if c["spec_drafted"] else "-"
            model = f"{c['spec_model_accepted'] / c['spec_model_drafted']:.0%}" if c["spec_model_drafted"] else "-"
            lines.append(f"| {row['workload']} | {row['streams']} | {mode} | {c['tok_s']:.1f} | "
                         f"{c['tok_s'] / off:.2f}x | {c['spec_drafted']} | {acc} | {model} | "
                         f"{c['decoded'] / c['decode_steps']:.2f} |")
    print("\n".join(lines))
    print()
    for mode, _ in modes[1:]:
        ratios = sorted(row[mode]["tok_s"] / row["off"]["tok_s"] for row in rows)
        print(f"{mode} / off over workloads and streams: min {ratios[0]:.2f}x, median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
