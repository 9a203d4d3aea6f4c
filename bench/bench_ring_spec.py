"""Speculative decoding across a 2-stage ring over simulated WAN links: prompt lookup at k against off,
one session, direct links, at each RTT; the layout of bench/bench_links.py.

    .venv/bin/python bench/bench_ring_spec.py [--shape llama-gqa8] [--rtt 0 20 50] [--ks 2 4] [--tokens 64]

Stage 0 drafts, the last stage verifies, and a token's trip round the ring carries up to k + 1 tokens
back (fellow.runtime.ring.head). Over a slow link the trip, not the compute, is most of a token's time,
so every drafted token that stands saves a whole trip. Two workloads, as bench/bench_spec.py's:

- copying: a code file of this repository in the prompt, "return it with one change", on the shape's
  model with the file's bigram table planted (tests/copying.py);
- chat: the speed matrix's first question to the same shape with random weights.

Decode tokens/s of the one session (its own ``tokens_per_s``), greedy, every row against k = 0 on the
same ring and links in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_links import homes  # noqa: E402
from bench.bench_matrix import SHAPES, make_checkpoint, prompts_for  # noqa: E402
from bench.bench_spec import copying_prompt  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from tests.bus_ring import BusRing  # noqa: E402
from tests.copying import plant_bigrams  # noqa: E402


def servable(ckpt: Path, out: Path, plant: list[int] | None) -> Path:
    """A 2-stage export of ``ckpt``, with ``plant``'s bigram table planted first where given."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fellow.runtime.tools.export import export

    source = ckpt
    if plant is not None:
        model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
        plant_bigrams(model, plant)
        source = out.parent / f"{out.name}-hf"
        model.save_pretrained(str(source))
        AutoTokenizer.from_pretrained(str(ckpt)).save_pretrained(str(source))
        (source / "generation_config.json").write_text((ckpt / "generation_config.json").read_text())
    export(source, out, stages=2, model_id=out.name)
    return out


async def measure(model: Path, nats: EmbeddedNats, rtt_ms: float, prompt: list[int], ks: list[int],
                  tokens: int) -> dict:
    proxies, urls, listen = homes(nats, 2, rtt_ms)
    ring = BusRing(model, 2, "direct", listen=listen, prefill_chunk=256)
    try:
        await ring.start(nats.url, urls=urls)
        await asyncio.to_thread(ring.generate, [prompt[:32]], 4)  # warm
        row: dict = {"rtt_ms": rtt_ms, "routes": ring.routes}
        replies = {}
        for k in [0, *ks]:
            ring.head.speculative = k
            out, timings = await asyncio.to_thread(ring.generate, [prompt], tokens)
            [timing] = timings.values()
            replies[k] = out["s0"]
            row[f"tok_s_{k}"] = timing["tokens_per_s"]
            if k:
                row[f"accepted_{k}"] = round(timing["spec_accepted"] / max(1, timing["spec_drafted"]), 3)
                row[f"tokens_per_pass_{k}"] = round(timing["spec_tokens"] / max(1, timing["spec_passes"]), 2)
        row["same_replies"] = all(replies[k] == replies[0] for k in ks)
        return row
    finally:
        await ring.close()
        for proxy in proxies.values():
            proxy.stop()


async def run(args) -> list[dict]:
    from transformers import AutoTokenizer

    root = scratch_dir("bench-ring-spec-")
    ckpt = make_checkpoint(root / "hf", SHAPES[args.shape])
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    prompt, code = copying_prompt(tok)
    models = {"copying": (servable(ckpt, root / "servables" / "copying", code), prompt),
              "chat": (servable(ckpt, root / "servables" / "chat", None), prompts_for(tok, 1)[0])}
    nats = EmbeddedNats(root / "jetstream").start()
    rows = []
    try:
        for workload, (model, ids) in models.items():
            for rtt in args.rtt:
                row = {"workload": workload, **await measure(model, nats, rtt, ids, args.ks, args.tokens)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        nats.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-gqa8", choices=[n for n, s in SHAPES.items() if not s[-1]],
                    help="an untied shape of the speed matrix (the bigram table needs a head of its own)")
    ap.add_argument("--rtt", type=float, nargs="+", default=[0, 20, 50])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the stages share this process)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = asyncio.run(run(args))
    head = "| workload | RTT ms | off tok/s |" + "".join(f" k={k} tok/s | k={k} / off | accepted | tokens/pass |"
                                                           for k in args.ks) + " same replies |"
    print("\n" + head + "\n|" + "---|" * (head.count("|") - 1))
    for r in rows:
        cells = [r["workload"], f"{r['rtt_ms']:g}", f"{r['tok_s_0']:.1f}"]
        for k in args.ks:
            cells += [f"{r[f'tok_s_{k}']:.1f}", f"{r[f'tok_s_{k}'] / r['tok_s_0']:.2f}x",
                      f"{100 * r[f'accepted_{k}']:.0f}%", f"{r[f'tokens_per_pass_{k}']:.2f}"]
        cells.append("yes" if r["same_replies"] else "NO")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
