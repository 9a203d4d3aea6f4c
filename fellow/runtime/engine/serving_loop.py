"""The thread that drives the engine: takes jobs, steps, detokenizes, spots stop strings, reports out."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from core.logs import stage_stats_s
from events.frames import TokenLogprob
from events.requests import Sampling
from fellow.runtime.engine.detokenizer import Detokenizer, TokenTexts
from fellow.runtime.engine.processors import constraint_for
from fellow.runtime.engine.scheduler import Scheduler
from fellow.runtime.engine.session import Session

log = logging.getLogger(__name__)


@dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop: list[str] = field(default_factory=list)
    replayed: int = 0  # the prompt's last ids that are a moved reply's so far (events.moves)
    text_sent: int = 0  # characters of their text the client has

    @property
    def earlier_ids(self) -> list[int]:
        """The reply's ids an earlier stage made (a moved request's), which it goes on from."""
        return self.prompt_ids[len(self.prompt_ids) - self.replayed:]


@dataclass(frozen=True)
class Cancel:
    request_id: str
    reason: str = "cancelled"


class Wake:
    """Nothing to do but look again (the loop is stopping)."""


Inbound = Job | Cancel | Wake  # what the serving loop's inbox carries


@dataclass
class Output:
    """What one step produced for one request: text pieces, ids, and the end if it ended."""

    request_id: str
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    timing: dict = field(default_factory=dict)
    error: Exception | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per id, when the request asked
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # the prompt's, once, first


class _Reply:
    """Per request: the detokenizer and the text held back while it may be the start of a stop string."""

    def __init__(self, job: Job, tokenizer):
        self.job = job
        earlier = job.earlier_ids
        self.detok = Detokenizer(tokenizer, job.prompt_ids[:len(job.prompt_ids) - len(earlier)])
        # a moved reply: its ids replayed as they were made, and what of their text the client lacks is held
        # back again (part of a character stays in the detokenizer, what may start a stop string is pending)
        self.pending = "".join(self.detok.add(token) for token in earlier)[job.text_sent:]
        self.stopped = False
        self.logprobs_out = 0  # the session's logprobs already in an Output
        self.prompt_out = False  # its prompt's logprobs are in an Output
        self.ids_out = 0  # ids already in an Output (a verify pass may gain ids past a stop string)

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        stops = self.job.stop
        if not stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = max((k for s in stops for k in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:k])), default=0)
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out, False


class StepStats:
    """The spec's periodic line, ``[stageN stats 30s] batch_size=… batch_ms=… wait_ms=…``: the mean
    batch, step time and time between steps over each `interval_s` of traffic; idle time writes none."""

    def __init__(self, stage: int, interval_s: float):
        self.stage = stage
        self.interval_s = interval_s
        self._reset(None)

    def _reset(self, at: float | None) -> None:
        self.since = at  # the first step of this window; None until traffic
        self.steps = self.sessions = 0
        self.step_s = self.wait_s = 0.0
        self.last_end: float | None = None

    def step(self, started: float, ended: float, batch: int) -> None:
        if self.since is None:
            self.since = started
        elif self.last_end is not None:
            self.wait_s += started - self.last_end
        self.steps += 1
        self.sessions += batch
        self.step_s += ended - started
        self.last_end = ended
        if ended - self.since >= self.interval_s:
            n = self.steps
            log.info("[stage%d stats %gs] batch_size=%.2f batch_ms=%.2f wait_ms=%.2f steps=%d", self.stage,
                     self.interval_s, self.sessions / n, self.step_s * 1e3 / n,
                     self.wait_s * 1e3 / max(1, n - 1), n)
            self._reset(None)

    def idle(self) -> None:
        """Nothing to step: the wait until the next traffic is not a step's wait."""
        self.last_end = None


class ServingLoop:
    """Owns the scheduler on one thread; `submit` and `cancel` are safe from any thread.

    `deliver(outputs)` is called on this thread after every step with at least one output; the
    caller hands them to its event loop. ``samples_here``: the scheduler's runner samples on this stage,
    so a request's grammar is compiled here (a ring's last stage samples instead). ``wake`` is called
    after anything goes into the inbox, for a runner that waits on an inbox of its own.
    """

    def __init__(self, engine: Scheduler, tokenizer, stop_ids: frozenset[int], deliver: Callable[[list[Output]], None],
                 stage: int = 0, samples_here: bool = True, wake: Callable[[], None] | None = None):
        self.engine = engine
        self.stats = StepStats(stage, stage_stats_s())
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.deliver = deliver
        self.samples_here = samples_here
        self.wake = wake or (lambda: None)
        self.inbox: queue.SimpleQueue[Inbound] = queue.SimpleQueue()
        self.replies: dict[str, _Reply] = {}
        self.texts = TokenTexts(tokenizer)
        self.running = True
        self.last_active = time.monotonic()
        self.between: Callable[[], object] | None = None  # called between steps (a background compile's swap)
        self.thread = threading.Thread(target=self._run, name="serving-loop", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def run_here(self) -> None:
        """Drive the engine on the calling thread until `stop`."""
        self._run()

    def _put(self, item: Inbound) -> None:
        self.inbox.put(item)
        self.wake()

    def submit(self, job: Job) -> None:
        """A job whose tokens were offered to the scheduler (``Scheduler.offer``) or are taken at admission."""
        self._put(job)

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self._put(Cancel(request_id, reason))

    def stop(self) -> None:
        self.running = False
        self._put(Wake())

    def _drain(self, block: bool) -> list[Output]:
        refused: list[Output] = []
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return refused
        while True:
            if isinstance(item, Job):
                try:
                    self._add(item)
                except Exception as exc:  # refused: the scheduler gave its tokens back
                    refused.append(Output(item.request_id, prompt_tokens=len(item.prompt_ids), error=exc))
            elif isinstance(item, Cancel) and item.request_id in self.replies:
                self.engine.cancel(item.request_id, item.reason)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return refused

    def _add(self, job: Job) -> None:
        try:
            session = Session(job.request_id, job.prompt_ids, job.max_new_tokens, sampling=job.sampling,
                              stop_ids=self.stop_ids, earlier_ids=job.earlier_ids)
            if self.samples_here:
                session.constraint = constraint_for(self.tokenizer, session.sampling.grammar, self.stop_ids,
                                                    job.earlier_ids)
        except Exception:
            self.engine.withdraw(job.request_id)
            raise
        self.engine.add(session)
        self.replies[job.request_id] = _Reply(job, self.tokenizer)

    def _run(self) -> None:
        while self.running:
            if self.between is not None:
                self.between()
            outputs = self._drain(block=not self.engine.busy)
            if self.engine.busy:
                self.last_active = started = time.monotonic()
                batch = len(self.replies)
                try:
                    outputs += self._step()
                except Exception as exc:  # a failed step fails its sessions, not the process
                    log.exception("engine step failed")
                    outputs += self._fail_all(exc)
                self.stats.step(started, time.monotonic(), batch)
            else:
                self.stats.idle()
            if outputs:
                self.deliver(outputs)

    def _step(self) -> list[Output]:
        result = self.engine.step()
        outputs: dict[str, Output] = {}
        ended = {s.session_id: s for s in result.finished}
        for sid in [*result.tokens, *ended]:  # a scored prompt's logprobs go out before its first token
            reply, session = self.replies.get(sid), self.engine.sessions.get(sid) or ended.get(sid)
            if reply is not None and session is not None and session.prompt_logprobs and not reply.prompt_out:
                reply.prompt_out = True
                outputs.setdefault(sid, Output(sid)).prompt_logprobs = [self.texts.logprob(e)
                                                                        for e in session.prompt_logprobs]
        for sid, tokens in result.tokens.items():
            reply = self.replies.get(sid)
            if reply is None or reply.stopped:
                continue
            out = outputs.setdefault(sid, Output(sid))
            session = self.engine.sessions.get(sid) or ended.get(sid)
            for token in tokens:
                if session is not None and reply.logprobs_out < len(session.logprobs):
                    out.logprobs.append(self.texts.logprob(session.logprobs[reply.logprobs_out]))
                    reply.logprobs_out += 1
                text, hit = reply.feed(reply.detok.add(token))
                out.ids.append(token)
                reply.ids_out += 1
                out.texts.append(text)  # one per token, "" included: the leader counts a reply's tokens by them
                if hit:
                    reply.stopped = True
                    self.engine.cancel(sid, "stop")
                    break
        for session in result.finished:
            reply = self.replies.pop(session.session_id, None)
            if reply is None:
                continue
            out = outputs.setdefault(session.session_id, Output(session.session_id))
            out.error = session.error
            if not reply.stopped:
                tail, _ = reply.feed(reply.detok.flush())
                tail += reply.pending
                if tail and out.texts:
                    out.texts[-1] += tail  # the last token's text
                elif tail:
                    out.texts.append(tail)  # a piece of no token, after the ids
            out.finish_reason = session.finish_reason or "stop"
            out.completion_tokens = reply.ids_out if reply.stopped else len(session.output_ids)
            out.prompt_tokens = len(session.prompt_ids)
            out.timing = session.timing()
        return list(outputs.values())

    def _fail_all(self, exc: Exception) -> list[Output]:
        outs = []
        for sid, reply in list(self.replies.items()):
            self.engine.cancel(sid, "error")
            outs.append(Output(sid, prompt_tokens=len(reply.job.prompt_ids), error=exc))
        self.replies.clear()
        try:
            self.engine.step()  # applies the cancels: caches and reservations are given back
        except Exception:
            log.exception("engine could not release failed sessions")
        return outs
