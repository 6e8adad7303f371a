/* Software prefetch for the weight streams of the AVX-512 kernels (quant_kernels.c,
 * quant_amx.c, and the bf16 tile panels of amx_panel.h).
 *
 * A weight block is one sequential stream, yet on the machines here the hardware prefetchers
 * alone kept it at ~9 GB/s from DRAM against ~30 GB/s of read bandwidth: each byte costs the
 * kernels a few instructions, so too few lines are in flight, and the L2 streamer stops at
 * every 4 KB page. Asking for each line twice, far ahead into L2 and nearer into L1, measured
 * ~20 GB/s at one row on a Qwen2.5-0.5B-shaped Q8_0 body (24 layers, 380 MB, out of cache;
 * int4 7.4 -> 17.5 GB/s), and the bf16 body's decode went from 35.8 to 37.6 tok/s against one
 * near T0 prefetch; the distances were swept (1-64 KB far, 1-8 KB near) and 16 KB / 4 KB were the
 * best there; without AMX the far distance is 8 KB (below). Prefetches past the end of a block
 * land in the next block, usually the same thread's next one. */
#ifndef DOLMUS_PREFETCH_H
#define DOLMUS_PREFETCH_H

#include <stdint.h>
#include <immintrin.h>

#include "amx_tiles.h"

#if DOLMUS_AMX
#define PREFETCH_FAR 16384
#else
/* Without AMX (AMD Zen 4/5): half as far. On a Zen 4 (2 cores, 32 KB of L1), the one-row bf16
 * products of a 0.5B body's 24 layers, back to back on weights out of cache, read 85-87% of what a
 * plain sum streams where the host gave ~63 GB/s, against 71-75% 16 KB ahead (91-97% against
 * 88-94% at ~36 GB/s; interleaved rounds, scratch harness); 4-6 and 12 KB far, 2 and 6 KB near,
 * and the far request on every other line all read less. On a Zen 5, 8 and 16 KB had measured
 * the same. The AMX hosts keep the distance tuned there. (Those bf16 products now read one or
 * two rows' weights in the order they lie and ask for nothing, bf16_gemm_avx512.c's seq_steps,
 * and ask for more rows' their own way, its FIRST_BLOCK_AHEAD; the int8 and int4 kernels here
 * keep these distances.) */
#define PREFETCH_FAR 8192
#endif
#define PREFETCH_NEAR 4096

/* One row's weight stream, the kernels' decode at one user. Without AMX (tuned on a Zen 4, each
 * form against the other step by step in one process; the kernels' comments give the figures):
 * bf16 panels and per-row int8 codes, read in the order they lie, also ask for each line
 * ONE_ROW_AHEAD bytes on into L2; int4 blocks, whose unpacking takes long enough a line that the
 * cores' prefetchers keep up, ask for nothing (ONE_ROW_STREAM 0); grouped int8 blocks take
 * prefetch_stream everywhere (int8g_kernels.c). AMX hosts keep what they had: no request ahead
 * for bf16 and int8, prefetch_stream for the blocks (on an AMX Xeon, 2026-12-07, the int4 blocks
 * at one row without it made a one-sequence Q4_0 step of the 0.5B body 12 -> 19 ms). */
#if DOLMUS_AMX
#define ONE_ROW_AHEAD 0
#define ONE_ROW_STREAM 1
#else
#define ONE_ROW_AHEAD 2048
#define ONE_ROW_STREAM 0
#endif

/* One line asked for into L2 (prefetcht1) or L1 (prefetcht0), as an instruction the compiler must
 * keep. GCC 12 deletes _mm_prefetch (__builtin_prefetch) as dead code from some loops after
 * inlining: the int4 and per-row int8 products had lost every request they were written with
 * (0 prefetch instructions in quant_kernels.c and int8_kernels.c, -fno-tree-dce brought them
 * back), which on an AMX Xeon made a one-sequence Q4_0 decode step of the 0.5B body 12 -> 18 ms.
 * A volatile asm is never removed; it has no outputs and clobbers nothing, so the loads around it
 * still move freely. */
static inline __attribute__((always_inline)) void prefetch_l2(const void *at) {
    __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)at));
}
static inline __attribute__((always_inline)) void prefetch_l1(const void *at) {
    __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)at));
}

/* The `lines` cache lines from `at` are about to be read: ask for the lines that far ahead. */
static inline void prefetch_stream(const void *at, int lines) {
    for (int i = 0; i < lines; i++) {
        prefetch_l2((const char *)at + PREFETCH_FAR + 64 * i);
        prefetch_l1((const char *)at + PREFETCH_NEAR + 64 * i);
    }
}

/* The int4 and grouped int8 blocks' scales and zeros (bf16 [groups][npad], zero NULL for none):
 * ask for the 64 of outputs [n0, n0 + 64), a line pair in each group's row, before their block. */
static inline void prefetch_block_scales(const uint16_t *scale, const uint16_t *zero, int64_t groups, int64_t npad,
                                         int64_t n0) {
    for (int64_t g = 0; g < groups; g++) {
        const char *sa = (const char *)(scale + g * npad + n0);
        prefetch_l2(sa), prefetch_l2(sa + 64);
        if (zero) {
            const char *za = (const char *)(zero + g * npad + n0);
            prefetch_l2(za), prefetch_l2(za + 64);
        }
    }
}

#endif
