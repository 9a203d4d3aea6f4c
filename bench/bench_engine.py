"""Decode tokens/s of the runtime Engine against transformers' generate on the same small model (CPU)."""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

from events.requests import Sampling
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.session import Session
from fellow.runtime.model.load.kernels import prepare_stage
from fellow.runtime.model.stage import StageModel

GREEDY = Sampling(temperature=0.0)
SAMPLED = Sampling(temperature=0.8, top_p=0.9, top_k=50, seed=0)


def build_model(layers: int, hidden: int, vocab: int, device: str = "cpu", dtype: torch.dtype = torch.float32):
    config = transformers.Qwen3Config(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=3 * hidden,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                                      vocab_size=vocab, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval().to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def run_generate(model, prompts: torch.Tensor, new_tokens: int, sampled: bool = False) -> float:
    knobs = dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=50) if sampled else dict(do_sample=False)
    with torch.inference_mode():
        started = time.perf_counter()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, **knobs)
        out.tolist()  # waits for the device
        return time.perf_counter() - started


def run_engine(stage: StageModel, prompts: torch.Tensor, new_tokens: int, sampled: bool = False) -> float:
    engine = local_engine(stage, kv_tokens=1 << 20, prefill_chunk=256)
    started = time.perf_counter()
    for row, ids in enumerate(prompts.tolist()):
        engine.add(Session(f"s{row}", ids, new_tokens, SAMPLED if sampled else GREEDY))
    produced = 0
    while engine.busy:
        produced += sum(len(tokens) for tokens in engine.step().tokens.values())
    assert produced == new_tokens * len(prompts)
    return time.perf_counter() - started


def decode_tokens_per_s(run, batch: int, new_tokens: int, repeats: int) -> float:
    """Best of ``repeats``: (new_tokens - 1) x batch over the time past the prompt (a 1-token run's time)."""
    best = 0.0
    for _ in range(repeats):
        whole, prompt_only = run(new_tokens), run(1)
        best = max(best, (new_tokens - 1) * batch / max(whole - prompt_only, 1e-9))
    return best


def shape_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model shape and run length options this benchmark and its kin share."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def main() -> None:
    parser = shape_arguments(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sampled", action="store_true", help="temperature 0.8, top-p 0.9, top-k 50 instead of greedy")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--plain", action="store_true", help="torch's default matmuls only (as with "
                        "SWARM_SERVE_PACKED_LINEAR=off); by default kernels are chosen as a fellow chooses them")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.layers, args.hidden, args.vocab, args.device, getattr(torch, args.dtype))
    stage = StageModel.from_causal_lm(copy.deepcopy(model))  # generate keeps the model's own modules
    path = prepare_stage(stage, packed=not args.plain, batch_cap=max(args.batches)).path
    params = sum(p.numel() for p in model.parameters())
    print(f"Qwen3 {params / 1e6:.1f}M params, {args.dtype} on {args.device}, {args.threads} threads, "
          f"prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, {'sampled' if args.sampled else 'greedy'}, stage path {path}")
    for batch in args.batches:
        prompts = torch.randint(1, args.vocab, (batch, args.prompt),
                                generator=torch.Generator().manual_seed(batch)).to(args.device)
        run_engine(stage, prompts, 4)  # warm up both paths
        run_generate(model, prompts, 4)
        hf = decode_tokens_per_s(lambda n: run_generate(model, prompts, n, args.sampled), batch,
                                 args.new_tokens, args.repeats)
        ours = decode_tokens_per_s(lambda n: run_engine(stage, prompts, n, args.sampled), batch,
                                   args.new_tokens, args.repeats)
        print(f"batch {batch}: generate {hf:7.1f} tok/s   engine {ours:7.1f} tok/s   ({ours / hf:.2f}x)")


if __name__ == "__main__":
    main()
