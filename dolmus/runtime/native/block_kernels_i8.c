/* The block-quantized products of block_kernels.c with the activations rounded to int8 per
 * block of 32 first, as llama.cpp does for every run (`--gguf-activations int8`): a block's
 * product is a few integer instructions (maddubs, madd) instead of a float decode of its codes.
 * The weights are in block_kernels.c's layout and lane-major code order; outputs are float32,
 * rows split over PyTorch's OpenMP threads (see __init__.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>

#include "kernels_f32.h"
#include "sums_avx2.h"

#define MR 4 /* activation rows sharing one load of a block's codes */

/* x [M][K] as int8 per block of 32 (llama.cpp's Q8_0, for activations): xq in each block's
 * lane-major order (that of the weight codes, so a byte-wise dot product pairs the right
 * inputs), d[M][K/32] = max |x| / 127 per block, and, where sums is given, the sum of x (the
 * float values) per group of g inputs: the minima's term is minimum * sum. */
static void quantize_rows_i8(const float *x, int64_t M, int64_t K, int g, int8_t *xq, float *d, float *sums) {
    int64_t nb = K / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * K + b * 32;
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int a = 0; a < 4; a++) {
                v[a] = _mm256_loadu_ps(xb + 8 * a);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[a]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float mx = _mm_cvtss_f32(h);
            __m256 inv = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
            int32_t q[32];
            for (int a = 0; a < 4; a++)
                _mm256_storeu_si256((__m256i *)(q + 8 * a), _mm256_cvtps_epi32(_mm256_mul_ps(v[a], inv)));
            int8_t *out = xq + m * K + b * 32;
            for (int i = 0; i < 8; i++)
                for (int a = 0; a < 4; a++) out[4 * i + a] = (int8_t)q[8 * a + i];
            d[m * nb + b] = mx / 127.0f;
            if (sums) {
                for (int j = 0; j < 32 / g; j++) {
                    float t = 0.0f;
                    for (int i = 0; i < g; i++) t += xb[j * g + i];
                    sums[m * (K / g) + b * (32 / g) + j] = t;
                }
            }
        }
    }
}

/* One output row n against rows [m0, m0 + R) of the int8 x. Per block: |w| times x with w's
 * sign (maddubs: unsigned by signed bytes, pairs summed to int16; |w| <= 128 and |x| <= 127
 * cannot saturate), pairs summed to 8 int32 lanes, scaled in float. With two scales per block
 * (groups of 16) the int16 pairs of the first 16 weights (bytes 4i, 4i + 1: weights i, 8 + i)
 * and of the last 16 (bytes 4i + 2, 4i + 3) are summed apart. */
static inline __attribute__((always_inline)) void i8_tile(const int8_t *xq, const float *xd, const float *xs,
                                                          const int8_t *qn, const float *sn, const float *mn,
                                                          int spb, float *y, int64_t m0, int R, int64_t N,
                                                          int64_t K, int64_t n) {
    int64_t nb = K / 32, ng = nb * spb;
    const __m256i ones = _mm256_set1_epi16(1), first = _mm256_set1_epi32(1), last = _mm256_set1_epi32(1 << 16);
    __m256 acc[MR];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(qn + b * 32));
        __m256i aw = _mm256_sign_epi8(w, w);
        for (int i = 0; i < R; i++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (m0 + i) * K + b * 32));
            __m256i p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w));
            float dx = xd[(m0 + i) * nb + b];
            if (spb == 1) {
                __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(sn[b] * dx), acc[i]);
            } else {
                __m256 lo = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, first));
                __m256 hi = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, last));
                acc[i] = _mm256_fmadd_ps(lo, _mm256_set1_ps(sn[2 * b] * dx), acc[i]);
                acc[i] = _mm256_fmadd_ps(hi, _mm256_set1_ps(sn[2 * b + 1] * dx), acc[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        float r = hsum(acc[i]);
        if (mn) {
            const float *s = xs + (m0 + i) * ng;
            for (int64_t j = 0; j < ng; j++) r += mn[j] * s[j];
        }
        y[(m0 + i) * N + n] = r;
    }
}

/* y[M][N] = x[M][K] times the 8-bit weight, x rounded to int8 per block of 32 first. */
void dolmus_q8_gemm_i8(const float *x, const int8_t *q, const float *scale, const float *minimum, float *y,
                       int64_t M, int64_t N, int64_t K, int64_t spb_) {
    int spb = (int)spb_;
    int64_t nb = K / 32, ng = nb * spb;
    int8_t *xq = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    float *xd = malloc(sizeof(float) * (size_t)(M * nb));
    float *xs = minimum ? malloc(sizeof(float) * (size_t)(M * ng)) : NULL;
    if (xq && xd && (xs || !minimum)) {
        quantize_rows_i8(x, M, K, 32 / spb, xq, xd, xs);
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const int8_t *qn = q + n * K;
            const float *sn = scale + n * ng, *mn = minimum ? minimum + n * ng : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                switch (M - m0 < MR ? (int)(M - m0) : MR) {
                case 1: i8_tile(xq, xd, xs, qn, sn, mn, spb, y, m0, 1, N, K, n); break;
                case 2: i8_tile(xq, xd, xs, qn, sn, mn, spb, y, m0, 2, N, K, n); break;
                case 3: i8_tile(xq, xd, xs, qn, sn, mn, spb, y, m0, 3, N, K, n); break;
                default: i8_tile(xq, xd, xs, qn, sn, mn, spb, y, m0, MR, N, K, n); break;
                }
            }
        }
    }
    free(xq);
    free(xd);
    free(xs);
}

/* 4 bits: a block's 16 bytes of codes as its 32 codes in bytes, in the int8 x's order (byte
 * 4i + a: weight 8a + i). Byte j of the codes holds two weights in its nibbles (decode_q4's
 * lane i is bytes 2i, 2i + 1: weights i and 8 + i, then 16 + i and 24 + i), which become bytes
 * 2j and 2j + 1. */
static inline __m256i q4_bytes(const uint8_t *q) {
    __m128i b = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

/* One output row n of the 4-bit weight against row m of the int8 x: codes 0..15 (unsigned) by
 * x (signed) in maddubs, pairs summed to 8 int32 lanes, scaled by s * dx in float; the
 * minima's term is minimum times the sums of the rounded x per block (dx times the sum of its
 * int8 codes, as llama.cpp's Q8_1), so each weight w = q s + m meets the same rounded x: the
 * error is w times x's rounding, where float sums of x would leave q s times it (larger: q
 * runs 0..15 where w is centred by m). One row at a time: it runs at one row only
 * (gguf_blocks.Q4_I8_MAX_ROWS), so no row tile shares a block's widening. */
static float q4_i8_row(const int8_t *xq, const float *xd, const float *xs, const uint8_t *qn, const float *sn,
                       const float *mn, int64_t m, int64_t K) {
    int64_t nb = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + b * 32));
        __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q4_bytes(qn + b * 16), xv), ones));
        acc = _mm256_fmadd_ps(p, _mm256_set1_ps(sn[b] * xd[m * nb + b]), acc);
    }
    return hsum(acc) + (mn ? dot_f32(mn, xs + m * nb, nb) : 0.0f);
}

/* y[M][N] = x[M][K] times the 4-bit weight, x rounded to int8 per block of 32 first (as
 * llama.cpp's Q8_1 activations): a block's product is ~10 integer instructions, against ~20 to
 * decode it to floats, which is what bounds dolmus_q4_gemm_f32 at one row (from two rows the
 * float tile shares each decode; gguf_blocks.Q4_I8_MAX_ROWS). */
void dolmus_q4_gemm_i8(const float *x, const uint8_t *q, const float *scale, const float *minimum, float *y,
                       int64_t M, int64_t N, int64_t K) {
    int64_t nb = K / 32;
    int8_t *xq = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    float *xd = malloc(sizeof(float) * (size_t)(M * nb));
    float *xs = minimum ? malloc(sizeof(float) * (size_t)(M * nb)) : NULL;
    if (xq && xd && (xs || !minimum)) {
        quantize_rows_i8(x, M, K, 32, xq, xd, NULL);
        for (int64_t i = 0; xs && i < M * nb; i++) { /* the rounded x's sum per block */
            int32_t t = 0;
            for (int j = 0; j < 32; j++) t += xq[i * 32 + j];
            xs[i] = xd[i] * (float)t;
        }
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *qn = q + n * nb * 16;
            const float *sn = scale + n * nb, *mn = minimum ? minimum + n * nb : NULL;
            for (int64_t m = 0; m < M; m++) y[m * N + n] = q4_i8_row(xq, xd, xs, qn, sn, mn, m, K);
        }
    }
    free(xq);
    free(xd);
    free(xs);
}
