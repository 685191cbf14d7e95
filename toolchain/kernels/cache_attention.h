/* Attention of one query row over a static KV cache, reading only the slots its mask admits.
 *
 * The step graphs' cache has a fixed number of slots P; a token attends to the committed ones and
 * its own call's new keys, and the additive mask holds MASK_MIN (-1e4) for every other slot. Those
 * slots' softmax weights are exp(score + mask - max) = 0 in float32 (the exponent is below -104 as
 * long as |scaled score| < ~9,000), so skipping them changes nothing but the time: a token at
 * position 100 of a 512-slot cache reads a fifth of it. Slots are taken in chunks of 8; a chunk
 * with any admitted slot is computed in full (its masked slots get their zero weight as in the graph).
 *
 * Layouts (one KV group; a query head reads its group's cache):
 *   q[D]; past_key[D, P] (keys stored transposed, as the step graphs keep them); new_key[D, Nn];
 *   past_value[P, D]; new_value[Nn, D]; mask[P + Nn] (additive); out[D].
 *   scores = (q . k) * scale + mask; p = softmax(scores); out = p @ values. */
#ifndef MOBC_CACHE_ATTENTION_H
#define MOBC_CACHE_ATTENTION_H
#include <stdint.h>

/* a slot whose mask is at most this is never attended (MASK_MIN is -1e4) */
#define MOBC_MASKED (-1.0e3f)

/* floats of scratch a call of Q rows over L = P + Nn slots needs */
#define MOBC_ATTENTION_SCRATCH(Q, L) (((Q) < 8 ? (Q) : 8) + 2) * (L)

/* Q query rows of one KV group: q[Q, D], mask[Q, P + Nn] (each row its own), out[Q, D]; scratch of
 * MOBC_ATTENTION_SCRATCH(Q, P + Nn) floats. Each row's result is the same as alone (see cache_attention.c) */
void mobc_cache_attention_rows(int64_t Q, const float *q, const float *mask, const float *past_key,
                               const float *new_key, const float *past_value, const float *new_value, int64_t D,
                               int64_t P, int64_t Nn, float scale, float *out, float *scratch);

/* one row; scratch of MOBC_ATTENTION_SCRATCH(1, P + Nn) floats */
void mobc_cache_attention_row(const float *q, const float *past_key, const float *new_key,
                              const float *past_value, const float *new_value, const float *mask,
                              int64_t D, int64_t P, int64_t Nn, float scale, float *out, float *scratch);

#endif
