/* server/server: the HTTP server on libmicrohttpd (one thread polls every
 * connection, one engine thread runs the scheduler, one watches waiting
 * clients for hang-ups and enforces the header, body and send deadlines): routing,
 * request bodies and their limits, the API key, CORS, TLS, errors, /health,
 * /v1/models, /metrics, /kvlm/status and the web page. The completion
 * endpoints live in openai.c. */
#include "server/server.h"
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include "model/model.h"
#include "server/kv_events.h"
#include "util/error.h"
#include "util/file.h"
#include "util/log.h"
#include "util/mem.h"
#include "util/timing.h"

extern const unsigned char server_web_page[];
extern const size_t server_web_page_len;

static const double k_ttft_le[SRV_TTFT_BUCKETS] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
static const double k_tpot_le[SRV_TPOT_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5};

srv_sock *srv_conn_sock(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* Drops what fd's queue holds: its close sends a reset. */
static void reset_on_close(int fd) {
    struct linger l = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
}

/* k is reset for the cap on unsent answers (under socks_mu). */
static void cut_unsent(kvlm_server *s, srv_sock *k) {
    k->cutoff = true;
    s->unsent_cut += k->held;
    s->answers_cut++;
    if (k->fd >= 0 && !k->kicked) {
        reset_on_close(k->fd);
        shutdown(k->fd, SHUT_RDWR);
    }
    k->kicked = true;
}

bool srv_unsent_add(kvlm_server *s, srv_sock *k, long delta, bool stream) {
    if (!k || !delta) return !k || !k->cutoff;
    pthread_mutex_lock(&s->socks_mu);
    k->held += (size_t)delta;
    s->unsent += (size_t)delta;
    if (k->cutoff) s->unsent_cut += (size_t)delta;
    else if (delta > 0) {
        if (stream && k->held > s->p.max_unsent / SRV_STREAM_UNSENT_SHARE) cut_unsent(s, k);
        while (s->unsent - s->unsent_cut > s->p.max_unsent) { /* the connection holding most goes first */
            srv_sock *most = NULL;
            for (srv_sock *o = s->socks; o; o = o->next)
                if (!o->cutoff && o->held && (!most || o->held > most->held)) most = o;
            if (!most) break;
            cut_unsent(s, most);
        }
    }
    bool ok = !k->cutoff;
    pthread_mutex_unlock(&s->socks_mu);
    return ok;
}

/* An answer of len bytes at data; persistent: static, not copied (nor
 * counted). A copy counts as the connection's unsent answer until MHD has
 * handed it over (on_completed). */
static enum MHD_Result send_text_mode(struct MHD_Connection *c, unsigned status, const char *type, const void *data,
                                      size_t len, bool persistent) {
    srv_sock *k = persistent ? NULL : srv_conn_sock(c);
    char too_big[256];
    if (k && len > k->srv->p.max_unsent && len > sizeof too_big) {
        snprintf(too_big, sizeof too_big, "{\"error\":{\"message\":\"the answer is %zu bytes, more than the server holds for "
                 "unsent answers (%zu)\",\"type\":\"server_error\",\"param\":null,\"code\":\"answer_too_large\"}}", len,
                 k->srv->p.max_unsent);
        status = 500;
        type = "application/json";
        data = too_big;
        len = strlen(too_big);
    }
    if (k && !srv_unsent_add(k->srv, k, (long)len, false)) { /* reset: it held the most */
        srv_unsent_add(k->srv, k, -(long)len, false);
        return MHD_NO;
    }
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)data, persistent ? MHD_RESPMEM_PERSISTENT : MHD_RESPMEM_MUST_COPY);
    enum MHD_Result ret = MHD_NO;
    if (r) {
        MHD_add_response_header(r, "Content-Type", type);
        srv_cors(c, r);
        ret = MHD_queue_response(c, status, r);
        MHD_destroy_response(r);
    }
    if (k && ret == MHD_YES) k->whole += len;
    else if (k) srv_unsent_add(k->srv, k, -(long)len, false);
    return ret;
}

static enum MHD_Result send_text(struct MHD_Connection *c, unsigned status, const char *type, const void *data,
                                 size_t len) {
    return send_text_mode(c, status, type, data, len, false);
}

void srv_sock_answer_due(srv_sock *k) {
    pthread_mutex_lock(&k->srv->socks_mu);
    k->send_due = util_now_s() + k->srv->p.send_timeout_s;
    k->writing = true;
    pthread_mutex_unlock(&k->srv->socks_mu);
}

/* Bytes in fd's send queue that the peer has not acknowledged. */
static int unsent(int fd) {
    int n = 0;
    return ioctl(fd, SIOCOUTQ, &n) ? 0 : n;
}

static bool grow_drain(kvlm_server *s) {
    int cap = s->cap_drain ? 2 * s->cap_drain : 64;
    srv_drain *d = realloc(s->drain, (size_t)cap * sizeof *d);
    if (!d) return false;
    s->drain = d;
    s->cap_drain = cap;
    return true;
}

static bool origin_allowed(const kvlm_server *s, const char *origin) {
    if (!origin) return false;
    for (int i = 0; i < s->p.n_cors_origins; i++)
        if (!strcmp(s->p.cors_origins[i], origin)) return true;
    return false;
}

/* No Access-Control-Allow-Origin at all unless the origin was named with
 * --cors-origin: a browser then keeps other pages from reading our answers. */
void srv_cors(struct MHD_Connection *c, struct MHD_Response *r) {
    srv_sock *k = srv_conn_sock(c);
    if (!k || !k->srv->p.n_cors_origins) return;
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    MHD_add_response_header(r, "Vary", "Origin");
    if (origin_allowed(k->srv, origin)) MHD_add_response_header(r, "Access-Control-Allow-Origin", origin);
}

enum MHD_Result srv_json(struct MHD_Connection *c, unsigned status, json_t *j) {
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!s) return MHD_NO;
    enum MHD_Result r = send_text(c, status, "application/json", s, strlen(s));
    free(s);
    return r;
}

enum MHD_Result srv_error(struct MHD_Connection *c, kvlm_server *s, unsigned status, const char *param,
                          const char *code, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *type = status == 404 && code && !strcmp(code, "model_not_found") ? "invalid_request_error"
                       : status >= 500                                            ? "server_error"
                       : status == 404                                            ? "not_found_error"
                                                                                  : "invalid_request_error";
    pthread_mutex_lock(&s->mu);
    s->http_errors++;
    pthread_mutex_unlock(&s->mu);
    json_t *e = json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", msg, "type", type, "param",
                          param ? json_string(param) : json_null(), "code", code ? json_string(code) : json_null());
    return srv_json(c, status, e);
}

void srv_observe(kvlm_server *s, double ttft, double tpot) {
    pthread_mutex_lock(&s->mu);
    if (ttft >= 0) {
        for (int i = 0; i < SRV_TTFT_BUCKETS; i++) s->ttft_counts[i] += ttft <= k_ttft_le[i];
        s->ttft_n++;
        s->ttft_sum += ttft;
    }
    if (tpot >= 0) {
        for (int i = 0; i < SRV_TPOT_BUCKETS; i++) s->tpot_counts[i] += tpot <= k_tpot_le[i];
        s->tpot_n++;
        s->tpot_sum += tpot;
    }
    pthread_mutex_unlock(&s->mu);
}

/* ---- GET endpoints ------------------------------------------------------------ */

static bool get_stats(kvlm_server *s, kvlm_sched_stats *st) {
    pthread_mutex_lock(&s->mu);
    bool ok = s->sched != NULL;
    if (ok) kvlm_sched_stats_get(s->sched, st);
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static double hit_rate(const kvlm_kv_stats *kv) {
    uint64_t n = kv->prefix_hits + kv->prefix_misses;
    return n ? (double)kv->prefix_hits / (double)n : 0.0;
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

static void metric(tbuf *b, const char *name, const char *type, const char *help, double v) {
    tput(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

static void histogram(tbuf *b, const char *name, const char *help, const double *le, const uint64_t *counts, int n,
                      uint64_t total, double sum) {
    tput(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < n; i++) tput(b, "%s_bucket{le=\"%g\"} %llu\n", name, le[i], (unsigned long long)counts[i]);
    tput(b, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.17g\n%s_count %llu\n", name, (unsigned long long)total, name, sum,
         name, (unsigned long long)total);
}

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

static double tier_field(const kvlm_kv_tier_stats *t, const char *f) {
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
        tput(b, "kvlm_kv_tier_" #f "{tier=\"%s\"} %.17g\n", st->tiers[i].name, tier_field(&st->tiers[i], #f));
    TIER_FIELDS(TIER_METRIC)
#undef TIER_METRIC
}

static json_t *tiers_json(const kvlm_sched_stats *st) {
    json_t *a = json_array();
    for (int i = 0; i < st->n_tiers; i++) {
        const kvlm_kv_tier_stats *t = &st->tiers[i];
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(t->name));
        json_object_set_new(o, "up", json_boolean(t->up));
#define TIER_JSON(f, type, help) json_object_set_new(o, #f, json_real(tier_field(t, #f)));
        TIER_FIELDS(TIER_JSON)
#undef TIER_JSON
        json_object_set_new(o, "read_ms_mean", json_real(t->reads ? 1e3 * t->read_seconds / (double)t->reads : 0.0));
        json_array_append_new(a, o);
    }
    return a;
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
#undef VLLM
    const char *kt = kvlm_cache_type_name(kv->type_k), *vt = kvlm_cache_type_name(kv->type_v);
    tput(b, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            "vllm:cache_config_info{block_size=\"%d\",cache_dtype=\"%s\",cache_dtype_v=\"%s\",engine=\"0\","
            "model_name=\"%s\",num_cpu_blocks=\"%llu\",num_gpu_blocks=\"%d\",prefix_caching_hash_algo=\"xxh3_128\"} 1\n",
         kv->block_size, kt ? kt : "?", vt ? vt : "?", model, (unsigned long long)kv->swap_slots, kv->n_blocks);
}

static enum MHD_Result get_metrics(kvlm_server *s, struct MHD_Connection *c) {
    kvlm_sched_stats st;
    if (!get_stats(s, &st)) return srv_error(c, s, 503, NULL, NULL, "the server is shutting down");
    tbuf b = {malloc(4096), 0, 4096};
    const kvlm_kv_stats *kv = &st.kv;
    metric(&b, "kvlm_kv_blocks_total", "gauge", "KV cache blocks in the pool", kv->n_blocks);
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
    histogram(&b, "kvlm_time_to_first_token_seconds", "Time from a request's arrival to its first token", k_ttft_le,
              s->ttft_counts, SRV_TTFT_BUCKETS, s->ttft_n, s->ttft_sum);
    histogram(&b, "kvlm_time_per_output_token_seconds", "Mean time between a request's tokens after the first",
              k_tpot_le, s->tpot_counts, SRV_TPOT_BUCKETS, s->tpot_n, s->tpot_sum);
    pthread_mutex_unlock(&s->mu);
    if (!b.s) return MHD_NO;
    enum MHD_Result r = send_text(c, 200, "text/plain; version=0.0.4; charset=utf-8", b.s, b.len);
    free(b.s);
    return r;
}

static void hex_keys(json_t *a, const uint8_t (*keys)[16], int n) {
    for (int i = 0; a && i < n; i++) {
        char hex[33];
        for (int k = 0; k < 16; k++) snprintf(hex + 2 * k, 3, "%02x", keys[i][k]);
        json_array_append_new(a, json_string(hex));
    }
}

/* /kvlm/status?blocks=1: the keys of the blocks in the prefix index as of the
 * end of the engine's last step (hex; KV events carry the last 16 hex
 * digits as an integer). The first call waits for the engine thread to take
 * them (a step, or at once when idle). */
static json_t *cached_blocks_json(kvlm_server *s, int n_blocks) {
    uint8_t (*keys)[16] = malloc((size_t)(n_blocks > 0 ? n_blocks : 1) * 16);
    if (!keys) return NULL;
    int n = -1;
    for (int tries = 0; tries < 1000 && n < 0; tries++) { /* at most about 5 s */
        pthread_mutex_lock(&s->mu);
        bool up = s->sched != NULL;
        if (up) n = kvlm_sched_kv_blocks(s->sched, keys, n_blocks);
        pthread_mutex_unlock(&s->mu);
        if (!up) break;
        if (n < 0) usleep(5000);
    }
    json_t *a = n >= 0 ? json_array() : NULL;
    hex_keys(a, (const uint8_t (*)[16])keys, n < n_blocks ? n : n_blocks);
    free(keys);
    return a;
}

/* The host tier's blocks that KV events told, taken with the pool's (after
 * cached_blocks_json); [] without a host tier. */
static json_t *host_blocks_json(kvlm_server *s) {
    json_t *a = json_array();
    pthread_mutex_lock(&s->mu);
    int n = s->sched ? kvlm_sched_kv_host_blocks(s->sched, NULL, 0) : 0;
    uint8_t (*keys)[16] = n > 0 ? malloc((size_t)n * 16) : NULL;
    if (keys && s->sched) {
        int m = kvlm_sched_kv_host_blocks(s->sched, keys, n);
        hex_keys(a, (const uint8_t (*)[16])keys, m < n ? m : n);
    }
    pthread_mutex_unlock(&s->mu);
    free(keys);
    return a;
}

static enum MHD_Result get_status(kvlm_server *s, struct MHD_Connection *c) {
    kvlm_sched_stats st;
    kvlm_sched_req_info info[256];
    int n = 0;
    pthread_mutex_lock(&s->mu);
    bool ok = s->sched != NULL;
    if (ok) {
        kvlm_sched_stats_get(s->sched, &st);
        n = kvlm_sched_requests(s->sched, info, 256);
    }
    pthread_mutex_unlock(&s->mu);
    if (!ok) return srv_error(c, s, 503, NULL, NULL, "the server is shutting down");
    if (n > 256) n = 256;
    const kvlm_kv_stats *kv = &st.kv;
    json_t *reqs = json_array();
    static const char *states[] = {"waiting", "prefill", "running"};
    for (int i = 0; i < n; i++) {
        char id[32];
        snprintf(id, sizeof id, "cmpl-%llu", (unsigned long long)info[i].id);
        json_array_append_new(reqs, json_pack("{s:s, s:s, s:i, s:i, s:i, s:i, s:i}", "id", id, "state",
                                              states[info[i].state], "prompt_tokens", info[i].prompt_tokens,
                                              "generated", info[i].generated, "blocks", info[i].blocks,
                                              "shared_blocks", info[i].shared_blocks, "cached_tokens",
                                              info[i].cached_tokens));
    }
    json_t *j = json_pack(
        "{s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:I, s:I, s:I, s:I, s:I, s:f, s:i, s:i, s:I, s:f, s:I, s:I, s:o, s:o, "
        "s:I, s:I}",
        "model", s->model_id, "block_size", kv->block_size, "n_blocks", kv->n_blocks, "blocks_used", kv->used,
        "blocks_cached", kv->cached, "blocks_free", kv->free, "blocks_shared", kv->shared, "block_bytes",
        (json_int_t)kv->block_bytes, "kv_bytes_used", (json_int_t)(kv->used * kv->block_bytes), "kv_bytes_total",
        (json_int_t)(kv->n_blocks * kv->block_bytes), "prefix_hits", (json_int_t)kv->prefix_hits, "prefix_misses",
        (json_int_t)kv->prefix_misses, "prefix_hit_rate", hit_rate(kv), "running", st.running, "waiting", st.waiting,
        "preemptions", (json_int_t)st.preemptions, "tokens_per_second", st.tokens_per_second, "generated_tokens",
        (json_int_t)st.generated_tokens, "requests_done", (json_int_t)st.requests_done, "requests", reqs, "tiers",
        tiers_json(&st), "prompt_tokens", (json_int_t)st.prompt_tokens, "cached_tokens", (json_int_t)st.cached_tokens);
    if (j) { /* preemption by swap or recompute (docs/kv-tiers.md) */
        json_object_set_new(j, "swaps_out", json_integer((json_int_t)st.swaps_out));
        json_object_set_new(j, "swaps_in", json_integer((json_int_t)st.swaps_in));
        json_object_set_new(j, "recomputes", json_integer((json_int_t)st.recomputes));
        json_object_set_new(j, "swap_bytes", json_integer((json_int_t)st.swap_bytes));
        json_object_set_new(j, "swap_blocks", json_integer((json_int_t)kv->swap_slots));
        json_object_set_new(j, "swap_blocks_used", json_integer((json_int_t)kv->swap_used));
    }
    const char *want = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "blocks");
    if (j && want && (!strcmp(want, "1") || !strcmp(want, "true"))) {
        json_t *blocks = cached_blocks_json(s, kv->n_blocks);
        if (!blocks) {
            json_decref(j);
            return srv_error(c, s, 503, NULL, NULL, "the engine did not list its cached blocks in time");
        }
        json_object_set_new(j, "cached_blocks", blocks);
        json_object_set_new(j, "host_blocks", host_blocks_json(s));
    }
    return srv_json(c, 200, j);
}

static enum MHD_Result get_models(kvlm_server *s, struct MHD_Connection *c) {
    const kvlm_config *cfg = kvlm_model_config(s->model);
    json_t *j = json_pack("{s:s, s:[{s:s, s:s, s:I, s:s, s:{s:i, s:i}}]}", "object", "list", "data", "id",
                          s->model_id, "object", "model", "created", (json_int_t)s->started, "owned_by", "kvlm",
                          "meta", "n_ctx", kvlm_ctx_n_ctx(s->ctx), "n_vocab", cfg->vocab_size);
    return srv_json(c, 200, j);
}

/* ---- requests ------------------------------------------------------------------ */

/* deadline: monotonic seconds by which the connection's request must be in; 0: none.
 * written: MHD has handed the connection's last answer to the kernel. */
static void set_deadline(struct MHD_Connection *c, double deadline, bool written) {
    srv_sock *k = srv_conn_sock(c);
    if (!k) return;
    pthread_mutex_lock(&k->srv->socks_mu);
    k->deadline = deadline;
    if (written) k->writing = false;
    pthread_mutex_unlock(&k->srv->socks_mu);
}

/* The page itself holds nothing secret (it asks for the key), /health is for
 * load balancers; /metrics by choice. */
static bool needs_key(const kvlm_server *s, const char *url) {
    if (!strcmp(url, "/health") || !strcmp(url, "/") || !strcmp(url, "/index.html")) return false;
    return strcmp(url, "/metrics") || s->p.metrics_auth;
}

/* Compares in time that depends on the key's length only, not on where a guess goes wrong. */
static bool key_ok(const kvlm_server *s, struct MHD_Connection *c) {
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncasecmp(h, "Bearer ", 7)) return false;
    h += 7;
    while (*h == ' ') h++;
    size_t n = strlen(h);
    while (n && (h[n - 1] == ' ' || h[n - 1] == '\t')) n--;
    volatile unsigned char diff = (unsigned char)(n != s->api_key_len);
    for (size_t i = 0; i < s->api_key_len; i++)
        diff |= (unsigned char)(s->api_key[i] ^ (i < n ? h[i] : 0));
    return diff == 0;
}

/* application/json, any case, optionally with parameters (charset=utf-8). */
static bool is_json_type(const char *ct) {
    if (!ct) return false;
    while (*ct == ' ' || *ct == '\t') ct++;
    if (strncasecmp(ct, "application/json", 16)) return false;
    char next = ct[16];
    return next == '\0' || next == ';' || next == ' ' || next == '\t';
}

/* A CORS preflight: 204 with what may follow for an allowed origin, 403 otherwise. */
static enum MHD_Result preflight(kvlm_server *s, struct MHD_Connection *c) {
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    if (!origin_allowed(s, origin))
        return srv_error(c, s, 403, NULL, "cors_origin_not_allowed",
                         "cross-origin requests from %s are not allowed (kvlm serve --cors-origin ORIGIN allows one)",
                         origin ? origin : "this origin");
    struct MHD_Response *r = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    srv_cors(c, r);
    MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
    MHD_add_response_header(r, "Access-Control-Allow-Headers", "Authorization, Content-Type");
    MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    enum MHD_Result ret = MHD_queue_response(c, 204, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result count_content_length(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    (void)kind; (void)value;
    if (!strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH)) ++*(int *)cls;
    return MHD_YES;
}

/* A 400 after which the connection is closed: its framing cannot be trusted. */
static enum MHD_Result refuse_and_close(struct MHD_Connection *c, kvlm_server *s, const char *fmt, int n) {
    char msg[256];
    snprintf(msg, sizeof msg, fmt, n);
    pthread_mutex_lock(&s->mu);
    s->http_errors++;
    pthread_mutex_unlock(&s->mu);
    json_t *e = json_pack("{s:{s:s, s:s, s:n, s:s}}", "error", "message", msg, "type", "invalid_request_error", "param",
                          "code", "invalid_content_length");
    char *body = e ? json_dumps(e, JSON_COMPACT) : NULL;
    json_decref(e);
    if (!body) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) { free(body); return MHD_NO; }
    MHD_add_response_header(r, "Content-Type", "application/json");
    MHD_add_response_header(r, "Connection", "close");
    enum MHD_Result ret = MHD_queue_response(c, 400, r);
    MHD_destroy_response(r);
    return ret;
}

/* Takes cn's body up to `want` bytes from max_body_total; false if it has no room. */
static bool body_reserve(kvlm_server *s, srv_conn *cn, size_t want) {
    if (want <= cn->reserved) return true;
    pthread_mutex_lock(&s->mu);
    bool ok = s->body_bytes + (want - cn->reserved) <= s->p.max_body_total;
    if (ok) {
        s->body_bytes += want - cn->reserved;
        cn->reserved = want;
    } else s->bodies_refused++;
    pthread_mutex_unlock(&s->mu);
    return ok;
}

void srv_body_release(kvlm_server *s, srv_conn *cn) {
    free(cn->body);
    cn->body = NULL;
    cn->cap = 0;
    pthread_mutex_lock(&s->mu);
    s->body_bytes -= cn->reserved;
    pthread_mutex_unlock(&s->mu);
    cn->reserved = 0;
}

/* 503: the bodies being received hold max_body_total; the rest of this one is discarded. */
static enum MHD_Result body_busy(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn) {
    cn->answered = true;
    return srv_error(c, s, 503, NULL, "server_busy",
                     "the server is receiving as many request bodies as it holds (%zu bytes); try again", s->p.max_body_total);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    kvlm_server *s = cls;
    srv_conn *cn = *con_cls;
    bool post = !strcmp(method, "POST");
    bool completions = !strcmp(url, "/v1/completions") || !strcmp(url, "/v1/chat/completions");
    bool tokenize = !strcmp(url, "/tokenize") || !strcmp(url, "/detokenize");
    if (!cn) { /* the headers are in: the body (if any) has body_timeout_s to follow */
        if (!(cn = calloc(1, sizeof *cn))) return MHD_NO;
        cn->http11 = version && !strcmp(version, MHD_HTTP_VERSION_1_1);
        *con_cls = cn;
        pthread_mutex_lock(&s->mu);
        s->active++;
        pthread_mutex_unlock(&s->mu);
        set_deadline(c, util_now_s() + s->p.body_timeout_s, false);
        int n_cl = 0; /* MHD frames the body by one of them: two are ambiguous (request smuggling) */
        MHD_get_connection_values(c, MHD_HEADER_KIND, count_content_length, &n_cl);
        if (n_cl > 1) {
            cn->answered = true;
            return refuse_and_close(c, s, "the request has %d Content-Length headers; exactly one is allowed", n_cl);
        }
        if (!strcmp(method, "OPTIONS")) {
            cn->answered = true;
            return preflight(s, c);
        }
        if (s->api_key && needs_key(s, url) && !key_ok(s, c)) {
            cn->answered = true;
            return srv_error(c, s, 401, NULL, "invalid_api_key",
                             "a valid API key is required: send the header 'Authorization: Bearer KEY'");
        }
        if (post) {
            const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
            if (cl && strtoull(cl, NULL, 10) > s->p.max_body) {
                cn->answered = true;
                return srv_error(c, s, 413, NULL, "request_too_large", "the request body is %s bytes; at most %zu are accepted",
                                 cl, s->p.max_body);
            }
            if (cl) cn->expect = (size_t)strtoull(cl, NULL, 10) + 1; /* its buffer grows to this, no more */
            const char *ct = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
            if ((completions || tokenize) && !is_json_type(ct)) {
                cn->answered = true;
                return srv_error(c, s, 415, NULL, "unsupported_media_type",
                                 "the request body must be JSON with 'Content-Type: application/json' (got %s)",
                                 ct ? ct : "none");
            }
        }
        return MHD_YES;
    }
    if (cn->job) return srv_answer(s, c, cn); /* the engine resumed us */
    if (cn->answered) { /* discard the rest of a refused upload */
        if (!*upload_size) set_deadline(c, 0, false);
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) {
        if (cn->len + *upload_size > s->p.max_body) {
            *upload_size = 0;
            cn->answered = true;
            return srv_error(c, s, 413, NULL, "request_too_large", "the request body is larger than %zu bytes",
                             s->p.max_body);
        }
        if (cn->len + *upload_size + 1 > cn->cap) {
            size_t cap = (cn->len + *upload_size + 1) * 2;
            if (cap > s->p.max_body + 1) cap = s->p.max_body + 1;
            if (cn->expect && cap > cn->expect) cap = cn->expect;
            if (cap < cn->len + *upload_size + 1) cap = cn->len + *upload_size + 1;
            /* the bytes a body holds are taken from max_body_total as it grows, so a
             * client that declares a large body and sends a trickle holds a trickle */
            if (!body_reserve(s, cn, cap)) {
                *upload_size = 0;
                return body_busy(s, c, cn);
            }
            char *b = realloc(cn->body, cap);
            if (!b) return MHD_NO;
            cn->body = b;
            cn->cap = cap;
        }
        memcpy(cn->body + cn->len, upload, *upload_size);
        cn->len += *upload_size;
        *upload_size = 0;
        return MHD_YES;
    }
    set_deadline(c, 0, false); /* the request is in: no deadline while it is answered */
    /* an answer made here must be delivered within send_timeout_s; the engine's
     * from when it is made (srv_sock_answer_due). A previous answer still in the
     * kernel's queue (pipelined requests) keeps its own until then. */
    srv_sock *k = srv_conn_sock(c);
    if (k && !completions) srv_sock_answer_due(k);
    else if (k) {
        pthread_mutex_lock(&s->socks_mu);
        if (k->send_due > 0 && !unsent(k->fd)) k->send_due = 0;
        pthread_mutex_unlock(&s->socks_mu);
    }
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if (completions) {
        if (!post) return srv_error(c, s, 405, NULL, "method_not_allowed", "%s takes POST", url);
        return srv_completions(s, c, cn, !strcmp(url, "/v1/chat/completions"));
    }
    if (tokenize) {
        if (!post) return srv_error(c, s, 405, NULL, "method_not_allowed", "%s takes POST", url);
        return !strcmp(url, "/tokenize") ? srv_tokenize(s, c, cn) : srv_detokenize(s, c, cn);
    }
    struct { const char *url; int kind; } gets[] = {
        {"/", 0}, {"/index.html", 0}, {"/health", 1}, {"/v1/models", 2}, {"/metrics", 3}, {"/kvlm/status", 4},
    };
    for (size_t i = 0; i < sizeof gets / sizeof gets[0]; i++) {
        if (strcmp(url, gets[i].url)) continue;
        if (!get) return srv_error(c, s, 405, NULL, "method_not_allowed", "%s takes GET", url);
        switch (gets[i].kind) {
        case 0: return send_text_mode(c, 200, "text/html; charset=utf-8", server_web_page, server_web_page_len, true);
        case 1: return send_text(c, 200, "application/json", "{\"status\":\"ok\"}", 15);
        case 2: return get_models(s, c);
        case 3: return get_metrics(s, c);
        default: return get_status(s, c);
        }
    }
    return srv_error(c, s, 404, NULL, "not_found", "no endpoint %s %s", method, url);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)toe;
    kvlm_server *s = cls;
    srv_conn *cn = *con_cls;
    /* a kept-alive connection's next request has header_timeout_s from now */
    set_deadline(c, util_now_s() + s->p.header_timeout_s, true);
    srv_sock *k = srv_conn_sock(c);
    if (k && k->whole) { /* MHD lets go of the answer */
        srv_unsent_add(s, k, -(long)k->whole, false);
        k->whole = 0;
    }
    if (!cn) return;
    srv_body_release(s, cn);
    srv_conn_done(s, cn);
    pthread_mutex_lock(&s->mu);
    s->active--;
    pthread_mutex_unlock(&s->mu);
    free(cn);
    *con_cls = NULL;
}

/* Every connection is listed from accept to close with the deadline of its
 * request's headers (and later its body): MHD's own timeout is reset by each
 * byte, so a client trickling one byte a second would never meet it. */
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    kvlm_server *s = cls;
    srv_sock *k = *socket_context;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        if (!(k = calloc(1, sizeof *k))) return; /* untracked: MHD's idle timeout still applies */
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        k->srv = s;
        k->fd = ci ? ci->connect_fd : -1;
        k->deadline = util_now_s() + s->p.header_timeout_s;
        pthread_mutex_lock(&s->socks_mu);
        k->next = s->socks;
        if (s->socks) s->socks->prev = k;
        s->socks = k;
        s->n_socks++;
        pthread_mutex_unlock(&s->socks_mu);
        *socket_context = k;
        return;
    }
    if (!k) return;
    /* MHD closes the socket after this returns: once unlisted under socks_mu,
     * the watcher cannot shut down a descriptor that has been reused */
    pthread_mutex_lock(&s->socks_mu);
    if (k->prev) k->prev->next = k->next;
    else s->socks = k->next;
    if (k->next) k->next->prev = k->prev;
    s->n_socks--;
    s->unsent -= k->held; /* nothing should be left: its stream and answer let go first */
    if (k->cutoff) s->unsent_cut -= k->held;
    if (k->fd >= 0 && k->send_due > 0 && unsent(k->fd) > 0) { /* its answer is still on its way */
        int fd = -1;
        if (s->n_drain < s->cap_drain || grow_drain(s)) fd = fcntl(k->fd, F_DUPFD_CLOEXEC, 0);
        if (fd >= 0) s->drain[s->n_drain++] = (srv_drain){fd, k->send_due};
        else reset_on_close(k->fd); /* out of descriptors: no socket is left to the kernel */
    }
    pthread_mutex_unlock(&s->socks_mu);
    free(k);
    *socket_context = NULL;
}

/* Shuts down the sockets of the connections past their deadline: MHD's
 * polling thread then reads the end of the stream and closes them. One whose
 * answer is not delivered by its send deadline (still being written, or still
 * in the kernel's queue) is reset. Closed connections still delivering are
 * closed once their queue is empty, or reset at their deadline. */
static void sweep_deadlines(kvlm_server *s) {
    double now = util_now_s();
    pthread_mutex_lock(&s->socks_mu);
    for (srv_sock *k = s->socks; k; k = k->next) {
        if (k->kicked || k->fd < 0) continue;
        bool late = k->send_due > 0 && now >= k->send_due;
        if (late && !k->writing && !unsent(k->fd)) { /* written and delivered */
            k->send_due = 0;
            late = false;
        }
        if (!late && (k->deadline <= 0 || now < k->deadline)) continue;
        if (late) reset_on_close(k->fd);
        shutdown(k->fd, SHUT_RDWR);
        k->kicked = true;
    }
    for (int i = 0; i < s->n_drain; i++) {
        srv_drain *d = &s->drain[i];
        bool drained = !unsent(d->fd);
        if (!drained && now < d->due) continue;
        if (!drained) reset_on_close(d->fd);
        close(d->fd);
        s->drain[i--] = s->drain[--s->n_drain];
    }
    pthread_mutex_unlock(&s->socks_mu);
}

/* Many clients' buffers freed (bodies, unsent answers, connections): the
 * heap is trimmed, at most once a second, or glibc keeps what they held. */
static void trim_after_frees(kvlm_server *s, double now) {
    pthread_mutex_lock(&s->mu);
    size_t held = s->body_bytes;
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_lock(&s->socks_mu);
    held += s->unsent;
    int n = s->n_socks;
    pthread_mutex_unlock(&s->socks_mu);
    if (held < s->trim_held) s->trim_freed += s->trim_held - held;
    if (n < s->trim_socks) s->trim_freed += (size_t)(s->trim_socks - n) * SRV_CONN_MEMORY;
    s->trim_held = held;
    s->trim_socks = n;
    if (s->trim_freed >= ((size_t)2 << 20) && now - s->trim_at > 1) {
        util_mem_trim();
        s->trim_at = now;
        s->trim_freed = 0;
    }
}

static void *engine_main(void *arg) {
    kvlm_sched_run(arg);
    return NULL;
}

/* A suspended connection's socket is not polled by MHD: this thread waits
 * for the hang-up of any client whose request is in the engine and cancels
 * that request (its event carries the request's id; 0 is the stop signal).
 * Four times a second it also enforces the header, body and send deadlines
 * and sends the keep-alive bytes of silent requests. */
static void *watcher_main(void *arg) {
    kvlm_server *s = arg;
    double next_sweep = 0;
    for (;;) {
        struct epoll_event evs[64];
        int n = epoll_wait(s->watch_fd, evs, 64, 250);
        if (n < 0 && errno != EINTR) break;
        if (util_now_s() >= next_sweep) {
            sweep_deadlines(s);
            trim_after_frees(s, util_now_s());
            srv_keepalive(s);
            next_sweep = util_now_s() + 0.25;
        }
        for (int i = 0; i < n; i++) {
            if (!evs[i].data.u64) return NULL;
            srv_hangup(s, evs[i].data.u64, evs[i].events);
        }
    }
    return NULL;
}

static void model_id_from_path(const char *path, char *out, size_t cap) {
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    const char *dot = strrchr(base, '.');
    size_t n = dot && dot != base ? (size_t)(dot - base) : strlen(base);
    snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), base);
}

/* The whole of a small text file (a PEM key or certificate), NUL-terminated. */
static char *read_text(const char *path, const char *what, kvlm_error *err) {
    size_t len = 0;
    char *b = util_read_file(path, 16u << 20, &len, err);
    if (b && !len) {
        free(b);
        b = NULL;
        util_err_set(err, KVLM_EIO, "cannot read the %s '%s' (empty)", what, path);
    } else if (!b && err) {
        char why[sizeof err->msg];
        snprintf(why, sizeof why, "%s", err->msg);
        util_err_set(err, err->code, "the %s: %s", what, why);
    }
    return b;
}

static void free_config(kvlm_server *s) {
    if (s->api_key) memset(s->api_key, 0, s->api_key_len);
    free(s->api_key);
    free(s->tls_key);
    free(s->tls_cert);
    for (int i = 0; s->cors && i < s->p.n_cors_origins; i++) free(s->cors[i]);
    free(s->cors);
    kvlm_chat_free(s->own_chat);
    s->own_chat = NULL;
}

/* GnuTLS's priorities for the oldest TLS version allowed (NULL: TLS 1.2):
 * TLS 1.0 and 1.1 (SHA-1 and MD5 in the handshake, RFC 8996) are never offered. */
static const char *tls_priorities(const char *min_version) {
    if (!min_version || !strcmp(min_version, "tls1.2")) return "NORMAL:-VERS-ALL:+VERS-TLS1.3:+VERS-TLS1.2";
    if (!strcmp(min_version, "tls1.3")) return "NORMAL:-VERS-ALL:+VERS-TLS1.3";
    return NULL;
}

/* Copies what the server keeps of p (key, origins) and reads the TLS files. */
static int take_config(kvlm_server *s, const kvlm_server_params *p, kvlm_error *err) {
    if (p->api_key) {
        if (!*p->api_key) { util_err_set(err, KVLM_EINVAL, "the API key is empty"); return -1; }
        s->api_key_len = strlen(p->api_key);
        if (!(s->api_key = strdup(p->api_key))) goto nomem;
        s->p.api_key = s->api_key;
    }
    s->p.cors_origins = NULL;
    if (p->n_cors_origins > 0) {
        if (!(s->cors = calloc((size_t)p->n_cors_origins, sizeof *s->cors))) goto nomem;
        for (int i = 0; i < p->n_cors_origins; i++) {
            const char *o = p->cors_origins[i];
            if (!o || !*o || !strcmp(o, "*") || strchr(o, ' ')) {
                util_err_set(err, KVLM_EINVAL, "bad CORS origin '%s' (give one like https://example.com)", o ? o : "");
                return -1;
            }
            if (!(s->cors[i] = strdup(o))) goto nomem;
        }
        s->p.cors_origins = (const char *const *)s->cors;
    } else s->p.n_cors_origins = 0;
    if ((p->kv_events_replay && !p->kv_events) || (p->kv_events_buffer && !p->kv_events_replay)) {
        util_err_set(err, KVLM_EINVAL, p->kv_events_replay ? "--kv-events-replay needs --kv-events"
                                                           : "--kv-events-buffer needs --kv-events-replay");
        return -1;
    }
    if (p->kv_events_buffer < 0) {
        util_err_set(err, KVLM_EINVAL, "--kv-events-buffer %d: give a number of batches, 1 or more",
                     p->kv_events_buffer);
        return -1;
    }
    if (!p->ssl_key_file != !p->ssl_cert_file) {
        util_err_set(err, KVLM_EINVAL, "TLS needs both a key file and a certificate file");
        return -1;
    }
    if (p->ssl_min_version && !tls_priorities(p->ssl_min_version)) {
        util_err_set(err, KVLM_EINVAL, "--ssl-min-version %s: expected tls1.2 or tls1.3", p->ssl_min_version);
        return -1;
    }
    if (p->ssl_min_version && !p->ssl_key_file) {
        util_err_set(err, KVLM_EINVAL, "--ssl-min-version needs --ssl-key-file and --ssl-cert-file");
        return -1;
    }
    if (p->ssl_key_file) {
        if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
            util_err_set(err, KVLM_EINVAL, "this libmicrohttpd was built without TLS");
            return -1;
        }
        if (!(s->tls_key = read_text(p->ssl_key_file, "TLS key", err)) ||
            !(s->tls_cert = read_text(p->ssl_cert_file, "TLS certificate", err)))
            return -1;
    }
    return 0;
nomem:
    util_err_set(err, KVLM_ENOMEM, "out of memory");
    return -1;
}

/* The default connection cap stays within what the descriptor limit allows
 * (each connection is one descriptor; keep some for the model, logs, the
 * engine). One asked for is taken as is: past the fd limit, accept() fails
 * and MHD stops accepting until a connection closes. */
static unsigned conn_limit(int want) {
    if (want > 0) return (unsigned)want;
    unsigned n = 4096u;
    struct rlimit rl;
    if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur != RLIM_INFINITY) {
        rlim_t room = rl.rlim_cur > 96 ? rl.rlim_cur - 64 : 32;
        if (n > room) n = (unsigned)room;
    }
    return n;
}

static void stop_threads(kvlm_server *s, kvlm_sched *sched) {
    uint64_t one = 1;
    if (write(s->stop_fd, &one, sizeof one) != sizeof one) perror("kvlm serve: stopping the watcher");
    pthread_join(s->watcher, NULL);
    kvlm_sched_stop(sched);
    pthread_join(s->engine, NULL);
}

kvlm_server *kvlm_server_start(kvlm_ctx *ctx, const kvlm_server_params *p, kvlm_error *err) {
    kvlm_server *s = calloc(1, sizeof *s);
    if (!s) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    s->ctx = ctx;
    s->watch_fd = s->stop_fd = -1;
    s->model = kvlm_ctx_model(ctx);
    s->p = *p;
    if (!s->p.host) s->p.host = "127.0.0.1";
    if (!s->p.max_body) s->p.max_body = 1 << 20;
    if (!s->p.max_body_total) s->p.max_body_total = s->p.max_body > ((size_t)64 << 20) ? s->p.max_body : (size_t)64 << 20;
    if (!s->p.max_unsent) s->p.max_unsent = (size_t)64 << 20;
    if (s->p.timeout_s <= 0) s->p.timeout_s = 30;
    if (s->p.header_timeout_s <= 0) s->p.header_timeout_s = 10;
    if (s->p.body_timeout_s <= 0) s->p.body_timeout_s = 30;
    if (s->p.send_timeout_s <= 0) s->p.send_timeout_s = 60;
    if (s->p.keepalive_s == 0) s->p.keepalive_s = 2;
    if (s->p.max_conns_per_ip == 0) s->p.max_conns_per_ip = 256;
    if (s->p.model_id) snprintf(s->model_id, sizeof s->model_id, "%s", s->p.model_id);
    else model_id_from_path(s->model->path, s->model_id, sizeof s->model_id);
    s->started = (double)time(NULL);
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->socks_mu, NULL);
    pthread_mutex_init(&s->watch_mu, NULL);
    if (take_config(s, p, err)) goto fail;
    if (s->p.max_body_total < s->p.max_body + 1) {
        util_err_set(err, KVLM_EINVAL, "--max-body-total %zu is below --max-body %zu: no body of that size could be taken",
                     s->p.max_body_total, s->p.max_body);
        goto fail;
    }
    if (!(s->chat = s->p.chat)) {
        /* a template named by the caller must work; the model's own may be
         * one kvlm cannot render: then only chat requests fail, saying why */
        kvlm_chat_params cp = {.template_name = s->p.chat_template};
        kvlm_error cerr = {0};
        if (!(s->chat = s->own_chat = kvlm_chat_create(s->model, &cp, &cerr))) {
            if (s->p.chat_template) {
                util_err_set(err, cerr.code, "%s", cerr.msg);
                goto fail;
            }
            snprintf(s->chat_error, sizeof s->chat_error, "%s", cerr.msg);
            LOG_WARN("%s: /v1/chat/completions will refuse requests", cerr.msg);
        }
    }
    /* IPv4 or IPv6 (e.g. --host ::1, or :: for both stacks where the system allows) */
    struct sockaddr_storage addr;
    memset(&addr, 0, sizeof addr);
    bool v6 = false;
    struct sockaddr_in *a4 = (struct sockaddr_in *)&addr;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&addr;
    if (inet_pton(AF_INET, s->p.host, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET;
    } else if (inet_pton(AF_INET6, s->p.host, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6;
        v6 = true;
    } else {
        struct addrinfo hints = {0}, *res = NULL;
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        if (getaddrinfo(s->p.host, NULL, &hints, &res) || !res) {
            util_err_set(err, KVLM_EINVAL, "cannot resolve host '%s' (give an address such as 127.0.0.1 or ::1)",
                         s->p.host);
            goto fail;
        }
        memcpy(&addr, res->ai_addr, res->ai_addrlen < sizeof addr ? res->ai_addrlen : sizeof addr);
        v6 = res->ai_family == AF_INET6;
        freeaddrinfo(res);
    }
    if (v6) a6->sin6_port = htons((uint16_t)s->p.port);
    else a4->sin_port = htons((uint16_t)s->p.port);
    if (s->p.kv_events) { /* before the engine thread: the sink is its */
        kvlm_kv_stats kst;
        kvlm_kv_stats_get(ctx, &kst);
        /* vLLM's names: its GPU pool, and the CPU memory it offloads to; a pool
         * in CPU memory keeps "CPU", and the host tier below it is "HOST" */
        bool gpu = kvlm_ctx_device(ctx) == KVLM_DEVICE_CUDA;
        const char *medium = gpu ? "GPU" : "CPU", *host_medium = gpu ? "CPU" : "HOST";
        srv_kv_events_params ep = {.endpoint = s->p.kv_events, .topic = s->p.kv_events_topic, .medium = medium,
                                   .host_medium = host_medium, .block_size = kst.block_size,
                                   .replay = s->p.kv_events_replay, .buffer = s->p.kv_events_buffer};
        if (!(s->events = srv_kv_events_start(&ep, err))) goto fail;
        kvlm_kv_event_sink sink = srv_kv_events_sink(s->events);
        kvlm_ctx_set_kv_event_sink(ctx, &sink);
    }
    kvlm_sched_params sp = {.batch_tokens = p->batch_tokens, .max_seqs = p->max_seqs, .spec_mode = p->spec_mode,
                            .spec_n_draft = p->spec_n_draft, .draft_ctx = p->draft_ctx,
                            .spec_p_min = p->spec_p_min};
    if (!(s->sched = kvlm_sched_create(ctx, &sp, err))) goto fail;
    if (pthread_create(&s->engine, NULL, engine_main, s->sched)) {
        util_err_set(err, KVLM_ENOMEM, "cannot start the engine thread");
        kvlm_sched_free(s->sched);
        goto fail;
    }
    s->watch_fd = epoll_create1(EPOLL_CLOEXEC);
    s->stop_fd = eventfd(0, EFD_CLOEXEC);
    struct epoll_event stop_ev = {.events = EPOLLIN, .data.u64 = 0};
    if (s->watch_fd < 0 || s->stop_fd < 0 || epoll_ctl(s->watch_fd, EPOLL_CTL_ADD, s->stop_fd, &stop_ev) ||
        pthread_create(&s->watcher, NULL, watcher_main, s)) {
        util_err_set(err, KVLM_EIO, "cannot start the hang-up watcher: %s", strerror(errno));
        kvlm_sched_stop(s->sched);
        pthread_join(s->engine, NULL);
        kvlm_sched_free(s->sched);
        goto fail;
    }
    /* One thread polls every connection (epoll, or poll: select() cannot
     * watch descriptors past 1023); a connection waiting for the engine is
     * suspended, so a step's tokens wake this one thread, not one per
     * client. */
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_ALLOW_SUSPEND_RESUME |
                     (MHD_is_feature_supported(MHD_FEATURE_EPOLL) == MHD_YES  ? MHD_USE_EPOLL
                      : MHD_is_feature_supported(MHD_FEATURE_POLL) == MHD_YES ? MHD_USE_POLL
                                                                               : 0) |
                     (v6 ? MHD_USE_IPv6 : 0);
    if (s->tls_key) flags |= MHD_USE_TLS;
    struct MHD_OptionItem opts[12];
    int no = 0;
    opts[no++] = (struct MHD_OptionItem){MHD_OPTION_SOCK_ADDR, 0, &addr};
    opts[no++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_TIMEOUT, s->p.timeout_s, NULL};
    /* each connection's headers and read buffer (MHD's default, named: docs/serving.md's bound counts it) */
    opts[no++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_MEMORY_LIMIT, SRV_CONN_MEMORY, NULL};
    opts[no++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_LIMIT, (intptr_t)conn_limit(s->p.max_conns), NULL};
    /* the thread parses every request: its stack sized for the parsers' limits, whatever ulimit -s is */
    opts[no++] = (struct MHD_OptionItem){MHD_OPTION_THREAD_STACK_SIZE, SRV_HTTP_STACK, NULL};
    if (s->p.max_conns_per_ip > 0)
        opts[no++] = (struct MHD_OptionItem){MHD_OPTION_PER_IP_CONNECTION_LIMIT, s->p.max_conns_per_ip, NULL};
    if (s->tls_key) {
        opts[no++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, s->tls_key};
        opts[no++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, s->tls_cert};
        opts[no++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_PRIORITIES, 0, (void *)tls_priorities(s->p.ssl_min_version)};
    }
    opts[no++] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    s->daemon = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s, MHD_OPTION_ARRAY, opts,
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_NOTIFY_CONNECTION,
                                 on_connection, s, MHD_OPTION_END);
    if (!s->daemon) {
        if (s->tls_key)
            util_err_set(err, KVLM_EIO, "cannot listen on %s:%d with TLS (address in use, or the key and certificate "
                         "are not a matching PEM pair?)", s->p.host, s->p.port);
        else
            util_err_set(err, KVLM_EIO, "cannot listen on %s:%d (address in use or not available?)", s->p.host, s->p.port);
        stop_threads(s, s->sched);
        kvlm_sched_free(s->sched);
        goto fail;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : s->p.port;
    return s;
fail:
    if (s->events) {
        kvlm_ctx_set_kv_event_sink(ctx, NULL);
        srv_kv_events_stop(s->events);
    }
    if (s->watch_fd >= 0) close(s->watch_fd);
    if (s->stop_fd >= 0) close(s->stop_fd);
    free_config(s);
    pthread_mutex_destroy(&s->socks_mu);
    pthread_mutex_destroy(&s->watch_mu);
    pthread_mutex_destroy(&s->mu);
    free(s);
    return NULL;
}

int kvlm_server_port(const kvlm_server *s) { return s->port; }

void kvlm_server_stop(kvlm_server *s) {
    if (!s) return;
    MHD_socket listen_fd = MHD_quiesce_daemon(s->daemon); /* no new connections (ours to close, last) */
    pthread_mutex_lock(&s->mu);
    kvlm_sched *sched = s->sched;
    s->sched = NULL; /* no more submits */
    pthread_mutex_unlock(&s->mu);
    stop_threads(s, sched);
    kvlm_sched_free(sched); /* every request ends (cancelled): suspended connections resume and answer */
    if (s->events) { /* the engine thread is gone: the last batch says the cache went with the server */
        kvlm_ctx_set_kv_event_sink(s->ctx, NULL);
        srv_kv_events_stop(s->events);
    }
    /* let them send those answers (a stalled upload is not waited for long) */
    for (int i = 0; i < 200; i++) {
        pthread_mutex_lock(&s->mu);
        int active = s->active;
        pthread_mutex_unlock(&s->mu);
        if (!active) break;
        usleep(10000);
    }
    MHD_stop_daemon(s->daemon);
    for (int i = 0; i < s->n_drain; i++) close(s->drain[i].fd); /* the kernel delivers what it can */
    free(s->drain);
    if (listen_fd != MHD_INVALID_SOCKET) close(listen_fd);
    close(s->watch_fd);
    close(s->stop_fd);
    free_config(s);
    pthread_mutex_destroy(&s->socks_mu);
    pthread_mutex_destroy(&s->watch_mu);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
