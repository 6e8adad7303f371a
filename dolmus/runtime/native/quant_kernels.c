/* Weight-only int4 matrix kernels for x86 CPUs with AVX-512 BF16 (per-row int8: int8_kernels.c;
 * grouped int8: int8g_kernels.c).
 *
 * Decode multiplies a few activation rows by every weight of the model, so its speed is
 * how fast weights stream from memory. PyTorch's int8 CPU kernel keeps weights row by row
 * and ends every output with a horizontal sum; on short rows (896 inputs) that halves the
 * bandwidth it reaches. Here weights are packed in blocks of 64 output rows, column by
 * column, so each 64-byte line of codes feeds 64 outputs directly: no horizontal sums, one
 * sequential stream per thread.
 *
 *   int4: P[b][p][.]  = 64 bytes holding q[64b + o][2p + e] for o < 64, e < 2: output
 *         o = 32s + 16h + 4l + i in byte 16l + 8h + 2i + e, low nibble for s = 0, high for 1
 *         (the order AVX-512's in-lane byte interleave produces; see nibbles_to_bf16_pairs in bf16_simd.h)
 *
 * y[m][n] = sum_k x[m][k] w[n][k], activations and outputs in bf16, sums in float32:
 *   w = (q - 8) * scale[g][n] + zero[g][n] for k in group g (PyTorch's convention).
 * The products are AVX-512 BF16 dot products, two inputs per lane and instruction: the codes
 * become bf16 pairs without a conversion (0x4300 | q is the bf16 number 128 + q), and per group
 *   sum x (q - 8) = sum x (128 + q) - 136 sum x.
 *
 * Blocks past N are zero padded; outputs past N are not written. Threads: OpenMP (see
 * runtime/native/__init__.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "bf16_simd.h"
#include "kernels.h"
#include "prefetch.h"

#define MR 4 /* activation rows per pass over a block: codes are unpacked once per pass */


static inline __m512 bf16x16_to_ps(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* sum x over each group of inputs of each row -> out [M][K / group].
 * 16 inputs at a time: summed one by one, this took ~7 us of a one-row product over 4,864 inputs
 * (~0.3 ms of a 0.5B body's int4 decode step, whose products take ~4 ms). */
void group_sums_into(const uint16_t *x, int64_t M, int64_t K, int64_t group, float *out) {
    int64_t groups = K / group;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *p = x + m * K + g * group;
            __m512 s = _mm512_setzero_ps();
            for (int64_t k = 0; k < group; k += 16) {
                __m256i h = _mm256_maskz_loadu_epi16(first_lanes(group - k), p + k);
                s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
            }
            out[m * groups + g] = _mm512_reduce_add_ps(s);
        }
}

/* The same sums in a new array (the caller frees), or NULL. */
float *dolmus_group_sums(const uint16_t *x, int64_t M, int64_t K, int64_t group) {
    float *xsum = malloc(sizeof(float) * (size_t)(M * (K / group)));
    if (xsum) group_sums_into(x, M, K, group, xsum);
    return xsum;
}

/* Block b of an int4 weight: rows [0, M) of x times it -> outputs [64 b, 64 b + 64) of y. `ask`:
 * request each line's far and near lines ahead (prefetch.h), or read the codes as they lie alone,
 * as one row does without AMX (BLOCK_ASKING_FOR_ROWS). */
static inline __attribute__((always_inline)) void int4_block_asking(const uint16_t *x, const float *xsum,
                                                                       const uint8_t *packed, const uint16_t *scale,
                                                                       const uint16_t *zero, uint16_t *y, int64_t M,
                                                                       int64_t N, int64_t K, int64_t group, int64_t b,
                                                                       const int ask) {
    int64_t blocks = (N + 63) / 64, npad = blocks * 64, groups = K / group;
    const uint8_t *pb = packed + b * (K / 2) * 64;
    /* The next block's scales and zeros, a line pair in each group's row (rows npad values
     * apart), asked for ahead: 2-8% at one row. Skipping their reads altogether made the
     * product ~28% faster, but that is their bytes: a block-major layout (one stream)
     * measured the same as this one. */
    if (b + 1 < blocks) prefetch_block_scales(scale, zero, groups, npad, (b + 1) * 64);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        int64_t rows = M - m0 < MR ? M - m0 : MR;
        __m512 total[MR][4];
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < 4; j++) total[i][j] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m512 acc[MR][4];
            for (int i = 0; i < MR; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
            for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
                __m512bh w[4];
                if (ask) prefetch_stream(pb + (k / 2) * 64, 1);
                nibbles_to_bf16_pairs(pb + (k / 2) * 64, w);
                for (int i = 0; i < MR && i < rows; i++) {
                    int32_t pair;
                    memcpy(&pair, x + (m0 + i) * K + k, sizeof pair);
                    __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                    for (int j = 0; j < 4; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
                }
            }
            const uint16_t *sg = scale + g * npad + b * 64;
            for (int j = 0; j < 4; j++) {
                __m512 s = bf16x16_to_ps(sg + 16 * j);
                __m512 z = zero ? bf16x16_to_ps(zero + g * npad + b * 64 + 16 * j) : _mm512_setzero_ps();
                for (int i = 0; i < MR && i < rows; i++) {
                    __m512 xs = _mm512_set1_ps(xsum[(m0 + i) * groups + g]);
                    __m512 dot = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), xs, acc[i][j]);
                    total[i][j] = _mm512_fmadd_ps(dot, s, _mm512_fmadd_ps(xs, z, total[i][j]));
                }
            }
        }
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < 4; j++)
                store_bf16(y + (m0 + i) * N + b * 64 + 16 * j, total[i][j], N - b * 64 - 16 * j);
    }
}

/* A block's product with the requests its rows take: without AMX one row reads its codes without
 * them (prefetch.h's ONE_ROW_STREAM), more rows ask. One row's unpacking and products take long
 * enough a line that the cores' prefetchers keep up, and the requests only cost. With and without
 * them taking turns step by step in one process (a 0.5B body's decode, 2,000-2,500 steps a run,
 * Zen 4): int4 steps 2.3-3% shorter without, and 2-7% shorter than with each line asked for 2 KB
 * ahead (seq_steps' request); the grouped int8 kernel's bf16 form went the same way (its integer
 * form reads faster asking: int8g_kernels.c). At 2 and 4 rows the requests are worth 0.1-0.6%,
 * and stay. `ask` is a constant at each call, so each form's loop is
 * its own. */
#define BLOCK_ASKING_FOR_ROWS(block, M, ...)    \
    do {                                        \
        if ((M) == 1)                           \
            block(__VA_ARGS__, ONE_ROW_STREAM); \
        else                                    \
            block(__VA_ARGS__, 1);              \
    } while (0)

static void int4_block(const uint16_t *x, const float *xsum, const uint8_t *packed, const uint16_t *scale,
                       const uint16_t *zero, uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group, int64_t b) {
    BLOCK_ASKING_FOR_ROWS(int4_block_asking, M, x, xsum, packed, scale, zero, y, M, N, K, group, b);
}

/* y[M][N] = x[M][K] times int4 weights; scale, zero: [K / group][Npad] bf16; K, group even.
 * zero may be NULL (all zero: symmetric weights, llama.cpp's Q4_0), saving its bytes. */
void dolmus_int4_gemm(const uint16_t *x, const uint8_t *packed, const uint16_t *scale,
                      const uint16_t *zero, uint16_t *y, int64_t M, int64_t N, int64_t K,
                      int64_t group) {
    if (dolmus_amx_quant_usable(M, K, group, 4)) { /* several rows: on AMX tiles (quant_amx.c) */
        dolmus_quant_gemm_amx(x, packed, scale, zero, y, M, N, K, group, 4);
        return;
    }
    float *xsum = dolmus_group_sums(x, M, K, group);
    if (!xsum) return;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < (N + 63) / 64; b++) int4_block(x, xsum, packed, scale, zero, y, M, N, K, group, b);
    free(xsum);
}

/* The one-region step's form (kernels.h); xsum: the group sums (its prep). */
void team_int4_run(const uint16_t *x, const float *xsum, const uint8_t *packed, const uint16_t *scale,
                   const uint16_t *zero, uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group,
                   panel_split *split, int t, int T) {
    for (int64_t b; (b = split_take(split, t, T)) >= 0;)
        int4_block(x, xsum, packed, scale, zero, y, M, N, K, group, b);
}
