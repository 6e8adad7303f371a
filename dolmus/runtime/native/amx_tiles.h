/* AMX tiles for the kernels that use them (amx_panel.h, bf16_gemm.c, quant_amx.c,
 * prefill_attention.c, and prefetch.h's distances). DOLMUS_AMX is 1 where those paths are built:
 *
 * - on the hardware: a compiler targeting AMX (-march=native on a Xeon from Sapphire Rapids on);
 * - on a software model of the six tile instructions they use (DOLMUS_AMX_EMULATE, set by
 *   cpu_profile.py under DOLMUS_AMX_EMULATE=1 on an AVX-512 BF16 CPU), so that the tile paths'
 *   layouts, loops and dispatch run, and are tested, on a CPU without AMX. It is far slower than
 *   the hardware (each tile product is a scalar loop): for tests only, never for measuring.
 *
 * The model follows Intel's pseudo-code for TDPBF16PS: for each output, the products of the even
 * and of the odd bf16 of each pair are summed apart in float32 over the tile's pairs, then their
 * sum is added to the output; bf16 denormals read as zero and denormal results are flushed to
 * zero. Intel leaves the order of the hardware's additions unspecified, so the model's last bits
 * may differ from a real tile's: tests hold both to the same tolerances. Where the hardware
 * faults (a tile used with no configuration loaded, a configuration past 16 rows or 64 bytes or
 * with reserved fields set, a product whose tiles' shapes disagree, a tile named twice) the
 * model stops the process with the reason, as the hardware's #UD or #GP would. */
#ifndef DOLMUS_AMX_TILES_H
#define DOLMUS_AMX_TILES_H

#include <immintrin.h>

#if defined(DOLMUS_AMX_EMULATE)

#define DOLMUS_AMX 1

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A thread's tiles: 8 of up to 16 rows of 64 bytes, shaped by the last configuration loaded. */
typedef struct {
    uint8_t palette; /* 0: no configuration (released) */
    uint8_t rows[8];
    uint16_t colsb[8];
    _Alignas(64) uint8_t data[8][16][64];
} amx_emulated_tiles;

/* one per thread, as the hardware's registers are (defined in bf16_gemm.c) */
extern _Thread_local amx_emulated_tiles amx_emulated;

static inline void amx_emulated_fault(const char *what) {
    fprintf(stderr, "dolmus: AMX tiles' model: %s (the hardware faults here)\n", what);
    abort();
}

/* LDTILECFG's 64 bytes: palette (byte 0), colsb (uint16 from byte 16), rows (bytes 48 on). */
static inline void amx_emulated_loadconfig(const void *config) {
    const uint8_t *c = config;
    if (c[0] > 1) amx_emulated_fault("a palette other than 0 or 1");
    for (int i = 1; i < 64; i++) /* start_row, reserved bytes, tiles 8-15: zero */
        if (c[i] && !(i >= 16 && i < 32) && !(i >= 48 && i < 56))
            amx_emulated_fault("a non-zero reserved field");
    amx_emulated.palette = c[0];
    for (int t = 0; t < 8; t++) {
        memcpy(&amx_emulated.colsb[t], c + 16 + 2 * t, sizeof(uint16_t));
        amx_emulated.rows[t] = c[48 + t];
        if (amx_emulated.rows[t] > 16 || amx_emulated.colsb[t] > 64)
            amx_emulated_fault("a tile past 16 rows of 64 bytes");
    }
    memset(amx_emulated.data, 0, sizeof amx_emulated.data);
}

static inline void amx_emulated_configured(void) {
    if (!amx_emulated.palette) amx_emulated_fault("a tile instruction with no configuration loaded");
}

static inline void amx_emulated_release(void) { memset(&amx_emulated, 0, sizeof amx_emulated); }

static inline void amx_emulated_zero(int t) {
    amx_emulated_configured();
    memset(amx_emulated.data[t], 0, sizeof amx_emulated.data[t]);
}

static inline void amx_emulated_loadd(int t, const void *base, int64_t stride) {
    amx_emulated_zero(t);
    for (int r = 0; r < amx_emulated.rows[t]; r++)
        memcpy(amx_emulated.data[t][r], (const uint8_t *)base + r * stride, amx_emulated.colsb[t]);
}

static inline void amx_emulated_stored(int t, void *base, int64_t stride) {
    amx_emulated_configured();
    for (int r = 0; r < amx_emulated.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, amx_emulated.data[t][r], amx_emulated.colsb[t]);
}

static inline float amx_emulated_bf16(uint16_t h) {
    if ((h & 0x7F80) == 0) h &= 0x8000; /* a denormal reads as zero */
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float amx_emulated_flush(float f) { return fabsf(f) < FLT_MIN ? copysignf(0.0f, f) : f; }

/* tile c (float32, rows x colsb / 4) += tile a (bf16 pairs, rows x K pairs) times tile b (K rows of
 * bf16 pairs, one pair per output) */
static inline void amx_emulated_dpbf16ps(int c, int a, int b) {
    amx_emulated_configured();
    if (c == a || c == b || a == b) amx_emulated_fault("TDPBF16PS with a tile named twice");
    if (amx_emulated.rows[c] != amx_emulated.rows[a] || amx_emulated.colsb[a] / 4 != amx_emulated.rows[b] ||
        amx_emulated.colsb[c] != amx_emulated.colsb[b])
        amx_emulated_fault("TDPBF16PS on tiles whose shapes disagree");
    int n_out = amx_emulated.colsb[c] / 4, pairs = amx_emulated.colsb[a] / 4;
    for (int m = 0; m < amx_emulated.rows[c]; m++) {
        float even[16] = {0}, odd[16] = {0};
        const uint16_t *arow = (const uint16_t *)amx_emulated.data[a][m];
        for (int k = 0; k < pairs; k++) {
            float a0 = amx_emulated_bf16(arow[2 * k]), a1 = amx_emulated_bf16(arow[2 * k + 1]);
            const uint16_t *brow = (const uint16_t *)amx_emulated.data[b][k];
            for (int n = 0; n < n_out; n++) {
                even[n] = amx_emulated_flush(even[n] + a0 * amx_emulated_bf16(brow[2 * n]));
                odd[n] = amx_emulated_flush(odd[n] + a1 * amx_emulated_bf16(brow[2 * n + 1]));
            }
        }
        float *crow = (float *)amx_emulated.data[c][m];
        for (int n = 0; n < n_out; n++)
            crow[n] = amx_emulated_flush(amx_emulated_flush(crow[n]) + amx_emulated_flush(even[n] + odd[n]));
    }
}

/* The intrinsics' names, over any the compiler's headers declare. */
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) amx_emulated_loadconfig(config)
#define _tile_release() amx_emulated_release()
#define _tile_zero(t) amx_emulated_zero(t)
#define _tile_loadd(t, base, stride) amx_emulated_loadd((t), (base), (stride))
#define _tile_stored(t, base, stride) amx_emulated_stored((t), (base), (stride))
#define _tile_dpbf16ps(c, a, b) amx_emulated_dpbf16ps((c), (a), (b))

#elif defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define DOLMUS_AMX 1
#else
#define DOLMUS_AMX 0
#endif

#endif
