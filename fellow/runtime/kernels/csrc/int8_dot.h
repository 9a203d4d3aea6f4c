#ifndef SWARM_INT8_DOT_H
#define SWARM_INT8_DOT_H
/* an int8 weight row by an int8-quantized input row over nb blocks of 32 (each block's products summed in
   integers, then scaled by the input block's scale d[b]); the weight row's own scale is the caller's */
#include "hsum.h"

static inline float int8_dot(const int8_t *wr, const int8_t *xr, const float *dr, int64_t nb) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + b * 32));
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dr[b]), acc0);
        __m256i wv2 = _mm256_loadu_si256((const __m256i *)(wr + b * 32 + 32));
        __m256i xv2 = _mm256_loadu_si256((const __m256i *)(xr + b * 32 + 32));
        __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv2, wv2), _mm256_sign_epi8(xv2, wv2)), ones);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p2), _mm256_set1_ps(dr[b + 1]), acc1);
    }
    for (; b < nb; b++) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + b * 32));
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dr[b]), acc0);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

#endif
