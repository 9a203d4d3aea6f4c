"""A draft model beside a one-stage engine (the spec's TS9): a small model with the served model's
tokenizer guesses the next tokens of every session, and the engine's verify pass checks them.

Each session gets its own KV cache in the draft model, created on its first draft. Before a pass
the cache is brought in step with the session's sequence (prompt, then the reply so far): the
positions after the first token that differs (a draft that fell) are cropped, and the tokens it has
not seen yet run as one piece. Then it proposes up to k tokens greedily (argmax), one batched
decode step per token for all sessions that draft. A greedy draft is a deterministic function of
the sequence, a point mass, so ``verify_drafts`` keeps greedy replies identical and sampled ones
exactly distributed (standard speculative sampling with q = the point mass on the draft).

On CUDA the one-token steps replay a fixed-shape decoder captured as CUDA graphs
(``fellow.runtime.model.forms.draft_graph``): a session then keeps its cache in one of the decoder's
slots while it fits (its sequence and drafts within a slot's positions, a slot free); one that does
not has its own growing cache and steps eagerly beside them. ``decoder_label`` says which runs.

A draft model in half precision (float16 on CUDA) times one row through its largest weight in its
own precision and upcast to float32 per matmul (``fellow.runtime.model.load.half_storage``): where the
upcast is clearly faster it computes in float32 over its half-precision weights and cache, at no extra
memory (``upcast``, shown in the stage's kernels).

The draft model's KV memory counts in the stage's token budget: a session's positions in both
models may reach its reservation, so each budget token holds one position of the served model and
one of the draft model (``budget_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from fellow.runtime.model.forms.draft_graph import EAGER, FixedDecoder, SlotCache, fixed_decoder
from fellow.runtime.model.forms.plan_steps import plan_draft_steps
from fellow.runtime.model.kv_cache import KVCache
from fellow.runtime.model.load.half_storage import apply_half_storage
from fellow.runtime.model.stage import StageModel

PIECE_BATCH = 16  # catch-ups up to this long run together in one pass; longer ones (a prompt) alone
LOOKUP_FIRST_RUN = 3  # prompt lookup drafts first when its tail match is at least this long and full


class DraftModelMismatch(ValueError):
    """The draft model cannot draft for this model: another vocabulary, or not a whole model."""


def check_same_vocabulary(target_tokenizer, draft_tokenizer) -> None:
    """Raise DraftModelMismatch unless the two tokenizers map the same strings to the same ids."""
    target, draft = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target == draft:
        return
    differ = sum(1 for token, i in target.items() if draft.get(token) != i) + len(set(draft) - set(target))
    raise DraftModelMismatch(
        f"the draft model's tokenizer is not the served model's ({len(draft):,} tokens against {len(target):,}, "
        f"{differ:,} differ): a draft model must share the served model's vocabulary")


def kv_bytes_per_position(stage: StageModel) -> int:
    """One position's keys and values over all of a stage's layers."""
    element = torch.tensor([], dtype=stage.dtype).element_size()
    return 2 * len(stage.layers) * stage.num_kv_heads * stage.head_dim * element


@dataclass
class _State:
    """A session's draft cache and the tokens whose positions it holds."""

    cache: object
    ids: list[int] = field(default_factory=list)
    checked: int = 0  # ids[:checked] are known to be the session's own (its sequence only grows)


class DraftModel:
    """A whole small model (embeddings to head) that proposes greedy drafts for a one-stage engine."""

    def __init__(self, stage: StageModel, target: StageModel, name: str = "draft",
                 decoder: FixedDecoder | None = None) -> None:
        if not (stage.is_first and stage.is_last):
            raise DraftModelMismatch("a draft model must be a whole model (embeddings, every layer and the head)")
        if stage.recurrent is not None:  # its drafts that fall are cropped from its caches
            raise DraftModelMismatch(f"the draft model {name!r} cannot draft: {stage.recurrent}")
        if stage.config.vocab_size != target.config.vocab_size:
            raise DraftModelMismatch(
                f"the draft model {name!r} has {stage.config.vocab_size:,} token ids where the served model has "
                f"{target.config.vocab_size:,}: a draft model must share the served model's vocabulary")
        self.stage = stage
        self.name = name
        self.position_bytes = kv_bytes_per_position(stage)
        # what a draft position costs in the served model's positions
        self.ratio = self.position_bytes / kv_bytes_per_position(target)
        self.states: dict[str, _State] = {}
        self.use_decoder(decoder)
        self.upcast: dict = {}  # half_storage's times and verdict, per device, where it is half precision

    def use_decoder(self, decoder: FixedDecoder | None, label: str | None = None) -> None:
        """Step through ``decoder`` (None: eagerly): its slots' steps replay it, the others step eagerly."""
        self.decoder = decoder
        self.decoder_label = label or (decoder.label if decoder is not None else EAGER)
        plan_draft_steps(self.stage, decoder)

    def budget_tokens(self, kv_tokens: int) -> int:
        """The engine's budget when ``kv_tokens`` positions of the served model's cache fit: each budget
        token then holds a position in both models."""
        tokens = int(kv_tokens / (1.0 + self.ratio))
        if tokens < 1:
            raise ValueError(f"a budget of {kv_tokens} tokens leaves no room beside the draft model's cache")
        return tokens

    @property
    def positions(self) -> int:
        """Positions its caches hold now, all sessions together."""
        return sum(state.cache.length for state in self.states.values())

    def release(self, session_id: str) -> None:
        state = self.states.pop(session_id, None)
        if state is not None:
            state.cache.release()

    @torch.inference_mode()
    def propose(self, rows: list[tuple[str, list[int], int, frozenset[int]]]) -> dict[str, list[int]]:
        """Greedy drafts for each ``(session_id, sequence, limit, stop_ids)``: up to ``limit`` tokens
        after ``sequence``, stopping after a stop id."""
        if not rows:
            return {}
        stage = self.stage
        caches, catches = [], []
        for session_id, sequence, limit, _ in rows:
            state = self.states.get(session_id)
            if state is None:
                state = self.states[session_id] = _State(self._new_cache(len(sequence) + limit))
            elif isinstance(state.cache, SlotCache) and len(sequence) + limit > state.cache.capacity:
                state.cache = self._unslotted(state.cache)
            same = state.checked
            end = min(len(state.ids), len(sequence))
            while same < end and state.ids[same] == sequence[same]:
                same += 1
            same = min(same, len(sequence) - 1)  # at least one token to run: the logits after the last
            state.cache.crop_to(same)
            caches.append(state.cache)
            catches.append(sequence[same:])
        logits: list[torch.Tensor | None] = [None] * len(rows)
        short = [i for i, ids in enumerate(catches) if len(ids) <= PIECE_BATCH]
        if short:
            for i, out in zip(short, stage.verify([caches[i] for i in short], [catches[i] for i in short])):
                logits[i] = out[-1]
        for i, ids in enumerate(catches):
            if logits[i] is None:
                logits[i] = stage.prefill(caches[i], torch.tensor(ids, device=stage.input_device), PIECE_BATCH * 16)
        drafts = {session_id: [int(torch.argmax(out))] for (session_id, *_), out in zip(rows, logits)}
        active = [i for i, (session_id, _, limit, stops) in enumerate(rows)
                  if limit > 1 and drafts[session_id][-1] not in stops]
        step = 1
        while active:
            slotted = [i for i in active if isinstance(caches[i], SlotCache)]
            others = [i for i in active if not isinstance(caches[i], SlotCache)]
            for group in (slotted, others):  # each one step of the stage's table: the decoder's, the eager one
                if group:
                    ids = torch.tensor([drafts[rows[i][0]][-1] for i in group], device=stage.input_device)
                    out = stage.decode([caches[i] for i in group], ids).argmax(dim=-1).tolist()
                    for i, token in zip(group, out):
                        drafts[rows[i][0]].append(int(token))
            step += 1
            active = [i for i in active if rows[i][2] > step and drafts[rows[i][0]][-1] not in rows[i][3]]
        for (session_id, sequence, _, _), cache in zip(rows, caches):
            state = self.states[session_id]
            state.ids = (list(sequence) + drafts[session_id])[: cache.length]
            state.checked = len(sequence)
        return drafts

    def _new_cache(self, needed: int) -> KVCache:
        """A slot of the fixed-shape decoder when one is free and holds ``needed`` positions, else a cache of
        its own."""
        slot = self.decoder.take(needed) if self.decoder is not None else None
        return slot if slot is not None else self.stage.new_cache()

    def _unslotted(self, slot: SlotCache) -> KVCache:
        """A session outgrowing its slot: its positions copied into a cache of its own, the slot freed."""
        cache = self.stage.new_cache()
        cache.reserve(slot.length)
        for mine, theirs in ((cache.keys, slot.keys), (cache.values, slot.values)):
            mine[0][:, :, : slot.length].copy_(theirs[0][:, :, : slot.length])
        cache.advance(slot.length)
        slot.release()
        return cache


def load_draft_model(draft_dir: str | Path, target_stage: StageModel, target_tokenizer, device: torch.device,
                     *, packed: bool = True, batch_cap: int = 8, capture=None) -> DraftModel:
    """Load the servable at ``draft_dir`` as a whole model on ``device`` and check it against the served
    one; on CUDA its steps are captured (``draft_graph.fixed_decoder``, ``batch_cap`` slots), else eager."""
    from events.stage import StageOptions
    from fellow.runtime.model.load.loader import load_one_stage

    # its steps get a fixed-shape decoder of their own below, not the served stage's pool of graphs
    loaded = load_one_stage(draft_dir, str(device), StageOptions(packed_linear=packed, max_batch=batch_cap,
                                                                 cuda_graphs=False))
    check_same_vocabulary(target_tokenizer, loaded.tokenizer)
    draft = DraftModel(loaded.stage, target_stage, name=loaded.manifest.model_id)
    draft.upcast = apply_half_storage(loaded.stage)  # before the capture: the graphs run what it chose
    draft.use_decoder(*fixed_decoder(loaded.stage, slots=batch_cap, capture=capture))
    return draft
