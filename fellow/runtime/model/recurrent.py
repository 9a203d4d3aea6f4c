"""Stages whose layers keep a recurrent state instead of keys and values (hybrid models: Qwen3-Next's
Gated DeltaNet ``linear_attention`` layers between its full-attention ones).

A linear-attention layer folds every position of a session into states of a fixed size: its causal
convolution's last few inputs and one matrix per head (transformers' ``torch_chunk_gated_delta_rule``
for pieces, ``torch_recurrent_gated_delta_rule`` for one position). Such a state cannot be taken back
to an earlier position, nor cut at a block boundary for another session to start from, and the
project's batched views pad keys and values, which it has none of. So a stage with such layers:

- keeps each session's attention layers' keys and values in a KVCache of their own (only those layers:
  a linear one keeps no keys) and each linear layer's states beside them (``RecurrentCache``); the
  layers reach both through ``RecurrentView``, which updates the states as transformers' own
  ``LinearAttentionLayer`` does (what ``generate`` runs on);
- runs a prompt piece for one session at a time (a linear layer's chunked rule would need every row's
  padding masked), and a decode step of N sessions that have each run a position already in one batch
  (``RecurrentBatchedView``: keys and values padded as for any stage, the linear layers' states stacked
  and handed back after the step); each gets the logits it gets alone, to float32 rounding
  (``StageModel.decode``);
- cannot roll back: ``crop_to`` refuses to move back, ``StageModel.verify`` refuses, and the engines
  serve it without speculative decoding, a draft model or prefix reuse, saying so in the stage's
  ``kernels.recurrent`` (``off_note``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from fellow.runtime.model.fused import recurrent_layers
from fellow.runtime.model.kv_cache import BatchedView, KVCache

log = logging.getLogger(__name__)


SESSIONS = "prompts one at a time, decode steps batched"  # how a stage with recurrent layers runs sessions


class RollbackRefused(ValueError):
    """A session's recurrent state was asked to go back to an earlier position."""


def recurrent_reason(config, layers: Iterable[int] | None = None) -> str | None:
    """Why sessions' states cannot be rolled back or cut where ``layers`` (absolute indices; default: every
    layer of the model) include recurrent ones (one line); None where none do."""
    every = recurrent_layers(config)
    wanted = every if layers is None else sorted(set(every) & set(layers))
    if not wanted:
        return None
    return (f"layers {_spans(wanted)} are linear attention: each session keeps a recurrent state that cannot "
            f"be rolled back or cut at a position, so prompts run one session at a time, without drafts or "
            f"prefix reuse")


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 4, 5, 6] -> '0-2, 4-6'."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def off_note(stage, off: list[str], model: bool = False) -> dict:
    """What a recurrent stage's status says (``kernels.recurrent``): its linear layers (``model``: the
    whole model's, where a ring's stage 0 decides for every stage), how sessions run, what
    the engine turned ``off`` for it, and why; logged once."""
    layers = recurrent_layers(stage.config) if model else stage.recurrent_layers
    why = recurrent_reason(stage.config) if model else stage.recurrent
    note = {"layers": layers, "sessions": SESSIONS, "off": off, "why": why}
    stage.note(recurrent=note)
    log.info("linear-attention layers %s: %s%s", _spans(layers), SESSIONS,
             f"; {', '.join(off)} off" if off else "")
    return note


def without_rollback(stage, speculative: int, draft, prefix_cache: bool, model: bool = False):
    """(0, None, False): what a stage with recurrent layers serves with in place of its engine's
    ``speculative``, ``draft`` and ``prefix_cache``, noting those that were on (off_note)."""
    off = [name for name, on in (("speculative", speculative), ("draft_model", draft is not None),
                                 ("prefix_cache", prefix_cache)) if on]
    off_note(stage, off, model=model)
    return 0, None, False


class RecurrentCache:
    """One session's cache on a stage with recurrent layers: ``kv`` holds its attention layers' keys and
    values (compact: ``attention`` maps each such layer's absolute index to its slot there), ``conv`` and
    ``state`` each linear layer's convolution and recurrent states by absolute index, made by the layers'
    first forward. The KVCache's protocol where a stage and its engine use it (``length``, ``reserve``,
    ``advance``, ``release``, ``bytes``); ``crop_to`` only to where it is."""

    home = None  # never a row of a decode slab (fellow.runtime.model.forms.decode_slab)

    def __init__(self, kv: KVCache, attention: dict[int, int], linear: list[int],
                 shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]]) -> None:
        self.kv = kv
        self.attention = attention
        self.linear = linear
        self.shapes = shapes  # by linear layer: (conv state shape, recurrent state shape, conv dtype, device)
        self.conv: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def keys(self) -> list[torch.Tensor | None]:  # the attention layers' (kv_cache.random_caches fills them)
        return self.kv.keys

    @property
    def values(self) -> list[torch.Tensor | None]:
        return self.kv.values

    @property
    def bytes(self) -> int:
        states = sum(t.numel() * t.element_size() for t in (*self.conv.values(), *self.state.values()))
        return self.kv.bytes + states

    def reserve(self, positions: int) -> None:
        self.kv.reserve(positions)

    def advance(self, positions: int) -> None:
        self.kv.advance(positions)

    def crop_to(self, length: int) -> None:
        if length != self.length:
            raise RollbackRefused(f"a recurrent state cannot go back from {self.length} positions to {length}")

    def release(self) -> None:
        self.kv.release()
        self.conv.clear()
        self.state.clear()

    def fill_states(self, generator: torch.Generator | None = None) -> None:
        """Random states in every linear layer, as after some positions (what a decode step is timed on)."""
        for index in self.linear:
            conv, state, dtype, device = self.shapes[index]
            self.conv[index] = torch.randn(conv, generator=generator, dtype=dtype).to(device)
            self.state[index] = torch.randn(state, generator=generator, dtype=torch.float32).to(device)


class _NoPast:
    """What transformers' linear-attention layers ask a cache beyond the states: these views never record
    the past (no rollback), so no intermediate states are kept, and a one-position step that updates a
    convolution state in place (``increase_count``, transformers >= 5.2x) changes no count: a session's
    length is its KVCache's, advanced by the stage."""

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        return None


class RecurrentView(_NoPast):
    """What the HF layers of a stage with recurrent layers see as their cache in one session's forward:
    keys and values through the session's KVCache, convolution and recurrent states as transformers'
    ``Cache`` hands them out (``get_conv_state``, ``update_conv_state``, ... of ``LinearAttentionLayer``,
    one state a layer, never recording the past)."""

    def __init__(self, cache: RecurrentCache) -> None:
        self.cache = cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.cache.kv.write(self.cache.attention[layer_idx], key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.length

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.cache.conv.get(layer_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """A piece's new convolution inputs [1, C, q]: returns them after the kept ones (or left-padded with
        zeros to the kernel on a first piece), and keeps the last ``conv_kernel_size``."""
        past = self.cache.conv.get(layer_idx)
        if past is None:
            size = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
            full = conv_states
            if full.shape[-1] < size:
                full = F.pad(full, (size - full.shape[-1], 0), value=0)
            self.cache.conv[layer_idx] = full[..., -size:].clone()
            return full
        full = torch.cat([past, conv_states], dim=-1)
        past.copy_(full[..., -past.shape[-1]:])
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.cache.state.get(layer_idx)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self.cache.state[layer_idx] = recurrent_states
        return recurrent_states


class RecurrentBatchedView(_NoPast):
    """One decode position for several sessions in one forward, on a stage with recurrent layers.

    The attention layers attend through a BatchedView over the sessions' own KVCaches (left-padded keys
    and values, masked), addressed by each layer's slot there. Each linear layer gets the sessions' states
    stacked into one batch ([B, C, kernel] and [B, heads, key, value]): a one-position step updates the
    convolution state in place and returns a new recurrent state, and ``commit`` hands each session its
    row of both. Every session must have run a position already (``batchable``): a fresh one has no
    state to stack, and its first piece runs alone."""

    def __init__(self, caches: list[RecurrentCache]) -> None:
        self.caches = caches
        self.attention = caches[0].attention
        self.batched = BatchedView([cache.kv for cache in caches])
        self.conv: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}

    @staticmethod
    def batchable(caches) -> bool:
        return len(caches) > 1 and all(isinstance(c, RecurrentCache) and c.length > 0 and len(c.conv) == len(c.linear)
                                       and len(c.state) == len(c.linear) for c in caches)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.batched.update(key_states, value_states, self.attention[layer_idx])

    def attention_mask(self, dtype: torch.dtype, device: torch.device, window: int | None = None):
        return self.batched.attention_mask(dtype, device, window)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.batched.get_seq_length()

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        if layer_idx not in self.conv:
            self.conv[layer_idx] = torch.cat([cache.conv[layer_idx] for cache in self.caches])
        return self.conv[layer_idx]

    def update_conv_state(self, *args, **kwargs):
        raise RuntimeError("a batched step over recurrent layers takes one position a session")

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        if layer_idx not in self.state:
            self.state[layer_idx] = torch.cat([cache.state[layer_idx] for cache in self.caches])
        return self.state[layer_idx]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self.state[layer_idx] = recurrent_states
        return recurrent_states

    def commit(self) -> None:
        """Each session's new keys and values, and its rows of the stepped states; the stage then advances
        each by one."""
        self.batched.commit()
        for layer_idx, conv in self.conv.items():
            for row, cache in enumerate(self.caches):
                cache.conv[layer_idx].copy_(conv[row : row + 1])
        for layer_idx, state in self.state.items():
            for row, cache in enumerate(self.caches):
                cache.state[layer_idx] = state[row : row + 1].clone()


def state_shapes(layer: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]:
    """A Gated DeltaNet layer's convolution state [1, C, kernel] (in the stage's dtype) and recurrent state
    [1, value heads, key dim, value dim] (float32, as transformers' torch kernels keep it)."""
    attn = layer.linear_attn
    return ((1, attn.conv_dim, attn.conv_kernel_size), (1, attn.num_v_heads, attn.head_k_dim, attn.head_v_dim),
            dtype, device)
