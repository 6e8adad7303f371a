/* int4 and grouped int8 weights (quant_kernels.c's and int8g_kernels.c's layouts) times several
 * activation rows on AMX tiles.
 *
 * quant_kernels.c's products multiply every weight with every row through AVX-512 BF16 dot
 * products: at one row that streams at the read bandwidth, but the work grows with the rows
 * (SmolLM2-135M's layers take 4.6x as long at 8 rows as at 1 and 17x at 32). Here each panel
 * of 32 outputs is dequantized once per call into bf16 B tiles (amx_panel.h's layout, a few
 * KB held in cache: w = (q - 8) * scale + zero for int4, q * scale + zero for int8, each
 * rounded once to bf16, as the int8 prefill path's dequantized weights are), and AMX multiplies
 * all the rows with it: the cost of a call barely grows with the rows. Up to 16 rows, weights
 * grouped by multiples of 32 skip the dequantizing instead (rows_block: group sums on tiles,
 * scaled after). The callers (dolmus_int4_gemm, dolmus_int8g_gemm) take these paths where the
 * CPU lets this process use AMX, with K a multiple of 32, from the row counts named below.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "amx_panel.h"
#include "amx_tiles.h" /* DOLMUS_AMX */
#include "bf16_simd.h"
#include "kernels.h"
#include "prefetch.h"

/* From this many rows the dequantized panels are the faster (at 4 rows the dot-product kernels,
 * one pass over each block, were 1.2-1.4x faster on a 0.5B body out of cache once they
 * prefetched). */
#define AMX_MIN_ROWS 5
/* Up to this many rows, weights grouped by multiples of 32 take rows_block (one A tile), which
 * reads the codes as they are and pays from fewer rows: measured on the fused decode step of a
 * 0.5B body out of cache and of SmolLM2-135M in cache (speculative windows of 2-5 rows), int4
 * from 2 rows (Q4_0 body 10.9 vs 12.3 ms at 2, 12.3 vs 18.1 at 4), grouped int8 from 3 (Q8_0
 * body 20.8 vs 21.7 ms at 3, but 20.8 vs 19.2 at 2). */
#define ROWS_PATH_MAX 16
#define ROWS_MIN_INT4 2
#define ROWS_MIN_INT8 3

#if DOLMUS_AMX

/* Two 16-lane float vectors (the weights of inputs 2p and 2p + 1 of 16 outputs) -> one tile
 * row: lane o holds the bf16 pair (even[o], odd[o]), each rounded to nearest even. */
static inline __m512i bf16_pairs(__m512 even, __m512 odd) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

/* Tile row j = p % 16 of step p / 16, tile h, of the panel buffer: the weights q s + z of
 * inputs 2p (even) and 2p + 1 (odd) of 16 outputs, as bf16 pairs. */
static inline void put_pair_row(uint16_t *buf, int64_t p, int h, __m512 even, __m512 odd, __m512 s, __m512 z) {
    __m512i row = bf16_pairs(_mm512_fmadd_ps(even, s, z), _mm512_fmadd_ps(odd, s, z));
    _mm512_store_si512((void *)(buf + (p / 16 * 2 + h) * TILE + p % 16 * 32), row);
}

/* The scales and zeros of group g for outputs n0 + 16 h + o, h < 2, as floats. */
static inline void group_vectors(const uint16_t *scale, const uint16_t *zero, int64_t g, int64_t npad,
                                 int64_t n0, __m512 sc[2], __m512 zc[2]) {
    for (int h = 0; h < 2; h++) {
        sc[h] = load_bf16x16(scale + g * npad + n0 + 16 * h);
        zc[h] = zero ? load_bf16x16(zero + g * npad + n0 + 16 * h) : _mm512_setzero_ps();
    }
}

/* Panel (block b, half s) of an int4 weight: outputs 64 b + 32 s + 16 h + o, for all K. Byte
 * 16 l + 8 h + 2 i + e of a pair's 64 holds output 32 s + 16 h + 4 l + i, input e (nibble s):
 * in-lane unpacking against zero gives, per h, the 16 outputs' pairs in lane order. */
static void int4_panel(const uint8_t *block, const uint16_t *scale, const uint16_t *zero, int64_t npad,
                       int64_t n0, int64_t K, int64_t group, int s, uint16_t *buf) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), zero_byte = _mm512_setzero_si512();
    const __m512i low_word = _mm512_set1_epi32(0xFFFF);
    __m512 sc[2], zc[2];
    int64_t current = -1;
    for (int64_t p = 0; p < K / 2; p++) {
        int64_t g = 2 * p / group;
        if (g != current) {
            current = g;
            group_vectors(scale, zero, g, npad, n0, sc, zc);
            for (int h = 0; h < 2; h++) /* (q - 8) s + z = q s + (z - 8 s) */
                zc[h] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sc[h], zc[h]);
        }
        if (!s) prefetch_stream(block + p * 64, 1); /* the second half re-reads it from cache */
        __m512i bytes = _mm512_loadu_si512((const void *)(block + p * 64));
        __m512i q = _mm512_and_si512(s ? _mm512_srli_epi16(bytes, 4) : bytes, nibble);
        for (int h = 0; h < 2; h++) {
            /* 16-bit lanes: (q[o][2p], q[o][2p + 1]) for the 16 outputs of h */
            __m512i words = h ? _mm512_unpackhi_epi8(q, zero_byte) : _mm512_unpacklo_epi8(q, zero_byte);
            __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(words, low_word));
            __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(words, 16));
            put_pair_row(buf, p, h, even, odd, sc[h], zc[h]);
        }
    }
}

/* Panel (block b, half s) of a grouped int8 weight: codes [K][64] per block, input k's codes
 * of outputs 32 s + 16 h + o at 32 s + 16 h + o. */
static void int8g_panel(const int8_t *block, const uint16_t *scale, const uint16_t *zero, int64_t npad,
                        int64_t n0, int64_t K, int64_t group, int s, uint16_t *buf) {
    __m512 sc[2], zc[2];
    int64_t current = -1;
    for (int64_t p = 0; p < K / 2; p++) {
        int64_t g = 2 * p / group;
        if (g != current) {
            current = g;
            group_vectors(scale, zero, g, npad, n0, sc, zc);
        }
        if (!s) prefetch_stream(block + 2 * p * 64, 2);
        for (int h = 0; h < 2; h++) {
            const int8_t *c = block + 2 * p * 64 + 32 * s + 16 * h;
            __m512 even = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
            __m512 odd = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 64))));
            put_pair_row(buf, p, h, even, odd, sc[h], zc[h]);
        }
    }
}

/* Up to 16 rows of a weight, block b (outputs n0 = 64 b ..), groups of a multiple of 32 inputs.
 * Dequantizing panels costs arithmetic per weight; here the codes become exact bf16 numbers,
 * for int4 by byte shuffles alone (nibbles_to_bf16_pairs: 128 + q, the pairs of 16 outputs are
 * a B tile row as they come), for int8 by a conversion without a multiply; AMX sums each group
 * into float tiles, and the group's scale and zero are applied to those sums, once per (row,
 * output, group), as quant_kernels.c's one-row kernels do:
 *   int4: sum x w = s (sum x (128 + q) - 136 sum x) + z sum x     (w = (q - 8) s + z)
 *   int8: sum x w = s sum x q + z sum x                            (w = q s + z)
 * bbuf: 4 tiles (4 KB, 64-byte aligned). */
static void rows_block(const void *block, int bits, const uint16_t *scale, const uint16_t *zero, int64_t npad,
                       int64_t n0, int64_t K, int64_t group, const uint16_t *x, int64_t M, const float *xsum,
                       uint16_t *y, int64_t N, uint16_t *bbuf) {
    float total[16][64], sums[4][16 * 16];
    int64_t groups = K / group, per_group = group / KSTEP;
    float offset = bits == 4 ? 136.0f : 0.0f;
    memset(total, 0, sizeof total);
    for (int64_t g = 0; g < groups; g++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = g * per_group; kb < (g + 1) * per_group; kb++) {
            for (int p = 0; p < KSTEP / 2; p++) { /* tile row p: inputs kb * 32 + 2p, + 1 */
                int64_t pair = kb * KSTEP / 2 + p;
                __m512bh w[4];
                if (bits == 4) {
                    const uint8_t *c = (const uint8_t *)block + pair * 64;
                    prefetch_stream(c, 1);
                    nibbles_to_bf16_pairs(c, w);
                } else {
                    const int8_t *c = (const int8_t *)block + pair * 128;
                    prefetch_stream(c, 2);
                    for (int t = 0; t < 4; t++) w[t] = int8_pairs_to_bf16(c + 16 * t, c + 64 + 16 * t);
                }
                for (int t = 0; t < 4; t++) _mm512_store_si512((void *)(bbuf + t * TILE + p * 32), (__m512i)w[t]);
            }
            _tile_loadd(4, x + kb * KSTEP, K * (int64_t)sizeof(uint16_t));
            _tile_loadd(6, bbuf, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, bbuf + TILE, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, bbuf + 2 * TILE, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, bbuf + 3 * TILE, 64);
            _tile_dpbf16ps(3, 4, 7);
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
        for (int t = 0; t < 4; t++) {
            __m512 s = load_bf16x16(scale + g * npad + n0 + 16 * t);
            __m512 z = zero ? load_bf16x16(zero + g * npad + n0 + 16 * t) : _mm512_setzero_ps();
            for (int64_t m = 0; m < M; m++) {
                __m512 xs = _mm512_set1_ps(xsum ? xsum[m * groups + g] : 0.0f);
                __m512 dot = _mm512_fnmadd_ps(_mm512_set1_ps(offset), xs, _mm512_loadu_ps(sums[t] + m * 16));
                __m512 acc = _mm512_loadu_ps(&total[m][16 * t]);
                _mm512_storeu_ps(&total[m][16 * t], _mm512_fmadd_ps(dot, s, _mm512_fmadd_ps(xs, z, acc)));
            }
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int t = 0; t < 4; t++) store_row(y + m * N + n0 + 16 * t, &total[m][16 * t], NULL, N - n0 - 16 * t);
}

/* Whether a product takes rows_block: few rows, whole tile steps per group. */
static int rows_path(int64_t M, int64_t group) { return M <= ROWS_PATH_MAX && group % KSTEP == 0; }

/* Whether tiles may be used here, asked once (dolmus_amx_ready: the kernel's permission). */
int dolmus_amx_quant_usable(int64_t M, int64_t K, int64_t group, int64_t bits) {
    static int usable = -1;
    if (usable < 0) usable = dolmus_amx_ready();
    int64_t min_rows = !rows_path(M, group) ? AMX_MIN_ROWS : bits == 4 ? ROWS_MIN_INT4 : ROWS_MIN_INT8;
    return usable && M >= min_rows && K % KSTEP == 0;
}

/* y[M][N] = x[M][K] times the weight; bits 4 (int4 layout, blocks [K / 2][64] bytes) or 8
 * (grouped int8, blocks [K][64]); scale, zero [K / group][Npad] bf16, zero may be NULL. */
void dolmus_quant_gemm_amx(const uint16_t *x, const void *packed, const uint16_t *scale, const uint16_t *zero,
                           uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group, int64_t bits) {
    int64_t blocks = (N + 63) / 64, npad = blocks * 64, steps = K / KSTEP;
    uint16_t *copy;
    if (rows_path(M, group)) { /* K % 32 == 0 and M <= 16: x is as tiles read it */
        float *xsum = NULL;     /* sum x per group: for int4's offset and for zeros */
        if ((bits == 4 || zero) && !(xsum = dolmus_group_sums(x, M, K, group))) return;
#pragma omp parallel
        {
            uint16_t *bbuf = aligned_alloc(64, 4 * TILE * sizeof(uint16_t));
            if (bbuf) {
                configure((int)M);
#pragma omp for schedule(static)
                for (int64_t b = 0; b < blocks; b++)
                    rows_block((const uint8_t *)packed + b * K * bits * 8, (int)bits, scale, zero, npad, 64 * b, K,
                               group, x, M, xsum, y, N, bbuf);
                _tile_release();
                free(bbuf);
            }
        }
        free(xsum);
        return;
    }
    tile_rows rows;
    if (tile_rows_of(x, M, K, &rows, &copy)) return;
#pragma omp parallel
    {
        uint16_t *buf = aligned_alloc(64, (size_t)steps * 2 * TILE * sizeof(uint16_t));
        if (buf) {
            configure(M < 16 ? (int)M : 16);
#pragma omp for schedule(static)
            for (int64_t panel = 0; panel < 2 * blocks; panel++) {
                int64_t b = panel / 2, n0 = panel * PANEL;
                int s = (int)(panel % 2);
                if (n0 >= N) continue;
                if (bits == 4)
                    int4_panel((const uint8_t *)packed + b * (K / 2) * 64, scale, zero, npad, n0, K, group, s, buf);
                else
                    int8g_panel((const int8_t *)packed + b * K * 64, scale, zero, npad, n0, K, group, s, buf);
                panel_product(buf, steps, &rows, M, NULL, y, N, n0, N, 0, 0);
            }
            _tile_release();
            free(buf);
        }
    }
    free(copy);
}

#else

int dolmus_amx_quant_usable(int64_t M, int64_t K, int64_t group, int64_t bits) {
    (void)M, (void)K, (void)group, (void)bits;
    return 0;
}

void dolmus_quant_gemm_amx(const uint16_t *x, const void *packed, const uint16_t *scale, const uint16_t *zero,
                           uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group, int64_t bits) {
    (void)x, (void)packed, (void)scale, (void)zero, (void)y, (void)M, (void)N, (void)K, (void)group, (void)bits;
    abort(); /* never called: dolmus_amx_quant_usable() said no */
}

#endif
