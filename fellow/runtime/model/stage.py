"""A serving stage: a contiguous range of HF decoder layers, with the embeddings on stage 0 and the head on the last.

Over 350 lines: one class whose forward paths (a piece, fresh prompts side by side, a verify pass, recurrent
sessions) share its layer loop, embedding and head, which the decode forms of model/forms/eager_steps.py run too; its
masks live in model/masks.py.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import msgspec
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from events.stage_kernels import StageKernels
from fellow.runtime.model.forms.eager_steps import eager_forms
from fellow.runtime.model.fused import (
    FusedLayer,
    FusedStack,
    Linear,
    MakeLinear,
    bias_of,
    layer_windows,
    recurrent_layers,
    rotary_tables,
    strip_linears,
)
from fellow.runtime.model.grouped_attention import GROUPED
from fellow.runtime.model.kv_cache import FreshBatchView, KVCache, SessionView
from fellow.runtime.model.masks import fresh_masks, piece_mask
from fellow.runtime.model.recurrent import (
    RecurrentCache,
    RecurrentView,
    RollbackRefused,
    recurrent_reason,
    state_shapes,
)
from fellow.runtime.steps.table import StepTable

BATCHABLE_ATTENTION = ("sdpa", "eager", GROUPED)  # implementations that take an explicit additive 4D mask
# cuDNN attention rebuilt its plan for every new key length: 52 ms a decode step on an H200 where
# flash / memory-efficient took 8 ms (a Qwen3 of 42M parameters, bf16, batches of 8 and 32)
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _cache_keyword(layer: nn.Module) -> str:
    """The name a decoder layer's forward takes its cache by (transformers renamed it in 5.x)."""
    names = inspect.signature(layer.forward).parameters
    for name in ("cache", "past_key_values", "past_key_value"):
        if name in names:
            return name
    raise TypeError(f"{type(layer).__name__}.forward takes no cache argument")


def _module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class StageModel:
    """Runs one session's prompt pieces and batched decode positions through its layers.

    A stage is a ring of one when it holds the embeddings, every layer, the final norm and the head.
    Stage 0 takes token ids; later stages take hidden states. The last stage returns logits of the
    last position only; the others return hidden states of every position they ran.

    A stage with recurrent layers (``recurrent``: why, else None; fellow.runtime.model.recurrent) keeps
    each session in a RecurrentCache, runs prompt pieces for one session at a time and decode steps
    batched (RecurrentBatchedView); it cannot roll
    a session back (no ``verify``).
    """

    def __init__(
        self,
        config,
        layers: Sequence[nn.Module],
        first_layer: int,
        rotary_emb: nn.Module,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        head: nn.Module | None = None,
    ) -> None:
        if (norm is None) != (head is None):
            raise ValueError("the final norm and the head come together, on the last stage")
        attention = getattr(config, "_attn_implementation", None) or "eager"
        if attention not in BATCHABLE_ATTENTION:
            raise ValueError(f"attention {attention!r} cannot take a padded batch; "
                             f"load with one of {BATCHABLE_ATTENTION}")
        if not layers:
            raise ValueError("a stage needs at least one decoder layer")
        windows = layer_windows(config)  # ValueError for kinds not served (fused.unserved_kinds)
        # each layer's window (None: full attention); every mask is made once a forward per window
        self.layer_windows = [windows[first_layer + slot] for slot in range(len(layers))]
        self.windows = set(self.layer_windows)
        # absolute indices of the layers with a recurrent state (linear attention), and why that means one
        # session at a time and no rollback; None where there are none
        indices = range(first_layer, first_layer + len(layers))
        self.recurrent_layers = [i for i in recurrent_layers(config) if i in indices]
        self.recurrent: str | None = recurrent_reason(config, indices)
        # per slot: the layer attends to keys and values (else it keeps a recurrent state and takes no mask)
        self.attends = [first_layer + slot not in self.recurrent_layers for slot in range(len(layers))]
        self.config = config
        self.layers = list(layers)
        self.first_layer = first_layer
        self.rotary_emb = rotary_emb
        self.embed, self.norm, self.head = embed, norm, head
        self.attention = attention
        self.layer_devices = [_module_device(layer) for layer in self.layers]
        self.dtype = next(self.layers[0].parameters()).dtype
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._cache_keyword = _cache_keyword(self.layers[0])
        self._input_device = _module_device(embed) if embed is not None else self.layer_devices[0]
        self._head_device = _module_device(head) if head is not None else None
        self.fused: FusedStack | None = None  # set by ``fuse``: the layers then run by hand
        self.kernels = StageKernels(path="hf")  # how it computes, for the load's status: written by ``note``
        # its quantization and measured weight bytes, for the status (quant.report.weights_report)
        self.weights: dict = {}
        # its decode forms, fastest first (model.plan_steps fills it at load; the eager forms until then)
        self.steps = StepTable(eager_forms(self))
        self.plain_weights = None  # while it loads with SWARM_SERVE_COMPILE: compiled.PlainWeights

    def note(self, **fields) -> StageKernels:
        """Record how it computes (``StageKernels``' fields, each noted by the module its comment names): the one
        way its status report is written."""
        self.kernels = msgspec.structs.replace(self.kernels, **fields)
        return self.kernels

    def take_plain_weights(self):
        """Hand its plain weights to what compiles a step from them (forms/plan_steps), keeping none."""
        plain, self.plain_weights = self.plain_weights, None
        return plain

    def fuse(self, make_linear: MakeLinear, fused_layers: Sequence[FusedLayer] | None = None) -> FusedStack:
        """Run the layers fused (fellow.runtime.model.fused), each weight made by ``make_linear`` (which
        picks its kernel); the HF layers' linear weights are dropped, so the stage holds each weight once.
        ``fused_layers``: the layers fused already as they loaded (a quantized stage), in order."""
        self.fused = FusedStack(fused_layers or self.layers, self.config, make_linear)
        self.steps = StepTable(eager_forms(self))  # the fused step is its eager form now
        for layer in self.layers:
            strip_linears(layer)
        if type(self.head) is nn.Linear:
            self.head = _HeadLinear(make_linear(self.head.weight.detach(), bias_of(self.head)))
        return self.fused

    @classmethod
    def from_causal_lm(cls, model: nn.Module, start: int = 0, end: int | None = None) -> "StageModel":
        """Layers [start, end) of an HF causal LM, with embeddings when start is 0 and the head when end is the last."""
        decoder = model.model
        end = len(decoder.layers) if end is None else end
        return cls(
            config=model.config,
            layers=decoder.layers[start:end],
            first_layer=start,
            rotary_emb=decoder.rotary_emb,
            embed=decoder.embed_tokens if start == 0 else None,
            norm=decoder.norm if end == len(decoder.layers) else None,
            head=model.lm_head if end == len(decoder.layers) else None,
        )

    @property
    def is_first(self) -> bool:
        return self.embed is not None

    @property
    def is_last(self) -> bool:
        return self.head is not None

    @property
    def input_device(self) -> torch.device:
        return self._input_device

    @property
    def output_device(self) -> torch.device | None:
        """Where the logits come out (and sampling generators live); None before the last stage."""
        return self._head_device

    def new_cache(self) -> KVCache | RecurrentCache:
        if self.graphed is not None and (pooled := self.graphed.take()) is not None:
            return pooled  # a slot of the pool its decode steps replay over (fellow.runtime.model.forms.cuda_graphs)
        if self.recurrent is not None:  # keys and values of the attention layers only, states of the others
            slots = [slot for slot, attends in enumerate(self.attends) if attends]
            kv = KVCache(0, len(slots), self.num_kv_heads, self.head_dim, self.dtype,
                         [self.layer_devices[slot] for slot in slots])
            shapes = {self.first_layer + slot: state_shapes(layer, self.dtype, device)
                      for slot, (layer, device) in enumerate(zip(self.layers, self.layer_devices))
                      if not self.attends[slot]}
            return RecurrentCache(kv, {self.first_layer + slot: n for n, slot in enumerate(slots)},
                                  self.recurrent_layers, shapes)
        return KVCache(self.first_layer, len(self.layers), self.num_kv_heads, self.head_dim,
                       self.dtype, self.layer_devices)

    @torch.inference_mode()
    def prefill(self, cache: KVCache, inputs: torch.Tensor, prefill_chunk: int = 0) -> torch.Tensor:
        """A whole prompt (or a stage's share of it) in pieces of ``prefill_chunk`` positions (0: at once).

        Returns what the last piece returns: the last position's logits [V], or hidden states [1, q, H].
        """
        total = inputs.shape[0] if self.is_first else inputs.shape[1]
        chunk = prefill_chunk if prefill_chunk > 0 else total
        out = None
        for start in range(0, total, chunk):
            piece = inputs[start : start + chunk] if self.is_first else inputs[:, start : start + chunk]
            out = self.forward_piece(cache, piece)
        return out

    @torch.inference_mode()
    def forward_piece(self, cache: KVCache, inputs: torch.Tensor) -> torch.Tensor:
        """One session's next positions: ids [q] on stage 0, hidden [1, q, H] after it."""
        hidden = self._piece(cache, inputs)
        return self.head_last(hidden)[0] if self.is_last else hidden

    @torch.inference_mode()
    def verify(self, caches: Sequence[KVCache], inputs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """A decode pass in which a session may run several positions (its last token and the tokens
        drafted after it): ``inputs[i]`` are session i's ids. Returns each session's logits at every
        position it ran, [len(inputs[i]), V]; the caller crops each cache to the positions that stand.

        Fused layers run every session's positions in one forward; the HF layers run one forward
        per session. A stage with recurrent layers refuses (RollbackRefused): its caches cannot be cropped.
        """
        if not (self.is_first and self.is_last):
            raise ValueError("a verify pass runs on a stage that holds the embeddings and the head")
        if self.recurrent is not None:
            raise RollbackRefused(f"no verify pass: {self.recurrent}")
        if self.fused is None:
            return [self._head_all(self._piece(cache, torch.tensor(list(ids), device=self.input_device)))[0]
                    for cache, ids in zip(caches, inputs)]
        widths = [len(ids) for ids in inputs]
        hidden = self.embed_ids(torch.tensor([[t for ids in inputs for t in ids]], device=self.input_device))
        for cache, width in zip(caches, widths):
            cache.reserve(width)
        position_ids = torch.cat([torch.arange(cache.length, cache.length + width)
                                  for cache, width in zip(caches, widths)])[None, :].to(hidden.device)
        hidden = self.run_fused(hidden, position_ids, self.fused.attend_packed(caches, widths))
        for cache, width in zip(caches, widths):
            cache.advance(width)
        return list(self._head_all(hidden)[0].split(widths))

    @torch.inference_mode()
    def piece_logits(self, cache: KVCache, inputs: torch.Tensor) -> torch.Tensor:
        """The stage that holds the head: one session's next positions (hidden [1, q, H], or ids [q] where
        it holds the embeddings too) and the logits at every one of them [q, V], for a verify pass or a
        prompt's logprobs. It moves the session forward only, so a stage with recurrent layers runs it too."""
        if not self.is_last:
            raise ValueError("logits come from the stage that holds the head")
        return self._head_all(self._piece(cache, inputs))[0]

    def _piece(self, cache: KVCache, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_ids(inputs.view(1, -1)) if self.is_first else inputs
        positions = hidden.shape[1]
        cache.reserve(positions)
        position_ids = torch.arange(cache.length, cache.length + positions, device=hidden.device)[None, :]
        masks = {window: piece_mask(cache.length, positions, hidden, window, self.attention)
                 for window in self.windows}
        if self.fused is not None:
            hidden = self.run_fused(hidden, position_ids, self.fused.attend_piece(cache, masks))
        else:
            view = RecurrentView(cache) if self.recurrent is not None else SessionView(cache)
            hidden = self.run_layers(hidden, position_ids, masks, view)
        cache.advance(positions)
        return hidden

    @torch.inference_mode()
    def prefill_fresh(self, caches: Sequence[KVCache], pieces: Sequence[Sequence[int]]) -> torch.Tensor:
        """The first prompt pieces of several sessions whose caches are empty, in one forward.

        Rows are left-padded to the longest; each row sees only its own positions, causally. One
        bigger matrix product per layer instead of one small one per session. Stage 0 only (ids);
        returns the last position's logits [B, V] on a last stage, hidden [B, q, H] otherwise.
        """
        if not self.is_first:
            raise ValueError("fresh batched prompts start on the stage that holds the embeddings")
        if self.recurrent is not None:
            return self.each_alone(caches, [torch.as_tensor(list(p), dtype=torch.long) for p in pieces])
        width = max(len(p) for p in pieces)
        pads = [width - len(p) for p in pieces]
        ids = torch.zeros(len(pieces), width, dtype=torch.long)
        for row, piece in enumerate(pieces):
            ids[row, pads[row]:] = torch.as_tensor(list(piece), dtype=torch.long)
        hidden = self.embed_ids(ids)
        for cache, piece in zip(caches, pieces):
            if cache.length:
                raise ValueError("prefill_fresh takes sessions with empty caches")
            cache.reserve(len(piece))
        masks, position_ids = fresh_masks(self.windows, pads, width, hidden.dtype, hidden.device)
        if self.fused is not None:
            hidden = self.run_fused(hidden, position_ids, self.fused.attend_fresh(caches, pads, masks))
        else:
            hidden = self.run_layers(hidden, position_ids, masks, FreshBatchView(caches, pads))
        for cache, piece in zip(caches, pieces):
            cache.advance(len(piece))
        return self.head_last(hidden) if self.is_last else hidden

    @torch.inference_mode()
    def decode(self, caches: Sequence[KVCache], inputs: torch.Tensor) -> torch.Tensor:
        """One new position for each session: ids [B] on stage 0, hidden [B, 1, H] after it; logits [B, V] on
        the last stage, hidden [B, 1, H] before it. The step table's first form that takes the batch runs it."""
        return self.steps.decode(caches, inputs)

    @property
    def compiled(self):
        """The checked steps that serve (inductor's graphs, the native step), in the table's ``compiled`` slot."""
        return self.steps.get("compiled")

    @property
    def graphed(self):
        """The CUDA-graph pool whose steps replay (cuda_graphs.GraphedDecode), in the table's slot."""
        return self.steps.get("cuda_graphs")

    def each_alone(self, caches: Sequence[RecurrentCache], inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each session's positions (ids [q] on stage 0, hidden [1, q, H] after it) in a forward of its own,
        in order: the last position's logits [B, V] on the last stage, else hidden [B, q, H], a shorter
        session's left-padded with zeros."""
        outs = [self._piece(cache, piece) for cache, piece in zip(caches, inputs)]
        if self.is_last:
            return self.head_last(torch.cat([out[:, -1:] for out in outs]))
        width = max(out.shape[1] for out in outs)
        return torch.cat([F.pad(out, (0, 0, width - out.shape[1], 0)) for out in outs])

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids.to(self.input_device))

    def run_fused(self, hidden: torch.Tensor, position_ids: torch.Tensor, attend) -> torch.Tensor:
        cos, sin = rotary_tables(*self.rotary_emb(hidden, position_ids))
        return self.fused.forward(hidden, cos, sin, attend)

    def run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor, masks: dict, view) -> torch.Tensor:
        """The HF layers; ``masks``: by window (None: full attention), the mask of the layers with it."""
        if hidden.device.type != "cuda":
            return self._run_layers(hidden, position_ids, masks, view)
        with sdpa_kernel(CUDA_SDPA_BACKENDS):
            return self._run_layers(hidden, position_ids, masks, view)

    def _run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor, masks: dict, view) -> torch.Tensor:
        device = hidden.device
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer, layer_device, window, attends in zip(self.layers, self.layer_devices, self.layer_windows,
                                                        self.attends):
            if layer_device != device:  # layers spread over several cards
                device = layer_device
                hidden = hidden.to(device)
                position_ids = position_ids.to(device)
                masks = {w: None if m is None else m.to(device) for w, m in masks.items()}
                position_embeddings = tuple(t.to(device) for t in position_embeddings)
            # a recurrent layer takes a padding mask [B, q] only, and one session's forward has no padding
            out = layer(hidden, attention_mask=masks[window] if attends else None, position_ids=position_ids,
                        position_embeddings=position_embeddings, **{self._cache_keyword: view})
            hidden = out[0] if isinstance(out, tuple) else out  # transformers 4.x returns a tuple
        return hidden

    def head_last(self, hidden: torch.Tensor) -> torch.Tensor:
        last = hidden[:, -1, :].to(self._head_device)  # the head reads only the last position
        return self.head(self.norm(last))

    def _head_all(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of every position [B, q, V]."""
        return self.head(self.norm(hidden.to(self._head_device)))


class _HeadLinear(nn.Module):
    """The head's weight in the kernel chosen for its shape (a tied head keeps the embeddings too)."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
