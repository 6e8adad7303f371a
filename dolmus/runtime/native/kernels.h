/* The kernels of the AVX-512 library that its sources call in each other (defined in
 * layer_kernels.c, decode_attention.c, prefill_attention.c, int8_kernels.c,
 * quant_kernels.c, int8g_kernels.c, bf16_gemm.c and quant_amx.c). */
#ifndef DOLMUS_KERNELS_H
#define DOLMUS_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "panel_split.h"

/* Rows up to which a row-wise kernel (the norms, the rotary, a step's cache writes) loops on the
 * calling thread without entering OpenMP; past it the rows are shared between the threads. A
 * parallel region whose `if` comes out false still sets up a team of one (~0.75 us a call), and
 * decode_step.c's one-region step calls these a few times a layer from inside its own region:
 * looping there instead made int4 and int8 decode steps of a 0.5B body 0.7-1.1% shorter (step
 * by step in one process, Zen 4). */
#define SHARED_ROWS 16

void dolmus_rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t cols,
                     float eps);
void dolmus_rotary(uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin, int64_t tokens,
                   int64_t heads, int64_t d);
void dolmus_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int64_t *block_ids, int64_t nb,
                             const int64_t *lengths, uint16_t *out, int64_t n, int64_t hq, int64_t hkv,
                             int64_t d, int64_t bs, float scale, int64_t window);
/* 0, or -1 when memory ran out (prefill_attention.c) */
int dolmus_prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *block_ids, int64_t nb, const int64_t *starts, const int64_t *lens,
                             const int64_t *contexts, int64_t nseq, uint16_t *out, int64_t out_stride, int64_t hq,
                             int64_t hkv, int64_t d, int64_t bs, float scale);
void dolmus_silu_and_mul(const uint16_t *x, uint16_t *out, int64_t rows, int64_t cols);
void dolmus_int8_gemm(const uint16_t *x, const uint8_t *packed, const float *scale, uint16_t *y, int64_t M,
                      int64_t N, int64_t K);
void dolmus_int4_gemm(const uint16_t *x, const uint8_t *packed, const uint16_t *scale, const uint16_t *zero,
                      uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group);
void dolmus_int8g_gemm(const uint16_t *x, const int8_t *packed, const uint16_t *scale, const uint16_t *zero,
                       uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group);

/* One row of activations as the VNNI kernels read them (int8_kernels.c's header): x = s x16, x16 =
 * 256 h + l, h and l signed bytes. */
typedef struct {
    const int8_t *h, *l; /* [kq] bytes each (K rounded up to 16, zero past K) */
    int32_t corr_h, corr_l; /* 128 sum h, 128 sum l */
    float s;                /* x = s x16; NaN when the row holds an inf or NaN */
} int8_row;
void split_row(const uint16_t *x, int64_t K, int64_t kq, int8_t *h, int8_t *l, int8_row *row);
/* the same x16 as 16-bit integers [kq] (zero past K); returns s */
float x16_row(const uint16_t *x, int64_t K, int64_t kq, int16_t *out);
void dolmus_bf16_gemm_amx(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y,
                          int64_t M, int64_t N, int64_t K, int64_t gated);
/* the tile-packed product on AMX where granted, else AVX-512 BF16 (bf16_gemm_avx512.c) */
void dolmus_bf16_gemm(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t M,
                      int64_t N, int64_t K, int64_t gated);
int dolmus_amx_ready(void);
/* sum x over each group of inputs of each row: [M][K / group] floats (the caller frees), or NULL. */
float *dolmus_group_sums(const uint16_t *x, int64_t M, int64_t K, int64_t group);
int dolmus_amx_quant_usable(int64_t M, int64_t K, int64_t group, int64_t bits);
void dolmus_quant_gemm_amx(const uint16_t *x, const void *packed, const uint16_t *scale, const uint16_t *zero,
                           uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group, int64_t bits);

/* ---- The same products and decode attention inside the caller's parallel region ----
 * For decode_step.c's one-region step: one thread writes the activations as the product reads
 * them into `ws` (team_scratch_bytes(K) bytes, 64-byte aligned), every thread initializes `split`
 * for the product's panels, and after a barrier every thread runs. The same blocks, the same
 * bits, as the calls above. At most TEAM_ROWS rows. */
#define TEAM_ROWS 4
static inline size_t team_scratch_bytes(int64_t K) { /* the grouped int8 prep's, the largest (groups of 16) */
    return (size_t)TEAM_ROWS * (64 + 2 * (size_t)((K + 63) / 64 * 64) + 8 * (size_t)((K + 15) / 16));
}
void team_int8_prep(const uint16_t *x, int64_t M, int64_t K, void *ws);
void team_int8_run(const void *ws, const uint8_t *packed, const float *scale, uint16_t *y, int64_t M,
                   int64_t N, int64_t K, panel_split *split, int t, int T);
/* the group sums of dolmus_group_sums into out (int4, and grouped int8 with zeros: their prep) */
void group_sums_into(const uint16_t *x, int64_t M, int64_t K, int64_t group, float *out);
void team_int4_run(const uint16_t *x, const float *xsum, const uint8_t *packed, const uint16_t *scale,
                   const uint16_t *zero, uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group,
                   panel_split *split, int t, int T);
/* the grouped int8 kernel's activations into ws (its prep; zeros: whether the weight has them) */
void int8g_prep(const uint16_t *x, int64_t M, int64_t K, int64_t group, int zeros, void *ws);
void team_int8g_run(const void *ws, const int8_t *packed, const uint16_t *scale,
                    const uint16_t *zero, uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t group,
                    panel_split *split, int t, int T);
/* whether dolmus_bf16_gemm runs on AMX tiles here (no team form) */
int bf16_on_amx(void);
int64_t team_bf16_panels(int64_t N);
void team_bf16_prep(const uint16_t *x, int64_t M, int64_t K, void *ws);
void team_bf16_run(const uint16_t *x, const void *ws, const uint16_t *packed, const float *bias, uint16_t *y,
                   int64_t M, int64_t N, int64_t K, int64_t gated, panel_split *split, int t, int T);
/* thread t's share of dolmus_decode_attention's items; *claimed: 0, set before a barrier */
void team_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int64_t *block_ids, int64_t nb,
                           const int64_t *lengths, uint16_t *out, int64_t n, int64_t hq, int64_t hkv,
                           int64_t d, int64_t bs, float scale, int64_t window, int64_t *claimed, int t, int T);

#endif
