"""The products of the native decode step (``step_kernel``), as C: a weight times the step's rows.

``product`` multiplies one of the step's weights (``Lin``: float32, int8 or int4) by its ``rows`` input
rows (one per session, up to eight) inside the step's OpenMP parallel region: the weight's rows are
split over the threads (``omp for``) and each weight row is read from memory once for all the input rows.
- float32: for one input row, eight weight rows a block (``f32_gemv``'s loop); for more, one weight row
  against every input row, an accumulator each.
- int8: each input row quantized to int8 in blocks of 32 (``prepare``, as ``quant.int8_gemv`` does), and
  each weight row multiplied by each input row with ``int8_dot``, exactly ``quant.int8_gemv``'s arithmetic.
- int4 (``native_step.int4_rows``' layout): each input row quantized to int16 in blocks of 32, each
  32-weight block's nibbles widened once for every input row, each group's offset times the input's sum
  over the group. int8 inputs, as llama.cpp's q4_1 by q8_1 does, moved a 20-layer model's logits by 0.08
  from the fused step's (which reads them in bfloat16); int16 ones by 0.02.
Each row's result has the bias added, and is written or added (``add``: the residual) to ``y``.
"""

from __future__ import annotations

from fellow.runtime.model import native

STRUCTS = r"""
typedef struct {
    const void *w;        /* float32 [n, k]; int8 [n, k]; or int4 [n, k / 2], each 32 inputs' 16 bytes
                             holding input i in the low nibble and input i + 16 in the high one */
    const float *scale;   /* int8: each row's scale [n]; int4: [n, k / group, 2], each group's scale and
                             offset (a weight is q * scale + offset, q in 0..15); NULL: float32 */
    const float *bias;    /* [n] or NULL */
    int64_t n, k;
    int64_t bits;         /* 32, 8 or 4 */
    int64_t group;        /* int4: inputs a scale */
} Lin;

/* where the step's rows sit: x and y rows by their strides (floats), xq rows (bytes) and xd rows (floats) */
typedef struct { int64_t xs, ys, qs, ds; } Rows;
"""

SOURCE = native.DOT + native.INT8_DOT + STRUCTS + r"""
/* the rows of an int8 product's input quantized to int8 in blocks of 32; an int4 product's to int16 (xq read
   as int16), each block's sum beside its scale (xd[k / 32 + b]); the (row, block) pairs split over the team
   (nothing, and no barrier, for a float32 product) */
static void prepare(const Lin *l, const float *x, int8_t *xq, float *xd, int64_t rows, Rows s) {
    if (l->bits == 32) return;
    const float top = l->bits == 4 ? 32767.f : 127.f;
    const int64_t nb = l->k / 32;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < rows * nb; t++) {
        const int64_t r = t / nb, b = t % nb;
        const float *xb = x + r * s.xs + b * 32;
        float *d = xd + r * s.ds;
        float amax = 0.f, sum = 0.f;
        for (int i = 0; i < 32; i++) { float a = fabsf(xb[i]); if (a > amax) amax = a; sum += xb[i]; }
        const float scale = amax / top, inv = scale ? 1.f / scale : 0.f;
        d[b] = scale;
        if (l->bits == 4) {
            d[nb + b] = sum;
            for (int i = 0; i < 32; i++) ((int16_t *)(xq + r * s.qs))[b * 32 + i] = (int16_t)lrintf(xb[i] * inv);
        } else {
            for (int i = 0; i < 32; i++) xq[r * s.qs + b * 32 + i] = (int8_t)lrintf(xb[i] * inv);
        }
    }
}

static inline void put(const Lin *l, float *y, int64_t j, float v, int add) {
    if (l->bias) v += l->bias[j];
    y[j] = add ? y[j] + v : v;
}

static void f32_one(const Lin *l, const float *x, float *y, int add) {
    const float *w = (const float *)l->w;
    const int64_t n = l->n, k = l->k, blocks = (n + 7) / 8;
    #pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t j0 = blk * 8;
        const float *w0 = w + j0 * k;
        if (j0 + 8 <= n) {
            __m256 a[8];
            for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
            for (int64_t i = 0; i < k; i += 8) {
                const __m256 xv = _mm256_loadu_ps(x + i);
                #pragma GCC unroll 8
                for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + r * k + i), a[r]);
            }
            for (int r = 0; r < 8; r++) put(l, y, j0 + r, hsum(a[r]), add);
        } else {
            for (int64_t j = j0; j < n; j++) put(l, y, j, dot(x, w + j * k, k), add);
        }
    }
}

static inline __attribute__((always_inline)) void f32_many(const Lin *l, const float *x, float *y, int add,
                                                           Rows s, const int R) {
    const float *w = (const float *)l->w;
    const int64_t n = l->n, k = l->k;
    #pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const float *wr = w + j * k;
        __m256 a[8];
        for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8) {
            const __m256 wv = _mm256_loadu_ps(wr + i);
            for (int r = 0; r < R; r++) a[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * s.xs + i), a[r]);
        }
        for (int r = 0; r < R; r++) put(l, y + r * s.ys, j, hsum(a[r]), add);
    }
}

static inline __attribute__((always_inline)) void int4_many(const Lin *l, const int8_t *xq, const float *xd,
                                                            float *y, int add, Rows s, const int R) {
    const uint8_t *w = (const uint8_t *)l->w;
    const int64_t n = l->n, k = l->k, nb = k / 32, per = l->group / 32, groups = k / l->group;
    const __m128i low = _mm_set1_epi8(15);
    #pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *wr = w + j * (k / 2);
        const float *sm = l->scale + j * groups * 2;
        __m256 acc[8];
        float offset[8];
        for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); offset[r] = 0.f; }
        for (int64_t g = 0; g < groups; g++) {
            const float scale = sm[2 * g];
            float sums[8];
            for (int r = 0; r < R; r++) sums[r] = 0.f;
            for (int64_t b = g * per; b < (g + 1) * per; b++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(wr + b * 16));
                const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low));
                const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low));
                for (int r = 0; r < R; r++) {
                    const int16_t *xw = (const int16_t *)(xq + r * s.qs) + b * 32;
                    const float *d = xd + r * s.ds;
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xw)),
                                                       _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xw + 16))));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[b] * scale), acc[r]);
                    sums[r] += d[nb + b];
                }
            }
            for (int r = 0; r < R; r++) offset[r] += sm[2 * g + 1] * sums[r];
        }
        for (int r = 0; r < R; r++) put(l, y + r * s.ys, j, hsum(acc[r]) + offset[r], add);
    }
}

#define EACH_ROWS(CALL) switch (rows) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); }

/* y = W x (+ bias), or y += that, for each of the rows (at most 8); called inside the parallel region */
static void product(const Lin *l, const float *x, const int8_t *xq, const float *xd, float *y, int add,
                    int64_t rows, Rows s) {
    if (l->bits == 8) {
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < l->n; j++)
            for (int64_t r = 0; r < rows; r++)
                put(l, y + r * s.ys, j, int8_dot((const int8_t *)l->w + j * l->k, xq + r * s.qs, xd + r * s.ds,
                                                 l->k / 32) * l->scale[j], add);
    } else if (l->bits == 4) {
        #define INT4(R) int4_many(l, xq, xd, y, add, s, R)
        EACH_ROWS(INT4)
    } else if (rows == 1) {
        f32_one(l, x, y, add);
    } else {
        #define F32(R) f32_many(l, x, y, add, s, R)
        EACH_ROWS(F32)
    }
}
"""
