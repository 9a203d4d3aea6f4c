"""A ring's stage processes: stage 0 serves requests like a one-stage load; later stages run frames."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import torch

from core.bus import close_quietly, connect
from events import subjects
from events.base import decode_event
from events.loads import LoadFailed
from fellow.runtime.kv_budget import measured_kv_tokens
from fellow.runtime.ring.head import WAKE, RingHead
from fellow.runtime.ring.inbox import Inbox
from fellow.runtime.ring.link import RingLink
from fellow.runtime.ring.loader import RingStage, load_ring_stage
from fellow.runtime.ring.worker import RingWorker
from fellow.runtime.serve import StageServer, report
from fellow.runtime.serving_loop import ServingLoop

log = logging.getLogger("swarm.ring")

PROBE_TIMEOUT_S = 600.0  # the later stages may still be loading (or fetching their shards)


def ring_server(cfg: dict):
    """The server for this stage of a ring (cfg has ``stage`` and ``num_stages``)."""
    return RingHeadServer(cfg) if int(cfg.get("stage") or 0) == 0 else RingStageServer(cfg)


def _kv_tokens(ring: RingStage, cfg: dict, prefill_chunk: int) -> tuple[int, int]:
    """(measured, planned): what this stage holds, never more than the leader planned."""
    planned = int(cfg.get("transport", {}).get("kv_tokens") or 0)
    measured = measured_kv_tokens(ring.stage, prefill_chunk or 256)
    return (min(measured, planned) if planned else measured), (planned or measured)


@torch.inference_mode()
def _warm_up(ring: RingStage) -> None:
    """One piece and one decode position locally, so the first request pays no one-off costs."""
    stage = ring.stage
    cache = stage.new_cache()
    if stage.is_first:
        stage.forward_piece(cache, torch.tensor([1, 2, 3, 4], device=stage.input_device))
        stage.decode([cache], torch.tensor([5], device=stage.input_device))
    else:
        hidden = torch.zeros(1, 4, ring.manifest.hidden_size, dtype=stage.dtype, device=stage.input_device)
        stage.forward_piece(cache, hidden)
        stage.decode([cache], hidden[:, :1])
    cache.release()


class RingServingLoop(ServingLoop):
    """The one-stage serving loop over a RingHead: new jobs wake it, and ring failures become errors."""

    def submit(self, job) -> None:
        super().submit(job)
        self.engine.inbox.put(WAKE)

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        super().cancel(request_id, reason)
        self.engine.inbox.put(WAKE)

    def stop(self) -> None:
        super().stop()
        self.engine.inbox.put(WAKE)

    def _step(self):
        outputs = super()._step()
        for out in outputs:
            error = self.engine.failures.pop(out.request_id, None)
            if error is not None:
                out.error = error
        return outputs


class RingHeadServer(StageServer):
    """Stage 0: pulls requests by KV room, tokenizes, runs its blocks, and streams the frames."""

    def load(self) -> None:
        started = time.perf_counter()
        self.num_stages = int(self.cfg["num_stages"])
        self.ring = self.loaded = load_ring_stage(self.cfg["model_dir"], 0, self.num_stages, self.cfg.get("device"),
                                                   packed=self.cfg.get("packed_linear", True))
        self.kv_tokens, self.kv_planned = _kv_tokens(self.ring, self.cfg, self.prefill_chunk)
        self.inbox = Inbox()
        self.engine = RingHead(self.ring.stage, self.ring.sender, lambda frame: self.link.send(frame), self.inbox,
                               num_stages=self.num_stages, kv_tokens=self.kv_tokens, max_batch=self.max_batch,
                               prefill_chunk=self.prefill_chunk)
        _warm_up(self.ring)
        self.load_s = time.perf_counter() - started

    def make_loop(self, deliver) -> ServingLoop:
        return RingServingLoop(self.engine, self.ring.tokenizer, self.ring.stop_ids, deliver)

    async def before_ready(self) -> None:
        self.link = RingLink(self.nc, self.load_id, 0, self.num_stages, self.inbox)
        await self.link.start()
        self.engine.max_piece = max(1, (self.link.max_payload - 1024) // self.ring.sender.bytes_per_position)
        await self.nc.subscribe(subjects.event(LoadFailed.__struct_config__.tag), cb=self._on_load_failed)
        started = time.perf_counter()
        try:
            await self.link.probe(float(self.cfg.get("probe_timeout_s") or PROBE_TIMEOUT_S))
        except asyncio.TimeoutError:
            report(event="failed", reason=f"the ring's later stages did not answer within "
                                          f"{time.perf_counter() - started:.0f}s")
            raise SystemExit(1) from None
        log.info("ring of %d stages answered a probe in %.3fs", self.num_stages, time.perf_counter() - started)

    async def _on_load_failed(self, msg) -> None:
        try:
            evt = decode_event(msg.data)
        except Exception:
            return
        if isinstance(evt, LoadFailed) and evt.load_id == self.load_id:
            log.warning("load failed (%s): failing every request in the ring", evt.reason)
            self.engine.fail_all(f"the ring serving this model failed: {evt.reason}", evt.code or "ring_failed")

    async def _shutdown(self) -> None:
        await super()._shutdown()  # errors the requests in flight, stops the loop, closes the bus
        await self.link.close()


class RingStageServer:
    """A middle or last stage: no intake; frames in on its lane, frames out on the next."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.load_id = cfg["load_id"]
        self.stage = int(cfg["stage"])
        self.num_stages = int(cfg["num_stages"])
        t = cfg.get("transport", {})
        self.max_batch = int(t.get("max_batch") or 0)
        self.prefill_chunk = int(t.get("prefill_chunk", 256))
        self.stopped = asyncio.Event()

    def load(self) -> None:
        started = time.perf_counter()
        self.ring = load_ring_stage(self.cfg["model_dir"], self.stage, self.num_stages, self.cfg.get("device"),
                                    packed=self.cfg.get("packed_linear", True))
        self.kv_tokens, self.kv_planned = _kv_tokens(self.ring, self.cfg, self.prefill_chunk)
        self.inbox = Inbox()
        self.worker = RingWorker(self.ring, self.inbox, lambda frame, lane=None: self.link.send(frame, lane),
                                 max_batch=self.max_batch)
        _warm_up(self.ring)
        self.load_s = time.perf_counter() - started

    def vram_bytes(self) -> int:
        if self.ring.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.ring.device))
        params = sum(p.numel() * p.element_size() for layer in self.ring.stage.layers for p in layer.parameters())
        return params + sum(h.cache.bytes for h in list(self.worker.held.values()))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.nc = await connect(self.cfg["nats_url"], name=f"swarm-stage{self.stage}-{self.load_id}")
        self.link = RingLink(self.nc, self.load_id, self.stage, self.num_stages, self.inbox)
        await self.link.start()
        thread = threading.Thread(target=self.worker.run, name=f"ring-stage{self.stage}", daemon=True)
        thread.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopped.set)
        report(event="ready", kv_tokens=self.kv_tokens, kv_tokens_planned=self.kv_planned,
               max_in_flight=int(self.cfg.get("transport", {}).get("max_in_flight") or 1),
               vram_bytes=self.vram_bytes(), load_s=round(self.load_s, 3), pid=os.getpid())
        reporter = asyncio.create_task(self._report_metrics())
        try:
            await self.stopped.wait()
        finally:
            reporter.cancel()
            self.worker.stop()
            await asyncio.to_thread(thread.join, 10)
            await self.link.close()
            await close_quietly(self.nc)

    async def _report_metrics(self) -> None:
        interval = float(self.cfg.get("report_s", 1.0))
        while True:
            await asyncio.sleep(interval)
            held = list(self.worker.held.values())
            report(event="metrics", tokens_per_s=0.0, last_ttft_s=None, requests=0,
                   idle_s=0.0 if held else round(time.monotonic() - self.worker.last_active, 3),
                   vram_bytes=self.vram_bytes(), in_flight=len(held), waiting=0, kv_tokens=self.kv_tokens,
                   cached_tokens=sum(h.cache.length for h in held), frames=self.worker.frames)
