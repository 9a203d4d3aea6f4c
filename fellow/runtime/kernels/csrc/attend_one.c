/* one session's decode attention for one layer (attend_kernel.py) */
#include "dot.h"

#include <stdlib.h>
#include <string.h>
#include <math.h>

/* the dot products of a with four rows of b (row stride `stride`), as four lanes */
static inline __m128 dot4(const float *a, const float *b, int64_t stride, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(a + i);
        s0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + stride + i), s1);
        s2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 2 * stride + i), s2);
        s3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 3 * stride + i), s3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    if (i < n) {
        float rest[4] = {0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < 4; j++)
            for (int64_t k = i; k < n; k++) rest[j] += a[k] * b[j * stride + k];
        r = _mm_add_ps(r, _mm_loadu_ps(rest));
    }
    return r;
}

/* q [kv_heads * groups, dim], k_new and v_new [kv_heads, dim]; keys and values [kv_heads, capacity, dim]
   with the given head and position strides (dim contiguous). Writes k_new and v_new at `length`, then
   out [kv_heads * groups, dim] = softmax(scale * q K[start..length]^T) V[start..length] per head. */
void swarm_attend_one(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                      int64_t head_stride, int64_t pos_stride, int64_t kv_heads, int64_t groups, int64_t dim,
                      int64_t length, int64_t start, float scale, float *out, int64_t parallel) {
    for (int64_t h = 0; h < kv_heads; h++) {
        memcpy(keys + h * head_stride + length * pos_stride, k_new + h * dim, dim * sizeof(float));
        memcpy(values + h * head_stride + length * pos_stride, v_new + h * dim, dim * sizeof(float));
    }
    const int64_t n = length + 1 - start, heads = kv_heads * groups;
    #pragma omp parallel if(parallel)
    {
        float *p = malloc(n * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t hq = 0; hq < heads; hq++) {
            const int64_t h = hq / groups;
            const float *qq = q + hq * dim;
            const float *kb = keys + h * head_stride + start * pos_stride;
            const float *vb = values + h * head_stride + start * pos_stride;
            float top = -INFINITY;
            int64_t t = 0;
            for (; t + 4 <= n; t += 4) {  /* four positions at once: one horizontal sum for four */
                __m128 s4 = dot4(qq, kb + t * pos_stride, pos_stride, dim);
                _mm_storeu_ps(p + t, _mm_mul_ps(s4, _mm_set1_ps(scale)));
            }
            for (; t < n; t++) p[t] = dot(qq, kb + t * pos_stride, dim) * scale;
            for (t = 0; t < n; t++) if (p[t] > top) top = p[t];
            float sum = 0.f;
            for (t = 0; t < n; t++) { p[t] = expf(p[t] - top); sum += p[t]; }
            const float inv = 1.f / sum;
            float *o = out + hq * dim;
            int64_t c = 0;
            for (; c + 32 <= dim; c += 32) {  /* 32 outputs kept in registers over every position */
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (t = 0; t < n; t++) {
                    const float *vr = vb + t * pos_stride + c;
                    const __m256 w = _mm256_set1_ps(p[t]);
                    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr), a0);
                    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8), a1);
                    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 16), a2);
                    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 24), a3);
                }
                const __m256 iv = _mm256_set1_ps(inv);
                _mm256_storeu_ps(o + c, _mm256_mul_ps(a0, iv));
                _mm256_storeu_ps(o + c + 8, _mm256_mul_ps(a1, iv));
                _mm256_storeu_ps(o + c + 16, _mm256_mul_ps(a2, iv));
                _mm256_storeu_ps(o + c + 24, _mm256_mul_ps(a3, iv));
            }
            for (; c < dim; c++) {
                float a = 0.f;
                for (t = 0; t < n; t++) a += p[t] * vb[t * pos_stride + c];
                o[c] = a * inv;
            }
        }
        free(p);
    }
}
