/* engine/engine: internal hooks of the forward pass for benchmarks and tests
 * (not part of the public API). */
#ifndef KVLM_ENGINE_ENGINE_H
#define KVLM_ENGINE_ENGINE_H
#include <stdbool.h>
#include <stdint.h>
#include "kvlm.h"

/* Appends n positions of random keys and values to a sequence through the
 * normal write path (quantized to the cache's types), as a long prefill
 * would leave them, without running the model: decode speed does not depend
 * on the values. */
int engine_seq_fill_synthetic(kvlm_ctx *ctx, int seq, int n, uint64_t seed, kvlm_error *err);
/* Uses the reference attention (dequantize everything, materialise each
 * query's full softmax) instead of the kernels: the naive baseline. */
void engine_set_naive_attention(kvlm_ctx *ctx, bool naive);
/* The token ids the sequence's cache holds, in cache order (after eviction:
 * the kept ones); *n gets their count. */
const int32_t *engine_seq_tokens(const kvlm_ctx *ctx, int seq, int *n);
/* h2o only (NULL otherwise): the sequence's accumulated attention per cache
 * slot (softmax weights summed over steps, layers and query heads). */
const float *engine_h2o_scores(const kvlm_ctx *ctx, int seq);
/* Seconds spent evicting (choosing, compacting, re-rotating keys) since the
 * context was created. */
double engine_evict_seconds(const kvlm_ctx *ctx);
/* Seconds spent in attention since the context was created. */
double engine_attention_seconds(const kvlm_ctx *ctx);
/* Most tokens one forward chunk takes (kvlm_ctx_params.n_batch as resolved). */
int engine_ctx_n_batch(const kvlm_ctx *ctx);
/* The context's KV store (tests: pool counts, kv_check). */
struct kv_store *engine_kv_store(kvlm_ctx *ctx);
/* A draft context's host (kvlm_ctx_create_draft), whose store it uses; NULL: none. */
kvlm_ctx *engine_ctx_host(const kvlm_ctx *ctx);
/* Tests: kv_check of the context's pool (NULL: every invariant holds). */
const char *engine_kv_check(const kvlm_ctx *ctx);
/* Tests: with defer false, unverified tokens' attention goes straight into
 * the h2o scores (the wrong way, to show a test sees the difference). */
void engine_set_spec_h2o_defer(kvlm_ctx *ctx, bool defer);
#endif
