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
#include "server/kv_events.h"
#include "server/log.h"
#include "server/metrics.h"
#include "util/error.h"
#include "util/file.h"
#include "util/log.h"
#include "util/mem.h"
#include "util/timing.h"

extern const unsigned char server_web_page[];
extern const size_t server_web_page_len;


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
    srv_sock *ks = srv_conn_sock(c);
    if (ks) ks->status = status, ks->error[0] = '\0'; /* for the request log (srv_error then says why) */
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

enum MHD_Result srv_text(struct MHD_Connection *c, unsigned status, const char *type, const char *data, size_t len) {
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
    enum MHD_Result r = srv_json(c, status, e);
    srv_sock *k = srv_conn_sock(c);
    if (k) snprintf(k->error, sizeof k->error, "%.190s", msg); /* for the request log */
    return r;
}

/* ---- GET endpoints ------------------------------------------------------------ */

static double hit_rate(const kvlm_kv_stats *kv) {
    uint64_t n = kv->prefix_hits + kv->prefix_misses;
    return n ? (double)kv->prefix_hits / (double)n : 0.0;
}

/* One metric per KV tier in /metrics (metrics.c); here their JSON for /kvlm/status. */
static json_t *tiers_json(const kvlm_sched_stats *st) {
    json_t *a = json_array();
    for (int i = 0; i < st->n_tiers; i++) {
        const kvlm_kv_tier_stats *t = &st->tiers[i];
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(t->name));
        json_object_set_new(o, "up", json_boolean(t->up));
#define TIER_JSON(f, type, help) json_object_set_new(o, #f, json_real(srv_tier_field(t, #f)));
        TIER_FIELDS(TIER_JSON)
#undef TIER_JSON
        json_object_set_new(o, "read_ms_mean", json_real(t->reads ? 1e3 * t->read_seconds / (double)t->reads : 0.0));
        json_array_append_new(a, o);
    }
    return a;
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
        char id[64]; /* the id its answer carries (one of a request's prompts: the request's) */
        if (!srv_ids_get(s, info[i].id, id, sizeof id)) snprintf(id, sizeof id, "req-%llu", (unsigned long long)info[i].id);
        json_t *r = json_pack("{s:s, s:I, s:s, s:i, s:i, s:i, s:i, s:i}", "id", id, "sched_id", (json_int_t)info[i].id,
                              "state", states[info[i].state], "prompt_tokens", info[i].prompt_tokens, "generated",
                              info[i].generated, "blocks", info[i].blocks, "shared_blocks", info[i].shared_blocks,
                              "cached_tokens", info[i].cached_tokens);
        if (r && info[i].state == 1) /* a prefill's progress: tokens in the cache of those it computes toward */
            json_object_set_new(r, "prefill", json_pack("{s:i, s:i}", "done", info[i].prefill_done, "total",
                                                        info[i].prefill_total));
        json_array_append_new(reqs, r);
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
    if (j && s->answers) {
        srv_answers_stats as;
        srv_answers_stats_get(s->answers, &as);
        json_object_set_new(j, "chat_answers",
                            json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "kept", (json_int_t)as.entries,
                                      "bytes", (json_int_t)as.bytes, "cap_bytes", (json_int_t)as.cap, "recorded",
                                      (json_int_t)as.recorded, "unmatched", (json_int_t)as.unmatched, "evicted",
                                      (json_int_t)as.evicted, "reused", (json_int_t)as.reused, "reused_tokens",
                                      (json_int_t)as.reused_tokens));
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

static json_t *model_json(kvlm_server *s) {
    const kvlm_config *cfg = kvlm_model_config(s->model);
    /* max_model_len: vLLM's; meta: llama-server's */
    return json_pack("{s:s, s:s, s:I, s:s, s:s, s:i, s:{s:i, s:i}}", "id", s->model_id, "object", "model", "created",
                     (json_int_t)s->started, "owned_by", "kvlm", "root", s->model_id, "max_model_len",
                     kvlm_ctx_n_ctx(s->ctx), "meta", "n_ctx", kvlm_ctx_n_ctx(s->ctx), "n_vocab", cfg->vocab_size);
}

static enum MHD_Result get_models(kvlm_server *s, struct MHD_Connection *c) {
    return srv_json(c, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", model_json(s)));
}

/* GET /v1/models/{id} (the SDKs' models.retrieve): the model, or OpenAI's 404 for another id. */
static enum MHD_Result get_model(kvlm_server *s, struct MHD_Connection *c, const char *id) {
    if (strcmp(id, s->model_id))
        return srv_error(c, s, 404, "model", "model_not_found", "The model '%s' does not exist", id);
    return srv_json(c, 200, model_json(s));
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
    srv_sock *k = srv_conn_sock(c);
    if (k) k->status = 204;
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
    srv_sock *k = srv_conn_sock(c);
    if (k) k->status = 400;
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
    bool embeddings = !strcmp(url, "/v1/embeddings");
    if (!cn) { /* the headers are in: the body (if any) has body_timeout_s to follow */
        if (!(cn = calloc(1, sizeof *cn))) return MHD_NO;
        cn->http11 = version && !strcmp(version, MHD_HTTP_VERSION_1_1);
        cn->t_start = util_now_s();
        snprintf(cn->method, sizeof cn->method, "%s", method);
        snprintf(cn->url, sizeof cn->url, "%s", url);
        srv_client_address(c, cn->client, sizeof cn->client);
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
            if ((completions || tokenize || embeddings) && !is_json_type(ct)) {
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
    if (k && !completions && !embeddings) srv_sock_answer_due(k);
    else if (k) {
        pthread_mutex_lock(&s->socks_mu);
        if (k->send_due > 0 && !unsent(k->fd)) k->send_due = 0;
        pthread_mutex_unlock(&s->socks_mu);
    }
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if (completions) {
        if (!post) return srv_error(c, s, 405, NULL, "method_not_allowed", "%s takes POST", url);
        if (kvlm_model_is_encoder(s->model)) {
            srv_body_release(s, cn);
            return srv_error(c, s, 501, NULL, "not_supported", "This server's model is an encoder: it gives embeddings "
                             "only (POST /v1/embeddings)");
        }
        return srv_completions(s, c, cn, !strcmp(url, "/v1/chat/completions"));
    }
    if (embeddings) {
        if (!post) return srv_error(c, s, 405, NULL, "method_not_allowed", "%s takes POST", url);
        return srv_embeddings(s, c, cn);
    }
    if (tokenize) {
        if (!post) return srv_error(c, s, 405, NULL, "method_not_allowed", "%s takes POST", url);
        return !strcmp(url, "/tokenize") ? srv_tokenize(s, c, cn) : srv_detokenize(s, c, cn);
    }
    struct { const char *url; int kind; } gets[] = {
        {"/", 0}, {"/index.html", 0}, {"/health", 1}, {"/v1/models", 2}, {"/metrics", 3}, {"/kvlm/status", 4},
    };
    if (!strncmp(url, "/v1/models/", 11) && url[11]) {
        if (!get) return srv_error(c, s, 405, NULL, "method_not_allowed", "%s takes GET", url);
        return get_model(s, c, url + 11);
    }
    for (size_t i = 0; i < sizeof gets / sizeof gets[0]; i++) {
        if (strcmp(url, gets[i].url)) continue;
        if (!get) return srv_error(c, s, 405, NULL, "method_not_allowed", "%s takes GET", url);
        switch (gets[i].kind) {
        case 0: return send_text_mode(c, 200, "text/html; charset=utf-8", server_web_page, server_web_page_len, true);
        case 1: return send_text(c, 200, "application/json", "{\"status\":\"ok\"}", 15);
        case 2: return get_models(s, c);
        case 3: return srv_get_metrics(s, c);
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
    if (!cn->job_logs && strcmp(cn->method, "OPTIONS")) { /* a completion's job logs its own line */
        srv_reqlog rl = {.method = cn->method, .endpoint = cn->url, .client = cn->client,
                         .status = k && toe == MHD_REQUEST_TERMINATED_COMPLETED_OK ? k->status : 0,
                         .prompt_tokens = -1, .cached_tokens = -1, .generated_tokens = -1,
                         .ttft = -1, .tpot = -1, .queue = -1, .e2e = util_now_s() - cn->t_start,
                         .error = k && k->error[0] && k->status >= 400 ? k->error : NULL};
        srv_log_request(s, &rl);
    }
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
            srv_log_tick(s);
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
    if (write(s->stop_fd, &one, sizeof one) != sizeof one)
        kvlm_log(KVLM_LOG_ERROR, "stopping the watcher: %s", strerror(errno));
    pthread_join(s->watcher, NULL);
    kvlm_sched_stop(sched);
    pthread_join(s->engine, NULL);
}

/* OpenAI's system_fingerprint ("fp_" and 10 hex digits): changes when what
 * shapes answers does (the model file, its id, the context, the cache types,
 * the template), so a client can tell answers of one configuration apart. */
static void srv_fingerprint(kvlm_server *s) {
    uint64_t h = 1469598103934665603ull;
    char buf[1024];
    kvlm_kv_stats kv;
    kvlm_kv_stats_get(s->ctx, &kv);
    int n = snprintf(buf, sizeof buf, "%s|%s|%zu|%d|%d|%d|%d|%s", kvlm_model_path(s->model), s->model_id,
                     kvlm_model_weight_bytes(s->model), kvlm_ctx_n_ctx(s->ctx), kv.type_k, kv.type_v, kv.block_size,
                     s->p.chat_template ? s->p.chat_template : "");
    for (int i = 0; i < n && i < (int)sizeof buf; i++) h = (h ^ (uint8_t)buf[i]) * 1099511628211ull; /* FNV-1a */
    snprintf(s->fingerprint, sizeof s->fingerprint, "fp_%010llx", (unsigned long long)(h & 0xffffffffffull));
}

kvlm_server *kvlm_server_start(kvlm_ctx *ctx, const kvlm_server_params *p, kvlm_error *err) {
    if (kvlm_model_is_encoder(kvlm_ctx_model(ctx)) && !p->embeddings) {
        util_err_set(err, KVLM_EINVAL, "the model is an encoder (bert, nomic-bert): it gives embeddings only; start the "
                     "server with --embeddings");
        return NULL;
    }
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
    else model_id_from_path(kvlm_model_path(s->model), s->model_id, sizeof s->model_id);
    s->started = (double)time(NULL);
    if (s->p.log_interval_s == 0) s->p.log_interval_s = 10;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->socks_mu, NULL);
    pthread_mutex_init(&s->watch_mu, NULL);
    if (take_config(s, p, err)) goto fail;
    if (!(s->metrics = srv_metrics_new(kvlm_ctx_n_ctx(ctx))) || !(s->logs = srv_logs_new())) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        goto fail;
    }
    srv_fingerprint(s);
    if (s->p.max_body_total < s->p.max_body + 1) {
        util_err_set(err, KVLM_EINVAL, "--max-body-total %zu is below --max-body %zu: no body of that size could be taken",
                     s->p.max_body_total, s->p.max_body);
        goto fail;
    }
    if (s->p.answer_ids_mem >= 0) {
        size_t cap = s->p.answer_ids_mem ? (size_t)s->p.answer_ids_mem : (size_t)16 << 20;
        if (!(s->answers = srv_answers_create(cap, s->model, s->model_id))) {
            util_err_set(err, KVLM_ENOMEM, "out of memory");
            goto fail;
        }
    }
    if (!(s->chat = s->p.chat)) {
        /* a template named by the caller must work; the model's own may be
         * one kvlm cannot render: then only chat requests fail, saying why */
        kvlm_chat_params cp = {.template_name = s->p.chat_template, .tool_parser = s->p.tool_parser,
                               .reasoning_format = s->p.reasoning_format};
        kvlm_error cerr = {0};
        if (!(s->chat = s->own_chat = kvlm_chat_create(s->model, &cp, &cerr))) {
            if (s->p.chat_template || (s->p.tool_parser && cerr.code == KVLM_EINVAL && strstr(cerr.msg, "tool-call parser"))) {
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
                            .spec_p_min = p->spec_p_min, .spec_n_min = p->spec_n_min};
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
    srv_answers_free(s->answers);
    free_config(s);
    srv_metrics_free(s->metrics);
    srv_logs_free(s->logs);
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
    srv_answers_free(s->answers); /* the engine and HTTP threads, which use it, are gone */
    free_config(s);
    srv_metrics_free(s->metrics);
    srv_logs_free(s->logs);
    pthread_mutex_destroy(&s->socks_mu);
    pthread_mutex_destroy(&s->watch_mu);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
