/* a float32 weight times one row (f32_gemv.py) */
#include "hsum.h"


/* y [n] = w [n, k] x [k], k a multiple of 8 */
void swarm_f32_gemv(const float *x, const float *w, float *y, int64_t n, int64_t k) {
    const int64_t blocks = n / 8;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const float *w0 = w + b * 8 * k;
        __m256 a[8];
        for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8) {
            const __m256 xv = _mm256_loadu_ps(x + i);
            #pragma GCC unroll 8
            for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + r * k + i), a[r]);
        }
        for (int r = 0; r < 8; r++) y[b * 8 + r] = hsum(a[r]);
    }
    for (int64_t j = blocks * 8; j < n; j++) {  /* the last rows, fewer than a block */
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + j * k + i), a);
        y[j] = hsum(a);
    }
}
