/* bf16 weights times bf16 activations on AMX tiles (x86 CPUs with AMX-BF16).
 *
 * A decode step multiplies a few activation rows by every weight of the model, so its speed
 * is how fast the weights stream from memory: oneDNN's prepacked bf16 path reaches ~75-80%
 * of the read bandwidth here at 1-32 rows, this kernel ~85-100%. Weights are packed once into
 * the layout of AMX's B tiles: panels of 32 outputs, each a sequential stream of 2 KB steps
 * of 32 inputs,
 *
 *   P[panel][kb][t][j][o][e] = w[32 panel + 16 t + o][32 kb + 2 j + e]   (t < 2, j, o < 16, e < 2)
 *
 * one 1 KB tile (t) being 16 rows of input pairs by 16 outputs; outputs past N and inputs
 * past K are zero. Activation rows go in blocks of 32 (two A tiles) per pass over a panel, so
 * a panel (K * 64 bytes) is read from memory once and from cache for later blocks. Sums are
 * float32; an optional float32 bias is added before the one rounding to bf16. Threads split
 * the panels (OpenMP: see runtime/native/__init__.py).
 *
 * A gate/up projection of an MLP may be packed gated: its two tiles of a panel are the gate
 * and the up rows of the same 16 features, and the product ends in SiLU(gate) * up for them,
 * rounded as the separate SiLU-and-multiply kernel rounds (layer_kernels.c): one pass over
 * its output instead of three.
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16_simd.h"

#define PANEL 32      /* outputs per panel */
#define KSTEP 32      /* inputs per tile step */
#define TILE 512      /* bf16 values per 1 KB tile */

/* Software prefetch this many 2 KB steps ahead of the panel being read: measured 27 GB/s at
 * 1 row against 25.8 without (the machine's read bandwidth is ~27), 23 against 20.8 at 32. */
#define PREFETCH_STEPS 4

static inline void prefetch_ahead(const uint16_t *step) {
    const char *ahead = (const char *)(step + PREFETCH_STEPS * 2 * TILE);
    for (int line = 0; line < 32; line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
}

static inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

/* w [N][K] bf16 -> P (above), zero padded to whole panels and steps. */
void dolmus_bf16_pack(const uint16_t *w, uint16_t *packed, int64_t N, int64_t K) {
    int64_t panels = round_up(N, PANEL) / PANEL, steps = round_up(K, KSTEP) / KSTEP;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kb = 0; kb < steps; kb++) {
            uint16_t *dst = packed + (p * steps + kb) * 2 * TILE;
            for (int64_t t = 0; t < 2; t++)
                for (int64_t j = 0; j < 16; j++)
                    for (int64_t o = 0; o < 16; o++)
                        for (int64_t e = 0; e < 2; e++) {
                            int64_t n = p * PANEL + 16 * t + o, k = kb * KSTEP + 2 * j + e;
                            *dst++ = n < N && k < K ? w[n * K + k] : 0;
                        }
        }
}

/* 16 sums of one output row -> bf16, plus bias, only the `valid` first ones written. */
static inline void store_row(uint16_t *y, const float *acc, const float *bias, int64_t valid) {
    __m512 v = _mm512_loadu_ps(acc);
    __mmask16 mask = valid >= 16 ? 0xFFFF : (valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out AMX state only to processes that ask: 1 when tiles may be used. */
int dolmus_amx_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* Tiles: 0-3 sums (rows 0-15 / 16-31 by outputs 0-15 / 16-31 of a panel), 4-5 activations,
 * 6-7 weights. `rows`: activation rows per A tile (M when M < 16, else 16). */
static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t >= 6 ? 16 : rows;
    }
    _tile_loadconfig(&cfg);
}

/* Rows r < 16 of one panel's two 16 x 16 float tiles (t0, t1) -> y. Plain: outputs
 * [n0, n0 + 32) = (t0, t1) plus bias. Gated: outputs [n0 / 2, n0 / 2 + 16) = SiLU(t0) * t1, each
 * rounded to bf16 first as the unfused layer's output is. */
static void store_panel(const float *t0, const float *t1, int64_t rows, const float *bias, uint16_t *y,
                        int64_t ldy, int64_t n0, int64_t N, int gated) {
    for (int64_t r = 0; r < rows; r++) {
        if (!gated) {
            store_row(y + r * ldy + n0, t0 + 16 * r, bias ? bias + n0 : NULL, N - n0);
            store_row(y + r * ldy + n0 + 16, t1 + 16 * r, bias ? bias + n0 + 16 : NULL, N - n0 - 16);
            continue;
        }
        __m512 g = _mm512_loadu_ps(t0 + 16 * r), u = _mm512_loadu_ps(t1 + 16 * r);
        if (bias) {
            g = _mm512_add_ps(g, _mm512_loadu_ps(bias + n0));
            u = _mm512_add_ps(u, _mm512_loadu_ps(bias + n0 + 16));
        }
        store_bf16x16(y + r * ldy + n0 / 2, silu_and_mul_ps(round_to_bf16(g), round_to_bf16(u)));
    }
}

/* y = x [M][K] times the packed weight: [M][N], or [M][N / 2] when gated (N % 32 == 0 then).
 * Tiles read x in whole steps of 32 inputs and, past 16 rows, whole blocks of 16 rows: other
 * shapes go through a zero-padded copy. */
void dolmus_bf16_gemm_amx(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y,
                          int64_t M, int64_t N, int64_t K, int64_t gated) {
    int64_t panels = round_up(N, PANEL) / PANEL, steps = round_up(K, KSTEP) / KSTEP, kp = steps * KSTEP;
    int64_t ldy = gated ? N / 2 : N;
    int rows = M < 16 ? (int)M : 16;
    int64_t mp = M < 16 ? M : round_up(M, 16);
    uint16_t *padded = NULL;
    if (kp != K || mp != M) {
        padded = calloc((size_t)(mp * kp), sizeof(uint16_t));
        if (!padded) return;
        for (int64_t m = 0; m < M; m++) memcpy(padded + m * kp, x + m * K, sizeof(uint16_t) * (size_t)K);
        x = padded;
    }
    int64_t stride = kp * (int64_t)sizeof(uint16_t);
#pragma omp parallel
    {
        configure(rows);
        float t0[16 * 16], t1[16 * 16];
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const uint16_t *pp = packed + p * steps * 2 * TILE;
            for (int64_t m0 = 0; m0 < mp; m0 += 32) {
                int two = mp - m0 > 16;
                _tile_zero(0);
                _tile_zero(1);
                if (two) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                const uint16_t *xa = x + m0 * kp;
                for (int64_t kb = 0; kb < steps; kb++) {
                    const uint16_t *tile = pp + kb * 2 * TILE;
                    prefetch_ahead(tile);
                    _tile_loadd(6, tile, 64);
                    _tile_loadd(7, tile + TILE, 64);
                    _tile_loadd(4, xa + kb * KSTEP, stride);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, xa + 16 * kp + kb * KSTEP, stride);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                int64_t n0 = p * PANEL, left = M - m0;
                _tile_stored(0, t0, 64);
                _tile_stored(1, t1, 64);
                store_panel(t0, t1, left < 16 ? left : 16, bias, y + m0 * ldy, ldy, n0, N, (int)gated);
                if (two) {
                    _tile_stored(2, t0, 64);
                    _tile_stored(3, t1, 64);
                    left -= 16;
                    store_panel(t0, t1, left < 16 ? left : 16, bias, y + (m0 + 16) * ldy, ldy, n0, N, (int)gated);
                }
            }
        }
        _tile_release();
    }
    free(padded);
}

#else

int dolmus_amx_ready(void) { return 0; }

void dolmus_bf16_gemm_amx(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y,
                          int64_t M, int64_t N, int64_t K, int64_t gated) {
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)gated;
    abort(); /* never called: dolmus_amx_ready() said no */
}

#endif
