"""llama.cpp's side of bench/bench_peers.py: a checkpoint converted to GGUF (float32, then q8_0 and q4_0 by
llama-quantize), `llama-server` started on one, and streams timed against its `/completion` endpoint as
bench/bench_serving.py times the stack's (the same figures, bench_serving.aggregate).

The llama.cpp tree (``--llama-cpp DIR`` or SWARM_BENCH_LLAMA_CPP) is a source tree with a built
build/bin/llama-server and build/bin/llama-quantize, its convert_hf_to_gguf.py and gguf-py/. The converter
needs sentencepiece importable; it names a BPE tokenizer's pre-tokenizer by a hash of how it splits a test
text, and refuses one it does not know (the project's tiny chat tokenizer): the conversion here answers
"qwen2" for it instead (Qwen's split pattern, which the tiny tokenizer's follows). Decode speed does not
depend on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.bench_serving import aggregate
from tests.processes import free_port, wait_until

GGUF_TYPES = ("f32", "q8_0", "q4_0")
PRE_TOKENIZER = "qwen2"
# run in a fresh interpreter: the converter's own modules, with the pre-tokenizer's guess fixed
_CONVERT = """
import runpy, sys
tree = sys.argv.pop(1)
sys.path[:0] = [tree, tree + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_tree(given: str | None) -> Path:
    tree = Path(given or os.environ.get("SWARM_BENCH_LLAMA_CPP", "")).expanduser()
    needed = ["build/bin/llama-server", "build/bin/llama-quantize", "convert_hf_to_gguf.py", "gguf-py"]
    missing = [n for n in needed if not (tree / n).exists()] if str(tree) not in ("", ".") else needed
    if missing:
        raise SystemExit(f"no llama.cpp tree at {str(tree)!r} (--llama-cpp DIR or SWARM_BENCH_LLAMA_CPP): "
                         f"missing {', '.join(missing)}")
    return tree


def gguf_files(tree: Path, ckpt: Path, out: Path) -> dict[str, Path]:
    """The checkpoint as GGUF, one file per type of GGUF_TYPES, made once per folder (`out` caches them)."""
    out.mkdir(parents=True, exist_ok=True)
    files = {kind: out / f"model-{kind}.gguf" for kind in GGUF_TYPES}
    if not files["f32"].exists():
        _quiet([sys.executable, "-c", _CONVERT.format(pre=PRE_TOKENIZER), str(tree), str(ckpt),
                "--outtype", "f32", "--outfile", str(files["f32"])], "convert_hf_to_gguf.py")
    for kind in GGUF_TYPES[1:]:
        if not files[kind].exists():
            _quiet([str(tree / "build/bin/llama-quantize"), str(files["f32"]), str(files[kind]), kind],
                   "llama-quantize")
    return files


def _quiet(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


class LlamaServer:
    """`llama-server -m X.gguf -t THREADS -np SLOTS -cb --no-repack` (its AMX repacking crashed on the
    machine this was written on) on a free port, until stopped."""

    def __init__(self, tree: Path, gguf: Path, log: Path, threads: int = 2, slots: int = 8):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(tree / "build/bin/llama-server"), "-m", str(gguf), "-t", str(threads), "-np", str(slots),
                    "-cb", "--no-repack", "--port", str(self.port)]
        self.log = log

    def __enter__(self) -> "LlamaServer":
        self._log = self.log.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            return httpx.get(self.url + "/health", timeout=2).status_code == 200

        wait_until(healthy, 300, "llama-server healthy", interval=0.2)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


async def llama_stream(client: httpx.AsyncClient, url: str, prompt: list[int], tokens: int) -> dict:
    """One streamed greedy completion of `tokens` tokens (end of text ignored), timed as stream_one times
    the stack's: seconds to the first token, tokens, seconds from the first token to the last, end."""
    body = {"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    n = None
    async with client.stream("POST", url + "/completion", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("timings"):
                n = data["timings"].get("predicted_n")
            if data.get("stop"):
                continue
            chunks += 1
            now = time.perf_counter()
            first = first or now
            last = now
    return {"ttft": (first or t0) - t0, "tokens": n or chunks, "decode_s": (last or t0) - (first or t0),
            "end": time.perf_counter()}


async def llama_load_test(url: str, prompts: list[list[int]], tokens: int) -> dict:
    """len(prompts) streams at once, after an 8-token warm-up: bench_serving.aggregate's figures."""
    # a fresh connection a request: llama-server closed kept-alive ones that the client then reused
    # ("Server disconnected without sending a response")
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=fresh) as client:
        await llama_stream(client, url, prompts[-1][:4], 8)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(llama_stream(client, url, p, tokens) for p in prompts))
    for r in results:
        assert r["tokens"] == tokens, f"llama-server decoded {r['tokens']} tokens, not {tokens}"
    return aggregate(results, t0)
