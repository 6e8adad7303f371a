/* The product of activation rows with one panel of 32 outputs held in AMX's B-tile layout
 * (bf16_gemm.c's packing; quant_amx.c dequantizes quantized weights into it), shared by the
 * AMX kernels. Compiled only where the tiles are (amx_tiles.h: the hardware, or its model).
 *
 *   P[kb][t][j][o][e] = w[16 t + o][32 kb + 2 j + e]   (t < 2, j, o < 16, e < 2)
 */
#ifndef DOLMUS_AMX_PANEL_H
#define DOLMUS_AMX_PANEL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "amx_tiles.h"
#include "bf16_simd.h"
#include "prefetch.h"

#define PANEL 32      /* outputs per panel */
#define KSTEP 32      /* inputs per tile step */
#define TILE 512      /* bf16 values per 1 KB tile */

static inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

/* 16 sums of one output row -> bf16, plus bias, only the `valid` first ones written. */
static inline void store_row(uint16_t *y, const float *acc, const float *bias, int64_t valid) {
    __m512 v = _mm512_loadu_ps(acc);
    __mmask16 mask = first_lanes(valid);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

#if DOLMUS_AMX

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles: 0-3 sums (rows 0-15 / 16-31 by outputs 0-15 / 16-31 of a panel), 4-5 activations,
 * 6-7 weights. `rows`: activation rows per A tile (M when M < 16, else 16). */
static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t >= 6 ? 16 : rows;
    }
    _tile_loadconfig(&cfg);
}

/* Rows r < 16 of one panel's two 16 x 16 float tiles (t0, t1) -> y. Plain: outputs
 * [n0, n0 + 32) = (t0, t1) plus bias. Gated: outputs [n0 / 2, n0 / 2 + 16) = SiLU(t0) * t1, each
 * rounded to bf16 first as the unfused layer's output is. */
static void store_panel(const float *t0, const float *t1, int64_t rows, const float *bias, uint16_t *y,
                        int64_t ldy, int64_t n0, int64_t N, int gated) {
    for (int64_t r = 0; r < rows; r++) {
        if (!gated) {
            store_row(y + r * ldy + n0, t0 + 16 * r, bias ? bias + n0 : NULL, N - n0);
            store_row(y + r * ldy + n0 + 16, t1 + 16 * r, bias ? bias + n0 + 16 : NULL, N - n0 - 16);
            continue;
        }
        __m512 g = _mm512_loadu_ps(t0 + 16 * r), u = _mm512_loadu_ps(t1 + 16 * r);
        if (bias) {
            g = _mm512_add_ps(g, _mm512_loadu_ps(bias + n0));
            u = _mm512_add_ps(u, _mm512_loadu_ps(bias + n0 + 16));
        }
        store_bf16x16(y + r * ldy + n0 / 2, silu_and_mul_ps(round_to_bf16(g), round_to_bf16(u)));
    }
}

/* Activation rows as the A tiles read them: rows of whole steps of 32 inputs, kp apart, and
 * past 16 rows in whole groups of 16. Rows [0, full) are read in place from x; the last M % 16
 * rows of a longer M from `tail`, a zero-padded copy of 16 rows (a prompt of 129 tokens used to
 * copy all of its rows, 1.2 MB per down projection of a 0.5B model, for the one past 128). */
typedef struct {
    const uint16_t *x, *tail;
    int64_t full, kp;
} tile_rows;

/* The source of the 16-row group starting at row m0 (m0 % 16 == 0). */
static inline const uint16_t *group_rows(const tile_rows *r, int64_t m0) {
    return m0 < r->full ? r->x + m0 * r->kp : r->tail;
}

/* x [M][K] for the tiles. The copy, when one is needed (the tail; every row when K % 32 != 0),
 * goes in *copy for the caller to free; 0, or -1 when memory runs out. */
static inline int tile_rows_of(const uint16_t *x, int64_t M, int64_t K, tile_rows *r, uint16_t **copy) {
    int64_t kp = round_up(K, KSTEP), left = M < 16 ? 0 : M % 16;
    *copy = NULL;
    r->x = x, r->tail = NULL, r->full = M - left, r->kp = kp;
    if (kp != K) { /* every row padded: all of them in whole groups of the copy */
        int64_t mp = M < 16 ? M : round_up(M, 16);
        uint16_t *padded = calloc((size_t)(mp * kp), sizeof(uint16_t));
        if (!padded) return -1;
        for (int64_t m = 0; m < M; m++) memcpy(padded + m * kp, x + m * K, sizeof(uint16_t) * (size_t)K);
        r->x = *copy = padded, r->full = mp;
        return 0;
    }
    if (!left) return 0;
    uint16_t *tail = calloc((size_t)(16 * kp), sizeof(uint16_t));
    if (!tail) return -1;
    memcpy(tail, x + r->full * kp, sizeof(uint16_t) * (size_t)(left * kp));
    r->tail = *copy = tail;
    return 0;
}

/* Steps [k0, k1) of one block of rows (xa: its first 16 rows, xb the next 16 when `two`, rows
 * kp values apart) times panel pp, added to sum tiles 0-1 (and 2-3). */
static inline void block_steps(const uint16_t *pp, const uint16_t *xa, const uint16_t *xb, int64_t kp, int64_t k0,
                               int64_t k1, int two, int prefetch) {
    int64_t stride = kp * (int64_t)sizeof(uint16_t);
    for (int64_t kb = k0; kb < k1; kb++) {
        const uint16_t *tile = pp + kb * 2 * TILE;
        if (prefetch) prefetch_stream(tile, 32);
        _tile_loadd(6, tile, 64);
        _tile_loadd(7, tile + TILE, 64);
        _tile_loadd(4, xa + kb * KSTEP, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, xb + kb * KSTEP, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* M rows (tile_rows_of, after configure) times one panel pp of `steps` steps, outputs
 * [n0, n0 + 32) of y (or n0 / 2 .. when gated). Activation rows go in blocks of 32 (two A
 * tiles) per pass, so the panel is read from memory once and from cache after. */
static inline void panel_product(const uint16_t *pp, int64_t steps, const tile_rows *x, int64_t M,
                                 const float *bias, uint16_t *y, int64_t ldy, int64_t n0, int64_t N,
                                 int gated, int prefetch) {
    int64_t kp = steps * KSTEP, mp = M < 16 ? M : round_up(M, 16);
    float t0[16 * 16], t1[16 * 16];
    for (int64_t m0 = 0; m0 < mp; m0 += 32) {
        int two = mp - m0 > 16;
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
        block_steps(pp, group_rows(x, m0), group_rows(x, m0 + 16), kp, 0, steps, two, prefetch);
        int64_t left = M - m0;
        _tile_stored(0, t0, 64);
        _tile_stored(1, t1, 64);
        store_panel(t0, t1, left < 16 ? left : 16, bias, y + m0 * ldy, ldy, n0, N, gated);
        if (two) {
            _tile_stored(2, t0, 64);
            _tile_stored(3, t1, 64);
            left -= 16;
            store_panel(t0, t1, left < 16 ? left : 16, bias, y + (m0 + 16) * ldy, ldy, n0, N, gated);
        }
    }
}

/* Sums of a panel's 32-row blocks, kept between chunks of K by panel_product_chunked: block b's
 * four 16 x 16 float tiles at acc + 1024 b (rows 0-15 by outputs 0-15 / 16-31, then rows 16-31). */
#define CHUNK_STEPS 8 /* steps of 32 inputs per chunk: a panel's chunk is 16 KB, held in L1 */

/* panel_product for many rows (M > 32, after configure(16)): K in chunks of CHUNK_STEPS steps,
 * every 32-row block through one chunk before the next chunk, the block's sums parked in `acc`
 * (round_up(M, 32) * 32 floats) between chunks. Each chunk of the panel is read once from
 * memory and then from L1 for the other blocks, where whole-K passes read the panel and the rows
 * from L2 every block (1.2 -> 1.35-1.4 TF per core on K = 896 with hot data); and while a chunk
 * serves the later blocks, the next chunk, prefetched by the first block, arrives. Sums are
 * added in the same order as panel_product's: the same bits. A block's last chunk writes its
 * rows out at once, from a 4 KB copy in L1, rather than in a second pass over `acc`.
 * Steps [from, to) only (the sums of earlier steps in `acc`): a caller may go through K in
 * segments, each over many panels; `next` (or NULL) is the chunk it multiplies after each one,
 * prefetched in its place (without it, the first block prefetches a chunk ahead in the panel). */
static inline void panel_product_chunked(const uint16_t *pp, int64_t steps, const tile_rows *x, int64_t M,
                                         const float *bias, uint16_t *y, int64_t ldy, int64_t n0, int64_t N,
                                         int gated, float *acc, int64_t from, int64_t to, const uint16_t *next) {
    int64_t kp = steps * KSTEP, mp = round_up(M, 16);
    float done[1024] __attribute__((aligned(64)));
    for (int64_t k0 = from; k0 < to; k0 += CHUNK_STEPS) {
        int64_t k1 = k0 + CHUNK_STEPS < to ? k0 + CHUNK_STEPS : to;
        int64_t bytes = (k1 - k0) * 2 * TILE * (int64_t)sizeof(uint16_t);
        for (int64_t o = 0; next && o < bytes; o += 64) /* the chunk after this one, into L2 meanwhile */
            _mm_prefetch((const char *)next + o, _MM_HINT_T1);
        for (int64_t m0 = 0; m0 < mp; m0 += 32) {
            int two = mp - m0 > 16;
            float *c = acc + m0 * 32;
            if (k0 == 0) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            } else {
                _tile_loadd(0, c, 64);
                _tile_loadd(1, c + 256, 64);
                if (two) {
                    _tile_loadd(2, c + 512, 64);
                    _tile_loadd(3, c + 768, 64);
                }
            }
            block_steps(pp, group_rows(x, m0), group_rows(x, m0 + 16), kp, k0, k1, two, m0 == 0 && !next);
            float *sums = k1 == steps ? done : c;
            _tile_stored(0, sums, 64);
            _tile_stored(1, sums + 256, 64);
            if (two) {
                _tile_stored(2, sums + 512, 64);
                _tile_stored(3, sums + 768, 64);
            }
            if (k1 < steps) continue;
            int64_t left = M - m0;
            store_panel(done, done + 256, left < 16 ? left : 16, bias, y + m0 * ldy, ldy, n0, N, gated);
            if (two)
                store_panel(done + 512, done + 768, left - 16 < 16 ? left - 16 : 16, bias, y + (m0 + 16) * ldy, ldy,
                            n0, N, gated);
        }
    }
}
#endif
#endif
