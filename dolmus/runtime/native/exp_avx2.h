/* exp of eight floats on AVX2 + FMA, and a softmax's numerators on it, for the float32 kernels (layer_kernels_f32.c,
 * prefill_attention_f32.c): Cephes' expf, e^x = 2^n e^r with |r| <= ln2 / 2 and a degree-6
 * polynomial for e^r, within 2 ulp of the exact value. Inputs are clamped to +-88.38: below,
 * the result is 0 (e^-88.38 is under the smallest normal float anyway); above, a large finite
 * number; NaN stays NaN. */
#ifndef DOLMUS_EXP_AVX2_H
#define DOLMUS_EXP_AVX2_H

#include <math.h>
#include <stdint.h>
#include <immintrin.h>

static inline __m256 exp_ps(__m256 x) {
    /* x second: min and max return their second operand when either is NaN, so NaN stays NaN */
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x);
    x = _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), x);
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    /* r = x - n ln2, with ln2 in two parts so the product is exact enough */
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    /* 2^n from the exponent bits; n = -127 (the clamp's floor) gives 0 */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* A softmax's numerators: s[0..n) -> e^(s - top) in place; returns their sum (eight lanes'
 * sums added in lane order, then the last n % 8 in order, on expf). */
static inline float exp_sub_sum(float *s, int64_t n, float top) {
    __m256 mx = _mm256_set1_ps(top), sum = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + k), mx));
        _mm256_storeu_ps(s + k, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, sum);
    for (int j = 0; j < 8; j++) total += lanes[j];
    for (; k < n; k++) {
        s[k] = expf(s[k] - top);
        total += s[k];
    }
    return total;
}

#endif
