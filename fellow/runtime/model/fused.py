"""A Llama-family decoder stack run by hand: fewer, bigger matmuls and no per-layer module calls.

transformers' decoder layers cost a CPU decode step more in Python and small ops than in the
matmuls themselves: on a 46M Qwen3 (hidden 512, MLP 3,072, vocabulary 4,096, fp32, 2 threads) a
step was 16.8 ms, of which the seven matmuls per layer took 9. Here each layer makes four matmuls
(query, key and value in one weight; gate and up in one weight; out; down), the norms are
``F.rms_norm``, the rotary tables are computed once per step, and a decode batch attends row by row
straight into each session's own cache (no padded copy of the past). Each weight is kept in the
form its kernel reads: torch's default (MKL) or packed for oneDNN, chosen per shape by timing at
load (``fellow.runtime.model.load.kernels``).

Serves Llama, Mistral, Qwen2 and Qwen3 decoder layers with SiLU MLPs, sliding-window ones included
(``layer_windows``: a query sees only the last ``window`` positions, as HF's masks say; the KV cache
still keeps every position); ``fusable`` says whether a stage's layers are of that kind. Results
equal the HF layers' to float32 rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fellow.runtime.model.forms.attend_one import attend_one
from fellow.runtime.model.forms.decode_slab import DecodeSlab
from fellow.runtime.model.kv_cache import KVCache

FUSABLE_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
KERNELS = ("mkl", "onednn")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class Linear:
    """One weight (and bias) in the form one kernel reads; called like ``F.linear``."""

    __slots__ = ("kernel", "weight", "bias", "out_features", "in_features", "_call")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str, rows: int = 16) -> None:
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        if kernel == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
            self._call = self._onednn
        elif kernel == "mkl":
            self.weight = weight.detach().contiguous()
            self._call = self._default
        else:
            raise ValueError(f"unknown kernel {kernel!r}: one of {KERNELS}")

    def _default(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(x)

    @property
    def bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + extra


ATTENTION_KINDS = ("full_attention", "sliding_attention")
# layer kinds that keep a recurrent state per session instead of keys and values, and the families whose
# layers of that kind are served (fellow.runtime.model.recurrent: prompts one session at a time, no rollback)
RECURRENT_KINDS = {"linear_attention": ("qwen3_next",)}


def unserved_kinds(kinds, model_type: str | None) -> str | None:
    """Why a model of ``model_type`` whose layers are of ``kinds`` is not served (one line); None when it is."""
    unknown = sorted(set(kinds) - set(ATTENTION_KINDS) - set(RECURRENT_KINDS))
    if unknown:
        served = ", ".join([*ATTENTION_KINDS, *RECURRENT_KINDS])
        return f"layers of kind {unknown} are not served (only {served})"
    for kind, families in RECURRENT_KINDS.items():
        if kind in kinds and model_type not in families:
            return f"layers of kind {kind!r} are served for {', '.join(families)} only, not {model_type}"
    return None


def layer_windows(config) -> dict[int, int | None]:
    """Each layer's attention window by absolute index: None where a query sees every earlier position,
    else how many positions it sees (itself and the ``window - 1`` before it: HF's ``kv > q - window``).
    A recurrent layer (RECURRENT_KINDS) attends to no keys: None too, and it takes no mask.

    Qwen2 / Qwen3 name each layer's kind in ``layer_types`` (sliding from ``max_window_layers`` on when
    ``use_sliding_window``); Mistral has none, and one ``sliding_window`` holds for every layer.
    Raises ValueError for kinds not served (``unserved_kinds``).
    """
    window = getattr(config, "sliding_window", None) or None
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return {i: window for i in range(config.num_hidden_layers)}
    if why := unserved_kinds(kinds, getattr(config, "model_type", None)):
        raise ValueError(why)
    if "sliding_attention" in kinds and not window:
        raise ValueError("sliding-attention layers without a sliding_window in the config")
    return {i: window if kind == "sliding_attention" else None for i, kind in enumerate(kinds)}


def recurrent_layers(config) -> list[int]:
    """The absolute indices of the layers that keep a recurrent state (RECURRENT_KINDS)."""
    return [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind in RECURRENT_KINDS]


def fusable(layers: Sequence[nn.Module], config, device: torch.device) -> str | None:
    """None when these layers can run fused on ``device``, else why not (one line)."""
    if device.type != "cpu":
        return f"fused layers run on the CPU; this stage is on {device.type}"
    kinds = {type(layer).__name__ for layer in layers}
    if not kinds <= set(FUSABLE_LAYERS):
        return f"layers {sorted(kinds - set(FUSABLE_LAYERS))} are not of the Llama family"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not SiLU"
    for layer in layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if type(getattr(layer.self_attn, name, None)) is not nn.Linear:
                return f"{name} is a {type(getattr(layer.self_attn, name, None)).__name__}, not a plain linear layer"
        for name in ("gate_proj", "up_proj", "down_proj"):
            if type(getattr(layer.mlp, name, None)) is not nn.Linear:
                return f"{name} is a {type(getattr(layer.mlp, name, None)).__name__}, not a plain linear layer"
    return None


def _cat_bias(*linears: nn.Linear) -> torch.Tensor | None:
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat([linear.bias.detach() if linear.bias is not None
                      else torch.zeros(linear.out_features, dtype=linear.weight.dtype) for linear in linears])


class FusedLayer:
    """One decoder layer's weights, fused: [q; k; v], o, [gate; up], down, and its norms."""

    def __init__(self, layer: nn.Module, make_linear: MakeLinear, num_heads: int, num_kv_heads: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach()])
        self.qkv = make_linear(qkv, _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj))
        self.o = make_linear(attn.o_proj.weight.detach(), bias_of(attn.o_proj))
        gate_up = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()])
        self.gate_up = make_linear(gate_up, _cat_bias(mlp.gate_proj, mlp.up_proj))
        self.down = make_linear(mlp.down_proj.weight.detach(), bias_of(mlp.down_proj))
        self.input_norm = _norm(layer.input_layernorm)
        self.post_norm = _norm(layer.post_attention_layernorm)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_norm: tuple[torch.Tensor, float] | None = None  # Qwen3: per-head norms of queries and keys
        if q_norm is not None:
            (q_weight, eps), (k_weight, _) = _norm(q_norm), _norm(k_norm)
            # one norm over queries and keys together: each head's row of weights, [heads + kv_heads, D]
            weights = torch.cat([q_weight.expand(num_heads, -1), k_weight.expand(num_kv_heads, -1)])
            self.qk_norm = (weights.contiguous(), eps)
        self.layer_idx = attn.layer_idx
        self.scaling = attn.scaling
        self.intermediate = mlp.gate_proj.out_features

    @property
    def bytes(self) -> int:
        linears = (self.qkv, self.o, self.gate_up, self.down)
        norms = [n[0] for n in (self.input_norm, self.post_norm, self.qk_norm) if n is not None]
        return sum(linear.bytes for linear in linears) + sum(w.numel() * w.element_size() for w in norms)


MakeLinear = Callable[[torch.Tensor, "torch.Tensor | None"], Linear]  # or a quant.linear.QuantLinear, called alike


def strip_linears(layer: nn.Module) -> None:
    """Drop an HF layer's linear weights once its fused layer holds them, so the stage holds each once."""
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(layer.self_attn, name, None)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(layer.mlp, name, None)


def bias_of(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _norm(module: nn.Module) -> tuple[torch.Tensor, float]:
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6)
    return module.weight.detach(), float(eps)


def _rms(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    weight, eps = norm
    if weight.dim() == 1:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x, weight.shape[-1:], None, eps) * weight  # a row of weights per head


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos, sin [B, q, D] as [B, q, 1, D], sin signed so that rotating half is one roll."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos[:, :, None], signed[:, :, None]


class FusedStack:
    """The fused layers of one stage, and the four ways a forward attends (see ``StageModel``)."""

    def __init__(self, layers: Sequence[nn.Module | FusedLayer], config, make_linear: MakeLinear) -> None:
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.groups = self.num_heads // self.num_kv_heads
        self.windows = layer_windows(config)  # absolute layer index -> its window (None: full attention)
        # a layer fused already (quantized as it loaded: fellow.runtime.model.quant.quantizer) is taken as it is
        self.layers = [layer if isinstance(layer, FusedLayer) else
                       FusedLayer(layer, make_linear, self.num_heads, self.num_kv_heads) for layer in layers]
        # a decode batch's caches side by side, kept across steps (None: every step attends row by row)
        self.slab: DecodeSlab | None = DecodeSlab(self.layers[0].layer_idx, self.windows) if self.layers else None
        self.before: dict[int, Callable] = {}  # absolute layer index -> a trained cut run before it (model.boundary)

    @property
    def bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """hidden [B, q, H]; cos, sin from ``rotary_tables``; ``attend(layer, q, k, v)`` -> [B, q, heads * D]."""
        batch, width, _ = hidden.shape
        heads, qk_heads = self.num_heads, self.num_heads + self.num_kv_heads
        half = self.head_dim // 2
        for layer in self.layers:
            if self.before and layer.layer_idx in self.before:
                hidden = self.before[layer.layer_idx](hidden)
            qkv = layer.qkv(_rms(hidden, layer.input_norm))
            qk = qkv[..., : qk_heads * self.head_dim].view(batch, width, qk_heads, self.head_dim)
            if layer.qk_norm is not None:
                qk = _rms(qk, layer.qk_norm)
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)  # rotary, queries and keys at once
            q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)
            v = qkv[..., qk_heads * self.head_dim :].view(batch, width, self.num_kv_heads, self.head_dim)
            hidden = hidden + layer.o(attend(layer, q, k, v.transpose(1, 2)))
            gate, up = layer.gate_up(_rms(hidden, layer.post_norm)).split(layer.intermediate, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        return hidden

    # --- the four ways a forward attends ----------------------------------------------------------

    def attend_piece(self, cache, masks: dict[int | None, torch.Tensor | None]):
        """One session's next positions, into its cache: q [1, heads, q, D]. ``masks``: by window
        (None: full attention), each layer's mask (None: plain causal)."""
        def attend(layer: FusedLayer, q, k, v):
            keys, values = cache.write(layer.layer_idx, k, v)
            mask = masks[self.windows[layer.layer_idx]]
            causal = mask is None and q.shape[2] > 1
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                                 scale=layer.scaling, enable_gqa=self.groups > 1)
            return out.transpose(1, 2).reshape(1, q.shape[2], -1)
        return attend

    def attend_fresh(self, caches, pads: Sequence[int], masks: dict[int | None, torch.Tensor]):
        """First pieces of several sessions, left-padded: the batch attends to itself (``masks`` by window)."""
        def attend(layer: FusedLayer, q, k, v):
            for row, (cache, pad) in enumerate(zip(caches, pads)):
                cache.write(layer.layer_idx, k[row : row + 1, :, pad:], v[row : row + 1, :, pad:])
            mask = masks[self.windows[layer.layer_idx]]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling,
                                                 enable_gqa=self.groups > 1)
            return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
        return attend

    def attend_packed(self, caches, widths: Sequence[int]):
        """Several sessions' next positions packed in one row, ``widths[i]`` of them for session i
        (a verify pass: its last token and its drafts): q [1, heads, sum(widths), D].

        Two sessions or more attend over the stage's slab as a decode step does (one call per layer, each
        session's queries in its row: ``decode_slab.SlabStep``), unless their pasts are too uneven for it.
        Otherwise each session writes its positions into its own cache and attends to its past and, causally,
        to its own new positions. As in ``attend_decode``, the query heads that share a key/value head go in
        as that head's queries ([1, kv_heads, groups * w, D], the mask repeated per group): sdpa with
        ``enable_gqa`` and a mask took 2.4 times as long on a CPU (0.34 ms against 0.14, 16 heads over 2, 3
        positions on 1,208).
        """
        total = sum(widths)
        out_shape = (1, total, self.num_heads * self.head_dim)
        step = self.slab.step(caches, widths) if self.slab is not None else None
        if step is not None:  # two sessions or more, in the slab: one call per layer over their rows
            return lambda layer, q, k, v: step.attend(layer.layer_idx, layer.scaling, q, k, v, out_shape)
        # by window, per session of more than one position: [groups * w, past + w], True where a query sees a key
        masks: dict[int | None, list[torch.Tensor | None]] = {}
        for window in set(self.windows.values()):
            masks[window] = []
            for cache, width in zip(caches, widths):
                if width == 1:
                    masks[window].append(None)
                    continue
                rows = torch.arange(cache.length, cache.length + width)[:, None]
                columns = torch.arange(cache.length + width)[None, :]
                seen = columns <= rows
                if window is not None:
                    seen &= columns > rows - window
                masks[window].append(seen.repeat(self.groups, 1))

        def attend(layer: FusedLayer, q, k, v):
            out = q.new_empty(out_shape)
            start = 0
            window = self.windows[layer.layer_idx]
            for cache, width, mask in zip(caches, widths, masks[window]):
                end = start + width
                keys, values = cache.write(layer.layer_idx, k[:, :, start:end], v[:, :, start:end])
                if mask is None and window is not None:  # one position: it sees the last ``window`` keys
                    keys, values = keys[:, :, -window:], values[:, :, -window:]
                queries = q[:, :, start:end].reshape(1, self.num_kv_heads, self.groups * width, self.head_dim)
                attended = F.scaled_dot_product_attention(queries, keys, values, scale=layer.scaling,
                                                          attn_mask=None if mask is None else mask.to(q.device))
                if mask is None:
                    out[0, start] = attended.view(-1)
                else:  # [1, kv_heads, groups * w, D] is [heads, w, D]: each position's heads in a row
                    out[0, start:end] = attended.view(self.num_heads, width, self.head_dim).transpose(0, 1).reshape(
                        width, -1)
                start = end
            return out
        return attend

    def attend_decode(self, caches):
        """One new position per session. One session attends through ``attend_one`` (a C kernel a layer where
        it builds). Two or more attend in one call per layer over the stage's slab, where their caches live
        side by side (``decode_slab``), unless their pasts are too uneven; then each row attends to its own.

        A row's query heads that share a key/value head go in as that head's queries (one call, no mask, every
        group: [1, kv_heads, groups, D] against [1, kv_heads, n, D]); a sliding layer sees its last ``window``.
        """
        rows = len(caches)
        if rows == 1 and type(caches[0]) is KVCache:
            return attend_one(self, caches[0])
        out_shape = (rows, 1, self.num_heads * self.head_dim)
        step = self.slab.step(caches) if self.slab is not None else None
        if step is not None:
            return lambda layer, q, k, v: step.attend(layer.layer_idx, layer.scaling, q, k, v, out_shape)

        def attend(layer: FusedLayer, q, k, v):
            out = q.new_empty(out_shape)
            queries = q.reshape(rows, self.num_kv_heads, self.groups, self.head_dim)
            window = self.windows[layer.layer_idx]
            for row, cache in enumerate(caches):
                keys, values = cache.write(layer.layer_idx, k[row : row + 1], v[row : row + 1])
                if window is not None:
                    keys, values = keys[:, :, -window:], values[:, :, -window:]
                attended = F.scaled_dot_product_attention(queries[row : row + 1], keys, values, scale=layer.scaling)
                out[row, 0] = attended.view(-1)
            return out
        return attend
