"""A ring over a real nats-server in one process: each stage with its own NATS connection, RingLink and
thread, the way stage processes run it (tests/test_ring_links.py, bench/bench_links.py)."""

from __future__ import annotations

import threading
import uuid

from core.bus import connect
from events.requests import Sampling
from fellow.runtime.engine.session import Session
from fellow.runtime.model.load.kernels import step_costs
from fellow.runtime.ring.head import ring_engine
from fellow.runtime.ring.inbox import Inbox
from fellow.runtime.ring.link import RingLink
from fellow.runtime.ring.loader import load_ring_stage
from fellow.runtime.ring.sizing import RingSizing, size_ring
from fellow.runtime.ring.worker import RingWorker
from tests.delay_proxy import DelayProxy

GREEDY = Sampling(temperature=0.0)


class BusRing:
    """Stage 0's head on a thread of its own, later stages' workers on theirs; frames over RingLinks."""

    def __init__(self, model_dir, num_stages: int, links: str, listen: dict[int, DelayProxy] | None = None,
                 prefill_chunk: int = 8, kv_tokens: int = 4096):
        self.model_dir, self.num_stages, self.links = model_dir, num_stages, links
        self.prefill_chunk, self.kv_tokens = prefill_chunk, kv_tokens
        self.listen = listen or {}  # stage -> the proxy its predecessor dials, aimed at the port the stage binds
        self.load_id = "ld-" + uuid.uuid4().hex[:8]
        self.stages = [load_ring_stage(model_dir, i, num_stages, device="cpu") for i in range(num_stages)]

    async def start(self, url: str, urls: dict[int, str] | None = None) -> "BusRing":
        """``urls``: a stage's own way to nats-server, where it is not ``url`` (through a delay proxy)."""
        self.ncs, self.inboxes, self.links_ = [], [], []
        for i in range(self.num_stages):
            nc = await connect((urls or {}).get(i, url), name=f"stage{i}")
            inbox = Inbox()
            proxy = self.listen.get(i)
            link = RingLink(nc, self.load_id, i, self.num_stages, inbox, links=self.links,
                            advertise=proxy.address if proxy else "")
            await link.start()
            if proxy:  # a port of the stage's own, never one picked free before and taken since
                proxy.aim(link.address)
            self.ncs.append(nc)
            self.inboxes.append(inbox)
            self.links_.append(link)
        link0 = self.links_[0]
        self.head = ring_engine(self.stages[0].stage, self.stages[0].sender, link0.send, self.inboxes[0],
                               num_stages=self.num_stages, kv_tokens=self.kv_tokens, prefill_chunk=self.prefill_chunk,
                               route=lambda: link0.route)
        self.workers = [RingWorker(self.stages[i], self.inboxes[i], self.links_[i].send, prefix_tokens=self.kv_tokens,
                                   route=lambda link=self.links_[i]: link.route) for i in range(1, self.num_stages)]
        for worker in self.workers:
            threading.Thread(target=worker.run, daemon=True).start()
        self.routes = await link0.settle(20)
        return self

    async def size(self, per_group: int = 4, ceiling: int = 64) -> RingSizing:
        """What a ring's stage 0 does at start (fellow.runtime.ring.servers.RingHeadServer._fit_ring): every
        stage times its decode step at ``per_group`` rows, the later ones say theirs on a probe, probe trips
        time the links, and the head keeps that many decode groups in the ring."""
        for worker, ring_stage in zip(self.workers, self.stages[1:]):
            worker.step_ms = step_costs(ring_stage.stage, [per_group])[str(per_group)]
        own = step_costs(self.stages[0].stage, [per_group])[str(per_group)]
        link0 = self.links_[0]
        transit = await link0.transit_ms()
        sizing = size_ring([own, *link0.ring_step_ms], transit, per_group, ceiling)
        self.head.runner.units.groups = sizing.groups
        return sizing

    def generate(self, prompts, max_new_tokens: int, progress: threading.Event | None = None):
        """Blocking (call it on a thread): the replies and each session's timing."""
        out: dict[str, list[int]] = {}
        timings: dict[str, dict] = {}
        for i, prompt in enumerate(prompts):
            self.head.add(Session(f"s{i}", prompt, max_new_tokens, sampling=GREEDY))
        while self.head.busy:
            result = self.head.step()
            for sid, tokens in result.tokens.items():
                out.setdefault(sid, []).extend(tokens)
            timings.update({s.session_id: s.timing() for s in result.finished})
            if progress is not None and sum(map(len, out.values())) >= 2 * len(prompts):
                progress.set()
        return out, timings

    async def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        for link in self.links_:
            await link.close()
        for nc in self.ncs:
            await nc.close()
