/* server/kv_events: the KV-events publisher: per-step batches from the
 * engine thread, a bounded queue, a publisher thread that encodes each batch
 * with msgpack-c and sends [topic, seq (8 bytes big-endian), payload] on a
 * ZeroMQ PUB socket. The engine thread never touches ZeroMQ and never waits
 * for the publisher: a full queue drops the step's batch. With a replay
 * endpoint, the publisher keeps the last batches it sent in a ring, and a
 * replay thread answers vLLM's replay requests on a ROUTER socket from it:
 * each peer gets a cursor into the ring, and only a few messages at a time
 * go into ZeroMQ's queue for it. What ZeroMQ holds for all peers together is
 * capped in bytes (docs/kv-events.md, "Memory bounds"). */
#include "server/kv_events.h"
#include <errno.h>
#include <linux/sockios.h>
#include <linux/tcp.h>
#include <msgpack.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <zmq.h>
#include "util/error.h"
#include "util/mem.h"
#include "util/timing.h"

/* One step's events, owning copies of their tokens. */
typedef struct batch {
    struct batch *next;
    uint64_t seq;
    double ts;
    int n;
    kvlm_kv_event *ev;   /* tokens point into tok */
    int32_t *tok;
} batch;

/* A sent batch's msgpack bytes, shared without copies by the ring and by
 * every ZeroMQ queue that holds it (zmq_msg_init_data: ZeroMQ calls back
 * when it lets go). */
typedef struct payload {
    atomic_int refs;
    size_t len;
    size_t pub_cost; /* what the PUB socket's queues were charged for it */
    uint8_t data[];
} payload;

/* The connections of a socket, from its monitor (ZMQ_EVENT_ACCEPTED or
 * CONNECTED with the descriptor, DISCONNECTED, CLOSED). The descriptors are
 * ZeroMQ's: the only thing done to one is shutdown(), which ZeroMQ sees as
 * the peer going (it closes it and frees the peer's queue), and only after
 * checking that the descriptor is still that connection (its peer address,
 * and the socket's own port or path), so a descriptor closed and reused
 * meanwhile is left alone. */
typedef struct {
    int fd;
    struct sockaddr_storage peer;
    socklen_t plen;
    uint64_t moved;      /* bytes the peer acknowledged (TCP), or what was unsent (IPC), at the last look */
    double since;        /* when its kernel queue was last seen moving or empty */
} zconn;
typedef struct {
    void *mon;           /* PAIR connected to the socket's monitor (one thread's) */
    zconn *c;
    int n, cap;
    int max;             /* more connections than this are closed at once (0: no cap) */
    int kind, port;      /* the socket's own address when it binds: 1 tcp (port), 2 ipc (path); 0: unknown */
    char path[108];
    atomic_uint_fast64_t n_now, refused; /* for the figures (other threads read them) */
} zconns;

/* A peer of the replay socket (replay thread only, but for what ZeroMQ's
 * I/O thread updates through replay_free). */
typedef struct rpeer {
    struct rpeer *next;
    struct srv_kv_events *e;
    uint8_t id[256];     /* ZeroMQ routing ids are at most 255 bytes */
    size_t id_len;
    zconn conn;          /* its connection (fd -1: unknown) */
    bool active, delim, counted, cut;
    uint64_t next_seq, limit; /* the replay in progress: the ring's batches in [next_seq, limit), then the end mark */
    struct { uint64_t start, limit; bool delim; } waiting[SRV_KV_EVENTS_REPLAY_QUEUE]; /* requests behind it */
    int n_waiting;
    uint64_t queued;             /* messages given to ZeroMQ */
    atomic_uint_fast64_t freed;  /* ... and let go by it (sent, or dropped with the connection) */
    uint64_t freed_seen;
    double last_progress;        /* a message went in or out of its queue */
    double next_try;             /* its queue was full: try again then (backing off while it stays full) */
    double backoff;
} rpeer;

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
    /* the PUB socket's connections and what its queues hold (publisher thread; pub_held also ZeroMQ's) */
    zconns pubc;
    double pub_next_sweep;
    int pub_ended;
    atomic_size_t pub_held;
    size_t pub_max;
    /* replay (NULL socket: none): the ring of sent batches, oldest at
     * ring_head, under rmu (publisher and replay threads only) */
    void *replay;
    pthread_t rthread;
    atomic_bool rstop;
    pthread_mutex_t rmu;
    struct sent { uint64_t seq; payload *p; } *ring;
    int ring_cap, ring_n, ring_head;
    size_t ring_bytes, ring_max_bytes;
    /* the replay socket's peers (replay thread) and what its queues hold (also ZeroMQ's) */
    zconns repc;
    rpeer *peers;
    int n_active, max_replays;
    atomic_size_t replay_held;
    size_t replay_max;
    double stall_s;
    atomic_uint_fast64_t g_active;
    payload *empty;            /* the end mark's empty frame */
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

/* ---- payloads and connections ------------------------------------------------------ */

static payload *payload_new(const uint8_t *b, size_t len) {
    payload *p = malloc(sizeof *p + len);
    if (!p) return NULL;
    atomic_init(&p->refs, 1);
    p->len = len;
    p->pub_cost = 0;
    if (len) memcpy(p->data, b, len);
    return p;
}

static void payload_unref(payload *p) {
    if (p && atomic_fetch_sub(&p->refs, 1) == 1) free(p);
}

static payload *payload_of(void *data) { return (payload *)((uint8_t *)data - offsetof(payload, data)); }

static int conns_watch(zconns *z, void *zctx, void *sock, const char *name, void *self, int max, bool bound) {
    char ep[128];
    snprintf(ep, sizeof ep, "inproc://kvlm-kv-events-%p-%s", self, name);
    z->max = max;
    if (zmq_socket_monitor(sock, ep, ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED |
                                         ZMQ_EVENT_CLOSED))
        return -1;
    if (!(z->mon = zmq_socket(zctx, ZMQ_PAIR))) return -1;
    int zero = 0; /* no high-water mark between the monitor and us: no event is lost or waits */
    zmq_setsockopt(z->mon, ZMQ_RCVHWM, &zero, sizeof zero);
    zmq_setsockopt(z->mon, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_connect(z->mon, ep)) return -1;
    char last[512];
    size_t n = sizeof last;
    if (bound && !zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, last, &n)) {
        const char *colon = strrchr(last, ':');
        if (!strncmp(last, "tcp://", 6) && colon) { z->kind = 1; z->port = atoi(colon + 1); }
        else if (!strncmp(last, "ipc://", 6) && strlen(last + 6) < sizeof z->path) {
            z->kind = 2;
            memcpy(z->path, last + 6, strlen(last + 6) + 1);
        }
    }
    return 0;
}

/* Is c->fd still that connection of this socket? */
static bool conn_same(const zconns *z, const zconn *c) {
    struct sockaddr_storage a;
    socklen_t al = sizeof a;
    if (c->fd < 0 || getpeername(c->fd, (struct sockaddr *)&a, &al) || al != c->plen || memcmp(&a, &c->peer, al))
        return false;
    al = sizeof a;
    if (!z->kind) return true;
    if (getsockname(c->fd, (struct sockaddr *)&a, &al)) return false;
    if (z->kind == 1 && a.ss_family == AF_INET) return ntohs(((struct sockaddr_in *)&a)->sin_port) == z->port;
    if (z->kind == 1 && a.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&a)->sin6_port) == z->port;
    if (z->kind == 2 && a.ss_family == AF_UNIX) return !strcmp(((struct sockaddr_un *)&a)->sun_path, z->path);
    return false;
}

static bool conn_record(zconn *c, int fd) {
    c->fd = fd;
    c->moved = 0;
    c->since = 0;
    c->plen = sizeof c->peer;
    if (getpeername(fd, (struct sockaddr *)&c->peer, &c->plen)) { c->fd = -1; return false; }
    return true;
}

/* Closes connection c (ZeroMQ frees its queue); false if it is gone already. */
static bool conn_cut(const zconns *z, const zconn *c) {
    if (!conn_same(z, c)) return false;
    shutdown(c->fd, SHUT_RDWR);
    return true;
}

static int conns_find(const zconns *z, int fd) {
    for (int i = 0; i < z->n; i++)
        if (z->c[i].fd == fd) return i;
    return -1;
}

static void conns_remove(zconns *z, int i) {
    z->c[i] = z->c[--z->n];
    atomic_store(&z->n_now, (uint64_t)z->n);
}

/* Takes the monitor's events: the list of connections, and the cap on them.
 * Returns how many connections ended. */
static int conns_drain(zconns *z) {
    int ended = 0;
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, z->mon, ZMQ_DONTWAIT) < 0) { zmq_msg_close(&m); break; }
        uint16_t ev = 0;
        uint32_t val = 0;
        if (zmq_msg_size(&m) >= 6) {
            memcpy(&ev, zmq_msg_data(&m), 2);
            memcpy(&val, (uint8_t *)zmq_msg_data(&m) + 2, 4);
        }
        while (zmq_msg_more(&m)) { /* the endpoint */
            zmq_msg_close(&m);
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, z->mon, 0) < 0) break;
        }
        zmq_msg_close(&m);
        int fd = (int)val, i = conns_find(z, fd);
        if (ev == ZMQ_EVENT_ACCEPTED || ev == ZMQ_EVENT_CONNECTED) {
            zconn c;
            if (i >= 0) conns_remove(z, i); /* a stale entry: that descriptor was closed and reused */
            if (!conn_record(&c, fd)) continue;
            if (z->max && z->n >= z->max) {
                if (conn_cut(z, &c)) atomic_fetch_add(&z->refused, 1);
                continue;
            }
            if (z->n == z->cap) {
                int cap = z->cap ? 2 * z->cap : 64;
                zconn *nc = realloc(z->c, (size_t)cap * sizeof *nc);
                if (!nc) continue; /* unlisted: it cannot be cut, but still counts nowhere */
                z->c = nc;
                z->cap = cap;
            }
            z->c[z->n++] = c;
            atomic_store(&z->n_now, (uint64_t)z->n);
        } else if ((ev == ZMQ_EVENT_DISCONNECTED || ev == ZMQ_EVENT_CLOSED) && i >= 0) {
            conns_remove(z, i);
            ended++;
        }
    }
    return ended;
}

/* Bytes in fd's kernel send queue that the peer has not acknowledged. */
static int unsent(int fd) {
    int n = 0;
    return ioctl(fd, SIOCOUTQ, &n) ? 0 : n;
}

/* Connections whose kernel send queue has held bytes without the peer
 * taking any for stall_s are cut: the kernel's memory for a peer that does
 * not read is held that long at most (after ZeroMQ's own queue is empty, a
 * replay may sit whole in the kernel's). Returns how many were cut. */
static int conns_sweep(zconns *z, double now, double stall_s) {
    int cut = 0;
    for (int i = 0; i < z->n; i++) {
        zconn *c = &z->c[i];
        int u = unsent(c->fd);
        struct tcp_info ti;
        socklen_t tl = sizeof ti;
        bool tcp = c->peer.ss_family != AF_UNIX && !getsockopt(c->fd, IPPROTO_TCP, TCP_INFO, &ti, &tl) &&
                   tl >= offsetof(struct tcp_info, tcpi_bytes_acked) + sizeof ti.tcpi_bytes_acked;
        uint64_t moved = tcp ? ti.tcpi_bytes_acked : (uint64_t)u;
        bool moving = u == 0 || c->since == 0 || (tcp ? moved != c->moved : moved < c->moved);
        c->moved = moved;
        if (moving) c->since = now;
        else if (now - c->since > stall_s && conn_cut(z, c)) {
            conns_remove(z, i--);
            cut++;
        }
    }
    return cut;
}

/* ---- the publisher thread -------------------------------------------------------- */

/* ZeroMQ lets go of a payload sent on the PUB socket (every subscriber's
 * queue has sent or dropped it): its charge comes off. I/O thread. */
static void pub_free(void *data, void *hint) {
    srv_kv_events *e = hint;
    payload *p = payload_of(data);
    atomic_fetch_sub(&e->pub_held, p->pub_cost);
    payload_unref(p);
}

/* The PUB socket's queues would pass their byte cap: the subscriber with the
 * most bytes unsent in its kernel queue (the one that lags; its ZeroMQ queue
 * is where the held messages are) is disconnected, and the batch waits up
 * to 100 ms for the queues to let go. False: still over, the batch is not
 * published. */
static bool pub_room(srv_kv_events *e, size_t cost) {
    /* a batch larger than the cap alone goes when the queues are empty */
    if (atomic_load(&e->pub_held) + cost <= e->pub_max || !atomic_load(&e->pub_held)) return true;
    conns_drain(&e->pubc);
    int worst = -1, most = 0;
    for (int i = 0; i < e->pubc.n; i++) {
        int u = unsent(e->pubc.c[i].fd);
        if (u > most && conn_same(&e->pubc, &e->pubc.c[i])) { most = u; worst = i; }
    }
    if (worst >= 0 && conn_cut(&e->pubc, &e->pubc.c[worst])) {
        conns_remove(&e->pubc, worst);
        pthread_mutex_lock(&e->mu);
        e->st.subscribers_cut++;
        pthread_mutex_unlock(&e->mu);
    }
    for (int t = 0; t < 20; t++) {
        if (atomic_load(&e->pub_held) + cost <= e->pub_max || !atomic_load(&e->pub_held)) return true;
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    return false;
}

static void send_batch(srv_kv_events *e, batch *b) {
    size_t len = 0;
    uint8_t *bytes = srv_kv_events_encode(b->ev, b->n, b->ts, e->block_size, (const char *const *)e->media, &len);
    payload *p = bytes ? payload_new(bytes, len) : NULL;
    free(bytes);
    bool ok = false, published = false;
    if (p) {
        uint8_t seq[8];
        for (int i = 0; i < 8; i++) seq[i] = (uint8_t)(b->seq >> (56 - 8 * i));
        conns_drain(&e->pubc);
        /* the payload once (the queues share it), and each subscriber's three frames */
        const size_t tl = strlen(e->topic);
        p->pub_cost = len + tl + 8 + (size_t)(e->pubc.n + 1) * 3 * SRV_KV_EVENTS_FRAME_COST;
        ok = true;
        if (pub_room(e, p->pub_cost)) {
            /* PUB never blocks: past its high-water mark a subscriber's messages are dropped */
            zmq_msg_t m;
            atomic_fetch_add(&p->refs, 1);
            atomic_fetch_add(&e->pub_held, p->pub_cost);
            if (zmq_msg_init_data(&m, p->data, len, pub_free, e)) { /* out of memory: not sent */
                atomic_fetch_sub(&e->pub_held, p->pub_cost);
                atomic_fetch_sub(&p->refs, 1);
            } else {
                published = zmq_send(e->pub, e->topic, tl, ZMQ_SNDMORE) >= 0 &&
                            zmq_send(e->pub, seq, 8, ZMQ_SNDMORE) >= 0 && zmq_msg_send(&m, e->pub, 0) >= 0;
                if (!published) zmq_msg_close(&m); /* pub_free takes its charge and reference back */
            }
            ok = published;
        }
        if (ok && e->replay && len <= e->ring_max_bytes) {
            /* the ring takes the payload (also one the PUB socket's cap held back:
             * a subscriber that sees the gap can have it replayed); the oldest go
             * while it holds too many batches or bytes (long prompts make large batches) */
            pthread_mutex_lock(&e->rmu);
            while (e->ring_n && (e->ring_n == e->ring_cap || e->ring_bytes + len > e->ring_max_bytes)) {
                struct sent *o = &e->ring[e->ring_head];
                e->ring_bytes -= o->p->len;
                payload_unref(o->p);
                e->ring_head = (e->ring_head + 1) % e->ring_cap;
                e->ring_n--;
            }
            e->ring[(e->ring_head + e->ring_n++) % e->ring_cap] = (struct sent){b->seq, p};
            e->ring_bytes += len;
            p = NULL;
            pthread_mutex_unlock(&e->rmu);
        }
        payload_unref(p);
    }
    pthread_mutex_lock(&e->mu);
    if (published) { e->st.batches++; e->st.events += (uint64_t)b->n; }
    else { e->st.dropped_batches++; e->st.dropped_events += (uint64_t)b->n; }
    pthread_mutex_unlock(&e->mu);
}

/* The PUB socket's connections: taken from its monitor, those that stall
 * cut (once a second); the heap trimmed after many went. */
static void pub_housekeeping(srv_kv_events *e) {
    double now = util_now_s();
    e->pub_ended += conns_drain(&e->pubc);
    if (now < e->pub_next_sweep) return;
    e->pub_next_sweep = now + 1;
    int cut = conns_sweep(&e->pubc, now, e->stall_s);
    if (cut) {
        pthread_mutex_lock(&e->mu);
        e->st.subscribers_cut += (uint64_t)cut;
        pthread_mutex_unlock(&e->mu);
    }
    if (e->pub_ended) {
        util_mem_trim();
        e->pub_ended = 0;
    }
}

static void *publisher_main(void *arg) {
    srv_kv_events *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        /* woken at least every 100 ms to take the PUB socket's connections (its cap) */
        while (!e->head && !e->stopping) {
            struct timespec t;
            clock_gettime(CLOCK_REALTIME, &t);
            t.tv_nsec += 100000000;
            if (t.tv_nsec >= 1000000000) { t.tv_sec++; t.tv_nsec -= 1000000000; }
            if (pthread_cond_timedwait(&e->cv, &e->mu, &t)) {
                pthread_mutex_unlock(&e->mu);
                pub_housekeeping(e);
                pthread_mutex_lock(&e->mu);
            }
        }
        batch *b = e->head;
        if (!b) break; /* stopping, and everything is sent */
        e->head = b->next;
        if (!e->head) e->tail = NULL;
        e->queued -= (uint64_t)b->n;
        pthread_mutex_unlock(&e->mu);
        send_batch(e, b);
        free(b);
        pub_housekeeping(e);
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* ---- the replay thread ------------------------------------------------------------ */

/* Each replay message is charged its payload and this (four frames, a routing id). */
#define REPLAY_MSG_COST (4 * SRV_KV_EVENTS_FRAME_COST + 256)
#define REPLAY_GRACE_S 1.0 /* at the byte cap, a peer that took nothing for this long is cut */

static void be64(uint8_t out[8], uint64_t v) {
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)(v >> (56 - 8 * i));
}

/* ZeroMQ lets go of a replay message (sent, or dropped with its peer). I/O thread. */
static void replay_free(void *data, void *hint) {
    rpeer *r = hint;
    srv_kv_events *e = r->e;
    payload *p = payload_of(data);
    bool own = p != e->empty;
    atomic_fetch_sub(&e->replay_held, p->len + REPLAY_MSG_COST);
    atomic_fetch_add(&r->freed, 1); /* the last touch of r: the replay thread may free it now */
    if (own) payload_unref(p);
}

static uint64_t in_queue(rpeer *r) { return r->queued - atomic_load(&r->freed); }

/* One message [id, "" (if delim), seq, payload] to r, p's reference given
 * (e->empty: the end mark's). 0 when it went into r's queue, else why not:
 * EAGAIN its queue is full, EHOSTUNREACH it is gone, ENOBUFS the socket's
 * byte cap. Never waits. */
static int replay_send(srv_kv_events *e, rpeer *r, bool delim, uint64_t seq, payload *p) {
    const size_t cost = p->len + REPLAY_MSG_COST;
    size_t held = atomic_load(&e->replay_held);
    if (held + cost > e->replay_max && held) { /* a batch larger than the cap alone goes when the queues are empty */
        if (p != e->empty) payload_unref(p);
        return ENOBUFS;
    }
    const int more = ZMQ_SNDMORE | ZMQ_DONTWAIT;
    if (zmq_send(e->replay, r->id, r->id_len, more) < 0) { /* ROUTER_MANDATORY: the peer's queue decides here */
        int err = zmq_errno();
        if (p != e->empty) payload_unref(p);
        return err;
    }
    uint8_t sq[8];
    be64(sq, seq);
    if (delim) zmq_send(e->replay, "", 0, more);
    zmq_send(e->replay, sq, 8, more);
    zmq_msg_t m;
    if (zmq_msg_init_data(&m, p->data, p->len, replay_free, r)) { /* out of memory: the message ends empty */
        zmq_send(e->replay, "", 0, ZMQ_DONTWAIT);
        if (p != e->empty) payload_unref(p);
        return 0;
    }
    atomic_fetch_add(&e->replay_held, cost);
    r->queued++;
    if (zmq_msg_send(&m, e->replay, ZMQ_DONTWAIT) < 0) zmq_msg_close(&m); /* replay_free balances both */
    return 0;
}

/* The ring's first batch at or after seq, below limit, with a reference; NULL: none. */
static payload *ring_next(srv_kv_events *e, uint64_t seq, uint64_t limit, uint64_t *at) {
    payload *p = NULL;
    pthread_mutex_lock(&e->rmu);
    int lo = 0, hi = e->ring_n; /* seqs increase along the ring */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (e->ring[(e->ring_head + mid) % e->ring_cap].seq < seq) lo = mid + 1;
        else hi = mid;
    }
    if (lo < e->ring_n) {
        const struct sent *s = &e->ring[(e->ring_head + lo) % e->ring_cap];
        if (s->seq < limit) {
            p = s->p;
            atomic_fetch_add(&p->refs, 1);
            *at = s->seq;
        }
    }
    pthread_mutex_unlock(&e->rmu);
    return p;
}

/* The limit of a replay asked now: the batches up to the newest sent so far. */
static uint64_t ring_limit(srv_kv_events *e) {
    pthread_mutex_lock(&e->rmu);
    uint64_t l = e->ring_n ? e->ring[(e->ring_head + e->ring_n - 1) % e->ring_cap].seq + 1 : 0;
    pthread_mutex_unlock(&e->rmu);
    return l;
}

/* r's replay in progress and the requests behind it are abandoned (counted). */
static void peer_drop(srv_kv_events *e, rpeer *r) {
    uint64_t n = (uint64_t)r->n_waiting + r->active;
    pthread_mutex_lock(&e->mu);
    e->st.replays_dropped += n;
    if (r->active && r->counted) e->st.replays--; /* its end mark never went */
    pthread_mutex_unlock(&e->mu);
    if (r->active) e->n_active--;
    r->active = false;
    r->n_waiting = 0;
}

/* r is disconnected: its queue goes with its connection. Its record stays
 * until ZeroMQ has let go of every message it was given. A peer whose
 * connection is not known (ZMQ_SRCFD tells it over TCP, not over IPC)
 * stands for the connection with the most bytes unsent in its kernel
 * queue: one that does not read. */
static void peer_cut(srv_kv_events *e, rpeer *r, double now) {
    peer_drop(e, r);
    if (r->cut) return;
    r->cut = r->conn.fd >= 0; /* else asked again while it stalls (each time for one connection) */
    r->last_progress = now;
    conns_drain(&e->repc);
    int i = r->conn.fd >= 0 ? conns_find(&e->repc, r->conn.fd) : -1;
    bool done = conn_cut(&e->repc, &r->conn);
    if (r->conn.fd < 0) {
        int most = 0;
        for (int k = 0; k < e->repc.n; k++) {
            int u = unsent(e->repc.c[k].fd);
            if (u > most && conn_same(&e->repc, &e->repc.c[k])) { most = u; i = k; }
        }
        done = i >= 0 && conn_cut(&e->repc, &e->repc.c[i]);
    }
    if (done) {
        if (i >= 0) conns_remove(&e->repc, i);
        pthread_mutex_lock(&e->mu);
        e->st.replay_peers_cut++;
        pthread_mutex_unlock(&e->mu);
    }
}

static void peer_start(srv_kv_events *e, rpeer *r, uint64_t start, uint64_t limit, bool delim, double now);

/* The peer whose queue has moved least recently of those that hold
 * something (queued messages, or a replay in progress when active), other than self. */
static rpeer *oldest(srv_kv_events *e, const rpeer *self, bool active) {
    rpeer *o = NULL;
    for (rpeer *r = e->peers; r; r = r->next)
        if (r != self && !r->cut && (active ? r->active : in_queue(r) > 0) &&
            (!o || r->last_progress < o->last_progress))
            o = r;
    return o;
}

static void peer_start(srv_kv_events *e, rpeer *r, uint64_t start, uint64_t limit, bool delim, double now) {
    if (e->n_active >= e->max_replays) { /* the replay that moved least recently gives way */
        rpeer *o = oldest(e, r, true);
        if (o && in_queue(o) && now - o->last_progress > REPLAY_GRACE_S) peer_cut(e, o, now);
        else if (o) peer_drop(e, o);
    }
    r->active = true;
    r->counted = false;
    r->next_seq = start;
    r->limit = limit;
    r->delim = delim;
    r->last_progress = now;
    r->next_try = 0;
    r->backoff = 0.001;
    e->n_active++;
}

/* Sends r what fits of its replay (at most 256 messages, for fairness).
 * Returns true when the socket's byte cap stopped it. */
static bool peer_pump(srv_kv_events *e, rpeer *r, double now) {
    uint64_t sent = 0;
    bool capped = false;
    while (r->active && !r->cut && sent < 256) {
        uint64_t seq = 0;
        payload *p = ring_next(e, r->next_seq, r->limit, &seq);
        int rc;
        if (p) {
            if (!(rc = replay_send(e, r, r->delim, seq, p))) {
                r->next_seq = seq + 1;
                sent++;
                continue;
            }
        } else {
            /* counted before the end mark goes: a client that has it reads counts that include its request */
            pthread_mutex_lock(&e->mu);
            e->st.replayed += sent;
            if (!r->counted) e->st.replays++;
            pthread_mutex_unlock(&e->mu);
            sent = 0;
            r->counted = true;
            if (!(rc = replay_send(e, r, r->delim, UINT64_MAX, e->empty))) {
                r->active = false;
                e->n_active--;
                r->last_progress = now;
                if (r->n_waiting) { /* the next request it sent */
                    uint64_t st = r->waiting[0].start, li = r->waiting[0].limit;
                    bool d = r->waiting[0].delim;
                    memmove(r->waiting, r->waiting + 1, (size_t)--r->n_waiting * sizeof r->waiting[0]);
                    peer_start(e, r, st, li, d, now);
                }
                continue;
            }
        }
        if (rc == EAGAIN) { /* its queue is full: again soon, less often while it stays so */
            r->next_try = now + r->backoff;
            if (r->backoff < 0.05) r->backoff *= 2;
        } else if (rc == ENOBUFS) { /* the socket's cap: again once something left */
            capped = true;
            r->next_try = now + 0.002;
        } else { /* gone (EHOSTUNREACH) */
            peer_drop(e, r);
        }
        break;
    }
    if (sent) {
        r->last_progress = now;
        r->backoff = 0.001;
        pthread_mutex_lock(&e->mu);
        e->st.replayed += sent;
        pthread_mutex_unlock(&e->mu);
    }
    return capped;
}

static rpeer *peer_get(srv_kv_events *e, const zmq_msg_t *idf) {
    size_t n = zmq_msg_size((zmq_msg_t *)idf);
    if (n > 255) return NULL;
    for (rpeer *r = e->peers; r; r = r->next)
        if (r->id_len == n && !memcmp(r->id, zmq_msg_data((zmq_msg_t *)idf), n)) return r;
    rpeer *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->e = e;
    r->id_len = n;
    memcpy(r->id, zmq_msg_data((zmq_msg_t *)idf), n);
    r->conn.fd = -1;
    int fd = zmq_msg_get((zmq_msg_t *)idf, ZMQ_SRCFD); /* the connection it came on */
    if (fd >= 0) {
        int i = conns_find(&e->repc, fd);
        if (i >= 0) r->conn = e->repc.c[i];
        else conn_record(&r->conn, fd);
    }
    r->next = e->peers;
    e->peers = r;
    return r;
}

/* A request is vLLM's: [identity, "", start seq (8 bytes big-endian)] from a
 * REQ or DEALER socket, or [identity, start seq] from a DEALER that sends no
 * delimiter. The answer: every batch still in the ring from that seq on (up
 * to the newest when the request came), as [seq, payload] after the same
 * envelope, then the end mark [-1 (8 bytes 0xff), ""]. A malformed request
 * gets the end mark alone, so a REQ client never hangs on it. A peer's
 * requests are answered one after the other. */
static void replay_recv(srv_kv_events *e, double now) {
    zmq_msg_t f[3];
    int n = 0;
    size_t extra = 0;
    for (bool more = true; more;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, e->replay, ZMQ_DONTWAIT) < 0) { zmq_msg_close(&m); break; }
        more = zmq_msg_more(&m);
        if (n < 3) f[n++] = m;
        else { extra++; zmq_msg_close(&m); }
    }
    if (n == 0) return;
    /* [id, "", seq] or [id, seq]; anything else is answered in the envelope it came in */
    const bool delim = n >= 2 && zmq_msg_size(&f[1]) == 0;
    const zmq_msg_t *seqf = extra || n != 2 + delim ? NULL : &f[1 + delim];
    uint64_t start = 0, limit = 0; /* malformed: nothing below the limit */
    if (seqf && zmq_msg_size((zmq_msg_t *)seqf) == 8) {
        const uint8_t *q = zmq_msg_data((zmq_msg_t *)seqf);
        for (int i = 0; i < 8; i++) start = start << 8 | q[i];
        limit = ring_limit(e);
    }
    rpeer *r = peer_get(e, &f[0]);
    if (!r || r->cut || (r->active && r->n_waiting == SRV_KV_EVENTS_REPLAY_QUEUE)) {
        pthread_mutex_lock(&e->mu);
        e->st.replays_dropped++;
        pthread_mutex_unlock(&e->mu);
    } else if (r->active) {
        r->waiting[r->n_waiting].start = start;
        r->waiting[r->n_waiting].limit = limit;
        r->waiting[r->n_waiting++].delim = delim;
    } else {
        peer_start(e, r, start, limit, delim, now);
    }
    for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
}

static void *replay_main(void *arg) {
    srv_kv_events *e = arg;
    double next_sweep = 0, next_conn_sweep = 0, last_trim = 0;
    size_t held_at_trim = 0;
    int ended = 0;
    while (!atomic_load(&e->rstop)) {
        double now = util_now_s(), wake = now + 0.1;
        for (rpeer *r = e->peers; r; r = r->next)
            if (r->active && !r->cut && r->next_try < wake) wake = r->next_try;
        long ms = wake > now ? (long)((wake - now) * 1000) + 1 : 0;
        zmq_pollitem_t it[2] = {{e->replay, 0, ZMQ_POLLIN, 0}, {e->repc.mon, 0, ZMQ_POLLIN, 0}};
        zmq_poll(it, 2, ms > 100 ? 100 : ms);
        now = util_now_s();
        ended += conns_drain(&e->repc);
        for (int k = 0; k < 1000 && (it[0].revents & ZMQ_POLLIN); k++) {
            int ev = 0;
            size_t el = sizeof ev;
            if (zmq_getsockopt(e->replay, ZMQ_EVENTS, &ev, &el) || !(ev & ZMQ_POLLIN)) break;
            replay_recv(e, now);
        }
        bool capped = false;
        for (rpeer *r = e->peers; r; r = r->next) {
            uint64_t fr = atomic_load(&r->freed);
            if (fr != r->freed_seen) { /* it took something since */
                r->freed_seen = fr;
                r->last_progress = now;
                r->next_try = 0;
                r->backoff = 0.001;
            }
            if (r->active && !r->cut && r->next_try <= now) capped |= peer_pump(e, r, now);
        }
        if (capped) { /* the socket's byte cap: the peer whose queue moved least recently goes first */
            rpeer *o = oldest(e, NULL, false);
            if (o && now - o->last_progress > REPLAY_GRACE_S) peer_cut(e, o, now);
        }
        if (now >= next_sweep) { /* stalled peers, and records nothing refers to any more */
            next_sweep = now + 0.25;
            for (rpeer **pp = &e->peers, *r; (r = *pp);) {
                bool holds = in_queue(r) > 0;
                if (!r->cut && (holds || r->active) && now - r->last_progress > e->stall_s) {
                    if (holds) peer_cut(e, r, now);
                    else peer_drop(e, r);
                }
                if (!r->active && !r->n_waiting && !in_queue(r)) {
                    *pp = r->next;
                    free(r);
                    ended++;
                } else pp = &r->next;
            }
            atomic_store(&e->g_active, (uint64_t)e->n_active);
            if (now >= next_conn_sweep) {
                next_conn_sweep = now + 1;
                int cut = conns_sweep(&e->repc, now, e->stall_s);
                if (cut) {
                    pthread_mutex_lock(&e->mu);
                    e->st.replay_peers_cut += (uint64_t)cut;
                    pthread_mutex_unlock(&e->mu);
                }
            }
            size_t held = atomic_load(&e->replay_held);
            if (held < held_at_trim) ended += (int)((held_at_trim - held) >> 16); /* 64 KiB a unit */
            held_at_trim = held;
            if (ended && now - last_trim > 1) { /* the queues of peers that left: many small blocks */
                util_mem_trim();
                last_trim = now;
                ended = 0;
            }
        }
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
    /* the monitors stop before their readers close: an event sent to no one is leaked by libzmq */
    if (e->pubc.mon) zmq_socket_monitor(e->pub, NULL, 0);
    if (e->repc.mon) zmq_socket_monitor(e->replay, NULL, 0);
    if (e->pubc.mon) zmq_close(e->pubc.mon);
    if (e->repc.mon) zmq_close(e->repc.mon);
    if (e->pub) zmq_close(e->pub);
    if (e->replay) zmq_close(e->replay);
    if (e->zctx) zmq_ctx_term(e->zctx); /* ZeroMQ lets go of every message it held (pub_free, replay_free) */
    for (int i = 0; i < e->ring_n; i++) payload_unref(e->ring[(e->ring_head + i) % e->ring_cap].p);
    free(e->ring);
    for (rpeer *r = e->peers, *nr; r; r = nr) { nr = r->next; free(r); }
    free(e->pubc.c);
    free(e->repc.c);
    free(e->empty);
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
    e->pub_max = p->pub_bytes ? p->pub_bytes : SRV_KV_EVENTS_PUB_BYTES;
    e->replay_max = p->replay_bytes ? p->replay_bytes : SRV_KV_EVENTS_REPLAY_BYTES;
    e->max_replays = p->max_replays > 0 ? p->max_replays : SRV_KV_EVENTS_MAX_REPLAYS;
    e->stall_s = p->stall_s > 0 ? p->stall_s : SRV_KV_EVENTS_STALL_S;
    e->block_size = p->block_size;
    e->topic = strdup(p->topic ? p->topic : "");
    e->media[0] = strdup(p->medium ? p->medium : "CPU");
    e->media[1] = strdup(p->host_medium ? p->host_medium : "HOST");
    e->endpoint = strdup(p->endpoint ? p->endpoint : "");
    e->empty = payload_new(NULL, 0);
    if (!e->topic || !e->media[0] || !e->media[1] || !e->endpoint || !e->empty) { release(e); util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    if (!(e->zctx = zmq_ctx_new()) || !(e->pub = zmq_socket(e->zctx, ZMQ_PUB))) {
        util_err_set(err, KVLM_EIO, "--kv-events: cannot create a ZeroMQ socket: %s", zmq_strerror(zmq_errno()));
        release(e);
        return NULL;
    }
    int hwm = SRV_KV_EVENTS_PUB_HWM, linger = 1000, sndbuf = SRV_KV_EVENTS_SNDBUF;
    zmq_setsockopt(e->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(e->pub, ZMQ_LINGER, &linger, sizeof linger); /* the last batches at a stop */
    zmq_setsockopt(e->pub, ZMQ_SNDBUF, &sndbuf, sizeof sndbuf);
    bool bind = binds(e->endpoint);
    if ((bind ? zmq_bind(e->pub, e->endpoint) : zmq_connect(e->pub, e->endpoint)) != 0) {
        util_err_set(err, KVLM_EINVAL, "--kv-events %s: cannot %s: %s (give e.g. tcp://*:5557 to listen, "
                     "tcp://HOST:5557 to connect to a subscriber that listens)", e->endpoint,
                     bind ? "listen" : "connect", zmq_strerror(zmq_errno()));
        release(e);
        return NULL;
    }
    /* a PUB socket that binds takes at most max_subscribers connections */
    if (conns_watch(&e->pubc, e->zctx, e->pub, "pub", e,
                    bind ? (p->max_subscribers > 0 ? p->max_subscribers : SRV_KV_EVENTS_MAX_SUBSCRIBERS) : 0, bind)) {
        util_err_set(err, KVLM_EIO, "--kv-events: cannot watch the socket's connections: %s", zmq_strerror(zmq_errno()));
        release(e);
        return NULL;
    }
    if (p->replay) { /* always bound, as vLLM's */
        /* a few messages in a peer's queue; the rest of its replay waits as its cursor into the ring */
        int one = 1, zero = 0, rhwm = SRV_KV_EVENTS_REPLAY_HWM, sndbuf = SRV_KV_EVENTS_SNDBUF;
        if (!(e->ring = calloc((size_t)cap, sizeof *e->ring)) || !(e->replay = zmq_socket(e->zctx, ZMQ_ROUTER))) {
            util_err_set(err, KVLM_ENOMEM, "--kv-events-replay: out of memory");
            release(e);
            return NULL;
        }
        e->ring_cap = cap;
        e->ring_max_bytes = p->buffer_bytes > 0 ? p->buffer_bytes : SRV_KV_EVENTS_BUFFER_BYTES;
        zmq_setsockopt(e->replay, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(e->replay, ZMQ_SNDHWM, &rhwm, sizeof rhwm);
        zmq_setsockopt(e->replay, ZMQ_SNDBUF, &sndbuf, sizeof sndbuf);
        zmq_setsockopt(e->replay, ZMQ_ROUTER_MANDATORY, &one, sizeof one); /* a full peer: an error, not a loss */
        if (zmq_bind(e->replay, p->replay) != 0) {
            util_err_set(err, KVLM_EINVAL, "--kv-events-replay %s: cannot listen: %s (give e.g. tcp://*:5558)",
                         p->replay, zmq_strerror(zmq_errno()));
            release(e);
            return NULL;
        }
        if (conns_watch(&e->repc, e->zctx, e->replay, "replay", e,
                        p->max_peers > 0 ? p->max_peers : SRV_KV_EVENTS_MAX_PEERS, true)) {
            util_err_set(err, KVLM_EIO, "--kv-events-replay: cannot watch the socket's connections: %s",
                         zmq_strerror(zmq_errno()));
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
    st->pub_bytes = atomic_load(&e->pub_held);
    st->subscribers = atomic_load(&e->pubc.n_now);
    st->subscribers_refused = atomic_load(&e->pubc.refused);
    if (e->replay) {
        pthread_mutex_lock(&e->rmu);
        st->buffered = (uint64_t)e->ring_n;
        pthread_mutex_unlock(&e->rmu);
        st->replay_bytes = atomic_load(&e->replay_held);
        st->replay_peers = atomic_load(&e->repc.n_now);
        st->replay_peers_refused = atomic_load(&e->repc.refused);
        st->replays_active = atomic_load(&e->g_active);
    }
}
