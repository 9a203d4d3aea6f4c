"""A real serving stack for tests: tiny servables, nats-server, leader and fellow processes."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from pathlib import Path

import httpx
import msgspec

from events.frames import DoneFrame, ErrorFrame, TokenFrame, frame_decoder
from events.requests import ChatMessage, ChatRequest, Sampling
from tests.processes import SwarmProcess, swarm_env, wait_until


def hf_greedy(hf_dir, content: str, max_new_tokens: int) -> list[int]:
    """Hugging Face `generate`'s greedy reply to one user message, without its end-of-turn id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos),
                         pad_token_id=tok.pad_token_id)
    return [t for t in out[0, ids.shape[1]:].tolist() if t not in eos]


def stream_a_reply(base_url: str, model: str = "tiny", timeout: float = 120) -> list[dict]:
    """Stream a short greedy reply from /v1/chat/completions; assert it ends with a finish reason and
    `[DONE]`, no error on the way; its chunks."""
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=timeout) as s:
        lines = [line for line in s.iter_lines() if line]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and not any("error" in c for c in chunks), lines
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks[-1]
    return chunks


def make_servable(root: Path, model_id: str = "tiny", family: str = "qwen3", layers: int = 4, hidden: int = 64,
                  stages: int = 2, seed: int = 0, chat_template: str | None = None) -> tuple[Path, Path]:
    """(hf checkpoint dir, servable dir) of a random tiny model with a chat tokenizer (its template
    Qwen3's, or ``chat_template``)."""
    from fellow.runtime.tools.export import export
    from tests.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(root / f"hf-{model_id}", family=family, layers=layers, hidden=hidden, seed=seed)
    if chat_template is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(hf))
        tok.chat_template = chat_template
        tok.save_pretrained(str(hf))
    out = root / "servables" / model_id
    export(hf, out, stages=stages, model_id=model_id)
    return hf, out


def one_model_stack(root: Path, model_id: str = "tiny", env: dict | None = None, **model):
    """A generator for a module fixture: (Stack, hf dir, nats url) with ``model_id`` made and loaded on one
    fellow; ``env`` adds settings."""
    hf, servable = make_servable(root / "models", model_id, **model)
    for stack in stack_serving(root, servable.parent, model_id, env=env):
        yield stack, hf, stack.env["SWARM_NATS_URL"]


def stack_serving(root: Path, servables: Path, *model_ids: str, env: dict | None = None, fellows: int = 1, **load):
    """A generator for a module fixture: a Stack of ``fellows`` on its own nats-server serving the servables
    folder ``servables``, with each of ``model_ids`` loaded (``load``: the load requests' fields)."""
    from core.nats_server import EmbeddedNats

    nats = EmbeddedNats(root / "jetstream").start()
    stack = Stack(root, nats.url, servables, fellows=fellows, **(env or {}))
    try:
        stack.start()
        for model_id in model_ids:
            stack.load(model_id, **load)
        yield stack
    finally:
        stack.stop()
        nats.stop()


def secured_processes(root: Path, auth, nats_url: str, servables: Path, fellow_ids: list[str],
                      manages_nats: bool = False, **settings):
    """(leader, fellows) as real processes, each logged in to NATS as its own user (core.nats_auth `auth`),
    started, healthy and online; stop them with `stop_all`. `manages_nats`: the leader keeps the request
    grants of that server (SWARM_NATS_AUTH_DIR; its nats-server writes its pid to `auth.pid_file`).
    ``settings``: more SWARM_* variables for every process."""
    from core.nats_auth import LEADER_USER, fellow_user

    db = f"sqlite+aiosqlite:///{root / 'swarm.db'}"
    port = None

    def env(user: str, **extra) -> dict:
        return swarm_env(root, nats_url, db, port=port, SWARM_SERVABLE_MODELS_ROOT=servables, OMP_NUM_THREADS=1,
                         **auth.credentials(user).env(), **settings, **extra)

    leader = SwarmProcess(["leader"], env(LEADER_USER, **({"SWARM_NATS_AUTH_DIR": auth.path} if manages_nats else {})),
                          root / "leader.log")
    port = leader.env["SWARM_LEADER_PORT"]
    fellows = [SwarmProcess(["fellow", "--id", f], env(fellow_user(f)), root / f"{f}.log") for f in fellow_ids]
    try:
        for p in (leader, *fellows):
            p.start()
        leader.wait_healthy()
        wait_until(lambda: sum(f["status"] == "online" for f in leader.get("/api/v1/fellows").json()["data"])
                   == len(fellows), 60, "every fellow online")
    except BaseException:
        stop_all(leader, fellows)
        raise
    return leader, fellows


def stop_all(leader: SwarmProcess, fellows: list[SwarmProcess]) -> None:
    for p in (*fellows, leader):
        p.stop()


async def responses_stream(client, delta_type: str, **request) -> tuple[list[str], list[str], object]:
    """A streamed Responses reply read through the SDK: (its event types, the deltas of events of
    ``delta_type``, the final response)."""
    kinds, deltas, final = [], [], None
    async with await client.responses.create(stream=True, **request) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == delta_type:
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    return kinds, deltas, final


class Stack:
    """nats-server (from the fixture) + one leader + fellows, as real processes."""

    def __init__(self, tmp_path: Path, nats_url: str, servables: Path, fellows: int = 1, **env):
        self.tmp = tmp_path
        # a fellow probes its quantized kernels before it is online (seconds of torch start-up each): a stack
        # that serves no quantized load skips that; the quantized tests ask for it
        env.setdefault("SWARM_SERVE_QUANTIZED", "off")
        self.env = swarm_env(tmp_path, nats_url, f"sqlite+aiosqlite:///{tmp_path / 'swarm.db'}",
                             SWARM_SERVABLE_MODELS_ROOT=str(servables), **env)
        self.leader = SwarmProcess(["leader"], self.env, tmp_path / "leader.log")
        self.fellows = [SwarmProcess(["fellow", "--id", f"f{i}"], self.env, tmp_path / f"fellow{i}.log")
                        for i in range(fellows)]

    def start(self) -> "Stack":
        self.leader.start()
        for f in self.fellows:
            f.start()
        self.leader.wait_healthy()
        wait_until(lambda: sum(f["status"] == "online" for f in self.get("/api/v1/fellows").json()["data"])
                   == len(self.fellows), 60, "fellows online")
        return self

    @property
    def url(self) -> str:
        return self.leader.base_url

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)

    def post(self, path: str, body: dict | None = None, timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + path, json=body or {}, timeout=timeout)

    def load(self, model_id: str, **body) -> dict:
        r = self.post(f"/api/v1/models/{model_id}/load", {"wait": True, **body})
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "ready", (r.json(), self.logs())
        return r.json()

    def sql(self, query: str, *params) -> list[tuple]:
        """Rows of the leader's SQLite projections."""
        db = sqlite3.connect(self.tmp / "swarm.db")
        try:
            return db.execute(query, params).fetchall()
        finally:
            db.close()

    def logs(self) -> str:
        out = [f"--- leader\n{self.leader.tail()}"]
        out += [f"--- {f.args}\n{f.tail()}" for f in self.fellows]
        for p in sorted((self.tmp / "data" / "logs").glob("*.log")) if (self.tmp / "data" / "logs").exists() else []:
            out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for f in self.fellows:
            f.stop()
        self.leader.stop()


async def chat_over_bus(nc, js, load_id: str, model_id: str, content: str, max_tokens: int = 20,
                        temperature: float = 0.0, seed: int | None = None, stop: list[str] | None = None,
                        request_id: str | None = None, timeout: float = 120):
    """Publish a ChatRequest on the bus and collect its frames (what the gateway does)."""
    rid = request_id or "rq-" + uuid.uuid4().hex[:12]
    frames: list = []
    finished = asyncio.Event()

    async def on_frame(msg):
        frame = frame_decoder.decode(msg.data)
        frames.append(frame)
        if isinstance(frame, (DoneFrame, ErrorFrame)):
            finished.set()

    sub = await nc.subscribe(f"swarm.tok.{rid}", cb=on_frame)
    req = ChatRequest(request_id=rid, load_id=load_id, model_id=model_id,
                      messages=[ChatMessage(role="user", content=content)], max_tokens=max_tokens,
                      sampling=Sampling(temperature=temperature, seed=seed), stop=stop or [], created=time.time())
    await js.publish(f"swarm.req.{load_id}", msgspec.json.encode(req), headers={"Nats-Msg-Id": rid})
    await asyncio.wait_for(finished.wait(), timeout)
    await sub.unsubscribe()
    frames.sort(key=lambda f: f.seq)
    tokens = [t for f in frames if isinstance(f, TokenFrame) for t in f.token_ids]
    text = "".join(f.text for f in frames if isinstance(f, TokenFrame))
    return rid, frames, tokens, text
