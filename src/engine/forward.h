/* engine/forward: the forward pass (engine/forward.c) as the decode loop
 * (engine/decode.c) calls it. */
#ifndef KVLM_ENGINE_FORWARD_H
#define KVLM_ENGINE_FORWARD_H
#include <stdint.h>
#include "engine/ctx.h"

/* n tokens (slots reserved in the store; token t of sequence seq[t] at
 * pos[t]) through the model in chunks of n_batch; want[t]: its logits to
 * ctx->logits, emb[t] (emb may be NULL): its hidden state to ctx->embd. */
int eng_forward(kvlm_ctx *ctx, const int32_t *tokens, const int32_t *seq, const int32_t *pos, int n,
                const int8_t *want, const int8_t *emb, kvlm_error *err);
#endif
