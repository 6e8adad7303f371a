/* Matrix products on llama.cpp-style block-quantized weights with float32 activations, for x86
 * CPUs with AVX2, FMA and F16C (every x86 server CPU of the last decade).
 *
 * A weight row of K inputs is K / 32 blocks of 32 codes. 4 bits: 16 bytes per block, one float32
 * scale s and minimum m per block, w = q * s + m, q in 0..15 (Q4_0: m = -8 s; Q4_1 and Q4_K: the
 * file's). 8 bits: 32 int8 codes per block and a scale (and, where given, a minimum) per G = 32
 * or 16 inputs (SPB = 32 / G of them per block), w = q * s (+ m): Q8_0 (G 32), and the other
 * K-quants, widened to bytes on load (Q5_K with minima per 32; Q6_K, Q3_K per 16; Q2_K per 16
 * with minima). The codes of a block are in the lane-major order decode_q4/decode_q8 describe.
 * A file's scales are fp16 times small integers, so q * s is exact in float32 and the one
 * rounding of the product or fused multiply-add below gives the bits the gguf package's
 * dequantization gives (weights quantized on load have any float32 scales: there it is within a
 * rounding). The one-row products (q8_row, q4_row) take the scale and minimum out of the sums,
 * so at one row a weight counts within a rounding of what the decoding gives.
 *
 * At a few rows (decode) the time is the weight reads: each block is decoded once into float
 * registers and multiplied with up to MR rows of x. `--gguf-activations int8` takes x as int8
 * per block of 32 instead, as llama.cpp does for every run (block_kernels_i8.c): integer dot
 * products of 32 bytes in a few instructions, no float decode of the weight. Many rows
 * (prefill) go to PyTorch's GEMM on rows dequantized a chunk at a time (the *_dequant
 * functions). Output rows are split over PyTorch's OpenMP threads (see __init__.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>
#include <omp.h>

#include "kernels_f32.h"
#include "sums_avx2.h"

#define MR 4 /* activation rows sharing one decode of a block */

/* The 32 weights of one block as 4 vectors of 8 floats, in input order. The kernels' codes are
 * lane-major (gguf_blocks.pack_lanes): 32-bit lane i of a block's 16 (4-bit) or 32 (8-bit)
 * bytes holds weights i, 8 + i, 16 + i and 24 + i, so each vector of 8 comes out with shifts
 * and masks alone, no byte shuffles (those limited the GGUF byte order to ~2 weights a cycle). */
static inline void decode_q4(const uint8_t *q, float s, float m, __m256 w[4]) {
    __m256i lanes = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)q));
    __m256i mask = _mm256_set1_epi32(0x0F);
    __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lanes, mask)), vs, vm);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(lanes, 4), mask)), vs, vm);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(lanes, 8), mask)), vs, vm);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(lanes, 12)), vs, vm);
}

/* 8 bits: weights 0..15 of the block take scale s0 (and minimum m0), 16..31 s1 (m1); m0 and
 * m1 are read only where the weight has minima. */
static inline void decode_q8(const int8_t *q, float s0, float s1, const float *m, int spb, __m256 w[4]) {
    __m256i lanes = _mm256_loadu_si256((const __m256i *)q);
    __m256 lo = _mm256_set1_ps(s0), hi = _mm256_set1_ps(s1);
    __m256 c[4] = {
        _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(lanes, 24), 24)),
        _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(lanes, 16), 24)),
        _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(lanes, 8), 24)),
        _mm256_cvtepi32_ps(_mm256_srai_epi32(lanes, 24)),
    };
    if (m) {
        __m256 mlo = _mm256_set1_ps(m[0]), mhi = _mm256_set1_ps(m[spb - 1]);
        w[0] = _mm256_fmadd_ps(c[0], lo, mlo);
        w[1] = _mm256_fmadd_ps(c[1], lo, mlo);
        w[2] = _mm256_fmadd_ps(c[2], hi, mhi);
        w[3] = _mm256_fmadd_ps(c[3], hi, mhi);
    } else {
        w[0] = _mm256_mul_ps(c[0], lo);
        w[1] = _mm256_mul_ps(c[1], lo);
        w[2] = _mm256_mul_ps(c[2], hi);
        w[3] = _mm256_mul_ps(c[3], hi);
    }
}

/* One output row n against rows [m0, m0 + R) of x, R a compile-time 1..MR once inlined.
 * Each x row keeps A accumulators: at one or two rows, one per 8-wide part of a block (A = 4),
 * so each chain of dependent multiply-adds takes one per block; from three rows, two (even and
 * odd parts: A = 2), as the rows' own chains hide the latency and 4 * R would not fit the 16
 * registers. With two at one row, the chain of two multiply-adds a block (8 cycles) held an
 * 8-bit layer near 11 cycles a block. (One row of the common formats takes q8_row / q4_row
 * below instead.) */
#define ROW_TILE(NAME, CODE_T, DECODE, CODE_STEP)                                             \
    static inline __attribute__((always_inline)) void NAME(                                     \
        const float *x, const CODE_T *qn, const float *sn, const float *mn, int spb, float *y,  \
        int64_t m0, int R, int64_t N, int64_t K, int64_t n) {                                  \
        int64_t nb = K / 32;                                                                    \
        const int A = R <= 2 ? 4 : 2;                                                           \
        __m256 acc[MR][4];                                                                      \
        for (int i = 0; i < R; i++)                                                             \
            for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();                        \
        for (int64_t b = 0; b < nb; b++) {                                                      \
            __m256 w[4];                                                                        \
            DECODE;                                                                             \
            for (int i = 0; i < R; i++) {                                                       \
                const float *xb = x + (m0 + i) * K + b * 32;                                    \
                for (int j = 0; j < 4; j++)                                                     \
                    acc[i][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[i][j % A]); \
            }                                                                                   \
        }                                                                                       \
        for (int i = 0; i < R; i++) {                                                           \
            __m256 t = _mm256_add_ps(acc[i][0], acc[i][1]);                                     \
            if (A == 4) t = _mm256_add_ps(t, _mm256_add_ps(acc[i][2], acc[i][3]));              \
            y[(m0 + i) * N + n] = hsum(t);                                                      \
        }                                                                                       \
    }

ROW_TILE(q4_tile, uint8_t, decode_q4(qn + b * 16, sn[b], mn[b], w), 16)
/* Q8_0 (one scale per block, no minima) gets its own tile, the general decode folded away. */
ROW_TILE(q8_tile, int8_t, decode_q8(qn + b * 32, sn[b], sn[b], NULL, 1, w), 32)
ROW_TILE(q8g_tile, int8_t,
         decode_q8(qn + b * 32, sn[b * spb], sn[b * spb + spb - 1], mn ? mn + b * spb : NULL, spb, w), 32)

/* One row of x (decode), where the time is decoding the codes: the scale (and, 4 bits, the
 * minimum) leaves the inner products. 8 bits without minima: sum_b s_b (q_b . x_b); 4 bits:
 * that plus sum_b m_b xsum_b, xsum the sums of x per block, taken once per call. Codes are
 * converted where their bits lie, masked, not shifted down (masks issue on every vector pipe,
 * shifts on two): an 8-bit code comes out as q 2^24 (the row's sum is scaled back once), and
 * 4-bit code a of a lane as q 2^(4a), met by xs, x scaled by 2^(-4a) per 8-wide part once per
 * call. Powers of two change no product's rounding (in the normal range: an x below 2^-114
 * scaled by 2^-12 is subnormal). Two blocks a turn on two accumulators keep
 * the one chain per block off the multiply-add latency. */
static inline __m256 q8_dot(const int8_t *q, const float *x) {
    __m256i lanes = _mm256_loadu_si256((const __m256i *)q);
    __m256i top = _mm256_set1_epi32((int)0xFF000000u);
    __m256 c0 = _mm256_cvtepi32_ps(_mm256_slli_epi32(lanes, 24));
    __m256 c1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_slli_epi32(lanes, 16), top));
    __m256 c2 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_slli_epi32(lanes, 8), top));
    __m256 c3 = _mm256_cvtepi32_ps(_mm256_and_si256(lanes, top));
    __m256 t0 = _mm256_mul_ps(c0, _mm256_loadu_ps(x)), t1 = _mm256_mul_ps(c1, _mm256_loadu_ps(x + 8));
    t0 = _mm256_fmadd_ps(c2, _mm256_loadu_ps(x + 16), t0);
    t1 = _mm256_fmadd_ps(c3, _mm256_loadu_ps(x + 24), t1);
    return _mm256_add_ps(t0, t1);
}
#define Q8_ROW_SCALE 0x1p-24f

static inline __m256 q4_dot(const uint8_t *q, const float *xs) {
    __m256i lanes = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)q));
    __m256 c0 = _mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(0x000F)));
    __m256 c1 = _mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(0x00F0)));
    __m256 c2 = _mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(0x0F00)));
    __m256 c3 = _mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(0xF000)));
    __m256 t0 = _mm256_mul_ps(c0, _mm256_loadu_ps(xs)), t1 = _mm256_mul_ps(c1, _mm256_loadu_ps(xs + 8));
    t0 = _mm256_fmadd_ps(c2, _mm256_loadu_ps(xs + 16), t0);
    t1 = _mm256_fmadd_ps(c3, _mm256_loadu_ps(xs + 24), t1);
    return _mm256_add_ps(t0, t1);
}

#define ONE_ROW(NAME, CODE_T, DOT, CODE_BYTES)                                                   \
    static inline float NAME(const float *x, const CODE_T *qn, const float *sn, int64_t nb) {   \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                              \
        int64_t b = 0;                                                                          \
        for (; b + 1 < nb; b += 2) {                                                            \
            a0 = _mm256_fmadd_ps(DOT(qn + b * CODE_BYTES, x + b * 32), _mm256_set1_ps(sn[b]), a0); \
            a1 = _mm256_fmadd_ps(DOT(qn + (b + 1) * CODE_BYTES, x + (b + 1) * 32),              \
                                 _mm256_set1_ps(sn[b + 1]), a1);                                \
        }                                                                                       \
        if (b < nb) a0 = _mm256_fmadd_ps(DOT(qn + b * CODE_BYTES, x + b * 32), _mm256_set1_ps(sn[b]), a0); \
        return hsum(_mm256_add_ps(a0, a1));                                                     \
    }

ONE_ROW(q8_row, int8_t, q8_dot, 32)
ONE_ROW(q4_row, uint8_t, q4_dot, 16)

/* For the 4-bit row: the sums of x's one row per block of 32, xsum[nb], and xs[K], x with
 * part a (inputs 8a..8a+7) of each block scaled by 2^(-4a). */
static void q4_row_inputs(const float *x, int64_t nb, float *xsum, float *xs) {
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * 32;
        __m256 v[4], s = _mm256_setzero_ps();
        for (int a = 0; a < 4; a++) {
            v[a] = _mm256_loadu_ps(xb + 8 * a);
            s = _mm256_add_ps(s, v[a]);
            _mm256_storeu_ps(xs + b * 32 + 8 * a, _mm256_mul_ps(v[a], _mm256_set1_ps(1.0f / (float)(1 << (4 * a)))));
        }
        xsum[b] = hsum(s);
    }
}

#define FOR_ROW_TILES(TILE)                                                         \
    for (int64_t m0 = 0; m0 < M; m0 += MR) {                                        \
        switch (M - m0 < MR ? (int)(M - m0) : MR) {                                 \
        case 1: TILE(x, qn, sn, mn, spb, y, m0, 1, N, K, n); break;                      \
        case 2: TILE(x, qn, sn, mn, spb, y, m0, 2, N, K, n); break;                      \
        case 3: TILE(x, qn, sn, mn, spb, y, m0, 3, N, K, n); break;                      \
        default: TILE(x, qn, sn, mn, spb, y, m0, MR, N, K, n); break;                    \
        }                                                                           \
    }

/* Batches of more than MR rows: NS output rows are decoded once into a float buffer that
 * stays in cache (NS * K floats), then multiplied with every row of x; each weight is decoded
 * once per call instead of once per MR rows of x. From XT_MIN_ROWS rows, x is transposed once
 * per call (xt [K][Mp], Mp = M rounded up to 16, zero rows past M), and per input k the NS
 * broadcast weights meet 16 rows of x in two vectors on 2 * NS accumulators: two vector loads
 * and NS broadcasts for 2 * NS multiply-adds. Below, each row of x takes the strip as dot
 * products (two accumulators per output row), a load per multiply-add but no padding: at 8
 * rows, half of a 16-row block would be zeros. Measured on an AVX2 EPYC (Qwen2.5-0.5B's
 * layers, 2 threads): the transposed form 1.3-1.9x the dot products from 16 rows, 0.65-1.0x
 * at 5-8. */
#define NS 6
#define XT_MIN_ROWS 16
static inline void strip_dots(const float *buf, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                              int64_t n0, int ns) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        __m256 acc[NS][2];
        for (int j = 0; j < NS; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            __m256 x0 = _mm256_loadu_ps(xm + k), x1 = _mm256_loadu_ps(xm + k + 8);
            for (int j = 0; j < NS; j++) {
                acc[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(buf + j * K + k), x0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(_mm256_loadu_ps(buf + j * K + k + 8), x1, acc[j][1]);
            }
        }
        for (int j = 0; j < ns; j++) y[m * N + n0 + j] = hsum(_mm256_add_ps(acc[j][0], acc[j][1]));
    }
}

/* Rows [m0, m0 + 8 MV) of xt against the strip (MV = 1 or 2, a constant: the accumulators stay
 * in registers). */
#define STRIP_BLOCK(MV)                                                                          \
    do {                                                                                         \
        __m256 acc[NS][2];                                                                       \
        for (int j = 0; j < NS; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();                \
        for (int64_t k = 0; k < K; k++) {                                                        \
            const float *xk = xt + k * Mp + m0;                                                  \
            __m256 x0 = _mm256_loadu_ps(xk), x1 = MV == 2 ? _mm256_loadu_ps(xk + 8) : x0;        \
            for (int j = 0; j < NS; j++) {                                                       \
                __m256 w = _mm256_broadcast_ss(buf + j * K + k);                                 \
                acc[j][0] = _mm256_fmadd_ps(w, x0, acc[j][0]);                                   \
                if (MV == 2) acc[j][1] = _mm256_fmadd_ps(w, x1, acc[j][1]);                      \
            }                                                                                    \
        }                                                                                        \
        float out[NS][16];                                                                       \
        for (int j = 0; j < NS; j++) {                                                           \
            _mm256_storeu_ps(out[j], acc[j][0]);                                                 \
            _mm256_storeu_ps(out[j] + 8, acc[j][1]);                                             \
        }                                                                                        \
        for (int j = 0; j < ns; j++)                                                             \
            for (int i = 0; i < 8 * MV && m0 + i < M; i++) y[(m0 + i) * N + n0 + j] = out[j][i]; \
    } while (0)

static void strip_times_xt(const float *buf, const float *xt, float *y, int64_t M, int64_t Mp, int64_t N,
                           int64_t K, int64_t n0, int ns) {
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        if (M - m0 > 8)
            STRIP_BLOCK(2);
        else
            STRIP_BLOCK(1);
    }
}

/* Row n of the weight decoded into out[K]; spb = 0 for 4 bits, else 8 bits with spb scales
 * (and minima, where given) per block. */
static inline void decode_row(const void *q, const float *scale, const float *minimum, int spb, int64_t n,
                              int64_t K, float *out) {
    int64_t nb = K / 32;
    __m256 w[4];
    if (!spb) {
        for (int64_t b = 0; b < nb; b++) {
            decode_q4((const uint8_t *)q + (n * nb + b) * 16, scale[n * nb + b], minimum[n * nb + b], w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + b * 32 + 8 * i, w[i]);
        }
    } else if (spb == 1 && !minimum) {
        for (int64_t b = 0; b < nb; b++) {
            float s = scale[n * nb + b];
            decode_q8((const int8_t *)q + n * K + b * 32, s, s, NULL, 1, w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + b * 32 + 8 * i, w[i]);
        }
    } else {
        for (int64_t b = 0; b < nb; b++) {
            const float *s = scale + (n * nb + b) * spb;
            decode_q8((const int8_t *)q + n * K + b * 32, s[0], s[spb - 1],
                      minimum ? minimum + (n * nb + b) * spb : NULL, spb, w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + b * 32 + 8 * i, w[i]);
        }
    }
}

static void row_tiles(const float *x, const void *q, const float *scale, const float *minimum, int spb,
                      float *y, int64_t M, int64_t N, int64_t K);

/* Every thread's strip buffer is taken before the parallel region, so that all threads meet
 * the work-sharing loops or none does; without the memory the row tiles run instead. */
static void strip_gemm(const float *x, const void *q, const float *scale, const float *minimum, int spb,
                       float *y, int64_t M, int64_t N, int64_t K) {
    int64_t Mp = (M + 15) / 16 * 16;
    int threads = omp_get_max_threads();
    float *bufs = aligned_alloc(64, sizeof(float) * (size_t)(NS * K) * (size_t)threads);
    if (!bufs) {
        row_tiles(x, q, scale, minimum, spb, y, M, N, K);
        return;
    }
    float *xt = M >= XT_MIN_ROWS ? aligned_alloc(64, sizeof(float) * (size_t)(Mp * K)) : NULL;
#pragma omp parallel num_threads(threads)
    {
        if (xt) {
#pragma omp for schedule(static)
            for (int64_t k = 0; k < K; k++)
                for (int64_t m = 0; m < Mp; m++) xt[k * Mp + m] = m < M ? x[m * K + k] : 0.0f;
        }
        float *buf = bufs + (size_t)omp_get_thread_num() * (size_t)(NS * K);
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += NS) {
            int ns = N - n0 < NS ? (int)(N - n0) : NS;
            for (int j = 0; j < NS; j++) /* a short last strip repeats row n0 */
                decode_row(q, scale, minimum, spb, n0 + (j < ns ? j : 0), K, buf + j * K);
            if (xt)
                strip_times_xt(buf, xt, y, M, Mp, N, K, n0, ns);
            else
                strip_dots(buf, x, y, M, N, K, n0, ns);
        }
    }
    free(xt);
    free(bufs);
}

/* y[M][N] = x[M][K] times the 4-bit weight, K % 32 == 0, for M > MR. */
void dolmus_q4_gemm_strips_f32(const float *x, const uint8_t *q, const float *scale,
                               const float *minimum, float *y, int64_t M, int64_t N, int64_t K) {
    strip_gemm(x, q, scale, minimum, 0, y, M, N, K);
}

/* The same for 8 bits, spb (1 or 2) scales, and minima where minimum is not NULL, per block. */
void dolmus_q8_gemm_strips_f32(const float *x, const int8_t *q, const float *scale, const float *minimum,
                               float *y, int64_t M, int64_t N, int64_t K, int64_t spb) {
    strip_gemm(x, q, scale, minimum, (int)spb, y, M, N, K);
}

/* y[M][N] = x[M][K] times the 4-bit weight [N][K]; K % 32 == 0. */
void dolmus_q4_gemm_f32(const float *x, const uint8_t *q, const float *scale, const float *minimum,
                        float *y, int64_t M, int64_t N, int64_t K) {
    int64_t nb = K / 32;
    if (M == 1) {
        float *xsum = malloc(sizeof(float) * (size_t)(nb + K));
        if (xsum) {
            float *xs = xsum + nb;
            q4_row_inputs(x, nb, xsum, xs);
#pragma omp parallel for schedule(static)
            for (int64_t n = 0; n < N; n++)
                y[n] = q4_row(xs, q + n * nb * 16, scale + n * nb, nb) + dot_f32(minimum + n * nb, xsum, nb);
            free(xsum);
            return;
        }
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = q + n * nb * 16;
        const float *sn = scale + n * nb, *mn = minimum + n * nb;
        int spb = 1;
        FOR_ROW_TILES(q4_tile)
    }
}

/* y[M][N] = x[M][K] times the 8-bit weight [N][K] with spb scales (and minima, where minimum is
 * not NULL) per block; K % 32 == 0. */
void dolmus_q8_gemm_f32(const float *x, const int8_t *q, const float *scale, const float *minimum, float *y,
                        int64_t M, int64_t N, int64_t K, int64_t spb_) {
    int64_t nb = K / 32;
    int spb = (int)spb_;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *qn = q + n * K;
        const float *sn = scale + n * nb * spb, *mn = minimum ? minimum + n * nb * spb : NULL;
        if (spb == 1 && !mn && M == 1) {
            y[n] = q8_row(x, qn, sn, nb) * Q8_ROW_SCALE;
        } else if (spb == 1 && !mn) {
            FOR_ROW_TILES(q8_tile)
        } else {
            FOR_ROW_TILES(q8g_tile)
        }
    }
}

/* The row tiles for any M (the strips' fallback without memory for their buffers). */
static void row_tiles(const float *x, const void *q, const float *scale, const float *minimum, int spb,
                      float *y, int64_t M, int64_t N, int64_t K) {
    int64_t nb = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *sn = scale + n * nb * (spb ? spb : 1);
        const float *mn = minimum ? minimum + n * nb * (spb ? spb : 1) : NULL;
        if (!spb) {
            const uint8_t *qn = (const uint8_t *)q + n * nb * 16;
            FOR_ROW_TILES(q4_tile)
        } else {
            const int8_t *qn = (const int8_t *)q + n * K;
            FOR_ROW_TILES(q8g_tile)
        }
    }
}

/* Rows[i] of the weight as float32, for i in [0, count): out [count][K]. rows: int64 row
 * numbers (a chunk of the weight for prefill GEMMs, or token ids for an embedding). */
static void dequant_rows(const void *q, const float *scale, const float *minimum, int spb, const int64_t *rows,
                         float *out, int64_t count, int64_t K) {
#pragma omp parallel for schedule(static) if (count > 8)
    for (int64_t i = 0; i < count; i++) decode_row(q, scale, minimum, spb, rows[i], K, out + i * K);
}

void dolmus_q4_dequant_f32(const uint8_t *q, const float *scale, const float *minimum,
                           const int64_t *rows, float *out, int64_t count, int64_t K) {
    dequant_rows(q, scale, minimum, 0, rows, out, count, K);
}

void dolmus_q8_dequant_f32(const int8_t *q, const float *scale, const float *minimum, const int64_t *rows,
                           float *out, int64_t count, int64_t K, int64_t spb) {
    dequant_rows(q, scale, minimum, (int)spb, rows, out, count, K);
}
