/* bf16 weights, float32 activations and sums, on AVX2 + FMA: the linear layers of a float32
 * model whose weights are exact in bf16 (a bf16 checkpoint run in float32 where the CPU has no
 * bf16 arithmetic), so a decode step reads 2 bytes per weight instead of 4.
 *
 * Layout (bf16_weights.py packs it): panels of 16 outputs, P[panel][k][16] = w[16 panel + o][k]
 * with o in the order 0, 8, 1, 9, ..., 7, 15, outputs past N zero. A panel's 16 weights of input
 * k are 32 contiguous bytes; read as eight 32-bit lanes, a shift left by 16 gives outputs 0-7 as
 * floats and an and of the high halves 8-15 (a bf16 is the high half of its float32), and they
 * meet x[r][k] broadcast in a fused multiply-add. K goes in chunks whose weights stay in L1 while
 * every block of rows passes over them, so the weights come from memory once per call, and the
 * next chunk is asked for while the first block works on this one (without that, every chunk
 * waited on memory: 8 rows at ~85 GFLOP/s on 2 cores, now ~150). A block of R rows costs max(R,
 * 4) cycles an input on Zen 3 (2 multiply-add pipes, 4 cycles of latency), so from 8 rows on the
 * blocks hold 4 to 6 rows (12 sums in registers). Each block widens the pairs it reads in
 * registers: a version that widened a chunk once into an L1 scratch of floats for all blocks
 * measured no faster at 512 rows and slower at 9 to 96. One row (a decode step) goes through
 * GROUP panels at once instead: 2 GROUP independent chains of sums, so the adds' latency does not
 * bound the weight stream; there threads take contiguous runs of panels, one stream each for the
 * hardware prefetcher. Many rows are bound by arithmetic, not by the stream, so there threads
 * take 4 panels at a time as they come free: a core slowed by something else (the API server's
 * process shares the cores) no longer holds the other at the end of every product (with a
 * process busy 10% of the time beside it, 512-row gate/up 157 -> 170 GFLOP/s and 2048-row o
 * 161 -> 179 against halves fixed in advance; the same on a quiet host). Past STRETCH rows the
 * panels are passed over once per stretch of rows, whose inputs then stay in L2 (2048 rows:
 * gate/up 138 -> 154 GFLOP/s, down 132 -> 178).
 *
 * Every sum is float32 in input order whatever the number of rows, so a row's result does not
 * depend on its batch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "kernels_f32.h"

#define ROWS 6            /* most rows per block: 12 sums in registers */
#define CHUNK 256         /* inputs per chunk: 8 KB of a panel's bf16 weights */
#define STRETCH 256       /* rows per pass over the panels: their chunks of inputs stay in L2 */
#define GROUP 4           /* panels one row goes through at once */

static inline __m256 widen_lo(__m256i w) { /* outputs 0-7: the lanes' low halves */
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

static inline __m256 widen_hi(__m256i w) { /* outputs 8-15: the lanes' high halves */
    return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* Inputs [k0, k1) of rows [0, R) of x (rows ldx apart) times panel pp, added to acc (R rows of
 * 16 floats). R is a constant at each call site, so the sums stay in registers. With `next`
 * (the weights after these), asks for as many bytes of them on the way. */
static inline __attribute__((always_inline)) void fma_inputs(const uint16_t *pp, int64_t k0, int64_t k1,
                                                                const float *x, int64_t ldx, const int R,
                                                                float *acc, const char *next) {
    __m256 s[ROWS][2];
    for (int r = 0; r < R; r++) {
        s[r][0] = _mm256_loadu_ps(acc + 16 * r);
        s[r][1] = _mm256_loadu_ps(acc + 16 * r + 8);
    }
    for (int64_t k = k0; k < k1; k++) {
        if (next && (k & 1) == 0) _mm_prefetch(next + 32 * (k - k0), _MM_HINT_T0);
        __m256i w = _mm256_loadu_si256((const __m256i *)(pp + 16 * k));
        __m256 lo = widen_lo(w), hi = widen_hi(w);
        for (int r = 0; r < R; r++) {
            __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
            s[r][0] = _mm256_fmadd_ps(a, lo, s[r][0]);
            s[r][1] = _mm256_fmadd_ps(a, hi, s[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(acc + 16 * r, s[r][0]);
        _mm256_storeu_ps(acc + 16 * r + 8, s[r][1]);
    }
}

/* One row x times panels [0, G) from pp (K inputs each) -> sums[G][16]. */
static inline __attribute__((always_inline)) void row_panels(const uint16_t *pp, int64_t K, const float *x,
                                                                const int G, float *sums) {
    __m256 s[GROUP][2];
    for (int g = 0; g < G; g++) s[g][0] = s[g][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 a = _mm256_broadcast_ss(x + k);
        for (int g = 0; g < G; g++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(pp + (g * K + k) * 16));
            s[g][0] = _mm256_fmadd_ps(a, widen_lo(w), s[g][0]);
            s[g][1] = _mm256_fmadd_ps(a, widen_hi(w), s[g][1]);
        }
    }
    for (int g = 0; g < G; g++) {
        _mm256_storeu_ps(sums + 16 * g, s[g][0]);
        _mm256_storeu_ps(sums + 16 * g + 8, s[g][1]);
    }
}

/* Outputs [n0, n0 + 16 count) of rows [0, rows) from their sums (16 per panel, rows 16 count
 * apart), plus bias, those below N written. */
static void store_rows(const float *acc, int64_t rows, int64_t count, const float *bias, float *y, int64_t N,
                       int64_t n0) {
    int64_t valid = N - n0 < 16 * count ? N - n0 : 16 * count;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < valid; o++) y[r * N + n0 + o] = acc[r * 16 * count + o] + (bias ? bias[n0 + o] : 0.0f);
}

/* Rows [0, M) of one panel (outputs n0 .. n0 + 15, those below N written) -> y. */
static void panel_product(const uint16_t *pp, int64_t K, const float *x, int64_t M, const float *bias, float *y,
                          int64_t N, int64_t n0, float *acc) {
    memset(acc, 0, sizeof(float) * 16 * (size_t)M);
    /* Blocks of at most ROWS, as even as can be: from 8 rows on, each of 4 to 6 rows. */
    int64_t blocks = (M + ROWS - 1) / ROWS;
    for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
        int64_t k1 = k0 + CHUNK < K ? k0 + CHUNK : K, r0 = 0;
        const char *next = (const char *)(pp + 16 * k1); /* the next chunk, in this panel or the next */
        for (int64_t b = 0; b < blocks; b++) {
            int64_t R = (M - r0) / (blocks - b);
            const float *xr = x + r0 * K;
            float *ar = acc + 16 * r0;
            switch (R) {
            case 1: fma_inputs(pp, k0, k1, xr, K, 1, ar, next); break;
            case 2: fma_inputs(pp, k0, k1, xr, K, 2, ar, next); break;
            case 3: fma_inputs(pp, k0, k1, xr, K, 3, ar, next); break;
            case 4: fma_inputs(pp, k0, k1, xr, K, 4, ar, next); break;
            case 5: fma_inputs(pp, k0, k1, xr, K, 5, ar, next); break;
            default: fma_inputs(pp, k0, k1, xr, K, ROWS, ar, next); break;
            }
            next = NULL; /* asked for once */
            r0 += R;
        }
    }
    store_rows(acc, M, 1, bias, y, N, n0);
}

/* y [M][N] = x [M][K] (float32, rows contiguous) times the packed bf16 weight, plus bias
 * (float32, or NULL). */
void dolmus_bf16w_gemm_f32(const float *x, const uint16_t *packed, const float *bias, float *y, int64_t M, int64_t N,
                           int64_t K) {
    int64_t panels = (N + 15) / 16;
    if (M == 1) {
        int64_t groups = (panels + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            float sums[16 * GROUP];
            int64_t p = g * GROUP, count = panels - p < GROUP ? panels - p : GROUP;
            const uint16_t *pp = packed + p * K * 16;
            switch (count) {
            case 1: row_panels(pp, K, x, 1, sums); break;
            case 2: row_panels(pp, K, x, 2, sums); break;
            case 3: row_panels(pp, K, x, 3, sums); break;
            default: row_panels(pp, K, x, GROUP, sums); break;
            }
            store_rows(sums, 1, count, bias, y, N, p * 16);
        }
        return;
    }
    int64_t stretch = M < STRETCH ? M : STRETCH;
#pragma omp parallel
    {
        float *acc = malloc(sizeof(float) * 16 * (size_t)stretch);
        if (!acc) abort();
        for (int64_t m0 = 0; m0 < M; m0 += stretch) {
            int64_t rows = M - m0 < stretch ? M - m0 : stretch;
#pragma omp for schedule(dynamic, 4)
            for (int64_t p = 0; p < panels; p++)
                panel_product(packed + p * K * 16, K, x + m0 * K, rows, bias, y + m0 * N, N, p * 16, acc);
        }
        free(acc);
    }
}
