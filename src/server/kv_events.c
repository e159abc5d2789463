/* server/kv_events: the KV-events publisher: per-step batches from the
 * engine thread, a bounded queue, a publisher thread that encodes each batch
 * with msgpack-c and sends [topic, seq (8 bytes big-endian), payload] on a
 * ZeroMQ PUB socket. The engine thread never touches ZeroMQ and never waits
 * for the publisher: a full queue drops the step's batch. With a replay
 * endpoint, the publisher keeps the last batches it sent in a ring, and a
 * replay thread answers vLLM's replay requests on a ROUTER socket from it. */
#include "server/kv_events.h"
#include <msgpack.h>
#include <pthread.h>
#include <stdatomic.h>
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
    char *topic, *media[2], *endpoint; /* the pool's medium, the host tier's */
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
    /* replay (NULL socket: none): the ring of sent batches, oldest at
     * ring_head, under rmu (publisher and replay threads only) */
    void *replay;
    pthread_t rthread;
    atomic_bool rstop;
    pthread_mutex_t rmu;
    struct sent { uint64_t seq; uint8_t *payload; size_t len; } *ring;
    int ring_cap, ring_n, ring_head;
    size_t ring_bytes, ring_max_bytes;
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

/* Events [i, j) merge into one: stored blocks that chain, or removals, of one medium. */
static int run_end(const kvlm_kv_event *ev, int n, int i) {
    int j = i + 1;
    if (ev[i].kind == KVLM_KV_EVENT_STORED)
        while (j < n && ev[j].kind == KVLM_KV_EVENT_STORED && ev[j].medium == ev[i].medium && ev[j].has_parent &&
               !memcmp(ev[j].parent, ev[j - 1].hash, 16))
            j++;
    else if (ev[i].kind == KVLM_KV_EVENT_REMOVED)
        while (j < n && ev[j].kind == KVLM_KV_EVENT_REMOVED && ev[j].medium == ev[i].medium) j++;
    return j;
}

uint8_t *srv_kv_events_encode(const kvlm_kv_event *ev, int n, double ts, int block_size, const char *const media[2],
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
        const char *medium = media[ev[i].medium == KVLM_KV_MEDIUM_HOST];
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
    uint8_t *payload = srv_kv_events_encode(b->ev, b->n, b->ts, e->block_size, (const char *const *)e->media, &len);
    bool ok = false;
    if (payload) {
        uint8_t seq[8];
        for (int i = 0; i < 8; i++) seq[i] = (uint8_t)(b->seq >> (56 - 8 * i));
        /* PUB never blocks: past its high-water mark a subscriber's messages are dropped */
        ok = zmq_send(e->pub, e->topic, strlen(e->topic), ZMQ_SNDMORE) >= 0 &&
             zmq_send(e->pub, seq, 8, ZMQ_SNDMORE) >= 0 && zmq_send(e->pub, payload, len, 0) >= 0;
        if (ok && e->replay && len <= e->ring_max_bytes) {
            /* the ring takes the payload; the oldest go while it holds too
             * many batches or bytes (long prompts make large batches) */
            pthread_mutex_lock(&e->rmu);
            while (e->ring_n && (e->ring_n == e->ring_cap || e->ring_bytes + len > e->ring_max_bytes)) {
                struct sent *o = &e->ring[e->ring_head];
                e->ring_bytes -= o->len;
                free(o->payload);
                e->ring_head = (e->ring_head + 1) % e->ring_cap;
                e->ring_n--;
            }
            e->ring[(e->ring_head + e->ring_n++) % e->ring_cap] = (struct sent){b->seq, payload, len};
            e->ring_bytes += len;
            payload = NULL;
            pthread_mutex_unlock(&e->rmu);
        }
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

/* ---- the replay thread ------------------------------------------------------------ */

static void be64(uint8_t out[8], uint64_t v) {
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)(v >> (56 - 8 * i));
}

/* One reply message to `id`: [id, "" (when the request had it), seq, payload].
 * Never waits: false when the peer is gone or its queue is full. */
static bool reply(void *sock, const zmq_msg_t *id, bool delim, const uint8_t seq[8], const void *payload,
                  size_t len) {
    const int more = ZMQ_SNDMORE | ZMQ_DONTWAIT;
    return zmq_send(sock, zmq_msg_data((zmq_msg_t *)id), zmq_msg_size((zmq_msg_t *)id), more) >= 0 &&
           (!delim || zmq_send(sock, "", 0, more) >= 0) && zmq_send(sock, seq, 8, more) >= 0 &&
           zmq_send(sock, payload, len, ZMQ_DONTWAIT) >= 0;
}

/* A request is vLLM's: [identity, "", start seq (8 bytes big-endian)] from a
 * REQ or DEALER socket, or [identity, start seq] from a DEALER that sends no
 * delimiter. The answer: every batch still in the ring from that seq on, as
 * [seq, payload] after the same envelope, then the end mark [-1 (8 bytes
 * 0xff), ""]. A malformed request gets the end mark alone, so a REQ client
 * never hangs on it. */
static void serve_replay(srv_kv_events *e) {
    zmq_msg_t f[3];
    int n = 0;
    size_t extra = 0;
    for (bool more = true; more;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, e->replay, 0) < 0) { zmq_msg_close(&m); break; }
        more = zmq_msg_more(&m);
        if (n < 3) f[n++] = m;
        else { extra++; zmq_msg_close(&m); }
    }
    if (n == 0) return;
    /* [id, "", seq] or [id, seq]; anything else is answered in the envelope it came in */
    const bool delim = n >= 2 && zmq_msg_size(&f[1]) == 0;
    const zmq_msg_t *seqf = extra || n != 2 + delim ? NULL : &f[1 + delim];
    uint8_t end[8];
    memset(end, 0xff, sizeof end);
    uint64_t sent = 0;
    bool ok = true;
    if (seqf && zmq_msg_size((zmq_msg_t *)seqf) == 8) {
        const uint8_t *q = zmq_msg_data((zmq_msg_t *)seqf);
        uint64_t start = 0;
        for (int i = 0; i < 8; i++) start = start << 8 | q[i];
        pthread_mutex_lock(&e->rmu);
        for (int i = 0; i < e->ring_n && ok; i++) {
            const struct sent *r = &e->ring[(e->ring_head + i) % e->ring_cap];
            if (r->seq < start) continue;
            uint8_t sq[8];
            be64(sq, r->seq);
            if ((ok = reply(e->replay, &f[0], delim, sq, r->payload, r->len))) sent++;
        }
        pthread_mutex_unlock(&e->rmu);
    }
    /* counted before the end mark goes: a client that has it reads counts that include its request */
    pthread_mutex_lock(&e->mu);
    if (ok) e->st.replays++;
    e->st.replayed += sent;
    pthread_mutex_unlock(&e->mu);
    if (ok) reply(e->replay, &f[0], delim, end, "", 0);
    for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
}

static void *replay_main(void *arg) {
    srv_kv_events *e = arg;
    while (!atomic_load(&e->rstop)) {
        zmq_pollitem_t it = {e->replay, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) > 0 && (it.revents & ZMQ_POLLIN)) serve_replay(e);
    }
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
    if (e->replay) zmq_close(e->replay);
    for (int i = 0; i < e->ring_n; i++) free(e->ring[(e->ring_head + i) % e->ring_cap].payload);
    free(e->ring);
    if (e->zctx) zmq_ctx_term(e->zctx);
    for (batch *b = e->head, *nb; b; b = nb) { nb = b->next; free(b); }
    free(e->cur);
    free(e->cur_tok);
    free(e->topic);
    free(e->media[0]);
    free(e->media[1]);
    free(e->endpoint);
    free(e);
}

static bool binds(const char *url) {
    return strchr(url, '*') || strstr(url, "::") || !strncmp(url, "ipc://", 6) || !strncmp(url, "inproc://", 9);
}

static void stop_replay(srv_kv_events *e) {
    atomic_store(&e->rstop, true);
    pthread_join(e->rthread, NULL);
}

srv_kv_events *srv_kv_events_start(const srv_kv_events_params *p, kvlm_error *err) {
    const int cap = p->buffer > 0 ? p->buffer : SRV_KV_EVENTS_BUFFER;
    if (p->replay && cap > SRV_KV_EVENTS_BUFFER_MAX) {
        util_err_set(err, KVLM_EINVAL, "--kv-events-buffer %d: at most %d batches", cap, SRV_KV_EVENTS_BUFFER_MAX);
        return NULL;
    }
    srv_kv_events *e = calloc(1, sizeof *e);
    if (!e) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    e->block_size = p->block_size;
    e->topic = strdup(p->topic ? p->topic : "");
    e->media[0] = strdup(p->medium ? p->medium : "CPU");
    e->media[1] = strdup(p->host_medium ? p->host_medium : "HOST");
    e->endpoint = strdup(p->endpoint ? p->endpoint : "");
    if (!e->topic || !e->media[0] || !e->media[1] || !e->endpoint) { release(e); util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    if (!(e->zctx = zmq_ctx_new()) || !(e->pub = zmq_socket(e->zctx, ZMQ_PUB))) {
        util_err_set(err, KVLM_EIO, "--kv-events: cannot create a ZeroMQ socket: %s", zmq_strerror(zmq_errno()));
        release(e);
        return NULL;
    }
    int hwm = SRV_KV_EVENTS_MAX_QUEUED, linger = 1000;
    zmq_setsockopt(e->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(e->pub, ZMQ_LINGER, &linger, sizeof linger); /* the last batches at a stop */
    bool bind = binds(e->endpoint);
    if ((bind ? zmq_bind(e->pub, e->endpoint) : zmq_connect(e->pub, e->endpoint)) != 0) {
        util_err_set(err, KVLM_EINVAL, "--kv-events %s: cannot %s: %s (give e.g. tcp://*:5557 to listen, "
                     "tcp://HOST:5557 to connect to a subscriber that listens)", e->endpoint,
                     bind ? "listen" : "connect", zmq_strerror(zmq_errno()));
        release(e);
        return NULL;
    }
    if (p->replay) { /* always bound, as vLLM's */
        int one = 1, zero = 0, rhwm = cap + 2; /* a whole replay and its end mark fit a peer's queue */
        if (!(e->ring = calloc((size_t)cap, sizeof *e->ring)) || !(e->replay = zmq_socket(e->zctx, ZMQ_ROUTER))) {
            util_err_set(err, KVLM_ENOMEM, "--kv-events-replay: out of memory");
            release(e);
            return NULL;
        }
        e->ring_cap = cap;
        e->ring_max_bytes = p->buffer_bytes > 0 ? p->buffer_bytes : SRV_KV_EVENTS_BUFFER_BYTES;
        zmq_setsockopt(e->replay, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(e->replay, ZMQ_SNDHWM, &rhwm, sizeof rhwm);
        zmq_setsockopt(e->replay, ZMQ_ROUTER_MANDATORY, &one, sizeof one); /* a full peer: an error, not a loss */
        if (zmq_bind(e->replay, p->replay) != 0) {
            util_err_set(err, KVLM_EINVAL, "--kv-events-replay %s: cannot listen: %s (give e.g. tcp://*:5558)",
                         p->replay, zmq_strerror(zmq_errno()));
            release(e);
            return NULL;
        }
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    pthread_mutex_init(&e->rmu, NULL);
    cleared(e);
    bool replaying = e->replay && !pthread_create(&e->rthread, NULL, replay_main, e);
    if ((e->replay && !replaying) || pthread_create(&e->thread, NULL, publisher_main, e)) {
        util_err_set(err, KVLM_ENOMEM, "--kv-events: cannot start the publisher's threads");
        if (replaying) stop_replay(e);
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->cv);
        pthread_mutex_destroy(&e->rmu);
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
    if (e->replay) stop_replay(e); /* after the publisher: the last batches stay replayable to the end */
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->rmu);
    release(e); /* zmq_ctx_term waits up to the linger for the last messages */
}

void srv_kv_events_stats_get(srv_kv_events *e, srv_kv_events_stats *st) {
    pthread_mutex_lock(&e->mu);
    *st = e->st;
    st->queued = e->queued;
    pthread_mutex_unlock(&e->mu);
    if (e->replay) {
        pthread_mutex_lock(&e->rmu);
        st->buffered = (uint64_t)e->ring_n;
        pthread_mutex_unlock(&e->rmu);
    }
}
