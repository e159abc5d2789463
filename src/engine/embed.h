/* engine/embed: pooling an input's hidden states into its embedding, as the
 * rows arrive (a prompt may take several steps), and normalising it; shared
 * by kvlm_embed and the scheduler. */
#ifndef KVLM_ENGINE_EMBED_H
#define KVLM_ENGINE_EMBED_H
#include <stdbool.h>
#include <stddef.h>
#include "kvlm.h"

typedef struct {
    int pooling, dim, n_tokens; /* n_tokens: the input's length */
    int n_rows;                 /* rows taken so far */
    double *acc;                /* MEAN: the running sum; CLS, LAST: the row kept (dim each) */
    float *rows;                /* NONE: every row (n_tokens x dim) */
} embed_pool;

/* For an input of n_tokens tokens pooled by pooling (a resolved KVLM_POOLING_*,
 * not RANK): KVLM_OK or KVLM_ENOMEM. */
int embed_pool_init(embed_pool *a, int pooling, int dim, int n_tokens);
void embed_pool_free(embed_pool *a);
/* Starts over (a preempted sequence recomputed). */
void embed_pool_reset(embed_pool *a);
/* Whether the state after the input's token at pos is needed. */
bool embed_pool_wants(const embed_pool *a, int pos);
/* Takes the state after the token at pos (one embed_pool_wants asked for). */
void embed_pool_add(embed_pool *a, int pos, const float *row);
/* Whether every state it needs has been taken. */
bool embed_pool_done(const embed_pool *a);
/* The embedding (each row, for NONE) of dims values, normalised unless
 * no_normalize; returns the floats it has (at most cap written). */
size_t embed_pool_finish(const embed_pool *a, int dims, bool no_normalize, float *out, size_t cap);
/* The pooling p resolves to for model (the model's when unspecified), or -1
 * with err filled; *dims: the vector's length. */
int embed_resolve(const kvlm_model *model, const kvlm_embed_params *p, int *dims, kvlm_error *err);
#endif
