"""The one-stage runner: prompt pieces and batched decode steps on a stage that holds the whole model."""

from __future__ import annotations

import time

import torch

from fellow.runtime.engine.draft_model import DraftModel
from fellow.runtime.engine.drafting import until_stop
from fellow.runtime.engine.forks import fork, late, twins
from fellow.runtime.engine.padded import fits_padded, padded_batches, padded_layers
from fellow.runtime.engine.processors import sample_next
from fellow.runtime.engine.prompt_scores import scored_piece
from fellow.runtime.engine.sampling import make_generator
from fellow.runtime.engine.scheduler import Scheduler, StepResult
from fellow.runtime.engine.session import Session
from fellow.runtime.engine.speculative import verify_drafts
from fellow.runtime.model.stage import StageModel


def local_engine(stage: StageModel, *, kv_tokens: int, max_batch: int = 0, prefill_chunk: int = 256,
                 prefix_cache: bool = True, speculative: int = 0, draft: DraftModel | None = None) -> Scheduler:
    """A scheduler over a LocalRunner: what serves a one-stage load."""
    return Scheduler(LocalRunner(stage), kv_tokens=kv_tokens, max_batch=max_batch, prefill_chunk=prefill_chunk,
                     prefix_cache=prefix_cache, speculative=speculative, draft=draft)


class LocalRunner:
    """Computes a scheduler's steps on a stage that holds the whole model (a ring of one). Free of I/O.

    Each step runs prompt pieces of at most ``prefill_chunk`` tokens in all (at least one piece; 0 runs
    one whole prompt), so a long prompt does not hold up the others' decode for long, and then one
    decode position for every decoding session, in batches of at most ``max_batch`` (0: no cap, 1: off).
    A session whose prompt ended in this step decodes from the next one: its first token goes out with
    the step's result instead of waiting for a decode pass (one decode step of time to first token).

    With speculative decoding on (the scheduler's ``speculative`` k > 0), a batch in which any session
    drafted (``Scheduler.drafts``) runs as one verify pass (``StageModel.verify``: every session's last
    token and its drafts), ``verify_drafts`` keeps what the model agrees with plus one token of its own,
    and each cache is cropped to what stood. Sessions with and without drafts share the pass.
    """

    def __init__(self, stage: StageModel) -> None:
        if not (stage.is_first and stage.is_last):
            raise ValueError("the engine serves a stage that holds the embeddings and the head")
        self.stage = stage
        self.rolls_back = stage.recurrent is None
        self.last_prefill_batch = 0  # prompts in the last step's padded prefill (0: none batched)

    def attach(self, scheduler: Scheduler) -> None:
        self.sched = scheduler

    def adopt(self, session: Session) -> Session:
        return session

    def start(self, session: Session) -> None:
        session.generator = make_generator(session.sampling, self.stage.output_device, self.stage.config.vocab_size)

    def ended(self, session: Session, kept: bool) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def run(self, result: StepResult) -> None:
        self._prefill(result)
        self._decode(result)

    def _prefill(self, result: StepResult) -> None:
        # sessions with a prompt another has run start from its positions; those with a prompt another is
        # running wait to fork from it (engine.forks)
        if self.rolls_back:
            late(list(self.sched.sessions.values()))
        waiting = twins(self.sched.sessions.values()) if self.rolls_back else {}
        held = {s.session_id for group in waiting.values() for s in group}
        spent = self._prefill_fresh(result, waiting, held)
        for session in [s for s in self.sched.sessions.values() if s.prefilling and s.session_id not in held]:
            if spent and (self.sched.prefill_chunk == 0 or spent >= self.sched.prefill_chunk):
                break
            left = len(session.prompt_ids) - session.prefilled
            size = min(left, self.sched.prefill_chunk) if self.sched.prefill_chunk else left
            if session.prefill_started_at is None:
                session.prefill_started_at = time.perf_counter()
            piece = torch.tensor(session.prompt_ids[session.prefilled : session.prefilled + size],
                                 device=self.stage.input_device)
            if session.sampling.prompt_logprobs is None:
                logits = self.stage.forward_piece(session.cache, piece)
            else:  # the prompt's own logprobs: every position's logits (engine.prompt_scores)
                logits, scored = scored_piece(self.stage, session.cache, piece, session.prompt_ids, session.prefilled,
                                              session.sampling.prompt_logprobs)
                session.prompt_logprobs += scored
            session.prefilled += size
            spent += size
            if not session.prefilling:  # the prompt's last piece starts the reply (and its twins')
                self._first_tokens([session], logits[None], waiting, result)

    def _first_tokens(self, sources: list[Session], logits: torch.Tensor, waiting: dict[str, list[Session]],
                      result: StepResult) -> None:
        """Each source's first token from its row of ``logits`` [B, V], and its twins' from the same row
        once they hold a copy of its positions (before a token that ends it releases its cache)."""
        rows, picks = [], []
        for i, source in enumerate(sources):
            forks = waiting.get(source.session_id, [])
            if forks:
                fork(source, forks)
            rows += [source, *forks]
            picks += [i] * (1 + len(forks))
        tokens = sample_next(logits[picks], rows)  # a copy of the rows: processors change their own
        now = time.perf_counter()
        for session, token in zip(rows, tokens):
            self.sched.accept(session, token, now, result)

    def _prefill_fresh(self, result: StepResult, waiting: dict[str, list[Session]], held: set[str]) -> int:
        """Whole short prompts that arrived together go through in one forward, left-padded (rows x
        longest counted against prefill_chunk); one prompt alone, or a long one, takes the loop below."""
        fresh = [s for s in self.sched.sessions.values() if s.prefilled == 0 and s.sampling.prompt_logprobs is None
                 and s.session_id not in held
                 and (not self.sched.prefill_chunk or len(s.prompt_ids) <= self.sched.prefill_chunk)]
        batch: list[Session] = []
        for session in fresh:
            if self.sched.max_batch and len(batch) == self.sched.max_batch:  # SWARM_SERVE_MAX_BATCH caps these too
                break
            width = max([len(session.prompt_ids)] + [len(s.prompt_ids) for s in batch])
            if self.sched.prefill_chunk and (len(batch) + 1) * width > self.sched.prefill_chunk:
                break
            batch.append(session)
        self.last_prefill_batch = len(batch) if len(batch) >= 2 else 0
        if not self.last_prefill_batch:
            return 0
        started = time.perf_counter()
        for session in batch:
            session.prefill_started_at = started
        logits = self.stage.prefill_fresh([s.cache for s in batch], [s.prompt_ids for s in batch])
        for session in batch:
            session.prefilled = len(session.prompt_ids)
        self._first_tokens(batch, logits, waiting, result)
        return len(batch) * max(len(s.prompt_ids) for s in batch)

    def _decode(self, result: StepResult) -> None:
        # what has a token in the result already got its first one from its prompt in this step
        decoding = [s for s in self.sched.sessions.values() if not s.prefilling and s.session_id not in result.tokens]
        drafts = self.sched.drafts(decoding) if self.sched.speculative else {}
        batches = self._decode_batches(decoding)
        self.sched.last_batches = [len(batch) for batch in batches]
        for batch in batches:
            if any(drafts.get(s.session_id) for s in batch):
                self._verify(batch, drafts, result)
                continue
            started = time.perf_counter()
            ids = torch.tensor([s.next_input for s in batch], device=self.stage.input_device)
            logits = self.stage.decode([s.cache for s in batch], ids)
            tokens = sample_next(logits, batch)
            now = time.perf_counter()
            for session, token in zip(batch, tokens):
                session.decode_s += now - started
                session.decode_steps += 1
                self.sched.accept(session, token, now, result)

    def _verify(self, batch: list[Session], drafts: dict[str, list[int]], result: StepResult) -> None:
        """One pass of ``[next_input, *drafts]`` for every session of the batch (sessions without
        drafts run their one position), then each cache cropped to the positions that stood."""
        started = time.perf_counter()
        inputs = [[s.next_input, *drafts.get(s.session_id, [])] for s in batch]
        lengths = [s.cache.length for s in batch]
        logits = self.stage.verify([s.cache for s in batch], inputs)
        gains = [until_stop(verify_drafts(rows, ids[1:], s), s.stop_ids) for s, rows, ids in zip(batch, logits, inputs)]
        now = time.perf_counter()
        for session, ids, length, gained in zip(batch, inputs, lengths, gains):
            drafted = len(ids) - 1
            session.cache.crop_to(length + len(gained))  # the input and the drafts that stood
            session.decode_s += now - started
            session.decode_steps += 1
            if drafted:
                session.record_pass(drafted, len(gained))
            for token, logprob in gained:
                session.pending_logprob = logprob
                if self.sched.accept(session, token, now, result):
                    break

    def _decode_batches(self, sessions: list[Session]) -> list[list[Session]]:
        """Batches of at most max_batch; sessions of similar length together, so padding stays small, and
        each cut where its padded copy would not fit (fellow.runtime.engine.padded)."""
        layers = padded_layers(self.stage)
        room = self.sched.budget.free + (self.sched.prefill_chunk or 256)
        return padded_batches(sessions, lambda s: s.cache.length, self.sched.max_batch,
                              lambda rows, longest: fits_padded(layers, rows, longest, room))
