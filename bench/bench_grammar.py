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

import numpy as np
import torch

from bench.bench_engine import build_model, shape_arguments
from events.requests import Sampling
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.processors import constraint_for
from fellow.runtime.engine.session import Session
from fellow.runtime.model.load.kernels import prepare_stage
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
    engine = local_engine(stage, kv_tokens=1 << 20, prefill_chunk=256, prefix_cache=False)
    eos = frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")})
    started = time.perf_counter()
    for row, ids in enumerate(prompts):
        session = Session(f"s{row}", ids, new_tokens, Sampling(temperature=1.0, seed=seed + row))
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


def mask_costs(tokenizer, rows: int, steps: int, seed: int, xgrammar_first: bool = False) -> dict[str, float]:
    """Milliseconds per step to compute ``rows`` masks of one JSON object schema and advance each row by a
    random allowed token (a row that completes starts over), for llguidance and, when importable, xgrammar.
    The same random draws on both: the k-th allowed id of each mask, k from one seeded stream."""
    import json

    from fellow.runtime.engine.processors import allowed_tokens

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    schema = {k: v for k, v in ITEM.items() if k != "x-guidance"}
    out = {}

    def walk(masks, take, reset) -> float:
        gen = torch.Generator().manual_seed(seed)
        spent = 0.0
        for _ in range(steps):
            started = time.perf_counter()
            allowed = masks()
            spent += time.perf_counter() - started
            for i in range(rows):
                ids = allowed[i].nonzero()[:, 0].tolist()
                token = ids[int(torch.randint(len(ids), (1,), generator=gen))]
                if token == eos:
                    reset(i)
                else:
                    take(i, token)
        return spent * 1e3 / steps

    from llguidance import LLMatcher

    ll_grammar = LLMatcher.grammar_from_json_schema(json.dumps(ITEM))
    bound = [constraint_for(tokenizer, ll_grammar, frozenset({eos})) for _ in range(rows)]

    def ll_reset(i):
        bound[i] = constraint_for(tokenizer, ll_grammar, frozenset({eos}))

    started = time.perf_counter()
    constraint_for(tokenizer, LLMatcher.grammar_from_json_schema(json.dumps(ITEM)), frozenset({eos}))
    setup = {"llguidance": (time.perf_counter() - started) * 1e3}
    runs = {"llguidance": lambda: walk(lambda: allowed_tokens(bound, len(tokenizer)), lambda i, t: bound[i].take(t),
                                       ll_reset)}
    try:
        import xgrammar as xgr
    except ImportError:
        return {"llguidance": runs["llguidance"](), "llguidance setup": setup["llguidance"]}
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    xgr.GrammarMatcher(compiled)
    setup["xgrammar"] = (time.perf_counter() - started) * 1e3
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    batch = xgr.BatchGrammarMatcher()
    bitmask = xgr.allocate_token_bitmask(rows, len(tokenizer))

    def xg_masks():  # unpacked as allowed_tokens unpacks llguidance's
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        unpacked = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little").astype(bool)
        return torch.from_numpy(unpacked[:, :len(tokenizer)])

    def xg_reset(i):
        matchers[i].reset()

    runs["xgrammar"] = lambda: walk(xg_masks, lambda i, t: matchers[i].accept_token(t), xg_reset)
    for name in (["xgrammar", "llguidance"] if xgrammar_first else ["llguidance", "xgrammar"]):
        out[name] = runs[name]()
    out.update({f"{name} setup": ms for name, ms in setup.items()})
    return dict(sorted(out.items()))


def main() -> None:
    parser = shape_arguments(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--masks", action="store_true", help="only the mask cost per step: llguidance against "
                        "xgrammar (when importable), same schema and draws, the two alternating")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from fellow.runtime.tools.calibration import default_texts
    from fellow.runtime.tools.chat_tokenizer import train_chat_tokenizer

    tokenizer = train_chat_tokenizer(default_texts(), args.vocab)
    if args.masks:
        print(f"vocab {len(tokenizer)}, {args.new_tokens} steps, ms per step to compute the masks (min, median "
              f"over {args.repeats} rounds)")
        for streams in args.streams:
            costs: dict[str, list[float]] = {}
            for r in range(args.repeats):
                costs_of_round = mask_costs(tokenizer, streams, args.new_tokens, seed=r, xgrammar_first=r % 2 == 1)
                for name, ms in costs_of_round.items():
                    costs.setdefault(name, []).append(ms)
            print(f"{streams} streams: " + ", ".join(f"{name} {min(v):.3f} / {statistics.median(v):.3f} ms"
                                                     for name, v in costs.items()))
        return
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
