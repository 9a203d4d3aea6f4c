#ifndef SWARM_STEP_PRODUCTS_H
#define SWARM_STEP_PRODUCTS_H
/* The products of the native decode step (step_kernel), as C: a weight times the step's rows.
   
   product multiplies the weight rows j0..j1 of one of the step's weights (Lin: float32, int8 or
   int4) by its rows input rows (one per session, up to eight): inside the step's OpenMP parallel region each
   thread takes its own span of the weight's rows (span), and each weight row is read from memory once for
   all the input rows. No barrier inside: the step puts its own where a result is read.
   - float32: for one input row, eight weight rows a block (f32_gemv's loop); for more, one weight row
     against every input row, an accumulator each.
   - int8: each input row quantized to int8 in blocks of 32 (prepare, as quant.int8_gemv does), and
     each weight row's blocks multiplied by each input row's as int8_dot does (its two accumulators a row),
     exactly quant.int8_gemv's arithmetic.
   - int4 (native_step.int4_rows' layout): each input row quantized to int16 under one scale (its largest
     value is 32,767), each 32-weight block's nibbles widened once for every input row, a group's products
     summed in integers and scaled once, each group's offset times the input's sum over the group. int8
     inputs, as llama.cpp's q4_1 by q8_1 does, moved a 20-layer model's logits by 0.08 from the fused step's
     (which reads them in bfloat16); int16 ones by 0.02 (a scale a block of 32) or 0.02-0.03 (a scale a row).
   Each row's result has the bias added, and is written or added (add: the residual) to y.
   Every form but float32's one-row one reads the weight rows after its own into the cache as it goes
   (AHEAD). Where the build has AVX-512 (native.flags), step_avx512's forms serve the products of
   several rows and the quantized ones.
*/
#include <math.h>
#include <omp.h>
#include "dot.h"
#include "f32_rows8.h"
#include "step_structs.h"

/* A quantized product reads the weight row AHEAD rows on into the cache as it goes, a float32 one the next
   row (or pair): the hardware's prefetcher follows one or two rows at a time and leaves the memory mostly
   idle; with eight input rows a step ran at half of one row's pace without (q46m-v4k, eight rows: int8 15.4
   against 6.8 ms, float32 15.2 against 11.3, AVX2) */
#define AHEAD 4

/* this thread's share of n items, in units of align: [*a, *b) */
static inline void span(int64_t n, int64_t align, int64_t *a, int64_t *b) {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads(), units = (n + align - 1) / align;
    const int64_t lo = units * t / T * align, hi = units * (t + 1) / T * align;
    *a = lo < n ? lo : n;
    *b = hi < n ? hi : n;
}

/* the rows of an int8 product's input quantized to int8 in blocks of 32; an int4 product's to int16 (xq read
   as int16), each block's sum beside its scale (xd[k / 32 + b]); all of them, by the calling thread into its
   own buffers (nothing for a float32 product): a few microseconds, where a split would cost a barrier */
static void prepare(const Lin *l, const float *x, int8_t *xq, float *xd, int64_t rows, Rows s) {
    if (l->bits == 32) return;
    const int64_t nb = l->k / 32, kin = l->kin;
    if (l->bits == 4) {  /* int16 under one scale a row (xd[0]), each group's sum at xd[1 + g] */
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * s.xs;
            float *d = xd + r * s.ds, amax = 0.f;
            for (int64_t i = 0; i < kin; i++) { const float a = fabsf(xr[i]); if (a > amax) amax = a; }
            const float scale = amax / 32767.f, inv = scale ? 1.f / scale : 0.f;
            d[0] = scale;
            for (int64_t g = 0; g < l->k / l->group; g++) {
                float sum = 0.f;
                for (int64_t i = g * l->group; i < (g + 1) * l->group; i++) {
                    const float v = i < kin ? xr[i] : 0.f;
                    sum += v;
                    ((int16_t *)(xq + r * s.qs))[i] = (int16_t)lrintf(v * inv);
                }
                d[1 + g] = sum;
            }
        }
        return;
    }
    for (int64_t t = 0; t < rows * nb; t++) {
        const int64_t r = t / nb, b = t % nb, left = kin - b * 32;
        const int live = left < 32 ? (int)left : 32;  /* a last block past kin: its tail zero */
        const float *xb = x + r * s.xs + b * 32;
        float amax = 0.f;
        for (int i = 0; i < live; i++) { float a = fabsf(xb[i]); if (a > amax) amax = a; }
        const float scale = amax / 127.f, inv = scale ? 1.f / scale : 0.f;
        xd[r * s.ds + b] = scale;
        for (int i = 0; i < 32; i++) xq[r * s.qs + b * 32 + i] = i < live ? (int8_t)lrintf(xb[i] * inv) : 0;
    }
}

static inline void put(const Lin *l, float *y, int64_t j, float v, int add) {
    if (l->bias) v += l->bias[j];
    y[j] = add ? y[j] + v : v;
}

static void f32_one(const Lin *l, const float *x, float *y, int add, int64_t j0, int64_t j1) {
    const float *w = (const float *)l->w;
    const int64_t k = l->k;
    int64_t j = j0;
    for (; j + 8 <= j1; j += 8) {
        float out[8];
        f32_rows8(w + j * k, x, k, out);
        for (int r = 0; r < 8; r++) put(l, y, j + r, out[r], add);
    }
    for (; j < j1; j++) put(l, y, j, dot(x, w + j * k, k), add);
}

static inline __attribute__((always_inline)) void f32_many(const Lin *l, const float *x, float *y, int add,
                                                           Rows s, int64_t j0, int64_t j1, const int R) {
    const float *w = (const float *)l->w;
    const int64_t k = l->k;
    for (int64_t j = j0; j < j1; j++) {
        const float *wr = w + j * k;
        __m256 a[8];
        for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8) {
            const __m256 wv = _mm256_loadu_ps(wr + i);
            if (!(i & 15)) _mm_prefetch((const char *)(wr + k + i), _MM_HINT_T0);  /* the next row's line */
            for (int r = 0; r < R; r++) a[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * s.xs + i), a[r]);
        }
        for (int r = 0; r < R; r++) put(l, y + r * s.ys, j, hsum(a[r]), add);
    }
}

/* int8_dot for R input rows at once: each weight block loaded and its signs taken once */
static inline __attribute__((always_inline)) void int8_many(const Lin *l, const int8_t *xq, const float *xd,
                                                            float *y, int add, Rows s, int64_t j0, int64_t j1,
                                                            const int R) {
    const int64_t k = l->k, nb = k / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t j = j0; j < j1; j++) {
        const int8_t *wr = (const int8_t *)l->w + j * k;
        __m256 a0[8], a1[8];
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + b * 32)), wa = _mm256_sign_epi8(wv, wv);
            const __m256i wv2 = _mm256_loadu_si256((const __m256i *)(wr + b * 32 + 32));
            const __m256i wa2 = _mm256_sign_epi8(wv2, wv2);
            _mm_prefetch((const char *)(wr + AHEAD * k + b * 32), _MM_HINT_T0);
            for (int r = 0; r < R; r++) {
                const int8_t *xr = xq + r * s.qs + b * 32;
                const float *dr = xd + r * s.ds + b;
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(
                    wa, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xr), wv)), ones);
                a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dr[0]), a0[r]);
                const __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(
                    wa2, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xr + 32)), wv2)), ones);
                a1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p2), _mm256_set1_ps(dr[1]), a1[r]);
            }
        }
        for (; b < nb; b++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + b * 32)), wa = _mm256_sign_epi8(wv, wv);
            for (int r = 0; r < R; r++) {
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(
                    wa, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + r * s.qs + b * 32)), wv)), ones);
                a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(xd[r * s.ds + b]), a0[r]);
            }
        }
        for (int r = 0; r < R; r++) put(l, y + r * s.ys, j, hsum(_mm256_add_ps(a0[r], a1[r])) * l->scale[j], add);
    }
}

/* int4's vectors: AVX-512's where the build has it, else AVX2's */
#ifdef __AVX512F__
#define VEC __m512
#define IVEC __m512i
#define IZERO _mm512_setzero_si512
#define VZERO _mm512_setzero_ps
#define VFMA _mm512_fmadd_ps
#define VCVT _mm512_cvtepi32_ps
#define VSET _mm512_set1_ps
#define VSUM _mm512_reduce_add_ps
#else
#define VEC __m256
#define IVEC __m256i
#define IZERO _mm256_setzero_si256
#define VZERO _mm256_setzero_ps
#define VFMA _mm256_fmadd_ps
#define VCVT _mm256_cvtepi32_ps
#define VSET _mm256_set1_ps
#define VSUM hsum
#endif

static inline __attribute__((always_inline)) void int4_many(const Lin *l, const int8_t *xq, const float *xd,
                                                            float *y, int add, Rows s, int64_t j0, int64_t j1,
                                                            const int R) {
    const uint8_t *w = (const uint8_t *)l->w;
    const int64_t k = l->k, per = l->group / 32, groups = k / l->group;
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *wr = w + j * (k / 2);
        const float *sm = l->scale + j * groups * 2;
        VEC acc[8];
        float offset[8];
        for (int r = 0; r < R; r++) { acc[r] = VZERO(); offset[r] = 0.f; }
        for (int64_t g = 0; g < groups; g++) {
            IVEC p[8];  /* the group's products in integers (a lane sums at most 8 x 15 x 32767) */
            for (int r = 0; r < R; r++) p[r] = IZERO();
            for (int64_t b = g * per; b < (g + 1) * per; b++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(wr + b * 16));
                if (!(b & 3)) _mm_prefetch((const char *)(wr + AHEAD * k / 2 + b * 16), _MM_HINT_T0);
                const __m128i lo8 = _mm_and_si128(bytes, low), hi8 = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
#ifdef __AVX512F__  /* low and high nibbles side by side: the block's 32 weights in order, one product */
                const __m512i q = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi8, lo8));
#else
                const __m256i lo = _mm256_cvtepu8_epi16(lo8), hi = _mm256_cvtepu8_epi16(hi8);
#endif
                for (int r = 0; r < R; r++) {
                    const int16_t *xw = (const int16_t *)(xq + r * s.qs) + b * 32;
#ifdef __AVX512F__
                    p[r] = _mm512_add_epi32(p[r], _mm512_madd_epi16(q, _mm512_loadu_si512((const void *)xw)));
#else
                    p[r] = _mm256_add_epi32(p[r], _mm256_add_epi32(
                        _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xw)),
                        _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xw + 16)))));
#endif
                }
            }
            const VEC scale = VSET(sm[2 * g]);
            for (int r = 0; r < R; r++) {
                acc[r] = VFMA(VCVT(p[r]), scale, acc[r]);
                offset[r] += sm[2 * g + 1] * xd[r * s.ds + 1 + g];
            }
        }
        for (int r = 0; r < R; r++) put(l, y + r * s.ys, j, VSUM(acc[r]) * xd[r * s.ds] + offset[r], add);
    }
}


#include "step_avx512.h"

#define EACH_ROWS(CALL) switch (rows) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); }

/* y = W x (+ bias), or y += that, for weight rows j0..j1 and each of the rows (at most 8) */
static void product(const Lin *l, const float *x, const int8_t *xq, const float *xd, float *y, int add,
                    int64_t rows, Rows s, int64_t j0, int64_t j1) {
    if (l->bits == 8) {
        #define INT8(R) INT8_MANY(l, xq, xd, y, add, s, j0, j1, R)
        EACH_ROWS(INT8)
    } else if (l->bits == 4) {
        #define INT4(R) int4_many(l, xq, xd, y, add, s, j0, j1, R)
        EACH_ROWS(INT4)
    } else if (rows == 1) {
        f32_one(l, x, y, add, j0, j1);
    } else {
        #define F32(R) F32_MANY(l, x, y, add, s, j0, j1, R)
        EACH_ROWS(F32)
    }
}

/* this thread's span of the weight's rows (in eights), then the team waits for every span */
static void product_all(const Lin *l, const float *x, const int8_t *xq, const float *xd, float *y, int add,
                        int64_t rows, Rows s) {
    int64_t j0, j1;
    span(l->n, 8, &j0, &j1);
    product(l, x, xq, xd, y, add, rows, s, j0, j1);
    #pragma omp barrier
}

#endif
