"""`swarm models | model-load | infer | model-unload | export | demo-model`."""

from __future__ import annotations

import json
import sys
import threading
import time

from core.cli_errors import CliError, part
from core.cli_tokens import call_leader
from core.settings import Settings


def _size(n: int) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if n < 1000:
            return f"{n:.0f}{unit}"
        n /= 1000
    return f"{n:.0f}P"


def cmd_models(args) -> int:
    models = call_leader(Settings.from_env(), "GET", "/api/v1/models")["data"]
    rows = [("ID", "STATE", "PARAMS", "STAGES", "NOTE")]
    for m in models:
        note = m.get("reason") or "" if not m["available"] else (m.get("quantization") or {}).get("method", "")
        rows.append((m["id"], m["load_state"] if m["available"] else "unavailable",
                     _size(m["parameters"]) if m["available"] else "-", str(m["num_stages"]), note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _spinner(stop: threading.Event, label: str) -> None:
    frames, i, started = "|/-\\", 0, time.monotonic()
    tty = sys.stderr.isatty()
    while not stop.wait(0.2):
        if tty:
            sys.stderr.write(f"\r{frames[i % 4]} {label} {time.monotonic() - started:5.1f}s")
            sys.stderr.flush()
            i += 1
    if tty:
        sys.stderr.write("\r" + " " * (len(label) + 12) + "\r")


def cmd_model_load(args) -> int:
    body: dict = {"wait": args.wait}
    if args.num_stages is not None:
        body["num_stages"] = args.num_stages
    if args.fellow_id:
        body["fellow_id"] = args.fellow_id
    if args.replicas != 1:
        body["replicas"] = args.replicas
    if args.speculative is not None:
        body["speculative"] = args.speculative
    if args.quantization:
        q = args.quantization
        body["quantization"] = {"bits": int(q)} if q.isdigit() else {"method": q}
    stop = threading.Event()
    spin = threading.Thread(target=_spinner, args=(stop, f"loading {args.model_id}"), daemon=True)
    if args.wait:
        spin.start()
    try:
        load = call_leader(Settings.from_env(), "POST", f"/api/v1/models/{args.model_id}/load", body,
                           timeout=args.timeout + 30)
    finally:
        stop.set()
    if load["state"] == "failed":
        raise CliError(f"loading {args.model_id} failed: {load.get('reason')}")
    stages = ", ".join((f"replica {s['replica']}, " if load.get("replicas", 1) > 1 else "")
                       + f"stage {s['stage']} on {s['fellow_id']} (kv {s['kv_tokens']} tokens{_weights(s)})"
                       for s in load["stages"])
    print(f"{args.model_id}: {load['state']} as {load['load_id']}" + (f" — {stages}" if stages else ""))
    for note in (load.get("quantization_reason"), load.get("reason")):  # placement's choices, when it made any
        if note:
            print(f"note: {note}")
    return 0


def _weights(stage: dict) -> str:
    """", int8 weights 5MB measured (5MB estimated)": what a stage serves beside placement's estimate."""
    w = stage.get("weights") or {}
    if "bytes" not in w:
        return ""
    quantization = w.get("quantization") or "none"
    kind = "" if quantization == "none" else quantization + " "
    said = f", {kind}weights {_size(w['bytes'])}B measured ({_size(w.get('estimate_bytes', 0))}B estimated)"
    return said + (f"; {w['reason']}" if w.get("reason") else "")


def cmd_model_unload(args) -> int:
    load = call_leader(Settings.from_env(), "POST", f"/api/v1/models/{args.model_id}/unload")
    print(f"{args.model_id}: unloading {load['load_id']}")
    return 0


def cmd_infer(args) -> int:
    import httpx

    s = Settings.from_env()
    body = {"model": args.model_id, "messages": [{"role": "user", "content": args.prompt}], "stream": True,
            "stream_options": {"include_usage": True}}
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.no_think:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    headers = {"Authorization": f"Bearer {s.leader.api_token}"} if s.leader.api_token else {}
    usage = None
    try:
        with httpx.stream("POST", s.leader.url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=httpx.Timeout(30.0, read=900.0)) as resp:
            if resp.status_code >= 400:
                resp.read()
                try:
                    message = resp.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = resp.text[:200]
                raise CliError(f"leader answered {resp.status_code}: {message}")
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise CliError(f"the reply failed: {chunk['error'].get('message')}")
                for choice in chunk.get("choices", []):
                    sys.stdout.write(choice.get("delta", {}).get("content") or "")
                    sys.stdout.flush()
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the leader at {s.leader.url}: {exc or type(exc).__name__}") from None
    sys.stdout.write("\n")
    if usage and args.verbose_usage:
        print(f"[{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens]", file=sys.stderr)
    return 0


def cmd_export(args) -> int:
    boundaries = json.loads(args.boundaries) if args.boundaries else None
    m = part("export")(args.hf_dir, args.out, stages=args.stages, boundaries=boundaries, bottleneck=args.bottleneck,
               adapters=args.adapters, model_id=args.model_id)
    print(f"exported {m.model_id} to {args.out}: {m.num_stages} stage(s), boundaries {m.boundaries}")
    return 0


class ProgressBar:
    """A one-line bar on stderr: `[#####.....] 130/260 loss 3.21 ~60s left`."""

    def __init__(self, label: str, width: int = 30):
        self.label, self.width, self.started = label, width, time.monotonic()

    def __call__(self, step: int, steps: int, loss: float) -> None:
        done = step / max(steps, 1)
        elapsed = time.monotonic() - self.started
        left = elapsed / done - elapsed if done > 0 else 0
        bar = "#" * int(done * self.width)
        end = "\n" if step >= steps else ""
        sys.stderr.write(f"\r{self.label} [{bar:<{self.width}}] {step}/{steps} loss {loss:.2f} ~{left:.0f}s left{end}")
        sys.stderr.flush()


def cmd_demo_model(args) -> int:
    make, what = (part("demo-draft"), "demo draft model") if args.draft else (part("demo-model"), "demo model")
    m = make(args.out, seed=args.seed, progress=ProgressBar(f"training the {what}"),
             **({"steps": args.steps} if args.steps else {}))
    print(f"{what} {m.model_id} written to {args.out}")
    return 0


def add_commands(sub) -> None:
    sub.add_parser("models", help="list servable models").set_defaults(func=cmd_models)

    load = sub.add_parser("model-load", help="load a model onto fellows")
    load.add_argument("model_id", help="a servable's model_id (see `swarm models`)")
    load.add_argument("--wait", action="store_true", help="wait until it is ready")
    load.add_argument("--num-stages", type=int, default=None, help="stages of a ring (default: the servable's)")
    load.add_argument("--fellow-id", default=None,
                      help="the fellow to place a one-stage load on (default: placement picks)")
    load.add_argument("--replicas", type=int, default=1,
                      help="copies sharing the requests: one stage each, or rings of --num-stages")
    load.add_argument("--speculative", type=int, default=None, metavar="K",
                      help="tokens drafted per decode pass by prompt lookup, 0 (off) to 8; one stage or a ring")
    load.add_argument("--quantization", default=None,
                      help="none, nf4, 8 (int8) or int4-fast; default: the servable's own (its manifest's)")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits (default 600)")
    load.set_defaults(func=cmd_model_load)

    unload = sub.add_parser("model-unload", help="unload a model and free its memory")
    unload.add_argument("model_id", help="the model to unload")
    unload.set_defaults(func=cmd_model_unload)

    infer = sub.add_parser("infer", help="one-shot chat completion, streamed to the terminal")
    infer.add_argument("model_id", help="a loaded (or autoloadable) model")
    infer.add_argument("prompt", help="the user message")
    infer.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate (default: the leader's)")
    infer.add_argument("--temperature", type=float, default=None,
                       help="0 is greedy (default: the model's generation config)")
    infer.add_argument("--no-think", action="store_true", help="turn a Qwen3 model's reasoning off")
    infer.add_argument("--usage", dest="verbose_usage", action="store_true", help="print token counts")
    infer.set_defaults(func=cmd_infer)

    ex = sub.add_parser("export", help="turn a local Hugging Face checkpoint into a servable")
    ex.add_argument("hf_dir", help="a local Hugging Face checkpoint folder")
    ex.add_argument("out", help="the servable folder to write")
    ex.add_argument("--stages", type=int, default=1, help="stages to split the layers into (default 1)")
    ex.add_argument("--boundaries", default=None, help='JSON, e.g. "[[0,2],[2,4]]"')
    ex.add_argument("--bottleneck", type=int, default=None, help="fit a linear bottleneck of this width")
    ex.add_argument("--adapters", default=None, help="a PEFT adapter folder (export adapters only)")
    ex.add_argument("--model-id", default=None, help="the id clients ask for (default: the folder's name)")
    ex.set_defaults(func=cmd_export)

    demo = sub.add_parser("demo-model", help="train and export the small demo model")
    demo.add_argument("out", help="the servable folder to write")
    demo.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    demo.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's)")
    demo.add_argument("--draft", action="store_true",
                      help="train the demo model's small draft model instead (for SWARM_SERVE_DRAFT_MODEL)")
    demo.set_defaults(func=cmd_demo_model)
