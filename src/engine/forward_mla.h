/* engine/forward_mla: the deepseek2 forward pass over a latent (MLA) cache
 * (docs/mla.md); engine/forward.c hands it the chunks of such a model. */
#ifndef KVLM_ENGINE_FORWARD_MLA_H
#define KVLM_ENGINE_FORWARD_MLA_H
#include <stdbool.h>
#include <stdint.h>
#include "kv/store.h"
#include "model/model.h"
#include "util/pool.h"

typedef struct engine_mla engine_mla;

/* Scratch for chunks of up to n_batch tokens and contexts of n_ctx, and the
 * absorbed up-projections (f32, per layer and head). */
engine_mla *engine_mla_create(const kvlm_model *m, int n_batch, int n_ctx, int block_size, int n_threads,
                              kvlm_error *err);
void engine_mla_free(engine_mla *e);
/* T tokens (slots reserved in kv) through every layer, their latent rows
 * written to the cache; the logits of the tokens with want[t] go to logits
 * (vocab floats each, in token order). naive: the reference attention;
 * *attn_seconds grows by the time spent in attention. Returns the number of
 * logit rows. */
int engine_mla_chunk(engine_mla *e, util_pool *pool, kv_store *kv, const int32_t *tokens, const int32_t *seq,
                     const int32_t *pos, int T, const int8_t *want, float *logits, bool naive, double *attn_seconds);
#endif
