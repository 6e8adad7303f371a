/* The kernels of the AVX2 library that its sources call in each other (defined in
 * layer_kernels_f32.c, prefill_attention_f32.c, block_kernels.c, block_kernels_i8.c and
 * bf16_weights_f32.c). */
#ifndef DOLMUS_KERNELS_F32_H
#define DOLMUS_KERNELS_F32_H

#include <stdint.h>

/* Rows up to which a row-wise kernel loops on the calling thread without entering OpenMP, as
 * kernels.h's SHARED_ROWS (which says why). */
#define SHARED_ROWS 16

void dolmus_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t cols, float eps);
void dolmus_silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t cols);
void dolmus_rotary_f32(float *x, int64_t x_stride, const float *cos, const float *sin, int64_t tokens,
                       int64_t heads, int64_t d);
/* 0, or -1 when memory ran out (prefill_attention_f32.c) */
int dolmus_prefill_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                 const int64_t *block_ids, int64_t nb, const int64_t *starts, const int64_t *lens,
                                 const int64_t *contexts, int64_t nseq, float *out, int64_t out_stride, int64_t hq,
                                 int64_t hkv, int64_t d, int64_t bs, float scale);
void dolmus_decode_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                 const int64_t *block_ids, int64_t nb, const int64_t *lengths, float *out,
                                 int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale,
                                 int64_t window);
void dolmus_q4_gemm_f32(const float *x, const uint8_t *q, const float *scale, const float *minimum, float *y,
                        int64_t M, int64_t N, int64_t K);
void dolmus_q8_gemm_f32(const float *x, const int8_t *q, const float *scale, const float *minimum, float *y,
                        int64_t M, int64_t N, int64_t K, int64_t spb);
void dolmus_q4_gemm_strips_f32(const float *x, const uint8_t *q, const float *scale, const float *minimum, float *y,
                               int64_t M, int64_t N, int64_t K);
void dolmus_q8_gemm_strips_f32(const float *x, const int8_t *q, const float *scale, const float *minimum, float *y,
                               int64_t M, int64_t N, int64_t K, int64_t spb);
void dolmus_q4_gemm_i8(const float *x, const uint8_t *q, const float *scale, const float *minimum, float *y,
                       int64_t M, int64_t N, int64_t K);
void dolmus_q8_gemm_i8(const float *x, const int8_t *q, const float *scale, const float *minimum, float *y,
                       int64_t M, int64_t N, int64_t K, int64_t spb);
void dolmus_bf16w_gemm_f32(const float *x, const uint16_t *packed, const float *bias, float *y, int64_t M,
                           int64_t N, int64_t K);

#endif
