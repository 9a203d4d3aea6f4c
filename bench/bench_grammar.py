"""The cost of grammar-constrained decoding: Engine decode tokens/s with an llguidance JSON grammar on every
stream against free decoding, same model, same sampling, at 1 and 8 streams, measured in the same run.

The tokenizer is the project's chat tokenizer trained on the calibration texts to --vocab (it stops
short of the target when the texts run out of merges; the run prints the size it got). The grammar
is JSON lines of objects (strings, bounded integers, enums, booleans) that never has to end, so a
constrained stream decodes all its tokens like a free one; both sample at temperature 1.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.bench_engine import build_model
from fellow.runtime.engine.engine import Engine
from fellow.runtime.engine.processors import constraint_for
from fellow.runtime.engine.sampling import SamplingParams
from fellow.runtime.engine.session import Session
from fellow.runtime.model.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel

ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "level", "tags", "ok"],
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "level": {"type": "integer", "minimum": 0, "maximum": 999},
                       "tags": {"type": "array", "items": {"enum": ["warm", "cold", "dry"]}, "maxItems": 3},
                       "ok": {"type": "boolean"}},
        "x-guidance": {"whitespace_flexible": False}}


def grammar() -> str:
    import json

    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(f"start: (item \"\\n\")+\nitem: %json {json.dumps(ITEM)}")


def run(stage: StageModel, tokenizer, prompts: list[list[int]], new_tokens: int, constrained: str, seed: int) -> float:
    engine = Engine(stage, kv_tokens=1 << 20, prefill_chunk=256, prefix_cache=False)
    eos = frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")})
    started = time.perf_counter()
    for row, ids in enumerate(prompts):
        session = Session(f"s{row}", ids, new_tokens, SamplingParams(temperature=1.0, seed=seed + row))
        session.constraint = constraint_for(tokenizer, constrained, eos) if constrained else None
        engine.add(session)
    produced = 0
    while engine.busy:
        produced += sum(len(tokens) for tokens in engine.step().tokens.values())
    assert produced == new_tokens * len(prompts), produced
    return time.perf_counter() - started


def tokens_per_s(stage, tokenizer, prompts, new_tokens: int, constrained: str, seed: int) -> float:
    """(new_tokens - 1) x streams over the time past the prompt (a 1-token run's time)."""
    whole = run(stage, tokenizer, prompts, new_tokens, constrained, seed)
    prompt_only = run(stage, tokenizer, prompts, 1, constrained, seed)
    return (new_tokens - 1) * len(prompts) / max(whole - prompt_only, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from fellow.runtime.tools.calibration import default_texts
    from fellow.runtime.tools.chat_tokenizer import train_chat_tokenizer

    tokenizer = train_chat_tokenizer(default_texts(), args.vocab)
    model = build_model(args.layers, args.hidden, len(tokenizer))
    stage = StageModel.from_causal_lm(model)
    prepare_stage(stage, batch_cap=max(args.streams))
    constrained = grammar()
    print(f"vocab {len(tokenizer)}, {args.layers} layers x {args.hidden}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, temperature 1, {args.repeats} rounds alternating the order")
    gen = torch.Generator().manual_seed(0)
    print("| streams | free tok/s | constrained tok/s | constrained / free (min, median) |")
    print("|---|---|---|---|")
    for streams in args.streams:
        prompts = torch.randint(300, len(tokenizer), (streams, args.prompt), generator=gen).tolist()
        free, bound, ratios = [], [], []
        run(stage, tokenizer, prompts, 4, constrained, seed=0)  # warm up both paths
        run(stage, tokenizer, prompts, 4, "", seed=0)
        for r in range(args.repeats):
            order = [("", free), (constrained, bound)]
            for g, out in (order if r % 2 == 0 else order[::-1]):
                out.append(tokens_per_s(stage, tokenizer, prompts, args.new_tokens, g, seed=r))
            ratios.append(bound[-1] / free[-1])
        print(f"| {streams} | {statistics.median(free):.1f} | {statistics.median(bound):.1f} | "
              f"{min(ratios):.2f}×, {statistics.median(ratios):.2f}× |")


if __name__ == "__main__":
    main()
