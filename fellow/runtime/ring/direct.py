"""Direct links between ring stages: one TCP connection per hop, frames in order whichever route they took.

Every stage listens on a serving port and answers, on the relay subject ``where<stage>``, the address
its predecessor dials. Stage i dials stage i + 1 (the last stage dials stage 0) and times ten round
trips over it against ten over the relay (the link probe). Where the dial fails, or the direct round
trip is slower than the relay's, the hop stays on the relay.

Every frame on a stage's own lane is a ``Hop``, numbered per sender (``Sequencer`` here puts them back
in order and drops what came twice). A frame sent direct is kept until the receiver acks it; when the
connection breaks, what is not acked goes again over the relay, and the hop stays there, so a session
in flight never loses a position.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import time
from collections import deque

from events.ring import Ack, Hop, Ping, decode_frame, encode_frame

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")  # each frame on a link: its length, then its msgpack bytes
GAP_S = 1.0  # a frame missing this long, with later ones in, is given up (the relay lost it)
ACK_EVERY = 8  # the receiver acks at least every this many frames ...
ACK_S = 0.05  # ... and whatever is left this often
MAX_UNACKED = 4096  # a link that leaves more frames than this unacked is treated as broken
PROBE_ROUNDS = 10


class Sequencer:
    """The receiving end of one hop: frames in their sender's order, each once.

    ``epoch`` names the sender's link; a new one (the sender restarted) starts the count over.
    """

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.expected = 0
        self.waiting: dict[int, object] = {}
        self.waiting_since: float | None = None
        self.skipped = 0

    def accept(self, epoch: int, seq: int, frame) -> list:
        """The frames now deliverable, in order (none if this one is early or a duplicate)."""
        if epoch != self.epoch:
            self.epoch, self.expected, self.waiting, self.waiting_since = epoch, seq, {}, None
        if seq < self.expected or seq in self.waiting:
            return []
        self.waiting[seq] = frame
        out = self._release()
        if self.waiting and self.waiting_since is None:
            self.waiting_since = time.monotonic()
        return out

    def overdue(self, now: float) -> list:
        """Give up the missing frame(s) once later ones waited GAP_S: what follows goes on."""
        if not self.waiting or self.waiting_since is None or now - self.waiting_since < GAP_S:
            return []
        first = min(self.waiting)
        self.skipped += first - self.expected
        log.warning("ring hop: %d frame(s) before #%d never came; going on without them",
                    first - self.expected, first)
        self.expected = first
        return self._release()

    def _release(self) -> list:
        out = []
        while self.expected in self.waiting:
            out.append(self.waiting.pop(self.expected))
            self.expected += 1
        self.waiting_since = time.monotonic() if self.waiting else None
        return out


def pack(frame) -> bytes:
    data = encode_frame(frame)
    return HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader, max_bytes: int):
    size = HEADER.unpack(await reader.readexactly(HEADER.size))[0]
    if size > max_bytes:
        raise ValueError(f"a frame of {size} bytes on a ring link (at most {max_bytes})")
    return decode_frame(await reader.readexactly(size))


class DirectOut:
    """The sending end of a direct hop, after the dial: writes Hops, keeps them until acked."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_bytes: int):
        self.reader, self.writer, self.max_bytes = reader, writer, max_bytes
        self.unacked: deque[tuple[int, bytes]] = deque()  # (seq, the Hop's encoded bytes)
        self.pongs: dict[int, asyncio.Future] = {}
        self.broken: str | None = None

    def write(self, seq: int, hop: bytes) -> None:
        if len(self.unacked) >= MAX_UNACKED:
            raise ConnectionError(f"{len(self.unacked)} frames unacked")
        self.writer.write(HEADER.pack(len(hop)) + hop)
        self.unacked.append((seq, hop))

    async def run_acks(self) -> None:
        """Read the receiver's acks and pongs until the connection ends (then raises)."""
        while True:
            frame = await read_frame(self.reader, self.max_bytes)
            if isinstance(frame, Ack):
                while self.unacked and self.unacked[0][0] <= frame.seq:
                    self.unacked.popleft()
            elif isinstance(frame, Ping) and frame.nonce in self.pongs:
                future = self.pongs.pop(frame.nonce)
                if not future.done():
                    future.set_result(time.perf_counter())

    async def round_trip(self, nonce: int, timeout: float) -> float:
        future = self.pongs[nonce] = asyncio.get_running_loop().create_future()
        started = time.perf_counter()
        self.writer.write(pack(Ping(nonce=nonce)))
        await self.writer.drain()
        return (await asyncio.wait_for(future, timeout)) - started

    def close(self) -> None:
        self.writer.close()


async def dial(host: str, port: int, load_id: str, from_stage: int, max_bytes: int,
               timeout: float = 5.0) -> DirectOut:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(json.dumps({"load": load_id, "from": from_stage}).encode() + b"\n")
        answer = await asyncio.wait_for(reader.readline(), timeout)
        if answer.strip() != b"ok":
            raise ConnectionError(f"the stage at {host}:{port} refused the link: {answer[:200]!r}")
    except BaseException:
        writer.close()
        raise
    return DirectOut(reader, writer, max_bytes)


class DirectIn:
    """The listening end: a server whose one accepted connection (from the predecessor) feeds ``deliver``."""

    def __init__(self, load_id: str, predecessor: int, deliver, max_bytes: int):
        self.load_id, self.predecessor, self.deliver, self.max_bytes = load_id, predecessor, deliver, max_bytes
        self.server: asyncio.base_events.Server | None = None
        self.connections: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._serve, host, port)
        bound = self.server.sockets[0].getsockname()
        return host, bound[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in list(self.connections):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = json.loads(await asyncio.wait_for(reader.readline(), 5.0))
            if hello.get("load") != self.load_id or hello.get("from") != self.predecessor:
                writer.write(b"no: not this ring's predecessor\n")
                await writer.drain()
                return
            writer.write(b"ok\n")
            self.connections.add(writer)
            last_seq, acked, since_ack = 0, 0, 0
            ack_task = asyncio.create_task(self._ack_now_and_then(writer, lambda: (last_seq, acked)))
            try:
                while True:
                    frame = await read_frame(reader, self.max_bytes)
                    if isinstance(frame, Ping):
                        writer.write(pack(frame))
                    elif isinstance(frame, Hop):
                        self.deliver(frame)
                        last_seq, since_ack = frame.seq, since_ack + 1
                        if since_ack >= ACK_EVERY:
                            writer.write(pack(Ack(seq=last_seq)))
                            acked, since_ack = last_seq, 0
            finally:
                ack_task.cancel()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, OSError):
            pass  # the sender went (or broke): it falls back to the relay on its side
        except Exception as exc:  # not JSON, not a frame: a stranger
            log.warning("a ring link connection sent what is not a frame: %s: %s", type(exc).__name__, exc)
        finally:
            self.connections.discard(writer)
            writer.close()

    @staticmethod
    async def _ack_now_and_then(writer: asyncio.StreamWriter, position) -> None:
        sent = 0
        while True:
            await asyncio.sleep(ACK_S)
            last, acked = position()
            if last > max(sent, acked):
                writer.write(pack(Ack(seq=last)))
                sent = last
