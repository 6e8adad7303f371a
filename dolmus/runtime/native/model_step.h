/* The rows of one step of a Llama-family model for decode_step.c and decode_step_f32.c: decodes
 * (one new token of a sequence each) first, then prompt chunks, and which rows the last layer
 * carries on (runtime/native/decode_step.py fills it). */
#ifndef DOLMUS_MODEL_STEP_H
#define DOLMUS_MODEL_STEP_H

#include <stdint.h>
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

/* Rows keep[0..kept) of x (rows of row_bytes) become its rows [0, kept): for the attention
 * output and the residual stream, the two inputs of what follows attention in the last layer.
 * keep ascends, so no row is overwritten before it is moved. */
static inline void keep_rows(void *x, size_t row_bytes, const int64_t *keep, int64_t kept) {
    char *rows = x;
    for (int64_t j = 0; j < kept; j++)
        if (keep[j] != j) memmove(rows + (size_t)j * row_bytes, rows + (size_t)keep[j] * row_bytes, row_bytes);
}

#endif
