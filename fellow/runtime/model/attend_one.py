"""One session's attention in a compiled decode step, with as little Python a layer as it takes.

The compiled step (``compiled.CompiledDecode``) leaves each layer's attention to ``swarm::attend_rows``,
which runs an attend function the step set up. For several sessions that is the fused stack's
``attend_decode`` (the decode slab, or row by row). For one, this: the same arithmetic as
``attend_decode`` over one ``KVCache`` (its new key and value written at ``length``, a sliding-window
layer seeing its last ``window`` positions), with the cache's buffers looked up once a step rather than
once a layer and no output buffer to fill. A layer's attention cost about 80 us of Python and small
ops besides its sdpa (q36m-l20, 20 layers: 1.5 ms of an 8.1 ms step; docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_one(fused, cache):
    """The attend function (``layer, q, k, v -> [1, 1, heads * D]``) of a one-session decode step over
    ``cache``, which has room for one more position (``reserve(1)``) and advances after the step."""
    length = cache.length
    end = length + 1
    kv, groups, dim = fused.num_kv_heads, fused.groups, fused.head_dim
    width = fused.num_heads * dim
    starts = {i: 0 if w is None else max(0, end - w) for i, w in fused.windows.items()}
    # by absolute layer index: that layer's key and value buffers, [kv_heads, capacity, D] each
    buffers = {cache.first_layer + slot: (cache.keys[g][index], cache.values[g][index])
               for slot, (g, index) in enumerate(cache.where)}
    sdpa = F.scaled_dot_product_attention

    def attend(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        i = layer.layer_idx
        keys, values = buffers[i]
        keys[:, length].copy_(k.view(kv, dim))
        values[:, length].copy_(v.view(kv, dim))
        start = starts[i]
        # four dimensions: sdpa's CPU flash kernel takes no other (three went the slower math way)
        out = sdpa(q.view(1, kv, groups, dim), keys[None, :, start:end], values[None, :, start:end],
                   scale=layer.scaling)
        return out.view(1, 1, width)

    return attend
