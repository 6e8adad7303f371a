/* bf16 <-> float32 on AVX-512 and the float math the C kernels share (layer_kernels.c,
 * bf16_gemm.c). Kernels compute in float32 and round to bf16 where PyTorch's bf16 code rounds. */
#ifndef DOLMUS_BF16_SIMD_H
#define DOLMUS_BF16_SIMD_H

#include <stdint.h>
#include <immintrin.h>

static inline __m512 load_bf16x16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store_bf16x16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

/* Lanes [0, valid) of 16: none for valid <= 0, all from 16 on (a row's last, partial vector). */
static inline __mmask16 first_lanes(int64_t valid) {
    return valid >= 16 ? 0xFFFF : (valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1));
}

/* 16 floats -> bf16 at y, only the first `valid` written. */
static inline void store_bf16(uint16_t *y, __m512 v, int64_t valid) {
    _mm256_mask_storeu_epi16(y, first_lanes(valid), (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __m512 round_to_bf16(__m512 v) {
    __m256bh h = _mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

/* e^x in float32 to about one ulp: 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in
 * two parts), p a degree-7 Taylor polynomial on |r| <= ln 2 / 2. Large negative x gives 0,
 * large positive x gives inf (scalef saturates), as expf does. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(89.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* SiLU of every bf16 value, rounded to bf16: entry b is silu(x) for the x whose bf16 bits are
 * b, computed once (layer_kernels.c, when the library loads) as x / (1 + exp_ps(-x)) in float32.
 * A gated projection's epilogue looked it up instead of computing it: the exp and the division
 * were ~30% of a gate/up product at 512 rows, a gather is a few cycles. One entry more than
 * 65536, as the gather reads four bytes at each. */
extern uint16_t dolmus_silu_table[65536 + 1];

/* silu(gate) rounded to bf16, times up: PyTorch's bf16 SiLU then its product (gate and up
 * hold bf16 values; the caller rounds the product as it stores it). */
static inline __m512 silu_and_mul_ps(__m512 gate, __m512 up) {
    __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(gate), 16);
    __m512i silu = _mm512_i32gather_epi32(bits, (const void *)dolmus_silu_table, 2);
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(silu, 16)), up);
}

/* The 64 bytes of one pair of inputs (k, k + 1) of a block -> 4 vectors of 16 lanes, lane i of
 * vector v holding the bf16 pair (128 + q[16v + i][k], 128 + q[16v + i][k + 1]). Nibbles are
 * split with two ANDs and a shift, and 0x43 is interleaved in as every bf16's high byte. */
static inline void nibbles_to_bf16_pairs(const uint8_t *c, __m512bh w[4]) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), high_byte = _mm512_set1_epi8(0x43);
    __m512i b = _mm512_loadu_si512((const void *)c);
    __m512i lo = _mm512_and_si512(b, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
    w[0] = (__m512bh)_mm512_unpacklo_epi8(lo, high_byte);
    w[1] = (__m512bh)_mm512_unpackhi_epi8(lo, high_byte);
    w[2] = (__m512bh)_mm512_unpacklo_epi8(hi, high_byte);
    w[3] = (__m512bh)_mm512_unpackhi_epi8(hi, high_byte);
}

static inline __m512 int8x16_to_ps(const int8_t *c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
}

/* Inputs k and k + 1 of 16 outputs (two 16-byte runs of int8 codes) -> 16 lanes of bf16 pairs.
 * Codes are small integers, exact in bf16: a float's top 16 bits are its bf16 bits. */
static inline __m512bh int8_pairs_to_bf16(const int8_t *ck, const int8_t *ck1) {
    __m512i a = _mm512_castps_si512(int8x16_to_ps(ck)), b = _mm512_castps_si512(int8x16_to_ps(ck1));
    /* imm 0xE4 = (A & C) | (B & ~C): high words from b, low words from a >> 16 */
    return (__m512bh)_mm512_ternarylogic_epi32(b, _mm512_srli_epi32(a, 16), _mm512_set1_epi32((int)0xFFFF0000), 0xE4);
}

#endif
