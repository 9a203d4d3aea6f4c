"""ensure_streams on a JetStream cluster whose nodes have not all joined (core/bus.py): with two of
three nodes up, streams of three replicas cannot be placed (JetStream's 10005). It tries again until
``wait_s``, then says so in one line naming the replicas and SWARM_NATS_REPLICAS; once the third node
is up the same call places every stream with three replicas."""

from __future__ import annotations

import asyncio

import nats
import pytest

from core.bus import BusUnavailable, ensure_streams
from core.nats_server import local_cluster
from events.subjects import STREAMS

pytestmark = pytest.mark.slow


async def jetstream_answers(js, timeout: float = 60.0) -> None:
    """Until the cluster's JetStream has a meta leader (an account info request answers)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await js.account_info()
            return
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_streams_wait_for_the_nodes_their_replicas_need(tmp_path):
    nodes = local_cluster(tmp_path / "nats", 3)
    try:
        for node in nodes[:2]:
            node.start()
        nc = await nats.connect([n.url for n in nodes[:2]])
        try:
            js = nc.jetstream()
            await jetstream_answers(js)
            with pytest.raises(BusUnavailable) as err:
                await ensure_streams(js, replicas=3, wait_s=2.0)
            line = str(err.value)
            assert "cannot place stream" in line and "3 replicas" in line and "SWARM_NATS_REPLICAS" in line, line
            assert "\n" not in line
            nodes[2].start()
            await ensure_streams(js, replicas=3, wait_s=60.0)
            for spec in STREAMS:
                info = await js.stream_info(spec.name)
                assert info.config.num_replicas == 3, spec.name
        finally:
            await nc.close()
    finally:
        for node in nodes:
            node.stop()
