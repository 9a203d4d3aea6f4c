"""Request intake: pulls requests while the stage has room, claims each with a start frame, hands it to
the serving loop, streams its frames and records how it ended. Runs on the stage's bus thread."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from core.bus import publish_event
from core.logs import for_request
from events import subjects
from events.requests import ChatRequest, RequestFailed, RequestFinished, request_failed_id, request_finished_id
from events.stage import StageConfig
from events.subjects import REQUESTS_STREAM
from fellow.runtime.engine.budget import ContextTooLong
from fellow.runtime.engine.scheduler import Scheduler
from fellow.runtime.engine.serving_loop import Job, Output, ServingLoop
from fellow.runtime.server.metrics import Metrics
from fellow.runtime.server.moved import count_once, resumed, sent, start_at
from fellow.token_batcher import TokenBatcher, stored_beyond

log = logging.getLogger("swarm.serve")
# A request a stage fetched but neither acked nor refused (it died in between) goes to another
# replica after this long. Taking one (decode, tokenize, admit, start frame) is milliseconds.
ACK_WAIT_S = 10.0
# A cancel for a request this stage has not taken (yet) is kept this long, at most EARLY_CANCELS of
# them: a client that hangs up while its request waits on the bus must not have it served in full.
EARLY_CANCEL_S = 300.0
EARLY_CANCELS = 10_000
GRANT_WAIT_S = 15.0  # how long a first refused pull is retried (Intake._subscribe)
_request = msgspec.json.Decoder(ChatRequest).decode


@dataclass
class _Taken:
    batcher: TokenBatcher
    started: float
    bus_wait_s: float = 0.0  # from the gateway's accept to this stage taking it (wall clocks)
    claimed: bool = False  # its start frame is stored: until then its outputs wait in `held`
    sent: int = 0  # a moved request's reply tokens sent before it came here (fellow.runtime.server.moved)
    held: list = field(default_factory=list)


class Intake:
    """The requests a stage serves, from the bus to their last frame.

    It asks the scheduler for a request's KV tokens before it claims the request (``Scheduler.offer``:
    admitted, busy, or too long for the stage) and never writes the ledger itself; the scheduler gives
    them back when the request ends. Anything that goes wrong while taking
    a request fails that request alone; a message that does not decode is logged, acked and skipped.
    """

    def __init__(self, cfg: StageConfig, nc: Client, js: JetStreamContext, tokenizer, scheduler: Scheduler,
                 serving: ServingLoop, max_in_flight: int = 0):
        self.cfg, self.nc, self.js = cfg, nc, js
        self.load_id, self.model_id, self.fellow_id = cfg.load_id, cfg.model_id, cfg.fellow_id
        self.tokenizer, self.scheduler, self.serving = tokenizer, scheduler, serving
        self.max_in_flight = max(1, max_in_flight or cfg.options.max_in_flight)  # the stage's, fitted to its KV
        self.active: dict[str, _Taken] = {}
        self.metrics = Metrics()
        self.room = asyncio.Event()
        self.running = True
        self._records: set[asyncio.Task] = set()
        self.early_cancels: dict[str, float] = {}  # request id -> when its cancel came, before we took it

    def stop(self) -> None:
        self.running = False
        self.room.set()

    async def _subscribe(self):
        """The load's request consumer. On a nats-server the leader manages, this fellow may use it once the
        leader granted it (before the stage's command; leader.serving.grants): a refused request times out,
        so one is retried for GRANT_WAIT_S, in case the server's reload lags the command."""
        durable = subjects.request_consumer(self.load_id)
        config = ConsumerConfig(durable_name=durable, deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.EXPLICIT,
                                ack_wait=ACK_WAIT_S, inactive_threshold=3600.0)
        deadline = time.monotonic() + GRANT_WAIT_S
        while True:
            try:
                return await self.js.pull_subscribe(subjects.request(self.load_id), durable=durable,
                                                    stream=REQUESTS_STREAM, config=config)
            except (NatsTimeout, asyncio.TimeoutError):
                if not self.running or time.monotonic() > deadline:
                    raise
                log.warning("the request queue of load %s did not answer (not granted yet?): again", self.load_id)

    async def run(self) -> None:
        """Until ``stop``."""
        sub = await self._subscribe()
        while self.running:
            if len(self.active) >= self.max_in_flight or self.scheduler.budget.free <= 0:
                await self._wait_room()
                continue
            try:
                msgs = await sub.fetch(1, timeout=1.0)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            for msg in msgs:
                await self.take(msg)

    async def _wait_room(self) -> None:
        self.room.clear()
        await self.room.wait()

    async def on_cancel(self, msg) -> None:
        rid = msg.subject.rsplit(".", 1)[1]
        if rid in self.active:
            self.serving.cancel(rid)
            return
        now = time.monotonic()
        while self.early_cancels and (len(self.early_cancels) >= EARLY_CANCELS
                                      or now - next(iter(self.early_cancels.values())) > EARLY_CANCEL_S):
            del self.early_cancels[next(iter(self.early_cancels))]
        self.early_cancels[rid] = now

    async def take(self, msg) -> None:
        """One message off the bus."""
        try:
            req = _request(msg.data)
        except Exception as exc:  # not JSON, the wrong schema, or nested too deep (RecursionError)
            log.warning("dropped a request that does not decode: %s: %s", type(exc).__name__, str(exc)[:200])
            await _ack(msg)
            return
        try:
            await self._take(msg, req)
        except Exception as exc:
            log.exception("request %s could not be taken", req.request_id, extra=for_request(req.request_id))
            await _ack(msg)
            await self._refuse(req, 0, f"the stage could not take this request: {type(exc).__name__}: {exc}",
                               "intake_failed")

    async def _take(self, msg, req: ChatRequest) -> None:
        if req.request_id in self.active:  # a redelivery of what we already serve
            await _ack(msg)
            return
        if msg.metadata.num_delivered > 1 and await stored_beyond(self.js, req.request_id, start_at(req)[1]):
            # A replica took it, said so, and died before acking: the gateway fails it (never both).
            log.warning("request %s was started by another replica; not serving it again", req.request_id,
                        extra=for_request(req.request_id))
            await _ack(msg)
            return
        try:
            prompt_ids = self._tokenize(req)
        except Exception as exc:
            await _ack(msg)
            await self._refuse(req, 0, f"the prompt could not be tokenized: {exc}", "invalid_prompt")
            return
        req, prompt_ids = resumed(req, prompt_ids)  # a moved request: the reply so far after its prompt
        try:
            sampling = req.sampling.check()
        except ValueError as exc:
            await _ack(msg)
            await self._refuse(req, len(prompt_ids), f"invalid sampling: {exc}", "invalid_request")
            return
        max_tokens = req.max_tokens
        if req.max_tokens_fit and len(prompt_ids) < self.scheduler.kv_tokens:
            max_tokens = min(max_tokens, self.scheduler.kv_tokens - len(prompt_ids))
        try:
            admitted = (self.fellow_id not in req.not_by  # a check of its own reply goes to another (leader.verify)
                        and self.scheduler.offer(req.request_id, len(prompt_ids), max_tokens))
        except ContextTooLong as err:
            await _ack(msg)
            await self._refuse(req, len(prompt_ids), str(err), err.code, err.data)
            return
        if not admitted:
            # Not now: back to the bus for another replica, and we wait until a session ends.
            await _ack(msg, nak=True)
            if self.active:
                await self._wait_room()
            return
        batcher = TokenBatcher(self.nc, self.js, req.request_id, req.frame_key,
                               self.cfg.options.stream_interval_ms / 1e3)
        bus_wait = max(0.0, time.time() - req.created) if req.created else 0.0
        taken = self.active[req.request_id] = _Taken(batcher, time.monotonic(), bus_wait, sent=sent(req))
        # The prompt runs while the start frame is acked (its round trip is not in the time to first token);
        # what it yields is held until the claim stands, and dropped with the request if it does not.
        self.serving.submit(Job(req.request_id, prompt_ids, max_tokens, sampling, list(req.stop), sent(req),
                                req.resume.text_sent if req.resume else 0))
        try:
            claimed = await batcher.start(self.fellow_id, self.cfg.replica, *start_at(req))  # our death fails it
        except Exception as exc:  # a bus timeout, say: the start frame may be stored or not
            self._drop(req.request_id)
            await _ack(msg)
            await self._refuse(req, len(prompt_ids), f"the start frame was not published: {exc}", "intake_failed",
                               batcher=batcher)
            return
        if not claimed:
            self._drop(req.request_id)
            log.warning("request %s was started by another replica; not serving it again", req.request_id,
                        extra=for_request(req.request_id))
            await _ack(msg)
            return
        self.metrics.requests += 1
        taken.claimed = True
        if self.early_cancels.pop(req.request_id, None) is not None:  # its client hung up while it waited
            self.serving.cancel(req.request_id)
        held, taken.held = taken.held, []
        self.deliver(held)  # what the prompt yielded while the start frame was acked
        await _ack(msg)  # served either way: a redelivery finds the start frame and leaves it

    def _drop(self, request_id: str) -> None:
        """A request taken but not claimed: its session ends, and nothing it yielded goes out."""
        self.active.pop(request_id, None)
        self.serving.cancel(request_id)

    def _tokenize(self, req: ChatRequest) -> list[int]:
        if req.prompt_ids:  # a completion: the gateway tokenized its prompt
            return list(req.prompt_ids) + list(req.scored_ids)
        kwargs = {} if req.enable_thinking is None else {"enable_thinking": req.enable_thinking}
        messages = [chat_message(m) for m in req.messages]
        if req.tools:
            kwargs["tools"] = list(req.tools)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids] + list(req.scored_ids)  # a check's reply after its prompt (leader.verify)

    async def _refuse(self, req: ChatRequest, prompt_tokens: int, message: str, code: str,
                      data: dict | None = None, batcher: TokenBatcher | None = None) -> None:
        try:
            batcher = batcher or TokenBatcher(self.nc, self.js, req.request_id, req.frame_key)
            batcher.error(message, code, data)
            await batcher.closed.wait()
            await publish_event(self.js, RequestFailed(
                id=request_failed_id(req.request_id), request_id=req.request_id, model_id=self.model_id,
                load_id=self.load_id, code=code, message=message, prompt_tokens=prompt_tokens,
                fellow_id=self.fellow_id))
        except Exception:
            log.exception("the refusal of %s was not published", req.request_id,
                          extra=for_request(req.request_id))

    def deliver(self, outputs: list[Output]) -> None:
        """What the serving loop produced (called on this, the bus, thread)."""
        for out in outputs:
            taken = self.active.get(out.request_id)
            if taken is None:  # dropped (not claimed): its end frees room all the same
                if out.finish_reason is not None or out.error is not None:
                    self.room.set()
                continue
            if not taken.claimed:
                taken.held.append(out)
                continue
            if out.ids:
                self.metrics.tokens(len(out.ids))
            if out.texts or out.ids:
                taken.batcher.add(out.texts, out.ids, out.logprobs, out.prompt_logprobs)
            if taken.sent and (out.error is not None or out.finish_reason is not None):
                count_once(out, taken.sent)
            if out.error is not None:
                code = getattr(out.error, "code", "internal_error")
                taken.batcher.error(str(out.error), code, getattr(out.error, "data", None))
                self._end(out, failed=True)
            elif out.finish_reason is not None:
                out.timing = {"route": "local", "stage0_ms": out.timing.get("decode_ms"), **out.timing}
                # queued: on the bus until taken, then in the engine's line until its prompt started
                out.timing["queue_ms"] = round(taken.bus_wait_s * 1e3 + out.timing.get("queue_ms", 0.0), 3)
                taken.batcher.done(out.completion_tokens, out.prompt_tokens, out.finish_reason, out.timing)
                self._end(out, failed=False)

    def _end(self, out: Output, failed: bool) -> None:
        taken = self.active.pop(out.request_id)
        self.room.set()
        if not failed and "ttft_ms" in out.timing:
            self.metrics.last_ttft_s = out.timing["ttft_ms"] / 1e3
        task = asyncio.get_running_loop().create_task(self._record(out, failed, time.monotonic() - taken.started))
        self._records.add(task)
        task.add_done_callback(self._records.discard)

    async def _record(self, out: Output, failed: bool, duration: float) -> None:
        try:
            if failed:
                evt = RequestFailed(id=request_failed_id(out.request_id), request_id=out.request_id,
                                    model_id=self.model_id, load_id=self.load_id,
                                    code=getattr(out.error, "code", "internal_error"), message=str(out.error),
                                    prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                                    fellow_id=self.fellow_id)
            else:
                t = out.timing
                evt = RequestFinished(id=request_finished_id(out.request_id), request_id=out.request_id,
                                      model_id=self.model_id, load_id=self.load_id, prompt_tokens=out.prompt_tokens,
                                      completion_tokens=out.completion_tokens, finish_reason=out.finish_reason,
                                      ttft_s=t["ttft_ms"] / 1e3 if "ttft_ms" in t else None,
                                      duration_s=round(duration, 6), tokens_per_s=t.get("tokens_per_s", 0.0),
                                      timing=t, fellow_id=self.fellow_id)
            await publish_event(self.js, evt)
            log.info("request %s %s: %d prompt + %d completion tokens in %.3fs", out.request_id,
                     getattr(evt, "code", None) or getattr(evt, "finish_reason", ""), out.prompt_tokens,
                     out.completion_tokens, duration, extra=for_request(out.request_id))
        except Exception:
            log.exception("request event for %s not published", out.request_id,
                          extra=for_request(out.request_id))

    def let_go(self) -> None:
        """The load failed: the requests in flight end here with no frame and no event, for the gateway to
        move to the load that heals it (leader.moves) or to fail itself; their frames so far stay."""
        for rid in list(self.active):
            self._drop(rid)

    async def shutdown(self) -> None:
        """The requests in flight fail (the model is going); every request event is out before it returns."""
        self.stop()
        for rid, taken in list(self.active.items()):
            self.serving.cancel(rid)
            taken.batcher.error("the model was unloaded while this request was served", "model_unloaded")
        for taken in list(self.active.values()):
            try:
                await asyncio.wait_for(taken.batcher.closed.wait(), 5)
            except asyncio.TimeoutError:
                pass
        while self._records:
            await asyncio.gather(*list(self._records), return_exceptions=True)


async def _ack(msg, nak: bool = False) -> None:
    """Settle a request message; if the bus fails us, it comes back after the ack wait."""
    try:
        await (msg.nak(delay=0.05) if nak else msg.ack())
    except Exception as exc:
        log.warning("a request message was not %s: %s", "nak'd" if nak else "acked", exc)


def chat_message(m) -> dict:
    """A ChatMessage as the chat template takes it: tool calls and the id a tool result answers when present."""
    message = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = list(m.tool_calls)
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message
