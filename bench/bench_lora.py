"""LoRA adapters kept apart over an int8 stage (a QLoRA-style export), served each way SWARM_SERVE_LORA
offers, all in one run: decode tokens/s at 1 and 8 streams of the int8 base alone (no adapters) and of the
base plus adapters served ``lean``, ``lean16`` and ``peft``, each driven by the engine as a fellow serves
it (bench/bench_matrix.py's `engine_alone`), on shapes of bench/bench_matrix.py.

    .venv/bin/python bench/bench_lora.py [--shapes q46m-v4k llama-deep] [--rank 16] [--streams 1 8] [--tokens 48]

The adapters: rank ``--rank`` on all seven linear modules of every layer, A and B random (PEFT's
``init_lora_weights=False``), so every output moves. Also prints each mode's largest logit difference
from lean over one prompt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, engine_alone, make_checkpoint, prompts_for  # noqa: E402
from bench.bench_quant import run_shapes  # noqa: E402

MODES = ("lean", "lean16", "peft")
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(ckpt: Path, out: Path, rank: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    torch.manual_seed(1)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # random B at PEFT's init scale moves logits far; keep the tuned model near its base
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.1)
    peft_model.save_pretrained(str(out))
    return out


def run_shape(name: str, tmp: Path, tokens: int, streams: list[int], rank: int) -> dict:
    from transformers import AutoTokenizer

    from events.stage import StageOptions
    from fellow.runtime.model.load.loader import load_one_stage
    from fellow.runtime.tools.export import export

    ckpt = make_checkpoint(tmp / name / "hf", SHAPES[name])
    export(ckpt, tmp / "servables" / name, stages=1, model_id=name)
    lora = make_adapters(ckpt, tmp / name / "lora", rank)
    export(ckpt, tmp / "servables" / f"{name}-lora", stages=1, adapters=lora, model_id=f"{name}-lora")
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    tok.padding_side = "left"
    ids = torch.tensor(prompts_for(tok, 1)[0])
    row = {"name": name, "rank": rank}
    stage = load_one_stage(tmp / "servables" / name, "cpu",
                           StageOptions(max_batch=max(streams), quantization="int8")).stage
    row["off"] = {b: engine_alone(stage, tok, b, tokens)[0] for b in streams}
    del stage
    logits = {}
    for mode in MODES:
        stage = load_one_stage(tmp / "servables" / f"{name}-lora", "cpu",
                               StageOptions(max_batch=max(streams), quantization="int8", lora=mode)).stage
        assert stage.kernels.lora["mode"] == mode, stage.kernels
        with torch.inference_mode():
            logits[mode] = stage.prefill(stage.new_cache(), ids)
        row[mode] = {b: engine_alone(stage, tok, b, tokens)[0] for b in streams}
        row[f"{mode}_mb"] = stage.weights["bytes"] / 1e6
        del stage
    row["max_logit_diff_from_lean"] = {m: float((logits[m] - logits["lean"]).abs().max()) for m in MODES[1:]}
    return row


def table(rows: list[dict], streams: list[int]) -> str:
    head = "| shape | rank |"
    for b in streams:
        head += f" int8 base {b} |" + "".join(f" {m} {b} |" for m in MODES) + "".join(f" {m}/base {b} |" for m in MODES)
    head += " weights MB " + " / ".join(MODES) + " | logit diff from lean: " + " / ".join(MODES[1:]) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["name"], str(r["rank"])]
        for b in streams:
            base = r["off"][b]
            cells += [f"{base:.1f}", *(f"{r[m][b]:.1f}" for m in MODES), *(f"{r[m][b] / base:.2f}x" for m in MODES)]
        cells.append(" / ".join(f"{r[f'{m}_mb']:.1f}" for m in MODES))
        cells.append(" / ".join(f"{r['max_logit_diff_from_lean'][m]:.1e}" for m in MODES[1:]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[dict], streams: list[int]) -> str:
    out = []
    for b in streams:
        for mode in MODES[1:]:
            ratios = sorted(r[mode][b] / r["lean"][b] for r in rows)
            out.append(f"{mode} / lean at {b} stream(s): min {ratios[0]:.2f}x, median {statistics.median(ratios):.2f}x")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["q46m-v4k", "llama-deep"], choices=list(SHAPES))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per stream")
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    print(f"{torch.get_num_threads()} threads, {args.tokens} new tokens per stream, rank {args.rank}", flush=True)
    run_shapes("swarm-bench-lora-", args.shapes,
               lambda name, tmp: run_shape(name, tmp, args.tokens, args.streams, args.rank),
               lambda rows: (table(rows, args.streams), summary(rows, args.streams)))


if __name__ == "__main__":
    main()
