/* One step of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) in one call, from the token
 * ids to the final norm's output: a decode step (every sequence has one new token), or a step
 * with prompt chunks too (model_step.h lays the rows out).
 *
 * The module path makes the same kernel calls (layer_kernels.c, decode_attention.c,
 * prefill_attention.c, quant_kernels.c, bf16_gemm.c) with a few dozen PyTorch ops and Python
 * calls around them per layer: at one sequence of a small model that glue costs as much as the
 * weight reads, and on a 128-token prompt ~2%. Here the same kernels run back to back on scratch
 * buffers the caller holds, and the elementwise steps between them round to bf16 exactly where
 * PyTorch's bf16 ops do, so the hidden states are bit for bit the module path's
 * (runtime/models/llama_decode.py builds the descriptors, and the tests compare the two).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

#include "bf16_simd.h"
#include "kernels.h"
#include "model_step.h"
#include "panel_split.h"

/* Which kernel multiplies a linear layer (layers/linear_method.py's NativeKind). */
enum { LINEAR_AMX_BF16 = 0, LINEAR_INT4 = 1, LINEAR_INT8 = 2, LINEAR_INT8_GROUPS = 3 };

typedef struct {
    int64_t kind;
    const void *packed; /* the weight in its kernel's layout */
    const void *scale;  /* int4, grouped int8: bf16 [K / group][Npad]; int8: float32 [Npad] */
    const void *zero;   /* int4, grouped int8: as scale, or NULL */
    const void *bias;   /* AMX: float32, added in the kernel; others: bf16, added after; or NULL */
    int64_t n, k, group;
    int64_t gated; /* AMX only: the product ends in SiLU(gate) * up, [M][n / 2] */
    int64_t tile_rows; /* unused here (decode_step_f32.c's blocks) */
} dolmus_linear;

typedef struct {
    const uint16_t *input_norm, *post_norm; /* [hidden] */
    const uint16_t *q_norm, *k_norm;        /* [head_dim] (Qwen3), or NULL */
    dolmus_linear qkv, o, gate_up, down;
    uint16_t *k_cache, *v_cache; /* [slots][kv_heads][head_dim] */
    int64_t window;              /* sliding attention window, or 0: the whole context */
} dolmus_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inner, block_size;
    float eps, scale;
    const dolmus_layer *layers;
    const uint16_t *embed;        /* [vocab][hidden] */
    const uint16_t *final_norm;   /* [hidden] */
    const uint16_t *cos, *sin;    /* [positions][head_dim] */
    /* scratch, each for the most rows the caller runs */
    uint16_t *residual;           /* [rows][hidden] */
    uint16_t *normed;             /* [rows][hidden] */
    uint16_t *qkv;                /* [rows][(heads + 2 kv_heads) head_dim] */
    uint16_t *attn;               /* [rows][heads head_dim] */
    uint16_t *gate_up;            /* [rows][2 inner] */
    uint16_t *act;                /* [rows][inner] */
    uint16_t *delta;              /* [rows][hidden] */
    int64_t one_region;           /* 1: small decode steps run as one parallel region (team_step) */
    dolmus_linear head;           /* the LM head, for decode steps' logits; packed NULL: none */
} dolmus_decoder;

/* y = bf16(y + b) per row: PyTorch's bf16 add. n % 16 tail handled with masks. */
static void add_rows(uint16_t *y, const uint16_t *b, int64_t rows, int64_t n, int64_t b_stride) {
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *yr = y + r * n;
        const uint16_t *br = b + r * b_stride;
        int64_t c = 0;
        for (; c + 16 <= n; c += 16) store_bf16x16(yr + c, _mm512_add_ps(load_bf16x16(yr + c), load_bf16x16(br + c)));
        for (; c < n; c++) {
            union { uint32_t u; float f; } a = {(uint32_t)yr[c] << 16}, d = {(uint32_t)br[c] << 16};
            __m128 s = _mm_set_ss(a.f + d.f);
            yr[c] = (uint16_t)_mm_extract_epi16((__m128i)_mm_cvtneps_pbh(s), 0);
        }
    }
}

static void linear(const dolmus_linear *l, const uint16_t *x, uint16_t *y, int64_t m) {
    switch (l->kind) {
    case LINEAR_AMX_BF16:
        dolmus_bf16_gemm(x, l->packed, l->bias, y, m, l->n, l->k, l->gated);
        return; /* its bias is added in float32 inside, as the module path's */
    case LINEAR_INT4:
        dolmus_int4_gemm(x, l->packed, l->scale, l->zero, y, m, l->n, l->k, l->group);
        break;
    case LINEAR_INT8:
        dolmus_int8_gemm(x, l->packed, l->scale, y, m, l->n, l->k);
        break;
    default:
        dolmus_int8g_gemm(x, l->packed, l->scale, l->zero, y, m, l->n, l->k, l->group);
    }
    if (l->bias) add_rows(y, l->bias, m, l->n, 0);
}

/* Whether the MLP's gate/up product ends in SiLU(gate) * up itself (the tile-packed bf16 one),
 * writing act; else it writes gate_up, and the kernel that the module path calls follows. */
static int fused_gate(const dolmus_linear *l) { return l->kind == LINEAR_AMX_BF16 && l->gated; }

static void gated(const dolmus_decoder *m, const dolmus_linear *l, const uint16_t *x, int64_t rows) {
    if (fused_gate(l)) {
        linear(l, x, m->act, rows);
        return;
    }
    linear(l, x, m->gate_up, rows);
    dolmus_silu_and_mul(m->gate_up, m->act, rows, m->inner);
}

/* Row t of qkv after its product: Qwen3's q/k norms, rotary embedding, and its key and value
 * into the cache. */
static void place_row(const dolmus_decoder *m, const dolmus_layer *L, const dolmus_step *s, int64_t t) {
    const int64_t d = m->head_dim, hq = m->heads, hkv = m->kv_heads;
    const int64_t q_size = hq * d, kv_size = hkv * d, width = q_size + 2 * kv_size;
    uint16_t *row = m->qkv + t * width;
    if (L->q_norm) { /* in place: each row's statistics are read before it is written */
        dolmus_rms_norm(row, L->q_norm, row, hq, d, m->eps);
        dolmus_rms_norm(row + q_size, L->k_norm, row + q_size, hkv, d, m->eps);
    }
    const int64_t p = s->positions[t];
    dolmus_rotary(row, width, m->cos + p * d, m->sin + p * d, 1, hq + hkv, d);
    size_t bytes = sizeof(uint16_t) * (size_t)kv_size;
    memcpy(L->k_cache + s->slots[t] * kv_size, row + q_size, bytes);
    memcpy(L->v_cache + s->slots[t] * kv_size, row + q_size + kv_size, bytes);
}

/* Rows [0, rows) of qkv (place_row). Rows are independent, so a prompt chunk's are shared out
 * between the threads: a 0.5B body's 2,048-token prompt spent 42.6 ms here on one thread, 29.2
 * on two (Zen 4; 3.2 -> 2.8 ms at 129 tokens). Not half: the first write into a fresh block of
 * the pool takes a page fault (kv_store.zeros), ~0.7 ms of the 129 tokens' time. A decode step's
 * few rows stay on the calling thread (kernels.h's SHARED_ROWS). */
static void place_rows(const dolmus_decoder *m, const dolmus_layer *L, const dolmus_step *s, int64_t rows) {
    if (rows <= SHARED_ROWS) {
        for (int64_t t = 0; t < rows; t++) place_row(m, L, s, t);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < rows; t++) place_row(m, L, s, t);
}

/* ---- Small decode steps in one parallel region ----
 * Each product and the decode attention above open a parallel region of their own: 96 products
 * and 24 attentions a step of a 24-layer model, each waking the other threads and waiting for
 * the last of them (~2 us a region on a Zen 4's two cores, the products' activations prepared
 * and their buffers allocated in between). At a few rows, where a whole step takes a few
 * milliseconds, that was ~5% of an int8 step. team_step runs the same kernels' team forms
 * (kernels.h) in one region: thread 0 does the elementwise work between products (norms,
 * rotary, the cache writes, the residual adds, SiLU) and prepares the next product's
 * activations, every thread sets up the product's panels, and barriers stand where the regions
 * ended. The same blocks and the same sums: the same bits. */

/* Whether a linear layer's kernel has a team form at `rows` rows: int8; int4 and grouped int8
 * where AMX's tiles do not take those rows; tile-packed bf16 on vdpbf16ps. */
static int team_linear(const dolmus_linear *l, int64_t rows) {
    switch (l->kind) {
    case LINEAR_INT8:
        return 1;
    case LINEAR_INT4:
        return !dolmus_amx_quant_usable(rows, l->k, l->group, 4);
    case LINEAR_INT8_GROUPS:
        return !dolmus_amx_quant_usable(rows, l->k, l->group, 8);
    default:
        return !bf16_on_amx();
    }
}

static int team_fits(const dolmus_decoder *m, const dolmus_step *s, const uint16_t *logits) {
    if (!m->one_region || s->chunks || s->rows > TEAM_ROWS || s->kept != s->rows) return 0;
    if (logits && !team_linear(&m->head, s->rows)) return 0;
    for (int64_t i = 0; i < m->num_layers; i++) {
        const dolmus_layer *L = m->layers + i;
        if (!team_linear(&L->qkv, s->rows) || !team_linear(&L->o, s->rows) || !team_linear(&L->gate_up, s->rows) ||
            !team_linear(&L->down, s->rows))
            return 0;
    }
    return 1;
}

static int64_t team_panels(const dolmus_linear *l) {
    return l->kind == LINEAR_AMX_BF16 ? team_bf16_panels(l->n) : (l->n + 63) / 64;
}

/* Thread 0, before the product's barrier: x as the kernel reads it, into ws. */
static void team_prep(const dolmus_linear *l, const uint16_t *x, int64_t rows, void *ws) {
    switch (l->kind) {
    case LINEAR_INT8:
        team_int8_prep(x, rows, l->k, ws);
        return;
    case LINEAR_INT4:
        group_sums_into(x, rows, l->k, l->group, ws);
        return;
    case LINEAR_INT8_GROUPS:
        int8g_prep(x, rows, l->k, l->group, l->zero != NULL, ws);
        return;
    default:
        team_bf16_prep(x, rows, l->k, ws);
    }
}

/* Every thread: its panels of the product (prepared by team_prep), between two barriers. The
 * bias, where the kernel does not add it, is thread 0's after the second (team_bias). */
static void team_product(const dolmus_linear *l, const uint16_t *x, uint16_t *y, int64_t rows, const void *ws,
                         panel_split *split, int t, int T) {
    split_init(split, t, T, team_panels(l));
#pragma omp barrier
    switch (l->kind) {
    case LINEAR_INT8:
        team_int8_run(ws, l->packed, l->scale, y, rows, l->n, l->k, split, t, T);
        break;
    case LINEAR_INT4:
        team_int4_run(x, ws, l->packed, l->scale, l->zero, y, rows, l->n, l->k, l->group, split, t, T);
        break;
    case LINEAR_INT8_GROUPS:
        team_int8g_run(ws, l->packed, l->scale, l->zero, y, rows, l->n, l->k, l->group, split, t, T);
        break;
    default:
        team_bf16_run(x, ws, l->packed, l->bias, y, rows, l->n, l->k, l->gated, split, t, T);
    }
#pragma omp barrier
}

static void team_bias(const dolmus_linear *l, uint16_t *y, int64_t rows) {
    if (l->bias && l->kind != LINEAR_AMX_BF16) add_rows(y, l->bias, rows, l->n, 0);
}

/* model_step for a step that team_fits: -1 (nothing written) when its scratch could not be had. */
static int team_step(const dolmus_decoder *m, const dolmus_step *s, uint16_t *out, uint16_t *logits) {
    const int64_t hidden = m->hidden, d = m->head_dim, hq = m->heads, hkv = m->kv_heads, rows = s->rows;
    const int64_t width = (hq + 2 * hkv) * d, widest = m->inner > hq * d ? m->inner : hq * d;
    void *ws = aligned_alloc(64, team_scratch_bytes(widest > hidden ? widest : hidden));
    if (!ws) return -1;
    panel_split split;
    int64_t claimed = 0;
    for (int64_t t = 0; t < rows; t++)
        memcpy(m->residual + t * hidden, m->embed + s->tokens[t] * hidden, sizeof(uint16_t) * (size_t)hidden);
#pragma omp parallel
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int64_t i = 0; i < m->num_layers; i++) {
            const dolmus_layer *L = m->layers + i;
            if (t == 0) {
                dolmus_rms_norm(m->residual, L->input_norm, m->normed, rows, hidden, m->eps);
                team_prep(&L->qkv, m->normed, rows, ws);
            }
            team_product(&L->qkv, m->normed, m->qkv, rows, ws, &split, t, T);
            if (t == 0) {
                team_bias(&L->qkv, m->qkv, rows);
                place_rows(m, L, s, rows);
                claimed = 0;
            }
#pragma omp barrier
            team_decode_attention(m->qkv, width, L->k_cache, L->v_cache, s->block_ids, s->nb, s->lengths, m->attn,
                                  rows, hq, hkv, d, m->block_size, m->scale, L->window, &claimed, t, T);
#pragma omp barrier
            if (t == 0) team_prep(&L->o, m->attn, rows, ws);
            team_product(&L->o, m->attn, m->delta, rows, ws, &split, t, T);
            if (t == 0) {
                team_bias(&L->o, m->delta, rows);
                add_rows(m->residual, m->delta, rows, hidden, hidden);
                dolmus_rms_norm(m->residual, L->post_norm, m->normed, rows, hidden, m->eps);
                team_prep(&L->gate_up, m->normed, rows, ws);
            }
            team_product(&L->gate_up, m->normed, fused_gate(&L->gate_up) ? m->act : m->gate_up, rows, ws, &split, t, T);
            if (t == 0) {
                if (!fused_gate(&L->gate_up)) {
                    team_bias(&L->gate_up, m->gate_up, rows);
                    dolmus_silu_and_mul(m->gate_up, m->act, rows, m->inner);
                }
                team_prep(&L->down, m->act, rows, ws);
            }
            team_product(&L->down, m->act, m->delta, rows, ws, &split, t, T);
            if (t == 0) {
                team_bias(&L->down, m->delta, rows);
                add_rows(m->residual, m->delta, rows, hidden, hidden);
            }
        }
        if (t == 0) {
            dolmus_rms_norm(m->residual, m->final_norm, out, rows, hidden, m->eps);
            if (logits) team_prep(&m->head, out, rows, ws);
        }
        if (logits) {
            team_product(&m->head, out, logits, rows, ws, &split, t, T);
            if (t == 0) team_bias(&m->head, logits, rows);
        }
    }
    free(ws);
    return 0;
}

/* One step of the rows in `s`: every row's key and value go to the cache; decodes attend with
 * the decode kernel, prompt chunks with the prefill kernel (prefill_attention.c); the last layer
 * goes on with the kept rows alone (a prompt chunk samples from its last row at most). out
 * [kept][hidden]: the final norm's output, for the LM head. Returns 1 where it ran as one
 * parallel region (team_step), 0 where it ran a region per kernel, or -1 when the prefill kernel
 * ran out of memory (the caller runs the step another way; the keys and values written so far
 * are the ones it writes again). */
static int model_step(const dolmus_decoder *m, const dolmus_step *s, uint16_t *out, uint16_t *logits) {
    const int64_t hidden = m->hidden, d = m->head_dim, hq = m->heads, hkv = m->kv_heads;
    const int64_t q_size = hq * d, kv_size = hkv * d, width = q_size + 2 * kv_size;
    if (team_fits(m, s, logits) && team_step(m, s, out, logits) == 0) return 1;
    int64_t rows = s->rows;
    for (int64_t t = 0; t < rows; t++)
        memcpy(m->residual + t * hidden, m->embed + s->tokens[t] * hidden, sizeof(uint16_t) * (size_t)hidden);
    for (int64_t i = 0; i < m->num_layers; i++) {
        const dolmus_layer *L = m->layers + i;
        dolmus_rms_norm(m->residual, L->input_norm, m->normed, rows, hidden, m->eps);
        linear(&L->qkv, m->normed, m->qkv, rows);
        place_rows(m, L, s, rows);
        if (s->decodes)
            dolmus_decode_attention(m->qkv, width, L->k_cache, L->v_cache, s->block_ids, s->nb, s->lengths, m->attn,
                                    s->decodes, hq, hkv, d, m->block_size, m->scale, L->window);
        if (s->chunks && dolmus_prefill_attention(m->qkv, width, L->k_cache, L->v_cache, s->chunk_blocks, s->chunk_nb,
                                                  s->starts, s->lens, s->contexts, s->chunks, m->attn, q_size, hq,
                                                  hkv, d, m->block_size, m->scale))
            return -1;
        if (i == m->num_layers - 1 && s->kept != s->rows) {
            keep_rows(m->attn, sizeof(uint16_t) * (size_t)q_size, s->keep, s->kept);
            keep_rows(m->residual, sizeof(uint16_t) * (size_t)hidden, s->keep, s->kept);
            rows = s->kept;
            if (!rows) return 0;
        }
        linear(&L->o, m->attn, m->delta, rows);
        add_rows(m->residual, m->delta, rows, hidden, hidden);
        dolmus_rms_norm(m->residual, L->post_norm, m->normed, rows, hidden, m->eps);
        gated(m, &L->gate_up, m->normed, rows);
        linear(&L->down, m->act, m->delta, rows);
        add_rows(m->residual, m->delta, rows, hidden, hidden);
    }
    dolmus_rms_norm(m->residual, m->final_norm, out, rows, hidden, m->eps);
    if (logits) linear(&m->head, out, logits, rows);
    return 0;
}

int dolmus_model_step(const dolmus_decoder *m, const dolmus_step *s, uint16_t *out) {
    return model_step(m, s, out, NULL);
}

/* The index of each row's largest logit, the first where several tie, as PyTorch's max(dim=-1)
 * gives it on bf16 rows (a NaN counts as the largest: the first NaN's). */
void dolmus_argmax_bf16(const uint16_t *logits, int64_t rows, int64_t vocab, int64_t *argmax) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = logits + r * vocab;
        __m512 top = _mm512_set1_ps(-__builtin_inff());
        __mmask16 nan = 0;
        for (int64_t c = 0; c < vocab; c += 16) {
            __m512 v = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first_lanes(vocab - c), x + c)), 16));
            __mmask16 valid = first_lanes(vocab - c);
            nan |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
            top = _mm512_mask_max_ps(top, valid, top, v);
        }
        float best = _mm512_reduce_max_ps(top);
        int64_t at = 0;
        for (int64_t c = 0; c < vocab; c++) {
            union { uint32_t u; float f; } v = {(uint32_t)x[c] << 16};
            if (nan ? v.f != v.f : v.f == best) {
                at = c;
                break;
            }
        }
        argmax[r] = at;
    }
}

/* A step of decodes alone, one new token per sequence: rows [3][n] (tokens, positions, seats in
 * table [seats][width]: model_step.h's seat_rows). out [n][hidden]: the final norm's output. Where
 * the decoder has an LM head and logits is not NULL, also logits [n][vocab] (the head's product of
 * out, as the module path's LM head computes it) and argmax [n], each row's largest logit's index
 * (dolmus_argmax_bf16): the Python between two steps, on caches the weights flushed, cost more than
 * these. Returns 1 where the step ran as one parallel region, 0 where not, or -1 when memory ran
 * out (nothing written). */
int dolmus_decode_step(const dolmus_decoder *m, int64_t n, const int64_t *rows, const int64_t *table, int64_t width,
                       uint16_t *out, uint16_t *logits, int64_t *argmax) {
    dolmus_step s;
    int64_t *scratch = seat_rows(&s, n, rows, table, width, m->block_size);
    if (!scratch) return -1;
    if (!m->head.packed) logits = NULL;
    int done = model_step(m, &s, out, logits);
    free(scratch);
    if (logits) dolmus_argmax_bf16(logits, n, m->head.n, argmax);
    return done;
}
