#ifndef SWARM_F32_ROWS8_H
#define SWARM_F32_ROWS8_H
/* eight float32 weight rows times one input row, k a multiple of 8: the block f32_gemv.c loops over and the
   native step's one-row float32 product (step_products.h f32_one) takes its rows in */
#include "hsum.h"

static inline __attribute__((always_inline)) void f32_rows8(const float *w0, const float *x, int64_t k,
                                                            float out[8]) {
    __m256 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        #pragma GCC unroll 8
        for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + r * k + i), a[r]);
    }
    for (int r = 0; r < 8; r++) out[r] = hsum(a[r]);
}

#endif
