/* an int8 weight times a few float32 rows (quant/int8_gemv.py) */
#include "int8_dot.h"

#include <math.h>

/* x [rows, k] float -> xq [rows, k] int8 and d [rows, k/32] float (k % 32 == 0) */
static void quantize_rows(const float *x, int8_t *xq, float *d, int64_t rows, int64_t k) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t b = 0; b < k / 32; b++) {
            const float *xb = x + m * k + b * 32;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) { float a = fabsf(xb[i]); if (a > amax) amax = a; }
            float dd = amax / 127.f, inv = dd ? 1.f / dd : 0.f;
            d[m * (k / 32) + b] = dd;
            for (int i = 0; i < 32; i++) xq[m * k + b * 32 + i] = (int8_t)lrintf(xb[i] * inv);
        }
}

/* y[m * n + j] = scale[j] * sum_b d[m, b] * sum_{i in block b} xq[m, i] * w[j, i]: each row quantized to
   int8 in blocks of 32 (xq, d: the caller's scratch), then multiplied with AVX2's int8 products */
void swarm_int8_gemv(const float *x, const int8_t *w, const float *scale, float *y, int64_t rows, int64_t n, int64_t k,
             int8_t *xq, float *d) {
    quantize_rows(x, xq, d, rows, k);
    int64_t nb = k / 32;
    #pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++)
        for (int64_t m = 0; m < rows; m++)
            y[m * n + j] = int8_dot(w + j * k, xq + m * k, d + m * nb, nb) * scale[j];
}
