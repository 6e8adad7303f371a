/* Horizontal sums on AVX2 that the float32 kernels share (block_kernels.c, block_kernels_i8.c,
 * layer_kernels_f32.c). */
#ifndef DOLMUS_SUMS_AVX2_H
#define DOLMUS_SUMS_AVX2_H

#include <stdint.h>
#include <immintrin.h>

/* The sum of the 8 lanes of v. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum(a[i] * b[i]) over i < n, eight lanes at a time. */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float r = hsum(acc);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

#endif
