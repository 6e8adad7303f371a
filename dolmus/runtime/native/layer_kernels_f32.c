/* RMSNorm, SiLU-and-multiply, rotary embedding and decode attention for float32 models on x86
 * CPUs with AVX2 and FMA: layer_kernels.c's functions for CPUs without AVX-512 BF16, where
 * models run in float32 (and GGUF weights on block_kernels.c).
 *
 * Same arithmetic as PyTorch's float32 ops up to the order of float sums (and expf against
 * PyTorch's own exp). Each call replaces three to six small PyTorch ops per layer and token.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "kernels_f32.h"

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)). cols % 8 == 0. */
void dolmus_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t cols,
                         float eps) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 16 <= cols; c += 16) {
            __m256 a = _mm256_loadu_ps(xr + c), b = _mm256_loadu_ps(xr + c + 8);
            s0 = _mm256_fmadd_ps(a, a, s0);
            s1 = _mm256_fmadd_ps(b, b, s1);
        }
        for (; c < cols; c += 8) {
            __m256 a = _mm256_loadu_ps(xr + c);
            s0 = _mm256_fmadd_ps(a, a, s0);
        }
        __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(_mm256_add_ps(s0, s1)) / (float)cols + eps));
        for (c = 0; c < cols; c += 8)
            _mm256_storeu_ps(out + r * cols + c,
                             _mm256_mul_ps(_mm256_loadu_ps(weight + c), _mm256_mul_ps(_mm256_loadu_ps(xr + c), inv)));
    }
}

/* out = silu(gate) * up. x: [rows][2 * cols] (gate, then up); out: [rows][cols]. */
void dolmus_silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * cols, *up = gate + cols;
        float *o = out + r * cols;
        for (int64_t c = 0; c < cols; c++) o[c] = gate[c] / (1.0f + expf(-gate[c])) * up[c];
    }
}

/* In place: x = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[d/2:], x[:d/2]).
 * x: [tokens][heads][d] at token stride x_stride; cos, sin: [tokens][d]. d % 16 == 0. */
void dolmus_rotary_f32(float *x, int64_t x_stride, const float *cos, const float *sin, int64_t tokens,
                       int64_t heads, int64_t d) {
    int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (tokens > 16)
    for (int64_t t = 0; t < tokens; t++) {
        const float *ct = cos + t * d, *st = sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            float *row = x + t * x_stride + h * d;
            for (int64_t i = 0; i < half; i += 8) {
                __m256 a = _mm256_loadu_ps(row + i), b = _mm256_loadu_ps(row + half + i);
                /* a*cos - b*sin, b*cos + a*sin: each product rounded, then the sum (PyTorch's order) */
                __m256 lo = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(ct + i)),
                                          _mm256_mul_ps(b, _mm256_loadu_ps(st + i)));
                __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(ct + half + i)),
                                          _mm256_mul_ps(a, _mm256_loadu_ps(st + half + i)));
                _mm256_storeu_ps(row + i, lo);
                _mm256_storeu_ps(row + half + i, hi);
            }
        }
    }
}

/* One new token per sequence attends to its cached keys and values (its own included); the
 * layout is layer_kernels.c's dolmus_decode_attention, in float32. d % 8 == 0. */
void dolmus_decode_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                                 const float *v_cache, const int64_t *block_ids, int64_t nb,
                                 const int64_t *lengths, float *out, int64_t n, int64_t hq, int64_t hkv,
                                 int64_t d, int64_t bs, float scale, int64_t window) {
    int64_t group = hq / hkv;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < n * hkv; item++) {
        int64_t s = item / hkv, h = item % hkv, end = lengths[s];
        int64_t first = window > 0 && end > window ? end - window : 0, len = end - first;
        const int64_t *table = block_ids + s * nb;
        float *qf = malloc(sizeof(float) * (size_t)(2 * group * d + group * len));
        if (!qf) continue;
        float *acc = qf + group * d, *scores = acc + group * d;
        const float *qs = q + s * q_stride + h * group * d;
        for (int64_t i = 0; i < group * d; i += 8)
            _mm256_storeu_ps(qf + i, _mm256_mul_ps(_mm256_loadu_ps(qs + i), _mm256_set1_ps(scale)));
        for (int64_t p = 0; p < len; p++) {
            const float *kr = k_cache + ((table[(first + p) / bs] * bs + (first + p) % bs) * hkv + h) * d;
            for (int64_t g = 0; g < group; g++) {
                __m256 dot = _mm256_setzero_ps();
                for (int64_t i = 0; i < d; i += 8)
                    dot = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * d + i), _mm256_loadu_ps(kr + i), dot);
                scores[g * len + p] = hsum8(dot);
            }
        }
        for (int64_t g = 0; g < group; g++) { /* softmax, in place */
            float *sg = scores + g * len, top = sg[0], sum = 0;
            for (int64_t p = 1; p < len; p++) top = sg[p] > top ? sg[p] : top;
            for (int64_t p = 0; p < len; p++) {
                sg[p] = expf(sg[p] - top);
                sum += sg[p];
            }
            float inv = 1.0f / sum;
            for (int64_t p = 0; p < len; p++) sg[p] *= inv;
        }
        memset(acc, 0, sizeof(float) * (size_t)(group * d));
        for (int64_t p = 0; p < len; p++) {
            const float *vr = v_cache + ((table[(first + p) / bs] * bs + (first + p) % bs) * hkv + h) * d;
            for (int64_t i = 0; i < d; i += 8) {
                __m256 v = _mm256_loadu_ps(vr + i);
                for (int64_t g = 0; g < group; g++) {
                    float *a = acc + g * d + i;
                    _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(scores[g * len + p]), v, _mm256_loadu_ps(a)));
                }
            }
        }
        memcpy(out + (s * hq + h * group) * d, acc, sizeof(float) * (size_t)(group * d));
        free(qf);
    }
}
