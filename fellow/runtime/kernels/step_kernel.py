"""The decode step of up to eight sessions as one C call: the C side of ``native_step``.

``swarm_step`` runs a fused stage's step for ``rows`` sessions from their tokens' embeddings to the logits:
per layer the input norm, the query-key-value product, the query and key norms, the rotary, each session's
new key and value written at its length and its attention over its own past (a sliding window seen from its
start), the out product added to the hidden state, the post norm, the gate-and-up product, SiLU times up,
the down product added; then the final norm and the head. One OpenMP parallel region for the whole step,
and five barriers a layer: each product's weight rows are split over the threads (``csrc/step_products.h``: each
read once for every session), and so is the attention, by (session, key-value head): each thread rotates
and writes that head's key and value, then rotates and attends its query heads (with fewer such pairs than
threads: the rotations, a barrier, then the attention by query head). The gate-and-up product is
split by gate row, each thread taking the same up rows and applying SiLU to its own. The norms and the
inputs' quantization are a few microseconds: every thread makes all of them for itself, rather than meet
the others at a barrier (on a shared machine each barrier waits for the thread another process held up).
The arithmetic is ``compiled.DecodeGraph``'s, summed in another order. Each session's cache is four numbers a layer
(keys
and values addresses, head and position strides: ``attend_one``'s), passed by pointer per session.

Its C is ``fellow/runtime/kernels/csrc/step_kernel.c`` (structs in ``step_structs.h``, mirrored below). Built
on first use by ``native.build``; where it cannot be, ``available()`` is False and says why.
"""

from __future__ import annotations

import ctypes

from fellow.runtime.kernels import native


class Lin(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("bits", ctypes.c_int64), ("group", ctypes.c_int64),
                ("kin", ctypes.c_int64)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Lin), ("o", Lin), ("gate_up", Lin), ("down", Lin),
                ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qk_norm", ctypes.c_void_p),
                ("in_eps", ctypes.c_float), ("post_eps", ctypes.c_float), ("qk_eps", ctypes.c_float),
                ("scaling", ctypes.c_float), ("window", ctypes.c_int64)]


class Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("dim", ctypes.c_int64), ("embed", ctypes.c_void_p),
                ("embed_scale", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("norm_eps", ctypes.c_float),
                ("head", Lin), ("width", ctypes.c_int64), ("most", ctypes.c_int64), ("parallel", ctypes.c_int64)]


MAX_ROWS = 8  # sessions one call steps
PARALLEL_BYTES = 4 << 20  # weight bytes a step from which its products are split over threads
MAX_DIM = 1024  # the head size ``place`` rotates in its stack buffer
STEP = native.Kernel("swarm_step", "step_kernel.c", "the native step kernel", "swarm_step",
                     [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p])
available, unavailable_reason = STEP.available, STEP.unavailable_reason
