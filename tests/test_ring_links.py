"""Ring stages over a real nats-server, each with its own connection and RingLink: direct links where they
beat the relay, the same replies either way, and a hop that breaks mid-session goes on over the relay."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
import torch

from core.bus import connect
from fellow.runtime.engine.sampling import SamplingParams
from fellow.runtime.engine.session import Session
from fellow.runtime.ring.head import RingHead
from fellow.runtime.ring.inbox import Inbox
from fellow.runtime.ring.link import RingLink
from fellow.runtime.ring.loader import load_ring_stage
from fellow.runtime.ring.worker import RingWorker
from tests.serving_fixtures import make_servable
from tests.test_ring_runtime import PROMPTS, one_stage

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(1)
    return make_servable(tmp_path_factory.mktemp("links"), "tiny3", layers=3, hidden=64, stages=3, seed=1)[1]


class BusRing:
    """Stage 0's head on a thread of its own, later stages' workers on theirs; frames over RingLinks."""

    def __init__(self, model_dir, num_stages: int, links: str):
        self.model_dir, self.num_stages, self.links = model_dir, num_stages, links
        self.load_id = "ld-" + uuid.uuid4().hex[:8]
        self.stages = [load_ring_stage(model_dir, i, num_stages, device="cpu") for i in range(num_stages)]

    async def start(self, url: str) -> "BusRing":
        self.ncs, self.inboxes, self.links_ = [], [], []
        for i in range(self.num_stages):
            nc = await connect(url, name=f"stage{i}")
            inbox = Inbox()
            link = RingLink(nc, self.load_id, i, self.num_stages, inbox, links=self.links)
            await link.start()
            self.ncs.append(nc)
            self.inboxes.append(inbox)
            self.links_.append(link)
        link0 = self.links_[0]
        self.head = RingHead(self.stages[0].stage, self.stages[0].sender, link0.send, self.inboxes[0],
                             num_stages=self.num_stages, kv_tokens=4096, prefill_chunk=8, route=lambda: link0.route)
        self.workers = [RingWorker(self.stages[i], self.inboxes[i], self.links_[i].send,
                                   route=lambda link=self.links_[i]: link.route) for i in range(1, self.num_stages)]
        for worker in self.workers:
            threading.Thread(target=worker.run, daemon=True).start()
        self.routes = await link0.settle(20)
        return self

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


async def test_direct_and_relay_rings_reply_alike_and_say_their_route(nats_server, model):
    expected = one_stage(model, PROMPTS, 12)
    got = {}
    for links in ("relay", "direct"):
        ring = await BusRing(model, 3, links).start(nats_server.url)
        try:
            got[links] = await asyncio.to_thread(ring.generate, PROMPTS, 12)
            assert ring.routes == ("ddd" if links == "direct" else "rrr")  # loopback: direct beats the relay
            if links == "direct":
                assert all(link.probe_ms["direct"] <= link.probe_ms["relay"] for link in ring.links_)
        finally:
            await ring.close()
    for links, (replies, timings) in got.items():
        assert replies == expected, links
        assert {t["route"] for t in timings.values()} == {links}


async def test_a_direct_hop_that_breaks_mid_session_goes_on_over_the_relay(nats_server, model):
    expected = one_stage(model, PROMPTS, 40)
    ring = await BusRing(model, 3, "direct").start(nats_server.url)
    try:
        progress = threading.Event()
        running = asyncio.create_task(asyncio.to_thread(ring.generate, PROMPTS, 40, progress))
        while not progress.is_set():  # tokens came back over the direct hops
            await asyncio.sleep(0.005)
        middle = ring.links_[1]
        middle._direct.writer.transport.abort()  # the hop from stage 1 to stage 2 breaks
        replies, timings = await asyncio.wait_for(running, 120)
    finally:
        await ring.close()
    assert replies == expected
    assert middle.fallbacks == 1 and middle.route == "r"
    assert ring.links_[0].route == "d" and ring.links_[2].route == "d"
    assert "direct,relay,direct" in {t["route"] for t in timings.values()}
