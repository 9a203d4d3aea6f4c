#ifndef SWARM_STEP_STRUCTS_H
#define SWARM_STEP_STRUCTS_H
/* the native step's structs; their ctypes mirrors are step_kernel.Lin, Layer and Model (tests/test_kernel_sources.py checks they agree) */
#include <stdint.h>

typedef struct {
    const void *w;        /* float32 [n, k]; int8 [n, k]; or int4 [n, k / 2], each 32 inputs' 16 bytes
                             holding input i in the low nibble and input i + 16 in the high one */
    const float *scale;   /* int8: each row's scale [n]; int4: [n, k / group, 2], each group's scale and
                             offset (a weight is q * scale + offset, q in 0..15); NULL: float32 */
    const float *bias;    /* [n] or NULL */
    int64_t n, k;         /* quantized: k a multiple of 32, the weight's columns past kin zero */
    int64_t bits;         /* 32, 8 or 4 */
    int64_t group;        /* int4: inputs a scale */
    int64_t kin;          /* the inputs x holds (quantized: up to k; those past it read as 0) */
} Lin;

/* where the step's rows sit: x and y rows by their strides (floats), xq rows (bytes) and xd rows (floats) */
typedef struct { int64_t xs, ys, qs, ds; } Rows;

typedef struct {
    Lin qkv, o, gate_up, down;
    const float *in_norm, *post_norm, *qk_norm;  /* qk_norm [heads + kv_heads, dim], or NULL: none */
    float in_eps, post_eps, qk_eps, scaling;
    int64_t window;       /* 0: every position */
} Layer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, dim;
    const void *embed;        /* float32 [vocab, hidden], or int8 rows where embed_scale is set */
    const float *embed_scale;
    const float *norm;
    float norm_eps;
    Lin head;
    int64_t width;            /* the widest input of any product */
    int64_t most;             /* the widest output of a layer's products */
    int64_t parallel;         /* 0: the calling thread alone (a model too small to pay for waking threads) */
} Model;

#endif
