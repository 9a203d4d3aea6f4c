"""What the bus acknowledged survives an OS crash (issue 53), and `swarm nats` reports its server's death.

The crash is real: the JetStream store lives on an ext4 filesystem of our own (an image file on a loop
device), and the "power loss" is ext4's shutdown ioctl without a journal flush (EXT4_IOC_SHUTDOWN,
EXT4_GOING_FLAGS_NOLOGFLUSH, what xfstests' godown uses): every write not yet on the device, the dirty
page cache and the journal's open transaction, is dropped, as when the machine loses power. Then the server
is SIGKILLed, the filesystem mounted again (the journal replayed) and the server restarted on it. Root and
a loop device are needed; elsewhere those tests skip and say why.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import signal
import subprocess
import urllib.request

import pytest

from core.bus import connect, ensure_streams, publish_with_id
from core.nats_server import SYNC_ALWAYS, EmbeddedNats, free_port
from events.subjects import EVENTS_STREAM, REQUESTS_STREAM
from tests.processes import SwarmProcess, children_of, pid_alive, swarm_env, wait_until

EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2
PUBLISHED = 200  # each stream gets this many, every one acknowledged


def _varz_jetstream(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as r:
        return json.load(r)["jetstream"]["config"]


@pytest.mark.parametrize("sync, always", [(SYNC_ALWAYS, True), (None, None)])
def test_the_running_server_syncs_each_write(tmp_path, sync, always):
    """The server `swarm up` and the tests start (EmbeddedNats' default) syncs every write before its ack:
    its monitoring endpoint says so; without the setting it says nothing of it (every two minutes)."""
    port = free_port()
    with EmbeddedNats(tmp_path / "js", sync=sync, http_port=port):
        config = _varz_jetstream(port)
    assert config.get("sync_always") is always, config
    assert EmbeddedNats(tmp_path / "x").sync == SYNC_ALWAYS


def test_swarm_nats_syncs_and_exits_non_zero_when_its_server_is_killed(tmp_path):
    """`swarm nats` runs its nats-server with sync_interval: always (its /varz says so), and when that
    server is SIGKILLed it says so and exits 137 (128 + SIGKILL): systemd's Restart=on-failure restarts it.
    (It used to exit 0, and the node stayed down.)"""
    http = free_port()
    proc = SwarmProcess(["nats", "--port", "0", "--http-port", str(http), "--store-dir", str(tmp_path / "store")],
                        swarm_env(tmp_path, None), tmp_path / "nats.log").start()
    try:
        wait_until(lambda: " at nats://" in proc.tail(), 30, "the server's URL")
        assert _varz_jetstream(http).get("sync_always") is True
        servers = children_of(proc.proc.pid)
        assert len(servers) == 1 and pid_alive(servers[0])
        os.kill(servers[0], signal.SIGKILL)
        assert proc.proc.wait(30) == 128 + signal.SIGKILL, proc.tail()
        assert "nats-server ended unasked (killed by SIGKILL)" in proc.tail()
    finally:
        proc.kill()


# --- a real crash --------------------------------------------------------------------------------------

def _crash_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "mounting a loop device needs root"
    if not (shutil.which("mkfs.ext4") and shutil.which("mount") and os.path.exists("/dev/loop-control")):
        return "no mkfs.ext4, mount or /dev/loop-control"
    return None


class Ext4Image:
    """An ext4 filesystem in an image file, mounted on a loop device, that can lose power."""

    def __init__(self, root):
        self.image, self.mount_point = root / "fs.img", root / "mnt"
        self.mount_point.mkdir()
        with open(self.image, "wb") as f:
            f.truncate(128 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(self.image)], check=True)
        self.mounted = False

    def mount(self) -> None:
        subprocess.run(["mount", "-o", "loop", str(self.image), str(self.mount_point)], check=True)
        self.mounted = True

    def lose_power(self) -> None:
        """Drop what is not on the device yet: dirty pages and the journal's open transaction."""
        fd = os.open(self.mount_point, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, EXT4_GOING_FLAGS_NOLOGFLUSH.to_bytes(4, "little"))
        finally:
            os.close(fd)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.mount_point)], check=True)
            self.mounted = False


async def _publish_acked(url: str) -> None:
    nc = await connect(url, name="durability")
    js = nc.jetstream()
    await ensure_streams(js)
    for i in range(PUBLISHED):  # an event and a chat request, as the leader publishes them: each acked
        await publish_with_id(js, "swarm.evt.request.accepted", b'{"n": %d}' % i, f"evt-{i}")
        await publish_with_id(js, "swarm.req.durability", b'{"n": %d}' % i, f"req-{i}")
    await nc.close()


async def _stored(url: str) -> dict[str, int]:
    nc = await connect(url, name="durability-after")
    js = nc.jetstream()
    counts = {}
    for name in (EVENTS_STREAM, REQUESTS_STREAM):
        try:
            counts[name] = (await js.stream_info(name)).state.messages
        except Exception:  # the stream itself was lost
            counts[name] = 0
    await nc.close()
    return counts


def _crash_and_count(tmp_path, sync: str | None) -> dict[str, int]:
    """Publish PUBLISHED acknowledged messages on each stream, lose power, restart: what is stored."""
    fs = Ext4Image(tmp_path)
    fs.mount()
    srv = EmbeddedNats(fs.mount_point / "js", sync=sync)
    try:
        srv.start()
        asyncio.run(_publish_acked(srv.url))
        fs.lose_power()
        srv.kill()
        fs.unmount()
        fs.mount()  # the journal replays: the filesystem as the device held it
        srv = EmbeddedNats(fs.mount_point / "js", sync=sync).start()
        return asyncio.run(_stored(srv.url))
    finally:
        srv.stop()
        fs.unmount()


@pytest.mark.skipif(_crash_unavailable() is not None, reason=str(_crash_unavailable()))
def test_acknowledged_messages_survive_a_power_loss(tmp_path):
    """With the project's setting, every acknowledged event and request is there after the crash."""
    assert _crash_and_count(tmp_path, SYNC_ALWAYS) == {EVENTS_STREAM: PUBLISHED, REQUESTS_STREAM: PUBLISHED}


@pytest.mark.skipif(_crash_unavailable() is not None, reason=str(_crash_unavailable()))
def test_without_the_setting_the_same_crash_loses_acknowledged_messages(tmp_path):
    """The same crash with nats-server's default sync loses what it had acknowledged: the test above would
    fail without the setting (here the streams themselves were gone: nothing had reached the device)."""
    counts = _crash_and_count(tmp_path, None)
    assert counts[EVENTS_STREAM] < PUBLISHED and counts[REQUESTS_STREAM] < PUBLISHED, counts
