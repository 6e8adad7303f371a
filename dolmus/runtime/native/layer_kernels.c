/* RMSNorm, SiLU-and-multiply, rotary embedding and decode attention for bf16 models on x86
 * CPUs with AVX-512 (BF16).
 *
 * Each replaces several small PyTorch ops per layer and token (see __init__.py). They
 * compute in float32 and round to bf16 where PyTorch's bf16 code rounds, so the elementwise
 * kernels give PyTorch's bits (up to the order of one float sum in RMSNorm, and our exp against
 * PyTorch's own in SiLU) and attention agrees to bf16 rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

#include "bf16_simd.h"

/* out = weight * bf16(x * rsqrt(mean(x^2) + eps)) for one row: transformers' order (statistics
 * in float32, the normalized row rounded to bf16, then the weight). cols % 16 == 0. */
static inline void norm_row(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t cols, float eps) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += 16) {
        __m512 v = load_bf16x16(x + c);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)cols + eps));
    for (int64_t c = 0; c < cols; c += 16) {
        __m512 normed = round_to_bf16(_mm512_mul_ps(load_bf16x16(x + c), inv));
        store_bf16x16(out + c, _mm512_mul_ps(normed, load_bf16x16(weight + c)));
    }
}

/* RMSNorm of each row (norm_row). */
void dolmus_rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows,
                     int64_t cols, float eps) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * cols, weight, out + r * cols, cols, eps);
}

/* A layer's residual add and the next RMSNorm in one pass: residual = bf16(residual + x) in
 * place, then out = RMSNorm(residual), each row while it is in L1. The same bits as PyTorch's
 * bf16 add followed by dolmus_rms_norm; one read of the stream fewer, and no new tensor for the
 * sum. cols % 16 == 0. */
void dolmus_add_rms_norm(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                         int64_t rows, int64_t cols, float eps) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *res = residual + r * cols;
        for (int64_t c = 0; c < cols; c += 16)
            store_bf16x16(res + c, _mm512_add_ps(load_bf16x16(res + c), load_bf16x16(x + r * cols + c)));
        norm_row(res, weight, out + r * cols, cols, eps);
    }
}

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

static inline __mmask16 first_lanes(int64_t count) {
    return count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
}

/* Query heads per pass over the values (registers: 2 sums of 16 floats per head and 32 values,
 * d / 32 of those, plus the two interleaved halves of a load and the heads' broadcast pairs): 7
 * for 64-element heads, 3 for the others that weigh_values takes (32, 96, 128). */
#define VALUE_HEADS_64 7
#define VALUE_HEADS_128 3

/* Positions p and p + 1 (rows v0 and v1; v1 NULL: zeros) weighed by the pairs at e, heads
 * stride apart, into the sums of weigh_values. */
static inline __attribute__((always_inline)) void weigh_pair(__m512 lo[7][4], __m512 hi[7][4], const uint16_t *v0,
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
 * every head of the pass weighs the pair while it is in registers (Qwen2.5-0.5B's 7 heads a KV
 * head in one pass over the rows). The lane order the interleave leaves (values 0-3 and 8-11 of
 * each 16 in the low sums, 4-7 and 12-15 in the high ones) is undone once, at the end. */
static inline __attribute__((always_inline)) void weigh_values(const uint16_t *v_cache, const int64_t *rows,
                                                                  int64_t len, const uint16_t *e, int64_t stride,
                                                                  const float *inv, const int H, const int64_t d,
                                                                  uint16_t *out) {
    const int64_t loads = d / 32;
    __m512 lo[7][4], hi[7][4];
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

/* The query heads q[g][d] (bf16) sharing KV head h attend to its `len` cached positions;
 * out[g][d] gets the result. Scores are bf16 dot products (exact products, float32 sums),
 * 16 positions at a time; the values are weighed by the softmax's numerators rounded to bf16 (in
 * bf16 dot products where weigh_values takes the head size, else widened to float32) and scaled
 * by one over their float32 sum. scores: group x len floats of scratch, inv: group floats.
 * `ahead` >= 0: while the first head computes its scores, ask for each row's values and for the
 * `ahead` bytes after its key and value rows (the work item's later KV heads in the same slot);
 * -1: ask for nothing. */
static inline __attribute__((always_inline)) void attend(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *rows,
    int64_t len, int64_t group, const int64_t d, float scale, float *scores, float *inv, uint16_t *out,
    int64_t ahead) {
    const int64_t pairs = (d + 31) / 32, chunks = d / 16; /* zmm of bf16 pairs; of 16 floats */
    const __mmask16 tail = d % 32 ? 0x00FF : 0xFFFF;      /* d % 32 == 16: half a vector of pairs */
    for (int64_t g = 0; g < group; g++) {
        __m512bh qv[16];
        for (int64_t c = 0; c < pairs; c++)
            qv[c] = (__m512bh)_mm512_maskz_loadu_epi32(c + 1 < pairs ? 0xFFFF : tail, q + g * d + 32 * c);
        float *sg = scores + g * len;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t p0 = 0; p0 < len; p0 += 16) {
            __m512 dots[16];
            int64_t count = len - p0 < 16 ? len - p0 : 16;
            if (g == 0 && ahead >= 0) /* this group's values, and the item's later heads' keys and values */
                for (int i = 0; i < count; i++) {
                    const char *kr = (const char *)(k_cache + rows[p0 + i]), *vr = (const char *)(v_cache + rows[p0 + i]);
                    for (int64_t b = 0; b < 2 * d + ahead; b += 64) {
                        if (b >= 2 * d) _mm_prefetch(kr + b, _MM_HINT_T1);
                        _mm_prefetch(vr + b, _MM_HINT_T1);
                    }
                }
            for (int i = 0; i < 16; i++) { /* past the end: position p0 again, its lane unused */
                const uint16_t *kr = k_cache + rows[p0 + (i < count ? i : 0)];
                dots[i] = _mm512_setzero_ps();
                for (int64_t c = 0; c < pairs; c++)
                    dots[i] = _mm512_dpbf16_ps(
                        dots[i], qv[c],
                        (__m512bh)_mm512_maskz_loadu_epi32(c + 1 < pairs ? 0xFFFF : tail, kr + 32 * c));
            }
            __mmask16 k = first_lanes(count);
            __m512 s = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(sg + p0, k, s);
            top = _mm512_mask_max_ps(top, k, top, s);
        }
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
            case 4: weigh_values(v_cache, rows, len, eg, 2 * len, inv + g, 4, d, og); break;
            case 5: weigh_values(v_cache, rows, len, eg, 2 * len, inv + g, 5, d, og); break;
            case 6: weigh_values(v_cache, rows, len, eg, 2 * len, inv + g, 6, d, og); break;
            default: weigh_values(v_cache, rows, len, eg, 2 * len, inv + g, 7, d, og); break;
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
 * d % 16 == 0, d <= 256. */
void dolmus_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int64_t *block_ids, int64_t nb,
                             const int64_t *lengths, uint16_t *out, int64_t n, int64_t hq,
                             int64_t hkv, int64_t d, int64_t bs, float scale, int64_t window) {
    int64_t group = hq / hkv;
    int64_t per_item = n >= 4 * omp_get_max_threads() ? hkv : 1; /* KV heads per work item */
    int64_t parts = hkv / per_item; /* work items per sequence */
#pragma omp parallel for schedule(dynamic, 1) if (n * parts > 1)
    for (int64_t item = 0; item < n * parts; item++) {
        int64_t s = item / parts, h0 = item % parts * per_item, end = lengths[s];
        int64_t first = window > 0 && end > window ? end - window : 0, len = end - first;
        /* per position: its row's offset in the caches, then each query head's score, then one
         * over each head's softmax sum */
        int64_t stack[STACK_POSITIONS * 9 + 8];
        size_t words = (size_t)(len + (group * len + group + 1) / 2);
        int64_t *rows = len <= STACK_POSITIONS && group <= 16 ? stack : malloc(sizeof(int64_t) * words);
        if (!rows) continue;
        const int64_t *table = block_ids + s * nb;
        for (int64_t h = h0; h < h0 + per_item; h++) {
            /* the first head asks for its values, and for the item's other heads' keys and
             * values, while it computes its scores: the same slots, on pages its own reads just
             * brought into the TLB. Blocks are scattered, and each block's rows were a cold
             * stream that every head met in turn (24 layers of 32 sequences of 190 positions,
             * blocks shuffled, a Zen 4: 7.7-11 -> 6.7-7.4 ms; asking for the next rows' keys
             * too was no faster). Long contexts too, though their rows outgrow L2 before their
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
                attend(qs, k_cache, v_cache, rows, len, group, 64, scale, scores, inv, o, ahead);
            else if (d == 128)
                attend(qs, k_cache, v_cache, rows, len, group, 128, scale, scores, inv, o, ahead);
            else
                attend(qs, k_cache, v_cache, rows, len, group, d, scale, scores, inv, o, ahead);
        }
        if (rows != stack) free(rows);
    }
}

uint16_t dolmus_silu_table[65536 + 1];

/* Fills dolmus_silu_table (bf16_simd.h) when the library loads, 16 entries at a time. */
__attribute__((constructor)) static void fill_silu_table(void) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int b = 0; b < 65536; b += 16) {
        __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_set1_epi32(b), lanes), 16));
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
        store_bf16x16(dolmus_silu_table + b, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    }
}

/* out = bf16(silu(gate)) * up, rounded to bf16: PyTorch's bf16 order. x: [rows][2 * cols]
 * (gate, then up, as the fused gate/up projection emits them); out: [rows][cols].
 * cols % 16 == 0. Work goes in spans of 512 columns, so one wide row can use both cores. */
void dolmus_silu_and_mul(const uint16_t *x, uint16_t *out, int64_t rows, int64_t cols) {
    int64_t spans = (cols + 511) / 512;
#pragma omp parallel for schedule(static) if (rows * cols >= 16384)
    for (int64_t item = 0; item < rows * spans; item++) {
        int64_t r = item / spans, c0 = item % spans * 512, c1 = c0 + 512 < cols ? c0 + 512 : cols;
        const uint16_t *gate = x + r * 2 * cols, *up = gate + cols;
        for (int64_t c = c0; c < c1; c += 16) {
            store_bf16x16(out + r * cols + c, silu_and_mul_ps(load_bf16x16(gate + c), load_bf16x16(up + c)));
        }
    }
}

/* In place: x = x * cos + rotate_half(x) * sin with each product and the sum rounded to bf16
 * (PyTorch's bf16 order); rotate_half(x) = (-x[d/2:], x[:d/2]). x: [tokens][heads][d] at
 * token stride x_stride; cos, sin: [tokens][d]. d % 32 == 0. */
void dolmus_rotary(uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
                   int64_t tokens, int64_t heads, int64_t d) {
    int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (tokens > 16)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *ct = cos + t * d, *st = sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *row = x + t * x_stride + h * d;
            for (int64_t i = 0; i < half; i += 16) {
                __m512 a = load_bf16x16(row + i), b = load_bf16x16(row + half + i);
                __m512 lo = _mm512_add_ps(round_to_bf16(_mm512_mul_ps(a, load_bf16x16(ct + i))),
                                          round_to_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b),
                                                                      load_bf16x16(st + i))));
                __m512 hi = _mm512_add_ps(round_to_bf16(_mm512_mul_ps(b, load_bf16x16(ct + half + i))),
                                          round_to_bf16(_mm512_mul_ps(a, load_bf16x16(st + half + i))));
                store_bf16x16(row + i, lo);
                store_bf16x16(row + half + i, hi);
            }
        }
    }
}
