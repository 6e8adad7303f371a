/* Weight-only int4 and grouped int8 matrix kernels for x86 CPUs with AVX-512 BF16 (per-row int8:
 * int8_kernels.c).
 *
 * Decode multiplies a few activation rows by every weight of the model, so its speed is
 * how fast weights stream from memory. PyTorch's int8 CPU kernel keeps weights row by row
 * and ends every output with a horizontal sum; on short rows (896 inputs) that halves the
 * bandwidth it reaches. Here weights are packed in blocks of 64 output rows, column by
 * column, so each 64-byte line of codes feeds 64 outputs directly: no horizontal sums, one
 * sequential stream per thread.
 *
 *   grouped int8: P[b][k][j]  = q[64b + j][k]                      (int8, j < 64)
 *   int4: P[b][p][.]  = 64 bytes holding q[64b + o][2p + e] for o < 64, e < 2: output
 *         o = 32s + 16h + 4l + i in byte 16l + 8h + 2i + e, low nibble for s = 0, high for 1
 *         (the order AVX-512's in-lane byte interleave produces; see nibbles_to_bf16_pairs in bf16_simd.h)
 *
 * y[m][n] = sum_k x[m][k] w[n][k], activations and outputs in bf16:
 *   grouped int8: w = q * scale[g][n] + zero[g][n] for k in group g
 *   int4: w = (q - 8) * scale[g][n] + zero[g][n] for k in group g (PyTorch's convention).
 * int4 multiplies with AVX-512 BF16 dot products, two inputs per lane and instruction: its codes
 * become bf16 pairs without a conversion (0x4300 | q is the bf16 number 128 + q), and per group
 *   sum x (q - 8) = sum x (128 + q) - 136 sum x.
 * Grouped int8 multiplies with VNNI's integer dot products, four inputs per lane and
 * instruction (below: "Grouped int8").
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

typedef int v16si __attribute__((vector_size(64))); /* as int8_kernels.c's */

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
    if (b + 1 < blocks)
        for (int64_t g = 0; g < groups; g++) {
            const char *sa = (const char *)(scale + g * npad + (b + 1) * 64);
            _mm_prefetch(sa, _MM_HINT_T1), _mm_prefetch(sa + 64, _MM_HINT_T1);
            if (zero) {
                const char *za = (const char *)(zero + g * npad + (b + 1) * 64);
                _mm_prefetch(za, _MM_HINT_T1), _mm_prefetch(za + 64, _MM_HINT_T1);
            }
        }
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
 * ahead (seq_steps' request); grouped int8 (GGUF Q8_0) 1.2-5% and ~5%. At 2 and 4 rows the
 * requests are worth 0.1-0.6%, and stay. `ask` is a constant at each call, so each form's loop is
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

/* ---- Grouped int8 (GGUF's 8-bit blocks) on VNNI's integer dot product (vpdpbusd) ----
 * The codes stay as packed above (each input's 64 codes of a block in a line; quant_amx.c reads
 * the same layout). Four lines, inputs k .. k + 3, become with two rounds of byte and word
 * interleaves four vectors whose 32-bit lanes each hold one output's four codes, vpdpbusd's
 * operand; flipping the codes' top bit makes them the unsigned bytes q + 128 it takes. The
 * activations are int8_kernels.c's (split_row): x = s x16, x16 = 256 h + l in signed bytes, s a
 * power of two. Per group g of inputs, exactly in int32 (|256 sum (q + 128) h| < 2^28 for groups
 * of at most 32):
 *     sum_g q x16 = 256 sum_g (q + 128) h + sum_g (q + 128) l - corr[g],  corr[g] = 128 sum_g x16
 * and y = s (sum_g scale[g] float(sum_g q x16) + sum_g zero[g] (sum_g x) / s). The interleaves
 * leave output 16c + 4v + e in lane 4c + e of vector v; each group's sums are put back in order
 * (a 4 x 4 transpose of 128-bit quarters) before their scales.
 * A row's activations round as int8_kernels.c's do (exact within 2^7 of the row's largest, else
 * by at most 2^-14 of it), and its result does not depend on the rows beside it.
 * The kernel this replaces widened each code to bf16 for vdpbf16ps, ~14 vector instructions a
 * 64-byte line against ~6 here. On a Zen 4 (2 cores), the two in one process: the four products
 * of a 0.5B body's layer with the codes in cache at 1 / 2 / 4 / 8 / 128 rows 96 / 155 / 233 /
 * 238 / 244 -> 203 / 290 / 312 / 313 / 332 GFLOP/s; the body's Q8_0 decode steps, taking turns
 * step by step, 1.2% shorter at one sequence (the codes' stream from memory bounds it), 14% at
 * 2, 2.6% at 4 and 10% at 8; a 128-token prompt 378 -> 282 ms. */

/* Rows of activations as the kernel reads them (int8g_prep), in one buffer of
 * int8g_prep_bytes: M int8_rows in 64-byte slots, each row's h and l, corr [M][groups] and,
 * where there are zeros, xsum [M][groups] (sum_g x / s). */
typedef struct {
    const int8_row *rows;
    const int32_t *corr;
    const float *xsum;
} int8g_rows;

static size_t int8g_prep_bytes(int64_t M, int64_t K, int64_t group) {
    return (size_t)M * (64 + 2 * (size_t)((K + 15) / 16 * 16) + 8 * (size_t)(K / group));
}

static int8g_rows int8g_layout(const void *ws, int64_t M, int64_t K, int64_t group, int zeros) {
    int64_t kq = (K + 15) / 16 * 16;
    const int32_t *corr = (const int32_t *)((const char *)ws + M * 64 + 2 * M * kq);
    return (int8g_rows){(const int8_row *)ws, corr, zeros ? (const float *)(corr + M * (K / group)) : NULL};
}

void int8g_prep(const uint16_t *x, int64_t M, int64_t K, int64_t group, int zeros, void *ws) {
    int64_t kq = (K + 15) / 16 * 16, groups = K / group;
    int8_row *rows = ws;
    int8_t *bytes = (int8_t *)ws + M * 64;
    int32_t *corr = (int32_t *)(bytes + 2 * M * kq);
    float *xsum = (float *)(corr + M * groups);
    for (int64_t m = 0; m < M; m++) {
        split_row(x + m * K, K, kq, bytes + 2 * m * kq, bytes + (2 * m + 1) * kq, rows + m);
        for (int64_t g = 0; g < groups; g++) {
            __m512i sum = _mm512_setzero_si512();
            for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
                __mmask16 in = first_lanes((g + 1) * group - k);
                __m512i hv = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(in, rows[m].h + k));
                __m512i lv = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(in, rows[m].l + k));
                sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_slli_epi32(hv, 8), lv));
            }
            corr[m * groups + g] = 128 * _mm512_reduce_add_epi32(sum);
        }
    }
    if (!zeros) return;
    group_sums_into(x, M, K, group, xsum);
    for (int64_t m = 0; m < M; m++) {
        float inv = 1.0f / rows[m].s; /* a power of two (NaN for a NaN row): exact */
        for (int64_t g = 0; g < groups; g++) xsum[m * groups + g] *= inv;
    }
}

/* Rows [m0, m0 + R) of a times block pb -> outputs [64 b, 64 b + 64) of their y rows. R is a
 * constant at each call, so the sums stay in registers (R = 2: 16 integer sums and 8 totals);
 * the loop over a group's quads is not unrolled (its loads see one line after another). `ask`:
 * prefetch.h's requests for the lines ahead (BLOCK_ASKING_FOR_ROWS). */
static inline __attribute__((always_inline)) void int8g_pass(const int8_t *pb, const int8g_rows *a, int64_t m0,
                                                                const int R, const uint16_t *scale,
                                                                const uint16_t *zero, uint16_t *y, int64_t N,
                                                                int64_t K, int64_t group, int64_t b, const int ask) {
    const int64_t npad = (N + 63) / 64 * 64, groups = K / group;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 total[2][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) total[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        v16si sh[2][4], sl[2][4];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4; v++) sh[r][v] = sl[r][v] = (v16si){0};
#pragma GCC unroll 1
        for (int64_t k = g * group; k < (g + 1) * group; k += 4) {
            const int8_t *c = pb + k * 64;
            if (ask) prefetch_stream(c, 4);
            __m512i l0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)c), flip);
            __m512i l1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(c + 64)), flip);
            __m512i l2 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(c + 128)), flip);
            __m512i l3 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(c + 192)), flip);
            __m512i t0 = _mm512_unpacklo_epi8(l0, l1), t1 = _mm512_unpackhi_epi8(l0, l1);
            __m512i t2 = _mm512_unpacklo_epi8(l2, l3), t3 = _mm512_unpackhi_epi8(l2, l3);
            v16si w[4] = {(v16si)_mm512_unpacklo_epi16(t0, t2), (v16si)_mm512_unpackhi_epi16(t0, t2),
                          (v16si)_mm512_unpacklo_epi16(t1, t3), (v16si)_mm512_unpackhi_epi16(t1, t3)};
            for (int r = 0; r < R; r++) {
                int32_t hq, lq;
                memcpy(&hq, a->rows[m0 + r].h + k, sizeof hq);
                memcpy(&lq, a->rows[m0 + r].l + k, sizeof lq);
                v16si bh = (v16si)_mm512_set1_epi32(hq), bl = (v16si)_mm512_set1_epi32(lq);
                for (int v = 0; v < 4; v++) {
                    sh[r][v] = __builtin_ia32_vpdpbusd_v16si(sh[r][v], w[v], bh);
                    sl[r][v] = __builtin_ia32_vpdpbusd_v16si(sl[r][v], w[v], bl);
                }
            }
        }
        __m512 sv[4], zv[4];
        for (int j = 0; j < 4; j++) {
            sv[j] = bf16x16_to_ps(scale + g * npad + b * 64 + 16 * j);
            if (zero) zv[j] = bf16x16_to_ps(zero + g * npad + b * 64 + 16 * j);
        }
        for (int r = 0; r < R; r++) {
            __m512i cg = _mm512_set1_epi32(a->corr[(m0 + r) * groups + g]), q[4];
            for (int v = 0; v < 4; v++)
                q[v] = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32((__m512i)sh[r][v], 8), (__m512i)sl[r][v]), cg);
            __m512i q01 = _mm512_shuffle_i32x4(q[0], q[1], 0x44), q01h = _mm512_shuffle_i32x4(q[0], q[1], 0xEE);
            __m512i q23 = _mm512_shuffle_i32x4(q[2], q[3], 0x44), q23h = _mm512_shuffle_i32x4(q[2], q[3], 0xEE);
            __m512i o[4] = {_mm512_shuffle_i32x4(q01, q23, 0x88), _mm512_shuffle_i32x4(q01, q23, 0xDD),
                            _mm512_shuffle_i32x4(q01h, q23h, 0x88), _mm512_shuffle_i32x4(q01h, q23h, 0xDD)};
            for (int j = 0; j < 4; j++) {
                total[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(o[j]), sv[j], total[r][j]);
                if (zero)
                    total[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(a->xsum[(m0 + r) * groups + g]), zv[j], total[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 s = _mm512_set1_ps(a->rows[m0 + r].s);
        for (int j = 0; j < 4; j++)
            store_bf16(y + (m0 + r) * N + b * 64 + 16 * j, _mm512_mul_ps(total[r][j], s), N - b * 64 - 16 * j);
    }
}

/* Block b of a grouped int8 weight: every row of a times it -> outputs [64 b, 64 b + 64) of y,
 * two rows a pass: the first pass reads the codes from memory and asks for the lines ahead
 * (prefetch.h's prefetch_stream: at one row, step by step in one process on a Zen 4, ~3% shorter
 * decode steps than asking for nothing or each line 1-2 KB ahead), the next passes find them in
 * L2. Each pass interleaves the codes again; doing that once a group into an L1 buffer that every
 * pair of rows then read was 6% faster at 128 rows and 5-20% slower at 4-16 (codes in cache). */
static void int8g_block(const int8g_rows *a, const int8_t *packed, const uint16_t *scale, const uint16_t *zero,
                        uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group, int64_t b) {
    const int8_t *pb = packed + b * K * 64;
    for (int64_t m0 = 0; m0 < M; m0 += 2) {
        if (M - m0 == 1)
            int8g_pass(pb, a, m0, 1, scale, zero, y, N, K, group, b, m0 == 0);
        else if (m0 == 0)
            int8g_pass(pb, a, m0, 2, scale, zero, y, N, K, group, b, 1);
        else
            int8g_pass(pb, a, m0, 2, scale, zero, y, N, K, group, b, 0);
    }
}

/* y[M][N] = x[M][K] times int8 weights with a scale and zero per group of inputs (GGUF's 8-bit
 * blocks: Q8_0, and the 5-, 6-, 3- and 2-bit types widened to bytes): w = q * scale[g][n] +
 * zero[g][n] for k in group g; packed as the header's grouped int8; scale, zero: [K / group][Npad]
 * bf16, zero NULL for none; group a multiple of 4 and at most 32. */
void dolmus_int8g_gemm(const uint16_t *x, const int8_t *packed, const uint16_t *scale, const uint16_t *zero,
                       uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group) {
    if (dolmus_amx_quant_usable(M, K, group, 8)) { /* several rows: on AMX tiles (quant_amx.c) */
        dolmus_quant_gemm_amx(x, packed, scale, zero, y, M, N, K, group, 8);
        return;
    }
    void *ws = aligned_alloc(64, (int8g_prep_bytes(M, K, group) + 63) / 64 * 64);
    if (!ws) abort();
    int8g_prep(x, M, K, group, zero != NULL, ws);
    int8g_rows a = int8g_layout(ws, M, K, group, zero != NULL);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < (N + 63) / 64; b++) int8g_block(&a, packed, scale, zero, y, M, N, K, group, b);
    free(ws);
}

/* The one-region step's form (kernels.h); ws: int8g_prep's rows (its prep). */
void team_int8g_run(const void *ws, const int8_t *packed, const uint16_t *scale,
                    const uint16_t *zero, uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group,
                    panel_split *split, int t, int T) {
    int8g_rows a = int8g_layout(ws, M, K, group, zero != NULL);
    for (int64_t b; (b = split_take(split, t, T)) >= 0;)
        int8g_block(&a, packed, scale, zero, y, M, N, K, group, b);
}

/* Outputs [n0, n1) of a grouped int8 weight as bf16, transposed: out[K][n1 - n0] (prefill
 * chunks multiply it with PyTorch's bf16 GEMM). n0 and n1 - n0 multiples of 64 (whole blocks),
 * so each input's 64 codes of a block, its scales and zeros are contiguous. */
void dolmus_int8g_dequant_t(const int8_t *packed, const uint16_t *scale, const uint16_t *zero, uint16_t *out,
                            int64_t n0, int64_t n1, int64_t K, int64_t N, int64_t group) {
    int64_t npad = (N + 63) / 64 * 64, width = n1 - n0;
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < K; k++) {
        int64_t g = k / group;
        for (int64_t n = n0; n < n1; n += 64) {
            const int8_t *c = packed + (n / 64) * K * 64 + k * 64;
            for (int j = 0; j < 4; j++) {
                __m512 v = _mm512_mul_ps(int8x16_to_ps(c + 16 * j), bf16x16_to_ps(scale + g * npad + n + 16 * j));
                if (zero) v = _mm512_add_ps(v, bf16x16_to_ps(zero + g * npad + n + 16 * j));
                _mm256_storeu_si256((__m256i *)(out + k * width + (n - n0) + 16 * j), (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
    }
}
