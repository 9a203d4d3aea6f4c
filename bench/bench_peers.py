"""Decode speed of the whole stack beside llama.cpp's server on the same weights, all in one run, each as a
ratio against HF `generate` measured in the same run, over a matrix of shapes (bench/bench_matrix.py's).

    .venv/bin/python bench/bench_peers.py --llama-cpp DIR [--shapes A B ...] [--tokens 128] [--streams 1 8]
        [--repeats 3] [--threads N]

DIR (or SWARM_BENCH_LLAMA_CPP) is a llama.cpp source tree with a built build/bin/llama-server and
build/bin/llama-quantize, its convert_hf_to_gguf.py and gguf-py/ (the converter needs sentencepiece).

Per shape, one random float32 checkpoint (bench_matrix.make_checkpoint: end-of-turn rows zeroed, so no reply
ends early), and at each stream count, decode tokens/s of:
- HF `generate` at that batch, the baseline every ratio divides by;
- the stack (nats-server, a leader, a fellow; no SWARM_* serving variable set, but SWARM_SERVE_THREADS
  with ``--threads``), its load at float32, then quantized int8 ({"bits": 8}) and int4
  ({"method": "int4-fast"}), one load at a time; clients stream /v1/chat/completions (bench_serving.load_test);
- beside each load, `llama-server -t N -np 8 -cb --no-repack` on the checkpoint converted to GGUF float32
  (convert_hf_to_gguf.py --outtype f32), or on q8_0 or q4_0 made from it by llama-quantize (its default
  recipe for each type); clients stream its /completion endpoint, greedy, end of text ignored, the same
  chat-templated prompts as the stack's (bench/peers_llama.py). The two are timed in turn, stream count by
  stream count, repeat by repeat (``paired_rates``), so a slow spell of a shared machine falls on both
  sides of a ratio (two runs timed one side after the other saw llama.cpp's own f32 figure move by a
  third between runs).
The figure of n streams started together is bench_serving.aggregate's: tokens past each stream's first over
the span from the median first token to the last stream's end; the median of ``--repeats`` runs, not the
best (a client starved of CPU by the server it times reads a stream's tokens in one burst: one such run gave
llama-server 24,000 tokens/s); generate's is the best of two, as in bench_matrix. Ratios: stack / llama.cpp
at the matching precision (float32 / f32, int8 / q8_0, int4 / q4_0), and each of the six / generate; then min
and median over the shapes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_matrix import SHAPES, hf_generate, prepare, prompts_for  # noqa: E402
from bench.bench_serving import load_test  # noqa: E402
from bench.peers_llama import LlamaServer, gguf_files, llama_load_test, llama_tree  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from core.nats_server import EmbeddedNats  # noqa: E402
from core.quantization import method_of  # noqa: E402
from tests.processes import wait_until  # noqa: E402
from tests.serving_fixtures import Stack  # noqa: E402

# the stack's load (a label, the load request's quantization) beside the llama.cpp GGUF type it is matched to
PAIRS = (("f32", None, "f32"), ("int8", {"bits": 8}, "q8_0"), ("int4", {"method": "int4-fast"}, "q4_0"))


def settled(stack: Stack, name: str, load: dict) -> str:
    """Wait until the load's background compile (SWARM_SERVE_COMPILE=auto) is done; what serves since."""
    if not (load["stages"][0]["kernels"] or {}).get("compiled", {}).get("state", "").startswith("compiling"):
        return "not compiling"

    def state():
        stage = stack.get(f"/api/v1/models/{name}/status").json()["load"]["stages"][0]
        return not stage.get("compiled", "compiling").startswith("compiling") and stage["compiled"]
    done = wait_until(state, 900, "the background compile")
    print(json.dumps({"compiled": done}), flush=True)
    return done


def paired_rates(name: str, tmp: Path, tree: Path, files: dict[str, Path], prompts: dict[int, list[list[int]]],
                 tokens: int, repeats: int = 1, threads: int = 0) -> tuple[dict, dict, dict]:
    """({label: {streams: tokens/s}} of the stack, {gguf type: {streams: tokens/s}} of llama-server,
    {label: the method the load was placed at}): the stack serving the servable at tmp/servables/name, loaded
    at each of PAIRS' quantizations in turn, and beside each load llama-server on the matching GGUF file, the
    two timed in turn at every stream count of every repeat, so that a slower spell of the machine falls on
    both sides of a ratio; each figure the median of ``repeats``."""
    stack_out, llama_out, placed = {}, {}, {}
    with EmbeddedNats(tmp / name / "js") as nats:
        # SWARM_SERVE_QUANTIZED=auto and SWARM_SERVE_COMPILE=auto are the fellow's defaults (the test fixture
        # turns both off)
        env = {"SWARM_SERVE_THREADS": threads} if threads else {}
        stack = Stack(tmp / name, nats.url, tmp / "servables", SWARM_SERVE_QUANTIZED="auto",
                      SWARM_SERVE_COMPILE="auto", **env).start()
        try:
            for label, quantization, kind in PAIRS:
                body = {"wait": True, "timeout_s": 1800} | ({"quantization": quantization} if quantization else {})
                r = stack.post(f"/api/v1/models/{name}/load", body, timeout=1900)
                assert r.status_code == 200 and r.json()["state"] == "ready", r.text
                placed[label] = method_of(r.json()["quantization"])
                settled(stack, name, r.json())  # the default's decode step compiled in the background, where it does
                ours: dict[int, list[float]] = {b: [] for b in prompts}
                theirs: dict[int, list[float]] = {b: [] for b in prompts}
                with LlamaServer(tree, files[kind], tmp / name / f"llama-server-{kind}.log", threads or
                                 torch.get_num_threads(), max(prompts)) as server:
                    for _ in range(repeats):
                        for b, batch in prompts.items():
                            ours[b].append(asyncio.run(load_test(stack.url, name, b, tokens))["agg_tok_s"])
                            theirs[b].append(asyncio.run(llama_load_test(server.url, batch, tokens))["agg_tok_s"])
                stack_out[label] = {b: statistics.median(v) for b, v in ours.items()}
                llama_out[kind] = {b: statistics.median(v) for b, v in theirs.items()}
                print(json.dumps({"stack": label, "placed": placed[label],
                                  **{f"{b} streams tok/s": round(v, 1) for b, v in stack_out[label].items()},
                                  "llama.cpp": kind,
                                  **{f"llama {b} streams tok/s": round(v, 1) for b, v in llama_out[kind].items()}}),
                      flush=True)
                assert stack.post(f"/api/v1/models/{name}/unload").status_code == 200
                wait_until(lambda: stack.get(f"/api/v1/models/{name}").json()["load_state"] == "unloaded", 120,
                           "unloaded")
        finally:
            stack.stop()
    return stack_out, llama_out, placed


def run_shape(name: str, tmp: Path, tree: Path, tokens: int, streams: list[int], threads: int = 0,
              repeats: int = 1) -> dict:
    """Every figure of one shape; threads 0: each side's default (llama-server -t torch's count here)."""
    ckpt, tok, model = prepare(name, SHAPES[name], tmp)
    row = {"name": name, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
           "generate": {b: hf_generate(model, tok, b, tokens) for b in streams}}
    del model
    files = gguf_files(tree, ckpt, tmp / name / "gguf")
    row["stack"], row["llama"], row["placed"] = paired_rates(
        name, tmp, tree, files, {b: prompts_for(tok, b) for b in streams}, tokens, repeats, threads)
    return row


def ratios(r: dict, b: int) -> dict[str, float]:
    """Every ratio of one shape at b streams, by column name."""
    g = r["generate"][b]
    out = {f"stack {label} / llama.cpp {kind}": r["stack"][label][b] / r["llama"][kind][b] for label, _, kind in PAIRS}
    out |= {f"stack {label} / gen": r["stack"][label][b] / g for label, _, _ in PAIRS}
    out |= {f"llama.cpp {kind} / gen": r["llama"][kind][b] / g for _, _, kind in PAIRS}
    return out


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def rate_table(rows: list[dict], streams: list[int]) -> str:
    head = ["shape", "params", "streams", "generate"] + [f"stack {label}" for label, _, _ in PAIRS] + [
        f"llama.cpp {kind}" for _, _, kind in PAIRS]
    body = []
    for r in rows:
        for b in streams:
            stack = [f"{r['stack'][label][b]:.1f}" + ("" if r["placed"][label] == method_of(q) else
                                                      f" (as {r['placed'][label]})") for label, q, _ in PAIRS]
            body.append([r["name"], f"{r['params_m']:.0f}M", str(b), f"{r['generate'][b]:.1f}", *stack,
                         *(f"{r['llama'][kind][b]:.1f}" for _, _, kind in PAIRS)])
    return _table(head, body)


def ratio_table(rows: list[dict], streams: list[int]) -> str:
    """The ratios per shape and stream count, then their min and median over the shapes at each count."""
    names = list(ratios(rows[0], streams[0]))
    body = []
    for b in streams:
        per_shape = [ratios(r, b) for r in rows]
        body += [[r["name"], str(b), *(f"{x[n]:.2f}x" for n in names)] for r, x in zip(rows, per_shape)]
        for what, pick in (("min", min), ("median", statistics.median)):
            body.append([f"**{what}** ({len(rows)} shapes)", str(b),
                         *(f"**{pick(x[n] for x in per_shape):.2f}x**" for n in names)])
    return _table(["shape", "streams", *names], body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", default=None, help="llama.cpp source tree (default: SWARM_BENCH_LLAMA_CPP)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    ap.add_argument("--repeats", type=int, default=3, help="each stack and llama.cpp figure: the median of this many")
    ap.add_argument("--threads", type=int, default=0, help="0: the defaults (torch's own here and in the stage, "
                    "llama-server -t torch's count); N: N torch threads here, SWARM_SERVE_THREADS=N, llama-server -t N")
    args = ap.parse_args()
    tree = llama_tree(args.llama_cpp)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} torch threads, llama-server -t {torch.get_num_threads()}, "
          f"stage threads {args.threads or 'default'}, {args.tokens} new tokens per stream, "
          f"median of {args.repeats} runs", flush=True)
    tmp = scratch_dir("swarm-bench-peers-")
    rows = []
    for name in args.shapes:
        rows.append(run_shape(name, tmp, tree, args.tokens, args.streams, args.threads, args.repeats))
        print(json.dumps(rows[-1], default=str), flush=True)
    print()
    print(rate_table(rows, args.streams))
    print()
    print(ratio_table(rows, args.streams))


if __name__ == "__main__":
    main()
