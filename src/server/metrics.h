/* server/metrics: GET /metrics: kvlm's series and vLLM's (the families its
 * Grafana dashboard and routers read, under its names, labels and buckets),
 * and the per-request observations behind their histograms. */
#ifndef KVLM_SERVER_METRICS_H
#define KVLM_SERVER_METRICS_H
#include "server/server.h"

/* One metric per KV tier, labelled tier="host|disk|redis". */
#define TIER_FIELDS(X) \
    X(blocks, "gauge", "Blocks held by the KV tier") \
    X(bytes, "gauge", "Bytes held by the KV tier") \
    X(hits_total, "counter", "Blocks found in the KV tier on a prefix miss in the pool") \
    X(misses_total, "counter", "Blocks looked for in the KV tier and not found") \
    X(writes_total, "counter", "Blocks written to the KV tier") \
    X(dropped_writes_total, "counter", "Block writes dropped (queue full, tier down or full)") \
    X(corrupt_total, "counter", "Blocks read from the KV tier that failed their checks (recomputed)") \
    X(forged_total, "counter", "Blocks read from the KV tier whose signature failed (--kv-key; recomputed)") \
    X(errors_total, "counter", "I/O or connection errors of the KV tier") \
    X(promoted_total, "counter", "Blocks brought back from the KV tier into the pool") \
    X(demoted_total, "counter", "Cached blocks sent down to the KV tier before the pool reused them") \
    X(read_seconds_total, "counter", "Summed latency of the KV tier's batched reads") \
    X(reads_total, "counter", "Batched reads of the KV tier")
/* A tier's figure by its field name in TIER_FIELDS. */
double srv_tier_field(const kvlm_kv_tier_stats *t, const char *f);

/* A finished request's figures (seconds; < 0: not observed). */
typedef struct srv_req_obs {
    double e2e, queue, ttft, prefill, decode, inference, tpot;
    int prompt_tokens, generation_tokens; /* summed over its prompts and choices */
    int max_generation_tokens;            /* the most any of its choices generated */
    int n, max_tokens;                    /* the request's n and max_tokens */
} srv_req_obs;

srv_metrics *srv_metrics_new(int max_model_len);
void srv_metrics_free(srv_metrics *m);
void srv_metrics_request(kvlm_server *s, const srv_req_obs *o);
/* The time between two tokens of a completion (vLLM's inter-token latency). */
void srv_metrics_itl(kvlm_server *s, double dt);
enum MHD_Result srv_get_metrics(kvlm_server *s, struct MHD_Connection *c);
#endif
