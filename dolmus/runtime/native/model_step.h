/* The rows of one step of a Llama-family model for decode_step.c and decode_step_f32.c: decodes
 * (one new token of a sequence each) first, then prompt chunks, and which rows the last layer
 * carries on (runtime/native/decode_step.py fills it). */
#ifndef DOLMUS_MODEL_STEP_H
#define DOLMUS_MODEL_STEP_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t rows;                               /* tokens in the step */
    const int64_t *tokens, *positions, *slots;  /* [rows]; slots: where each key and value go */
    int64_t decodes;                            /* rows [0, decodes): one new token of a sequence each */
    const int64_t *block_ids;                   /* [decodes][nb]: what each decode attends to */
    int64_t nb;
    const int64_t *lengths;                     /* [decodes]: its position + 1 */
    int64_t chunks;                             /* prompt chunks: rows [decodes, rows) */
    const int64_t *chunk_blocks;                /* [chunks][chunk_nb] */
    int64_t chunk_nb;
    const int64_t *starts, *lens, *contexts;    /* [chunks]: first row, tokens, positions cached before */
    int64_t kept;                               /* rows that come out of the last layer (0 to rows) */
    const int64_t *keep;                        /* [kept] ascending; read only where kept < rows */
} dolmus_step;

/* A decode step's rows from the runner's block table, worked out here rather than in Python
 * (whose small numpy and torch calls, run right after a step has streamed the weights through
 * the caches, cost tens of microseconds each): rows [3][n], each sequence's new token, its
 * position and its seat (row) in table [seats][width], blocks of bs positions. Fills s over
 * an allocation (slots [n], lengths [n], block ids [n][nb], nb = the longest context's blocks)
 * that the caller frees, or returns NULL (memory). */
static inline int64_t *seat_rows(dolmus_step *s, int64_t n, const int64_t *rows, const int64_t *table, int64_t width,
                                 int64_t bs) {
    const int64_t *tokens = rows, *positions = rows + n, *seats = rows + 2 * n;
    int64_t longest = 0;
    for (int64_t i = 0; i < n; i++) longest = positions[i] > longest ? positions[i] : longest;
    int64_t nb = longest / bs + 1;
    int64_t *scratch = malloc(sizeof(int64_t) * (size_t)(n * (2 + nb)));
    if (!scratch) return NULL;
    int64_t *slots = scratch, *lengths = scratch + n, *block_ids = scratch + 2 * n;
    for (int64_t i = 0; i < n; i++) {
        const int64_t *row = table + seats[i] * width;
        slots[i] = row[positions[i] / bs] * bs + positions[i] % bs;
        lengths[i] = positions[i] + 1;
        memcpy(block_ids + i * nb, row, sizeof(int64_t) * (size_t)nb);
    }
    *s = (dolmus_step){n, tokens, positions, slots, n, block_ids, nb, lengths, 0, NULL, 0, NULL, NULL, NULL, n, NULL};
    return scratch;
}

/* Rows keep[0..kept) of x (rows of row_bytes) become its rows [0, kept): for the attention
 * output and the residual stream, the two inputs of what follows attention in the last layer.
 * keep ascends, so no row is overwritten before it is moved. */
static inline void keep_rows(void *x, size_t row_bytes, const int64_t *keep, int64_t kept) {
    char *rows = x;
    for (int64_t j = 0; j < kept; j++)
        if (keep[j] != j) memmove(rows + (size_t)j * row_bytes, rows + (size_t)keep[j] * row_bytes, row_bytes);
}

#endif
