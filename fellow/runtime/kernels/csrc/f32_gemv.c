/* a float32 weight times one row (f32_gemv.py) */
#include "dot.h"
#include "f32_rows8.h"


/* y [n] = w [n, k] x [k], k a multiple of 8 */
void swarm_f32_gemv(const float *x, const float *w, float *y, int64_t n, int64_t k) {
    const int64_t blocks = n / 8;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) f32_rows8(w + b * 8 * k, x, k, y + b * 8);
    for (int64_t j = blocks * 8; j < n; j++) y[j] = dot(x, w + j * k, k);  /* the last rows, fewer than a block */
}
