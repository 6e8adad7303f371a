/* Prompt (prefill) attention over the paged KV cache, for bf16 models on x86 CPUs with AMX-BF16
 * (tiles) or AVX-512 BF16 alone (vdpbf16ps).
 *
 * PyTorch's CPU flash attention ran a 128-token prompt of a 0.5B model (14 query heads, 2 KV
 * heads, head size 64) at ~0.1 TFLOP/s, ~160 ms of a 32 x 128-token prefill; the same products
 * on tiles take a fraction of that. Each sequence's keys and values are first copied out of the
 * cache into the layouts AMX's B tiles read (per KV head: keys in 16-key tiles of input pairs,
 * values in 32-key tiles of key pairs). Then each work item, 16 query rows of one query head,
 * computes its scores against every key it may see (all tiles up to the last row's position),
 * the softmax in float32, and the weighted values:
 *
 *   s = (q . k) * scale, causal (row t of a chunk after `context` cached tokens sees keys
 *   0 .. context + t); e = exp(s - max); out = bf16((bf16(e) . v) / sum(e))
 *
 * which is the order PyTorch's flash kernel rounds in for rows of up to its 512-key block
 * (probabilities rounded to bf16 for the second product, the sum kept in float32); longer rows
 * differ from it only by its rescaling between blocks. The sums of products are float32 in both.
 *
 * Without AMX the same packed layouts serve vdpbf16ps, as in bf16_gemm_avx512.c: a tile row (16
 * keys' values of one input pair, or one key pair's values of 16 output columns) is exactly that
 * instruction's 32-value operand, the query's pair (a probability pair) broadcast is the other.
 * A prefix hit thus attends to its cached blocks in place on every AVX-512 BF16 CPU: SDPA needed
 * them gathered first.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "amx_panel.h"
#include "amx_tiles.h" /* DOLMUS_AMX */
#include "bf16_simd.h"
#include "kernels.h"

/* Keys [0, total) of KV head h of a sequence -> kp (16-key tiles: [tile][d / 32][16 pairs][16
 * keys][2]) and vp (32-key tiles: [tile][d / 16][16 key pairs][16][2]); padding keys are zero.
 * rows: each position's offset in the caches. */
static void pack_keys_values(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *rows,
                             int64_t total, int64_t d, uint16_t *kp, uint16_t *vp) {
    int64_t padded = round_up(total, 32), steps = d / 32;
    uint32_t *k32 = (uint32_t *)kp;
    for (int64_t p = 0; p < padded; p++) {
        const uint32_t *src = p < total ? (const uint32_t *)(k_cache + rows[p]) : NULL;
        uint32_t *tile = k32 + (p / 16) * steps * 256;
        for (int64_t j = 0; j < d / 2; j++) /* pair j of key p: step j / 16, row j % 16, column p % 16 */
            tile[(j / 16) * 256 + (j % 16) * 16 + p % 16] = src ? src[j] : 0;
    }
    for (int64_t p = 0; p < padded; p++) {
        const uint16_t *src = p < total ? v_cache + rows[p] : NULL;
        uint16_t *tile = vp + (p / 32) * (d / 16) * TILE;
        int64_t pair = (p % 32) / 2, e = p % 2;
        for (int64_t c = 0; c < d; c++) /* column c of key p: tile c / 16, row pair, column c % 16 */
            tile[(c / 16) * TILE + pair * 32 + (c % 16) * 2 + e] = src ? src[c] : 0;
    }
}

/* Row r < rows of 16 score rows (s, `padded` floats apart) -> its probabilities over the keys it
 * sees, [0, first + r], rounded to bf16 in pb (zero past them, and in rows >= rows); inv[r]: one
 * over their float32 sum. */
static void softmax_rows(float *s, uint16_t *pb, int64_t padded, int64_t rows, int64_t first, float scale,
                         float inv[16]) {
    for (int64_t r = 0; r < 16; r++) {
        float *sr = s + r * padded;
        uint16_t *pr = pb + r * padded;
        int64_t len = r < rows ? first + r + 1 : 0;
        __m512 top = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
        for (int64_t k0 = 0; k0 < len; k0 += 16) {
            __mmask16 m = first_lanes(len - k0);
            __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sr + k0), sc);
            _mm512_storeu_ps(sr + k0, v);
            top = _mm512_mask_max_ps(top, m, top, v);
        }
        __m512 mx = _mm512_set1_ps(len ? _mm512_reduce_max_ps(top) : 0.0f), sum = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < padded; k0 += 16) {
            __mmask16 m = first_lanes(len - k0);
            __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + k0), mx)));
            sum = _mm512_add_ps(sum, e);
            store_bf16x16(pr + k0, e);
        }
        float total = _mm512_reduce_add_ps(sum);
        inv[r] = total > 0 ? 1.0f / total : 0.0f;
    }
}

/* Up to 16 query rows of one head as 16 rows d values apart: in place, or copied with zero rows
 * below a short last tile (never reading past the query). Returns the rows' stride. */
static int64_t query_rows(const uint16_t *q, int64_t q_stride, int64_t rows, int64_t d, const uint16_t **qa,
                          uint16_t *qbuf) {
    if (rows == 16) {
        *qa = q;
        return q_stride;
    }
    memset(qbuf, 0, sizeof(uint16_t) * 16 * (size_t)d);
    for (int64_t r = 0; r < rows; r++) memcpy(qbuf + r * d, q + r * q_stride, sizeof(uint16_t) * (size_t)d);
    *qa = qbuf;
    return d;
}

#if DOLMUS_AMX

/* 16 query rows (q: rows `rows` valid, q_stride apart) of one head against the packed keys and
 * values of its KV head on AMX tiles; first: the position of row 0; the rows see keys
 * [0, first + r]. s: 16 x padded floats, pb: 16 x padded bf16 (scratch); out rows out_stride apart. */
static void attend_rows_amx(const uint16_t *q, int64_t q_stride, int64_t rows, int64_t first, const uint16_t *kp,
                            const uint16_t *vp, int64_t d, float scale, float *s, uint16_t *pb, uint16_t *out,
                            int64_t out_stride) {
    int64_t seen = first + rows, padded = round_up(seen, 32), steps = d / 32;
    uint16_t qbuf[16 * 128];
    const uint16_t *qa;
    int64_t qs = query_rows(q, q_stride, rows, d, &qa, qbuf);
    /* scores, 16 keys per tile: tiles 4 .. 4 + steps - 1 hold the query (steps <= 4 as d <= 128) */
    _tile_loadd(4, qa, qs * 2); /* tile numbers are immediates */
    if (steps > 1) _tile_loadd(5, qa + 32, qs * 2);
    if (steps > 2) _tile_loadd(6, qa + 64, qs * 2);
    if (steps > 3) _tile_loadd(7, qa + 96, qs * 2);
    for (int64_t k0 = 0; k0 < padded; k0 += 16) {
        _tile_zero(0);
        const uint16_t *kt = kp + (k0 / 16) * steps * TILE;
        for (int64_t c = 0; c < steps; c++) {
            _tile_loadd(1, kt + c * TILE, 64);
            switch (c) {
            case 0: _tile_dpbf16ps(0, 4, 1); break;
            case 1: _tile_dpbf16ps(0, 5, 1); break;
            case 2: _tile_dpbf16ps(0, 6, 1); break;
            default: _tile_dpbf16ps(0, 7, 1); break;
            }
        }
        _tile_stored(0, s + k0, padded * 4);
    }
    float inv[16];
    softmax_rows(s, pb, padded, rows, first, scale, inv);
    /* weighted values, 64 output columns per pass: sum tiles 0-3, probabilities 4, values 5 */
    float o[16 * 64] __attribute__((aligned(64)));
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        int64_t cols = d - c0 < 64 ? (d - c0) / 16 : 4;
        for (int64_t t = 0; t < cols; t++) {
            switch (t) {
            case 0: _tile_zero(0); break;
            case 1: _tile_zero(1); break;
            case 2: _tile_zero(2); break;
            default: _tile_zero(3); break;
            }
        }
        for (int64_t k0 = 0; k0 < padded; k0 += 32) {
            _tile_loadd(4, pb + k0, padded * 2);
            const uint16_t *vt = vp + (k0 / 32) * (d / 16) * TILE + (c0 / 16) * TILE;
            _tile_loadd(5, vt, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (cols > 1) {
                _tile_loadd(6, vt + TILE, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (cols > 2) {
                _tile_loadd(7, vt + 2 * TILE, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (cols > 3) {
                _tile_loadd(5, vt + 3 * TILE, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, o, 256);
        if (cols > 1) _tile_stored(1, o + 16, 256);
        if (cols > 2) _tile_stored(2, o + 32, 256);
        if (cols > 3) _tile_stored(3, o + 48, 256);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t t = 0; t < cols; t++)
                store_bf16x16(out + r * out_stride + c0 + 16 * t,
                              _mm512_mul_ps(_mm512_loadu_ps(o + r * 64 + 16 * t), _mm512_set1_ps(inv[r])));
    }
}

#endif

/* The same 16 rows on vdpbf16ps. Each of the 16 sums of a block is one register: a packed row
 * (16 keys of one input pair; one key pair's 16 value columns) is loaded once and meets each
 * query row's pair (probability pair) broadcast from memory. */
static void attend_rows_dp(const uint16_t *q, int64_t q_stride, int64_t rows, int64_t first, const uint16_t *kp,
                           const uint16_t *vp, int64_t d, float scale, float *s, uint16_t *pb, uint16_t *out,
                           int64_t out_stride) {
    int64_t seen = first + rows, padded = round_up(seen, 32), pairs = d / 2;
    uint16_t qbuf[16 * 128];
    const uint16_t *qa;
    int64_t qs = query_rows(q, q_stride, rows, d, &qa, qbuf);
    const int32_t *q32 = (const int32_t *)qa;
    int64_t qs32 = qs / 2;
    /* scores, 32 keys (two 16-key tiles) by 8 query rows at a time: a tile's rows are its keys'
     * pairs j = 0 .. d / 2 - 1, 32 values apart; each broadcast query pair feeds both tiles, 10
     * loads per 16 products where 16 rows by one tile took 17 (both products of the attention
     * now run at the vdpbf16ps loop's speed; one 2,048-token prompt 12.9 -> 11.0 ms a layer) */
    int64_t halves = rows > 8 ? 2 : 1; /* score rows past `rows` end up unused: not computed */
    for (int64_t k0 = 0; k0 < padded; k0 += 32) {
        const uint16_t *ka = kp + (k0 / 16) * pairs * 32, *kb = ka + pairs * 32;
        for (int64_t r0 = 0; r0 < 8 * halves; r0 += 8) {
            __m512 acc[8][2];
            for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            for (int64_t j = 0; j < pairs; j++) {
                __m512bh a = (__m512bh)_mm512_loadu_si512(ka + j * 32), b = (__m512bh)_mm512_loadu_si512(kb + j * 32);
                for (int r = 0; r < 8; r++) {
                    __m512bh x = (__m512bh)_mm512_set1_epi32(q32[(r0 + r) * qs32 + j]);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, a);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b);
                }
            }
            for (int r = 0; r < 8; r++) {
                _mm512_storeu_ps(s + (r0 + r) * padded + k0, acc[r][0]);
                _mm512_storeu_ps(s + (r0 + r) * padded + k0 + 16, acc[r][1]);
            }
        }
    }
    float inv[16];
    softmax_rows(s, pb, padded, rows, first, scale, inv);
    /* weighted values, 32 output columns (two column blocks) by 8 rows at a time: a 32-key tile's
     * rows for column block c are its 16 key pairs, 32 values apart */
    const int32_t *p32 = (const int32_t *)pb;
    int64_t ps32 = padded / 2;
    for (int64_t c = 0; c < d / 16; c += 2) {
        for (int64_t r0 = 0; r0 < 8 * halves; r0 += 8) {
            __m512 acc[8][2];
            for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            for (int64_t k0 = 0; k0 < padded; k0 += 32) {
                const uint16_t *va = vp + (k0 / 32) * (d / 16) * TILE + c * TILE, *vb = va + TILE;
                for (int64_t j = 0; j < 16; j++) {
                    __m512bh a = (__m512bh)_mm512_loadu_si512(va + j * 32), b = (__m512bh)_mm512_loadu_si512(vb + j * 32);
                    for (int r = 0; r < 8; r++) {
                        __m512bh p = (__m512bh)_mm512_set1_epi32(p32[(r0 + r) * ps32 + k0 / 2 + j]);
                        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], p, a);
                        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], p, b);
                    }
                }
            }
            for (int64_t r = r0; r < rows && r < r0 + 8; r++) {
                __m512 w = _mm512_set1_ps(inv[r]);
                store_bf16x16(out + r * out_stride + 16 * c, _mm512_mul_ps(acc[r - r0][0], w));
                store_bf16x16(out + r * out_stride + 16 * (c + 1), _mm512_mul_ps(acc[r - r0][1], w));
            }
        }
    }
}

/* Prompt chunks attend to the cache they were just written to.
 *   q:        token t's query heads at q + t * q_stride, [hq][d]; sequence i's tokens are
 *             starts[i] .. starts[i] + lens[i] - 1, at positions contexts[i] onwards
 *   k_cache, v_cache: [slots][hkv][d], slot = block * bs + offset
 *   block_ids: [nseq][nb] each sequence's blocks, covering contexts[i] + lens[i] positions
 *   out:      token t's heads at out + t * out_stride, [hq][d]
 * Query head j reads KV head j / (hq / hkv). d % 32 == 0, d <= 128. On AMX tiles where this
 * process may use them, else on vdpbf16ps. Returns 0, or -1 when memory ran out (some rows of out
 * unwritten: the caller computes them another way). */
int dolmus_prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *block_ids, int64_t nb, const int64_t *starts, const int64_t *lens,
                             const int64_t *contexts, int64_t nseq, uint16_t *out, int64_t out_stride, int64_t hq,
                             int64_t hkv, int64_t d, int64_t bs, float scale) {
    static int amx = -1;
    if (amx < 0) amx = dolmus_amx_ready();
    int64_t group = hq / hkv, packed_values = 0, items = 0, longest = 0;
    /* per sequence: where its packed keys and values start; its first work item (nseq + 1) */
    int64_t *packed_at = malloc(sizeof(int64_t) * (size_t)(2 * nseq + 1)), *first_item = packed_at + nseq;
    if (!packed_at) return -1;
    for (int64_t i = 0; i < nseq; i++) {
        int64_t total = contexts[i] + lens[i];
        packed_at[i] = packed_values;
        packed_values += hkv * 2 * round_up(total, 32) * d;
        first_item[i] = items;
        items += hq * ((lens[i] + 15) / 16);
        if (total > longest) longest = total;
    }
    first_item[nseq] = items;
    uint16_t *packed = aligned_alloc(64, sizeof(uint16_t) * (size_t)round_up(packed_values, 32));
    if (!packed) {
        free(packed_at);
        return -1;
    }
    int failed = 0;
#pragma omp parallel
    {
        /* keys and values of each (sequence, KV head) into tile layouts */
        int64_t *pos = malloc(sizeof(int64_t) * (size_t)longest);
        if (!pos) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < nseq * hkv; w++) {
            if (!pos) continue;
            int64_t i = w / hkv, h = w % hkv, total = contexts[i] + lens[i], padded = round_up(total, 32);
            for (int64_t p = 0; p < total; p++)
                pos[p] = ((block_ids[i * nb + p / bs] * bs + p % bs) * hkv + h) * d;
            uint16_t *kp = packed + packed_at[i] + h * 2 * padded * d;
            pack_keys_values(k_cache, v_cache, pos, total, d, kp, kp + padded * d);
        }
        free(pos);
#if DOLMUS_AMX
        if (amx) configure(16);
#endif
        float *s = aligned_alloc(64, sizeof(float) * 16 * (size_t)round_up(longest, 32));
        uint16_t *pb = aligned_alloc(64, sizeof(uint16_t) * 16 * (size_t)round_up(longest, 32));
        if (!s || !pb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        /* 16 query rows of one head per item, longest rows first within a sequence */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            if (failed) continue;
            int64_t i = 0;
            while (first_item[i + 1] <= w) i++;
            int64_t local = w - first_item[i], tiles = (lens[i] + 15) / 16;
            int64_t head = local % hq, tile = tiles - 1 - local / hq, t0 = tile * 16;
            int64_t rowsn = lens[i] - t0 < 16 ? lens[i] - t0 : 16, total = contexts[i] + lens[i];
            int64_t padded = round_up(total, 32);
            const uint16_t *kp = packed + packed_at[i] + (head / group) * 2 * padded * d;
            int64_t tok = starts[i] + t0;
#if DOLMUS_AMX
            if (amx) {
                attend_rows_amx(q + tok * q_stride + head * d, q_stride, rowsn, contexts[i] + t0, kp, kp + padded * d,
                                d, scale, s, pb, out + tok * out_stride + head * d, out_stride);
                continue;
            }
#endif
            attend_rows_dp(q + tok * q_stride + head * d, q_stride, rowsn, contexts[i] + t0, kp, kp + padded * d, d,
                           scale, s, pb, out + tok * out_stride + head * d, out_stride);
        }
        free(s);
        free(pb);
#if DOLMUS_AMX
        if (amx) _tile_release();
#endif
    }
    free(packed), free(packed_at);
    return failed ? -1 : 0;
}
