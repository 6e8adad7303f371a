/* Decode attention for bf16 models on x86 CPUs with AVX-512 (BF16): one new token per
 * sequence attends to its paged keys and values in place (see __init__.py). Scores are bf16 dot
 * products with float32 sums, the values are weighed by the softmax numerators rounded to bf16,
 * as the prompt kernel (prefill_attention.c) and PyTorch's flash kernel do: it agrees with
 * float32 attention to bf16 rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

#include "bf16_simd.h"
#include "kernels.h"

/* Positions of one work item of decode attention above this many live on the heap. */
#define STACK_POSITIONS 1024

/* r[j] = sum of the 16 lanes of v[j], j < 16: a transposing tree of 15 adds (one horizontal
 * sum per score would cost ~3x as much). */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves: [8 partials of v[2i] | 8 of v[2i+1]] */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lanes: 4 partials each of v[4i .. 4i + 3] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* lane j of 128 bits: 2 partials of v[8i + j], 2 of v[8i + 4 + j] */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xDD));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    /* lane 4j + t now holds v[4t + j] */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r);
}

/* Query heads per pass over the values (registers: 2 sums of 16 floats per head and 32 values,
 * d / 32 of those, plus the two interleaved halves of a load and the heads' broadcast pairs): 4
 * for 64-element heads, 3 for the others that weigh_values takes (32, 96, 128). Seven heads in
 * one pass need 28 sums, and GCC kept some on the stack: two passes over the rows (4 + 3 heads,
 * the second from L1) were faster (24 layers of 32 sequences of 210 positions, 14 query heads
 * on 2 KV heads, in L3, a Zen 4: 3.58 -> 3.37 ms). */
#define VALUE_HEADS_64 4
#define VALUE_HEADS_128 3

/* Positions p and p + 1 (rows v0 and v1; v1 NULL: zeros) weighed by the pairs at e, heads
 * stride apart, into the sums of weigh_values. */
static inline __attribute__((always_inline)) void weigh_pair(__m512 lo[4][4], __m512 hi[4][4], const uint16_t *v0,
                                                                const uint16_t *v1, const uint16_t *e,
                                                                int64_t stride, const int H, const int64_t loads) {
    for (int64_t c = 0; c < loads; c++) {
        __m512i a = _mm512_loadu_si512((const void *)(v0 + 32 * c));
        __m512i b = v1 ? _mm512_loadu_si512((const void *)(v1 + 32 * c)) : _mm512_setzero_si512();
        __m512bh l = (__m512bh)_mm512_unpacklo_epi16(a, b), h = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < H; g++) {
            int32_t pair;
            memcpy(&pair, e + g * stride, sizeof pair);
            __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
            lo[g][c] = _mm512_dpbf16_ps(lo[g][c], w, l);
            hi[g][c] = _mm512_dpbf16_ps(hi[g][c], w, h);
        }
    }
}

/* out[g][0 .. d) = bf16(inv[g] * sum over p of e[g][p] v(p)), g < H: e the bf16 numerators of
 * the softmax (heads `stride` values apart, a zero after an odd count), inv[g] one over their
 * float32 sum; d % 32 == 0, d <= 128. The weighting is vdpbf16ps over pairs of positions: the
 * rows of positions p and p + 1 interleaved (unpacklo/hi_epi16: within each 128-bit lane, values
 * c of both rows side by side) against the pair (e[p], e[p + 1]) broadcast. One instruction
 * weighs 16 values of two rows, where float FMAs weighed 16 of one after widening them, and
 * every head of the pass weighs the pair while it is in registers (up to VALUE_HEADS_64 heads a
 * pass over the rows for 64-element heads). The lane order the interleave leaves (values 0-3 and 8-11 of
 * each 16 in the low sums, 4-7 and 12-15 in the high ones) is undone once, at the end. */
static inline __attribute__((always_inline)) void weigh_values(const uint16_t *v_cache, const int64_t *rows,
                                                                  int64_t len, const uint16_t *e, int64_t stride,
                                                                  const float *inv, const int H, const int64_t d,
                                                                  uint16_t *out) {
    const int64_t loads = d / 32;
    __m512 lo[4][4], hi[4][4];
    for (int g = 0; g < H; g++)
        for (int64_t c = 0; c < loads; c++) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 1 < len; p += 2)
        weigh_pair(lo, hi, v_cache + rows[p], v_cache + rows[p + 1], e + p, stride, H, loads);
    if (p < len) /* an odd count's last position, beside a row of zeros (its pair's second is 0) */
        weigh_pair(lo, hi, v_cache + rows[p], NULL, e + p, stride, H, loads);
    /* lanes 4t .. 4t + 3 of lo hold values 8t .. 8t + 3 of a 32-value load, of hi 8t + 4 .. 8t + 7 */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < H; g++) {
        __m512 scale = _mm512_set1_ps(inv[g]);
        for (int64_t c = 0; c < loads; c++) {
            store_bf16x16(out + g * d + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(lo[g][c], first, hi[g][c]), scale));
            store_bf16x16(out + g * d + 32 * c + 16,
                          _mm512_mul_ps(_mm512_permutex2var_ps(lo[g][c], second, hi[g][c]), scale));
        }
    }
}

/* The rows of the work item a thread takes next (dolmus_decode_attention claims it when it
 * starts the current one), asked for into L2 a few positions per 16 scored ones, so the next
 * item's first reads find them there: each item's rows are a new handful of scattered blocks,
 * and without this a thread began every item on cold misses. */
typedef struct {
    const char *k, *v;      /* the caches, as bytes */
    const int64_t *table;   /* the next item's blocks; NULL: no next item */
    int64_t bs, slot_bytes; /* positions a block; bytes of a slot (all its KV heads) */
    int64_t offset, bytes;  /* the item's heads within a slot */
    int64_t at, end;        /* positions asked for so far, and where to stop */
    int64_t per_chunk;      /* positions to ask for each 16 scored */
} next_rows;

/* Bytes of the next item's rows asked for at most. For 2,000 positions of Qwen2.5-0.5B (1 MB
 * an item) 512 KB gained less than 1 MB, and the whole item no more than 1 MB; a bound, so a
 * long context's next item cannot flood L2 past what was measured. */
#define NEXT_BYTES (1 << 20)

static inline void ask_next(next_rows *nx) {
    if (!nx->table) return;
    for (int64_t stop = nx->at + nx->per_chunk < nx->end ? nx->at + nx->per_chunk : nx->end; nx->at < stop; nx->at++) {
        int64_t slot = nx->table[nx->at / nx->bs] * nx->bs + nx->at % nx->bs;
        const char *kr = nx->k + slot * nx->slot_bytes + nx->offset, *vr = nx->v + slot * nx->slot_bytes + nx->offset;
        for (int64_t b = 0; b < nx->bytes; b += 64) {
            _mm_prefetch(kr + b, _MM_HINT_T1);
            _mm_prefetch(vr + b, _MM_HINT_T1);
        }
    }
}

/* For `count` positions (rows): their value rows, and the `ahead` bytes after their key and
 * value rows (the work item's later KV heads in the same slots); ahead < 0: nothing. */
static inline void ask_ahead(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *rows, int64_t count,
                             int64_t d, int64_t ahead) {
    if (ahead < 0) return;
    for (int64_t i = 0; i < count; i++) {
        const char *kr = (const char *)(k_cache + rows[i]), *vr = (const char *)(v_cache + rows[i]);
        for (int64_t b = 0; b < 2 * d + ahead; b += 64) {
            if (b >= 2 * d) _mm_prefetch(kr + b, _MM_HINT_T1);
            _mm_prefetch(vr + b, _MM_HINT_T1);
        }
    }
}

/* Query heads a pass of scores_by_position takes (registers: one sum of 16 positions per head
 * beside the 16 rows' transposed pairs, 32 elements of each key). */
#define SCORE_HEADS 8

/* Whether scores_by_position computes the scores (else attend, one head at a time): from 6
 * query heads a KV head (Qwen2.5's 6-8), where reading each key row once for all the heads
 * outweighs transposing it; at 2 and 3 heads the transposes cost more than the lane sums, at 4
 * (128-element heads) they broke even. */
#define BY_POSITION_GROUP 6
static inline int by_position(int64_t group, int64_t d) {
    return group >= BY_POSITION_GROUP && d % 32 == 0;
}

/* t[j] lane i = dword (bf16 pair) c + j of row i, j, i < 16: 16 rows' 16 pairs transposed in
 * four rounds of 16 shuffles (pairs of dwords, of qwords, then two of 128-bit lanes). */
static inline __attribute__((always_inline)) void transpose_pairs(const uint16_t *const kr[16], int64_t c,
                                                                     __m512i t[16]) {
    __m512i r[16], a[16], b[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(kr[i] + 2 * c));
    for (int i = 0; i < 8; i++) { /* per 128-bit lane: dwords 0, 1 (and 2, 3) of rows 2i, 2i + 1 */
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* b[4i + e], 128-bit lane L: dword 4L + e of rows 4i .. 4i + 3 */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) { /* lane L of b[4M + e] goes to lane M of t[4L + e] */
        __m512i c0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44), c1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
        __m512i c2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44), c3 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
        t[e] = _mm512_shuffle_i32x4(c0, c2, 0x88);
        t[4 + e] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
        t[8 + e] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        t[12 + e] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}

/* Positions ahead whose keys scores_by_position asks for on its first pass. Each 16 positions
 * there carry every head's dot products, so the core's reads ran ahead of them less than in
 * attend's per-head loop, whose first head reads the rows with two products each: an item whose
 * rows were not asked for before (one sequence, each thread's first item) waited on its keys.
 * One sequence of 2,000 positions, 24 layers, a Zen 4: 1.94-2.00 -> 1.45-1.61 ms, as the per-head
 * loop (1.52-1.62); 4 sequences of 2,000 7.0 -> 6.5 ms; 8 of 700 5.07 -> 4.83 ms; 16 ahead did
 * less. */
#define KEYS_AHEAD 32

/* scores[g][p] = scale * q[g] . k(p) for H <= SCORE_HEADS query heads and every position p,
 * 16 positions at a time with positions in the lanes: the 16 key rows are transposed to pairs
 * (transpose_pairs, 16 pairs of a row at a time), and each head adds vdpbf16ps(its pair
 * broadcast, the 16 rows' pair) for each pair. The rows are read and transposed once for all
 * the heads, and each sum ends in its own lane, where attend's per-head loop read each row once
 * per head and folded 16 lane sums into one (sum16). 24 layers of 8 sequences of 210
 * positions, in L2, a Zen 4: 8 heads a KV head at 128 2.41 -> 2.01 ms, 7 at 128 3.81 -> 3.26, 6
 * at 128 1.38 -> 1.27, 7 at 64 within noise; 2 and 3 heads were slower (BY_POSITION_GROUP).
 * `ahead`, nx: as attend's (ahead only on the first pass). */
static inline __attribute__((always_inline)) void scores_by_position(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *rows, int64_t len,
    const int H, const int64_t d, float scale, float *scores, int64_t ahead, next_rows *nx) {
    for (int64_t p0 = 0; p0 < len; p0 += 16) {
        int64_t count = len - p0 < 16 ? len - p0 : 16;
        ask_next(nx);
        const uint16_t *kr[16];
        for (int i = 0; i < 16; i++) kr[i] = k_cache + rows[p0 + (i < count ? i : 0)]; /* past the end: lane unused */
        ask_ahead(k_cache, v_cache, rows + p0, count, d, ahead);
        if (ahead >= 0) /* on the first pass, the keys KEYS_AHEAD positions on */
            for (int64_t i = p0 + KEYS_AHEAD; i < p0 + KEYS_AHEAD + 16 && i < len; i++)
                for (int64_t b = 0; b < 2 * d; b += 64) _mm_prefetch((const char *)(k_cache + rows[i]) + b, _MM_HINT_T0);
        __m512 acc[SCORE_HEADS];
        for (int g = 0; g < H; g++) acc[g] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d / 2; c += 16) {
            __m512i t[16];
            transpose_pairs(kr, c, t);
            for (int j = 0; j < 16; j++)
                for (int g = 0; g < H; g++) {
                    int32_t pair;
                    memcpy(&pair, q + g * d + 2 * (c + j), sizeof pair);
                    acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)t[j]);
                }
        }
        __mmask16 k = first_lanes(count);
        for (int g = 0; g < H; g++) _mm512_mask_storeu_ps(scores + g * len + p0, k, _mm512_mul_ps(acc[g], _mm512_set1_ps(scale)));
    }
}

/* scores[p] = scale * q . k(p) for one query head q and every position p, 16 positions at a
 * time: each row's dot products in lanes, folded into one score each by sum16. Returns the
 * lane-wise largest scores. `ahead`, nx: as attend's. */
static inline __attribute__((always_inline)) __m512 scores_by_head(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *rows, int64_t len,
    const int64_t d, float scale, float *scores, int64_t ahead, next_rows *nx) {
    const int64_t pairs = (d + 31) / 32;              /* zmm of bf16 pairs */
    const __mmask16 tail = d % 32 ? 0x00FF : 0xFFFF; /* d % 32 == 16: half a vector of pairs */
    __m512bh qv[16];
    for (int64_t c = 0; c < pairs; c++)
        qv[c] = (__m512bh)_mm512_maskz_loadu_epi32(c + 1 < pairs ? 0xFFFF : tail, q + 32 * c);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t p0 = 0; p0 < len; p0 += 16) {
        __m512 dots[16];
        int64_t count = len - p0 < 16 ? len - p0 : 16;
        ask_next(nx);
        ask_ahead(k_cache, v_cache, rows + p0, count, d, ahead);
        for (int i = 0; i < 16; i++) { /* past the end: position p0 again, its lane unused */
            const uint16_t *kr = k_cache + rows[p0 + (i < count ? i : 0)];
            dots[i] = _mm512_setzero_ps();
            for (int64_t c = 0; c < pairs; c++)
                dots[i] = _mm512_dpbf16_ps(dots[i], qv[c],
                                           (__m512bh)_mm512_maskz_loadu_epi32(c + 1 < pairs ? 0xFFFF : tail, kr + 32 * c));
        }
        __mmask16 k = first_lanes(count);
        __m512 s = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores + p0, k, s);
        top = _mm512_mask_max_ps(top, k, top, s);
    }
    return top;
}

/* The lane-wise largest of `len` scores. */
static inline __m512 largest(const float *scores, int64_t len) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t p0 = 0; p0 < len; p0 += 16) {
        __mmask16 k = first_lanes(len - p0);
        top = _mm512_mask_max_ps(top, k, top, _mm512_maskz_loadu_ps(k, scores + p0));
    }
    return top;
}

/* The query heads q[g][d] (bf16) sharing KV head h attend to its `len` cached positions;
 * out[g][d] gets the result. Scores are bf16 dot products (exact products, float32 sums),
 * 16 positions at a time; the values are weighed by the softmax's numerators rounded to bf16 (in
 * bf16 dot products where weigh_values takes the head size, else widened to float32) and scaled
 * by one over their float32 sum. scores: group x len floats of scratch, inv: group floats.
 * `ahead` >= 0: while the first head computes its scores, ask for each row's values and for the
 * `ahead` bytes after its key and value rows (the work item's later KV heads in the same slot);
 * -1: ask for nothing. nx: the next item's rows, a few asked for each 16 positions scored. */
static inline __attribute__((always_inline)) void attend(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *rows,
    int64_t len, int64_t group, const int64_t d, float scale, float *scores, float *inv, uint16_t *out,
    int64_t ahead, next_rows *nx) {
    const int64_t chunks = d / 16; /* zmm of 16 floats */
    const int by_pos = by_position(group, d);
    if (by_pos)
        for (int64_t g = 0; g < group; g += SCORE_HEADS) {
            int64_t h = group - g < SCORE_HEADS ? group - g : SCORE_HEADS;
            const uint16_t *qg = q + g * d;
            float *sg = scores + g * len;
            int64_t pf = g == 0 ? ahead : -1;
            switch (h) {
            case 1: scores_by_position(qg, k_cache, v_cache, rows, len, 1, d, scale, sg, pf, nx); break;
            case 2: scores_by_position(qg, k_cache, v_cache, rows, len, 2, d, scale, sg, pf, nx); break;
            case 3: scores_by_position(qg, k_cache, v_cache, rows, len, 3, d, scale, sg, pf, nx); break;
            case 4: scores_by_position(qg, k_cache, v_cache, rows, len, 4, d, scale, sg, pf, nx); break;
            case 5: scores_by_position(qg, k_cache, v_cache, rows, len, 5, d, scale, sg, pf, nx); break;
            case 6: scores_by_position(qg, k_cache, v_cache, rows, len, 6, d, scale, sg, pf, nx); break;
            case 7: scores_by_position(qg, k_cache, v_cache, rows, len, 7, d, scale, sg, pf, nx); break;
            default: scores_by_position(qg, k_cache, v_cache, rows, len, 8, d, scale, sg, pf, nx); break;
            }
        }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * len;
        __m512 top = by_pos ? largest(sg, len)
                            : scores_by_head(q + g * d, k_cache, v_cache, rows, len, d, scale, sg, g == 0 ? ahead : -1, nx);
        /* the numerators e = exp(s - max) rounded to bf16, in place of the scores (each store
         * lands on scores already read), a zero after an odd count, and one over their float32
         * sum: out = bf16(e) . v / sum(e), prefill_attention.c's order (and PyTorch's flash kernel's) */
        uint16_t *eg = (uint16_t *)sg;
        __m512 sum = _mm512_setzero_ps(), m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        for (int64_t p0 = 0; p0 < len; p0 += 16) {
            __mmask16 k = first_lanes(len - p0);
            __m512 e = _mm512_maskz_mov_ps(k, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + p0), m)));
            sum = _mm512_add_ps(sum, e);
            _mm256_mask_storeu_epi16(eg + p0, k, (__m256i)_mm512_cvtneps_pbh(e));
        }
        if (len % 2) eg[len] = 0;
        float total = _mm512_reduce_add_ps(sum);
        inv[g] = total > 0 ? 1.0f / total : 0.0f; /* no positions: zeros, as before */
    }
    if (d % 32 == 0 && d <= 128) { /* weighted values, several heads per pass over the rows */
        const int most = d == 64 ? VALUE_HEADS_64 : VALUE_HEADS_128;
        for (int64_t g = 0; g < group;) {
            int64_t h = group - g < most ? group - g : most;
            const uint16_t *eg = (const uint16_t *)(scores + g * len); /* heads 2 len apart */
            uint16_t *og = out + g * d;
            switch (h) {
            case 1: weigh_values(v_cache, rows, len, eg, 2 * len, inv + g, 1, d, og); break;
            case 2: weigh_values(v_cache, rows, len, eg, 2 * len, inv + g, 2, d, og); break;
            case 3: weigh_values(v_cache, rows, len, eg, 2 * len, inv + g, 3, d, og); break;
            default: weigh_values(v_cache, rows, len, eg, 2 * len, inv + g, 4, d, og); break;
            }
            g += h;
        }
        return;
    }
    for (int64_t g = 0; g < group; g += 2) { /* other head sizes: two heads per pass */
        int64_t two = group - g >= 2;
        const uint16_t *e0 = (const uint16_t *)(scores + g * len), *e1 = (const uint16_t *)(scores + (g + two) * len);
        __m512 acc0[16], acc1[16];
        for (int64_t c = 0; c < chunks; c++) acc0[c] = acc1[c] = _mm512_setzero_ps();
        for (int64_t p = 0; p < len; p++) {
            const uint16_t *vr = v_cache + rows[p];
            union { uint32_t u; float f; } x0 = {(uint32_t)e0[p] << 16}, x1 = {(uint32_t)e1[p] << 16};
            __m512 w0 = _mm512_set1_ps(x0.f), w1 = _mm512_set1_ps(x1.f);
            for (int64_t c = 0; c < chunks; c++) {
                __m512 v = load_bf16x16(vr + 16 * c);
                acc0[c] = _mm512_fmadd_ps(w0, v, acc0[c]);
                acc1[c] = _mm512_fmadd_ps(w1, v, acc1[c]);
            }
        }
        __m512 i0 = _mm512_set1_ps(inv[g]), i1 = _mm512_set1_ps(inv[g + two]);
        for (int64_t c = 0; c < chunks; c++) {
            store_bf16x16(out + g * d + 16 * c, _mm512_mul_ps(acc0[c], i0));
            if (two) store_bf16x16(out + (g + 1) * d + 16 * c, _mm512_mul_ps(acc1[c], i1));
        }
    }
}

/* The positions sequence s attends: [*first, *first + len), len returned. */
static inline int64_t attended(const int64_t *lengths, int64_t s, int64_t window, int64_t *first) {
    int64_t end = lengths[s];
    *first = window > 0 && end > window ? end - window : 0;
    return end - *first;
}

/* Work item `item` (sequence item / parts, its KV heads from item % parts * per_item); `next`:
 * the item this thread takes after it, whose rows it asks for meanwhile (-1: none). */
static void attend_item(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                        const int64_t *block_ids, int64_t nb, const int64_t *lengths, uint16_t *out, int64_t hq,
                        int64_t hkv, int64_t d, int64_t bs, float scale, int64_t window, int64_t per_item,
                        int64_t item, int64_t next) {
    int64_t group = hq / hkv, parts = hkv / per_item;
    int64_t s = item / parts, h0 = item % parts * per_item, first;
    int64_t len = attended(lengths, s, window, &first);
    next_rows nx = {(const char *)k_cache, (const char *)v_cache, NULL, bs, hkv * d * 2, 0, per_item * d * 2, 0, 0, 0};
    if (next >= 0) { /* spread over every 16 positions this item scores, for each head and score pass */
        int64_t ns = next / parts, nfirst, nlen = attended(lengths, ns, window, &nfirst);
        int64_t passes = (by_position(group, d) ? (group + SCORE_HEADS - 1) / SCORE_HEADS : group) * per_item;
        int64_t calls = (len + 15) / 16 * passes;
        nx.table = block_ids + ns * nb;
        nx.offset = next % parts * per_item * d * 2;
        nx.at = nfirst;
        int64_t most = NEXT_BYTES / (2 * nx.bytes); /* positions: a key and a value row each */
        nx.end = nfirst + (nlen < most ? nlen : most);
        nx.per_chunk = calls ? (nx.end - nx.at + calls - 1) / calls : 0;
    }
    /* per position: its row's offset in the caches, then each query head's score, then one
     * over each head's softmax sum */
    int64_t stack[STACK_POSITIONS * 9 + 8];
    size_t words = (size_t)(len + (group * len + group + 1) / 2);
    int64_t *rows = len <= STACK_POSITIONS && group <= 16 ? stack : malloc(sizeof(int64_t) * words);
    if (!rows) return;
    const int64_t *table = block_ids + s * nb;
    for (int64_t h = h0; h < h0 + per_item; h++) {
        /* the first head asks for its values, and for the item's other heads' keys and
         * values, while it computes its scores: the same slots, on pages its own reads just
         * brought into the TLB. Blocks are scattered, and each block's rows were a cold
         * stream that every head met in turn (24 layers of 32 sequences of 190 positions,
         * blocks shuffled, a Zen 4: 7.7-11 -> 6.7-7.4 ms; asking for the next rows' keys
         * too was no faster there, though scores_by_position needs it: KEYS_AHEAD). Long contexts too, though their rows outgrow L2 before their
         * use (L3 still has them): 2,000 positions 103-110 -> 88-89 ms */
        int64_t ahead = h == h0 ? 2 * d * (per_item - 1) : -1;
        for (int64_t p = 0, b = first / bs, i = first % bs; p < len; p++) {
            rows[p] = ((table[b] * bs + i) * hkv + h) * d;
            if (++i == bs) i = 0, b++;
        }
        float *scores = (float *)(rows + len), *inv = scores + group * len;
        const uint16_t *qs = q + s * q_stride + h * group * d;
        uint16_t *o = out + (s * hq + h * group) * d;
        if (d == 64) /* the common head sizes, with constant loop bounds */
            attend(qs, k_cache, v_cache, rows, len, group, 64, scale, scores, inv, o, ahead, &nx);
        else if (d == 128)
            attend(qs, k_cache, v_cache, rows, len, group, 128, scale, scores, inv, o, ahead, &nx);
        else
            attend(qs, k_cache, v_cache, rows, len, group, d, scale, scores, inv, o, ahead, &nx);
    }
    if (rows != stack) free(rows);
}

/* One new token per sequence attends to its cached keys and values (its own included).
 *   q:        token s's query heads at q + s * q_stride, [hq][d]
 *   k_cache, v_cache: [slots][hkv][d], slot = block * bs + offset
 *   block_ids: [n][nb] each sequence's blocks; lengths: [n] positions to attend
 *   out:      [n][hq][d]
 *   window:   > 0: only the last `window` of those positions (sliding-window attention; the
 *             blocks before them are never read, and may belong to other sequences by now)
 * Query head j reads KV head j / (hq / hkv). Work items are a sequence's KV heads (all of them
 * when there are sequences enough to share between the threads, else one each), so the query
 * heads sharing a KV head read its keys while they are in cache, and a cache line holding two
 * KV heads' rows (64-element heads: 128 bytes each, next to each other in a slot) is read from
 * memory once: one head per item read each line twice, from two cores at two times (24 layers
 * of 32 sequences of 190 positions, Qwen2.5-0.5B's 2 KV heads, caches out of cache: 5.3 -> 5.0
 * ms; 64 sequences of 256: 14.9 -> 13.6 ms).
 * Each thread starts on the item of its own number, claims its next item as it starts one and
 * asks for that item's rows while it works (ask_next), so only a thread's first item starts on
 * cold misses: 24 layers of 32 sequences of 210 positions, blocks as the engine hands them out,
 * a Zen 4: 7.4-8.5 -> 5.1-5.8 ms; of 700 positions 24-25 -> 17.5-19.8 ms; of 2,000 78-83 ->
 * 60-64 ms. A claimed item waits for its thread: the last items can leave a thread idle for up
 * to one item's time.
 * d % 16 == 0, d <= 256. */
void dolmus_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int64_t *block_ids, int64_t nb,
                             const int64_t *lengths, uint16_t *out, int64_t n, int64_t hq,
                             int64_t hkv, int64_t d, int64_t bs, float scale, int64_t window) {
    int64_t claimed = 0; /* items past the threads' first ones handed out, each claimed by a thread
                          * as it starts its previous one */
    int64_t items = n * hkv; /* at most: whether a thread has an item to take is its share's business */
#pragma omp parallel if (items > 1)
    team_decode_attention(q, q_stride, k_cache, v_cache, block_ids, nb, lengths, out, n, hq, hkv, d, bs, scale,
                          window, &claimed, omp_get_thread_num(), omp_get_num_threads());
}

/* Thread t of T's items (the API above, and decode_step.c's one-region step; kernels.h). */
void team_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int64_t *block_ids, int64_t nb,
                           const int64_t *lengths, uint16_t *out, int64_t n, int64_t hq, int64_t hkv,
                           int64_t d, int64_t bs, float scale, int64_t window, int64_t *claimed, int t, int T) {
    int64_t per_item = n >= 4 * T ? hkv : 1; /* KV heads per work item */
    int64_t items = n * (hkv / per_item);
    /* each thread's first item is its own number: claimed from the counter, two threads'
     * back-to-back claims could give one thread both of a batch-1 step's two items */
    int64_t item = t;
    while (item < items) {
        int64_t next = T + __atomic_fetch_add(claimed, 1, __ATOMIC_RELAXED);
        attend_item(q, q_stride, k_cache, v_cache, block_ids, nb, lengths, out, hq, hkv, d, bs, scale, window,
                    per_item, item, next < items ? next : -1);
        item = next;
    }
}

