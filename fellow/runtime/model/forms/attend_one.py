"""One session's attention in a compiled decode step, with as little Python a layer as it takes.

The compiled step (``compiled.CompiledDecode``) leaves each layer's attention to ``swarm::attend_rows``,
which runs an attend function the step set up. For several sessions that is the fused stack's
``attend_decode`` (the decode slab, or row by row). For one, this: the same arithmetic as
``attend_decode`` over one ``KVCache`` (its new key and value written at ``length``, a sliding-window
layer seeing its last ``window`` positions), with the cache's buffers looked up once a step rather than
once a layer and no output buffer to fill. Where the C kernel builds (``attend_kernel``), each layer's
write and attention are one call of it; else torch's copies and sdpa, which cost about 80 us a layer
of Python and small ops (q36m-l20, 20 layers: 1.5 ms of an 8.1 ms step; docs/benchmarks.md).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from fellow.runtime.kernels import attend_kernel

# by cache: what its buffers were when their addresses were taken, and by absolute layer index (keys address,
# values address, head stride, position stride); taken again whenever the buffers change (reserve, a slab)
_addresses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attend_one(fused, cache):
    """The attend function (``layer, q, k, v -> [1, 1, heads * D]``) of a one-session decode step over
    ``cache``, which has room for one more position (``reserve(1)``) and advances after the step."""
    length = cache.length
    end = length + 1
    kv, groups, dim = fused.num_kv_heads, fused.groups, fused.head_dim
    width = fused.num_heads * dim
    starts = {i: 0 if w is None else max(0, end - w) for i, w in fused.windows.items()}
    addresses = _addresses_of(cache) if attend_kernel.available() else None
    if addresses is not None:
        return _kernel_attend(fused, addresses, starts, length)
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


def _addresses_of(cache) -> dict | None:
    """By absolute layer index, the addresses and strides of the cache's key and value buffers where the kernel
    takes every one of them, else None; kept per cache until its buffers change."""
    if any(t is None for t in cache.keys) or any(t is None for t in cache.values):
        return None
    what = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in (*cache.keys, *cache.values))
    kept = _addresses.get(cache)
    if kept is not None and kept[0] == what:
        return kept[1]
    addresses = {}
    for slot, (g, index) in enumerate(cache.where):
        keys, values = cache.keys[g][index], cache.values[g][index]
        if not (attend_kernel.takes(keys) and attend_kernel.takes(values) and keys.stride() == values.stride()):
            addresses = None
            break
        addresses[cache.first_layer + slot] = (keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1))
    _addresses[cache] = (what, addresses)
    return addresses


def _kernel_attend(fused, addresses: dict, starts: dict, length: int):
    """``attend_one``'s attend function through ``attend_kernel``: one C call a layer."""
    call = attend_kernel.caller()
    kv, groups, dim = fused.num_kv_heads, fused.groups, fused.head_dim
    width = fused.num_heads * dim
    # by window start: whether the heads are split over threads
    split = {start: int(fused.num_heads * (length + 1 - start) * dim >= attend_kernel.PARALLEL_WORK)
             for start in set(starts.values())}

    def attend(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        i = layer.layer_idx
        keys, values, head_stride, pos_stride = addresses[i]
        start = starts[i]
        out = torch.empty(1, 1, width)
        dtype = q.dtype  # float32 as the buffers are, unless a stage computes in another type beside them
        # the fused step's are views, contiguous at one row; .float() and .contiguous() copy nothing then
        q, k, v = q.float().contiguous(), k.float().contiguous(), v.float().contiguous()
        call(q.data_ptr(), k.data_ptr(), v.data_ptr(), keys, values, head_stride, pos_stride, kv, groups, dim,
             length, start, layer.scaling, out.data_ptr(), split[start])
        return out if dtype is torch.float32 else out.to(dtype)

    return attend
