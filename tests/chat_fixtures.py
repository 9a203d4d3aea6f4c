"""Chat gateway tests: the real app on a real bus and SQLite, plus the bus side of a serving stage.

`StandInServing` resolves one model id to a load that no fellow serves, so a test can watch
what the gateway publishes and answer on the bus itself; every other id goes to the leader's
real `serving`. `ServingPeer` is the other end of the gateway's protocol: it pulls the request
from SWARM_REQUESTS and publishes frames on SWARM_TOKENS exactly as a fellow would, so what is
under test is the gateway's relay, not a model.
"""

from __future__ import annotations

import asyncio
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import uvicorn
from nats.js.api import AckPolicy, ConsumerConfig

from core.servable import Manifest, Shard, ShardFile, save_manifest
from events import subjects
from events.frames import DoneFrame, ErrorFrame, TokenFrame, frame_msg_id
from events.requests import ChatRequest
from leader.serving import ReadyLoad, Serving

GENERATION = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_new_tokens": 64}
READY = ReadyLoad(load_id="ld-standin", model_id="standin", generation=GENERATION, context_tokens=256)


def cataloged_servable(root: Path, model_id: str) -> Path:
    """A valid servable folder (manifest, shard file, tokenizer dir) that nothing has loaded."""
    folder = root / model_id
    (folder / "tokenizer").mkdir(parents=True)
    shard = folder / "shards" / "stage-0" / "weights.bin"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"\0" * 16)
    save_manifest(Manifest(model_id=model_id, architecture="Qwen3ForCausalLM", num_stages=1,
                           config={"num_hidden_layers": 2, "hidden_size": 8},
                           shards=[Shard(stage=0, files=[ShardFile("shards/stage-0/weights.bin", "", 16)])]),
                  folder)
    return folder


class StandInServing(Serving):
    """The leader's serving with one extra model resolved to READY (validation tests only).

    Passed to ``Leader(settings, serving=StandInServing)``.
    """

    def __init__(self, leader, ready: ReadyLoad = READY):
        super().__init__(leader)
        self.stand_in = ready

    async def ready_load(self, model_id: str, autoload: bool | None = None) -> ReadyLoad:
        if model_id == self.stand_in.model_id:
            return self.stand_in
        return await super().ready_load(model_id, autoload)


class ServingPeer:
    """Pulls chat requests of one load and publishes frames for them, as stage 0 does."""

    def __init__(self, js, load_id: str = READY.load_id):
        self.js = js
        self.load_id = load_id
        self._sub = None

    async def next_request(self, timeout: float = 10.0) -> ChatRequest:
        if self._sub is None:
            durable = "peer-" + self.load_id
            await self.js.add_consumer(subjects.REQUESTS_STREAM, ConsumerConfig(
                durable_name=durable, filter_subject=subjects.request(self.load_id), ack_policy=AckPolicy.EXPLICIT))
            self._sub = await self.js.pull_subscribe_bind(durable, stream=subjects.REQUESTS_STREAM)
        msg = (await self._sub.fetch(1, timeout=timeout))[0]
        await msg.ack()
        return msgspec.json.decode(msg.data, type=ChatRequest)

    async def publish(self, frame) -> None:
        await self.js.publish(subjects.tokens(frame.request_id), msgspec.json.encode(frame),
                              headers={"Nats-Msg-Id": frame_msg_id(frame.request_id, frame.seq)})

    async def answer(self, rid: str, texts: list[list[str]], finish_reason: str = "stop",
                     prompt_tokens: int = 7, timing: dict | None = None) -> DoneFrame:
        """One TokenFrame per inner list, then the DoneFrame; returns the DoneFrame."""
        for seq, batch in enumerate(texts):
            await self.publish(TokenFrame(request_id=rid, seq=seq, texts=batch, text="".join(batch)))
        done = DoneFrame(request_id=rid, seq=len(texts), completion_tokens=sum(len(b) for b in texts),
                         prompt_tokens=prompt_tokens, finish_reason=finish_reason, timing=timing or {})
        await self.publish(done)
        return done

    async def fail(self, rid: str, seq: int, message: str, code: str) -> None:
        await self.publish(ErrorFrame(request_id=rid, seq=seq, message=message, code=code))


async def wait_cancel(nc, rid: str = "*") -> asyncio.Future:
    """The subject of the first ``swarm.cancel.<load>.<rid>`` published (`*`: any request) after this returns."""
    fut = asyncio.get_running_loop().create_future()

    async def _cb(msg):
        if not fut.done():
            fut.set_result(msg.subject)

    sub = await nc.subscribe("swarm.cancel.*." + rid, cb=_cb)
    fut.add_done_callback(lambda _: asyncio.ensure_future(sub.unsubscribe()))
    return fut


@dataclass
class Gateway:
    url: str  # http://127.0.0.1:<port>
    leader: object


@asynccontextmanager
async def served(app):
    """The app on a real uvicorn server on a free port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:  # uvicorn sets it once the lifespan started and the socket listens
        assert not task.done(), task.exception()
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
