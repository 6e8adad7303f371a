/* bf16 weights times bf16 activations with AVX-512 BF16's dot product (vdpbf16ps), for x86
 * CPUs without AMX (AMD Zen 4/5, Intel Cooper Lake), on the weights bf16_gemm.c packs for AMX.
 *
 * In that layout a step of 32 inputs of a panel is two 1 KB tiles, and row j of tile t holds the
 * input pair (2j, 2j + 1) of the panel's outputs 16t .. 16t + 15: 64 bytes, 16 lanes of bf16
 * pairs, exactly one operand of vdpbf16ps. With an activation row's pair broadcast to all 16
 * lanes, one instruction adds w[o][2j] x[2j] + w[o][2j + 1] x[2j + 1] to the float32 sums of the
 * 16 outputs. A block of up to ROWS activation rows shares every weight load (2 ROWS sums in
 * registers); a decode step (up to ROWS rows) is then a single pass over the weights, on the huge
 * pages the packed copy lives on: for one or two rows in the order the bytes lie, which the
 * cores' prefetchers follow alone (seq_steps), for more asked for ahead (SINGLE_BLOCK_AHEAD,
 * FIRST_BLOCK_AHEAD).
 * Panels are split between threads; rows go in stretches that stay in L2 while every panel passes
 * over them, and never under MIN_STRETCH rows.
 *
 * The sums are float32 in a fixed order (pairs of inputs, steps in order) whatever the number
 * of rows, so a row's result does not depend on its batch; bias and the gated epilogue
 * (SiLU(gate) * up) round as bf16_gemm.c's do.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

#include "amx_panel.h"
#include "bf16_simd.h"
#include "kernels.h"
#include "panel_split.h"
#include "prefetch.h"

#define ROWS 8                  /* activation rows per block: 16 sums in registers */
_Static_assert(TEAM_ROWS <= ROWS, "team_bf16_run keeps one block of sums");
#define STRETCH_BYTES (1 << 19) /* activations per stretch of rows: half of a 1 MB L2 */
/* Each stretch reads all of the weights again: a down projection's long rows (4864 inputs) made
 * stretches of 48 rows, and re-reading its 8.7 MB weights cost more than activations read from
 * L3 instead of L2 (stretches of at least 512 rows: 845 -> 961 GF/s at 128 rows, 873 -> 980 at
 * 512; the layers of 896 inputs, 288 rows to L2, measured the same either way). */
#define MIN_STRETCH 512
/* The first block of rows (the only one in a decode step of 1-8 sequences) asks for its weights
 * ahead into L2 like every block, and also for two lines this far ahead with each pair of loads. A
 * single block used to ask for each step 8 KB (into L2) and 4 KB (into L1) ahead, 64 requests at
 * the start of the step; from 4 rows on, where a step's dot products take as long as its bytes
 * take to arrive, the two hardly overlapped. On a Zen 4 (2 cores; one call over 700 MB of weights,
 * interleaved with a plain sum of the same bytes): 8 rows 25-26 -> 32-35 GB/s where the sum read
 * ~34 (the same as it), 29-30 -> 40-45 where it read ~58; 4 rows 27-28 -> 33-35 and 33 -> 53-57;
 * one row 30-32 -> 32-34 and 41-46 -> 50-51. A decode step of 8 sequences in process: 28.5-31.3 ->
 * 21.5-25.5 ms. Either request alone did less (the chunk ahead: 29 GB/s at 8 rows and ~34 of sum;
 * the two lines alone, kept in place with inline asm: 21.5; a rolled loop: 30); 8, 16 and 24 KB
 * read as 12. These are hints, and where GCC schedules them mattered as much: measure a change of
 * this loop's shape. The first of several blocks asking too: 16 rows 21.6 -> 22.9 GB/s, 32 rows
 * 12.1 -> 12.4; decode steps in process of 16 sequences 36.2-36.8 -> 33.2-35.3 ms, of 32 about the
 * same (62-68 ms). */
#define FIRST_BLOCK_AHEAD 12288
/* A single block (every row of the product in one block) asks for its weights this many steps
 * (16 KB) ahead into L2, not a chunk (128 KB) ahead: the chunk is for the blocks that follow the
 * first through it, and a single block has none. A thread's first 128 KB of each product then came
 * only on the FIRST_BLOCK_AHEAD stream, and its last 128 KB of requests went past its share (into
 * the other thread's, or past the matrix); in a q/k/v or output projection of a 0.5B model (1-2
 * MB, half a thread) that was a quarter of its bytes. On a Zen 4 (2 cores; the 96 products of a
 * 0.5B body's decode step on weights out of cache, interleaved, where a plain sum read 47-54 GB/s):
 * one row 16.1-18.9 -> 15.2-16.8 ms (q/k/v 28-31 -> 35-39 GB/s, output 27-33 -> 36-38, down
 * 40-47 -> 42-48, gate/up the same), 2 and 4 rows 5-10% faster, 8 rows about 5%; 4 steps and 16
 * read about as 8, where the sum read ~32 GB/s all were within 3%. */
#define SINGLE_BLOCK_AHEAD 8
#ifndef CHUNK_STEPS
/* steps of 32 inputs per chunk: a panel's chunk is 128 KB, held in L2 while every block passes
 * over it (a layer of 896 inputs is one chunk). Each block stores its sums once a chunk (and loads
 * them again for every chunk but the first), and the sums, not L2's bandwidth, were what shorter
 * chunks paid for: against chunks of 16 steps (32 KB, held in L1), on a Zen 4 (32 KB of L1) 1-5%
 * faster from 8 rows up on weights in cache and the same or faster from memory (16 rows: q/k/v 110
 * -> 95 us), a 2,048-token prompt 3.96-3.99 -> 3.87-3.96 s; 8 steps lost 3-4% against 16 there (on
 * a Zen 5, 16 had been 1-4% faster than 8 from 64 rows up). A library built for AMX takes
 * amx_panel.h's 8 instead, for the rare host that refuses the tiles. */
#define CHUNK_STEPS 64
#endif

static inline __m512bh pair_of(const uint16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* Steps [k0, k1) of rows [0, R) of x (rows ldx apart, whole steps of 32 inputs) times panel pp,
 * added to the sums in acc (R rows of 32 floats: outputs 0-15, then 16-31), or stored there when
 * k0 is 0 (clearing acc before each panel, 4 KB at 32 rows, was 2% of a decode step of 32
 * sequences). R is a constant at each call site, so the loops over rows unroll and the sums stay
 * in registers. Lines [pf_lo, pf_hi) of each step's 32 are asked for a chunk ahead (into L2; a single
 * block SINGLE_BLOCK_AHEAD steps ahead), and the block whose share starts at line 0 also asks for
 * two lines FIRST_BLOCK_AHEAD ahead with each pair of loads, and (but for a single block of 5-8
 * rows) brings the next steps into L1. */
static inline __attribute__((always_inline)) void dp_steps(const uint16_t *pp, int64_t k0, int64_t k1,
                                                              const uint16_t *x, int64_t ldx, const int R,
                                                              float *acc, int pf_lo, int pf_hi) {
    __m512 s[ROWS][2];
    for (int r = 0; r < R; r++) {
        s[r][0] = k0 ? _mm512_loadu_ps(acc + 32 * r) : _mm512_setzero_ps();
        s[r][1] = k0 ? _mm512_loadu_ps(acc + 32 * r + 16) : _mm512_setzero_ps();
    }
    /* the next steps into L1 for the first of several blocks, and for a single block of up to 4
     * rows; a single block of 5-8 rows, whose dot products take as long as its bytes take to
     * arrive, reads faster without (Zen 4, a decode step's products at 8 rows, host's sum ~50 GB/s:
     * 17.8-22.5 -> 17.0-18.9 ms; ~32 GB/s: 23.0-24.8 -> 22.5-23.6; at 1-4 rows the burst is worth
     * 5-15%). A share starting at line 0 is the first block's; past 32 blocks, shares of no line
     * (pf_lo == pf_hi == 0) ask for nothing. */
    const int near = pf_lo == 0 && pf_hi > 0 && (R <= 4 || pf_hi < 32);
    for (int64_t kb = k0; kb < k1; kb++) {
        const uint16_t *w = pp + kb * 2 * TILE, *xk = x + kb * KSTEP;
        /* _mm_prefetch written out: through prefetch.h's helper, before its requests were volatile
         * asm, GCC 12 emitted no prefetch at all in this file (benchmarks/bf16_linear.py:
         * 0.74-0.90x oneDNN at 4-64 rows). `ahead` is loop-invariant, yet set beside `near` GCC
         * laid the loop out differently; kept as measured. */
        const int64_t ahead = pf_hi - pf_lo == 32 ? SINGLE_BLOCK_AHEAD : CHUNK_STEPS;
        for (int i = pf_lo; i < pf_hi; i++)
            _mm_prefetch((const char *)(w + ahead * 2 * TILE) + 64 * i, _MM_HINT_T1);
        if (near)
            for (int i = 0; i < 32; i++) _mm_prefetch((const char *)w + PREFETCH_NEAR + 64 * i, _MM_HINT_T0);
        for (int j = 0; j < 16; j++) {
            if (pf_lo == 0 && pf_hi > 0) { /* lines 2j, 2j + 1 of the step FIRST_BLOCK_AHEAD on */
                _mm_prefetch((const char *)w + FIRST_BLOCK_AHEAD + 128 * j, _MM_HINT_T1);
                _mm_prefetch((const char *)w + FIRST_BLOCK_AHEAD + 128 * j + 64, _MM_HINT_T1);
            }
            __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(w + 32 * j));
            __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(w + TILE + 32 * j));
            for (int r = 0; r < R; r++) {
                __m512bh xr = pair_of(xk + r * ldx + 2 * j);
                s[r][0] = _mm512_dpbf16_ps(s[r][0], xr, w0);
                s[r][1] = _mm512_dpbf16_ps(s[r][1], xr, w1);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(acc + 32 * r, s[r][0]);
        _mm512_storeu_ps(acc + 32 * r + 16, s[r][1]);
    }
}

static void dp_steps_any(const uint16_t *pp, int64_t k0, int64_t k1, const uint16_t *x, int64_t ldx, int64_t R,
                            float *acc, int pf_lo, int pf_hi) {
    switch (R) {
    case 1: dp_steps(pp, k0, k1, x, ldx, 1, acc, pf_lo, pf_hi); break;
    case 2: dp_steps(pp, k0, k1, x, ldx, 2, acc, pf_lo, pf_hi); break;
    case 3: dp_steps(pp, k0, k1, x, ldx, 3, acc, pf_lo, pf_hi); break;
    case 4: dp_steps(pp, k0, k1, x, ldx, 4, acc, pf_lo, pf_hi); break;
    case 5: dp_steps(pp, k0, k1, x, ldx, 5, acc, pf_lo, pf_hi); break;
    case 6: dp_steps(pp, k0, k1, x, ldx, 6, acc, pf_lo, pf_hi); break;
    case 7: dp_steps(pp, k0, k1, x, ldx, 7, acc, pf_lo, pf_hi); break;
    default: dp_steps(pp, k0, k1, x, ldx, ROWS, acc, pf_lo, pf_hi); break;
    }
}

/* At most this many rows read a panel in seq_steps' order: on a Zen 4 (2 cores; the 96 one-row
 * products of a 0.5B body's decode step, back to back on weights out of cache, interleaved with
 * the chunked order in one process), 1 row read 1.20-1.22x as fast where a plain sum read ~60 GB/s
 * (as fast as the sum) and 1.05x at ~33 GB/s; 2 rows 1.08-1.10x and 1.03x; 4 rows 0.91-0.96x and
 * the same; 8 rows 0.82x and 0.97x (each row's pair broadcast per line there, not per two). */
#ifndef SEQ_ROWS
#define SEQ_ROWS 2
#endif
_Static_assert(SEQ_ROWS <= 2, "seq_steps keeps the sums of at most 2 rows");

/* Rows [0, R) of x times a whole panel into acc, as dp_steps leaves it, its bytes read in the
 * order they lie (tile 0 of a step, then tile 1, then the next step) by loops that are not
 * unrolled: each load instruction sees addresses 64 bytes apart, one after another, the pattern
 * the cores' own prefetchers follow, and no request is written out. (dp_steps reads a step's two
 * tiles side by side, to broadcast each pair of inputs once for both, and unrolled, so each of its
 * loads jumps 2 KB at a time, a stream the prefetchers do not follow: ~21 GB/s without its
 * requests where a sum read ~60.) One sum per row and tile, steps and pairs in dp_steps' order:
 * the same bits.
 *
 * One row also asks for each line ONE_ROW_AHEAD bytes on, into L2 (prefetch.h): where the host
 * gives ~60 GB/s the prefetchers alone kept too few lines in flight (likely because each tile's
 * 16 products are one chain of dependent sums, so the core's own loads run only a few KB ahead
 * of them). A 0.5B body's decode on a Zen 4, with and without the request taking turns step by
 * step in one process (2,000 steps a run, four runs): steps 3-4% shorter where the host gave ~60
 * GB/s (median of each step over the one before it; shorter in 80-85% of the pairs), 0-1% at ~33
 * GB/s; 1 KB or 4 KB ahead read ~1% less than 2 KB. Two rows read 1-2% less with it, so they go
 * without. */
static inline __attribute__((always_inline)) void seq_steps(const uint16_t *pp, int64_t steps, const uint16_t *x,
                                                               int64_t ldx, const int R, float *acc) {
    __m512 a[2], c[2]; /* this tile's sums, the other tile's */
    for (int r = 0; r < R; r++) a[r] = c[r] = _mm512_setzero_ps();
    const uint16_t *w = pp;
#pragma GCC unroll 1
    for (int64_t h = 0; h < 2 * steps; h++, w += TILE) {
        const uint16_t *xk = x + (h >> 1) * KSTEP;
#pragma GCC unroll 1
        for (int j = 0; j < 16; j++) {
            if (R == 1 && ONE_ROW_AHEAD) _mm_prefetch((const char *)(w + 32 * j) + ONE_ROW_AHEAD, _MM_HINT_T1);
            __m512bh wj = (__m512bh)_mm512_loadu_si512((const void *)(w + 32 * j));
            for (int r = 0; r < R; r++) a[r] = _mm512_dpbf16_ps(a[r], pair_of(xk + r * ldx + 2 * j), wj);
        }
        for (int r = 0; r < R; r++) {
            __m512 t = a[r];
            a[r] = c[r];
            c[r] = t;
        }
    }
    for (int r = 0; r < R; r++) { /* an even number of tiles: a holds tile 0's */
        _mm512_storeu_ps(acc + 32 * r, a[r]);
        _mm512_storeu_ps(acc + 32 * r + 16, c[r]);
    }
}

/* Rows [0, M) (any M) of one panel -> y. The panel goes through in chunks of CHUNK_STEPS steps
 * (held in L2), every block of ROWS rows through a chunk before the next: the weights
 * come from memory once, the sums wait in `acc` (M rounded up to ROWS, times 32 floats).
 * Every block asks for its share of the next chunk's lines: when the first block asked for all
 * of them, the requests came in a burst over a quarter of the time at 32 rows (the misses a core
 * keeps in flight are few) and the rest of the time fetched nothing; spread out, 16-64 rows
 * went from 61-75% to 72-90% of the product's speed on weights in cache (gemm at 16 rows
 * 455 -> 570 GF/s, at 32 rows 606 -> 731 GF/s, Qwen2.5-0.5B's q/k/v, weights from memory). */
static void panel_product_avx512(const uint16_t *pp, int64_t steps, const uint16_t *x, int64_t ldx, int64_t M,
                                 const float *bias, uint16_t *y, int64_t ldy, int64_t n0, int64_t N, int gated,
                                 float *acc) {
    int64_t blocks = (M + ROWS - 1) / ROWS;
    if (M <= SEQ_ROWS) { /* R a constant at each call, as dp_steps_any's */
        if (M == 1)
            seq_steps(pp, steps, x, ldx, 1, acc);
        else
            seq_steps(pp, steps, x, ldx, 2, acc);
    } else
        for (int64_t k0 = 0; k0 < steps; k0 += CHUNK_STEPS) {
            int64_t k1 = k0 + CHUNK_STEPS < steps ? k0 + CHUNK_STEPS : steps;
            for (int64_t m0 = 0, b = 0; m0 < M; m0 += ROWS, b++)
                dp_steps_any(pp, k0, k1, x + m0 * ldx, ldx, M - m0 < ROWS ? M - m0 : ROWS, acc + 32 * m0,
                             (int)(32 * b / blocks), (int)(32 * (b + 1) / blocks));
        }
    for (int64_t r = 0; r < M; r++) {
        const float *a = acc + 32 * r;
        uint16_t *row = y + r * ldy;
        if (!gated) {
            store_row(row + n0, a, bias ? bias + n0 : NULL, N - n0);
            store_row(row + n0 + 16, a + 16, bias ? bias + n0 + 16 : NULL, N - n0 - 16);
            continue;
        }
        __m512 g = _mm512_loadu_ps(a), u = _mm512_loadu_ps(a + 16);
        if (bias) {
            g = _mm512_add_ps(g, _mm512_loadu_ps(bias + n0));
            u = _mm512_add_ps(u, _mm512_loadu_ps(bias + n0 + 16));
        }
        store_bf16x16(row + n0 / 2, silu_and_mul_ps(round_to_bf16(g), round_to_bf16(u)));
    }
}

/* y = x [M][K] times the packed weight: [M][N], or [M][N / 2] when gated (N % 32 == 0 then). */
void dolmus_bf16_gemm_avx512(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t M,
                             int64_t N, int64_t K, int64_t gated) {
    int64_t panels = round_up(N, PANEL) / PANEL, kp = round_up(K, KSTEP), steps = kp / KSTEP;
    int64_t ldy = gated ? N / 2 : N;
    uint16_t *copy = NULL;
    if (kp != K) { /* rows padded to whole steps with zeros (the packed weights' padding is zero too) */
        copy = calloc((size_t)(M * kp), sizeof(uint16_t));
        if (!copy) abort();
        for (int64_t m = 0; m < M; m++) memcpy(copy + m * kp, x + m * K, sizeof(uint16_t) * (size_t)K);
        x = copy;
    }
    int64_t stretch = STRETCH_BYTES / (kp * (int64_t)sizeof(uint16_t)) / ROWS * ROWS;
    if (stretch < MIN_STRETCH) stretch = MIN_STRETCH;
    for (int64_t m0 = 0; m0 < M; m0 += stretch) {
        int64_t rows = M - m0 < stretch ? M - m0 : stretch;
        const uint16_t *xs = x + m0 * kp;
        uint16_t *ys = y + m0 * ldy;
        /* each thread a contiguous run of panels, the stream the prefetchers follow, and the
         * runs' last panels to whichever thread is done first (panel_split.h) */
        panel_split split;
#pragma omp parallel
        {
            int t = omp_get_thread_num(), T = omp_get_num_threads();
            float *acc = aligned_alloc(64, sizeof(float) * 32 * (size_t)round_up(rows, ROWS));
            if (!acc) abort();
            split_init(&split, t, T, panels);
#pragma omp barrier
            for (int64_t p; (p = split_take(&split, t, T)) >= 0;)
                panel_product_avx512(packed + p * steps * 2 * TILE, steps, xs, kp, rows, bias, ys, ldy, p * PANEL, N,
                                     (int)gated, acc);
            free(acc);
        }
    }
    free(copy);
}

/* The one-region step's form (kernels.h): rows padded to whole steps into ws where K needs it. */
int64_t team_bf16_panels(int64_t N) { return round_up(N, PANEL) / PANEL; }

void team_bf16_prep(const uint16_t *x, int64_t M, int64_t K, void *ws) {
    int64_t kp = round_up(K, KSTEP);
    if (kp == K) return;
    memset(ws, 0, sizeof(uint16_t) * (size_t)(M * kp));
    for (int64_t m = 0; m < M; m++) memcpy((uint16_t *)ws + m * kp, x + m * K, sizeof(uint16_t) * (size_t)K);
}

void team_bf16_run(const uint16_t *x, const void *ws, const uint16_t *packed, const float *bias, uint16_t *y,
                   int64_t M, int64_t N, int64_t K, int64_t gated, panel_split *split, int t, int T) {
    int64_t kp = round_up(K, KSTEP), steps = kp / KSTEP;
    const uint16_t *xs = kp == K ? x : ws;
    _Alignas(64) float acc[32 * ROWS]; /* TEAM_ROWS <= ROWS: one block of rows */
    for (int64_t p; (p = split_take(split, t, T)) >= 0;)
        panel_product_avx512(packed + p * steps * 2 * TILE, steps, xs, kp, M, bias, y, gated ? N / 2 : N, p * PANEL, N,
                             (int)gated, acc);
}

int bf16_on_amx(void) {
    static int amx = -1;
    if (amx < 0) amx = dolmus_amx_ready();
    return amx;
}

/* The tile-packed product on the best unit the CPU has: AMX tiles where the kernels were built
 * with them and Linux grants them, else vdpbf16ps. */
void dolmus_bf16_gemm(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t M,
                      int64_t N, int64_t K, int64_t gated) {
    if (bf16_on_amx())
        dolmus_bf16_gemm_amx(x, packed, bias, y, M, N, K, gated);
    else
        dolmus_bf16_gemm_avx512(x, packed, bias, y, M, N, K, gated);
}
