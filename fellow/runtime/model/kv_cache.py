"""A session's keys and values per layer, in buffers grown in place, and the views layers write through."""

from __future__ import annotations

from collections.abc import Sequence

import torch

GROW_CHUNK = 64  # positions a buffer grows by: a copy of the past every 64 tokens, not every token


class KVCache:
    """One session's keys and values for a contiguous range of layers.

    The layers on one device share one buffer pair [n_layers, H_kv, capacity, D], so a batched
    step stores its new position for all of them in one copy per session. Layers write a forward's
    new positions at ``length`` and the stage calls ``advance`` once every layer has; ``crop_to``
    rolls back. Buffers are allocated on first use and grown in chunks of GROW_CHUNK positions.
    """

    def __init__(
        self,
        first_layer: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        devices: Sequence[torch.device | str],
    ) -> None:
        if len(devices) != num_layers:
            raise ValueError(f"{len(devices)} devices for {num_layers} layers")
        self.first_layer = first_layer
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.groups: list[tuple[int, int, torch.device]] = []  # local layer slots [lo, hi) on one device
        for slot, device in enumerate(torch.device(d) for d in devices):
            if self.groups and self.groups[-1][2] == device:
                self.groups[-1] = (self.groups[-1][0], slot + 1, device)
            else:
                self.groups.append((slot, slot + 1, device))
        self.where = [(g, slot - lo) for g, (lo, hi, _) in enumerate(self.groups) for slot in range(lo, hi)]
        self.keys: list[torch.Tensor | None] = [None] * len(self.groups)
        self.values: list[torch.Tensor | None] = [None] * len(self.groups)
        self.length = 0
        self.capacity = 0
        # (slab, row) while the buffers are a row of a decode batch's slab (fellow.runtime.model.forms.decode_slab)
        self.home: tuple | None = None

    @property
    def bytes(self) -> int:
        """What the buffers hold now (capacity, not length: that is what the allocator gave)."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.capacity * self.head_dim * element

    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` more positions after ``length``, growing every buffer at once."""
        needed = self.length + positions
        if needed <= self.capacity:
            return
        capacity = -(-needed // GROW_CHUNK) * GROW_CHUNK
        for g, (lo, hi, device) in enumerate(self.groups):
            self.keys[g] = self._grown(self.keys[g], hi - lo, capacity, device)
            self.values[g] = self._grown(self.values[g], hi - lo, capacity, device)
        self.capacity = capacity
        self._leave_slab()  # grown into buffers of its own

    def _grown(self, old: torch.Tensor | None, layers: int, capacity: int, device: torch.device) -> torch.Tensor:
        new = torch.empty(layers, self.num_kv_heads, capacity, self.head_dim, dtype=self.dtype, device=device)
        if old is not None and self.length:
            new[:, :, : self.length].copy_(old[:, :, : self.length])
        return new

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [1, H_kv, q, D] new positions at ``length``; return the layer's keys and values through them."""
        g, index = self.where[layer_idx - self.first_layer]
        end = self.length + keys.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache holds {self.capacity} positions, a write needs {end}: reserve first")
        key_buffer, value_buffer = self.keys[g][index : index + 1], self.values[g][index : index + 1]
        key_buffer[:, :, self.length : end].copy_(keys)
        value_buffer[:, :, self.length : end].copy_(values)
        return key_buffer[:, :, :end], value_buffer[:, :, :end]

    def write_group(self, group: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new positions [n_layers, H_kv, q, D] of every layer in one device group at ``length``."""
        end = self.length + keys.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache holds {self.capacity} positions, a write needs {end}: reserve first")
        self.keys[group][:, :, self.length : end].copy_(keys)
        self.values[group][:, :, self.length : end].copy_(values)

    def layer(self, slot: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values [1, H_kv, end, D] (by local slot; ``end`` defaults to ``length``)."""
        end = self.length if end is None else end
        g, index = self.where[slot]
        return self.keys[g][index : index + 1, :, :end], self.values[g][index : index + 1, :, :end]

    def advance(self, positions: int) -> None:
        self.length += positions

    def copy_from(self, other: "KVCache", positions: int) -> None:
        """This (empty) cache holds a copy of ``other``'s first ``positions`` positions (a forked session)."""
        if self.length:
            raise ValueError("a cache copies another's positions only while it holds none")
        self.reserve(positions)
        for g in range(len(self.groups)):
            self.keys[g][:, :, :positions].copy_(other.keys[g][:, :, :positions])
            self.values[g][:, :, :positions].copy_(other.values[g][:, :, :positions])
        self.length = positions

    def crop_to(self, length: int) -> None:
        """Forget every position from ``length`` on; the buffers keep their capacity."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = length

    def release(self) -> None:
        """Drop the buffers now rather than whenever the session object goes."""
        self.keys = [None] * len(self.groups)
        self.values = [None] * len(self.groups)
        self.length = self.capacity = 0
        self._leave_slab()

    def _leave_slab(self) -> None:
        if self.home is not None:
            slab, row = self.home
            self.home = None
            slab.forget(row)


def random_caches(new_cache, rows: int, positions: int, room: int,
                  generator: torch.Generator | None = None, tile: int = 0) -> list[KVCache]:
    """``rows`` caches from ``new_cache()``, each holding ``positions`` random positions and room for
    ``room`` more: what a stage's decode step is timed or checked on. ``tile``: only the first ``tile``
    positions are drawn, and repeated over the rest (a step's time does not depend on the values; drawing
    a 1B model's eight caches of 256 positions took 0.15-0.2 s on two cores). A stage with recurrent
    layers (fellow.runtime.model.recurrent) gets random states in them too (``fill_states``)."""
    caches = [new_cache() for _ in range(rows)]
    for cache in caches:
        cache.reserve(positions + room)
        for buffers in (cache.keys, cache.values):
            for buffer in buffers:
                if not tile or tile >= positions:
                    buffer.normal_(generator=generator)
                    continue
                buffer[:, :, :tile].normal_(generator=generator)
                for start in range(tile, positions, tile):
                    end = min(start + tile, positions)
                    buffer[:, :, start:end].copy_(buffer[:, :, : end - start])
        if (fill_states := getattr(cache, "fill_states", None)) is not None:
            fill_states(generator)
        cache.advance(positions)
    return caches


class SessionView:
    """What an HF attention layer sees as its cache for one session's forward (a prompt piece or one position)."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.cache.write(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.length


class BatchedView:
    """One decode position for several sessions in one forward.

    Each attention layer gets the sessions' keys and values left-padded to the longest (padding
    zeroed, and masked by ``attention_mask``), with every row's new position last. The padded
    buffers are shared by all layers of one forward: a layer's attention is done before the next
    layer fills them. ``commit`` then stores each session's new position in its own cache, once
    per device group rather than once per layer, so sessions join and leave batches freely.
    """

    def __init__(self, caches: Sequence[KVCache]) -> None:
        self.caches = list(caches)
        self.first_layer = self.caches[0].first_layer
        self.lengths = [cache.length for cache in self.caches]
        self.width = max(self.lengths) + 1  # the longest past plus the new position
        self.runs = self._runs(self.lengths)
        self._padded: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._new: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.caches[0].num_layers
        # every row's past per layer, cut once per step: [slot][row] -> [H_kv, length, D]
        self._past_keys, self._past_values = self._pasts("keys"), self._pasts("values")

    def _pasts(self, kind: str) -> list[list[torch.Tensor]]:
        per_row = []
        for cache, length in zip(self.caches, self.lengths):
            layers: list[torch.Tensor] = []
            for buffer in getattr(cache, kind):
                layers.extend(buffer[:, :, :length].unbind(0))
            per_row.append(layers)
        return [list(layer) for layer in zip(*per_row)]

    @staticmethod
    def _runs(lengths: list[int]) -> list[tuple[int, int, int]]:
        """Rows [lo, hi) of one length: each run is copied with one cat per layer, not one copy per row."""
        runs, lo = [], 0
        for row in range(1, len(lengths) + 1):
            if row == len(lengths) or lengths[row] != lengths[lo]:
                runs.append((lo, row, lengths[lo]))
                lo = row
        return runs

    def _buffers(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buffers = self._padded.get(like.device)
        if buffers is None:
            shape = (len(self.caches), like.shape[1], self.width, like.shape[3])
            buffers = (torch.zeros(shape, dtype=like.dtype, device=like.device),
                       torch.zeros(shape, dtype=like.dtype, device=like.device))
            self._padded[like.device] = buffers
        return buffers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        slot = layer_idx - self.first_layer
        keys, values = self._buffers(key_states)  # [B, H_kv, width, D]
        past_keys, past_values = self._past_keys[slot], self._past_values[slot]
        for lo, hi, length in self.runs:
            if length:
                start = self.width - 1 - length
                torch.stack(past_keys[lo:hi], out=keys[lo:hi, :, start:-1])
                torch.stack(past_values[lo:hi], out=values[lo:hi, :, start:-1])
        keys[:, :, -1:].copy_(key_states)
        values[:, :, -1:].copy_(value_states)
        self._new[slot] = (key_states, value_states)
        return keys, values

    def commit(self) -> None:
        """Store every row's new position in its session's cache; the stage then advances each by one."""
        for g, (lo, hi, _) in enumerate(self.caches[0].groups):
            new_keys = torch.stack([self._new[slot][0] for slot in range(lo, hi)])  # [n, B, H_kv, 1, D]
            new_values = torch.stack([self._new[slot][1] for slot in range(lo, hi)])
            for row, cache in enumerate(self.caches):
                cache.write_group(g, new_keys[:, row], new_values[:, row])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width - 1

    def attention_mask(self, dtype: torch.dtype, device: torch.device,
                       window: int | None = None) -> torch.Tensor | None:
        """The additive mask [B, 1, 1, width] that hides each row's left padding and, for a layer with a
        sliding ``window``, every key more than ``window - 1`` positions back (every row's new position
        is the last column, so that is the columns before ``width - window``); None when it hides nothing."""
        windowed = window is not None and self.width > window
        if len(self.runs) == 1 and not windowed:
            return None
        columns = torch.arange(self.width, device=device)
        starts = torch.tensor([self.width - 1 - n for n in self.lengths], device=device)
        hidden = columns[None, :] < starts[:, None]
        if windowed:
            hidden |= columns[None, :] < self.width - window
        mask = torch.zeros(len(self.caches), 1, 1, self.width, dtype=dtype, device=device)
        return mask.masked_fill_(hidden[:, None, None, :], torch.finfo(dtype).min)


class FreshBatchView:
    """First prompt pieces of several sessions with empty caches, left-padded into one forward.

    A layer attends to the batch's own keys and values (padding masked by the stage's mask); each
    row's real positions, without its padding, go straight into its session's cache.
    """

    def __init__(self, caches: Sequence[KVCache], pads: Sequence[int]) -> None:
        self.caches = list(caches)
        self.pads = list(pads)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        for row, (cache, pad) in enumerate(zip(self.caches, self.pads)):
            cache.write(layer_idx, key_states[row : row + 1, :, pad:], value_states[row : row + 1, :, pad:])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
