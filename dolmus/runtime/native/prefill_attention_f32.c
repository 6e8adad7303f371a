/* Prompt (prefill) attention over the paged KV cache for float32 models on AVX2 + FMA: the
 * layout and contract of prefill_attention.c (the bf16 kernel for AMX and AVX-512 BF16), in
 * float32, for the CPUs where models run in float32.
 *
 * PyTorch's SDPA ran a 512-token chunk of a 0.5B model (14 query heads, 2 KV heads, head size
 * 64) at 66-106 GFLOP/s on an AVX2-only AMD EPYC, after the chunk's cached context had been
 * gathered out of the cache, and over the whole rectangle of a chunk that follows context (a
 * mask, not its causal path); ~17% of a 2,048-token prompt's time. Here each sequence's keys are
 * first copied out of the cache, per KV head, into tiles of 16 keys ([tile][d][16]: one input of
 * 16 keys is two registers); the values are read where they are. A work item is a few tokens
 * of a sequence by the query heads of one KV head (about 48 rows that read the same keys). It
 * passes over the keys its rows may see in blocks of KEY_BLOCK, as flash attention does:
 *
 *   s = (q . k) * scale, causal (row t of a chunk after `context` cached tokens sees keys
 *   0 .. context + t); per block m' = max(m, max s), l = l e^(m - m') + sum e^(s - m'),
 *   o = o e^(m - m') + sum e^(s - m') v; at the end o / l.
 *
 * Scores and weighted values run as register blocks of up to 6 rows by 16 keys (or 16 value
 * columns), 12 sums, as in bf16_weights_f32.c. Blocks start at key 0 and every KEY_BLOCK keys
 * whatever the chunk, and a row's sums run in key order, so a row's result does not depend on
 * how its prompt was chunked or which rows shared its item.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "exp_avx2.h"
#include "kernels_f32.h"

#define ROWS 6          /* rows per register block: 12 sums */
#define KEY_BLOCK 128   /* keys per pass: an item's scores stay in L1 / L2 */
#define ITEM_ROWS 48    /* rows per work item, about: tokens x query heads of one KV head */

static inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

/* Keys [0, total) of one KV head (rows: each position's offset in the cache) -> kt [tile][d][16],
 * padding keys zero. */
static void pack_keys(const float *k_cache, const int64_t *rows, int64_t total, int64_t d, float *kt) {
    int64_t padded = round16(total);
    for (int64_t p = 0; p < padded; p++) {
        float *tile = kt + (p / 16) * d * 16 + p % 16;
        if (p < total) {
            const float *src = k_cache + rows[p];
            for (int64_t j = 0; j < d; j++) tile[j * 16] = src[j];
        } else {
            for (int64_t j = 0; j < d; j++) tile[j * 16] = 0.0f;
        }
    }
}

/* Scores of R rows (q[r] their queries) against `tiles` tiles of 16 keys from kt -> s (rows ld
 * apart). */
static inline __attribute__((always_inline)) void score_rows(const float **q, const int R, const float *kt,
                                                                int64_t tiles, int64_t d, float *s, int64_t ld) {
    for (int64_t t = 0; t < tiles; t++) {
        const float *kk = kt + t * d * 16;
        __m256 acc[ROWS][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j++) {
            __m256 a = _mm256_loadu_ps(kk + j * 16), b = _mm256_loadu_ps(kk + j * 16 + 8);
            for (int r = 0; r < R; r++) {
                __m256 x = _mm256_broadcast_ss(q[r] + j);
                acc[r][0] = _mm256_fmadd_ps(x, a, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(x, b, acc[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(s + r * ld + 16 * t, acc[r][0]);
            _mm256_storeu_ps(s + r * ld + 16 * t + 8, acc[r][1]);
        }
    }
}

/* o[r] (rows d apart) += sum over keys k < count of p[r][k] (rows ld apart) v[k], R rows, all
 * d columns, 16 at a time. */
static inline __attribute__((always_inline)) void weigh_values(const float *p, int64_t ld, const int R,
                                                                  const float **v, int64_t count, int64_t d,
                                                                  float *o) {
    for (int64_t c = 0; c < d; c += 16) {
        __m256 acc[ROWS][2];
        for (int r = 0; r < R; r++) {
            acc[r][0] = _mm256_loadu_ps(o + r * d + c);
            acc[r][1] = _mm256_loadu_ps(o + r * d + c + 8);
        }
        for (int64_t k = 0; k < count; k++) {
            __m256 a = _mm256_loadu_ps(v[k] + c), b = _mm256_loadu_ps(v[k] + c + 8);
            for (int r = 0; r < R; r++) {
                __m256 x = _mm256_broadcast_ss(p + r * ld + k);
                acc[r][0] = _mm256_fmadd_ps(x, a, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(x, b, acc[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(o + r * d + c, acc[r][0]);
            _mm256_storeu_ps(o + r * d + c + 8, acc[r][1]);
        }
    }
}

/* Row r's scores of one key block (s, `count` keys from key `first`, `visible` of them seen by
 * the row) -> their weights e^(s scale - m') in place (zero past `visible`, up to `width`), with
 * the row's running largest score *m and sum *l updated; returns e^(m - m') for its values. */
static float weigh_scores(float *s, int64_t visible, int64_t width, float scale, float *m, float *l) {
    __m256 sc = _mm256_set1_ps(scale), top = _mm256_set1_ps(-INFINITY);
    int64_t k = 0;
    for (; k + 8 <= visible; k += 8) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + k), sc);
        _mm256_storeu_ps(s + k, x);
        top = _mm256_max_ps(top, x);
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
    for (; k < visible; k++) {
        s[k] *= scale;
        best = s[k] > best ? s[k] : best;
    }
    float next = best > *m ? best : *m, alpha = expf(*m - next); /* e^-inf = 0 on the first block */
    float total = exp_sub_sum(s, visible, next);
    for (; k < width; k++) s[k] = 0.0f; /* k == visible here */
    *m = next;
    *l = *l * alpha + total;
    return alpha;
}

/* One work item: rows [0, n) are tokens t0 + r / group of sequence i by query heads h group +
 * r % group, all reading KV head h (its packed keys kt); the token at chunk offset t sits at
 * position context + t. */
static void attend_item(const float *q, int64_t q_stride, const float *v_cache, const int64_t *table, int64_t bs,
                        int64_t hkv, int64_t h, int64_t group, int64_t start, int64_t context, int64_t t0,
                        int64_t n, const float *kt, int64_t d, float scale, float *out, int64_t out_stride,
                        float *s, float *o, float *m, float *l, const float **qrow, const float **vrow) {
    for (int64_t r = 0; r < n; r++) {
        qrow[r] = q + (start + t0 + r / group) * q_stride + (h * group + r % group) * d;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)(n * d));
    int64_t last = context + t0 + (n - 1) / group; /* the last row's position */
    for (int64_t k0 = 0; k0 <= last; k0 += KEY_BLOCK) {
        int64_t count = last + 1 - k0 < KEY_BLOCK ? last + 1 - k0 : KEY_BLOCK;
        for (int64_t k = 0; k < count; k++) {
            int64_t p = k0 + k, slot = table[p / bs] * bs + p % bs;
            vrow[k] = v_cache + (slot * hkv + h) * d;
        }
        const float *kb = kt + k0 * d;
        for (int64_t r0 = 0; r0 < n; r0 += ROWS) {
            int R = n - r0 < ROWS ? (int)(n - r0) : ROWS;
            /* keys this block of rows may see: up to its last row's position */
            int64_t seen = context + t0 + (r0 + R - 1) / group + 1 - k0;
            if (seen <= 0) continue; /* every row of the block is before this key block */
            int64_t width = round16(seen < count ? seen : count), tiles = width / 16;
            float *sr = s + r0 * KEY_BLOCK;
            switch (R) {
            case 1: score_rows(qrow + r0, 1, kb, tiles, d, sr, KEY_BLOCK); break;
            case 2: score_rows(qrow + r0, 2, kb, tiles, d, sr, KEY_BLOCK); break;
            case 3: score_rows(qrow + r0, 3, kb, tiles, d, sr, KEY_BLOCK); break;
            case 4: score_rows(qrow + r0, 4, kb, tiles, d, sr, KEY_BLOCK); break;
            case 5: score_rows(qrow + r0, 5, kb, tiles, d, sr, KEY_BLOCK); break;
            default: score_rows(qrow + r0, ROWS, kb, tiles, d, sr, KEY_BLOCK); break;
            }
            for (int r = 0; r < R; r++) {
                int64_t row = r0 + r, visible = context + t0 + row / group + 1 - k0;
                visible = visible < 0 ? 0 : visible > count ? count : visible;
                float alpha = weigh_scores(sr + r * KEY_BLOCK, visible, width, scale, m + row, l + row);
                if (alpha != 1.0f) {
                    __m256 a = _mm256_set1_ps(alpha);
                    for (int64_t c = 0; c < d; c += 8)
                        _mm256_storeu_ps(o + row * d + c, _mm256_mul_ps(_mm256_loadu_ps(o + row * d + c), a));
                }
            }
            int64_t keys = seen < count ? seen : count;
            float *orow = o + r0 * d;
            switch (R) {
            case 1: weigh_values(sr, KEY_BLOCK, 1, vrow, keys, d, orow); break;
            case 2: weigh_values(sr, KEY_BLOCK, 2, vrow, keys, d, orow); break;
            case 3: weigh_values(sr, KEY_BLOCK, 3, vrow, keys, d, orow); break;
            case 4: weigh_values(sr, KEY_BLOCK, 4, vrow, keys, d, orow); break;
            case 5: weigh_values(sr, KEY_BLOCK, 5, vrow, keys, d, orow); break;
            default: weigh_values(sr, KEY_BLOCK, ROWS, vrow, keys, d, orow); break;
            }
        }
    }
    for (int64_t r = 0; r < n; r++) {
        float *dst = out + (start + t0 + r / group) * out_stride + (h * group + r % group) * d;
        __m256 inv = _mm256_set1_ps(1.0f / l[r]);
        for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_loadu_ps(o + r * d + c), inv));
    }
}

/* Prompt chunks attend to the cache they were just written to: dolmus_prefill_attention's
 * arguments, in float32 (q, caches, out). d % 16 == 0. Returns 0, or -1 when memory ran out
 * (some rows of out unwritten: the caller computes them another way). */
int dolmus_prefill_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                 const int64_t *block_ids, int64_t nb, const int64_t *starts, const int64_t *lens,
                                 const int64_t *contexts, int64_t nseq, float *out, int64_t out_stride, int64_t hq,
                                 int64_t hkv, int64_t d, int64_t bs, float scale) {
    int64_t group = hq / hkv, tokens = ITEM_ROWS / group > 1 ? ITEM_ROWS / group : 1, rows = tokens * group;
    int64_t packed_floats = 0, items = 0, longest = 0;
    /* per sequence: where its packed keys start; its first work item (nseq + 1) */
    int64_t *packed_at = malloc(sizeof(int64_t) * (size_t)(2 * nseq + 1)), *first_item = packed_at + nseq;
    if (!packed_at) return -1;
    for (int64_t i = 0; i < nseq; i++) {
        int64_t total = contexts[i] + lens[i];
        packed_at[i] = packed_floats;
        packed_floats += hkv * round16(total) * d;
        first_item[i] = items;
        items += hkv * ((lens[i] + tokens - 1) / tokens);
        if (total > longest) longest = total;
    }
    first_item[nseq] = items;
    float *packed = aligned_alloc(64, sizeof(float) * (size_t)round16(packed_floats));
    if (!packed) {
        free(packed_at);
        return -1;
    }
    int failed = 0;
#pragma omp parallel
    {
        int64_t *pos = malloc(sizeof(int64_t) * (size_t)longest);
        if (!pos) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < nseq * hkv; w++) {
            if (!pos) continue;
            int64_t i = w / hkv, h = w % hkv, total = contexts[i] + lens[i];
            for (int64_t p = 0; p < total; p++) pos[p] = ((block_ids[i * nb + p / bs] * bs + p % bs) * hkv + h) * d;
            pack_keys(k_cache, pos, total, d, packed + packed_at[i] + h * round16(total) * d);
        }
        free(pos);
        /* per thread: scores, weighted values, running maxima and sums, row and value addresses
         * (aligned_alloc takes a multiple of its alignment) */
        float *s = aligned_alloc(64, sizeof(float) * (size_t)round16(rows * (KEY_BLOCK + d + 2)));
        const float **addr = malloc(sizeof(float *) * (size_t)(rows + KEY_BLOCK));
        if (!s || !addr) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        /* a sequence's last tokens (the most keys) first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            if (failed) continue;
            int64_t i = 0;
            while (first_item[i + 1] <= w) i++;
            int64_t local = w - first_item[i], spans = (lens[i] + tokens - 1) / tokens;
            int64_t h = local % hkv, t0 = (spans - 1 - local / hkv) * tokens;
            int64_t n = (lens[i] - t0 < tokens ? lens[i] - t0 : tokens) * group;
            const float *kt = packed + packed_at[i] + h * round16(contexts[i] + lens[i]) * d;
            float *o = s + rows * KEY_BLOCK, *m = o + rows * d, *l = m + rows;
            attend_item(q, q_stride, v_cache, block_ids + i * nb, bs, hkv, h, group, starts[i], contexts[i], t0, n,
                        kt, d, scale, out, out_stride, s, o, m, l, addr, addr + rows);
        }
        free(s);
        free(addr);
    }
    free(packed), free(packed_at);
    return failed ? -1 : 0;
}
