/* Grouped int8 weights (GGUF's 8-bit blocks: Q8_0, and Q5_0/Q5_1/Q2_K/Q3_K/Q5_K/Q6_K widened to
 * bytes) times bf16 activations on AVX-512 VNNI's integer dot products, for x86 CPUs with AVX-512
 * BF16 (every one has VNNI). On AMX, several rows go to quant_amx.c's tiles instead.
 *
 * Weights (dolmus/quant/native.py, pack_int8_groups), blocks of 64 output rows, each input's 64
 * codes of a block in a line:  P[b][k][j] = q[64b + j][k]  (int8, j < 64; blocks past N zero),
 * and bf16 scale, zero [K / group][Npad]: w = q * scale[g][n] + zero[g][n] for k in group g
 * (zero NULL for none; group a multiple of 4, at most 32). quant_amx.c reads the same layout.
 *
 * Activations are int8_kernels.c's integers: x = s x16 with s a power of two per row and |x16| <
 * 2^14 (exact within 2^7 of the row's largest, else rounded by at most 2^-14 of it). Per group g
 * the sum of q x16 is exact in int32 (under 2^26), and
 *     y = s (sum_g scale[g] float(sum_g q x16) + sum_g zero[g] (sum_g x) / s),
 * the groups in order. Two forms compute those integer sums, with the same results to the bit,
 * so a row's outputs do not depend on the rows beside it:
 *  - bytes (up to BYTE_ROWS rows: decode): x16 = 256 h + l in signed bytes (split_row), and four
 *    lines, inputs k .. k + 3, become with byte and word interleaves four vectors whose 32-bit
 *    lanes each hold one output's four codes, vpdpbusd's operand (the codes' top bit flipped:
 *    the unsigned q + 128 it takes, corrected by corr[g] = 128 sum_g x16):
 *        sum_g q x16 = 256 sum_g (q + 128) h + sum_g (q + 128) l - corr[g];
 *  - words (more rows: prompt chunks, large batches): x16 as 16-bit integers, two lines widened
 *    and interleaved into vpdpwssd's two-codes-per-lane operand; half the sums of the bytes form
 *    a row, so three rows share each interleave instead of two.
 * Either interleave leaves the outputs permuted across 128-bit quarters; each group's sums are
 * put back in order before their scales.
 *
 * On a Zen 4 (2 cores), the four products of a 0.5B body's layer with the codes in cache, at
 * 1 / 2 / 4 / 8 / 16 / 128 rows: bytes 191 / 291 / 311 / 325 / 321 / 317 GFLOP/s, words 142 /
 * 249 / 280 / 323 / 334 / 356. The kernel these replace widened each code to bf16 for vdpbf16ps
 * (~14 vector instructions a line against ~6): 96 / 155 / 233 / 238 / 237 / 244. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "bf16_simd.h"
#include "kernels.h"
#include "prefetch.h"

typedef int v16si __attribute__((vector_size(64))); /* as int8_kernels.c's */

/* Calls of up to this many rows take the bytes form (the one-region step's TEAM_ROWS too). */
#define BYTE_ROWS 4
_Static_assert(TEAM_ROWS <= BYTE_ROWS, "team_scratch_bytes holds the bytes form's activations");

/* Rows of activations as the kernel reads them (int8g_prep), in one buffer of int8g_prep_bytes.
 * Bytes: M int8_rows in 64-byte slots, each row's h and l, corr [M][groups]; words: s [M] (64-byte
 * lines of them), x16 [M][kq]; either then, where there are zeros, xsum [M][groups] (sum_g x / s). */
typedef struct {
    const int8_row *rows; /* bytes */
    const int32_t *corr;  /* bytes */
    const float *s;       /* words */
    const int16_t *x16;   /* words */
    int64_t kq;           /* K rounded up to 16 */
    const float *xsum;
} int8g_rows;

static size_t int8g_prep_bytes(int64_t M, int64_t K, int64_t group) {
    size_t kq = (size_t)((K + 15) / 16 * 16), groups = (size_t)(K / group), m = (size_t)M;
    return M <= BYTE_ROWS ? m * (64 + 2 * kq + 8 * groups) : (m + 15) / 16 * 64 + m * (2 * kq + 4 * groups);
}

static int8g_rows int8g_layout(const void *ws, int64_t M, int64_t K, int64_t group, int zeros) {
    int64_t kq = (K + 15) / 16 * 16, groups = K / group;
    const char *p = ws;
    int8g_rows a = {0};
    a.kq = kq;
    if (M <= BYTE_ROWS) {
        a.rows = (const int8_row *)p;
        a.corr = (const int32_t *)(p + M * 64 + 2 * M * kq);
        a.xsum = zeros ? (const float *)(a.corr + M * groups) : NULL;
    } else {
        a.s = (const float *)p;
        a.x16 = (const int16_t *)(p + (M + 15) / 16 * 64);
        a.xsum = zeros ? (const float *)(a.x16 + M * kq) : NULL;
    }
    return a;
}

void int8g_prep(const uint16_t *x, int64_t M, int64_t K, int64_t group, int zeros, void *ws) {
    int8g_rows a = int8g_layout(ws, M, K, group, zeros);
    int64_t kq = a.kq, groups = K / group;
    float inv[BYTE_ROWS + 1], *s = (float *)a.s;
    if (M <= BYTE_ROWS) {
        int8_row *rows = (int8_row *)a.rows;
        int8_t *bytes = (int8_t *)ws + M * 64;
        int32_t *corr = (int32_t *)a.corr;
        for (int64_t m = 0; m < M; m++) {
            split_row(x + m * K, K, kq, bytes + 2 * m * kq, bytes + (2 * m + 1) * kq, rows + m);
            inv[m] = 1.0f / rows[m].s; /* a power of two (NaN for a NaN row): exact */
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
    } else
        for (int64_t m = 0; m < M; m++) s[m] = x16_row(x + m * K, K, kq, (int16_t *)a.x16 + m * kq);
    if (!zeros) return;
    float *xsum = (float *)a.xsum;
    group_sums_into(x, M, K, group, xsum);
    for (int64_t m = 0; m < M; m++) {
        float f = M <= BYTE_ROWS ? inv[m] : 1.0f / s[m];
        for (int64_t g = 0; g < groups; g++) xsum[m * groups + g] *= f;
    }
}

/* Bytes: rows [m0, m0 + R) of a times block pb -> outputs [64 b, 64 b + 64) of their y rows. R
 * is a constant at each call, so the sums stay in registers (R = 2: 16 integer sums, 8 totals);
 * the loop over a group's quads is not unrolled (its loads see one line after another). `ask`:
 * prefetch.h's requests for the lines ahead (int8g_block). */
static inline __attribute__((always_inline)) void bytes_pass(const int8_t *pb, const int8g_rows *a, int64_t m0,
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
            sv[j] = load_bf16x16(scale + g * npad + b * 64 + 16 * j);
            if (zero) zv[j] = load_bf16x16(zero + g * npad + b * 64 + 16 * j);
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

/* Words: rows [m0, m0 + R) of a times block pb -> outputs [64 b, 64 b + 64) of their y rows. R
 * is a constant at each call, so the sums stay in registers (R = 3: 12 integer sums, 12 totals);
 * the loop over a group's pairs is not unrolled (its loads see one line after another). `ask`:
 * prefetch.h's requests for the lines ahead. */
static inline __attribute__((always_inline)) void words_pass(const int8_t *pb, const int8g_rows *a, int64_t m0,
                                                                const int R, const uint16_t *scale,
                                                                const uint16_t *zero, uint16_t *y, int64_t N,
                                                                int64_t K, int64_t group, int64_t b, const int ask) {
    const int64_t npad = (N + 63) / 64 * 64, groups = K / group;
    /* outputs 0-15 of the low and high interleaves' lanes, and 16-31 */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    __m512 total[3][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) total[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        v16si sum[3][4];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4; v++) sum[r][v] = (v16si){0};
#pragma GCC unroll 1
        for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
            const int8_t *c = pb + k * 64;
            if (ask) prefetch_stream(c, 2);
            __m512i a0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)c));
            __m512i a1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(c + 32)));
            __m512i b0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(c + 64)));
            __m512i b1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(c + 96)));
            v16si w[4] = {(v16si)_mm512_unpacklo_epi16(a0, b0), (v16si)_mm512_unpackhi_epi16(a0, b0),
                          (v16si)_mm512_unpacklo_epi16(a1, b1), (v16si)_mm512_unpackhi_epi16(a1, b1)};
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, a->x16 + (m0 + r) * a->kq + k, sizeof pair);
                v16si bx = (v16si)_mm512_set1_epi32(pair);
                for (int v = 0; v < 4; v++) sum[r][v] = __builtin_ia32_vpdpwssd_v16si(sum[r][v], w[v], bx);
            }
        }
        __m512 sv[4], zv[4];
        for (int j = 0; j < 4; j++) {
            sv[j] = load_bf16x16(scale + g * npad + b * 64 + 16 * j);
            zv[j] = zero ? load_bf16x16(zero + g * npad + b * 64 + 16 * j) : _mm512_setzero_ps();
        }
        for (int r = 0; r < R; r++) {
            __m512i o[4] = {_mm512_permutex2var_epi32((__m512i)sum[r][0], first, (__m512i)sum[r][1]),
                            _mm512_permutex2var_epi32((__m512i)sum[r][0], second, (__m512i)sum[r][1]),
                            _mm512_permutex2var_epi32((__m512i)sum[r][2], first, (__m512i)sum[r][3]),
                            _mm512_permutex2var_epi32((__m512i)sum[r][2], second, (__m512i)sum[r][3])};
            for (int j = 0; j < 4; j++) {
                total[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(o[j]), sv[j], total[r][j]);
                if (zero)
                    total[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(a->xsum[(m0 + r) * groups + g]), zv[j], total[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 s = _mm512_set1_ps(a->s[m0 + r]);
        for (int j = 0; j < 4; j++)
            store_bf16(y + (m0 + r) * N + b * 64 + 16 * j, _mm512_mul_ps(total[r][j], s), N - b * 64 - 16 * j);
    }
}

/* Block b of a grouped int8 weight: every row of a times it -> outputs [64 b, 64 b + 64) of y, in
 * passes of two rows (bytes) or three (words): the first pass reads the codes from memory and
 * asks for the lines ahead (prefetch.h's prefetch_stream: at one row, step by step in one process
 * on a Zen 4, ~3% shorter decode steps than asking for nothing or each line 1-2 KB ahead), the
 * next passes find them in L2. */
static void int8g_block(const int8g_rows *a, const int8_t *packed, const uint16_t *scale, const uint16_t *zero,
                        uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group, int64_t b) {
    const int8_t *pb = packed + b * K * 64;
    const int64_t blocks = (N + 63) / 64, npad = blocks * 64, groups = K / group;
    /* the next block's scales and zeros, a line pair in each group's row (rows npad values apart),
     * asked for ahead as the int4 kernel does: decode steps taking turns with and without, one
     * sequence, on a Zen 4: Q8_0 body 6% shorter where the host gave ~60 GB/s and 2% at ~33, Q5_K_M
     * (zeros too) 4-7% at ~33; eight sequences 1.7% */
    if (b + 1 < blocks) prefetch_block_scales(scale, zero, groups, npad, (b + 1) * 64);
    if (M <= BYTE_ROWS) {
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            if (M - m0 == 1)
                bytes_pass(pb, a, m0, 1, scale, zero, y, N, K, group, b, m0 == 0);
            else if (m0 == 0)
                bytes_pass(pb, a, m0, 2, scale, zero, y, N, K, group, b, 1);
            else
                bytes_pass(pb, a, m0, 2, scale, zero, y, N, K, group, b, 0);
        }
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += 3) {
        int64_t R = M - m0 < 3 ? M - m0 : 3;
        if (m0 == 0) /* M > BYTE_ROWS: a whole pass */
            words_pass(pb, a, m0, 3, scale, zero, y, N, K, group, b, 1);
        else if (R == 1)
            words_pass(pb, a, m0, 1, scale, zero, y, N, K, group, b, 0);
        else if (R == 2)
            words_pass(pb, a, m0, 2, scale, zero, y, N, K, group, b, 0);
        else
            words_pass(pb, a, m0, 3, scale, zero, y, N, K, group, b, 0);
    }
}

/* y[M][N] = x[M][K] times the packed grouped int8 weight (the header). */
void dolmus_int8g_gemm(const uint16_t *x, const int8_t *packed, const uint16_t *scale, const uint16_t *zero,
                       uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group) {
    if (M <= 0) return;
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
void team_int8g_run(const void *ws, const int8_t *packed, const uint16_t *scale, const uint16_t *zero, uint16_t *y,
                    int64_t M, int64_t N, int64_t K, int64_t group, panel_split *split, int t, int T) {
    int8g_rows a = int8g_layout(ws, M, K, group, zero != NULL);
    for (int64_t b; (b = split_take(split, t, T)) >= 0;)
        int8g_block(&a, packed, scale, zero, y, M, N, K, group, b);
}
