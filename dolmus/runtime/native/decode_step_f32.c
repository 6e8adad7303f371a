/* decode_step.c for float32 models on AVX2: one step of a Llama-family model (decodes, and
 * prompt chunks with them) in one call, on the float32 kernels (layer_kernels_f32.c,
 * prefill_attention_f32.c) and the AVX2 products (bf16 weights kept under float32,
 * bf16_weights_f32.c; GGUF's 4- and 8-bit blocks, block_kernels.c).
 *
 * The module path makes the same calls with PyTorch's float32 adds between them, so the hidden
 * states are bit for bit the module path's (runtime/models/llama_decode.py builds the
 * descriptors, whose layout is decode_step.c's with float32 tensors, and the tests compare the
 * two). Where bf16 is emulated this is what a decode step of a bf16 or GGUF checkpoint runs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "kernels_f32.h"
#include "model_step.h"

/* Which kernel multiplies a linear layer (layers/linear_method.py's NativeKind). */
enum { LINEAR_BF16_F32 = 4, LINEAR_Q4_F32 = 5, LINEAR_Q8_F32 = 6, LINEAR_Q8_I8 = 7, LINEAR_Q4_I8 = 8 };

typedef struct {
    int64_t kind;
    const void *packed; /* the weight in its kernel's layout */
    const float *scale; /* blocks: a scale per block (8-bit: per `group` scales of a block) */
    const float *zero;  /* blocks: a minimum per block, or NULL */
    const float *bias;  /* bf16 weights: added in the kernel; blocks: added after; or NULL */
    int64_t n, k, group; /* group, 8-bit blocks: scales per block of 32 */
    int64_t gated;       /* unused here */
    int64_t tile_rows;   /* blocks: rows up to which the kind's own kernel runs; past them, strips */
} linear_f32;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim] (Qwen3), or NULL */
    linear_f32 qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* [slots][kv_heads][head_dim] */
    int64_t window;           /* sliding attention window, or 0: the whole context */
} layer_f32;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inner, block_size;
    float eps, scale;
    const layer_f32 *layers;
    const float *embed, *final_norm, *cos, *sin;
    float *residual, *normed, *qkv, *attn, *gate_up, *act, *delta; /* scratch, most rows */
    int64_t one_region; /* decode_step.c's; every step here runs a region per kernel */
    linear_f32 head;    /* the LM head, for decode steps' logits; packed NULL: none */
} decoder_f32;

static void linear(const linear_f32 *l, const float *x, float *y, int64_t m) {
    switch (l->kind) {
    case LINEAR_BF16_F32:
        dolmus_bf16w_gemm_f32(x, l->packed, l->bias, y, m, l->n, l->k);
        return; /* its bias is added inside, as the module path's */
    case LINEAR_Q4_I8: /* int8 x at one row (gguf_blocks.Q4_I8_MAX_ROWS), else as LINEAR_Q4_F32 */
        if (m == 1) {
            dolmus_q4_gemm_i8(x, l->packed, l->scale, l->zero, y, m, l->n, l->k);
            break;
        }
        /* fall through */
    case LINEAR_Q4_F32:
        if (m <= l->tile_rows)
            dolmus_q4_gemm_f32(x, l->packed, l->scale, l->zero, y, m, l->n, l->k);
        else
            dolmus_q4_gemm_strips_f32(x, l->packed, l->scale, l->zero, y, m, l->n, l->k);
        break;
    default: /* 8-bit blocks */
        if (m > l->tile_rows)
            dolmus_q8_gemm_strips_f32(x, l->packed, l->scale, l->zero, y, m, l->n, l->k, l->group);
        else if (l->kind == LINEAR_Q8_I8)
            dolmus_q8_gemm_i8(x, l->packed, l->scale, l->zero, y, m, l->n, l->k, l->group);
        else
            dolmus_q8_gemm_f32(x, l->packed, l->scale, l->zero, y, m, l->n, l->k, l->group);
    }
    if (l->bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < l->n; c++) y[r * l->n + c] += l->bias[c];
}

static void add_rows(float *y, const float *b, int64_t rows, int64_t n) {
    for (int64_t i = 0; i < rows * n; i++) y[i] += b[i];
}

/* As dolmus_model_step (decode_step.c), in float32. */
int dolmus_model_step_f32(const decoder_f32 *m, const dolmus_step *s, float *out) {
    const int64_t hidden = m->hidden, d = m->head_dim, hq = m->heads, hkv = m->kv_heads;
    const int64_t q_size = hq * d, kv_size = hkv * d, width = q_size + 2 * kv_size;
    int64_t rows = s->rows;
    for (int64_t t = 0; t < rows; t++)
        memcpy(m->residual + t * hidden, m->embed + s->tokens[t] * hidden, sizeof(float) * (size_t)hidden);
    for (int64_t i = 0; i < m->num_layers; i++) {
        const layer_f32 *L = m->layers + i;
        dolmus_rms_norm_f32(m->residual, L->input_norm, m->normed, rows, hidden, m->eps);
        linear(&L->qkv, m->normed, m->qkv, rows);
        for (int64_t t = 0; t < rows; t++) {
            float *row = m->qkv + t * width;
            if (L->q_norm) { /* in place: each row's statistics are read before it is written */
                dolmus_rms_norm_f32(row, L->q_norm, row, hq, d, m->eps);
                dolmus_rms_norm_f32(row + q_size, L->k_norm, row + q_size, hkv, d, m->eps);
            }
            const int64_t p = s->positions[t];
            dolmus_rotary_f32(row, width, m->cos + p * d, m->sin + p * d, 1, hq + hkv, d);
            size_t bytes = sizeof(float) * (size_t)kv_size;
            memcpy(L->k_cache + s->slots[t] * kv_size, row + q_size, bytes);
            memcpy(L->v_cache + s->slots[t] * kv_size, row + q_size + kv_size, bytes);
        }
        if (s->decodes)
            dolmus_decode_attention_f32(m->qkv, width, L->k_cache, L->v_cache, s->block_ids, s->nb, s->lengths,
                                        m->attn, s->decodes, hq, hkv, d, m->block_size, m->scale, L->window);
        if (s->chunks && dolmus_prefill_attention_f32(m->qkv, width, L->k_cache, L->v_cache, s->chunk_blocks,
                                                      s->chunk_nb, s->starts, s->lens, s->contexts, s->chunks,
                                                      m->attn, q_size, hq, hkv, d, m->block_size, m->scale))
            return -1;
        if (i == m->num_layers - 1 && s->kept != s->rows) {
            keep_rows(m->attn, sizeof(float) * (size_t)q_size, s->keep, s->kept);
            keep_rows(m->residual, sizeof(float) * (size_t)hidden, s->keep, s->kept);
            rows = s->kept;
            if (!rows) return 0;
        }
        linear(&L->o, m->attn, m->delta, rows);
        add_rows(m->residual, m->delta, rows, hidden);
        dolmus_rms_norm_f32(m->residual, L->post_norm, m->normed, rows, hidden, m->eps);
        linear(&L->gate_up, m->normed, m->gate_up, rows);
        dolmus_silu_and_mul_f32(m->gate_up, m->act, rows, m->inner);
        linear(&L->down, m->act, m->delta, rows);
        add_rows(m->residual, m->delta, rows, hidden);
    }
    dolmus_rms_norm_f32(m->residual, m->final_norm, out, rows, hidden, m->eps);
    return 0;
}

/* The index of each row's largest logit, the first where several tie, as PyTorch's max(dim=-1)
 * gives it on float32 rows (a NaN counts as the largest: the first NaN's). */
void dolmus_argmax_f32(const float *logits, int64_t rows, int64_t vocab, int64_t *argmax) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        __m256 top = _mm256_set1_ps(-__builtin_inff()), nan = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 8 <= vocab; c += 8) {
            __m256 v = _mm256_loadu_ps(x + c);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            top = _mm256_max_ps(top, v);
        }
        float lanes[8], best = -__builtin_inff();
        int any_nan = _mm256_movemask_ps(nan) != 0;
        _mm256_storeu_ps(lanes, top);
        for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
        for (; c < vocab; c++) {
            any_nan |= x[c] != x[c];
            best = x[c] > best ? x[c] : best;
        }
        int64_t at = 0;
        for (c = 0; c < vocab; c++)
            if (any_nan ? x[c] != x[c] : x[c] == best) {
                at = c;
                break;
            }
        argmax[r] = at;
    }
}

/* As dolmus_decode_step (decode_step.c), in float32: where the decoder has an LM head and logits
 * is not NULL, also logits [n][vocab] (the head's product of out, as the LM head module computes
 * it) and argmax [n] (dolmus_argmax_f32). A region per kernel: returns 0, or -1 when memory ran
 * out (nothing written). */
int dolmus_decode_step_f32(const decoder_f32 *m, int64_t n, const int64_t *rows, const int64_t *table, int64_t width,
                           float *out, float *logits, int64_t *argmax) {
    dolmus_step s;
    int64_t *scratch = seat_rows(&s, n, rows, table, width, m->block_size);
    if (!scratch) return -1;
    int done = dolmus_model_step_f32(m, &s, out);
    free(scratch);
    if (m->head.packed && logits) {
        linear(&m->head, out, logits, n);
        dolmus_argmax_f32(logits, n, m->head.n, argmax);
    }
    return done;
}
