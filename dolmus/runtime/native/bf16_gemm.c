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
 * a panel (K * 64 bytes) is read from memory once and from cache for later blocks; past 32 rows
 * in chunks of K (amx_panel.h), in stretches of rows that stay in L2, and for long K with K
 * outermost (gemm_rows_deep). Sums are float32, added in the same order whatever the number of
 * rows; an optional float32 bias is added before the one rounding to bf16. Threads split the
 * panels (OpenMP: see runtime/native/__init__.py).
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
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_panel.h"
#include "amx_tiles.h" /* DOLMUS_AMX */
#include "bf16_simd.h"

/* Rows go through the panels in stretches of about this many bytes of activations, so a stretch
 * stays in L2 while every panel passes over it (the panels, 8.7 MB for a 0.5B model's down
 * projection, come from L3 again for the next stretch). Without it the rows streamed from L3 for
 * every panel once they outgrew L2: 1024 rows cost 2.4x 512 rows, and a 2048-token step budget
 * was 1.8x slower than 512 over the same prompts; now the same. */
#define SUPER_BYTES (1 << 20)
/* Products whose stretches would be shorter than this many rows go K outermost (gemm_rows_deep). */
#define DEEP_ROWS 256

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

#if DOLMUS_AMX

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#if defined(DOLMUS_AMX_EMULATE)
_Thread_local amx_emulated_tiles amx_emulated;

/* The tiles' model (amx_tiles.h) runs anywhere. */
int dolmus_amx_ready(void) { return 1; }
#else
/* Linux hands out AMX state only to processes that ask: 1 when tiles may be used. */
int dolmus_amx_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }
#endif

/* One stretch of rows (dolmus_bf16_gemm_amx) times every panel. */
static void gemm_rows(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, int64_t gated) {
    int64_t panels = round_up(N, PANEL) / PANEL, steps = round_up(K, KSTEP) / KSTEP;
    tile_rows rows;
    uint16_t *copy;
    if (tile_rows_of(x, M, K, &rows, &copy)) return;
    int chunked = M > 32;
#pragma omp parallel
    {
        configure(M < 16 ? (int)M : 16);
        float *acc = chunked ? aligned_alloc(64, (size_t)round_up(M, 32) * 32 * sizeof(float)) : NULL;
        int64_t ldy = gated ? N / 2 : N;
        if (chunked) {
            /* Panels handed out two at a time: a thread that loses its core for a while (the API
             * server and the clients share the cores) leaves its panels to the other instead of
             * holding the step at the barrier. */
#pragma omp for schedule(dynamic, 2)
            for (int64_t p = 0; p < panels; p++) {
                const uint16_t *pp = packed + p * steps * 2 * TILE;
                if (acc)
                    panel_product_chunked(pp, steps, &rows, M, bias, y, ldy, p * PANEL, N, (int)gated, acc, 0, steps,
                                          NULL);
                else /* no memory for the sums: whole-K passes */
                    panel_product(pp, steps, &rows, M, bias, y, ldy, p * PANEL, N, (int)gated, 1);
            }
        } else {
            /* Few rows: each thread one contiguous stretch of the weights, the stream the
             * prefetchers follow best. */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++)
                panel_product(packed + p * steps * 2 * TILE, steps, &rows, M, bias, y, ldy, p * PANEL, N, (int)gated,
                              1);
        }
        free(acc);
        _tile_release();
    }
    free(copy);
}

/* One stretch of many rows (M > 32) of a deep product (long K) times every panel, K outermost:
 * each thread takes a contiguous share of the panels and goes through K one chunk at a time,
 * every panel of its share through the chunk before the next, the sums of all of them parked in
 * `acc` (L2). The weights are then read from memory once per stretch, where gemm_rows, holding
 * the rows in L2 across panels, takes stretches of only ~100 rows at K = 4864 and reads the 8.7 MB
 * of a 0.5B model's down projection again for each. Same sums, same order: the same bits. */
static void gemm_rows_deep(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t M,
                           int64_t N, int64_t K, int64_t gated) {
    int64_t panels = round_up(N, PANEL) / PANEL, steps = round_up(K, KSTEP) / KSTEP, ldy = gated ? N / 2 : N;
    int64_t block = round_up(M, 32) * 32; /* floats of one panel's sums */
    tile_rows rows;
    uint16_t *copy;
    if (tile_rows_of(x, M, K, &rows, &copy)) return;
#pragma omp parallel
    {
        configure(16);
        int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t p0 = panels * t / threads, p1 = panels * (t + 1) / threads;
        float *acc = p1 > p0 ? aligned_alloc(64, (size_t)((p1 - p0) * block) * sizeof(float)) : NULL;
        for (int64_t k0 = 0; acc && k0 < steps; k0 += CHUNK_STEPS) {
            int64_t k1 = k0 + CHUNK_STEPS < steps ? k0 + CHUNK_STEPS : steps;
            for (int64_t p = p0; p < p1; p++) {
                const uint16_t *pp = packed + p * steps * 2 * TILE;
                /* next: the following panel's chunk, or the first panel's next chunk */
                const uint16_t *next = p + 1 < p1 ? pp + (steps + k0) * 2 * TILE
                                       : k1 < steps ? packed + (p0 * steps + k1) * 2 * TILE
                                                    : NULL;
                panel_product_chunked(pp, steps, &rows, M, bias, y, ldy, p * PANEL, N, (int)gated,
                                      acc + (p - p0) * block, k0, k1, next);
            }
        }
        if (!acc) /* no memory for the sums: whole-K passes */
            for (int64_t p = p0; p < p1; p++)
                panel_product(packed + p * steps * 2 * TILE, steps, &rows, M, bias, y, ldy, p * PANEL, N, (int)gated,
                              1);
        free(acc);
        _tile_release();
    }
    free(copy);
}

/* y = x [M][K] times the packed weight: [M][N], or [M][N / 2] when gated (N % 32 == 0 then). */
void dolmus_bf16_gemm_amx(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y,
                          int64_t M, int64_t N, int64_t K, int64_t gated) {
    int64_t kp = round_up(K, KSTEP), rows = SUPER_BYTES / (kp * (int64_t)sizeof(uint16_t)) / 32 * 32;
    int64_t width = gated ? N / 2 : N;
    if (rows < DEEP_ROWS && M > 32) {
        /* stretches whose sums, a thread's share of the panels, take about SUPER_BYTES */
        int64_t share = (round_up(N, PANEL) / PANEL + omp_get_max_threads() - 1) / omp_get_max_threads();
        rows = SUPER_BYTES / (share * PANEL * (int64_t)sizeof(float)) / 32 * 32;
        if (rows < 64) rows = 64;
        for (int64_t m0 = 0; m0 < M; m0 += rows)
            gemm_rows_deep(x + m0 * K, packed, bias, y + m0 * width, M - m0 < rows ? M - m0 : rows, N, K, gated);
        return;
    }
    if (rows < 64) rows = 64; /* fewer rows per pass would stream the panels too often */
    for (int64_t m0 = 0; m0 < M; m0 += rows)
        gemm_rows(x + m0 * K, packed, bias, y + m0 * width, M - m0 < rows ? M - m0 : rows, N, K, gated);
}

#else

int dolmus_amx_ready(void) { return 0; }

void dolmus_bf16_gemm_amx(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y,
                          int64_t M, int64_t N, int64_t K, int64_t gated) {
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)gated;
    abort(); /* never called: dolmus_amx_ready() said no */
}

#endif
