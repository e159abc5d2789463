/* server/log: the request log and throughput lines (text or JSON, through
 * kvlm_log), the ignored request fields (logged once per name), random
 * public request ids and the map from scheduler ids to them. */
#include "server/log.h"
#include <arpa/inet.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include "util/timing.h"

enum { MAX_IGNORED = 1024, ID_BUCKETS = 256 };

typedef struct id_entry {
    uint64_t id;
    char pub[64];
    struct id_entry *next;
} id_entry;

struct srv_logs {
    pthread_mutex_t mu;
    char *ignored[MAX_IGNORED]; /* field names already logged */
    int n_ignored;
    id_entry *ids[ID_BUCKETS];
    /* the throughput line: the last one's time and counters (watcher thread only) */
    double next_at, last_at;
    uint64_t last_prompt, last_cached, last_generated, last_preemptions;
};

srv_logs *srv_logs_new(void) {
    srv_logs *l = calloc(1, sizeof *l);
    if (l) pthread_mutex_init(&l->mu, NULL);
    return l;
}

void srv_logs_free(srv_logs *l) {
    if (!l) return;
    for (int i = 0; i < l->n_ignored; i++) free(l->ignored[i]);
    for (int b = 0; b < ID_BUCKETS; b++)
        for (id_entry *e = l->ids[b], *n; e; e = n) {
            n = e->next;
            free(e);
        }
    pthread_mutex_destroy(&l->mu);
    free(l);
}

void srv_client_address(struct MHD_Connection *c, char *out, size_t cap) {
    snprintf(out, cap, "?");
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (!ci || !ci->client_addr) return;
    const struct sockaddr *sa = ci->client_addr;
    if (sa->sa_family == AF_INET)
        inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, out, (socklen_t)cap);
    else if (sa->sa_family == AF_INET6)
        inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, out, (socklen_t)cap);
}

void srv_random_id(const char *prefix, char *out, size_t cap) {
    uint8_t r[16];
    ssize_t got = getrandom(r, sizeof r, GRND_NONBLOCK);
    if (got != (ssize_t)sizeof r) { /* no entropy yet: time, pid and a counter, still unique per process */
        static uint64_t counter;
        uint64_t a = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32), b = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED) ^
                                                                              (uint64_t)(util_now_s() * 1e9);
        memcpy(r, &a, 8);
        memcpy(r + 8, &b, 8);
    }
    int k = snprintf(out, cap, "%s", prefix);
    for (int i = 0; i < 16 && k + 2 < (int)cap; i++) k += snprintf(out + k, cap - (size_t)k, "%02x", r[i]);
}

void srv_field_ignored(kvlm_server *s, const char *name) {
    srv_logs *l = s->logs;
    if (!l) return; /* a server struct made by hand (the request parser's tests and fuzzer) */
    bool first = true;
    pthread_mutex_lock(&l->mu);
    for (int i = 0; i < l->n_ignored && first; i++) first = strcmp(l->ignored[i], name) != 0;
    if (first && l->n_ignored < MAX_IGNORED) l->ignored[l->n_ignored++] = strdup(name);
    else if (first) first = false; /* past the cap: no more lines */
    pthread_mutex_unlock(&l->mu);
    if (!first) return;
    if (s->p.log_json) {
        json_t *o = json_pack("{s:s, s:s}", "event", "ignored_field", "field", name);
        char *t = o ? json_dumps(o, JSON_COMPACT) : NULL;
        if (t) kvlm_log(KVLM_LOG_WARN, "%s", t);
        free(t);
        json_decref(o);
    } else
        kvlm_log(KVLM_LOG_WARN, "the request field '%s' is not used by kvlm and was ignored (said once per field name; "
                 "kvlm serve --strict-params refuses unknown fields)", name);
}

void srv_ids_put(kvlm_server *s, uint64_t id, const char *pub) {
    srv_logs *l = s->logs;
    id_entry *e = l ? calloc(1, sizeof *e) : NULL;
    if (!e) return;
    e->id = id;
    snprintf(e->pub, sizeof e->pub, "%s", pub);
    pthread_mutex_lock(&l->mu);
    e->next = l->ids[id % ID_BUCKETS];
    l->ids[id % ID_BUCKETS] = e;
    pthread_mutex_unlock(&l->mu);
}

void srv_ids_drop(kvlm_server *s, uint64_t id) {
    srv_logs *l = s->logs;
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    for (id_entry **pp = &l->ids[id % ID_BUCKETS]; *pp; pp = &(*pp)->next)
        if ((*pp)->id == id) {
            id_entry *e = *pp;
            *pp = e->next;
            free(e);
            break;
        }
    pthread_mutex_unlock(&l->mu);
}

bool srv_ids_get(kvlm_server *s, uint64_t id, char *out, size_t cap) {
    srv_logs *l = s->logs;
    bool found = false;
    if (!l) return false;
    pthread_mutex_lock(&l->mu);
    for (id_entry *e = l->ids[id % ID_BUCKETS]; e && !found; e = e->next)
        if (e->id == id) {
            snprintf(out, cap, "%s", e->pub);
            found = true;
        }
    pthread_mutex_unlock(&l->mu);
    return found;
}

static void put_ms(char *b, size_t cap, size_t *k, const char *key, double sec) {
    if (sec >= 0 && *k < cap) *k += (size_t)snprintf(b + *k, cap - *k, " %s=%.1fms", key, sec * 1e3);
}

void srv_log_request(kvlm_server *s, const srv_reqlog *r) {
    /* /health and /metrics are polled by machines: at debug */
    bool polled = r->endpoint && (!strcmp(r->endpoint, "/health") || !strcmp(r->endpoint, "/metrics"));
    int level = polled ? KVLM_LOG_DEBUG : KVLM_LOG_INFO;
    if (level < kvlm_log_get_level()) return;
    if (s->p.log_json) {
        json_t *o = json_pack("{s:s}", "event", "request");
        if (r->id) json_object_set_new(o, "id", json_string(r->id));
        if (r->sched_id) json_object_set_new(o, "sched_id", json_integer((json_int_t)r->sched_id));
        json_object_set_new(o, "method", json_string(r->method ? r->method : "?"));
        json_object_set_new(o, "endpoint", json_string(r->endpoint ? r->endpoint : "?"));
        json_object_set_new(o, "client", json_string(r->client ? r->client : "?"));
        json_object_set_new(o, "status", r->status ? json_integer(r->status) : json_null());
        if (r->prompt_tokens >= 0) json_object_set_new(o, "prompt_tokens", json_integer(r->prompt_tokens));
        if (r->cached_tokens >= 0) json_object_set_new(o, "cached_tokens", json_integer(r->cached_tokens));
        if (r->generated_tokens >= 0) json_object_set_new(o, "generated_tokens", json_integer(r->generated_tokens));
        if (r->n > 0) json_object_set_new(o, "n", json_integer(r->n));
        if (r->ttft >= 0) json_object_set_new(o, "ttft_s", json_real(r->ttft));
        if (r->tpot >= 0) json_object_set_new(o, "tpot_s", json_real(r->tpot));
        if (r->queue >= 0) json_object_set_new(o, "queue_s", json_real(r->queue));
        if (r->e2e >= 0) json_object_set_new(o, "e2e_s", json_real(r->e2e));
        if (r->finish) json_object_set_new(o, "finish_reason", json_string(r->finish));
        if (r->error) json_object_set_new(o, "error", json_string(r->error));
        char *t = json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII);
        if (t) kvlm_log(level, "%s", t);
        free(t);
        json_decref(o);
        return;
    }
    char b[1536];
    size_t k = (size_t)snprintf(b, sizeof b, "request %s %s %s %s", r->id ? r->id : "-", r->method ? r->method : "?",
                                r->endpoint ? r->endpoint : "?", r->client ? r->client : "?");
    if (r->status) k += (size_t)snprintf(b + k, sizeof b - k, " %u", r->status);
    else k += (size_t)snprintf(b + k, sizeof b - k, " -");
    if (r->prompt_tokens >= 0 && k < sizeof b)
        k += (size_t)snprintf(b + k, sizeof b - k, " prompt=%d cached=%d generated=%d", r->prompt_tokens,
                              r->cached_tokens > 0 ? r->cached_tokens : 0, r->generated_tokens > 0 ? r->generated_tokens : 0);
    if (r->n > 1 && k < sizeof b) k += (size_t)snprintf(b + k, sizeof b - k, " n=%d", r->n);
    put_ms(b, sizeof b, &k, "ttft", r->ttft);
    put_ms(b, sizeof b, &k, "tpot", r->tpot);
    put_ms(b, sizeof b, &k, "queue", r->queue);
    put_ms(b, sizeof b, &k, "e2e", r->e2e);
    if (r->finish && k < sizeof b) k += (size_t)snprintf(b + k, sizeof b - k, " finish=%s", r->finish);
    if (r->sched_id && k < sizeof b) k += (size_t)snprintf(b + k, sizeof b - k, " req=%llu", (unsigned long long)r->sched_id);
    if (r->error && k < sizeof b) snprintf(b + k, sizeof b - k, " error=\"%.300s\"", r->error);
    kvlm_log(level, "%s", b);
}

void srv_log_tick(kvlm_server *s) {
    srv_logs *l = s->logs;
    double every = s->p.log_interval_s, now = util_now_s();
    if (every <= 0 || now < l->next_at) return;
    kvlm_sched_stats st;
    pthread_mutex_lock(&s->mu);
    bool up = s->sched != NULL;
    if (up) kvlm_sched_stats_get(s->sched, &st);
    pthread_mutex_unlock(&s->mu);
    if (!up) return;
    double dt = l->last_at > 0 ? now - l->last_at : every;
    uint64_t prompt = st.prompt_tokens - l->last_prompt, cached = st.cached_tokens - l->last_cached,
             gen = st.generated_tokens - l->last_generated, pre = st.preemptions - l->last_preemptions;
    bool first = l->last_at == 0;
    l->last_at = now;
    l->next_at = now + every;
    l->last_prompt = st.prompt_tokens;
    l->last_cached = st.cached_tokens;
    l->last_generated = st.generated_tokens;
    l->last_preemptions = st.preemptions;
    if (first || (!st.running && !st.waiting && !prompt && !gen)) return; /* idle: nothing to say */
    double usage = st.kv.n_blocks ? (double)st.kv.used / st.kv.n_blocks : 0, hit = prompt ? (double)cached / prompt : 0;
    /* prompt throughput counts the tokens computed, not those found in the prefix cache (as vLLM's) */
    double ptps = (double)(prompt - cached) / dt, gtps = (double)gen / dt;
    if (s->p.log_json) {
        json_t *o = json_pack("{s:s, s:f, s:f, s:i, s:i, s:f, s:f, s:I, s:I}", "event", "throughput",
                              "prompt_tokens_per_s", ptps, "generation_tokens_per_s", gtps, "running", st.running,
                              "waiting", st.waiting, "kv_cache_usage", usage, "prefix_cache_hit_rate", hit,
                              "preemptions", (json_int_t)pre, "swapped_blocks", (json_int_t)st.kv.swap_used);
        char *t = o ? json_dumps(o, JSON_COMPACT) : NULL;
        if (t) kvlm_log(KVLM_LOG_INFO, "%s", t);
        free(t);
        json_decref(o);
    } else
        kvlm_log(KVLM_LOG_INFO, "throughput: prompt %.1f tokens/s, generation %.1f tokens/s, running %d, waiting %d, KV "
                 "cache %.1f%% used, prefix cache hit rate %.1f%%, %llu preempted, %llu blocks swapped out",
                 ptps, gtps, st.running, st.waiting, 100 * usage, 100 * hit, (unsigned long long)pre,
                 (unsigned long long)st.kv.swap_used);
}
