/* kv/tier_redis: the Redis tier: KV blocks shared by every engine process
 * that points at one Redis server, through hiredis.
 *
 * Layout: one string per block, key "kvlm:blk:<32 hex digits>" (kv_key_hex),
 * value the block's bytes, SET without expiry. Eviction is Redis's own: run
 * the server with a memory cap and an LRU policy, e.g.
 *     redis-server --maxmemory 8gb --maxmemory-policy allkeys-lru
 * (or CONFIG SET maxmemory / maxmemory-policy at run time). Without a cap
 * Redis grows until the machine runs out; with "noeviction" a full server
 * answers SET with an OOM error, which this tier counts as dropped writes.
 *
 * Threads and connections:
 * - put and drop copy the command into a bounded queue and return at once;
 *   one background thread (the writer) drains it on its own connection,
 *   many SETs per round trip (append all, then read all replies).
 * - get and contains run in the caller's thread on one of a few reader
 *   connections (one caller per connection at a time), one round trip each,
 *   bounded by the tier's timeout as a whole: the socket timeouts shrink as
 *   the deadline nears, and a caller that finds every reader busy waits at
 *   most until the same deadline.
 * - A broken connection (any I/O error, timeout or protocol surprise) is
 *   closed at once; the writer thread reconnects it, at most one attempt per
 *   connection every KV_REDIS_RETRY_MS, and only after the server answers
 *   PING. Callers never connect, so a down or hung server costs a caller at
 *   most one timeout, then nothing (immediate misses) until it is back.
 * - The writer thread also asks DBSIZE and INFO memory once a second for
 *   stats (blocks, bytes: the whole database as Redis sees it, shared with
 *   every other process; this process cannot know which keys are still
 *   there) and to notice a dead server while idle.
 *
 * SIGPIPE: hiredis 0.14 writes with write(2), so a write to a closed socket
 * raises SIGPIPE. `kvlm serve` ignores it process-wide, but a library user
 * may not: the writer thread runs with every signal blocked, and callers'
 * I/O runs with SIGPIPE blocked and any SIGPIPE it raised taken back before
 * the mask is restored (the usual recipe of libraries that cannot use
 * MSG_NOSIGNAL). */
#include "kv/tier.h"
#include <errno.h>
#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include "util/error.h"
#include "util/timing.h"

/* The put queue's bounds: what a serving process may hold in blocks not yet
 * written. 128 MiB is ~180 TinyLlama f32 blocks and about a tenth of a
 * second of a local Redis's write speed: enough to ride out a burst of
 * demotions, small beside the model. The count bound keeps tiny blocks from
 * piling up thousands of commands. */
#define KV_REDIS_QUEUE_BYTES ((size_t)128 << 20)
#define KV_REDIS_QUEUE_BLOCKS 4096
/* One pipelined round trip of the writer: at most this many commands or
 * bytes (so a slow server never holds a huge batch in flight). */
#define KV_REDIS_BATCH_CMDS 64
#define KV_REDIS_BATCH_BYTES ((size_t)16 << 20)
/* Reader connections: parallel get/contains callers beyond this wait. */
#define KV_REDIS_READERS 4
/* At most one connection attempt per connection this often. */
#define KV_REDIS_RETRY_MS 500
/* The writer's deadline for one round trip (at least the tier's timeout). A
 * 16 MiB batch takes ~20 ms on loopback, ~150 ms over 1 Gb/s. */
#define KV_REDIS_WRITE_MS 1000
/* flush gives up when no queued command completes for this long (the
 * writer's deadline plus slack), and in any case after KV_REDIS_FLUSH_MAX_MS:
 * what is still queued then is dropped and counted. */
#define KV_REDIS_FLUSH_STALL_MS (KV_REDIS_WRITE_MS + 500)
#define KV_REDIS_FLUSH_MAX_MS 10000
/* Stats poll (DBSIZE, INFO memory) period. */
#define KV_REDIS_POLL_MS 1000
/* The largest block put accepts (Redis's proto-max-bulk-len is 512 MB). */
#define KV_REDIS_MAX_BLOCK ((size_t)64 << 20)
/* Bytes a reader asks the socket for at once (hiredis reads 16 KiB). */
#define KV_REDIS_READ_CHUNK ((size_t)256 << 10)

#define KEY_PREFIX "kvlm:blk:"
#define KEY_LEN (sizeof KEY_PREFIX - 1 + 32)

enum { OP_SET, OP_DEL };

/* A queued command, formatted by hiredis at put (the one copy of the
 * block's bytes); the writer sends a batch of them with one writev. */
typedef struct qnode {
    struct qnode *next;
    uint64_t seq;
    int op;
    size_t len;     /* the block's bytes (OP_SET) */
    char *cmd;      /* RESP, from redisFormatCommandArgv */
    size_t cmd_len; /* what the queue's byte bound counts */
} qnode;

typedef struct {
    redisContext *c; /* NULL: down */
    bool busy;       /* taken by a caller, or by the writer reconnecting it */
    double next_try; /* earliest next connection attempt */
} reader;

typedef struct {
    kv_tier base;
    char host[256];
    int port, db;
    int timeout_ms;

    /* queue: q_mu guards it, the writer's state and the flush sequence */
    pthread_mutex_t q_mu;
    pthread_cond_t q_cv;    /* work for the writer, or stop */
    pthread_cond_t done_cv; /* done_seq moved */
    qnode *head, *tail;     /* head..: queued; the first `inflight` are being written */
    int inflight;
    size_t q_count, q_bytes; /* includes the in-flight batch */
    uint64_t next_seq, done_seq;
    bool stop;
    pthread_t thread;
    bool thread_started;

    redisContext *w; /* the writer's connection; only the writer thread (or open/close) touches it */
    double w_next_try, next_poll;

    /* readers: r_mu guards the slots' c and busy (a slot's connection is used
     * without the lock by whoever marked it busy) */
    pthread_mutex_t r_mu;
    pthread_cond_t r_cv; /* a slot was released */
    reader readers[KV_REDIS_READERS];
    unsigned r_next;
    unsigned char *rbuf[KV_REDIS_READERS]; /* read chunk per slot */

    _Atomic bool up;
    _Atomic uint64_t hits, misses, writes, write_bytes, dropped, errors, reads, read_ns;
    _Atomic uint64_t blocks, bytes;
} redis_tier;

/* ---- small helpers ---- */

static void key_name(const kv_key *k, char out[KEY_LEN + 1]) {
    memcpy(out, KEY_PREFIX, sizeof KEY_PREFIX - 1);
    kv_key_hex(k, out + sizeof KEY_PREFIX - 1);
}

static struct timeval tv_of(double s) {
    if (s < 0.001) s = 0.001; /* 0 would mean "no timeout" */
    struct timeval tv;
    tv.tv_sec = (time_t)s;
    tv.tv_usec = (suseconds_t)((s - (double)tv.tv_sec) * 1e6);
    return tv;
}

static void abs_deadline(struct timespec *ts, double deadline) {
    /* condvars here run on CLOCK_MONOTONIC, the clock util_now_s reads */
    ts->tv_sec = (time_t)deadline;
    ts->tv_nsec = (long)((deadline - (double)ts->tv_sec) * 1e9);
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

static void cond_init_mono(pthread_cond_t *cv) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
}

/* SIGPIPE blocked around a caller's socket I/O; one it raised is consumed. */
typedef struct {
    sigset_t old;
    bool was_pending;
} pipe_guard;

static void pipe_block(pipe_guard *g) {
    sigset_t s, pend;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    sigemptyset(&pend);
    sigpending(&pend);
    g->was_pending = sigismember(&pend, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &s, &g->old);
}

static void pipe_restore(pipe_guard *g) {
    sigset_t s, pend;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    sigemptyset(&pend);
    sigpending(&pend);
    if (!g->was_pending && sigismember(&pend, SIGPIPE) == 1) {
        struct timespec zero = {0, 0};
        while (sigtimedwait(&s, NULL, &zero) < 0 && errno == EINTR) {}
    }
    pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

/* ---- one round trip on a blocking context, bounded by a deadline ---- */

/* Sets the socket timeouts to what is left before deadline when that is
 * well below what is set now (re-set at 80%, so few system calls and an
 * overshoot of at most a quarter of what is left). */
static bool io_budget(redisContext *c, double deadline, double *set_s) {
    double left = deadline - util_now_s();
    if (left <= 0) return false;
    if (*set_s <= 0 || left < *set_s * 0.8) {
        if (redisSetTimeout(c, tv_of(left)) != REDIS_OK) return false;
        *set_s = left;
    }
    return true;
}

/* Writes everything appended to c. */
static bool rt_send(redisContext *c, double deadline, double *set_s) {
    int done = 0;
    while (!done) {
        if (!io_budget(c, deadline, set_s)) return false;
        if (redisBufferWrite(c, &done) != REDIS_OK) return false;
    }
    return true;
}

/* Writes n buffers (the writer's batch: no copy into hiredis's buffer). */
static bool send_iov(redisContext *c, struct iovec *iov, int n, double deadline, double *set_s) {
    while (n > 0) {
        if (!io_budget(c, deadline, set_s)) return false;
        ssize_t w = writev(c->fd, iov, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return false; /* EAGAIN: the send timeout passed */
        }
        while (n > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return true;
}

/* Reads one reply (NULL: error or deadline passed). rbuf: a read chunk of
 * KV_REDIS_READ_CHUNK bytes, or NULL for hiredis's own 16 KiB reads. */
static redisReply *rt_recv(redisContext *c, double deadline, double *set_s, unsigned char *rbuf) {
    void *r = NULL;
    if (redisReaderGetReply(c->reader, &r) != REDIS_OK) return NULL;
    while (!r) {
        if (!io_budget(c, deadline, set_s)) return NULL;
        if (rbuf) {
            ssize_t n = read(c->fd, rbuf, KV_REDIS_READ_CHUNK);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) return NULL; /* timeout (EAGAIN), error or EOF */
            if (redisReaderFeed(c->reader, (const char *)rbuf, (size_t)n) != REDIS_OK) return NULL;
        } else if (redisBufferRead(c) != REDIS_OK) {
            return NULL;
        }
        if (redisReaderGetReply(c->reader, &r) != REDIS_OK) return NULL;
    }
    return r;
}

/* Connects, selects the database and checks the server answers (PING),
 * all within timeout_ms. NULL if it is not there or not answering. */
static redisContext *rconnect(redis_tier *t) {
    double deadline = util_now_s() + t->timeout_ms / 1000.0;
    redisContext *c = redisConnectWithTimeout(t->host, t->port, tv_of(t->timeout_ms / 1000.0));
    if (!c) return NULL;
    if (c->err) { redisFree(c); return NULL; }
    double set_s = 0;
    bool ok = true;
    int n = 1;
    if (t->db) {
        ok = redisAppendCommand(c, "SELECT %d", t->db) == REDIS_OK;
        n++;
    }
    ok = ok && redisAppendCommand(c, "PING") == REDIS_OK && rt_send(c, deadline, &set_s);
    for (int i = 0; ok && i < n; i++) {
        redisReply *r = rt_recv(c, deadline, &set_s, NULL);
        ok = r && (r->type == REDIS_REPLY_STATUS);
        if (r) freeReplyObject(r);
    }
    if (!ok) { redisFree(c); return NULL; }
    /* keep the read buffer between replies (hiredis frees it past 16 KiB
     * and regrows it for every block); it never holds much more than one
     * block and a read chunk, the reader consumes as it parses */
    c->reader->maxbuf = 0;
    return c;
}

/* ---- readers (callers' threads) ---- */

/* Takes a connected reader slot, waiting for a busy one until deadline.
 * -1: none is connected, or none came free in time. */
static int reader_take(redis_tier *t, double deadline) {
    pthread_mutex_lock(&t->r_mu);
    int got = -1;
    for (;;) {
        bool any_up = false;
        for (int k = 0; k < KV_REDIS_READERS; k++) {
            int i = (int)((t->r_next + (unsigned)k) % KV_REDIS_READERS);
            reader *r = &t->readers[i];
            if (!r->c) continue;
            any_up = true;
            if (!r->busy) { got = i; break; }
        }
        if (got >= 0 || !any_up) break;
        struct timespec ts;
        abs_deadline(&ts, deadline);
        if (pthread_cond_timedwait(&t->r_cv, &t->r_mu, &ts) == ETIMEDOUT) break;
    }
    if (got >= 0) {
        t->readers[got].busy = true;
        t->r_next = (unsigned)got + 1;
    }
    pthread_mutex_unlock(&t->r_mu);
    return got;
}

/* Gives the slot back; broken: close its connection (the writer thread
 * reconnects it after KV_REDIS_RETRY_MS). */
static void reader_give(redis_tier *t, int i, bool broken) {
    pthread_mutex_lock(&t->r_mu);
    reader *r = &t->readers[i];
    if (broken) {
        redisFree(r->c);
        r->c = NULL;
        r->next_try = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
        atomic_fetch_add(&t->errors, 1);
    }
    r->busy = false;
    pthread_cond_broadcast(&t->r_cv);
    pthread_mutex_unlock(&t->r_mu);
}

/* argv for one command over n keys: cmd + n key names, in one allocation. */
typedef struct {
    const char **argv;
    size_t *lens;
    char (*names)[KEY_LEN + 1];
} key_argv;

static bool key_argv_make(key_argv *a, const char *cmd, int n, const kv_key *keys) {
    size_t m = (size_t)n + 1;
    void *p = malloc(m * (sizeof(char *) + sizeof(size_t)) + (size_t)n * (KEY_LEN + 1));
    if (!p) return false;
    a->argv = p;
    a->lens = (size_t *)(a->argv + m);
    a->names = (char (*)[KEY_LEN + 1])(a->lens + m);
    a->argv[0] = cmd;
    a->lens[0] = strlen(cmd);
    for (int i = 0; i < n; i++) {
        key_name(&keys[i], a->names[i]);
        a->argv[i + 1] = a->names[i];
        a->lens[i + 1] = KEY_LEN;
    }
    return true;
}

/* MGET's reply is parsed straight into the caller's buffers: reply-object
 * functions (hiredis's hook for building replies) that copy each string
 * element from the read buffer into bufs[idx], instead of building a
 * redisReply per element (a malloc and a copy of every block). Every object
 * is the sink itself; nothing is allocated, nothing to free. */
typedef struct {
    int n;
    void *const *bufs;
    size_t cap;
    size_t *lens;
    bool bad; /* not an array of n strings and nils */
} mget_sink;

static void *sink_string(const redisReadTask *task, char *str, size_t len) {
    mget_sink *s = task->privdata;
    if (!task->parent || task->type != REDIS_REPLY_STRING || task->idx < 0 || task->idx >= s->n) s->bad = true;
    else if (len > 0 && len <= s->cap) {
        memcpy(s->bufs[task->idx], str, len);
        s->lens[task->idx] = len;
    }
    return s;
}
static void *sink_array(const redisReadTask *task, int elements) {
    mget_sink *s = task->privdata;
    if (task->parent || elements != s->n) s->bad = true;
    return s;
}
static void *sink_integer(const redisReadTask *task, long long v) {
    (void)v;
    ((mget_sink *)task->privdata)->bad = true;
    return task->privdata;
}
static void *sink_nil(const redisReadTask *task) {
    mget_sink *s = task->privdata;
    if (!task->parent) s->bad = true; /* an element's nil is a miss */
    return s;
}
static void sink_free(void *obj) { (void)obj; }
static redisReplyObjectFunctions sink_fns = {sink_string, sink_array, sink_integer, sink_nil, sink_free};

static int redis_get(kv_tier *base, int n, const kv_key *keys, void *const *bufs, size_t cap, size_t *lens) {
    redis_tier *t = (redis_tier *)base;
    if (n <= 0) return 0;
    double t0 = util_now_s(), deadline = t0 + t->timeout_ms / 1000.0;
    for (int i = 0; i < n; i++) lens[i] = 0;
    atomic_fetch_add(&t->reads, 1);
    int lead = 0, found = 0;
    key_argv a;
    int slot = reader_take(t, deadline);
    if (slot >= 0) {
        redisContext *c = t->readers[slot].c;
        bool ok = key_argv_make(&a, "MGET", n, keys);
        if (!ok) {
            reader_give(t, slot, false);
        } else {
            pipe_guard g;
            pipe_block(&g);
            double set_s = 0;
            mget_sink sink = {n, bufs, cap, lens, false};
            redisReader *rd = c->reader;
            redisReplyObjectFunctions *fn = rd->fn;
            void *priv = rd->privdata;
            rd->fn = &sink_fns;
            rd->privdata = &sink;
            ok = redisAppendCommandArgv(c, n + 1, a.argv, a.lens) == REDIS_OK && rt_send(c, deadline, &set_s) &&
                 rt_recv(c, deadline, &set_s, t->rbuf[slot]) == (void *)&sink && !sink.bad;
            /* a half-built reply is the sink's, not hiredis's to free */
            rd->reply = NULL;
            rd->fn = fn;
            rd->privdata = priv;
            pipe_restore(&g);
            if (ok) {
                bool gap = false;
                for (int i = 0; i < n; i++) {
                    if (lens[i]) {
                        found++;
                        if (!gap) lead++;
                    } else {
                        gap = true;
                    }
                }
            } else {
                for (int i = 0; i < n; i++) lens[i] = 0;
            }
            free(a.argv);
            reader_give(t, slot, !ok);
        }
    }
    atomic_fetch_add(&t->hits, (uint64_t)found);
    atomic_fetch_add(&t->misses, (uint64_t)(n - found));
    atomic_fetch_add(&t->read_ns, (uint64_t)((util_now_s() - t0) * 1e9));
    return lead;
}

static int redis_contains(kv_tier *base, int n, const kv_key *keys) {
    redis_tier *t = (redis_tier *)base;
    if (n <= 0) return 0;
    double deadline = util_now_s() + t->timeout_ms / 1000.0;
    int slot = reader_take(t, deadline);
    if (slot < 0) return 0;
    redisContext *c = t->readers[slot].c;
    pipe_guard g;
    pipe_block(&g);
    bool ok = true;
    for (int i = 0; ok && i < n; i++) {
        char name[KEY_LEN + 1];
        key_name(&keys[i], name);
        ok = redisAppendCommand(c, "EXISTS %b", name, (size_t)KEY_LEN) == REDIS_OK;
    }
    double set_s = 0;
    ok = ok && rt_send(c, deadline, &set_s);
    int lead = 0;
    bool gap = false;
    /* every reply is read, even after the first miss, to leave the connection clean */
    for (int i = 0; ok && i < n; i++) {
        redisReply *r = rt_recv(c, deadline, &set_s, NULL);
        ok = r && r->type == REDIS_REPLY_INTEGER;
        if (ok && r->integer == 1 && !gap) lead++;
        else gap = true;
        if (r) freeReplyObject(r);
    }
    pipe_restore(&g);
    reader_give(t, slot, !ok);
    return ok ? lead : 0;
}

/* ---- the queue (callers) ---- */

static void qnode_free(qnode *q) {
    redisFreeCommand(q->cmd);
    free(q);
}

/* A node holding the command argv formats to; NULL if out of memory. */
static qnode *qnode_make(int op, const kv_key *key, const void *data, size_t len) {
    char name[KEY_LEN + 1];
    key_name(key, name);
    const char *argv[3] = {op == OP_SET ? "SET" : "DEL", name, data};
    size_t lens[3] = {3, KEY_LEN, len};
    qnode *q = malloc(sizeof *q);
    if (!q) return NULL;
    int n = redisFormatCommandArgv(&q->cmd, op == OP_SET ? 3 : 2, argv, lens);
    if (n < 0) {
        free(q);
        return NULL;
    }
    q->op = op;
    q->len = len;
    q->cmd_len = (size_t)n;
    return q;
}

static bool enqueue(redis_tier *t, qnode *q) {
    pthread_mutex_lock(&t->q_mu);
    size_t add = q->cmd_len;
    if (t->stop || t->q_count >= KV_REDIS_QUEUE_BLOCKS || t->q_bytes + add > KV_REDIS_QUEUE_BYTES) {
        pthread_mutex_unlock(&t->q_mu);
        qnode_free(q);
        return false;
    }
    q->seq = ++t->next_seq;
    q->next = NULL;
    if (t->tail) t->tail->next = q;
    else t->head = q;
    t->tail = q;
    t->q_count++;
    t->q_bytes += add;
    pthread_cond_signal(&t->q_cv);
    pthread_mutex_unlock(&t->q_mu);
    return true;
}

static bool redis_put(kv_tier *base, const kv_key *key, const void *data, size_t len) {
    redis_tier *t = (redis_tier *)base;
    qnode *q = NULL;
    /* down: drop without copying; the writer drops what was queued before */
    if (atomic_load(&t->up) && len > 0 && len <= KV_REDIS_MAX_BLOCK && (q = qnode_make(OP_SET, key, data, len))) {
        if (enqueue(t, q)) return true;
    }
    atomic_fetch_add(&t->dropped, 1);
    return false;
}

static void redis_drop(kv_tier *base, const kv_key *key) {
    redis_tier *t = (redis_tier *)base;
    if (!atomic_load(&t->up)) return; /* nothing to do that would reach it */
    qnode *q = qnode_make(OP_DEL, key, NULL, 0);
    if (q) enqueue(t, q); /* a full queue loses the DEL; a reader's checksum still guards the block */
}

/* Removes the first n queued nodes (q_mu held); frees them, counting puts
 * among them as dropped when `dropped`. */
static void dequeue_n(redis_tier *t, int n, bool dropped) {
    for (int i = 0; i < n && t->head; i++) {
        qnode *q = t->head;
        t->head = q->next;
        if (!t->head) t->tail = NULL;
        t->q_count--;
        t->q_bytes -= q->cmd_len;
        if (q->op == OP_SET && dropped) atomic_fetch_add(&t->dropped, 1);
        t->done_seq = q->seq;
        qnode_free(q);
    }
    /* flush may have dropped nodes behind a batch in flight: nothing queued
     * means everything enqueued is done */
    if (!t->head) t->done_seq = t->next_seq;
    pthread_cond_broadcast(&t->done_cv);
}

static void redis_flush(kv_tier *base) {
    redis_tier *t = (redis_tier *)base;
    pthread_mutex_lock(&t->q_mu);
    uint64_t want = t->next_seq, last = t->done_seq;
    double start = util_now_s(), progress = start;
    while (t->done_seq < want) {
        double now = util_now_s();
        if (t->done_seq != last) { last = t->done_seq; progress = now; }
        if (now - progress > KV_REDIS_FLUSH_STALL_MS / 1000.0 || now - start > KV_REDIS_FLUSH_MAX_MS / 1000.0) {
            /* stuck: drop what the writer has not taken; its batch in
             * flight ends within its own deadline */
            qnode *keep = t->head;
            for (int i = 0; i < t->inflight && keep; i++) keep = keep->next;
            int n_rest = 0;
            for (qnode *q = keep; q; q = q->next) n_rest++;
            if (t->inflight == 0) {
                dequeue_n(t, n_rest, true);
            } else {
                /* unlink the nodes after the in-flight ones */
                qnode *lastf = t->head;
                for (int i = 1; i < t->inflight; i++) lastf = lastf->next;
                lastf->next = NULL;
                t->tail = lastf;
                for (qnode *q = keep, *nx; q; q = nx) {
                    nx = q->next;
                    t->q_count--;
                    t->q_bytes -= q->cmd_len;
                    if (q->op == OP_SET) atomic_fetch_add(&t->dropped, 1);
                    qnode_free(q);
                }
            }
            break;
        }
        struct timespec ts;
        abs_deadline(&ts, now + 0.05);
        pthread_cond_timedwait(&t->done_cv, &t->q_mu, &ts);
    }
    pthread_mutex_unlock(&t->q_mu);
}

/* ---- the writer thread ---- */

static void set_up(redis_tier *t) { atomic_store(&t->up, t->w != NULL); }

static void writer_break(redis_tier *t) {
    redisFree(t->w);
    t->w = NULL;
    t->w_next_try = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
    atomic_fetch_add(&t->errors, 1);
    set_up(t);
}

/* DBSIZE and INFO memory in one round trip. */
static void writer_poll(redis_tier *t) {
    double deadline = util_now_s() + t->timeout_ms / 1000.0, set_s = 0;
    redisContext *c = t->w;
    bool ok = redisAppendCommand(c, "DBSIZE") == REDIS_OK && redisAppendCommand(c, "INFO memory") == REDIS_OK &&
              rt_send(c, deadline, &set_s);
    redisReply *a = ok ? rt_recv(c, deadline, &set_s, NULL) : NULL;
    redisReply *b = a ? rt_recv(c, deadline, &set_s, NULL) : NULL;
    ok = a && b && a->type == REDIS_REPLY_INTEGER && b->type == REDIS_REPLY_STRING;
    if (ok) {
        atomic_store(&t->blocks, (uint64_t)(a->integer > 0 ? a->integer : 0));
        const char *m = strstr(b->str, "used_memory:");
        if (m) atomic_store(&t->bytes, strtoull(m + strlen("used_memory:"), NULL, 10));
    }
    if (a) freeReplyObject(a);
    if (b) freeReplyObject(b);
    if (!ok) writer_break(t);
}

/* Writes the batch (the first t->inflight queued nodes, taken under q_mu:
 * their links are the callers' to change, not read here) in one pipelined
 * round trip; q_mu is not held, only the writer pops nodes. */
static void writer_batch(redis_tier *t, qnode *const *batch, int n) {
    redisContext *c = t->w;
    int tmo = t->timeout_ms > KV_REDIS_WRITE_MS ? t->timeout_ms : KV_REDIS_WRITE_MS;
    double deadline = util_now_s() + tmo / 1000.0, set_s = 0;
    struct iovec iov[KV_REDIS_BATCH_CMDS];
    for (int i = 0; i < n; i++) iov[i] = (struct iovec){batch[i]->cmd, batch[i]->cmd_len};
    bool ok = send_iov(c, iov, n, deadline, &set_s);
    int done = 0;
    for (; ok && done < n; done++) {
        const qnode *q = batch[done];
        redisReply *r = rt_recv(c, deadline, &set_s, NULL);
        if (!r) { ok = false; break; }
        if (q->op == OP_SET) {
            if (r->type == REDIS_REPLY_STATUS) {
                atomic_fetch_add(&t->writes, 1);
                atomic_fetch_add(&t->write_bytes, q->len);
            } else { /* e.g. OOM under maxmemory with noeviction */
                atomic_fetch_add(&t->dropped, 1);
                atomic_fetch_add(&t->errors, 1);
            }
        }
        freeReplyObject(r);
    }
    if (!ok) {
        for (; done < n; done++)
            if (batch[done]->op == OP_SET) atomic_fetch_add(&t->dropped, 1);
        writer_break(t);
    }
}

/* Reconnects broken reader slots whose retry time has come; stops at the
 * first failure (the server is not there: the rest would fail too). */
static void readers_reconnect(redis_tier *t) {
    for (int i = 0; i < KV_REDIS_READERS; i++) {
        pthread_mutex_lock(&t->r_mu);
        reader *r = &t->readers[i];
        bool go = !r->c && !r->busy && util_now_s() >= r->next_try;
        if (go) r->busy = true;
        pthread_mutex_unlock(&t->r_mu);
        if (!go) continue;
        redisContext *c = rconnect(t);
        pthread_mutex_lock(&t->r_mu);
        r->c = c;
        r->busy = false;
        if (!c) r->next_try = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
        pthread_cond_broadcast(&t->r_cv);
        pthread_mutex_unlock(&t->r_mu);
        if (!c) {
            atomic_fetch_add(&t->errors, 1);
            break;
        }
    }
}

static void *writer_main(void *arg) {
    redis_tier *t = arg;
    pthread_mutex_lock(&t->q_mu);
    for (;;) {
        if (t->stop && !t->head) break;
        if (!t->head) {
            struct timespec ts;
            abs_deadline(&ts, util_now_s() + 0.1); /* reconnects and the stats poll */
            pthread_cond_timedwait(&t->q_cv, &t->q_mu, &ts);
        }
        bool stopping = t->stop;
        pthread_mutex_unlock(&t->q_mu);

        double now = util_now_s();
        if (!t->w && !stopping && now >= t->w_next_try) {
            t->w = rconnect(t);
            if (!t->w) {
                t->w_next_try = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
                atomic_fetch_add(&t->errors, 1);
            }
            set_up(t);
        }
        if (!stopping) readers_reconnect(t);
        if (t->w && !stopping && util_now_s() >= t->next_poll) {
            writer_poll(t);
            t->next_poll = util_now_s() + KV_REDIS_POLL_MS / 1000.0;
        }

        pthread_mutex_lock(&t->q_mu);
        if (!t->head) continue;
        if (!t->w) { /* down: what is queued is lost */
            int n = (int)t->q_count;
            dequeue_n(t, n, true);
            continue;
        }
        qnode *batch[KV_REDIS_BATCH_CMDS];
        int n = 0;
        size_t bytes = 0;
        for (qnode *q = t->head; q && n < KV_REDIS_BATCH_CMDS && (n == 0 || bytes + q->cmd_len <= KV_REDIS_BATCH_BYTES);
             q = q->next) {
            batch[n++] = q;
            bytes += q->cmd_len;
        }
        t->inflight = n;
        pthread_mutex_unlock(&t->q_mu);
        writer_batch(t, batch, n);
        pthread_mutex_lock(&t->q_mu);
        t->inflight = 0;
        dequeue_n(t, n, false);
    }
    pthread_mutex_unlock(&t->q_mu);
    return NULL;
}

/* ---- stats, close, open ---- */

static void redis_stats(kv_tier *base, kv_tier_stats *out) {
    redis_tier *t = (redis_tier *)base;
    out->blocks = atomic_load(&t->blocks);
    out->bytes = atomic_load(&t->bytes);
    out->hits = atomic_load(&t->hits);
    out->misses = atomic_load(&t->misses);
    out->writes = atomic_load(&t->writes);
    out->write_bytes = atomic_load(&t->write_bytes);
    out->dropped_writes = atomic_load(&t->dropped);
    out->errors = atomic_load(&t->errors);
    out->reads = atomic_load(&t->reads);
    out->read_seconds = (double)atomic_load(&t->read_ns) / 1e9;
    out->evicted = 0; /* Redis evicts on its own and does not say which */
    out->up = atomic_load(&t->up);
}

static void tier_free(redis_tier *t) {
    for (int i = 0; i < KV_REDIS_READERS; i++) {
        if (t->readers[i].c) redisFree(t->readers[i].c);
        free(t->rbuf[i]);
    }
    if (t->w) redisFree(t->w);
    for (qnode *q = t->head, *nx; q; q = nx) {
        nx = q->next;
        qnode_free(q);
    }
    pthread_mutex_destroy(&t->q_mu);
    pthread_cond_destroy(&t->q_cv);
    pthread_cond_destroy(&t->done_cv);
    pthread_mutex_destroy(&t->r_mu);
    pthread_cond_destroy(&t->r_cv);
    free(t);
}

static void redis_close(kv_tier *base) {
    redis_tier *t = (redis_tier *)base;
    redis_flush(base);
    pthread_mutex_lock(&t->q_mu);
    t->stop = true;
    pthread_cond_broadcast(&t->q_cv);
    pthread_mutex_unlock(&t->q_mu);
    if (t->thread_started) pthread_join(t->thread, NULL);
    /* callers still inside get/contains would be a use after close: the
     * caller's contract, as for free() */
    tier_free(t);
}

static const kv_tier_ops redis_ops = {
    .name = "redis",
    .put = redis_put,
    .get = redis_get,
    .contains = redis_contains,
    .drop = redis_drop,
    .flush = redis_flush,
    .stats = redis_stats,
    .close = redis_close,
};

/* Digits only, no sign, no leading '+', at most 9 of them. */
static bool parse_uint(const char *s, size_t n, long *out) {
    if (n == 0 || n > 9) return false;
    long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return false;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return true;
}

/* redis://HOST:PORT[/DB]; HOST a name or IPv4 address (letters, digits,
 * '.', '-') or [IPv6]. */
static bool parse_url(const char *url, char *host, size_t host_cap, int *port, int *db, kvlm_error *err) {
    static const char scheme[] = "redis://";
    const char *want = "expected redis://HOST:PORT[/DB]";
    if (!url) return util_err_set(err, KVLM_EINVAL, "redis tier: no URL (%s)", want), false;
    if (strncmp(url, scheme, sizeof scheme - 1) != 0)
        return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': %s", url, want), false;
    const char *h = url + sizeof scheme - 1, *he, *p;
    if (strchr(h, '@'))
        return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': user names and passwords are not supported", url),
               false;
    if (*h == '[') {
        he = strchr(h, ']');
        if (!he) return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': unclosed '[' in the host", url), false;
        for (const char *c = h + 1; c < he; c++)
            if (!strchr("0123456789abcdefABCDEF:.", *c))
                return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': bad IPv6 address", url), false;
        if (he == h + 1) return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': empty host", url), false;
        h++;
        p = he + 1;
    } else {
        he = h;
        while ((*he >= 'a' && *he <= 'z') || (*he >= 'A' && *he <= 'Z') || (*he >= '0' && *he <= '9') || *he == '.' || *he == '-')
            he++;
        if (he == h) return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': no host (%s)", url, want), false;
        p = he;
    }
    if ((size_t)(he - h) >= host_cap)
        return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': host name too long", url), false;
    if (*p != ':')
        return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': no port after the host (%s)", url, want), false;
    p++;
    const char *pe = p;
    while (*pe && *pe != '/') pe++;
    long v;
    if (!parse_uint(p, (size_t)(pe - p), &v) || v < 1 || v > 65535)
        return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': port must be 1-65535", url), false;
    *port = (int)v;
    *db = 0;
    if (*pe == '/') {
        const char *d = pe + 1;
        if (!parse_uint(d, strlen(d), &v))
            return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': database must be a number (%s)", url, want),
                   false;
        *db = (int)v;
    }
    memcpy(host, h, (size_t)(he - h));
    host[he - h] = 0;
    return true;
}

kv_tier *kv_tier_redis_open(const char *url, int timeout_ms, kvlm_error *err) {
    char host[256];
    int port, db;
    if (!parse_url(url, host, sizeof host, &port, &db, err)) return NULL;
    if (timeout_ms < 0 || timeout_ms > 60000) {
        util_err_set(err, KVLM_EINVAL, "redis tier: timeout %d ms: must be 0 (default 200) to 60000", timeout_ms);
        return NULL;
    }
    redis_tier *t = calloc(1, sizeof *t);
    if (!t) { util_err_set(err, KVLM_ENOMEM, "redis tier: out of memory"); return NULL; }
    t->base.ops = &redis_ops;
    memcpy(t->host, host, sizeof host);
    t->port = port;
    t->db = db;
    t->timeout_ms = timeout_ms ? timeout_ms : 200;
    pthread_mutex_init(&t->q_mu, NULL);
    pthread_mutex_init(&t->r_mu, NULL);
    cond_init_mono(&t->q_cv);
    cond_init_mono(&t->done_cv);
    cond_init_mono(&t->r_cv);
    for (int i = 0; i < KV_REDIS_READERS; i++) {
        if (!(t->rbuf[i] = malloc(KV_REDIS_READ_CHUNK))) {
            tier_free(t);
            util_err_set(err, KVLM_ENOMEM, "redis tier: out of memory");
            return NULL;
        }
    }

    /* One try now, so a tier opened beside a running server takes puts at
     * once; a server that is not there is not an error (the writer thread
     * keeps trying). */
    pipe_guard g;
    pipe_block(&g);
    t->w = rconnect(t);
    if (t->w) {
        t->readers[0].c = rconnect(t);
    } else {
        atomic_fetch_add(&t->errors, 1);
        t->w_next_try = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
        for (int i = 0; i < KV_REDIS_READERS; i++) t->readers[i].next_try = t->w_next_try;
    }
    pipe_restore(&g);
    set_up(t);

    /* The writer thread takes no signals (and so no SIGPIPE). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&t->thread, NULL, writer_main, t);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        tier_free(t);
        util_err_set(err, KVLM_ENOMEM, "redis tier: cannot start its writer thread (%s)", strerror(rc));
        return NULL;
    }
    t->thread_started = true;
    return &t->base;
}
