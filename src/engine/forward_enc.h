/* engine/forward_enc: the forward pass of the encoders (bert, nomic-bert):
 * whole inputs attended to bidirectionally, no KV cache. */
#ifndef KVLM_ENGINE_FORWARD_ENC_H
#define KVLM_ENGINE_FORWARD_ENC_H
#include <stdint.h>
#include "kvlm.h"
#include "util/pool.h"

typedef struct engine_enc engine_enc;
/* The context's scratch, each for n_batch tokens (the context owns it): x,
 * xb, q, k, v, att of the width (dim), hb, hb2 of the FFN's, RoPE's cos and
 * sin (rope_dim / 2 each), the matmul work. */
typedef struct {
    float *x, *xb, *q, *k, *v, *att, *hb, *hb2, *cs, *sn;
    void *mm_work;
} engine_enc_scratch;

engine_enc *engine_enc_create(const kvlm_model *model, int n_batch, int n_threads, const engine_enc_scratch *s,
                              kvlm_error *err);
void engine_enc_free(engine_enc *e);
/* T <= n_batch tokens; each run of one sequence (seq) is a whole input at
 * positions pos (0, 1, ...). The last layer's output for each token with
 * emb[t] set goes to out (dim floats each, in token order); returns how many.
 * attn_seconds (may be NULL) gains the time spent in attention. */
int engine_enc_forward(engine_enc *e, util_pool *pool, const int32_t *tokens, const int32_t *seq, const int32_t *pos,
                       int T, const int8_t *emb, float *out, double *attn_seconds);
#endif
