/* Matrix products on llama.cpp-style block-quantized weights (Q4_0, Q4_1, Q8_0) with float32
 * activations, for x86 CPUs with AVX2, FMA and F16C (every x86 server CPU of the last decade).
 *
 * A weight row of K inputs is K / 32 blocks; block b of row n has a float32 scale
 * s = scale[n][b] and, for 4 bits, a float32 minimum m = minimum[n][b]:
 *   4 bits: 16 bytes per block, w = q * s + m, q in 0..15 (Q4_0: m = -8 s; Q4_1: the file's);
 *   8 bits: 32 int8 codes per block; w = q * s;
 * the codes of a block in the lane-major order decode_q4/decode_q8 describe.
 * A file's scales and minima are fp16, so q * s is exact in float32 and the one rounding of
 * the fused multiply-add below gives the bits the gguf package's dequantization gives.
 *
 * At a few rows (decode) the time is the weight reads: each block is decoded once into float
 * registers and multiplied with up to MR rows of x. Many rows (prefill) go to PyTorch's GEMM
 * on rows dequantized a chunk at a time (the *_dequant functions). Output rows are split over
 * PyTorch's OpenMP threads (see __init__.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>

#define MR 4 /* activation rows sharing one decode of a block */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

static inline void decode_q8(const int8_t *q, float s, __m256 w[4]) {
    __m256i lanes = _mm256_loadu_si256((const __m256i *)q);
    __m256 vs = _mm256_set1_ps(s);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(lanes, 24), 24)), vs);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(lanes, 16), 24)), vs);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(lanes, 8), 24)), vs);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(lanes, 24)), vs);
}

/* One output row n against rows [m0, m0 + R) of x, R a compile-time 1..MR once inlined.
 * Each x row keeps two accumulators (even and odd 8-wide parts of a block): the chains of
 * dependent multiply-adds stay short enough for the FMA units' latency. */
#define ROW_TILE(NAME, CODE_T, DECODE, CODE_STEP)                                             \
    static inline __attribute__((always_inline)) void NAME(                                     \
        const float *x, const CODE_T *qn, const float *sn, const float *mn, float *y, int64_t m0, \
        int R, int64_t N, int64_t K, int64_t n) {                                              \
        int64_t nb = K / 32;                                                                    \
        __m256 acc[MR][2];                                                                      \
        for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();               \
        for (int64_t b = 0; b < nb; b++) {                                                      \
            __m256 w[4];                                                                        \
            DECODE;                                                                             \
            for (int i = 0; i < R; i++) {                                                       \
                const float *xb = x + (m0 + i) * K + b * 32;                                    \
                acc[i][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[i][0]);              \
                acc[i][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[i][1]);          \
                acc[i][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[i][0]);         \
                acc[i][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[i][1]);         \
            }                                                                                   \
        }                                                                                       \
        for (int i = 0; i < R; i++) y[(m0 + i) * N + n] = hsum(_mm256_add_ps(acc[i][0], acc[i][1])); \
    }

ROW_TILE(q4_tile, uint8_t, decode_q4(qn + b * 16, sn[b], mn[b], w), 16)
ROW_TILE(q8_tile, int8_t, decode_q8(qn + b * 32, sn[b], w), 32)

#define FOR_ROW_TILES(TILE)                                                         \
    for (int64_t m0 = 0; m0 < M; m0 += MR) {                                        \
        switch (M - m0 < MR ? (int)(M - m0) : MR) {                                 \
        case 1: TILE(x, qn, sn, mn, y, m0, 1, N, K, n); break;                      \
        case 2: TILE(x, qn, sn, mn, y, m0, 2, N, K, n); break;                      \
        case 3: TILE(x, qn, sn, mn, y, m0, 3, N, K, n); break;                      \
        default: TILE(x, qn, sn, mn, y, m0, MR, N, K, n); break;                    \
        }                                                                           \
    }

/* Batches of more than MR rows: NS output rows are decoded once into a float buffer that
 * stays in cache (NS * K floats), then every row of x is multiplied with it; each weight is
 * decoded once per call instead of once per MR rows of x. Two accumulators per output row
 * keep the FMA chains short. */
#define NS 4
static inline void strip_times_rows(const float *buf, const float *x, float *y, int64_t M, int64_t N,
                                    int64_t K, int64_t n0, int ns) {
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

/* Row n of the weight decoded into out[K]: 4 bits where minimum is given, else 8 bits. */
static inline void decode_row(const void *q, const float *scale, const float *minimum, int64_t n,
                              int64_t K, float *out) {
    int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        if (minimum)
            decode_q4((const uint8_t *)q + (n * nb + b) * 16, scale[n * nb + b], minimum[n * nb + b], w);
        else
            decode_q8((const int8_t *)q + n * K + b * 32, scale[n * nb + b], w);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + b * 32 + 8 * i, w[i]);
    }
}

static void strip_gemm(const float *x, const void *q, const float *scale, const float *minimum, float *y,
                       int64_t M, int64_t N, int64_t K) {
#pragma omp parallel
    {
        float *buf = aligned_alloc(64, sizeof(float) * (size_t)(NS * K));
        if (buf) {
#pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < N; n0 += NS) {
                int ns = N - n0 < NS ? (int)(N - n0) : NS;
                for (int j = 0; j < NS; j++) /* a short last strip repeats row n0 */
                    decode_row(q, scale, minimum, n0 + (j < ns ? j : 0), K, buf + j * K);
                strip_times_rows(buf, x, y, M, N, K, n0, ns);
            }
            free(buf);
        }
    }
}

/* y[M][N] = x[M][K] times the 4-bit weight, K % 32 == 0, for M > MR. */
void dolmus_q4_gemm_strips_f32(const float *x, const uint8_t *q, const float *scale,
                               const float *minimum, float *y, int64_t M, int64_t N, int64_t K) {
    strip_gemm(x, q, scale, minimum, y, M, N, K);
}

void dolmus_q8_gemm_strips_f32(const float *x, const int8_t *q, const float *scale, float *y, int64_t M,
                               int64_t N, int64_t K) {
    strip_gemm(x, q, scale, NULL, y, M, N, K);
}

/* y[M][N] = x[M][K] times the 4-bit weight [N][K]; K % 32 == 0. */
void dolmus_q4_gemm_f32(const float *x, const uint8_t *q, const float *scale, const float *minimum,
                        float *y, int64_t M, int64_t N, int64_t K) {
    int64_t nb = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = q + n * nb * 16;
        const float *sn = scale + n * nb, *mn = minimum + n * nb;
        FOR_ROW_TILES(q4_tile)
    }
}

/* y[M][N] = x[M][K] times the 8-bit weight [N][K]; K % 32 == 0. */
void dolmus_q8_gemm_f32(const float *x, const int8_t *q, const float *scale, float *y, int64_t M,
                        int64_t N, int64_t K) {
    int64_t nb = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *qn = q + n * K;
        const float *sn = scale + n * nb, *mn = NULL;
        FOR_ROW_TILES(q8_tile)
    }
}

/* Rows[i] of the weight as float32, for i in [0, count): out [count][K]. rows: int64 row
 * numbers (a chunk of the weight for prefill GEMMs, or token ids for an embedding). */
static void dequant_rows(const void *q, const float *scale, const float *minimum, const int64_t *rows,
                         float *out, int64_t count, int64_t K) {
#pragma omp parallel for schedule(static) if (count > 8)
    for (int64_t i = 0; i < count; i++) decode_row(q, scale, minimum, rows[i], K, out + i * K);
}

void dolmus_q4_dequant_f32(const uint8_t *q, const float *scale, const float *minimum,
                           const int64_t *rows, float *out, int64_t count, int64_t K) {
    dequant_rows(q, scale, minimum, rows, out, count, K);
}

void dolmus_q8_dequant_f32(const int8_t *q, const float *scale, const int64_t *rows, float *out,
                           int64_t count, int64_t K) {
    dequant_rows(q, scale, NULL, rows, out, count, K);
}
