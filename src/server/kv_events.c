/* server/kv_events: the KV-events publisher: per-step batches from the
 * engine thread, a bounded queue, a publisher thread that encodes each batch
 * with msgpack-c and sends [topic, seq (8 bytes big-endian), payload] on a
 * ZeroMQ PUB socket. The engine thread never touches ZeroMQ and never waits
 * for the publisher: a full queue drops the step's batch. */
#include "server/kv_events.h"
#include <msgpack.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>
#include "util/error.h"

/* One step's events, owning copies of their tokens. */
typedef struct batch {
    struct batch *next;
    uint64_t seq;
    double ts;
    int n;
    kvlm_kv_event *ev;   /* tokens point into tok */
    int32_t *tok;
} batch;

struct srv_kv_events {
    void *zctx, *pub;
    char *topic, *medium, *endpoint;
    int block_size;
    pthread_t thread;
    /* the step being collected (engine thread only) */
    kvlm_kv_event *cur;
    int n_cur, cap_cur;
    int32_t *cur_tok;
    size_t n_cur_tok, cap_cur_tok;
    bool cur_oom;              /* an event was lost for memory: the batch is dropped */
    uint64_t next_seq;         /* engine thread (and start/stop, when it is not running) */
    /* the queue and figures (under mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    batch *head, *tail;
    uint64_t queued;
    bool stopping;
    srv_kv_events_stats st;
};

static double wall_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

uint64_t srv_kv_hash64(const uint8_t key[16]) {
    uint64_t v = 0;
    for (int i = 8; i < 16; i++) v = v << 8 | key[i];
    return v;
}

/* ---- encoding ------------------------------------------------------------------ */

static int pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    return msgpack_pack_str(pk, n) | msgpack_pack_str_body(pk, s, n);
}

/* Events [i, j) merge into one: stored blocks that chain, or removals. */
static int run_end(const kvlm_kv_event *ev, int n, int i) {
    int j = i + 1;
    if (ev[i].kind == KVLM_KV_EVENT_STORED)
        while (j < n && ev[j].kind == KVLM_KV_EVENT_STORED && ev[j].has_parent &&
               !memcmp(ev[j].parent, ev[j - 1].hash, 16))
            j++;
    else if (ev[i].kind == KVLM_KV_EVENT_REMOVED)
        while (j < n && ev[j].kind == KVLM_KV_EVENT_REMOVED) j++;
    return j;
}

uint8_t *srv_kv_events_encode(const kvlm_kv_event *ev, int n, double ts, int block_size, const char *medium,
                              size_t *len) {
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    int groups = 0;
    for (int i = 0; i < n; i = run_end(ev, n, i)) groups++;
    /* EventBatch, array_like: [ts, events, data_parallel_rank] */
    int bad = 0; /* sbuffer writes fail only out of memory */
#define P(x) (bad |= (x) != 0)
    P(msgpack_pack_array(&pk, 3));
    P(msgpack_pack_double(&pk, ts));
    P(msgpack_pack_array(&pk, (size_t)groups));
    for (int i = 0, j; i < n && !bad; i = j) {
        j = run_end(ev, n, i);
        if (ev[i].kind == KVLM_KV_EVENT_STORED) {
            /* ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name] */
            P(msgpack_pack_array(&pk, 8));
            P(pack_str(&pk, "BlockStored"));
            P(msgpack_pack_array(&pk, (size_t)(j - i)));
            for (int k = i; k < j; k++) P(msgpack_pack_uint64(&pk, srv_kv_hash64(ev[k].hash)));
            if (ev[i].has_parent) P(msgpack_pack_uint64(&pk, srv_kv_hash64(ev[i].parent)));
            else P(msgpack_pack_nil(&pk));
            size_t nt = 0;
            for (int k = i; k < j; k++) nt += (size_t)ev[k].n_tokens;
            P(msgpack_pack_array(&pk, nt));
            for (int k = i; k < j; k++)
                for (int t = 0; t < ev[k].n_tokens; t++) P(msgpack_pack_int32(&pk, ev[k].tokens[t]));
            P(msgpack_pack_int(&pk, block_size));
            P(msgpack_pack_nil(&pk));
            P(pack_str(&pk, medium));
            P(msgpack_pack_nil(&pk));
        } else if (ev[i].kind == KVLM_KV_EVENT_REMOVED) {
            /* ["BlockRemoved", block_hashes, medium] */
            P(msgpack_pack_array(&pk, 3));
            P(pack_str(&pk, "BlockRemoved"));
            P(msgpack_pack_array(&pk, (size_t)(j - i)));
            for (int k = i; k < j; k++) P(msgpack_pack_uint64(&pk, srv_kv_hash64(ev[k].hash)));
            P(pack_str(&pk, medium));
        } else {
            P(msgpack_pack_array(&pk, 1));
            P(pack_str(&pk, "AllBlocksCleared"));
        }
    }
    P(msgpack_pack_int(&pk, 0));
#undef P
    if (bad || !sb.data) { msgpack_sbuffer_destroy(&sb); return NULL; }
    *len = sb.size;
    return (uint8_t *)msgpack_sbuffer_release(&sb);
}

/* ---- the publisher thread -------------------------------------------------------- */

static void send_batch(srv_kv_events *e, batch *b) {
    size_t len = 0;
    uint8_t *payload = srv_kv_events_encode(b->ev, b->n, b->ts, e->block_size, e->medium, &len);
    bool ok = false;
    if (payload) {
        uint8_t seq[8];
        for (int i = 0; i < 8; i++) seq[i] = (uint8_t)(b->seq >> (56 - 8 * i));
        /* PUB never blocks: past its high-water mark a subscriber's messages are dropped */
        ok = zmq_send(e->pub, e->topic, strlen(e->topic), ZMQ_SNDMORE) >= 0 &&
             zmq_send(e->pub, seq, 8, ZMQ_SNDMORE) >= 0 && zmq_send(e->pub, payload, len, 0) >= 0;
        free(payload);
    }
    pthread_mutex_lock(&e->mu);
    if (ok) { e->st.batches++; e->st.events += (uint64_t)b->n; }
    else { e->st.dropped_batches++; e->st.dropped_events += (uint64_t)b->n; }
    pthread_mutex_unlock(&e->mu);
}

static void *publisher_main(void *arg) {
    srv_kv_events *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->head && !e->stopping) pthread_cond_wait(&e->cv, &e->mu);
        batch *b = e->head;
        if (!b) break; /* stopping, and everything is sent */
        e->head = b->next;
        if (!e->head) e->tail = NULL;
        e->queued -= (uint64_t)b->n;
        pthread_mutex_unlock(&e->mu);
        send_batch(e, b);
        free(b);
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* Queues the collected events as batch `seq` (one allocation), or drops them. */
static void enqueue(srv_kv_events *e, const kvlm_kv_event *ev, int n, const int32_t *tok, size_t n_tok, bool oom) {
    uint64_t seq = e->next_seq++;
    batch *b = oom ? NULL : malloc(sizeof *b + (size_t)n * sizeof(kvlm_kv_event) + n_tok * sizeof(int32_t));
    pthread_mutex_lock(&e->mu);
    if (!b || e->queued + (uint64_t)n > SRV_KV_EVENTS_MAX_QUEUED) {
        e->st.dropped_batches++;
        e->st.dropped_events += (uint64_t)n;
        pthread_mutex_unlock(&e->mu);
        free(b);
        return;
    }
    e->queued += (uint64_t)n;
    pthread_mutex_unlock(&e->mu);
    b->next = NULL;
    b->seq = seq;
    b->ts = wall_now();
    b->n = n;
    b->ev = (kvlm_kv_event *)(b + 1);
    b->tok = (int32_t *)(b->ev + n);
    memcpy(b->ev, ev, (size_t)n * sizeof *ev);
    if (n_tok) memcpy(b->tok, tok, n_tok * sizeof(int32_t));
    for (int i = 0; i < n; i++) /* tokens were stored as offsets into tok */
        if (b->ev[i].kind == KVLM_KV_EVENT_STORED) b->ev[i].tokens = b->tok + (size_t)(uintptr_t)ev[i].tokens;
    pthread_mutex_lock(&e->mu);
    if (e->tail) e->tail->next = b; else e->head = b;
    e->tail = b;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* ---- the sink (engine thread) ----------------------------------------------------- */

static void on_event(void *user, const kvlm_kv_event *ev) {
    srv_kv_events *e = user;
    if (e->n_cur == e->cap_cur) {
        int cap = e->cap_cur ? 2 * e->cap_cur : 64;
        kvlm_kv_event *p = realloc(e->cur, (size_t)cap * sizeof *p);
        if (!p) { e->cur_oom = true; return; }
        e->cur = p;
        e->cap_cur = cap;
    }
    kvlm_kv_event *c = &e->cur[e->n_cur];
    *c = *ev;
    if (ev->kind == KVLM_KV_EVENT_STORED) {
        if (e->n_cur_tok + (size_t)ev->n_tokens > e->cap_cur_tok) {
            size_t cap = 2 * (e->n_cur_tok + (size_t)ev->n_tokens);
            int32_t *p = realloc(e->cur_tok, cap * sizeof *p);
            if (!p) { e->cur_oom = true; return; }
            e->cur_tok = p;
            e->cap_cur_tok = cap;
        }
        memcpy(e->cur_tok + e->n_cur_tok, ev->tokens, (size_t)ev->n_tokens * sizeof(int32_t));
        c->tokens = (const int32_t *)(uintptr_t)e->n_cur_tok; /* an offset until the batch is built */
        e->n_cur_tok += (size_t)ev->n_tokens;
    } else {
        c->tokens = NULL;
        c->n_tokens = 0;
    }
    e->n_cur++;
}

static void on_flush(void *user) {
    srv_kv_events *e = user;
    if (!e->n_cur && !e->cur_oom) return; /* no empty batches */
    enqueue(e, e->cur, e->n_cur, e->cur_tok, e->n_cur_tok, e->cur_oom);
    e->n_cur = 0;
    e->n_cur_tok = 0;
    e->cur_oom = false;
}

kvlm_kv_event_sink srv_kv_events_sink(srv_kv_events *e) {
    kvlm_kv_event_sink s = {on_event, on_flush, e};
    return s;
}

static void cleared(srv_kv_events *e) {
    kvlm_kv_event ev;
    memset(&ev, 0, sizeof ev); /* kind 0: AllBlocksCleared */
    enqueue(e, &ev, 1, NULL, 0, false);
}

/* ---- start and stop ---------------------------------------------------------------- */

static void release(srv_kv_events *e) {
    if (e->pub) zmq_close(e->pub);
    if (e->zctx) zmq_ctx_term(e->zctx);
    for (batch *b = e->head, *nb; b; b = nb) { nb = b->next; free(b); }
    free(e->cur);
    free(e->cur_tok);
    free(e->topic);
    free(e->medium);
    free(e->endpoint);
    free(e);
}

srv_kv_events *srv_kv_events_start(const char *endpoint, const char *topic, const char *medium, int block_size,
                                   kvlm_error *err) {
    srv_kv_events *e = calloc(1, sizeof *e);
    if (!e) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    e->block_size = block_size;
    e->topic = strdup(topic ? topic : "");
    e->medium = strdup(medium ? medium : "CPU");
    e->endpoint = strdup(endpoint ? endpoint : "");
    if (!e->topic || !e->medium || !e->endpoint) { release(e); util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    if (!(e->zctx = zmq_ctx_new()) || !(e->pub = zmq_socket(e->zctx, ZMQ_PUB))) {
        util_err_set(err, KVLM_EIO, "--kv-events: cannot create a ZeroMQ socket: %s", zmq_strerror(zmq_errno()));
        release(e);
        return NULL;
    }
    int hwm = SRV_KV_EVENTS_MAX_QUEUED, linger = 1000;
    zmq_setsockopt(e->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(e->pub, ZMQ_LINGER, &linger, sizeof linger); /* the last batches at a stop */
    bool bind = strchr(e->endpoint, '*') || strstr(e->endpoint, "::") || !strncmp(e->endpoint, "ipc://", 6) ||
                !strncmp(e->endpoint, "inproc://", 9);
    if ((bind ? zmq_bind(e->pub, e->endpoint) : zmq_connect(e->pub, e->endpoint)) != 0) {
        util_err_set(err, KVLM_EINVAL, "--kv-events %s: cannot %s: %s (give e.g. tcp://*:5557 to listen, "
                     "tcp://HOST:5557 to connect to a subscriber that listens)", e->endpoint,
                     bind ? "listen" : "connect", zmq_strerror(zmq_errno()));
        release(e);
        return NULL;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    cleared(e);
    if (pthread_create(&e->thread, NULL, publisher_main, e)) {
        util_err_set(err, KVLM_ENOMEM, "--kv-events: cannot start the publisher thread");
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->cv);
        release(e);
        return NULL;
    }
    return e;
}

void srv_kv_events_stop(srv_kv_events *e) {
    if (!e) return;
    on_flush(e); /* events of a step that never ended */
    cleared(e);
    pthread_mutex_lock(&e->mu);
    e->stopping = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    release(e); /* zmq_ctx_term waits up to the linger for the last messages */
}

void srv_kv_events_stats_get(srv_kv_events *e, srv_kv_events_stats *st) {
    pthread_mutex_lock(&e->mu);
    *st = e->st;
    st->queued = e->queued;
    pthread_mutex_unlock(&e->mu);
}
