"""Ring stages over a real nats-server, each with its own connection and RingLink: direct links where they
beat the relay, the same replies either way, and a hop that breaks mid-session goes on over the relay."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tests.bus_ring import BusRing
from tests.delay_proxy import DelayProxy
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


async def test_the_link_probe_times_ten_trips_by_the_routes_they_take(nats_server, model):
    """The spec's [stage0 link-probe] (SWARM_SERVE_STEP_COSTS): ten round trips of the frames' path without
    compute, named by their hops' routes (RingHeadServer puts them in stage 0's kernels and log)."""
    ring = await BusRing(model, 3, "direct").start(nats_server.url)
    try:
        probe = await ring.links_[0].link_probe()
    finally:
        await ring.close()
    assert probe["trips"] == 10 and probe["routes"] == "ddd"
    assert 0 < probe["min_ms"] <= probe["median_ms"] <= probe["max_ms"]


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
    with DelayProxy(None, delay_s=0.02) as proxy:
        ring = await BusRing(model, 3, "direct", listen={1: proxy}).start(nats_server.url)
        try:
            replies, timings = await asyncio.to_thread(ring.generate, PROMPTS[:3], 10)
        finally:
            await ring.close()
    assert replies == expected and ring.routes == "rdd"
    probe = ring.links_[0].probe_ms
    assert probe["direct"] >= 40 > probe["relay"]  # both ways through the proxy: at least 2 x 20 ms
    assert {t["route"] for t in timings.values()} == {"relay,direct,direct"}


async def test_a_ring_over_slow_links_keeps_more_decode_groups_in_flight_and_replies_alike(nats_server, model):
    """Every link of a 3-stage ring crosses a 10 ms (one way) proxy: probe trips time the links, each later
    stage says its step on the probe, and stage 0 sizes more decode groups than stages to fill the pipe
    (fellow.runtime.ring.sizing). With twelve sessions in those groups, replies equal the model alone."""
    host, port = nats_server.url.split("://", 1)[1].rsplit(":", 1)
    proxies = {i: DelayProxy(None, delay_s=0.01).start() for i in range(3)}
    proxies["nats"] = DelayProxy((host, int(port)), delay_s=0.01).start()
    try:
        ring = BusRing(model, 3, "direct", listen={i: proxies[i] for i in range(3)})
        await ring.start(nats_server.url, urls={i: f"nats://{proxies['nats'].address}" for i in (1, 2)})
        try:
            sizing = await ring.size(per_group=2, ceiling=24)
            prompts = (PROMPTS * 4)[:12]
            expected = one_stage(model, prompts, 8)
            replies, _ = await asyncio.to_thread(ring.generate, prompts, 8)
        finally:
            await ring.close()
    finally:
        for proxy in proxies.values():
            proxy.stop()
    assert ring.routes == "ddd"
    assert sizing.transit_ms >= 30  # three hops, each one way through a 10 ms proxy
    assert len(sizing.step_ms) == 3 and all(ms > 0 for ms in sizing.step_ms)  # stage 0's and both later ones
    assert sizing.groups == ring.head.runner.units.groups > 3  # the pipe is longer than three steps
    assert sizing.in_flight == 2 * sizing.groups <= 24
    assert replies == expected
