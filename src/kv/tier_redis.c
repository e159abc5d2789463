/* kv/tier_redis: the Redis tier: KV blocks shared by every engine process
 * that points at one Redis server (or a Redis Cluster), over kv/redis_conn
 * (TCP or TLS, AUTH, bounded replies) and hiredis's reply parser.
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
 * - put and drop format their command (hiredis's redisFormatCommandArgv:
 *   the one copy of the block) into a bounded queue and return at once;
 *   one background thread (the writer) drains it on its own connection,
 *   many SETs per round trip (one writev of the batch, then all replies).
 * - get and contains run in the caller's thread on one of a few reader
 *   connections (one caller per connection at a time), one round trip each,
 *   bounded by the tier's timeout as a whole (every wait is a poll against
 *   that deadline), and a caller that finds every reader busy waits at most
 *   until the same deadline.
 * - A broken connection (any I/O error, timeout or protocol surprise) is
 *   closed at once, and the idle ones to the same server with it; the
 *   writer thread reconnects them, at most one attempt per connection every
 *   KV_REDIS_RETRY_MS, and only after the server answers PING (after AUTH
 *   and SELECT). Callers never connect, so a down or hung server costs one
 *   caller one timeout (and callers already waiting on it theirs), then
 *   nothing (immediate misses) until it is back.
 * - The writer thread also asks DBSIZE and INFO memory once a second for
 *   stats and to notice a dead server while idle. blocks is DBSIZE (every
 *   key of the database: give kvlm a database of its own) and bytes is the
 *   server's used_memory: the server is shared with other processes and
 *   evicts on its own, so what this process wrote minus what it dropped
 *   would mean nothing. up is the writer's connection.
 *
 * Trust: the server's replies are bounded by what each call can receive
 * (redis_conn.h: an MGET of n blocks is an array of n strings of at most the
 * caller's block size, a PING is a status), so a hostile or broken endpoint
 * costs a refused connection, not memory or time. Every fault is logged once
 * when it starts and once when it ends, with what it cost (see "faults").
 * The password is never logged; URLs in messages are redacted.
 *
 * SIGPIPE: plain sockets are written with MSG_NOSIGNAL, but OpenSSL writes
 * with write(2), so a TLS write to a closed socket raises SIGPIPE. `kvlm
 * serve` ignores it process-wide, but a library user may not: the tier's
 * threads run with every signal blocked, and callers' I/O runs with SIGPIPE
 * blocked and any SIGPIPE it raised taken back before the mask is restored
 * (the usual recipe of libraries that cannot use MSG_NOSIGNAL). */
#include "kv/tier.h"
#include <errno.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include "kv/redis_conn.h"
#include "util/error.h"
#include "util/log.h"
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
/* The largest block put accepts (Redis's proto-max-bulk-len is 512 MB); a
 * read may skip a stored block up to this long that is longer than the
 * caller's buffer (a miss), and refuses anything longer. */
#define KV_REDIS_MAX_BLOCK ((size_t)64 << 20)
/* Bytes a reader asks the socket for at once (hiredis reads 16 KiB). */
#define KV_REDIS_READ_CHUNK ((size_t)256 << 10)
/* An error-reply fault (writes refused, ...) ends once a command succeeds
 * and none has been refused for this long. */
#define KV_REDIS_QUIET_MS 1000

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
    rconn *c;        /* NULL: down */
    bool busy;       /* taken by a caller, or by the writer reconnecting it */
    double next_try; /* earliest next connection attempt */
} reader;

/* What every connection of a tier presents: AUTH and TLS (shared by a
 * cluster's nodes; owned by the tier that opened it). */
typedef struct {
    char *user, *password; /* NULL: none */
    rconn_tls *tls;        /* NULL: plain TCP */
} redis_auth;

/* An error-reply fault: one direction of commands answered with errors. */
enum { REF_WRITES, REF_READS, REF_MODE, REF_N };
typedef struct {
    bool on;
    double since, last;
    uint64_t count; /* refused while it lasts */
    uint64_t ok_at; /* the tier's ok[dir] at the last refusal */
} refusal;

typedef struct {
    kv_tier base;
    char host[256];
    char peer[300]; /* HOST:PORT, as logs name it */
    int port, db;
    int timeout_ms;
    bool proxy; /* a twemproxy in front (?proxy=1): it has no DBSIZE, INFO or SELECT */
    const redis_auth *auth;
    redis_auth *own_auth; /* a single server's, freed with it */

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

    rconn *w; /* the writer's connection; only the writer thread (or open/close) touches it */
    double w_next_try, next_poll;

    /* readers: r_mu guards the slots' c and busy (a slot's connection is used
     * without the lock by whoever marked it busy) */
    pthread_mutex_t r_mu;
    pthread_cond_t r_cv; /* a slot was released */
    reader readers[KV_REDIS_READERS];
    unsigned r_next;

    /* a node of a cluster tier: set when the server answers a write with a
     * redirection (MOVED, ASK) or CLUSTERDOWN, so the cluster re-reads its
     * slot map; NULL for a single server */
    _Atomic bool *refresh;

    _Atomic uint64_t blocks, bytes;

    /* faults (f_mu): the connection's (0 or an rconn_status) since f_since,
     * and the error-reply ones; `missed` counts reads that could not ask
     * the server (no connection, or it broke), ok[] commands that succeeded */
    pthread_mutex_t f_mu;
    int f_kind;
    unsigned f_told; /* the kinds told while it lasts (bits by rconn_status) */
    double f_since;
    uint64_t f_missed0, f_dropped0;
    refusal ref[REF_N];
    _Atomic uint64_t missed, ok[REF_N];
    _Atomic bool f_on; /* f_kind != 0, read without the lock */
} redis_tier;

/* ---- small helpers ---- */

static void key_name(const kv_key *k, char out[KEY_LEN + 1]) {
    memcpy(out, KEY_PREFIX, sizeof KEY_PREFIX - 1);
    kv_key_hex(k, out + sizeof KEY_PREFIX - 1);
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

/* ---- faults: each logged once when it starts and once when it ends ----
 *
 * A server's connection fault (down, hung, AUTH or SELECT refused, TLS, a
 * reply refused) starts at the first failure and ends at the next
 * connection that answers PING; while it lasts its reads miss at once
 * (counted in `missed`) and its puts drop. Down and hung say the same (a
 * hung server killed is then down): one line; a kind that says something
 * new while it lasts (AUTH refused after a restart) is logged too, once.
 *
 * Error replies are faults of their own, by direction (writes, reads, and a
 * single-server tier answered with cluster redirections): they start at the
 * first error and end once a command of that direction succeeds and none
 * has been refused for KV_REDIS_QUIET_MS (the writer thread checks). */

static bool transport_fault(int k) { return k == RCONN_DOWN || k == RCONN_HUNG; }

static void fault_note(redis_tier *t, rconn_status st, const char *msg) {
    atomic_store(&t->f_on, true);
    pthread_mutex_lock(&t->f_mu);
    if (!t->f_kind) {
        t->f_since = util_now_s();
        t->f_missed0 = atomic_load(&t->missed);
        t->f_dropped0 = atomic_load(&t->base.n.dropped);
        t->f_told = 0;
    }
    /* each kind at most once a fault (down and hung one kind): a server
     * whose answers alternate between two failures is two lines, not one
     * every retry */
    unsigned bit = 1u << (transport_fault((int)st) ? RCONN_DOWN : (int)st);
    bool log = !(t->f_told & bit);
    t->f_told |= bit;
    t->f_kind = (int)st;
    pthread_mutex_unlock(&t->f_mu);
    if (log)
        LOG_WARN("redis tier %s: %s%s (reads miss and writes drop until it answers)", t->peer,
                 st == RCONN_DOWN ? "down: " : st == RCONN_HUNG ? "not answering: " : "", msg);
}

/* A connection answered PING (data: a command of data succeeded). A reply
 * refused (a server that answers PING but not reads sanely) ends only with
 * data, or it would start again at every reconnect. */
static void fault_end(redis_tier *t, bool data) {
    if (!atomic_load(&t->f_on)) return;
    pthread_mutex_lock(&t->f_mu);
    if (t->f_kind == RCONN_PROTOCOL && !data) {
        pthread_mutex_unlock(&t->f_mu);
        return;
    }
    atomic_store(&t->f_on, false);
    int was = t->f_kind;
    double dt = util_now_s() - t->f_since;
    uint64_t missed = atomic_load(&t->missed) - t->f_missed0, dropped = atomic_load(&t->base.n.dropped) - t->f_dropped0;
    t->f_kind = 0;
    pthread_mutex_unlock(&t->f_mu);
    if (was)
        LOG_WARN("redis tier %s: reachable again after %.1f s (%llu reads missed, %llu writes dropped)", t->peer, dt,
                 (unsigned long long)missed, (unsigned long long)dropped);
}

/* Which fault an error reply e is: a redirection to a single-server tier is
 * the wrong mode; to a cluster node (refresh set) it is the map's business
 * (-1: not a fault). */
static int refusal_dir(const redis_tier *t, const char *e, int dir) {
    bool redirect = !strncmp(e, "MOVED ", 6) || !strncmp(e, "ASK ", 4);
    if (t->refresh) return redirect ? -1 : dir;
    return redirect || !strncmp(e, "CROSSSLOT", 9) || !strncmp(e, "CLUSTERDOWN", 11) ? REF_MODE : dir;
}

static void refusal_note(redis_tier *t, int dir, const char *e) {
    if ((dir = refusal_dir(t, e, dir)) < 0) return;
    double now = util_now_s();
    pthread_mutex_lock(&t->f_mu);
    refusal *r = &t->ref[dir];
    bool start = !r->on;
    if (start) {
        r->on = true;
        r->since = now;
        r->count = 0;
    }
    r->count++;
    r->last = now;
    r->ok_at = atomic_load(&t->ok[dir]);
    pthread_mutex_unlock(&t->f_mu);
    if (!start) return;
    if (dir == REF_MODE)
        LOG_WARN("redis tier %s: answers '%.160s': a Redis Cluster node? (use redis-cluster://%s); blocks of other "
                 "nodes' slots miss and their writes drop", t->peer, e, t->peer);
    else
        LOG_WARN("redis tier %s: refusing %s: %.160s", t->peer, dir == REF_WRITES ? "writes" : "reads", e);
}

static void note_ok(redis_tier *t, int dir) {
    atomic_fetch_add_explicit(&t->ok[dir], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&t->ok[REF_MODE], 1, memory_order_relaxed);
}

/* Ends the error-reply faults that have gone quiet (writer thread). */
static void refusals_check(redis_tier *t) {
    double now = util_now_s();
    static const char *what[REF_N] = {"accepting writes again", "answering reads again", "no more cluster redirections"};
    for (int d = 0; d < REF_N; d++) {
        pthread_mutex_lock(&t->f_mu);
        refusal *r = &t->ref[d];
        bool end = r->on && now - r->last >= KV_REDIS_QUIET_MS / 1000.0 && atomic_load(&t->ok[d]) > r->ok_at;
        double dt = now - r->since;
        uint64_t n = r->count;
        if (end) r->on = false;
        pthread_mutex_unlock(&t->f_mu);
        if (end)
            LOG_WARN("redis tier %s: %s after %.1f s (%llu %s refused)", t->peer, what[d], dt, (unsigned long long)n,
                     d == REF_READS ? "reads" : d == REF_WRITES ? "writes" : "commands");
    }
}

/* ---- connections ---- */

/* Connects, AUTHs, selects the database and checks the server answers
 * (PING), all within the tier's timeout; NULL if it does not, with the fault
 * noted (and a fault ended when it does). */
static rconn *rconnect(redis_tier *t, bool for_reader) {
    rconn_params p = {t->host, t->port, t->proxy ? 0 : t->db, t->auth->user, t->auth->password, t->auth->tls,
                      for_reader ? KV_REDIS_READ_CHUNK : 0};
    rconn_status st;
    char msg[256];
    rconn *c = rconn_open(&p, util_now_s() + t->timeout_ms / 1000.0, &st, msg, sizeof msg);
    if (c) fault_end(t, false);
    else fault_note(t, st, msg);
    return c;
}

/* ---- readers (callers' threads) ---- */

/* Takes a connected reader slot, waiting for a busy one until deadline.
 * -1: none is connected (*down set), or none came free in time. */
static int reader_take(redis_tier *t, double deadline, bool *down) {
    pthread_mutex_lock(&t->r_mu);
    int got = -1;
    bool any_up = false;
    for (;;) {
        any_up = false;
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
    if (down) *down = !any_up;
    return got;
}

/* Gives the slot back; broken: note why (its connection's error), close it,
 * and every idle one with it (the writer thread reconnects them after
 * KV_REDIS_RETRY_MS, each once the server answers PING). A connection
 * breaks when its server is gone, hung or reset, and its siblings are then
 * in the same state: left open, each would cost its next caller a timeout
 * of its own before it broke too (a hung node: 4 batches of 200 ms, not 1). */
static void reader_give(redis_tier *t, int i, bool broken) {
    if (broken) {
        const char *msg;
        rconn_status st = rconn_error(t->readers[i].c, &msg);
        fault_note(t, st ? st : RCONN_PROTOCOL, st ? msg : "a reply not of the shape asked for");
    }
    pthread_mutex_lock(&t->r_mu);
    reader *r = &t->readers[i];
    if (broken) {
        const double retry = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
        for (int k = 0; k < KV_REDIS_READERS; k++) {
            reader *o = &t->readers[k];
            if (!o->c || (k != i && o->busy)) continue;
            rconn_free(o->c);
            o->c = NULL;
            o->next_try = retry;
        }
        atomic_fetch_add(&t->base.n.errors, 1);
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

/* Copies an error reply's text (printable bytes only). */
static void copy_err(char *out, size_t cap, const char *str, size_t len) {
    size_t m = 0;
    for (size_t i = 0; i < len && m + 1 < cap; i++) out[m++] = str[i] >= 32 && str[i] < 127 ? str[i] : '?';
    out[m] = 0;
}

/* The limits of a read of blocks of at most cap bytes: one at a time is
 * buffered; a longer one (up to the largest block a put writes) is read past
 * as a miss; anything longer is refused. */
static rconn_limits block_limits(size_t cap) {
    rconn_limits l = {cap > 4096 ? cap : 4096, KV_REDIS_MAX_BLOCK, 0, 0, 0};
    return l;
}

/* MGET's reply is parsed straight into the caller's buffers: reply-object
 * functions (hiredis's hook for building replies) that copy each string
 * element from the read buffer into bufs[idx], instead of building a
 * redisReply per element (a malloc and a copy of every block). Every object
 * is the sink itself; nothing is allocated, nothing to free. An array that
 * is not of n elements is refused before its elements are read (NULL ends
 * the parse). */
typedef struct {
    int n;
    void *const *bufs;
    size_t cap;
    size_t *lens;
    bool bad;       /* not an array of n strings and nils */
    char err[160];  /* the reply was an error: its text */
} mget_sink;

static void *sink_string(const redisReadTask *task, char *str, size_t len) {
    mget_sink *s = task->privdata;
    if (!task->parent && task->type == REDIS_REPLY_ERROR) copy_err(s->err, sizeof s->err, str, len);
    else if (!task->parent || task->type != REDIS_REPLY_STRING || task->idx < 0 || task->idx >= s->n) s->bad = true;
    else if (len > 0 && len <= s->cap) {
        memcpy(s->bufs[task->idx], str, len);
        s->lens[task->idx] = len;
    }
    return s;
}
static void *sink_array(const redisReadTask *task, int elements) {
    mget_sink *s = task->privdata;
    if (task->parent || elements != s->n) {
        s->bad = true;
        return NULL;
    }
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
    int lead = 0, found = 0;
    key_argv a;
    bool down;
    int slot = reader_take(t, deadline, &down);
    if (slot < 0 && down) atomic_fetch_add(&t->missed, 1);
    if (slot >= 0) {
        rconn *c = t->readers[slot].c;
        bool ok = key_argv_make(&a, "MGET", n, keys);
        if (!ok) {
            reader_give(t, slot, false);
        } else {
            pipe_guard g;
            pipe_block(&g);
            mget_sink sink = {n, bufs, cap, lens, false, {0}};
            rconn_limits lim = block_limits(cap);
            rconn_set_limits(c, &lim);
            rconn_set_sink(c, &sink_fns, &sink);
            ok = rconn_append(c, n + 1, a.argv, a.lens) && rconn_send(c, deadline) &&
                 rconn_recv(c, deadline) == (void *)&sink && !sink.bad;
            rconn_clear_sink(c);
            pipe_restore(&g);
            bool refused = ok && sink.err[0];
            if (ok && !refused) {
                note_ok(t, REF_READS);
                fault_end(t, true);
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
            if (!ok) atomic_fetch_add(&t->missed, 1);
            reader_give(t, slot, !ok);
            if (refused) refusal_note(t, REF_READS, sink.err);
        }
    }
    kv_tier_note_read(base, found, n, t0);
    return lead;
}

static int redis_contains(kv_tier *base, int n, const kv_key *keys) {
    redis_tier *t = (redis_tier *)base;
    if (n <= 0) return 0;
    double deadline = util_now_s() + t->timeout_ms / 1000.0;
    int slot = reader_take(t, deadline, NULL);
    if (slot < 0) return 0;
    rconn *c = t->readers[slot].c;
    pipe_guard g;
    pipe_block(&g);
    rconn_set_limits(c, &rconn_small);
    bool ok = true;
    for (int i = 0; ok && i < n; i++) {
        char name[KEY_LEN + 1];
        key_name(&keys[i], name);
        const char *argv[2] = {"EXISTS", name};
        size_t alen[2] = {6, KEY_LEN};
        ok = rconn_append(c, 2, argv, alen);
    }
    ok = ok && rconn_send(c, deadline);
    int lead = 0;
    bool gap = false;
    char err[160] = "";
    /* every reply is read, even after the first miss, to leave the connection clean */
    for (int i = 0; ok && i < n; i++) {
        redisReply *r = rconn_recv(c, deadline);
        ok = r && (r->type == REDIS_REPLY_INTEGER || r->type == REDIS_REPLY_ERROR);
        if (ok && r->type == REDIS_REPLY_ERROR && !err[0]) copy_err(err, sizeof err, r->str, r->len);
        if (ok && r->type == REDIS_REPLY_INTEGER && r->integer == 1 && !gap) lead++;
        else gap = true;
        if (r) freeReplyObject(r);
    }
    pipe_restore(&g);
    reader_give(t, slot, !ok);
    if (ok && err[0]) refusal_note(t, REF_READS, err);
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
    if (atomic_load(&t->base.n.up) && len > 0 && len <= KV_REDIS_MAX_BLOCK && (q = qnode_make(OP_SET, key, data, len))) {
        if (enqueue(t, q)) return true;
    }
    atomic_fetch_add(&t->base.n.dropped, 1);
    return false;
}

static void redis_drop(kv_tier *base, const kv_key *key) {
    redis_tier *t = (redis_tier *)base;
    if (!atomic_load(&t->base.n.up)) return; /* nothing to do that would reach it */
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
        if (q->op == OP_SET && dropped) atomic_fetch_add(&t->base.n.dropped, 1);
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
                    if (q->op == OP_SET) atomic_fetch_add(&t->base.n.dropped, 1);
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

static void set_up(redis_tier *t) { atomic_store(&t->base.n.up, t->w != NULL); }

/* The writer's connection broke: closed, and the idle readers with it (as
 * reader_give does: they are in the same state; left open to a server that
 * was restarted, each would cost a caller a failed round trip later). */
static void writer_break(redis_tier *t) {
    const char *msg;
    rconn_status st = rconn_error(t->w, &msg);
    fault_note(t, st ? st : RCONN_PROTOCOL, st ? msg : "a reply not of the shape asked for");
    rconn_free(t->w);
    t->w = NULL;
    t->w_next_try = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
    pthread_mutex_lock(&t->r_mu);
    for (int k = 0; k < KV_REDIS_READERS; k++) {
        reader *o = &t->readers[k];
        if (!o->c || o->busy) continue;
        rconn_free(o->c);
        o->c = NULL;
        o->next_try = t->w_next_try;
    }
    pthread_mutex_unlock(&t->r_mu);
    atomic_fetch_add(&t->base.n.errors, 1);
    set_up(t);
}

/* DBSIZE and INFO memory in one round trip (a proxy: PING, to notice it
 * is gone while idle; its figures stay 0). */
static void writer_poll(redis_tier *t) {
    double deadline = util_now_s() + t->timeout_ms / 1000.0;
    rconn *c = t->w;
    rconn_set_limits(c, &rconn_small);
    if (t->proxy) {
        redisReply *r = NULL;
        if (rconn_appendv(c, "PING", (char *)NULL) && rconn_send(c, deadline)) r = rconn_recv(c, deadline);
        bool ok = r && r->type == REDIS_REPLY_STATUS;
        if (r) freeReplyObject(r);
        if (!ok) writer_break(t);
        return;
    }
    bool ok = rconn_appendv(c, "DBSIZE", (char *)NULL) && rconn_appendv(c, "INFO", "memory", (char *)NULL) &&
              rconn_send(c, deadline);
    redisReply *a = ok ? rconn_recv(c, deadline) : NULL;
    redisReply *b = a ? rconn_recv(c, deadline) : NULL;
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
    rconn *c = t->w;
    int tmo = t->timeout_ms > KV_REDIS_WRITE_MS ? t->timeout_ms : KV_REDIS_WRITE_MS;
    double deadline = util_now_s() + tmo / 1000.0;
    struct iovec iov[KV_REDIS_BATCH_CMDS];
    for (int i = 0; i < n; i++) iov[i] = (struct iovec){batch[i]->cmd, batch[i]->cmd_len};
    rconn_set_limits(c, &rconn_small);
    bool ok = rconn_writev(c, iov, n, deadline);
    int done = 0;
    char err[160] = "";
    for (; ok && done < n; done++) {
        const qnode *q = batch[done];
        redisReply *r = rconn_recv(c, deadline);
        if (!r) { ok = false; break; }
        if (q->op == OP_SET) {
            if (r->type == REDIS_REPLY_STATUS) {
                atomic_fetch_add(&t->base.n.writes, 1);
                atomic_fetch_add(&t->base.n.write_bytes, q->len);
                note_ok(t, REF_WRITES);
            } else { /* e.g. OOM under maxmemory with noeviction */
                atomic_fetch_add(&t->base.n.dropped, 1);
                atomic_fetch_add(&t->base.n.errors, 1);
                if (r->type == REDIS_REPLY_ERROR && r->str) {
                    copy_err(err, sizeof err, r->str, r->len);
                    refusal_note(t, REF_WRITES, err);
                    if (t->refresh && (!strncmp(r->str, "MOVED ", 6) || !strncmp(r->str, "ASK ", 4) ||
                                       !strncmp(r->str, "CLUSTERDOWN", 11)))
                        atomic_store(t->refresh, true);
                }
            }
        }
        freeReplyObject(r);
    }
    if (!ok) {
        for (; done < n; done++)
            if (batch[done]->op == OP_SET) atomic_fetch_add(&t->base.n.dropped, 1);
        writer_break(t);
    } else {
        fault_end(t, true);
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
        rconn *c = rconnect(t, true);
        pthread_mutex_lock(&t->r_mu);
        r->c = c;
        r->busy = false;
        if (!c) r->next_try = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
        pthread_cond_broadcast(&t->r_cv);
        pthread_mutex_unlock(&t->r_mu);
        if (!c) {
            atomic_fetch_add(&t->base.n.errors, 1);
            break;
        }
    }
}

/* Starts a thread that takes no signals (and so no SIGPIPE from a server
 * that went away); the pthread_create status. */
static int start_unsignalled(pthread_t *th, void *(*fn)(void *), void *arg) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(th, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
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
            t->w = rconnect(t, false);
            if (!t->w) {
                t->w_next_try = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
                atomic_fetch_add(&t->base.n.errors, 1);
            }
            set_up(t);
        }
        if (!stopping) readers_reconnect(t);
        if (t->w && !stopping && util_now_s() >= t->next_poll) {
            writer_poll(t);
            t->next_poll = util_now_s() + KV_REDIS_POLL_MS / 1000.0;
        }
        refusals_check(t);

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
    /* the counters come from the base; evicted stays 0: Redis evicts on its own and does not say which */
}

static void auth_free(redis_auth *a) {
    if (!a) return;
    if (a->password) {
        memset(a->password, 0, strlen(a->password));
        free(a->password);
    }
    free(a->user);
    rconn_tls_free(a->tls);
    free(a);
}

static void tier_free(redis_tier *t) {
    for (int i = 0; i < KV_REDIS_READERS; i++)
        if (t->readers[i].c) rconn_free(t->readers[i].c);
    if (t->w) rconn_free(t->w);
    for (qnode *q = t->head, *nx; q; q = nx) {
        nx = q->next;
        qnode_free(q);
    }
    pthread_mutex_destroy(&t->q_mu);
    pthread_cond_destroy(&t->q_cv);
    pthread_cond_destroy(&t->done_cv);
    pthread_mutex_destroy(&t->r_mu);
    pthread_cond_destroy(&t->r_cv);
    pthread_mutex_destroy(&t->f_mu);
    auth_free(t->own_auth);
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

/* ---- URLs ----
 *
 * SCHEME://[USER:PASSWORD@]HOST:PORT[/DB][?proxy=1] with SCHEME redis or
 * rediss (TLS), and SCHEME://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...] with
 * redis-cluster or rediss-cluster. USER and PASSWORD are percent-decoded;
 * ":PASSWORD@" is the default user's password (AUTH PASSWORD), "USER@" a
 * user whose password comes from kv_redis_opts. Messages show the URL
 * redacted. */

#define KV_CLUSTER_MAX_SEEDS 16

typedef struct {
    char host[256];
    int port;
} hostport;

typedef struct {
    bool tls, cluster, proxy;
    int db;
    char *user, *password; /* decoded, malloc'd; NULL: none */
    int n_hosts;
    hostport hosts[KV_CLUSTER_MAX_SEEDS];
    char shown[300]; /* the URL redacted, for messages */
} redis_url;

static const char *const k_want = "expected redis[s]://[USER:PASSWORD@]HOST:PORT[/DB] or "
                                  "redis[s]-cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]";

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

/* HOST:PORT at h, HOST a name or IPv4 address (letters, digits, '.', '-')
 * or [IPv6]; the port ends at any of `stops` or the string's end (*end). */
static bool parse_hostport(const redis_url *u, const char *h, const char *stops, hostport *hp, const char **end,
                           kvlm_error *err) {
    const char *he, *p, *url = u->shown;
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
        if (he == h) return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': no host (%s)", url, k_want), false;
        p = he;
    }
    if ((size_t)(he - h) >= sizeof hp->host)
        return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': host name too long", url), false;
    if (*p != ':')
        return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': no port after the host (%s)", url, k_want), false;
    p++;
    const char *pe = p;
    while (*pe && !strchr(stops, *pe)) pe++;
    long v;
    if (!parse_uint(p, (size_t)(pe - p), &v) || v < 1 || v > 65535)
        return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': port must be 1-65535", url), false;
    hp->port = (int)v;
    memcpy(hp->host, h, (size_t)(he - h));
    hp->host[he - h] = 0;
    *end = pe;
    return true;
}

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* s[0..n) percent-decoded into a new string; NULL on a bad escape, a NUL or
 * out of memory (*bad set for the first two). */
static char *pct_decode(const char *s, size_t n, bool *bad) {
    char *o = malloc(n + 1);
    if (!o) return NULL;
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '%') { o[m++] = s[i]; continue; }
        int hi = i + 1 < n ? hexval(s[i + 1]) : -1, lo = i + 2 < n ? hexval(s[i + 2]) : -1;
        if (hi < 0 || lo < 0 || (hi == 0 && lo == 0)) {
            *bad = true;
            free(o);
            return NULL;
        }
        o[m++] = (char)(hi * 16 + lo);
        i += 2;
    }
    o[m] = 0;
    return o;
}

static void url_free(redis_url *u) {
    if (u->password) {
        memset(u->password, 0, strlen(u->password));
        free(u->password);
    }
    free(u->user);
    u->user = u->password = NULL;
}

static bool parse_url(const char *url, redis_url *u, kvlm_error *err) {
    memset(u, 0, sizeof *u);
    if (!url) return util_err_set(err, KVLM_EINVAL, "redis tier: no URL (%s)", k_want), false;
    rconn_redact(url, u->shown, sizeof u->shown);
    static const struct { const char *s; bool tls, cluster; } schemes[] = {
        {"redis://", false, false}, {"rediss://", true, false},
        {"redis-cluster://", false, true}, {"rediss-cluster://", true, true}};
    const char *h = NULL;
    for (size_t i = 0; i < sizeof schemes / sizeof *schemes && !h; i++) {
        size_t n = strlen(schemes[i].s);
        if (!strncmp(url, schemes[i].s, n)) {
            h = url + n;
            u->tls = schemes[i].tls;
            u->cluster = schemes[i].cluster;
        }
    }
    if (!h) return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': %s", u->shown, k_want), false;
    const char *at = strrchr(h, '@');
    if (at) {
        const char *colon = memchr(h, ':', (size_t)(at - h)), *ue = colon ? colon : at;
        if (colon && colon + 1 == at)
            return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': empty password", u->shown), false;
        if (ue == h && !colon)
            return util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': empty user name", u->shown), false;
        bool bad = false, failed = false;
        if (ue > h && !(u->user = pct_decode(h, (size_t)(ue - h), &bad))) failed = true;
        if (!failed && colon && !(u->password = pct_decode(colon + 1, (size_t)(at - colon - 1), &bad))) failed = true;
        if (failed) {
            url_free(u);
            return util_err_set(err, bad ? KVLM_EINVAL : KVLM_ENOMEM, "redis tier: bad URL '%.200s': %s", u->shown,
                                bad ? "bad %-escape in the user or password" : "out of memory"),
                   false;
        }
        h = at + 1;
    }
    const char *pe;
    if (u->cluster) {
        for (;;) {
            if (u->n_hosts == KV_CLUSTER_MAX_SEEDS) {
                util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': more than %d seed nodes", u->shown,
                             KV_CLUSTER_MAX_SEEDS);
                goto fail;
            }
            if (!parse_hostport(u, h, ",", &u->hosts[u->n_hosts], &pe, err)) goto fail;
            u->n_hosts++;
            if (!*pe) break;
            h = pe + 1; /* a ',' */
        }
        return true;
    }
    if (!parse_hostport(u, h, "/?", &u->hosts[0], &pe, err)) goto fail;
    u->n_hosts = 1;
    const char *q = strchr(pe, '?');
    if (q) {
        if (strcmp(q, "?proxy=1") != 0) {
            util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': the one option is ?proxy=1", u->shown);
            goto fail;
        }
        u->proxy = true;
    }
    if (*pe == '/') {
        const char *d = pe + 1;
        long v;
        if (!parse_uint(d, (size_t)((q ? q : d + strlen(d)) - d), &v)) {
            util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': database must be a number (%s)", u->shown, k_want);
            goto fail;
        }
        u->db = (int)v;
    } else if (*pe && *pe != '?') {
        util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': %s", u->shown, k_want);
        goto fail;
    }
    if (u->proxy && u->db) {
        util_err_set(err, KVLM_EINVAL, "redis tier: bad URL '%.200s': a proxy has only database 0", u->shown);
        goto fail;
    }
    return true;
fail:
    url_free(u);
    return false;
}

/* One server's tier (a single server, or one node of a cluster). */
static redis_tier *node_open(const char *host, int port, int db, int timeout_ms, const redis_auth *auth,
                             _Atomic bool *refresh, bool proxy, kvlm_error *err) {
    redis_tier *t = calloc(1, sizeof *t);
    if (!t) { util_err_set(err, KVLM_ENOMEM, "redis tier: out of memory"); return NULL; }
    t->base.ops = &redis_ops;
    snprintf(t->host, sizeof t->host, "%s", host);
    snprintf(t->peer, sizeof t->peer, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
    t->port = port;
    t->db = db;
    t->timeout_ms = timeout_ms;
    t->auth = auth;
    t->refresh = refresh;
    t->proxy = proxy;
    pthread_mutex_init(&t->q_mu, NULL);
    pthread_mutex_init(&t->r_mu, NULL);
    pthread_mutex_init(&t->f_mu, NULL);
    cond_init_mono(&t->q_cv);
    cond_init_mono(&t->done_cv);
    cond_init_mono(&t->r_cv);

    /* One try now, so a tier opened beside a running server takes puts at
     * once; a server that is not there is not an error (the writer thread
     * keeps trying), but it is said, once. */
    pipe_guard g;
    pipe_block(&g);
    t->w = rconnect(t, false);
    if (t->w) {
        t->readers[0].c = rconnect(t, true);
    } else {
        atomic_fetch_add(&t->base.n.errors, 1);
        t->w_next_try = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
        for (int i = 0; i < KV_REDIS_READERS; i++) t->readers[i].next_try = t->w_next_try;
    }
    pipe_restore(&g);
    set_up(t);

    int rc = start_unsignalled(&t->thread, writer_main, t);
    if (rc != 0) {
        tier_free(t);
        util_err_set(err, KVLM_ENOMEM, "redis tier: cannot start its writer thread (%s)", strerror(rc));
        return NULL;
    }
    t->thread_started = true;
    return t;
}

/* ---- Redis Cluster: the tier over several nodes ----
 *
 * redis-cluster://HOST:PORT[,HOST:PORT...]: seed nodes; the rest of the
 * cluster is discovered from CLUSTER SLOTS. hiredis 0.14 knows nothing of
 * clusters, so this does what a cluster client does:
 * - a block's key "kvlm:blk:<hex>" goes to slot CRC16(key) mod 16384 (no
 *   hash tag: the blocks of one prompt spread over every node);
 * - the slot map (slot -> master) comes from CLUSTER SLOTS, asked of any
 *   node that answers, at open, every KV_CLUSTER_MAP_MS, and at once after
 *   a redirection or CLUSTERDOWN;
 * - every master is a node tier of its own (the single-server code above:
 *   its writer thread and queue for puts, its reader connections, its
 *   reconnects, its faults), so a dead node costs only its own blocks: its
 *   puts drop and its gets miss at once (no connection: no wait), other
 *   nodes serve; every node gets the same AUTH and TLS;
 * - a get of n blocks is one pipeline of GETs per node (keys of one MGET
 *   must share a slot), all sent before any is read, under one deadline;
 *   MOVED (the slot changed master) and ASK (being migrated) are followed
 *   once (ASK with ASKING first) on a node already known, and refresh the
 *   map; an unknown target is a miss until the map has it;
 * - writes answered MOVED/ASK are dropped (counted) and refresh the map.
 * Only database 0 exists in a cluster. Run the nodes with
 * cluster-require-full-coverage no, or a single dead master stops every
 * node from serving any slot (docs/cluster.md). Until a first map is read
 * (no seed answers, or answers as no cluster) the tier is down, said once
 * when it starts and once when a map comes. */

#define KV_CLUSTER_SLOTS 16384
#define KV_CLUSTER_MAX_NODES 64
#define KV_CLUSTER_NO_NODE 0xff
/* Slot map re-read this often (the answer is a few hundred bytes). */
#define KV_CLUSTER_MAP_MS 1000

typedef struct {
    kv_tier base;
    int timeout_ms;
    int n_seeds;
    hostport seeds[KV_CLUSTER_MAX_SEEDS];
    redis_auth *auth; /* every node's */
    /* append-only (by open and the mapper thread); a node is closed only at close */
    _Atomic(redis_tier *) nodes[KV_CLUSTER_MAX_NODES];
    _Atomic int n_nodes;
    _Atomic uint8_t slot_node[KV_CLUSTER_SLOTS]; /* index into nodes, or KV_CLUSTER_NO_NODE */
    _Atomic bool refresh, mapped;
    uint8_t map_scratch[KV_CLUSTER_SLOTS]; /* the map being read */

    pthread_mutex_t m_mu;
    pthread_cond_t m_cv;
    bool stop;
    pthread_t thread;
    bool thread_started;

    /* no map yet: the fault, logged when it starts (map thread or open) and
     * when a map comes; missed: gets that had no map */
    bool f_on;
    double f_since;
    uint64_t f_missed0, f_dropped0;
    _Atomic uint64_t missed;
} cluster_tier;

/* CRC16-CCITT (XMODEM), Redis Cluster's key hash. */
static uint16_t crc16(const char *buf, size_t len) {
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++) {
        crc ^= (uint16_t)((unsigned char)buf[i] << 8);
        for (int b = 0; b < 8; b++) crc = (uint16_t)(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
    }
    return crc;
}

/* Redis's key slot: a {hash tag} if the key has a non-empty one. */
static int key_slot(const char *key, size_t len) {
    size_t s, e;
    for (s = 0; s < len && key[s] != '{'; s++) {}
    if (s < len) {
        for (e = s + 1; e < len && key[e] != '}'; e++) {}
        if (e < len && e != s + 1) return crc16(key + s + 1, e - s - 1) & (KV_CLUSTER_SLOTS - 1);
    }
    return crc16(key, len) & (KV_CLUSTER_SLOTS - 1);
}

/* The node index serving a block, or -1 (no map yet, or slot unassigned). */
static int cluster_node_of(cluster_tier *t, const char name[KEY_LEN + 1]) {
    int n = atomic_load(&t->slot_node[key_slot(name, KEY_LEN)]);
    return n == KV_CLUSTER_NO_NODE ? -1 : n;
}

static int cluster_find_node(cluster_tier *t, const char *host, int port) {
    int n = atomic_load(&t->n_nodes);
    for (int i = 0; i < n; i++) {
        redis_tier *nd = atomic_load(&t->nodes[i]);
        if (nd->port == port && !strcmp(nd->host, host)) return i;
    }
    return -1;
}

/* Finds or opens the node (mapper thread and open only). -1: no room. */
static int cluster_node_add(cluster_tier *t, const char *host, int port) {
    int i = cluster_find_node(t, host, port);
    if (i >= 0) return i;
    int n = atomic_load(&t->n_nodes);
    if (n >= KV_CLUSTER_MAX_NODES) return -1;
    kvlm_error err = {0};
    redis_tier *nd = node_open(host, port, 0, t->timeout_ms, t->auth, &t->refresh, false, &err);
    if (!nd) return -1;
    atomic_store(&t->nodes[n], nd);
    atomic_store(&t->n_nodes, n + 1);
    return n;
}

/* Reads CLUSTER SLOTS from one node and installs the map; false with why
 * (msg: "HOST:PORT: ...") when it cannot. */
static bool cluster_map_from(cluster_tier *t, const char *host, int port, char *msg, size_t cap) {
    rconn_params p = {host, port, 0, t->auth->user, t->auth->password, t->auth->tls, 0};
    rconn_status st;
    char why[256];
    const char *fmt = strchr(host, ':') ? "[%s]:%d: %s%s" : "%s:%d: %s%s";
    double deadline = util_now_s() + t->timeout_ms / 1000.0;
    rconn *c = rconn_open(&p, deadline, &st, why, sizeof why);
    if (!c) {
        snprintf(msg, cap, fmt, host, port, st == RCONN_DOWN ? "down: " : st == RCONN_HUNG ? "not answering: " : "", why);
        return false;
    }
    redisReply *r = NULL;
    rconn_set_limits(c, &rconn_slots);
    if (rconn_appendv(c, "CLUSTER", "SLOTS", (char *)NULL) && rconn_send(c, deadline)) r = rconn_recv(c, deadline);
    bool ok = r && r->type == REDIS_REPLY_ARRAY && r->elements > 0;
    if (!r) {
        const char *m;
        rconn_status e = rconn_error(c, &m);
        snprintf(msg, cap, fmt, host, port, e == RCONN_HUNG ? "not answering: " : "", m);
    } else if (r->type == REDIS_REPLY_ERROR) {
        char e[160];
        copy_err(e, sizeof e, r->str, r->len);
        snprintf(msg, cap, strchr(host, ':') ? "[%s]:%d: not a cluster node: CLUSTER SLOTS answered '%s' (use redis://)"
                                             : "%s:%d: not a cluster node: CLUSTER SLOTS answered '%s' (use redis://)",
                 host, port, e);
    } else if (!ok) {
        snprintf(msg, cap, fmt, host, port, "", r->type == REDIS_REPLY_ARRAY ? "the cluster has no slots assigned"
                                                                          : "CLUSTER SLOTS answered something else than a map");
    }
    uint8_t *map = t->map_scratch; /* the mapper thread's (open runs before it starts) */
    memset(map, KV_CLUSTER_NO_NODE, KV_CLUSTER_SLOTS);
    for (size_t i = 0; ok && i < r->elements; i++) {
        redisReply *e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER || e->element[2]->type != REDIS_REPLY_ARRAY ||
            e->element[2]->elements < 2 || e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
            e->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
            ok = false;
            snprintf(msg, cap, fmt, host, port, "", "CLUSTER SLOTS answered a map not of the shape expected");
            break;
        }
        long long lo = e->element[0]->integer, hi = e->element[1]->integer;
        const char *mh = e->element[2]->element[0]->str;
        long long mp = e->element[2]->element[1]->integer;
        if (lo < 0 || hi >= KV_CLUSTER_SLOTS || lo > hi || mp < 1 || mp > 65535) {
            ok = false;
            snprintf(msg, cap, fmt, host, port, "", "CLUSTER SLOTS answered a slot or port out of range");
            break;
        }
        /* "" or "?": the node does not know its own address; it is the one asked */
        if (!*mh || !strcmp(mh, "?")) mh = host;
        if (strlen(mh) >= sizeof ((hostport *)0)->host) continue;
        int nd = cluster_node_add(t, mh, (int)mp);
        if (nd < 0) continue; /* no room: its slots miss */
        for (long long s = lo; s <= hi; s++) map[s] = (uint8_t)nd;
    }
    if (r) freeReplyObject(r);
    rconn_free(c);
    if (!ok) return false;
    for (int s = 0; s < KV_CLUSTER_SLOTS; s++) atomic_store_explicit(&t->slot_node[s], map[s], memory_order_relaxed);
    atomic_store(&t->mapped, true);
    return true;
}

/* Asks the known nodes that are up, then the seeds, until one answers; a
 * tier without a map yet logs why when that starts and when it ends. */
static bool cluster_refresh(cluster_tier *t) {
    char why[1024] = "", one[400];
    size_t wl = 0;
    bool ok = false;
    int n = atomic_load(&t->n_nodes);
    for (int i = 0; i < n && !ok; i++) {
        redis_tier *nd = atomic_load(&t->nodes[i]);
        if (atomic_load(&nd->base.n.up)) ok = cluster_map_from(t, nd->host, nd->port, one, sizeof one);
    }
    for (int i = 0; i < t->n_seeds && !ok; i++) {
        ok = cluster_map_from(t, t->seeds[i].host, t->seeds[i].port, one, sizeof one);
        if (!ok && wl < sizeof why - 1) wl += (size_t)snprintf(why + wl, sizeof why - wl, "%s%s", wl ? "; " : "", one);
    }
    if (ok) {
        if (t->f_on) {
            t->f_on = false;
            LOG_WARN("redis tier: cluster slot map read after %.1f s (%llu reads missed, %llu writes dropped)",
                     util_now_s() - t->f_since, (unsigned long long)(atomic_load(&t->missed) - t->f_missed0),
                     (unsigned long long)(atomic_load(&t->base.n.dropped) - t->f_dropped0));
        }
        return true;
    }
    atomic_fetch_add(&t->base.n.errors, 1);
    if (!atomic_load(&t->mapped) && !t->f_on) { /* once mapped, the nodes tell their own faults */
        t->f_on = true;
        t->f_since = util_now_s();
        t->f_missed0 = atomic_load(&t->missed);
        t->f_dropped0 = atomic_load(&t->base.n.dropped);
        LOG_WARN("redis tier %s (no cluster slot map: reads miss and writes drop until a seed answers)", why);
    }
    return false;
}

static void *mapper_main(void *arg) {
    cluster_tier *t = arg;
    double next = util_now_s() + KV_CLUSTER_MAP_MS / 1000.0;
    pthread_mutex_lock(&t->m_mu);
    while (!t->stop) {
        struct timespec ts;
        abs_deadline(&ts, util_now_s() + 0.05);
        pthread_cond_timedwait(&t->m_cv, &t->m_mu, &ts);
        if (t->stop) break;
        double now = util_now_s();
        if (now < next && !atomic_load(&t->refresh)) continue;
        pthread_mutex_unlock(&t->m_mu);
        atomic_store(&t->refresh, false);
        cluster_refresh(t);
        next = util_now_s() + KV_CLUSTER_MAP_MS / 1000.0;
        pthread_mutex_lock(&t->m_mu);
    }
    pthread_mutex_unlock(&t->m_mu);
    return NULL;
}

/* Replies of a pipeline of GETs or EXISTS parsed straight into the caller's
 * buffers (as mget_sink does for MGET): one top-level reply at a time, the
 * caller sets `cur` before each and reads `kind` after. An array is never
 * an answer to either: refused at its header. */
enum { RK_NONE, RK_STR, RK_NIL, RK_INT, RK_ERR, RK_STATUS, RK_OTHER };
typedef struct {
    void *const *bufs; /* NULL: EXISTS */
    size_t cap;
    size_t *lens;
    int cur, kind;
    long long ival;
    char err[160];
} pipe_sink;

static void *psink_string(const redisReadTask *task, char *str, size_t len) {
    pipe_sink *s = task->privdata;
    if (task->parent) s->kind = RK_OTHER;
    else if (task->type == REDIS_REPLY_STRING) {
        s->kind = RK_STR;
        if (s->bufs && len > 0 && len <= s->cap) {
            memcpy(s->bufs[s->cur], str, len);
            s->lens[s->cur] = len;
        }
    } else if (task->type == REDIS_REPLY_ERROR) {
        s->kind = RK_ERR;
        copy_err(s->err, sizeof s->err, str, len);
    } else {
        s->kind = RK_STATUS;
    }
    return s;
}
static void *psink_array(const redisReadTask *task, int elements) {
    (void)elements;
    ((pipe_sink *)task->privdata)->kind = RK_OTHER;
    return NULL;
}
static void *psink_integer(const redisReadTask *task, long long v) {
    pipe_sink *s = task->privdata;
    if (task->parent) s->kind = RK_OTHER;
    else { s->kind = RK_INT; s->ival = v; }
    return s;
}
static void *psink_nil(const redisReadTask *task) {
    pipe_sink *s = task->privdata;
    s->kind = task->parent ? RK_OTHER : RK_NIL;
    return s;
}
static redisReplyObjectFunctions psink_fns = {psink_string, psink_array, psink_integer, psink_nil, sink_free};

/* Reads one reply of a pipeline into the sink (false: connection broken). */
static bool psink_recv(rconn *c, pipe_sink *s, int cur, double deadline) {
    rconn_set_sink(c, &psink_fns, s);
    s->cur = cur;
    s->kind = RK_NONE;
    bool ok = rconn_recv(c, deadline) == (void *)s && s->kind != RK_OTHER && s->kind != RK_NONE;
    rconn_clear_sink(c);
    return ok;
}

/* "MOVED 3999 127.0.0.1:6381" / "ASK ...": the target node's index if known
 * (*ask set for ASK); -1 otherwise. Either way the map gets re-read. */
static int redirect_target(cluster_tier *t, const char *e, bool *ask) {
    *ask = !strncmp(e, "ASK ", 4);
    if (!*ask && strncmp(e, "MOVED ", 6) != 0) return -1;
    atomic_store(&t->refresh, true);
    const char *a = strchr(e, ' ');
    a = a ? strchr(a + 1, ' ') : NULL;
    const char *colon = a ? strrchr(a, ':') : NULL;
    if (!colon || colon - a - 1 <= 0 || colon - a - 1 >= 256) return -1;
    char host[256];
    memcpy(host, a + 1, (size_t)(colon - a - 1));
    host[colon - a - 1] = 0;
    long port = strtol(colon + 1, NULL, 10);
    return cluster_find_node(t, host, (int)port);
}

/* Parses one reply already read into the sink, no I/O: 1 one parsed, 0 not
 * whole yet, -1 a protocol error, a refused reply or an unexpected shape. */
static int psink_try(rconn *c, pipe_sink *s, int cur) {
    rconn_set_sink(c, &psink_fns, s);
    s->cur = cur;
    s->kind = RK_NONE;
    void *r = NULL;
    int st = rconn_parse(c, &r);
    if (st == 1 && (r != (void *)s || s->kind == RK_OTHER || s->kind == RK_NONE)) st = -1;
    rconn_clear_sink(c);
    return st;
}

/* A node's pipeline is over: its reader goes back, closed if broken (its
 * unread replies would reach the next caller); its blocks not read miss. */
static void leg_end(cluster_tier *t, int nd, int slot, bool broken) {
    redis_tier *r = atomic_load(&t->nodes[nd]);
    if (broken) atomic_fetch_add(&r->missed, 1);
    reader_give(r, slot, broken);
}

/* GET (bufs != NULL) or EXISTS of n blocks over the cluster: lens[i] > 0
 * for a block found (EXISTS: 1). One pipeline per node, sent to every node
 * before any reply is read; one deadline for all. */
static void cluster_fetch(cluster_tier *t, int n, const kv_key *keys, void *const *bufs, size_t cap, size_t *lens,
                          double deadline) {
    const char *cmd = bufs ? "GET" : "EXISTS";
    int *node = malloc(sizeof *node * (size_t)n * 2);
    char(*names)[KEY_LEN + 1] = malloc(sizeof *names * (size_t)n);
    if (!node || !names) { free(node); free(names); return; }
    int *redir = node + n; /* per key: -1, or the node a redirection named (+ KV_CLUSTER_MAX_NODES for ASK) */
    struct { int node, slot; bool broken; } legs[KV_CLUSTER_MAX_NODES];
    int n_legs = 0;
    rconn_limits lim = bufs ? block_limits(cap) : rconn_small;
    pipe_guard g;
    pipe_block(&g);
    bool unmapped = false;
    for (int i = 0; i < n; i++) {
        key_name(&keys[i], names[i]);
        node[i] = cluster_node_of(t, names[i]);
        redir[i] = -1;
        unmapped |= node[i] < 0;
    }
    if (unmapped && bufs) atomic_fetch_add(&t->missed, 1);
    /* send: one pipeline per node, nodes in index order (callers that wait
     * for a busy reader while holding others' all take them in one order) */
    int n_nodes = atomic_load(&t->n_nodes);
    for (int nd = 0; nd < n_nodes; nd++) {
        int i = 0;
        while (i < n && node[i] != nd) i++;
        if (i == n) continue;
        redis_tier *r = atomic_load(&t->nodes[nd]);
        bool down;
        int slot = reader_take(r, deadline, &down);
        if (slot < 0) { /* down (or every reader busy until the deadline): its blocks miss */
            if (down && bufs) atomic_fetch_add(&r->missed, 1);
            for (int j = i; j < n; j++)
                if (node[j] == nd) node[j] = -1;
            continue;
        }
        rconn *c = r->readers[slot].c;
        rconn_set_limits(c, &lim);
        bool ok = true;
        for (int j = i; ok && j < n; j++) {
            if (node[j] != nd) continue;
            const char *argv[2] = {cmd, names[j]};
            size_t alen[2] = {strlen(cmd), KEY_LEN};
            ok = rconn_append(c, 2, argv, alen);
        }
        ok = ok && rconn_send(c, deadline);
        legs[n_legs].node = nd;
        legs[n_legs].slot = slot;
        legs[n_legs].broken = !ok;
        n_legs++;
    }
    /* receive from every node at once (poll): a node that hangs costs its
     * own blocks at the deadline, not the others' */
    struct pollfd pfd[KV_CLUSTER_MAX_NODES];
    int next[KV_CLUSTER_MAX_NODES], open_legs = 0;
    for (int l = 0; l < n_legs; l++) {
        next[l] = 0;
        if (!legs[l].broken) open_legs++;
        else leg_end(t, legs[l].node, legs[l].slot, true);
    }
    while (open_legs > 0) {
        int np = 0, map_[KV_CLUSTER_MAX_NODES];
        bool ready = false; /* a TLS leg holds decrypted bytes: read them before waiting */
        for (int l = 0; l < n_legs; l++) {
            if (legs[l].broken || next[l] > n) continue; /* ended */
            redis_tier *r = atomic_load(&t->nodes[legs[l].node]);
            rconn *c = r->readers[legs[l].slot].c;
            /* parse what has arrived */
            for (;;) {
                while (next[l] < n && node[next[l]] != legs[l].node) next[l]++;
                if (next[l] == n) break;
                int j = next[l];
                pipe_sink s = {bufs, cap, lens, 0, 0, 0, {0}};
                int got = psink_try(c, &s, j);
                if (got == 0) break;
                if (got < 0) { legs[l].broken = true; break; }
                if (s.kind == RK_INT && !bufs) lens[j] = s.ival == 1;
                else if (s.kind == RK_ERR) {
                    bool ask;
                    int to = redirect_target(t, s.err, &ask);
                    if (to >= 0) redir[j] = to + (ask ? KV_CLUSTER_MAX_NODES : 0);
                    else {
                        if (!strncmp(s.err, "CLUSTERDOWN", 11)) atomic_store(&t->refresh, true);
                        refusal_note(r, REF_READS, s.err);
                    }
                } else if (bufs) {
                    note_ok(r, REF_READS);
                    fault_end(r, true);
                }
                next[l]++;
            }
            if (legs[l].broken || next[l] == n) {
                leg_end(t, legs[l].node, legs[l].slot, legs[l].broken);
                next[l] = n + 1;
                open_legs--;
                continue;
            }
            ready |= rconn_buffered(c);
            pfd[np] = (struct pollfd){.fd = rconn_fd(c), .events = rconn_events(c)};
            map_[np++] = l;
        }
        if (np == 0) break;
        double left = deadline - util_now_s();
        int pr = 0;
        if (left > 0 || ready) {
            pr = poll(pfd, (nfds_t)np, ready || left <= 0 ? 0 : (int)(left * 1000) + 1);
            if (pr < 0 && errno == EINTR) continue;
        }
        bool expired = left <= 0 || pr < 0 || (pr == 0 && !ready); /* the deadline passed (or poll failed) */
        for (int k = 0; k < np; k++) {
            int l = map_[k];
            redis_tier *r = atomic_load(&t->nodes[legs[l].node]);
            rconn *c = r->readers[legs[l].slot].c;
            bool end = expired;
            if (end) rconn_set_error(c, RCONN_HUNG, "waiting for a reply timed out");
            else if (pfd[k].revents || rconn_buffered(c)) end = rconn_read_some(c) < 0;
            if (end) {
                legs[l].broken = true;
                leg_end(t, legs[l].node, legs[l].slot, true);
                next[l] = n + 1;
                open_legs--;
            }
        }
    }
    /* redirections: once each, one round trip per block (they are rare: a
     * slot moved since the map was read) */
    for (int j = 0; j < n; j++) {
        if (redir[j] < 0 || lens[j]) continue;
        bool ask = redir[j] >= KV_CLUSTER_MAX_NODES;
        redis_tier *r = atomic_load(&t->nodes[redir[j] % KV_CLUSTER_MAX_NODES]);
        int slot = reader_take(r, deadline, NULL);
        if (slot < 0) continue;
        rconn *c = r->readers[slot].c;
        rconn_set_limits(c, &lim);
        const char *argv[2] = {cmd, names[j]};
        size_t alen[2] = {strlen(cmd), KEY_LEN};
        pipe_sink s = {bufs, cap, lens, 0, 0, 0, {0}};
        bool ok = (!ask || rconn_appendv(c, "ASKING", (char *)NULL)) && rconn_append(c, 2, argv, alen) &&
                  rconn_send(c, deadline) && (!ask || psink_recv(c, &s, j, deadline)) && psink_recv(c, &s, j, deadline);
        if (ok && s.kind == RK_INT && !bufs) lens[j] = s.ival == 1;
        if (!ok) lens[j] = 0;
        reader_give(r, slot, !ok);
    }
    pipe_restore(&g);
    free(node);
    free(names);
}
static int leading(int n, const size_t *lens, int *found) {
    int lead = 0;
    bool gap = false;
    *found = 0;
    for (int i = 0; i < n; i++) {
        if (lens[i]) {
            (*found)++;
            if (!gap) lead++;
        } else {
            gap = true;
        }
    }
    return lead;
}

static int cluster_get(kv_tier *base, int n, const kv_key *keys, void *const *bufs, size_t cap, size_t *lens) {
    cluster_tier *t = (cluster_tier *)base;
    if (n <= 0) return 0;
    double t0 = util_now_s();
    for (int i = 0; i < n; i++) lens[i] = 0;
    cluster_fetch(t, n, keys, bufs, cap, lens, t0 + t->timeout_ms / 1000.0);
    int found, lead = leading(n, lens, &found);
    kv_tier_note_read(base, found, n, t0);
    return lead;
}

static int cluster_contains(kv_tier *base, int n, const kv_key *keys) {
    cluster_tier *t = (cluster_tier *)base;
    if (n <= 0) return 0;
    size_t *lens = calloc((size_t)n, sizeof *lens);
    if (!lens) return 0;
    cluster_fetch(t, n, keys, NULL, 0, lens, util_now_s() + t->timeout_ms / 1000.0);
    int found, lead = leading(n, lens, &found);
    free(lens);
    return lead;
}

static redis_tier *cluster_route(cluster_tier *t, const kv_key *key) {
    char name[KEY_LEN + 1];
    key_name(key, name);
    int nd = cluster_node_of(t, name);
    return nd < 0 ? NULL : atomic_load(&t->nodes[nd]);
}

static bool cluster_put(kv_tier *base, const kv_key *key, const void *data, size_t len) {
    cluster_tier *t = (cluster_tier *)base;
    redis_tier *r = cluster_route(t, key);
    if (r) return redis_put(&r->base, key, data, len); /* the node counts a drop */
    atomic_fetch_add(&t->base.n.dropped, 1);
    return false;
}

static void cluster_drop(kv_tier *base, const kv_key *key) {
    redis_tier *r = cluster_route((cluster_tier *)base, key);
    if (r) redis_drop(&r->base, key);
}

static void cluster_flush(kv_tier *base) {
    cluster_tier *t = (cluster_tier *)base;
    int n = atomic_load(&t->n_nodes);
    for (int i = 0; i < n; i++) redis_flush(&atomic_load(&t->nodes[i])->base);
}

/* Sums of the nodes' figures (blocks: keys over every master; bytes: their
 * used_memory); up while the map is known and at least one node answers. */
/* Its own counters (reads, hits, misses, what it dropped before a node had
 * it) are in out already; the nodes' sizes, writes and errors add to them. */
static void cluster_stats(kv_tier *base, kv_tier_stats *out) {
    cluster_tier *t = (cluster_tier *)base;
    bool any_up = false;
    int n = atomic_load(&t->n_nodes);
    for (int i = 0; i < n; i++) {
        kv_tier_stats s;
        kv_tier_stats_get(&atomic_load(&t->nodes[i])->base, &s);
        out->blocks += s.blocks;
        out->bytes += s.bytes;
        out->writes += s.writes;
        out->write_bytes += s.write_bytes;
        out->dropped_writes += s.dropped_writes;
        out->errors += s.errors;
        any_up |= s.up;
    }
    out->up = any_up && atomic_load(&t->mapped);
}

static void cluster_free(cluster_tier *t) {
    int n = atomic_load(&t->n_nodes);
    for (int i = 0; i < n; i++) redis_close(&atomic_load(&t->nodes[i])->base);
    auth_free(t->auth);
    pthread_mutex_destroy(&t->m_mu);
    pthread_cond_destroy(&t->m_cv);
    free(t);
}

static void cluster_close(kv_tier *base) {
    cluster_tier *t = (cluster_tier *)base;
    pthread_mutex_lock(&t->m_mu);
    t->stop = true;
    pthread_cond_broadcast(&t->m_cv);
    pthread_mutex_unlock(&t->m_mu);
    if (t->thread_started) pthread_join(t->thread, NULL);
    cluster_free(t); /* each node flushes as it closes */
}

static const kv_tier_ops cluster_ops = {
    .name = "redis",
    .put = cluster_put,
    .get = cluster_get,
    .contains = cluster_contains,
    .drop = cluster_drop,
    .flush = cluster_flush,
    .stats = cluster_stats,
    .close = cluster_close,
};


static kv_tier *cluster_open(const redis_url *u, int timeout_ms, redis_auth *auth, kvlm_error *err) {
    cluster_tier *t = calloc(1, sizeof *t);
    if (!t) {
        auth_free(auth);
        util_err_set(err, KVLM_ENOMEM, "redis tier: out of memory");
        return NULL;
    }
    t->base.ops = &cluster_ops;
    t->timeout_ms = timeout_ms;
    t->auth = auth;
    t->n_seeds = u->n_hosts;
    memcpy(t->seeds, u->hosts, sizeof t->seeds);
    for (int s = 0; s < KV_CLUSTER_SLOTS; s++) atomic_init(&t->slot_node[s], KV_CLUSTER_NO_NODE);
    pthread_mutex_init(&t->m_mu, NULL);
    cond_init_mono(&t->m_cv);
    /* One map now (each seed at most one timeout), so puts route at once; a
     * cluster that is not there is not an error (the mapper keeps asking),
     * but it is said, once. */
    pipe_guard g;
    pipe_block(&g);
    cluster_refresh(t);
    pipe_restore(&g);

    int rc = start_unsignalled(&t->thread, mapper_main, t);
    if (rc != 0) {
        cluster_free(t);
        util_err_set(err, KVLM_ENOMEM, "redis tier: cannot start its slot-map thread (%s)", strerror(rc));
        return NULL;
    }
    t->thread_started = true;
    return &t->base;
}

kv_tier *kv_tier_redis_open(const char *url, const kv_redis_opts *o, kvlm_error *err) {
    kv_redis_opts none = {0};
    if (!o) o = &none;
    int timeout_ms = o->timeout_ms;
    if (timeout_ms < 0 || timeout_ms > 60000) {
        util_err_set(err, KVLM_EINVAL, "redis tier: timeout %d ms: must be 0 (default 200) to 60000", timeout_ms);
        return NULL;
    }
    if (!timeout_ms) timeout_ms = 200;
    redis_url u;
    if (!parse_url(url, &u, err)) return NULL;
    if (!u.tls && (o->tls_ca || o->tls_cert || o->tls_key)) {
        util_err_set(err, KVLM_EINVAL, "redis tier: '%.200s': TLS files given (CA, certificate or key) for a plain "
                     "connection: use rediss:// (or rediss-cluster://)", u.shown);
        url_free(&u);
        return NULL;
    }
    if (o->password && !*o->password) {
        util_err_set(err, KVLM_EINVAL, "redis tier: an empty password");
        url_free(&u);
        return NULL;
    }
    if (u.user && !u.password && !o->password) {
        util_err_set(err, KVLM_EINVAL, "redis tier: '%.200s': user '%.64s' without a password (give it in a file or "
                     "KVLM_REDIS_PASSWORD)", u.shown, u.user);
        url_free(&u);
        return NULL;
    }
    redis_auth *auth = calloc(1, sizeof *auth);
    if (!auth) {
        url_free(&u);
        util_err_set(err, KVLM_ENOMEM, "redis tier: out of memory");
        return NULL;
    }
    auth->user = u.user;
    auth->password = o->password ? strdup(o->password) : u.password;
    if (o->password && u.password) {
        memset(u.password, 0, strlen(u.password));
        free(u.password);
    }
    u.user = u.password = NULL; /* auth's now */
    if (o->password && !auth->password) {
        util_err_set(err, KVLM_ENOMEM, "redis tier: out of memory");
        auth_free(auth);
        return NULL;
    }
    if (u.tls && !(auth->tls = rconn_tls_new(o->tls_ca, o->tls_cert, o->tls_key, err))) {
        auth_free(auth);
        return NULL;
    }
    if (u.cluster) return cluster_open(&u, timeout_ms, auth, err);
    redis_tier *t = node_open(u.hosts[0].host, u.hosts[0].port, u.db, timeout_ms, auth, NULL, u.proxy, err);
    if (!t) {
        auth_free(auth);
        return NULL;
    }
    t->own_auth = auth;
    return &t->base;
}
