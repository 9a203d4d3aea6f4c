"""The serving subprocess: one per loaded stage. Loads it, pulls requests from the bus when it has
room, and publishes token frames. Reports to its agent as JSON lines on stdout."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time

import msgspec
import torch
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from core.bus import close_quietly, connect, publish_event
from events import subjects
from events.requests import ChatRequest, RequestFailed, RequestFinished, request_failed_id, request_finished_id
from events.subjects import REQUESTS_STREAM, TOKENS_STREAM
from fellow.runtime.engine import Engine
from fellow.runtime.kv_budget import measured_kv_tokens
from fellow.runtime.sampling import SamplingParams
from fellow.runtime.serving_loop import Job, Output, ServingLoop
from fellow.runtime.stage_loader import load_one_stage
from fellow.token_batcher import TokenBatcher

log = logging.getLogger("swarm.serve")
# A request a stage fetched but neither acked nor refused (it died in between) goes to another
# replica after this long. Taking one (decode, tokenize, admit, start frame) is milliseconds.
ACK_WAIT_S = 10.0
_request = msgspec.json.Decoder(ChatRequest).decode


def report(**fields) -> None:
    """One JSON line to the agent."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class Metrics:
    def __init__(self) -> None:
        self.requests = 0
        self.last_ttft_s: float | None = None
        self.window: list[tuple[float, int]] = []  # (time, tokens) over the last 30 s

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        self.window.append((now, n))
        while self.window and now - self.window[0][0] > 30:
            self.window.pop(0)

    def tokens_per_s(self) -> float:
        if len(self.window) < 2:
            return 0.0
        span = self.window[-1][0] - self.window[0][0]
        return round(sum(n for _, n in self.window[1:]) / span, 3) if span > 0 else 0.0


class StageServer:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.load_id = cfg["load_id"]
        self.model_id = cfg["model_id"]
        self.fellow_id = cfg.get("fellow_id", "")
        self.replica = int(cfg.get("replica", 0))
        t = cfg.get("transport", {})
        self.max_in_flight = max(1, int(t.get("max_in_flight") or 8))
        self.max_batch = int(t.get("max_batch") or 0)
        self.prefill_chunk = int(t.get("prefill_chunk", 256))
        self.active: dict[str, tuple[TokenBatcher, int, float]] = {}  # rid -> (batcher, reserved, started)
        self.reserved = 0
        self.metrics = Metrics()
        self.room = asyncio.Event()
        self.running = True

    def load(self) -> None:
        started = time.perf_counter()
        self.loaded = load_one_stage(self.cfg["model_dir"], self.cfg.get("device"),
                                     packed=self.cfg.get("packed_linear", True))
        planned = int(self.cfg.get("transport", {}).get("kv_tokens") or 0)
        self.kv_tokens = measured_kv_tokens(self.loaded.stage, self.prefill_chunk or 256)
        if planned:
            self.kv_tokens = min(self.kv_tokens, planned)
        self.kv_planned = planned or self.kv_tokens
        self.engine = Engine(self.loaded.stage, kv_tokens=self.kv_tokens, max_batch=self.max_batch,
                             prefill_chunk=self.prefill_chunk)
        self._warm_up()
        self.load_s = time.perf_counter() - started

    def _warm_up(self) -> None:
        """One short generation, so the first real request pays no one-off start-up costs."""
        from fellow.runtime.session import Session

        self.engine.add(Session("warm-up", [1, 2, 3, 4], 2, sampling=SamplingParams(temperature=0)))
        while self.engine.busy:
            self.engine.step()

    def vram_bytes(self) -> int:
        dev = self.loaded.device
        if dev.type == "cuda":
            return int(torch.cuda.memory_allocated(dev))
        params = sum(p.numel() * p.element_size() for layer in self.loaded.stage.layers for p in layer.parameters())
        return params + int(self.engine.stats()["kv_bytes"])

    def serve(self) -> None:
        """Steps the engine on this, the main, thread and runs the bus on an event loop in another.

        Torch's CPU kernels ran a batch-8 decode about 25 % slower called from a second thread than
        from the main one (bench/bench_serving.py's model, 2 cores), so compute keeps the main thread.
        """
        self.serving = self.make_loop(lambda outs: self.aloop.call_soon_threadsafe(self._deliver, outs))
        self.aloop = asyncio.new_event_loop()
        bus = threading.Thread(target=self._bus, name="bus", daemon=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.aloop.call_soon_threadsafe(self._stop))
        bus.start()
        self.serving.run_here()  # until _shutdown stops it
        bus.join(30)

    def _bus(self) -> None:
        try:
            self.aloop.run_until_complete(self.run())
        except Exception:
            log.exception("the stage's bus loop failed")
        finally:
            self.serving.stop()

    async def run(self) -> None:
        self.nc = await connect(self.cfg["nats_url"], name=f"swarm-stage-{self.load_id}")
        self.js = self.nc.jetstream()
        await self.nc.subscribe(subjects.cancels_of(self.load_id), cb=self._on_cancel)
        await self.before_ready()
        report(event="ready", kv_tokens=self.kv_tokens, kv_tokens_planned=self.kv_planned,
               max_in_flight=self.max_in_flight, vram_bytes=self.vram_bytes(), load_s=round(self.load_s, 3),
               pid=os.getpid())
        reporter = asyncio.create_task(self._report_metrics())
        try:
            await self._intake()
        finally:
            reporter.cancel()
            await self._shutdown()

    def make_loop(self, deliver) -> ServingLoop:
        """The thread that drives the engine (a ring's stage 0 brings its own)."""
        return ServingLoop(self.engine, self.loaded.tokenizer, self.loaded.stop_ids, deliver)

    async def before_ready(self) -> None:
        """Connected, not yet ready: a ring's stage 0 proves its ring here."""

    def _stop(self) -> None:
        self.running = False
        self.room.set()

    async def _on_cancel(self, msg) -> None:
        rid = msg.subject.rsplit(".", 1)[1]
        if rid in self.active:
            self.serving.cancel(rid)

    async def _intake(self) -> None:
        durable = subjects.request_consumer(self.load_id)
        sub = await self.js.pull_subscribe(
            subjects.request(self.load_id), durable=durable, stream=REQUESTS_STREAM,
            config=ConsumerConfig(durable_name=durable, deliver_policy=DeliverPolicy.ALL,
                                  ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S, inactive_threshold=3600.0))
        while self.running:
            if len(self.active) >= self.max_in_flight or self.reserved >= self.kv_tokens:
                self.room.clear()
                await self.room.wait()
                continue
            try:
                msgs = await sub.fetch(1, timeout=1.0)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            for msg in msgs:
                await self._take(msg)

    async def _take(self, msg) -> None:
        try:
            req = _request(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("dropped a malformed request: %s", exc)
            await msg.ack()
            return
        if req.request_id in self.active:  # a redelivery of what we already serve
            await msg.ack()
            return
        if msg.metadata.num_delivered > 1 and await self._started_elsewhere(req.request_id):
            # A replica took it, said so, and died before acking: the gateway fails it (never both).
            log.warning("request %s was started by another replica; not serving it again", req.request_id)
            await msg.ack()
            return
        try:
            prompt_ids = self._tokenize(req)
        except Exception as exc:
            await msg.ack()
            await self._refuse(req, 0, f"the prompt could not be tokenized: {exc}", "invalid_prompt")
            return
        max_tokens = req.max_tokens
        if req.max_tokens_fit and len(prompt_ids) < self.kv_tokens:
            max_tokens = min(max_tokens, self.kv_tokens - len(prompt_ids))
        needed = len(prompt_ids) + max_tokens
        if needed > self.kv_tokens:
            await msg.ack()
            from fellow.runtime.admission import ContextTooLong

            err = ContextTooLong(len(prompt_ids), max_tokens, self.kv_tokens)
            await self._refuse(req, len(prompt_ids), str(err), err.code, err.data)
            return
        if needed > self.kv_tokens - self.reserved and self.active:
            # Not now: back to the bus for another replica, and we wait until a session ends.
            await msg.nak(delay=0.05)
            self.room.clear()
            await self.room.wait()
            return
        batcher = TokenBatcher(self.js, req.request_id)
        if not await batcher.start(self.fellow_id, self.replica):  # from here on, a death of this fellow fails it
            log.warning("request %s was started by another replica; not serving it again", req.request_id)
            await msg.ack()
            return
        self.active[req.request_id] = (batcher, needed, time.monotonic())
        self.reserved += needed
        self.metrics.requests += 1
        s = req.sampling
        self.serving.submit(Job(req.request_id, prompt_ids, max_tokens,
                                SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                               min_p=s.min_p, seed=s.seed), list(req.stop)))
        await msg.ack()

    async def _started_elsewhere(self, request_id: str) -> bool:
        """Whether SWARM_TOKENS holds a frame of this request already (a start frame at least)."""
        try:
            await self.js.get_last_msg(TOKENS_STREAM, subjects.tokens(request_id))
        except NotFoundError:
            return False
        return True

    def _tokenize(self, req: ChatRequest) -> list[int]:
        kwargs = {} if req.enable_thinking is None else {"enable_thinking": req.enable_thinking}
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        ids = self.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    async def _refuse(self, req: ChatRequest, prompt_tokens: int, message: str, code: str,
                      data: dict | None = None) -> None:
        batcher = TokenBatcher(self.js, req.request_id)
        batcher.error(message, code, data)
        await batcher.closed.wait()
        await publish_event(self.js, RequestFailed(id=request_failed_id(req.request_id), request_id=req.request_id,
                                                   model_id=self.model_id, load_id=self.load_id, code=code,
                                                   message=message, prompt_tokens=prompt_tokens,
                                                   fellow_id=self.fellow_id))

    def _deliver(self, outputs: list[Output]) -> None:
        for out in outputs:
            entry = self.active.get(out.request_id)
            if entry is None:
                continue
            batcher = entry[0]
            if out.ids:
                self.metrics.tokens(len(out.ids))
            if out.texts or out.ids:
                batcher.add(out.texts, out.ids)
            if out.error is not None:
                code = getattr(out.error, "code", "internal_error")
                batcher.error(str(out.error), code, getattr(out.error, "data", None))
                self._end(out, failed=True)
            elif out.finish_reason is not None:
                out.timing = {"route": "local", "stage0_ms": out.timing.get("decode_ms"), **out.timing}
                batcher.done(out.completion_tokens, out.prompt_tokens, out.finish_reason, out.timing)
                self._end(out, failed=False)

    def _end(self, out: Output, failed: bool) -> None:
        batcher, reserved, started = self.active.pop(out.request_id)
        self.reserved -= reserved
        self.room.set()
        if not failed and "ttft_ms" in out.timing:
            self.metrics.last_ttft_s = out.timing["ttft_ms"] / 1e3
        asyncio.create_task(self._record(out, failed, time.monotonic() - started))

    async def _record(self, out: Output, failed: bool, duration: float) -> None:
        try:
            if failed:
                evt = RequestFailed(id=request_failed_id(out.request_id), request_id=out.request_id, model_id=self.model_id,
                                    load_id=self.load_id, code=getattr(out.error, "code", "internal_error"),
                                    message=str(out.error), prompt_tokens=out.prompt_tokens,
                                    completion_tokens=out.completion_tokens, fellow_id=self.fellow_id)
            else:
                t = out.timing
                evt = RequestFinished(id=request_finished_id(out.request_id), request_id=out.request_id, model_id=self.model_id,
                                      load_id=self.load_id, prompt_tokens=out.prompt_tokens,
                                      completion_tokens=out.completion_tokens, finish_reason=out.finish_reason,
                                      ttft_s=t["ttft_ms"] / 1e3 if "ttft_ms" in t else None,
                                      duration_s=round(duration, 6), tokens_per_s=t.get("tokens_per_s", 0.0),
                                      timing=t, fellow_id=self.fellow_id)
            await publish_event(self.js, evt)
        except Exception:
            log.exception("request event for %s not published", out.request_id)

    async def _report_metrics(self) -> None:
        interval = float(self.cfg.get("report_s", 1.0))
        while True:
            await asyncio.sleep(interval)
            stats = self.engine.stats()
            idle = 0.0 if self.active else time.monotonic() - self.serving.last_active
            report(event="metrics", tokens_per_s=self.metrics.tokens_per_s(), last_ttft_s=self.metrics.last_ttft_s,
                   requests=self.metrics.requests, idle_s=round(idle, 3), vram_bytes=self.vram_bytes(),
                   in_flight=len(self.active), waiting=stats["waiting"], kv_tokens=self.kv_tokens,
                   reserved_tokens=stats["reserved_tokens"], cached_tokens=stats["cached_tokens"])

    async def _shutdown(self) -> None:
        for rid, (batcher, _, _) in list(self.active.items()):
            self.serving.cancel(rid)
            batcher.error("the model was unloaded while this request was served", "model_unloaded")
        for batcher, _, _ in list(self.active.values()):
            try:
                await asyncio.wait_for(batcher.closed.wait(), 5)
            except asyncio.TimeoutError:
                pass
        self.serving.stop()
        await close_quietly(self.nc)


def main() -> int:
    cfg = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [stage{cfg.get('stage', 0)} {cfg['load_id']}] %(message)s")
    torch.set_num_threads(int(cfg.get("threads") or torch.get_num_threads()))
    if int(cfg.get("num_stages") or 1) > 1:
        from fellow.runtime.ring.servers import ring_server

        server = ring_server(cfg)
    else:
        server = StageServer(cfg)
    try:
        server.load()
    except Exception as exc:
        log.exception("load failed")
        report(event="failed", reason=f"{type(exc).__name__}: {exc}")
        return 1
    if isinstance(server, StageServer):
        server.serve()
    else:  # a later ring stage: its worker thread computes, the event loop keeps the main thread
        asyncio.run(server.run())
    return 0


if __name__ == "__main__":
    # Run as `python -m`, this file is __main__; the ring servers import `fellow.runtime.serve`.
    # Take main from that module so there is one StageServer class, not two.
    from fellow.runtime.serve import main as _main

    sys.exit(_main())
