"""Multi-turn chat with the prefix cache on against off, in one run: the time to first token of each
turn of a 10-turn chat whose history grows to about 2,000 tokens, and the total decode tokens/s of 8
such chats at once. The engine serves the stage as a fellow does (fused layers, kernels chosen at load),
in this process; every turn sends the whole conversation again plus a new user message.

    .venv/bin/python bench/bench_prefix.py [--shape q46m-v4k] [--turns 10] [--chats 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, make_checkpoint  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from events.requests import Sampling  # noqa: E402
from fellow.runtime.engine.engine import local_engine  # noqa: E402
from fellow.runtime.engine.session import Session  # noqa: E402

GREEDY = Sampling(temperature=0.0)


def user_message(vocab: int, chat: int, turn: int, size: int) -> list[int]:
    return torch.randint(10, vocab, (size,), generator=torch.Generator().manual_seed(chat * 1000 + turn)).tolist()


def run_chats(stage, vocab: int, chats: int, turns: int, message: int, reply: int, cache: bool) -> dict:
    """All chats turn by turn, their turns in flight together; per turn the median TTFT (ms)."""
    engine = local_engine(stage, kv_tokens=1 << 20, prefix_cache=cache)
    histories = [[] for _ in range(chats)]
    ttft, decoded, decode_s, cached = [], 0, 0.0, []
    for turn in range(turns):
        sessions = [Session(f"c{c}-{turn}", histories[c] + user_message(vocab, c, turn, message), reply, GREEDY)
                    for c in range(chats)]
        for session in sessions:
            engine.add(session)
        started = time.perf_counter()
        while engine.busy:
            engine.step()
        decode_s += time.perf_counter() - started
        for c, s in enumerate(sessions):
            histories[c] = s.prompt_ids + s.output_ids
            decoded += len(s.output_ids)
        ttft.append(sorted(s.timing()["ttft_ms"] for s in sessions)[chats // 2])
        cached.append(sum(s.cached_tokens for s in sessions) / chats)
    return {"ttft_ms": ttft, "tok_s": decoded / decode_s, "cached": cached, "history": len(histories[0]),
            "replies": [h for h in histories]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="q46m-v4k", choices=list(SHAPES))
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--message", type=int, default=150, help="tokens of each new user message")
    ap.add_argument("--reply", type=int, default=50, help="tokens of each reply")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from fellow.runtime.model.load.kernels import prepare_stage
    from fellow.runtime.model.stage import StageModel

    ckpt = make_checkpoint(scratch_dir("swarm-bench-prefix-"), SHAPES[args.shape])
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    stage = StageModel.from_causal_lm(model)
    prepare_stage(stage, batch_cap=args.chats)
    vocab = model.config.vocab_size
    print(f"{args.shape}, {args.turns} turns of +{args.message} user tokens and {args.reply}-token replies, "
          f"{torch.get_num_threads()} threads")
    one = {c: run_chats(stage, vocab, 1, args.turns, args.message, args.reply, c) for c in (False, True)}
    assert one[True]["replies"] == one[False]["replies"], "the cache changed a greedy reply"
    many = {c: run_chats(stage, vocab, args.chats, args.turns, args.message, args.reply, c) for c in (False, True)}
    print(f"history at the last turn: {one[True]['history']} tokens")
    print("\n| turn | TTFT off ms | TTFT on ms | on/off | cached tokens |\n|---|---|---|---|---|")
    for t in range(args.turns):
        off, on = one[False]["ttft_ms"][t], one[True]["ttft_ms"][t]
        print(f"| {t + 1} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {one[True]['cached'][t]:.0f} |")
    off, on = many[False]["tok_s"], many[True]["tok_s"]
    print(f"\n{args.chats} chats at once, all turns: {off:.1f} tok/s off, {on:.1f} tok/s on ({on / off:.2f}x); "
          f"turn-{args.turns} median TTFT {many[False]['ttft_ms'][-1]:.0f} -> {many[True]['ttft_ms'][-1]:.0f} ms")


if __name__ == "__main__":
    main()
