/* engine/moe: the mixture-of-experts feed-forward of deepseek2 layers:
 * router, top-k experts, their weighted sum and the shared experts. */
#ifndef KVLM_ENGINE_MOE_H
#define KVLM_ENGINE_MOE_H
#include "model/model.h"
#include "util/pool.h"

typedef struct engine_moe engine_moe;

/* The most experts a layer may have (DeepSeek-V3: 256); loading refuses more. */
#define ENGINE_MOE_MAX_EXPERTS 1024

engine_moe *engine_moe_create(const kvlm_model *m, int n_batch, kvlm_error *err);
void engine_moe_free(engine_moe *e);
/* x[t] += MoE(xn[t]) for T tokens (xn: the normed input rows), times
 * cfg.residual_mult when it is set (granitemoe). */
void engine_moe_forward(engine_moe *e, util_pool *pool, const model_layer *L, const float *xn, float *x, int T);
/* The router's choice for one token: the top-k experts (idx) and their
 * weights from its logits (n_expert floats), as the config says (softmax or
 * sigmoid, selection bias, normalisation, scale). bias may be NULL. */
void engine_moe_route(const kvlm_config *c, const float *logits, const float *bias, int *idx, float *w);
#endif
