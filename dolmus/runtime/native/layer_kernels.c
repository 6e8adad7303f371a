/* RMSNorm, SiLU-and-multiply and rotary embedding for bf16 models on x86 CPUs with AVX-512
 * (BF16); decode attention is in decode_attention.c.
 *
 * Each replaces several small PyTorch ops per layer and token (see __init__.py). They
 * compute in float32 and round to bf16 where PyTorch's bf16 code rounds, so the elementwise
 * kernels give PyTorch's bits (up to the order of one float sum in RMSNorm, and our exp against
 * PyTorch's own in SiLU).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

#include "bf16_simd.h"
#include "kernels.h"

/* out = weight * bf16(x * rsqrt(mean(x^2) + eps)) for one row: transformers' order (statistics
 * in float32, the normalized row rounded to bf16, then the weight). cols % 16 == 0. */
static inline void norm_row(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t cols, float eps) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += 16) {
        __m512 v = load_bf16x16(x + c);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)cols + eps));
    for (int64_t c = 0; c < cols; c += 16) {
        __m512 normed = round_to_bf16(_mm512_mul_ps(load_bf16x16(x + c), inv));
        store_bf16x16(out + c, _mm512_mul_ps(normed, load_bf16x16(weight + c)));
    }
}

/* RMSNorm of each row (norm_row). */
void dolmus_rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows,
                     int64_t cols, float eps) {
    if (rows <= SHARED_ROWS) {
        for (int64_t r = 0; r < rows; r++) norm_row(x + r * cols, weight, out + r * cols, cols, eps);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * cols, weight, out + r * cols, cols, eps);
}

/* A layer's residual add and the next RMSNorm in one pass: residual = bf16(residual + x) in
 * place, then out = RMSNorm(residual), each row while it is in L1. The same bits as PyTorch's
 * bf16 add followed by dolmus_rms_norm; one read of the stream fewer, and no new tensor for the
 * sum. cols % 16 == 0. */
static inline void add_norm_row(const uint16_t *x, uint16_t *res, const uint16_t *weight, uint16_t *out,
                                int64_t cols, float eps) {
    for (int64_t c = 0; c < cols; c += 16)
        store_bf16x16(res + c, _mm512_add_ps(load_bf16x16(res + c), load_bf16x16(x + c)));
    norm_row(res, weight, out, cols, eps);
}

void dolmus_add_rms_norm(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                         int64_t rows, int64_t cols, float eps) {
    if (rows <= SHARED_ROWS) {
        for (int64_t r = 0; r < rows; r++)
            add_norm_row(x + r * cols, residual + r * cols, weight, out + r * cols, cols, eps);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) add_norm_row(x + r * cols, residual + r * cols, weight, out + r * cols, cols, eps);
}

uint16_t dolmus_silu_table[65536 + 1];

/* Fills dolmus_silu_table (bf16_simd.h) when the library loads, 16 entries at a time. */
__attribute__((constructor)) static void fill_silu_table(void) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int b = 0; b < 65536; b += 16) {
        __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_set1_epi32(b), lanes), 16));
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
        store_bf16x16(dolmus_silu_table + b, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    }
}

/* out = bf16(silu(gate)) * up, rounded to bf16: PyTorch's bf16 order. x: [rows][2 * cols]
 * (gate, then up, as the fused gate/up projection emits them); out: [rows][cols].
 * cols % 16 == 0. Work goes in spans of 512 columns, so one wide row can use both cores. */
static inline void silu_span(const uint16_t *x, uint16_t *out, int64_t r, int64_t c0, int64_t c1, int64_t cols) {
    const uint16_t *gate = x + r * 2 * cols, *up = gate + cols;
    for (int64_t c = c0; c < c1; c += 16)
        store_bf16x16(out + r * cols + c, silu_and_mul_ps(load_bf16x16(gate + c), load_bf16x16(up + c)));
}

void dolmus_silu_and_mul(const uint16_t *x, uint16_t *out, int64_t rows, int64_t cols) {
    if (rows * cols < 16384) {
        for (int64_t r = 0; r < rows; r++) silu_span(x, out, r, 0, cols, cols);
        return;
    }
    int64_t spans = (cols + 511) / 512;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < rows * spans; item++) {
        int64_t c0 = item % spans * 512;
        silu_span(x, out, item / spans, c0, c0 + 512 < cols ? c0 + 512 : cols, cols);
    }
}

/* In place: x = x * cos + rotate_half(x) * sin with each product and the sum rounded to bf16
 * (PyTorch's bf16 order); rotate_half(x) = (-x[d/2:], x[:d/2]). x: [tokens][heads][d] at
 * token stride x_stride; cos, sin: [tokens][d]. d % 32 == 0. */
static inline void rotary_token(uint16_t *x, const uint16_t *ct, const uint16_t *st, int64_t heads, int64_t d) {
    int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *row = x + h * d;
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

void dolmus_rotary(uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
                   int64_t tokens, int64_t heads, int64_t d) {
    if (tokens <= SHARED_ROWS) {
        for (int64_t t = 0; t < tokens; t++) rotary_token(x + t * x_stride, cos + t * d, sin + t * d, heads, d);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; t++) rotary_token(x + t * x_stride, cos + t * d, sin + t * d, heads, d);
}
