"""Ring stages over a real nats-server, each with its own connection and RingLink: direct links where they
beat the relay, the same replies either way, and a hop that breaks mid-session goes on over the relay."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tests.bus_ring import BusRing
from tests.delay_proxy import DelayProxy
from tests.processes import free_port
from tests.serving_fixtures import make_servable
from tests.test_ring_runtime import PROMPTS, one_stage

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(1)
    return make_servable(tmp_path_factory.mktemp("links"), "tiny3", layers=3, hidden=64, stages=3, seed=1)[1]


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


async def test_a_hop_whose_direct_link_is_slower_than_the_relay_stays_on_the_relay(nats_server, model):
    """Stage 1 is reached through a delay proxy (20 ms each way) while the relay is on loopback: that hop's
    probe finds the relay faster and keeps it; the other hops go direct, and the replies are the same."""
    expected = one_stage(model, PROMPTS[:3], 10)
    port = free_port()
    with DelayProxy(("127.0.0.1", port), delay_s=0.02) as proxy:
        ring = await BusRing(model, 3, "direct", listen={1: (port, proxy.address)}).start(nats_server.url)
        try:
            replies, timings = await asyncio.to_thread(ring.generate, PROMPTS[:3], 10)
        finally:
            await ring.close()
    assert replies == expected and ring.routes == "rdd"
    probe = ring.links_[0].probe_ms
    assert probe["direct"] >= 40 > probe["relay"]  # both ways through the proxy: at least 2 x 20 ms
    assert {t["route"] for t in timings.values()} == {"relay,direct,direct"}
