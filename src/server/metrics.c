/* server/metrics: GET /metrics in Prometheus' text format: the KV pool, its
 * tiers, KV events, the scheduler, HTTP; vLLM's series under vLLM's names,
 * labels (model_name, engine) and histogram buckets (vllm/v1/metrics/loggers.py);
 * and the per-request observations that feed the histograms. */
#include "server/metrics.h"
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "server/kv_events.h"

typedef struct {
    const double *le;
    int n;
    uint64_t counts[64]; /* cumulative: observations <= le[i] */
    uint64_t total;
    double sum;
} hist;

/* vLLM's buckets */
static const double k_ttft_le[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
static const double k_tpot_le[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
static const double k_latency_le[] = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                                      30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
static const double k_n_le[] = {1, 2, 5, 10, 20};
/* kvlm's own (kvlm_time_to_first_token_seconds, kvlm_time_per_output_token_seconds) */
static const double k_kvlm_ttft_le[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
static const double k_kvlm_tpot_le[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5};

struct srv_metrics {
    pthread_mutex_t mu;
    double tok_le[64]; /* vLLM's build_1_2_5_buckets(max_model_len): 1, 2, 5, 10, 20, 50, ... */
    hist ttft, tpot, itl, req_tpot, e2e, queue, inference, prefill, decode;
    hist prompt_tokens, generation_tokens, max_generation_tokens, params_n, params_max_tokens;
    hist k_ttft, k_tpot;
};

#define NLE(a) ((int)(sizeof(a) / sizeof((a)[0])))

srv_metrics *srv_metrics_new(int max_model_len) {
    srv_metrics *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    pthread_mutex_init(&m->mu, NULL);
    int nt = 0;
    for (double mant = 1, exp = 1; nt < 60; mant = mant == 1 ? 2 : mant == 2 ? 5 : (exp *= 10, 1)) {
        double v = mant * exp;
        if (v > max_model_len) break;
        m->tok_le[nt++] = v;
    }
    hist *t[] = {&m->prompt_tokens, &m->generation_tokens, &m->max_generation_tokens, &m->params_max_tokens};
    for (int i = 0; i < 4; i++) t[i]->le = m->tok_le, t[i]->n = nt;
    m->ttft = (hist){.le = k_ttft_le, .n = NLE(k_ttft_le)};
    m->tpot = m->itl = m->req_tpot = (hist){.le = k_tpot_le, .n = NLE(k_tpot_le)};
    m->e2e = m->queue = m->inference = m->prefill = m->decode = (hist){.le = k_latency_le, .n = NLE(k_latency_le)};
    m->params_n = (hist){.le = k_n_le, .n = NLE(k_n_le)};
    m->k_ttft = (hist){.le = k_kvlm_ttft_le, .n = NLE(k_kvlm_ttft_le)};
    m->k_tpot = (hist){.le = k_kvlm_tpot_le, .n = NLE(k_kvlm_tpot_le)};
    return m;
}

void srv_metrics_free(srv_metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static void observe(hist *h, double v) {
    if (!(v >= 0)) return;
    for (int i = 0; i < h->n; i++) h->counts[i] += v <= h->le[i];
    h->total++;
    h->sum += v;
}

void srv_observe(kvlm_server *s, double ttft, double tpot) {
    srv_metrics *m = s->metrics;
    pthread_mutex_lock(&m->mu);
    observe(&m->k_ttft, ttft);
    observe(&m->k_tpot, tpot);
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_itl(kvlm_server *s, double dt) {
    srv_metrics *m = s->metrics;
    pthread_mutex_lock(&m->mu);
    observe(&m->tpot, dt); /* vLLM v1 observes time_per_output_token per token interval, as inter_token_latency */
    observe(&m->itl, dt);
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_request(kvlm_server *s, const srv_req_obs *o) {
    srv_metrics *m = s->metrics;
    pthread_mutex_lock(&m->mu);
    observe(&m->e2e, o->e2e);
    observe(&m->queue, o->queue);
    observe(&m->ttft, o->ttft);
    observe(&m->prefill, o->prefill);
    observe(&m->decode, o->decode);
    observe(&m->inference, o->inference);
    observe(&m->req_tpot, o->tpot);
    observe(&m->prompt_tokens, o->prompt_tokens);
    observe(&m->generation_tokens, o->generation_tokens);
    observe(&m->max_generation_tokens, o->max_generation_tokens);
    observe(&m->params_n, o->n);
    observe(&m->params_max_tokens, o->max_tokens);
    pthread_mutex_unlock(&m->mu);
}

typedef struct { char *s; size_t len, cap; } tbuf;
static void tput(tbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tput(tbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || !b->s) return;
    if (b->len + (size_t)n + 1 > b->cap) {
        size_t cap = (b->len + (size_t)n + 1) * 2;
        char *p = realloc(b->s, cap);
        if (!p) { free(b->s); b->s = NULL; return; }
        b->s = p;
        b->cap = cap;
    }
    va_start(ap, fmt);
    vsnprintf(b->s + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

static double hit_rate(const kvlm_kv_stats *kv) {
    uint64_t n = kv->prefix_hits + kv->prefix_misses;
    return n ? (double)kv->prefix_hits / (double)n : 0.0;
}

static void metric(tbuf *b, const char *name, const char *type, const char *help, double v) {
    tput(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}


/* A histogram; lab: its labels (without braces, "" for none) before le. */
static void hist_out(tbuf *b, const char *name, const char *help, const hist *h, const char *lab) {
    const char *sep = *lab ? "," : "";
    tput(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < h->n; i++)
        tput(b, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, lab, sep, h->le[i], (unsigned long long)h->counts[i]);
    tput(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, lab, sep, (unsigned long long)h->total);
    tput(b, "%s_sum%s%s%s %.17g\n%s_count%s%s%s %llu\n", name, *lab ? "{" : "", lab, *lab ? "}" : "", h->sum, name,
         *lab ? "{" : "", lab, *lab ? "}" : "", (unsigned long long)h->total);
}

double srv_tier_field(const kvlm_kv_tier_stats *t, const char *f) {
    if (!strcmp(f, "blocks")) return (double)t->blocks;
    if (!strcmp(f, "bytes")) return (double)t->bytes;
    if (!strcmp(f, "hits_total")) return (double)t->hits;
    if (!strcmp(f, "misses_total")) return (double)t->misses;
    if (!strcmp(f, "writes_total")) return (double)t->writes;
    if (!strcmp(f, "dropped_writes_total")) return (double)t->dropped_writes;
    if (!strcmp(f, "corrupt_total")) return (double)t->corrupt;
    if (!strcmp(f, "forged_total")) return (double)t->forged;
    if (!strcmp(f, "errors_total")) return (double)t->errors;
    if (!strcmp(f, "promoted_total")) return (double)t->promoted;
    if (!strcmp(f, "demoted_total")) return (double)t->demoted;
    if (!strcmp(f, "read_seconds_total")) return t->read_seconds;
    return (double)t->reads;
}

static void tier_metrics(tbuf *b, const kvlm_sched_stats *st) {
    if (st->n_tiers <= 0) return;
#define TIER_METRIC(f, type, help)                                                                        \
    tput(b, "# HELP kvlm_kv_tier_" #f " " help "\n# TYPE kvlm_kv_tier_" #f " " type "\n");                \
    for (int i = 0; i < st->n_tiers; i++)                                                                 \
        tput(b, "kvlm_kv_tier_" #f "{tier=\"%s\"} %.17g\n", st->tiers[i].name, srv_tier_field(&st->tiers[i], #f));
    TIER_FIELDS(TIER_METRIC)
#undef TIER_METRIC
}

/* A Prometheus label value: backslash, quote and newline escaped. */
static void label_value(char *out, size_t cap, const char *v) {
    size_t k = 0;
    for (; *v && k + 3 < cap; v++) {
        if (*v == '\\' || *v == '"') out[k++] = '\\';
        if (*v == '\n') { out[k++] = '\\'; out[k++] = 'n'; continue; }
        out[k++] = *v;
    }
    out[k] = '\0';
}

/* The vLLM-named series that routers and dashboards built for vLLM read
 * (llm-d's endpoint picker, the production-stack router): same names, types,
 * units and labels as vLLM v1 (model_name, engine). */
static void vllm_metrics(kvlm_server *s, tbuf *b, const kvlm_sched_stats *st) {
    char model[600], lab[700];
    label_value(model, sizeof model, s->model_id);
    snprintf(lab, sizeof lab, "{engine=\"0\",model_name=\"%s\"}", model);
    const kvlm_kv_stats *kv = &st->kv;
#define VLLM(name, type, help, v) \
    tput(b, "# HELP " name " " help "\n# TYPE " name " " type "\n" name "%s %.17g\n", lab, (double)(v))
    VLLM("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", st->running);
    VLLM("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", st->waiting);
    VLLM("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         kv->n_blocks ? (double)kv->used / kv->n_blocks : 0.0);
    VLLM("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
         st->prompt_tokens);
    VLLM("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
         st->cached_tokens);
    /* the older name, which vLLM's published dashboard still queries */
    VLLM("vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage (vllm:kv_cache_usage_perc).",
         kv->n_blocks ? (double)kv->used / kv->n_blocks : 0.0);
    VLLM("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", st->preemptions);
    VLLM("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", st->prompt_tokens);
    VLLM("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", st->generated_tokens);
#undef VLLM
    /* per completion, by why it ended: vLLM's stop, length, abort; kvlm's error and kv_cache_full */
    static const char *const reasons[6] = {NULL, "stop", "length", "abort", "error", "kv_cache_full"};
    tput(b, "# HELP vllm:request_success_total Count of successfully processed requests.\n"
            "# TYPE vllm:request_success_total counter\n");
    for (int i = 1; i < 6; i++)
        tput(b, "vllm:request_success_total{engine=\"0\",finished_reason=\"%s\",model_name=\"%s\"} %llu\n", reasons[i],
             model, (unsigned long long)__atomic_load_n(&s->finished[i], __ATOMIC_RELAXED));
    char hl[700];
    snprintf(hl, sizeof hl, "engine=\"0\",model_name=\"%s\"", model);
    srv_metrics *m = s->metrics;
    pthread_mutex_lock(&m->mu);
    hist_out(b, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", &m->ttft, hl);
    hist_out(b, "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", &m->tpot, hl);
    hist_out(b, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", &m->itl, hl);
    hist_out(b, "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
             &m->req_tpot, hl);
    hist_out(b, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", &m->e2e, hl);
    hist_out(b, "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", &m->queue, hl);
    hist_out(b, "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
             &m->inference, hl);
    hist_out(b, "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
             &m->prefill, hl);
    hist_out(b, "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", &m->decode,
             hl);
    hist_out(b, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", &m->prompt_tokens, hl);
    hist_out(b, "vllm:request_generation_tokens", "Number of generation tokens processed.", &m->generation_tokens, hl);
    hist_out(b, "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
             &m->max_generation_tokens, hl);
    hist_out(b, "vllm:request_params_n", "Histogram of the n request parameter.", &m->params_n, hl);
    hist_out(b, "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
             &m->params_max_tokens, hl);
    pthread_mutex_unlock(&m->mu);
    const char *kt = kvlm_cache_type_name(kv->type_k), *vt = kvlm_cache_type_name(kv->type_v);
    tput(b, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            "vllm:cache_config_info{block_size=\"%d\",cache_dtype=\"%s\",cache_dtype_v=\"%s\",engine=\"0\","
            "model_name=\"%s\",num_cpu_blocks=\"%llu\",num_gpu_blocks=\"%d\",prefix_caching_hash_algo=\"xxh3_128\"} 1\n",
         kv->block_size, kt ? kt : "?", vt ? vt : "?", model, (unsigned long long)kv->swap_slots, kv->n_blocks);
}

enum MHD_Result srv_get_metrics(kvlm_server *s, struct MHD_Connection *c) {
    kvlm_sched_stats st;
    pthread_mutex_lock(&s->mu);
    bool up = s->sched != NULL;
    if (up) kvlm_sched_stats_get(s->sched, &st);
    pthread_mutex_unlock(&s->mu);
    if (!up) return srv_error(c, s, 503, NULL, NULL, "the server is shutting down");
    tbuf b = {malloc(4096), 0, 4096};
    const kvlm_kv_stats *kv = &st.kv;
    metric(&b, "kvlm_kv_blocks", "gauge", "KV cache blocks in the pool (kvlm_kv_blocks_total before: a gauge named like a counter)",
           kv->n_blocks);
    metric(&b, "kvlm_kv_evictions_total", "counter", "Cached blocks dropped from the pool to make room", (double)kv->evictions);
    metric(&b, "kvlm_tokens_computed_total", "counter", "Tokens run through the model (prefix reuse skips some)",
           (double)kv->tokens_computed);
    metric(&b, "kvlm_kv_blocks_used", "gauge", "KV cache blocks held by sequences", kv->used);
    metric(&b, "kvlm_kv_blocks_cached", "gauge", "KV cache blocks kept only for prefix reuse (evictable)", kv->cached);
    metric(&b, "kvlm_kv_blocks_free", "gauge", "KV cache blocks free", kv->free);
    metric(&b, "kvlm_kv_blocks_shared", "gauge", "KV cache blocks held by more than one sequence", kv->shared);
    metric(&b, "kvlm_kv_block_bytes", "gauge", "Bytes of one KV cache block", (double)kv->block_bytes);
    metric(&b, "kvlm_kv_bytes_used", "gauge", "Bytes of the KV cache blocks held by sequences",
           (double)kv->used * (double)kv->block_bytes);
    metric(&b, "kvlm_prefix_cache_hits_total", "counter", "Prompt blocks found in the prefix index",
           (double)kv->prefix_hits);
    metric(&b, "kvlm_prefix_cache_misses_total", "counter", "Prompt blocks not found in the prefix index",
           (double)kv->prefix_misses);
    metric(&b, "kvlm_prefix_cache_hit_rate", "gauge", "Prefix index hits over lookups (per block)", hit_rate(kv));
    tier_metrics(&b, &st);
    metric(&b, "kvlm_embeddings_total", "counter", "Inputs embedded (POST /v1/embeddings): vectors given out",
           (double)st.embeddings);
    metric(&b, "kvlm_embedding_tokens_total", "counter", "Prompt tokens of the inputs embedded", (double)st.embedding_tokens);
    if (s->events) {
        srv_kv_events_stats es;
        srv_kv_events_stats_get(s->events, &es);
        metric(&b, "kvlm_kv_events_total", "counter", "KV events published (--kv-events)", (double)es.events);
        metric(&b, "kvlm_kv_event_batches_total", "counter", "KV event batches published (one per engine step with "
               "changes)", (double)es.batches);
        metric(&b, "kvlm_kv_events_dropped_total", "counter", "KV events dropped: the publisher's queue was full",
               (double)es.dropped_events);
        metric(&b, "kvlm_kv_events_queued", "gauge", "KV events waiting to be published", (double)es.queued);
        metric(&b, "kvlm_kv_events_pub_bytes", "gauge", "Bytes the PUB socket's queues hold for subscribers (a payload "
               "once, its frames per subscriber)", (double)es.pub_bytes);
        metric(&b, "kvlm_kv_events_subscribers", "gauge", "Connections to the KV-events PUB socket", (double)es.subscribers);
        metric(&b, "kvlm_kv_events_subscribers_refused_total", "counter",
               "Connections to the PUB socket closed at once: it had its most subscribers", (double)es.subscribers_refused);
        metric(&b, "kvlm_kv_events_subscribers_cut_total", "counter",
               "Subscribers disconnected at the PUB socket's byte cap (the one with the most unsent)",
               (double)es.subscribers_cut);
        if (s->p.kv_events_replay) {
            metric(&b, "kvlm_kv_event_replays_total", "counter", "Replay requests answered (--kv-events-replay)",
                   (double)es.replays);
            metric(&b, "kvlm_kv_event_batches_replayed_total", "counter", "KV event batches resent by replays",
                   (double)es.replayed);
            metric(&b, "kvlm_kv_event_batches_buffered", "gauge", "KV event batches kept for replay",
                   (double)es.buffered);
            metric(&b, "kvlm_kv_event_replay_bytes", "gauge", "Bytes of replay messages in the replay socket's queues "
                   "(all peers)", (double)es.replay_bytes);
            metric(&b, "kvlm_kv_event_replay_peers", "gauge", "Connections to the replay socket", (double)es.replay_peers);
            metric(&b, "kvlm_kv_event_replays_active", "gauge", "Replays in progress", (double)es.replays_active);
            metric(&b, "kvlm_kv_event_replays_dropped_total", "counter", "Replays (or requests waiting behind one) "
                   "abandoned: a peer gone, stalled, or the oldest at a cap", (double)es.replays_dropped);
            metric(&b, "kvlm_kv_event_replay_peers_refused_total", "counter",
                   "Connections to the replay socket closed at once: it had its most peers", (double)es.replay_peers_refused);
            metric(&b, "kvlm_kv_event_replay_peers_cut_total", "counter", "Replay peers disconnected: messages queued "
                   "and nothing taken for the stall time, or the oldest at the byte cap", (double)es.replay_peers_cut);
        }
    }
    vllm_metrics(s, &b, &st);
    metric(&b, "kvlm_requests_running", "gauge", "Requests holding KV blocks", st.running);
    metric(&b, "kvlm_requests_waiting", "gauge", "Requests queued or preempted", st.waiting);
    metric(&b, "kvlm_requests_total", "counter", "Requests finished", (double)st.requests_done);
    static const char *const reasons[6] = {NULL, "stop", "length", "cancelled", "error", "kv_cache_full"};
    tput(&b, "# HELP kvlm_completions_finished_total Completions (choices) ended, by finish reason\n"
             "# TYPE kvlm_completions_finished_total counter\n");
    for (int i = 1; i < 6; i++)
        tput(&b, "kvlm_completions_finished_total{reason=\"%s\"} %llu\n", reasons[i],
             (unsigned long long)__atomic_load_n(&s->finished[i], __ATOMIC_RELAXED));
    metric(&b, "kvlm_preemptions_total", "counter", "Sequences preempted for lack of KV blocks", (double)st.preemptions);
    metric(&b, "kvlm_swaps_out_total", "counter", "Preemptions by swap: sequences moved to the swap space",
           (double)st.swaps_out);
    metric(&b, "kvlm_swaps_in_total", "counter", "Sequences brought back from the swap space", (double)st.swaps_in);
    metric(&b, "kvlm_recomputes_total", "counter", "Preemptions by recompute", (double)st.recomputes);
    metric(&b, "kvlm_swap_bytes_total", "counter", "Bytes moved to and from the swap space", (double)st.swap_bytes);
    metric(&b, "kvlm_swap_blocks", "gauge", "Blocks the swap space holds", (double)st.kv.swap_slots);
    metric(&b, "kvlm_swap_blocks_used", "gauge", "Blocks swapped-out sequences hold", (double)st.kv.swap_used);
    metric(&b, "kvlm_prompt_tokens_total", "counter", "Prompt tokens admitted", (double)st.prompt_tokens);
    metric(&b, "kvlm_prompt_tokens_cached_total", "counter", "Prompt tokens taken from the prefix index or a KV tier",
           (double)st.cached_tokens);
    metric(&b, "kvlm_generated_tokens_total", "counter", "Tokens generated", (double)st.generated_tokens);
    if (s->answers) { /* docs/serving.md, "Conversations and the prefix cache" */
        srv_answers_stats as;
        srv_answers_stats_get(s->answers, &as);
        metric(&b, "kvlm_chat_answer_reuse_total", "counter",
               "Assistant messages of chat requests tokenized as the ids this server generated for them", (double)as.reused);
        metric(&b, "kvlm_chat_answer_reuse_tokens_total", "counter", "Token ids those messages took",
               (double)as.reused_tokens);
        metric(&b, "kvlm_chat_answers_recorded_total", "counter", "Chat answers whose ids were kept", (double)as.recorded);
        metric(&b, "kvlm_chat_answers_unmatched_total", "counter",
               "Chat answers not kept: no prefix of their ids spells the text returned", (double)as.unmatched);
        metric(&b, "kvlm_chat_answers_evicted_total", "counter", "Kept answers dropped for --answer-ids-mem",
               (double)as.evicted);
        metric(&b, "kvlm_chat_answers", "gauge", "Chat answers whose ids are kept", (double)as.entries);
        metric(&b, "kvlm_chat_answers_bytes", "gauge", "Bytes they take (cap: --answer-ids-mem)", (double)as.bytes);
    }
    metric(&b, "kvlm_spec_draft_tokens_total", "counter", "Speculative draft tokens checked", (double)st.spec_drafted);
    metric(&b, "kvlm_spec_accepted_tokens_total", "counter", "Speculative draft tokens kept", (double)st.spec_accepted);
    metric(&b, "kvlm_spec_draft_model_steps_total", "counter", "Engine steps in which the draft model proposed",
           (double)st.spec_draft_steps);
    metric(&b, "kvlm_spec_draft_model_failures_total", "counter",
           "Draft-model decodes that failed (pool full, error); their steps went on with fewer drafts",
           (double)st.spec_draft_failures);
    metric(&b, "kvlm_spec_draft_model_released_total", "counter",
           "Draft-model sequences dropped to give the model's sequences room in the shared KV pool",
           (double)st.spec_draft_released);
    metric(&b, "kvlm_spec_draft_model_windows_total", "counter",
           "Draft-model sequences started afresh on the text's last half context (the text outgrew the draft's)",
           (double)st.spec_draft_windows);
    metric(&b, "kvlm_spec_draft_model_waits_total", "counter",
           "Sequence-steps without draft-model drafts: what the draft would hold did not fit beside the model's next "
           "step in the shared KV pool",
           (double)st.spec_draft_waits);
    metric(&b, "kvlm_engine_steps_total", "counter", "Engine steps (forward passes)", (double)st.steps);
    metric(&b, "kvlm_tokens_per_second", "gauge", "Tokens generated per second, recently", st.tokens_per_second);
    pthread_mutex_lock(&s->socks_mu);
    size_t unsent_now = s->unsent - s->unsent_cut;
    uint64_t cut_now = s->answers_cut;
    pthread_mutex_unlock(&s->socks_mu);
    metric(&b, "kvlm_http_unsent_bytes", "gauge", "Answer bytes made and not yet handed to the kernel (--max-unsent)",
           (double)unsent_now);
    metric(&b, "kvlm_http_answers_cut_total", "counter",
           "Connections reset for --max-unsent (the one holding most), or a stream past its own cap", (double)cut_now);
    pthread_mutex_lock(&s->mu);
    metric(&b, "kvlm_http_errors_total", "counter", "Requests answered with an error", (double)s->http_errors);
    metric(&b, "kvlm_http_body_bytes", "gauge", "Bytes taken by request bodies being received (--max-body-total)",
           (double)s->body_bytes);
    metric(&b, "kvlm_http_bodies_refused_total", "counter", "Requests refused (503) for --max-body-total",
           (double)s->bodies_refused);
    pthread_mutex_unlock(&s->mu);
    srv_metrics *m = s->metrics;
    pthread_mutex_lock(&m->mu);
    hist_out(&b, "kvlm_time_to_first_token_seconds", "Time from a request's arrival to its first token", &m->k_ttft, "");
    hist_out(&b, "kvlm_time_per_output_token_seconds", "Mean time between a request's tokens after the first",
             &m->k_tpot, "");
    pthread_mutex_unlock(&m->mu);
    if (!b.s) return MHD_NO;
    enum MHD_Result r = srv_text(c, 200, "text/plain; version=0.0.4; charset=utf-8", b.s, b.len);
    free(b.s);
    return r;
}
