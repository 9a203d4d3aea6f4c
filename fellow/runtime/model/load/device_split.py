"""How one stage's layers are split over its fellow's devices by free memory: the cards balanced, each
filled to the same share of what it may take, and the CPU last, for what no card holds (offload).
Arithmetic only, no torch: the plan is data, from an inventory (plan_devices), tested with cards that
are not here.

Each layer costs its weight bytes (quantized or not: weights.stage_sizes) plus the keys and values of
a reserve of KV tokens; the embeddings go with the first device that takes layers, the final norm and
the head with the last. Contiguous ranges keep the hidden states crossing devices once per boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GB = 1e9
MIB = 1 << 20
CUDA_USABLE = 0.85  # of what is free on a card: the allocator fragments, and other buffers come and go
CUDA_KEEP_BYTES = 300 * MIB  # passing buffers of a forward besides the weights and the cache
CPU_WEIGHTS_USABLE = 0.8  # of the host's available memory, for offloaded layers (the rest: the process, KV)
SHARE_STEPS = 40  # bisections of the cards' common share: far below a byte of a card


class SplitError(ValueError):
    """The stage does not fit its devices, even with the CPU; the message says so in one line."""


@dataclass(frozen=True)
class Part:
    """The layers [lo, hi) (absolute) on one device, with what they take there."""

    device: str
    layers: tuple[int, int]
    weight_bytes: int  # the layers' weights, and the embeddings or head where this part has them
    kv_bytes: int  # the reserve of KV tokens for these layers
    embed: bool = False
    head: bool = False

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def describe(self) -> str:
        lo, hi = self.layers
        extra = "".join((" +embed" if self.embed else "", " +head" if self.head else ""))
        span = f"layer {lo}" if hi - lo == 1 else f"layers {lo}-{hi - 1}" if hi > lo else "no layers"
        return f"{self.device}: {span}{extra}, {size(self.weight_bytes)} weights + {size(self.kv_bytes)} KV"


def size(n: int) -> str:
    """Bytes for a log line: GB, or MB below a tenth of one."""
    return f"{n / GB:.2f} GB" if n >= GB / 10 or n == 0 else f"{n / 1e6:.1f} MB"


@dataclass(frozen=True)
class DeviceSplit:
    parts: tuple[Part, ...]

    @property
    def devices(self) -> list[str]:
        return [p.device for p in self.parts]

    def layer_devices(self) -> list[str]:
        """Each layer's device, in order."""
        return [p.device for p in self.parts for _ in range(*p.layers)]

    @property
    def embed_device(self) -> str:
        return next((p.device for p in self.parts if p.embed), self.parts[0].device)

    @property
    def head_device(self) -> str:
        return next((p.device for p in self.parts if p.head), self.parts[-1].device)

    def describe(self) -> str:
        """One line for the load's log: which layers on which device, and the bytes each."""
        return "; ".join(p.describe() for p in self.parts)

    def as_dicts(self) -> list[dict]:
        """For the load's status (StageModel.kernels.devices)."""
        return [{"device": p.device, "layers": list(p.layers), "weight_bytes": p.weight_bytes,
                 "kv_bytes": p.kv_bytes, "embed": p.embed, "head": p.head} for p in self.parts]


def plan_split(layer_bytes: Sequence[int], devices: Sequence[tuple[str, int]], *, first_layer: int = 0,
               embed_bytes: int = 0, head_bytes: int = 0, kv_token_bytes: int = 0,
               kv_tokens: int = 0) -> DeviceSplit:
    """Contiguous layer ranges over ``devices`` ((name, bytes it may take), in order: GPUs, then "cpu").

    ``layer_bytes``: each layer's weight bytes, from ``first_layer`` on; ``embed_bytes`` / ``head_bytes``:
    the embeddings (stage 0) and the final norm plus head (the last stage), 0 where the stage has none;
    ``kv_token_bytes``: one layer's keys and values for one token; ``kv_tokens``: the tokens each layer
    keeps room for. Each device takes layers in order while they fit; a device that fits none is left
    out. SplitError when even the last device cannot take what is left.
    """
    if not layer_bytes:
        raise SplitError("a stage needs at least one layer")
    if not devices:
        raise SplitError("no device to load the stage on")
    kv = kv_token_bytes * kv_tokens
    costs = [b + kv for b in layer_bytes]
    n, i, parts = len(costs), 0, []
    for name, free in devices:
        embed = embed_bytes if not parts else 0  # the embeddings go with the first device that takes layers
        used, j = embed, i
        while j < n and used + costs[j] <= free:
            used += costs[j]
            j += 1
        head = j == n
        while head and j > i and used + head_bytes > free:  # the head must fit beside the last layers
            j -= 1
            used -= costs[j]
            head = False
        if j == i:
            continue
        parts.append(Part(name, (first_layer + i, first_layer + j), sum(layer_bytes[i:j]) + embed
                          + (head_bytes if head else 0), kv * (j - i), embed=embed > 0, head=head and head_bytes > 0))
        i = j
        if head:
            return DeviceSplit(tuple(parts))
    need = sum(costs) + embed_bytes + head_bytes
    held = ", ".join(f"{name} {free / GB:.2f}" for name, free in devices)
    raise SplitError(f"the stage needs {need / GB:.2f} GB ({n} layers, their weights and {kv_tokens} KV tokens) "
                     f"and its devices hold {held} GB: layers from {first_layer + i} on fit nowhere, "
                     f"even on the last device")


@dataclass(frozen=True)
class Card:
    """One entry of a device inventory: ``name`` as torch spells it ("cuda:1", "cpu"), what is free on it,
    and a card's compute capability (None for the CPU); ``label`` names the card in a log line."""

    name: str
    free_bytes: int
    capability: tuple[int, int] | None = None
    label: str = ""
    take: int | None = None  # what it may take, where given outright (a test's made-up budget)

    @property
    def is_gpu(self) -> bool:
        return self.name.startswith("cuda")

    @property
    def usable_bytes(self) -> int:
        """What the stage may take here: on a card 85 % of what is free less 300 MiB (kv_budget keeps the
        same margins), on the CPU 80 % of the host's available memory."""
        if self.take is not None:
            return self.take
        if self.is_gpu:
            return max(0, int(CUDA_USABLE * self.free_bytes) - CUDA_KEEP_BYTES)
        return int(CPU_WEIGHTS_USABLE * self.free_bytes)


AMPERE = (8, 0)  # bfloat16 in hardware from here; older cards emulate it, far slower than float16


def half_dtype(capability: tuple[int, int] | None) -> str:
    """A card's half precision for weights and compute: bfloat16 on Ampere or newer, float16 before."""
    return "bfloat16" if capability is not None and capability >= AMPERE else "float16"


def by_free_memory(inventory: Sequence[Card]) -> list[Card]:
    """The cards with the most free memory first (ties in the inventory's order), the CPU last."""
    cards = sorted((c for c in inventory if c.is_gpu), key=lambda c: -c.free_bytes)
    return cards + [c for c in inventory if not c.is_gpu]


def plan_devices(inventory: Sequence[Card], layer_bytes: Sequence[int], *, first_layer: int = 0,
                 embed_bytes: int = 0, head_bytes: int = 0, kv_token_bytes: int = 0,
                 kv_tokens: int = 0) -> DeviceSplit:
    """The stage's layers over an inventory in its order (by_free_memory orders one), balanced over the
    cards: each card takes the same share of what it may take (Card.usable_bytes), the smallest share
    at which the cards hold the whole stage, as training spreads its blocks. Where the cards cannot
    hold it all, each is filled and the CPU (or whatever device follows them) takes the rest.
    SplitError as plan_split's. Arguments past the inventory: plan_split's."""
    sizes = dict(first_layer=first_layer, embed_bytes=embed_bytes, head_bytes=head_bytes,
                 kv_token_bytes=kv_token_bytes, kv_tokens=kv_tokens)
    budgets = [(c.name, c.usable_bytes) for c in inventory]
    cards = [(c.name, c.usable_bytes) for c in inventory if c.is_gpu]

    def on_cards(share: float) -> DeviceSplit | None:
        try:
            return plan_split(layer_bytes, [(name, int(share * free)) for name, free in cards], **sizes)
        except SplitError:
            return None

    best = on_cards(1.0) if cards else None
    if best is None:  # the cards alone cannot hold it: fill them in order, the rest after them
        return plan_split(layer_bytes, budgets, **sizes)
    low, high = 0.0, 1.0
    for _ in range(SHARE_STEPS):  # a bigger share never fits less, so bisect to the smallest that fits
        middle = (low + high) / 2
        if (split := on_cards(middle)) is None:
            low = middle
        else:
            high, best = middle, split
    return best
