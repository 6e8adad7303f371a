/* The rows of one step of a Llama-family model for decode_step.c and decode_step_f32.c: decodes
 * (one new token of a sequence each) first, then prompt chunks, and which rows the last layer
 * carries on (runtime/native/decode_step.py fills it). */
#ifndef DOLMUS_MODEL_STEP_H
#define DOLMUS_MODEL_STEP_H

#include <stdint.h>

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

#endif
