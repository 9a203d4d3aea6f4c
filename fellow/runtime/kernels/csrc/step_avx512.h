#ifndef SWARM_STEP_AVX512_H
#define SWARM_STEP_AVX512_H
/* The step's products built for AVX-512 (step_products.h includes this; native.flags builds
   with AVX-512 where torch dispatches it, so __AVX512F__ is defined there and nowhere else).
   
   Each takes the AVX2 form's arguments and gives its results, summed in another order:
   - float32: two weight rows against every input row (2 R accumulators of 16 floats), the next pair's lines
     read ahead, the last eight inputs under a mask;
   - int8: a pair of 32-blocks a register, each weight's sign moved onto its input under a mask (AVX-512 has no
     sign), then VNNI's dpbusd where the CPU has it (else maddubs and madd), the pair's two
     input scales as one vector;
   (int4's product has its AVX-512 arithmetic inside step_products.h int4_many: a block's low and high
   nibbles side by side widen to its 32 weights in order, one int16 product with the input's block where AVX2
   takes two.)
   Measured by bench/bench_native_step.py against the AVX2 build (ATEN_CPU_CAPABILITY=avx2).
*/

#ifdef __AVX512F__
/* AVX-512 (built where torch dispatches it): 16 floats a register. float32: two weight rows against every
   input row, 2 R accumulators, the last eight inputs under a mask */
static inline __attribute__((always_inline)) void f32_many512(const Lin *l, const float *x, float *y, int add,
                                                              Rows s, int64_t j0, int64_t j1, const int R) {
    const float *w = (const float *)l->w;
    const int64_t k = l->k, body = k - k % 16;
    const __mmask16 tail = (__mmask16)((1u << (k % 16)) - 1);
    int64_t j = j0;
    for (; j + 2 <= j1; j += 2) {
        const float *w0 = w + j * k, *w1 = w0 + k;
        __m512 a[8], b[8];
        for (int r = 0; r < R; r++) a[r] = b[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < body; i += 16) {
            const __m512 v0 = _mm512_loadu_ps(w0 + i), v1 = _mm512_loadu_ps(w1 + i);
            _mm_prefetch((const char *)(w0 + 2 * k + i), _MM_HINT_T0);  /* the next pair's lines */
            _mm_prefetch((const char *)(w0 + 3 * k + i), _MM_HINT_T0);
            for (int r = 0; r < R; r++) {
                const __m512 xv = _mm512_loadu_ps(x + r * s.xs + i);
                a[r] = _mm512_fmadd_ps(v0, xv, a[r]);
                b[r] = _mm512_fmadd_ps(v1, xv, b[r]);
            }
        }
        if (tail) {
            const __m512 v0 = _mm512_maskz_loadu_ps(tail, w0 + body), v1 = _mm512_maskz_loadu_ps(tail, w1 + body);
            for (int r = 0; r < R; r++) {
                const __m512 xv = _mm512_maskz_loadu_ps(tail, x + r * s.xs + body);
                a[r] = _mm512_fmadd_ps(v0, xv, a[r]);
                b[r] = _mm512_fmadd_ps(v1, xv, b[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            put(l, y + r * s.ys, j, _mm512_reduce_add_ps(a[r]), add);
            put(l, y + r * s.ys, j + 1, _mm512_reduce_add_ps(b[r]), add);
        }
    }
    if (j < j1) f32_many(l, x, y, add, s, j, j1, R);
}

/* int8: a pair of 32-blocks a register; each weight byte's sign moved onto the input's (a mask, as AVX2's
   sign does) so that unsigned |w| times signed x sums four products a lane (VNNI's dpbusd, else maddubs and
   madd); the pair's two input scales one vector ([d0 x 8, d1 x 8]) */
static inline __attribute__((always_inline)) void int8_many512(const Lin *l, const int8_t *xq, const float *xd,
                                                               float *y, int add, Rows s, int64_t j0, int64_t j1,
                                                               const int R) {
    const int64_t k = l->k, nb = k / 32;
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
#ifndef __AVX512VNNI__
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    for (int64_t j = j0; j < j1; j++) {
        const int8_t *wr = (const int8_t *)l->w + j * k;
        __m512 a[8];
        for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            const __m512i wv = _mm512_loadu_si512((const void *)(wr + b * 32)), wa = _mm512_abs_epi8(wv);
            const __mmask64 neg = _mm512_movepi8_mask(wv);
            _mm_prefetch((const char *)(wr + AHEAD * k + b * 32), _MM_HINT_T0);
            for (int r = 0; r < R; r++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(xq + r * s.qs + b * 32));
                const __m512i xs = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
#ifdef __AVX512VNNI__
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, xs);
#else
                const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(wa, xs), ones);
#endif
                const __m512 d = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(
                    _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(xd + r * s.ds + b)))));
                a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), d, a[r]);
            }
        }
        float last[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (b < nb) {  /* an odd block: AVX2's arithmetic */
            const __m256i ones16 = _mm256_set1_epi16(1);
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + b * 32)), wa = _mm256_sign_epi8(wv, wv);
            for (int r = 0; r < R; r++) {
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(
                    wa, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + r * s.qs + b * 32)), wv)), ones16);
                last[r] = hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(xd[r * s.ds + b])));
            }
        }
        for (int r = 0; r < R; r++) put(l, y + r * s.ys, j, (_mm512_reduce_add_ps(a[r]) + last[r]) * l->scale[j], add);
    }
}

#define F32_MANY f32_many512
#define INT8_MANY int8_many512
#else
#define F32_MANY f32_many
#define INT8_MANY int8_many
#endif


#endif
