/* RMSNorm, SiLU-and-multiply, rotary embedding and decode attention for bf16 models on x86
 * CPUs with AVX-512 (BF16).
 *
 * Each replaces several small PyTorch ops per layer and token (see __init__.py). They
 * compute in float32 and round to bf16 where PyTorch's bf16 code rounds, so the elementwise
 * kernels give PyTorch's bits (up to the order of one float sum in RMSNorm, and expf against
 * PyTorch's own exp in SiLU) and attention agrees to bf16 rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

static inline __m512 load_bf16x16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store_bf16x16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __m512 round_to_bf16(__m512 v) {
    __m256bh h = _mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

/* out[r] = weight * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)): transformers' order (statistics
 * in float32, the normalized row rounded to bf16, then the weight). cols % 16 == 0. */
void dolmus_rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows,
                     int64_t cols, float eps) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * cols;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t c = 0; c < cols; c += 16) {
            __m512 v = load_bf16x16(xr + c);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)cols + eps));
        for (int64_t c = 0; c < cols; c += 16) {
            __m512 normed = round_to_bf16(_mm512_mul_ps(load_bf16x16(xr + c), inv));
            store_bf16x16(out + r * cols + c, _mm512_mul_ps(normed, load_bf16x16(weight + c)));
        }
    }
}

/* One new token per sequence attends to its cached keys and values (its own included).
 *   q:        token s's query heads at q + s * q_stride, [hq][d]
 *   k_cache, v_cache: [slots][hkv][d], slot = block * bs + offset
 *   block_ids: [n][nb] each sequence's blocks; lengths: [n] positions to attend
 *   out:      [n][hq][d]
 * Query head j reads KV head j / (hq / hkv). Work items are (sequence, KV head) pairs, so
 * the query heads sharing a KV head read each key once. d % 16 == 0. */
void dolmus_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int64_t *block_ids, int64_t nb,
                             const int64_t *lengths, uint16_t *out, int64_t n, int64_t hq,
                             int64_t hkv, int64_t d, int64_t bs, float scale) {
    int64_t group = hq / hkv;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < n * hkv; item++) {
        int64_t s = item / hkv, h = item % hkv, len = lengths[s];
        const int64_t *table = block_ids + s * nb;
        float *qf = malloc(sizeof(float) * (size_t)(2 * group * d + group * len));
        if (!qf) continue;
        float *acc = qf + group * d, *scores = acc + group * d;
        const uint16_t *qs = q + s * q_stride + h * group * d;
        for (int64_t i = 0; i < group * d; i += 16)
            _mm512_storeu_ps(qf + i, _mm512_mul_ps(load_bf16x16(qs + i), _mm512_set1_ps(scale)));
        for (int64_t p = 0; p < len; p++) {
            const uint16_t *kr = k_cache + ((table[p / bs] * bs + p % bs) * hkv + h) * d;
            for (int64_t g = 0; g < group; g++) {
                __m512 dot = _mm512_setzero_ps();
                for (int64_t i = 0; i < d; i += 16)
                    dot = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * d + i), load_bf16x16(kr + i), dot);
                scores[g * len + p] = _mm512_reduce_add_ps(dot);
            }
        }
        for (int64_t g = 0; g < group; g++) { /* softmax, in place */
            float *sg = scores + g * len, top = sg[0], sum = 0;
            for (int64_t p = 1; p < len; p++) top = sg[p] > top ? sg[p] : top;
            for (int64_t p = 0; p < len; p++) {
                sg[p] = expf(sg[p] - top);
                sum += sg[p];
            }
            for (int64_t p = 0; p < len; p++) sg[p] /= sum;
        }
        memset(acc, 0, sizeof(float) * (size_t)(group * d));
        for (int64_t p = 0; p < len; p++) {
            const uint16_t *vr = v_cache + ((table[p / bs] * bs + p % bs) * hkv + h) * d;
            for (int64_t i = 0; i < d; i += 16) {
                __m512 v = load_bf16x16(vr + i);
                for (int64_t g = 0; g < group; g++) {
                    float *a = acc + g * d + i;
                    _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + p]), v, _mm512_loadu_ps(a)));
                }
            }
        }
        uint16_t *o = out + (s * hq + h * group) * d;
        for (int64_t i = 0; i < group * d; i += 16) store_bf16x16(o + i, _mm512_loadu_ps(acc + i));
        free(qf);
    }
}

/* out = bf16(silu(gate)) * up, rounded to bf16: PyTorch's bf16 order. x: [rows][2 * cols]
 * (gate, then up, as the fused gate/up projection emits them); out: [rows][cols].
 * cols % 16 == 0. */
void dolmus_silu_and_mul(const uint16_t *x, uint16_t *out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * cols, *up = gate + cols;
        float g[16];
        for (int64_t c = 0; c < cols; c += 16) {
            _mm512_storeu_ps(g, load_bf16x16(gate + c));
            for (int i = 0; i < 16; i++) g[i] = g[i] / (1.0f + expf(-g[i]));
            __m512 s = round_to_bf16(_mm512_loadu_ps(g));
            store_bf16x16(out + r * cols + c, _mm512_mul_ps(s, load_bf16x16(up + c)));
        }
    }
}

/* In place: x = x * cos + rotate_half(x) * sin with each product and the sum rounded to bf16
 * (PyTorch's bf16 order); rotate_half(x) = (-x[d/2:], x[:d/2]). x: [tokens][heads][d] at
 * token stride x_stride; cos, sin: [tokens][d]. d % 32 == 0. */
void dolmus_rotary(uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
                   int64_t tokens, int64_t heads, int64_t d) {
    int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (tokens > 16)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *ct = cos + t * d, *st = sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *row = x + t * x_stride + h * d;
            for (int64_t i = 0; i < half; i += 16) {
                __m512 a = load_bf16x16(row + i), b = load_bf16x16(row + half + i);
                __m512 lo = _mm512_add_ps(round_to_bf16(_mm512_mul_ps(a, load_bf16x16(ct + i))),
                                          round_to_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b),
                                                                      load_bf16x16(st + i))));
                __m512 hi = _mm512_add_ps(round_to_bf16(_mm512_mul_ps(b, load_bf16x16(ct + half + i))),
                                          round_to_bf16(_mm512_mul_ps(a, load_bf16x16(st + half + i))));
                store_bf16x16(row + i, lo);
                store_bf16x16(row + half + i, hi);
            }
        }
    }
}
