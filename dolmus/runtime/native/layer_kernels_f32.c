/* RMSNorm, SiLU-and-multiply, rotary embedding and decode attention for float32 models on x86
 * CPUs with AVX2 and FMA: layer_kernels.c's and decode_attention.c's functions for CPUs without
 * AVX-512 BF16, where models run in float32 (and GGUF weights on block_kernels.c).
 *
 * Same arithmetic as PyTorch's float32 ops up to the order of float sums (and expf or exp_ps
 * against PyTorch's own exp). Each call replaces three to six small PyTorch ops per layer and token.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "exp_avx2.h"
#include "kernels_f32.h"
#include "sums_avx2.h"

/* out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)). cols % 8 == 0. */
static inline void norm_row_f32(const float *xr, const float *weight, float *out, int64_t cols, float eps) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        __m256 a = _mm256_loadu_ps(xr + c), b = _mm256_loadu_ps(xr + c + 8);
        s0 = _mm256_fmadd_ps(a, a, s0);
        s1 = _mm256_fmadd_ps(b, b, s1);
    }
    for (; c < cols; c += 8) {
        __m256 a = _mm256_loadu_ps(xr + c);
        s0 = _mm256_fmadd_ps(a, a, s0);
    }
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(_mm256_add_ps(s0, s1)) / (float)cols + eps));
    for (c = 0; c < cols; c += 8)
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_loadu_ps(weight + c), _mm256_mul_ps(_mm256_loadu_ps(xr + c), inv)));
}

void dolmus_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t cols,
                         float eps) {
    if (rows <= SHARED_ROWS) {
        for (int64_t r = 0; r < rows; r++) norm_row_f32(x + r * cols, weight, out + r * cols, cols, eps);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row_f32(x + r * cols, weight, out + r * cols, cols, eps);
}

/* out = silu(gate) * up. x: [rows][2 * cols] (gate, then up); out: [rows][cols]. Eight at a
 * time on exp_ps (a 2,048-token prompt of a 0.5B model spent ~4% of its time here on expf). */
static inline void silu_row_f32(const float *gate, float *o, int64_t cols) {
    const float *up = gate + cols;
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        __m256 g = _mm256_loadu_ps(gate + c);
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(o + c, _mm256_mul_ps(silu, _mm256_loadu_ps(up + c)));
    }
    for (; c < cols; c++) o[c] = gate[c] / (1.0f + expf(-gate[c])) * up[c];
}

void dolmus_silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t cols) {
    if (rows <= 4) {
        for (int64_t r = 0; r < rows; r++) silu_row_f32(x + r * 2 * cols, out + r * cols, cols);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) silu_row_f32(x + r * 2 * cols, out + r * cols, cols);
}

/* In place: x = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[d/2:], x[:d/2]).
 * x: [tokens][heads][d] at token stride x_stride; cos, sin: [tokens][d]. d % 16 == 0. */
static inline void rotary_token_f32(float *x, const float *ct, const float *st, int64_t heads, int64_t d) {
    int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *row = x + h * d;
        for (int64_t i = 0; i < half; i += 8) {
            __m256 a = _mm256_loadu_ps(row + i), b = _mm256_loadu_ps(row + half + i);
            /* a*cos - b*sin, b*cos + a*sin: each product rounded, then the sum (PyTorch's order) */
            __m256 lo = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(ct + i)), _mm256_mul_ps(b, _mm256_loadu_ps(st + i)));
            __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(ct + half + i)),
                                      _mm256_mul_ps(a, _mm256_loadu_ps(st + half + i)));
            _mm256_storeu_ps(row + i, lo);
            _mm256_storeu_ps(row + half + i, hi);
        }
    }
}

void dolmus_rotary_f32(float *x, int64_t x_stride, const float *cos, const float *sin, int64_t tokens,
                       int64_t heads, int64_t d) {
    if (tokens <= SHARED_ROWS) {
        for (int64_t t = 0; t < tokens; t++) rotary_token_f32(x + t * x_stride, cos + t * d, sin + t * d, heads, d);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; t++) rotary_token_f32(x + t * x_stride, cos + t * d, sin + t * d, heads, d);
}

/* Decode attention is split along each sequence's keys (flash decoding): a work item is one
 * KV head's query group over one span of keys, so one long sequence keeps every core busy
 * (items per sequence and head: its spans; one item per KV head left a 3-KV-head model's batch-1
 * step on one core for two thirds of the time). How a sequence is cut depends on its length
 * only, never on its companions, so its result does not depend on its batch. */
#define SPAN_KEYS 64 /* keys per span at least: a span's keys and values stay in L2 (16 KB each at d = 64) */
#define MAX_SPANS 16 /* spans per sequence at most: bounds the partial results kept per call */

static inline int64_t span_keys(int64_t len) {
    int64_t spans = (len + SPAN_KEYS - 1) / SPAN_KEYS;
    if (spans <= MAX_SPANS) return SPAN_KEYS;
    int64_t keys = (len + MAX_SPANS - 1) / MAX_SPANS;
    return (keys + 7) / 8 * 8;
}

/* Eight sums of eight vectors' lanes, one per lane: [sum(a[0]), ..., sum(a[7])]. */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* One span of `count` keys (rows `key[0..count)`) against `group` queries qf [group][d]
 * (already scaled): per query its largest score top[g], the sum of exp(score - top) sum[g]
 * and the values weighted by those exponentials acc [group][d]. scores: scratch [group][count]. */
static void attend_span(const float *qf, const float *const *key, const float *const *value, int64_t count,
                        int64_t group, int64_t d, float *scores, float *top, float *sum, float *acc) {
    for (int64_t p0 = 0; p0 < count; p0 += 8) { /* eight keys at a time: eight chains of sums */
        const float *kr[8];
        for (int j = 0; j < 8; j++) kr[j] = key[p0 + j < count ? p0 + j : count - 1];
        for (int64_t g = 0; g < group; g++) {
            __m256 dot[8];
            for (int j = 0; j < 8; j++) dot[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8) {
                __m256 qv = _mm256_loadu_ps(qf + g * d + i);
                for (int j = 0; j < 8; j++) dot[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[j] + i), dot[j]);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, hsum8x8(dot));
            for (int64_t j = 0; j < 8 && p0 + j < count; j++) scores[g * count + p0 + j] = lanes[j];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * count, m = sg[0];
        for (int64_t p = 1; p < count; p++) m = sg[p] > m ? sg[p] : m;
        top[g] = m;
        sum[g] = exp_sub_sum(sg, count, m); /* on expf one at a time: ~20% more time at 32 sequences */
        for (int64_t i0 = 0; i0 < d; i0 += 64) { /* 64 outputs at a time: eight sums in registers */
            int64_t width = d - i0 < 64 ? d - i0 : 64;
            __m256 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
            if (width == 64) {
                for (int64_t p = 0; p < count; p++) {
                    __m256 e = _mm256_set1_ps(sg[p]);
                    for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(e, _mm256_loadu_ps(value[p] + i0 + 8 * j), a[j]);
                }
            } else {
                for (int64_t p = 0; p < count; p++) {
                    __m256 e = _mm256_set1_ps(sg[p]);
                    for (int j = 0; j < width / 8; j++)
                        a[j] = _mm256_fmadd_ps(e, _mm256_loadu_ps(value[p] + i0 + 8 * j), a[j]);
                }
            }
            for (int j = 0; j < width / 8; j++) _mm256_storeu_ps(acc + g * d + i0 + 8 * j, a[j]);
        }
    }
}

/* One new token per sequence attends to its cached keys and values (its own included); the
 * layout is decode_attention.c's dolmus_decode_attention, in float32. d % 8 == 0. Each span's
 * partial result (its largest score, sum of exponentials and weighted values) is kept, and a
 * second pass rescales a sequence's spans to their common largest score and adds them. */
void dolmus_decode_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                                 const float *v_cache, const int64_t *block_ids, int64_t nb,
                                 const int64_t *lengths, float *out, int64_t n, int64_t hq, int64_t hkv,
                                 int64_t d, int64_t bs, float scale, int64_t window) {
    const int64_t group = hq / hkv, part = group * (d + 2); /* a partial: acc, top, sum per query */
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(n + 1)); /* items before sequence s */
    if (!first_item) abort();
    first_item[0] = 0;
    int64_t most = SPAN_KEYS; /* the longest span: sizes each thread's scratch */
    for (int64_t s = 0; s < n; s++) {
        int64_t end = lengths[s], first = window > 0 && end > window ? end - window : 0, len = end - first;
        first_item[s + 1] = first_item[s] + hkv * ((len + span_keys(len) - 1) / span_keys(len));
        most = span_keys(len) > most ? span_keys(len) : most;
    }
    const int64_t items = first_item[n];
    float *partials = malloc(sizeof(float) * (size_t)(items * part));
    if (!partials && items) abort();
#pragma omp parallel
    {
        /* per thread: the scaled queries, a span's scores and its rows' addresses */
        float *qf = malloc(sizeof(float) * (size_t)(group * (d + most)));
        const float **rows = malloc(sizeof(float *) * (size_t)(2 * most));
        if (!qf || !rows) abort();
        float *scores = qf + group * d;
        int64_t s = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            while (first_item[s + 1] <= item) s++; /* items ascend within a thread */
            while (first_item[s] > item) s--;
            int64_t end = lengths[s], first = window > 0 && end > window ? end - window : 0, len = end - first;
            int64_t keys = span_keys(len), spans = (len + keys - 1) / keys;
            int64_t h = (item - first_item[s]) / spans, span = (item - first_item[s]) % spans;
            int64_t p0 = first + span * keys, count = end - p0 < keys ? end - p0 : keys;
            const int64_t *table = block_ids + s * nb;
            for (int64_t p = 0; p < count; p++) {
                int64_t slot = table[(p0 + p) / bs] * bs + (p0 + p) % bs;
                rows[p] = k_cache + (slot * hkv + h) * d;
                rows[most + p] = v_cache + (slot * hkv + h) * d;
            }
            const float *qs = q + s * q_stride + h * group * d;
            for (int64_t i = 0; i < group * d; i += 8)
                _mm256_storeu_ps(qf + i, _mm256_mul_ps(_mm256_loadu_ps(qs + i), _mm256_set1_ps(scale)));
            float *pr = partials + item * part;
            attend_span(qf, rows, rows + most, count, group, d, scores, pr + group * d, pr + group * d + group, pr);
        }
        free(qf);
        free(rows);
        /* the implicit barrier above: every span is done */
#pragma omp for schedule(static)
        for (int64_t sh = 0; sh < n * hkv; sh++) {
            int64_t s2 = sh / hkv, h = sh % hkv, spans = (first_item[s2 + 1] - first_item[s2]) / hkv;
            const float *pr = partials + (first_item[s2] + h * spans) * part;
            if (!spans) { /* no key to attend to (a sequence's length is at least 1) */
                memset(out + (s2 * hq + h * group) * d, 0, sizeof(float) * (size_t)(group * d));
                continue;
            }
            for (int64_t g = 0; g < group; g++) {
                float m = pr[group * d + g], total = 0;
                for (int64_t c = 1; c < spans; c++) m = pr[c * part + group * d + g] > m ? pr[c * part + group * d + g] : m;
                float *o = out + (s2 * hq + h * group + g) * d;
                for (int64_t c = 0; c < spans; c++) {
                    const float *pc = pr + c * part;
                    float w = expf(pc[group * d + g] - m);
                    total += pc[group * d + group + g] * w;
                    for (int64_t i = 0; i < d; i++) o[i] = (c ? o[i] : 0.0f) + pc[g * d + i] * w;
                }
                float inv = 1.0f / total;
                for (int64_t i = 0; i < d; i++) o[i] *= inv;
            }
        }
    }
    free(partials);
    free(first_item);
}
