/* Panels split between a parallel region's threads: each thread a contiguous run, taken front to
 * back, and a thread done with its own run takes the other runs' last panels.
 *
 * A contiguous run is the stream the prefetchers follow (a prefetch past the end of a panel lands
 * in the same thread's next one); handing panels out two at a time instead (OpenMP's dynamic
 * schedule) made each thread's stream jump, and at 16-64 rows, where the weights come from
 * memory, the products ran 5-17% slower (benchmarks/bf16_linear.py). Taking from the other end
 * keeps what a static split loses: a thread that loses its core for a while leaves its share to
 * the others instead of holding the region up.
 *
 * Each run is one 64-bit word, next (low half) and end (high half), changed by compare-and-swap:
 * the owner takes `next`, the others take `end - 1`, and a panel is taken exactly once. */
#ifndef DOLMUS_PANEL_SPLIT_H
#define DOLMUS_PANEL_SPLIT_H

#include <stdatomic.h>
#include <stdint.h>

#define SPLIT_MAX_THREADS 64

/* each run on its own cache line, so that a thread taking from its own run never moves a line
 * between cores (a one-row product takes a panel every ~2 us) */
typedef struct {
    _Alignas(64) _Atomic uint64_t word;
} split_run;

typedef struct {
    split_run runs[SPLIT_MAX_THREADS];
} panel_split;

static inline uint64_t split_word(uint64_t next, uint64_t end) { return next | end << 32; }

/* Runs for a team of T threads: one each, up to SPLIT_MAX_THREADS (threads past that only take
 * from the others' runs). */
static inline int split_runs(int T) { return T < SPLIT_MAX_THREADS ? T : SPLIT_MAX_THREADS; }

/* Thread t of T: its run of [0, panels). Every thread calls this, then waits at a barrier. */
static inline void split_init(panel_split *s, int t, int T, int64_t panels) {
    int R = split_runs(T);
    if (t >= R) return;
    uint64_t lo = (uint64_t)(panels * t / R), hi = (uint64_t)(panels * (t + 1) / R);
    atomic_store_explicit(&s->runs[t].word, split_word(lo, hi), memory_order_relaxed);
}

/* The next panel for thread t (its own run's front, else another run's back), or -1 when none
 * is left. */
static inline int64_t split_take(panel_split *s, int t, int T) {
    int R = split_runs(T);
    uint64_t w = t < R ? atomic_load_explicit(&s->runs[t].word, memory_order_relaxed) : 0;
    while ((uint32_t)w < (uint32_t)(w >> 32))
        if (atomic_compare_exchange_weak_explicit(&s->runs[t].word, &w, w + 1, memory_order_relaxed,
                                                  memory_order_relaxed))
            return (int64_t)(uint32_t)w;
    for (int i = 1; i <= R; i++) {
        _Atomic uint64_t *run = &s->runs[(t + i) % R].word;
        w = atomic_load_explicit(run, memory_order_relaxed);
        while ((uint32_t)w < (uint32_t)(w >> 32)) {
            uint64_t end = (w >> 32) - 1;
            if (atomic_compare_exchange_weak_explicit(run, &w, split_word((uint32_t)w, end), memory_order_relaxed,
                                                      memory_order_relaxed))
                return (int64_t)end;
        }
    }
    return -1;
}

#endif
