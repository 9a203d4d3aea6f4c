"""A middle or last stage of a ring: decode what comes in, run its blocks per session, pass on or sample."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from core.logs import stage_stats_s
from events.loads import PREFILL_CHUNK
from events.requests import Sampling
from events.ring import DECODE, LAST_PIECE, NO_TOKEN, PREFIX_MISSING, VERIFY, End, Hidden, Probe, Token
from fellow.runtime.engine.drafting import until_stop
from fellow.runtime.engine.padded import fits_padded, padded_batches, padded_layers
from fellow.runtime.engine.prefix_cache import PrefixCache
from fellow.runtime.engine.processors import constraint_for, sample_next
from fellow.runtime.engine.prompt_scores import scored_piece
from fellow.runtime.engine.sampling import make_generator
from fellow.runtime.engine.scheduler import Follower
from fellow.runtime.engine.serving_loop import StepStats
from fellow.runtime.engine.speculative import verify_drafts
from fellow.runtime.model.recurrent import off_note
from fellow.runtime.ring.drafts import LastStageDrafter
from fellow.runtime.ring.held import Held
from fellow.runtime.ring.inbox import Inbox
from fellow.runtime.ring.loader import RingStage

log = logging.getLogger(__name__)


class FrameError(ValueError):
    """A frame this stage cannot run for its session; that session alone fails."""

    code = "stage_failed"


class PrefixMissing(FrameError):
    """A first frame reuses positions this stage's prefix cache no longer holds: stage 0 starts over."""

    code = PREFIX_MISSING


class RingWorker:
    """Runs frames as they come; I/O-free: ``send(frame, lane=None)`` is the link's.

    A middle stage has no embeddings and no head: it decodes with the receiver half of the boundary
    before it, runs its blocks with its own KV cache per session, and encodes with the sender half
    of the boundary after it. The last stage samples with the sampling named in the session's first
    frame and sends the token straight back to stage 0. Decode frames that wait together run as one
    batch; a session's other frames keep their order behind it. A frame that fails ends only its
    own session: stage 0 is told on the token lane.

    With ``prefix_tokens`` > 0 the stage keeps ended sessions' positions (an End with ``keep``) in its
    own PrefixCache, within that many KV tokens together with the live sessions' reservations, and a
    first frame that reuses a prefix copies it from there (fellow.runtime.ring.head says who decides).
    A stage with recurrent layers keeps none (fellow.runtime.model.recurrent), and runs a decode batch's
    sessions batched over stacked states (fellow.runtime.model.recurrent). A last stage with a ``drafter``
    (fellow.runtime.ring.drafts) sends its draft model's guesses with the answers of frames that ask.
    """

    def __init__(self, ring: RingStage, inbox: Inbox, send: Callable[..., None], max_batch: int = 0,
                 prefix_tokens: int = 0, route: Callable[[], str] | None = None, kv_tokens: int = 0,
                 drafter: LastStageDrafter | None = None) -> None:
        self.ring, self.stage = ring, ring.stage
        self.kv_tokens = kv_tokens  # what this stage holds, told to stage 0 on every probe
        self.step_ms = 0.0  # its decode step at a decode group's rows, when measured at load; told the same way
        self.inbox, self.send = inbox, send
        self.is_last = ring.plan.is_last
        self.max_batch = max_batch
        self.padded_layers = padded_layers(self.stage)  # what a batch's padded copy counts over (engine.padded)
        self.held: dict[str, Held] = {}
        self.drafter = drafter if self.is_last else None
        if self.stage.recurrent is not None:  # recurrent layers: no positions kept for reuse (stage 0 reuses none)
            off_note(self.stage, ["prefix_cache"] if prefix_tokens > 0 else [])
            prefix_tokens = 0
        self.prefix = PrefixCache() if prefix_tokens > 0 else None
        self.ledger = Follower(kv_tokens)  # what stage 0 admitted for each session it holds
        self.prefix_tokens = prefix_tokens
        self.route = route or (lambda: "r")  # how this stage's frames leave now: "d" direct, "r" relay
        self.running = True
        self.last_active = time.monotonic()
        self.frames = 0
        self._step_no = 0
        self.stats = StepStats(ring.plan.stage, stage_stats_s())  # the spec's [stageN stats 30s] line

    def run(self) -> None:
        while self.running:
            frames = self.inbox.take(0.5)
            if frames:
                self.last_active = started = time.monotonic()
                self.handle(frames)
                self.stats.step(started, time.monotonic(), len(frames))
            else:
                self.stats.idle()

    def stop(self) -> None:
        self.running = False
        self.inbox.put(("wake",))

    def handle(self, frames: list) -> None:
        batch: list[Hidden] = []
        for frame in frames:
            if not isinstance(frame, (Hidden, End, Probe)):
                continue
            session = getattr(frame, "session", None)
            if isinstance(frame, Hidden) and frame.kind == DECODE and all(f.session != session for f in batch):
                batch.append(frame)
                if self.max_batch and len(batch) >= self.max_batch:
                    self._decode(batch)
                    batch = []
                continue
            if session is not None and any(f.session == session for f in batch):
                self._decode(batch)  # its earlier position first
                batch = []
                if isinstance(frame, Hidden) and frame.kind == DECODE:
                    batch.append(frame)
                    continue
            self._one(frame)
        if batch:
            self._decode(batch)

    # --- one frame at a time -----------------------------------------------------------------

    def _one(self, frame) -> None:
        self.frames += 1
        if isinstance(frame, Probe):
            self.send(Probe(nonce=frame.nonce, routes=frame.routes + self.route(), kv=[*frame.kv, self.kv_tokens],
                            step_ms=[*frame.step_ms, self.step_ms],
                            drafter=self.drafter.name if self.drafter is not None else ""))
        elif isinstance(frame, End):
            held = self.held.get(frame.session)
            if held is not None:
                if 0 <= frame.length < held.cache.length:  # drafts of its last VERIFY frame that fell
                    held.cache.crop_to(frame.length)
                    del held.ids[frame.length:]
                if frame.keep and self.prefix is not None and len(held.ids) == held.cache.length:
                    self.prefix.insert(held.ids, held.cache)
                self._drop(frame.session)  # last: a session is gone from held once its blocks are kept
                self._fit_prefix()
            if not self.is_last:
                self.send(frame)
        elif not self._stale(frame):
            try:
                self._piece(frame)
            except Exception as exc:
                self._fail(frame.session, exc, frame.attempt)

    def _piece(self, frame: Hidden) -> None:
        started = time.perf_counter()
        if frame.first:  # a fresh cache (with its reused prefix), and its sampling for the last stage
            self._drop(frame.session)
            params = frame.sampling.sampling if frame.sampling is not None else Sampling()
            generator = make_generator(params, self.stage.output_device) if self.is_last else None
            ring = frame.sampling
            held = Held(self.stage.new_cache(), params, generator,
                         prompt_ids=list(ring.prompt_ids) if ring else [],
                         stop_ids=frozenset(ring.stop_ids) if ring else frozenset(),
                         output_ids=list(ring.output_ids) if ring else [],
                         ids=list(frame.reuse), attempt=frame.attempt)
            if self.is_last and params.grammar:  # a replayed session's grammar resumes after its reply so far
                tokenizer, stop_ids = self.ring.grammar_tokenizer()
                held.constraint = constraint_for(tokenizer, params.grammar, stop_ids, held.output_ids)
            self.held[frame.session] = held
            self.ledger.hold(frame.session, frame.reserve)
            self._fit_prefix()
            if frame.reuse and (self.prefix is None or not self.prefix.take(held.cache, list(frame.reuse))):
                raise PrefixMissing(f"stage {self.ring.index} no longer holds the {len(frame.reuse)} cached "
                                    f"position(s) stage 0 reused")
        held = self._held(frame)
        hidden = self.ring.receiver.decode([(frame.data, frame.scale)], frame.positions, self.stage.dtype,
                                           self.stage.input_device)
        if frame.kind == VERIFY and self.is_last:
            self._verify(frame, held, hidden, started)
            return
        scored: list = []
        scored_at = 0 if frame.pos == 0 else frame.pos + 1  # the prompt position of scored[0]
        if self.is_last and held.sampling.prompt_logprobs is not None and frame.kind != VERIFY:
            out, scored = scored_piece(self.stage, held.cache, hidden, held.prompt_ids, frame.pos,
                                       held.sampling.prompt_logprobs)  # a scored prompt: every position's logits
        else:
            out = self.stage.forward_piece(held.cache, hidden)
        held.ids += frame.ids
        held.unverified = frame.positions - 1 if frame.kind == VERIFY else 0
        if not self.is_last:
            (data, scale), = self.ring.sender.encode(out)
            self.send(Hidden(session=frame.session, pos=frame.pos, positions=frame.positions, data=data,
                             scale=scale, kind=frame.kind, sampling=frame.sampling,
                             compute_ms=[*frame.compute_ms, _ms(started)], ids=frame.ids, reuse=frame.reuse,
                             reserve=frame.reserve, routes=frame.routes + self.route(), attempt=frame.attempt,
                             draft=frame.draft, draft_k=frame.draft_k))
        elif frame.kind == LAST_PIECE:
            token = sample_next(out[None], [held])[0]
            logprob = held.sampled(token)
            self.send(Token(session=frame.session, token=token, compute_ms=[*frame.compute_ms, _ms(started)],
                            logprob=logprob, routes=frame.routes + self.route(), attempt=frame.attempt,
                            prompt=scored, prompt_pos=scored_at, draft=self._guesses([frame]).get(frame.session, [])))
        else:
            self.send(Token(session=frame.session, token=NO_TOKEN, attempt=frame.attempt, prompt=scored,
                            prompt_pos=scored_at))

    def _verify(self, frame: Hidden, held: Held, hidden: torch.Tensor, started: float) -> None:
        """The last stage checks a VERIFY frame's drafts (fellow.runtime.engine.speculative, exact) and
        answers every token the pass gained; its cache keeps the last token and the drafts that stood."""
        logits = self.stage.piece_logits(held.cache, hidden)  # [1 + drafts, V]
        gained = until_stop(verify_drafts(logits, list(frame.draft), held), held.stop_ids)
        held.cache.crop_to(frame.pos + len(gained))
        held.ids = (held.ids + frame.ids)[: held.cache.length] if frame.ids else held.ids
        held.output_ids += [token for token, _ in gained]
        wants = held.sampling.logprobs is not None
        self.send(Token(session=frame.session, token=NO_TOKEN, tokens=[t for t, _ in gained],
                        logprobs=[lp for _, lp in gained] if wants else [],
                        compute_ms=[*frame.compute_ms, _ms(started)], routes=frame.routes + self.route(),
                        attempt=frame.attempt, draft=self._guesses([frame]).get(frame.session, [])))

    # --- decode batches ----------------------------------------------------------------------

    def _decode(self, frames: list[Hidden]) -> None:
        self.frames += len(frames)
        runnable = []
        for frame in frames:
            if self._stale(frame):
                continue
            try:
                self._held(frame)
                runnable.append(frame)
            except FrameError as exc:
                self._fail(frame.session, exc, frame.attempt)
        room = self.ledger.budget.free + PREFILL_CHUNK  # beside a prompt piece's room, as on stage 0
        for batch in padded_batches(runnable, lambda f: self.held[f.session].cache.length, 0,
                                    lambda rows, longest: fits_padded(self.padded_layers, rows, longest, room)):
            self._decode_some(batch)

    def _decode_some(self, runnable: list[Hidden]) -> None:
        try:
            self._decode_batch(runnable)
        except Exception as exc:
            if len(runnable) == 1:
                self._fail(runnable[0].session, exc, runnable[0].attempt)
                return
            log.warning("a decode batch of %d failed; running its frames one at a time", len(runnable))
            for frame in runnable:
                try:
                    self._decode_batch([frame])
                except Exception as exc:
                    self._fail(frame.session, exc, frame.attempt)

    def _decode_batch(self, frames: list[Hidden]) -> None:
        started = time.perf_counter()
        held = [self.held[f.session] for f in frames]
        hidden = self.ring.receiver.decode([(f.data, f.scale) for f in frames], 1, self.stage.dtype,
                                           self.stage.input_device)  # [B, 1, H]
        out = self.stage.decode([h.cache for h in held], hidden)
        for frame, h in zip(frames, held):
            h.ids += frame.ids
        self._step_no += 1
        if self.is_last:
            tokens = sample_next(out, held)
            logprobs = [h.sampled(token) for token, h in zip(tokens, held)]
            guesses = self._guesses(frames)
            elapsed = _ms(started)
            for frame, token, logprob in zip(frames, tokens, logprobs):
                self.send(Token(session=frame.session, token=token, batch=len(frames), step=self._step_no,
                                compute_ms=[*frame.compute_ms, elapsed], logprob=logprob,
                                routes=frame.routes + self.route(), attempt=frame.attempt,
                                draft=guesses.get(frame.session, [])))
            return
        rows = self.ring.sender.encode(out)
        elapsed = _ms(started)
        for frame, (data, scale) in zip(frames, rows):
            self.send(Hidden(session=frame.session, pos=frame.pos, positions=1, data=data, scale=scale,
                             batch=len(frames), step=self._step_no, compute_ms=[*frame.compute_ms, elapsed],
                             ids=frame.ids, routes=frame.routes + self.route(), attempt=frame.attempt,
                             draft_k=frame.draft_k))

    # --- sessions ----------------------------------------------------------------------------

    def _held(self, frame: Hidden) -> Held:
        held = self.held.get(frame.session)
        if held is None:
            raise FrameError(f"stage {self.ring.index} holds no session {frame.session!r}")
        if held.unverified and frame.pos < held.cache.length <= frame.pos + held.unverified:
            held.cache.crop_to(frame.pos)  # the drafts of its last VERIFY frame that did not stand
            del held.ids[frame.pos:]
        held.unverified = 0
        if held.cache.length != frame.pos:
            raise FrameError(f"stage {self.ring.index} holds {held.cache.length} position(s) of this session; "
                             f"a frame for position {frame.pos} does not follow them")
        return held

    def _fit_prefix(self) -> None:
        """Kept blocks make room for the live sessions' reservations, as stage 0 admitted them."""
        if self.prefix is not None:
            self.prefix.fit(self.ledger.reserved, self.prefix_tokens)

    def _drop(self, session: str) -> None:
        held = self.held.pop(session, None)
        self.ledger.drop(session)
        if held is not None:
            held.cache.release()
        if self.drafter is not None:
            self.drafter.release(session)

    def _guesses(self, frames: list[Hidden]) -> dict[str, list[int]]:
        """The draft model's guesses after the tokens just answered, for the frames that asked."""
        if self.drafter is None:
            return {}
        try:  # a guess is never needed: a draft model that fails costs the drafts, not the tokens
            return self.drafter.after([(f.session, f.draft_k, self.held[f.session].prompt_ids
                                        + self.held[f.session].output_ids) for f in frames if f.draft_k])
        except Exception as exc:
            log.warning("stage %d: the draft model failed, no drafts this time: %s", self.ring.index, exc)
            return {}

    def _stale(self, frame: Hidden) -> bool:
        """A frame of a try its session has given up (stage 0 replayed it or started it over): dropped."""
        held = self.held.get(frame.session)
        return held is not None and frame.attempt < held.attempt

    def _fail(self, session: str, exc: Exception, attempt: int = 0) -> None:
        """This session alone ends: its cache goes, and stage 0 hears of it on the token lane."""
        log.warning("stage %d failed session %s: %s", self.ring.index, session, exc)
        self._drop(session)
        self.send(Token(session=session, token=NO_TOKEN, error=f"stage {self.ring.index}: {exc}",
                        code=getattr(exc, "code", "stage_failed"), attempt=attempt), lane="tok")


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1e3, 3)
