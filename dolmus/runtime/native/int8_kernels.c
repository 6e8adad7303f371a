/* Weight-only int8 products (one float scale per output row) on AVX-512 VNNI's integer dot
 * product (vpdpbusd), for x86 CPUs with AVX-512 BF16 (every one of them has VNNI too).
 *
 * Decode multiplies a few activation rows by every weight, so its speed is how fast the codes
 * stream from memory; the kernel this replaces widened each code to bf16 for vdpbf16ps (two
 * conversions and a merge per 16 codes), and one row of it ran at 45-53 GB/s of codes with the
 * codes in cache on a Zen 4's two cores: bound by the core, ~60% of the read bandwidth at one row
 * where the host gives ~60 GB/s. vpdpbusd takes the codes as they lie in memory: 64 unsigned bytes
 * times 64 signed bytes, four products summed into each of 16 int32 lanes, no widening. The same
 * one-row product with the codes in cache: 160-170 GB/s.
 *
 * Weights, packed once at load (dolmus/quant/native.py, pack_int8): blocks of 64 output rows,
 * inputs in quads (K rounded up to 4, padded with zero codes):
 *   P[b][c][j][t] = q[64b + j][4c + t] + 128   (uint8; j < 64, t < 4)
 * so each 256-byte quad of a block is 4 vectors of 16 outputs, lane j holding that output's four
 * codes of inputs 4c .. 4c + 3.
 *
 * Activations, per row and call: bf16 x becomes the integer x16 = x / s with s the power of two
 * that puts max |x| of the row in [2^13, 2^14) (so x16 is exact for every x within 2^7 of the
 * row's largest; below that it rounds by at most s / 2, 2^-14 of the row's largest, well under
 * the bf16 rounding of the activations themselves), split as x16 = 256 h + l with h in [-64, 64]
 * and l in [-128, 127], both signed bytes. Then, exactly in int32 (|sum| < 2^31 for K < 2^16):
 *   sum_k (q + 128) h = A_h,  sum_k (q + 128) l = A_l
 *   sum_k q x16 = 256 (A_h - 128 sum h) + (A_l - 128 sum l)
 * and y = bf16(that * s * scale[n]). A row's result is the same whatever rows come with it (the
 * sums are exact integers), and so whichever pass reads it.
 *
 * Each thread takes a contiguous run of blocks, and the other runs' last blocks once done with its
 * own (panel_split.h, as the bf16 panels). Up to 4 rows go through a block in one pass; one
 * row reads the codes in the order they lie (the stream the cores' prefetchers follow, as
 * bf16_gemm_avx512.c's seq_steps) and, without AMX, asks for each line ONE_ROW_AHEAD bytes on
 * into L2 (prefetch.h), as seq_steps does: with and without the request taking turns step by
 * step in one process (a 0.5B body's int8 decode, 2,500 steps a run, Zen 4), steps 4.3-4.5%
 * shorter where the host gave ~60 GB/s (shorter in 94% of the pairs) and 0.4-0.9% at ~33 GB/s;
 * 1 KB and 4 KB ahead read 1-2% less than 2 KB. 2-4 rows ask for the lines ahead prefetch.h's
 * way.
 * More rows go in passes of 3 (24 sums in registers), each pass after the first reading the
 * block from L2, and ask for nothing: there the requests cost more than they brought. On a Zen 4
 * (2 cores; a 0.5B body's 96 decode products, 362 MB of codes, out of cache, against the kernel
 * this replaces in the same process, median of interleaved rounds where a plain sum read ~30-50
 * GB/s): 1 row 1.02-1.06x, 2 rows 1.14x, 4 rows 0.98x, 8 rows 1.0x, 32 rows 1.36x; with a 4 MB
 * weight in cache, one row 53 -> 160-170 GB/s, 4 rows 35 -> 44. Threads: OpenMP. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include <omp.h>

#include "bf16_simd.h"
#include "kernels.h"
#include "panel_split.h"
#include "prefetch.h"

typedef int v16si __attribute__((vector_size(64))); /* GCC keeps arrays of these in registers (of
                                                        __m512i, cast per call, it did not) */

_Static_assert(sizeof(int8_row) <= 64, "team_int8_prep keeps TEAM_ROWS of them in 64-byte slots");

/* The power of two s with x = s x16 for row x [K] (see the header): *mul = 1 / s, and 0 when the
 * row holds an inf or a NaN (its outputs are then NaN, as a float product's would be). */
static int row_scale(const uint16_t *x, int64_t K, float *mul, float *s) {
    __m512i top = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) /* bf16 magnitudes order as their bits do */
        top = _mm512_max_epu16(top, _mm512_and_si512(_mm512_loadu_si512((const void *)(x + k)), _mm512_set1_epi16(0x7FFF)));
    if (k < K)
        top = _mm512_max_epu16(top, _mm512_and_si512(_mm512_maskz_loadu_epi16((__mmask32)((1ull << (K - k)) - 1), x + k),
                                                     _mm512_set1_epi16(0x7FFF)));
    uint16_t lanes[32], largest = 0;
    _mm512_storeu_si512((void *)lanes, top);
    for (int i = 0; i < 32; i++) largest = lanes[i] > largest ? lanes[i] : largest;
    int e = largest >> 7; /* the largest's biased exponent: max |x| < 2^(e - 126) */
    if (e == 255) {
        *s = __builtin_nanf("");
        return 0;
    }
    if (e < 14) e = 14; /* rows below 2^-112 (zero included): s stays a normal float */
    uint32_t mul_bits = (uint32_t)(267 - e) << 23, s_bits = (uint32_t)(e - 13) << 23; /* 2^(140 - e), 2^(e - 140) */
    memcpy(mul, &mul_bits, sizeof *mul);
    memcpy(s, &s_bits, sizeof *s);
    return 1;
}

/* Inputs [k, k + 16) of row x as x16 (16 int32 lanes; zero past K). */
static inline __m512i x16_of(const uint16_t *x, int64_t K, int64_t k, float mul) {
    __m256i bits = _mm256_maskz_loadu_epi16(first_lanes(K - k), x + k);
    __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    return _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(mul))); /* exact product, rounded to even */
}

/* Row x [K] -> h, l [kq] and the row's sums and scale (see the header; kernels.h). */
void split_row(const uint16_t *x, int64_t K, int64_t kq, int8_t *h, int8_t *l, int8_row *row) {
    float mul;
    row->h = h;
    row->l = l;
    if (!row_scale(x, K, &mul, &row->s)) {
        memset(h, 0, (size_t)kq);
        memset(l, 0, (size_t)kq);
        row->corr_h = row->corr_l = 0;
        return;
    }
    __m512i sum_h = _mm512_setzero_si512(), sum_l = _mm512_setzero_si512();
    for (int64_t k = 0; k < kq; k += 16) {
        __m512i q = x16_of(x, K, k, mul);
        __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
        __m512i lo = _mm512_sub_epi32(q, _mm512_slli_epi32(hi, 8));
        sum_h = _mm512_add_epi32(sum_h, hi);
        sum_l = _mm512_add_epi32(sum_l, lo);
        _mm_storeu_si128((__m128i *)(h + k), _mm512_cvtepi32_epi8(hi));
        _mm_storeu_si128((__m128i *)(l + k), _mm512_cvtepi32_epi8(lo));
    }
    row->corr_h = 128 * _mm512_reduce_add_epi32(sum_h);
    row->corr_l = 128 * _mm512_reduce_add_epi32(sum_l);
}

/* Row x [K] -> x16 [kq] as 16-bit integers (|x16| < 2^14), and s (kernels.h). */
float x16_row(const uint16_t *x, int64_t K, int64_t kq, int16_t *out) {
    float mul, s;
    if (!row_scale(x, K, &mul, &s)) {
        memset(out, 0, sizeof(int16_t) * (size_t)kq);
        return s;
    }
    for (int64_t k = 0; k < kq; k += 16) _mm256_storeu_si256((__m256i *)(out + k), _mm512_cvtepi32_epi16(x16_of(x, K, k, mul)));
    return s;
}

enum { ASK_NOTHING, ASK_STREAM, ASK_AHEAD }; /* block_rows' requests for the lines ahead */

/* Rows rows[0 .. R) times block pb (quads of 256 bytes) -> outputs [n0, n0 + 64) of their y rows.
 * R is a constant at each call, so the loops over rows and vectors unroll and the sums stay in
 * registers (at 4 rows, 32 sums, a few wait in L1); the loop over quads is not unrolled (its
 * loads then see addresses 64 bytes apart, one after another). `ask`: nothing, prefetch.h's
 * two requests (ASK_STREAM), or each line ONE_ROW_AHEAD on (ASK_AHEAD). */
static inline __attribute__((always_inline)) void block_rows(const uint8_t *pb, int64_t quads, const int8_row *rows,
                                                                const int R, const float *scale, uint16_t *const *y,
                                                                int64_t n0, int64_t N, const int ask) {
    v16si sh[4][4], sl[4][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) sh[r][v] = sl[r][v] = (v16si){0};
#pragma GCC unroll 1
    for (int64_t c = 0; c < quads; c++) {
        v16si w[4];
        if (ask == ASK_STREAM) prefetch_stream(pb + 256 * c, 4);
        if (ask == ASK_AHEAD)
            for (int v = 0; v < 4; v++)
                prefetch_l2((const char *)(pb + 256 * c + 64 * v) + ONE_ROW_AHEAD);
        for (int v = 0; v < 4; v++) w[v] = (v16si)_mm512_loadu_si512((const void *)(pb + 256 * c + 64 * v));
        for (int r = 0; r < R; r++) {
            int32_t hq, lq;
            memcpy(&hq, rows[r].h + 4 * c, sizeof hq);
            memcpy(&lq, rows[r].l + 4 * c, sizeof lq);
            v16si bh = (v16si)_mm512_set1_epi32(hq), bl = (v16si)_mm512_set1_epi32(lq);
            for (int v = 0; v < 4; v++) {
                sh[r][v] = __builtin_ia32_vpdpbusd_v16si(sh[r][v], w[v], bh);
                sl[r][v] = __builtin_ia32_vpdpbusd_v16si(sl[r][v], w[v], bl);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m512i ch = _mm512_set1_epi32(rows[r].corr_h), cl = _mm512_set1_epi32(rows[r].corr_l);
        __m512 s = _mm512_set1_ps(rows[r].s);
        for (int v = 0; v < 4; v++) {
            __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32((__m512i)sh[r][v], ch));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32((__m512i)sl[r][v], cl));
            __m512 dot = _mm512_fmadd_ps(hi, _mm512_set1_ps(256.0f), lo);
            __m512 out = _mm512_mul_ps(_mm512_mul_ps(dot, s), _mm512_loadu_ps(scale + n0 + 16 * v));
            store_bf16(y[r] + n0 + 16 * v, out, N - n0 - 16 * v);
        }
    }
}

/* Activations split per stretch of rows: at most this many bytes of them (h and l), half of a 1 MB
 * L2, read again by every block; each stretch reads all of the weights again (from memory). */
#define STRETCH_BYTES (1 << 19)

/* Thread t's blocks of `split` (set up for every block): rows [0, M) of the split activations
 * times them -> their outputs of the y rows. */
static void int8_blocks(const int8_row *rows, const uint8_t *packed, const float *scale, uint16_t *y, int64_t M,
                        int64_t N, int64_t quads, panel_split *split, int t, int T) {
    for (int64_t b; (b = split_take(split, t, T)) >= 0;) {
        const uint8_t *pb = packed + b * quads * 256;
        uint16_t *out[4];
        for (int64_t m = 0; m < M;) {
            int64_t r = M <= 4 ? M : (M - m >= 3 ? 3 : M - m);
            for (int i = 0; i < r; i++) out[i] = y + (m + i) * N;
            if (M == 1) /* one row: the whole block's stream (prefetch.h's ONE_ROW_AHEAD) */
                block_rows(pb, quads, rows + m, 1, scale, out, b * 64, N, ONE_ROW_AHEAD ? ASK_AHEAD : ASK_NOTHING);
            else if (r == 1) block_rows(pb, quads, rows + m, 1, scale, out, b * 64, N, ASK_NOTHING);
            else if (M <= 4 && r == 2) block_rows(pb, quads, rows + m, 2, scale, out, b * 64, N, ASK_STREAM);
            else if (M <= 4 && r == 3) block_rows(pb, quads, rows + m, 3, scale, out, b * 64, N, ASK_STREAM);
            else if (M <= 4) block_rows(pb, quads, rows + m, 4, scale, out, b * 64, N, ASK_STREAM);
            else if (r == 2) block_rows(pb, quads, rows + m, 2, scale, out, b * 64, N, ASK_NOTHING);
            else block_rows(pb, quads, rows + m, 3, scale, out, b * 64, N, ASK_NOTHING);
            m += r;
        }
    }
}

/* Rows [0, M) of the split activations times every block -> y rows. */
static void int8_stretch(const int8_row *rows, const uint8_t *packed, const float *scale, uint16_t *y, int64_t M,
                         int64_t N, int64_t quads) {
    panel_split split;
#pragma omp parallel
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        split_init(&split, t, T, (N + 63) / 64);
#pragma omp barrier
        int8_blocks(rows, packed, scale, y, M, N, quads, &split, t, T);
    }
}

/* y[M][N] = x[M][K] times the packed int8 weight; scale: [Npad] float32. Any number of rows
 * (K < 2^16). */
void dolmus_int8_gemm(const uint16_t *x, const uint8_t *packed, const float *scale, uint16_t *y, int64_t M, int64_t N,
                      int64_t K) {
    int64_t quads = (K + 3) / 4, kq = (K + 15) / 16 * 16;
    int64_t stretch = STRETCH_BYTES / (2 * kq) / 3 * 3;
    if (stretch < 3) stretch = 3;
    if (stretch > M) stretch = M;
    int8_t *bytes = aligned_alloc(64, (size_t)(2 * stretch * kq));
    int8_row *rows = malloc(sizeof(int8_row) * (size_t)stretch);
    if (!bytes || !rows) abort();
    for (int64_t m0 = 0; m0 < M; m0 += stretch) {
        int64_t count = M - m0 < stretch ? M - m0 : stretch;
        for (int64_t m = 0; m < count; m++)
            split_row(x + (m0 + m) * K, K, kq, bytes + 2 * m * kq, bytes + (2 * m + 1) * kq, rows + m);
        int8_stretch(rows, packed, scale, y + m0 * N, count, N, quads);
    }
    free(rows);
    free(bytes);
}

/* The one-region step's form (kernels.h): ws holds the rows' int8_row (TEAM_ROWS * 64 bytes), then
 * each row's h and l. */
void team_int8_prep(const uint16_t *x, int64_t M, int64_t K, void *ws) {
    int64_t kq = (K + 15) / 16 * 16;
    int8_t *bytes = (int8_t *)ws + TEAM_ROWS * 64;
    for (int64_t m = 0; m < M; m++)
        split_row(x + m * K, K, kq, bytes + 2 * m * kq, bytes + (2 * m + 1) * kq, (int8_row *)ws + m);
}

void team_int8_run(const void *ws, const uint8_t *packed, const float *scale, uint16_t *y, int64_t M,
                   int64_t N, int64_t K, panel_split *split, int t, int T) {
    int8_blocks((const int8_row *)ws, packed, scale, y, M, N, (K + 3) / 4, split, t, T);
}

/* Rows [n0, n1) of the packed int8 weight as bf16, row-major [n1 - n0][K], n0 a multiple of 4:
 * where the CPU has AMX, long prompt chunks multiply with PyTorch's bf16 GEMM on its tiles. Each
 * 16 bytes of a quad are 4 outputs' 4 inputs. */
void dolmus_int8_dequant(const uint8_t *packed, const float *scale, uint16_t *out, int64_t n0, int64_t n1, int64_t K) {
    int64_t quads = (K + 3) / 4;
    const __m512i four = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
#pragma omp parallel for schedule(static)
    for (int64_t n = n0; n < n1; n += 4) {
        const uint8_t *pb = packed + (n / 64) * quads * 256 + 4 * (n % 64);
        __m512 s = _mm512_permutexvar_ps(four, _mm512_castps128_ps512(_mm_loadu_ps(scale + n)));
        for (int64_t c = 0; c < quads; c++) {
            __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pb + 256 * c))),
                                         _mm512_set1_epi32(128));
            uint16_t v[16];
            _mm256_storeu_si256((__m256i *)v, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_cvtepi32_ps(q), s)));
            int64_t take = K - 4 * c < 4 ? K - 4 * c : 4;
            for (int j = 0; j < 4 && n + j < n1; j++)
                memcpy(out + (n + j - n0) * K + 4 * c, v + 4 * j, sizeof(uint16_t) * (size_t)take);
        }
    }
}
