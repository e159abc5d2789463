/* kv/tier_redis: the Redis tier: KV blocks shared by every engine process
 * that points at one Redis server (or a Redis Cluster: kv/redis_cluster
 * routes each block to the node tier of its master, made here), over
 * kv/redis_conn (TCP or TLS, AUTH, bounded replies) and hiredis's reply
 * parser; and the tier's URL, parsed for both.
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
#include "kv/redis_cluster.h"
#include "kv/redis_conn.h"
#include "kv/tier_redis.h"
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

/* ---- small helpers ---- */

void redis_key_name(const kv_key *k, char out[KEY_LEN + 1]) {
    memcpy(out, KEY_PREFIX, sizeof KEY_PREFIX - 1);
    kv_key_hex(k, out + sizeof KEY_PREFIX - 1);
}

void redis_abs_deadline(struct timespec *ts, double deadline) {
    /* condvars here run on CLOCK_MONOTONIC, the clock util_now_s reads */
    ts->tv_sec = (time_t)deadline;
    ts->tv_nsec = (long)((deadline - (double)ts->tv_sec) * 1e9);
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

void redis_cond_init_mono(pthread_cond_t *cv) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
}


void redis_pipe_block(redis_pipe_guard *g) {
    sigset_t s, pend;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    sigemptyset(&pend);
    sigpending(&pend);
    g->was_pending = sigismember(&pend, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &s, &g->old);
}

void redis_pipe_restore(redis_pipe_guard *g) {
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
void redis_fault_end(redis_tier *t, bool data) {
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

void redis_refusal_note(redis_tier *t, int dir, const char *e) {
    if ((dir = refusal_dir(t, e, dir)) < 0) return;
    double now = util_now_s();
    pthread_mutex_lock(&t->f_mu);
    redis_refusal *r = &t->ref[dir];
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

void redis_note_ok(redis_tier *t, int dir) {
    atomic_fetch_add_explicit(&t->ok[dir], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&t->ok[REF_MODE], 1, memory_order_relaxed);
}

/* Ends the error-reply faults that have gone quiet (writer thread). */
static void refusals_check(redis_tier *t) {
    double now = util_now_s();
    static const char *what[REF_N] = {"accepting writes again", "answering reads again", "no more cluster redirections"};
    for (int d = 0; d < REF_N; d++) {
        pthread_mutex_lock(&t->f_mu);
        redis_refusal *r = &t->ref[d];
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
    if (c) redis_fault_end(t, false);
    else fault_note(t, st, msg);
    return c;
}

/* ---- readers (callers' threads) ---- */

/* Takes a connected reader slot, waiting for a busy one until deadline.
 * -1: none is connected (*down set), or none came free in time. */
int redis_reader_take(redis_tier *t, double deadline, bool *down) {
    pthread_mutex_lock(&t->r_mu);
    int got = -1;
    bool any_up = false;
    for (;;) {
        any_up = false;
        for (int k = 0; k < KV_REDIS_READERS; k++) {
            int i = (int)((t->r_next + (unsigned)k) % KV_REDIS_READERS);
            redis_reader *r = &t->readers[i];
            if (!r->c) continue;
            any_up = true;
            if (!r->busy) { got = i; break; }
        }
        if (got >= 0 || !any_up) break;
        struct timespec ts;
        redis_abs_deadline(&ts, deadline);
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
void redis_reader_give(redis_tier *t, int i, bool broken) {
    if (broken) {
        const char *msg;
        rconn_status st = rconn_error(t->readers[i].c, &msg);
        fault_note(t, st ? st : RCONN_PROTOCOL, st ? msg : "a reply not of the shape asked for");
    }
    pthread_mutex_lock(&t->r_mu);
    redis_reader *r = &t->readers[i];
    if (broken) {
        const double retry = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
        for (int k = 0; k < KV_REDIS_READERS; k++) {
            redis_reader *o = &t->readers[k];
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
        redis_key_name(&keys[i], a->names[i]);
        a->argv[i + 1] = a->names[i];
        a->lens[i + 1] = KEY_LEN;
    }
    return true;
}

/* Copies an error reply's text (printable bytes only). */
void redis_copy_err(char *out, size_t cap, const char *str, size_t len) {
    size_t m = 0;
    for (size_t i = 0; i < len && m + 1 < cap; i++) out[m++] = str[i] >= 32 && str[i] < 127 ? str[i] : '?';
    out[m] = 0;
}

/* The limits of a read of blocks of at most cap bytes: one at a time is
 * buffered; a longer one (up to the largest block a put writes) is read past
 * as a miss; anything longer is refused. */
rconn_limits redis_block_limits(size_t cap) {
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
    if (!task->parent && task->type == REDIS_REPLY_ERROR) redis_copy_err(s->err, sizeof s->err, str, len);
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
void redis_sink_free(void *obj) { (void)obj; }
static redisReplyObjectFunctions sink_fns = {sink_string, sink_array, sink_integer, sink_nil, redis_sink_free};

static int redis_get(kv_tier *base, int n, const kv_key *keys, void *const *bufs, size_t cap, size_t *lens) {
    redis_tier *t = (redis_tier *)base;
    if (n <= 0) return 0;
    double t0 = util_now_s(), deadline = t0 + t->timeout_ms / 1000.0;
    for (int i = 0; i < n; i++) lens[i] = 0;
    int lead = 0, found = 0;
    key_argv a;
    bool down;
    int slot = redis_reader_take(t, deadline, &down);
    if (slot < 0 && down) atomic_fetch_add(&t->missed, 1);
    if (slot >= 0) {
        rconn *c = t->readers[slot].c;
        bool ok = key_argv_make(&a, "MGET", n, keys);
        if (!ok) {
            redis_reader_give(t, slot, false);
        } else {
            redis_pipe_guard g;
            redis_pipe_block(&g);
            mget_sink sink = {n, bufs, cap, lens, false, {0}};
            rconn_limits lim = redis_block_limits(cap);
            rconn_set_limits(c, &lim);
            rconn_set_sink(c, &sink_fns, &sink);
            ok = rconn_append(c, n + 1, a.argv, a.lens) && rconn_send(c, deadline) &&
                 rconn_recv(c, deadline) == (void *)&sink && !sink.bad;
            rconn_clear_sink(c);
            redis_pipe_restore(&g);
            bool refused = ok && sink.err[0];
            if (ok && !refused) {
                redis_note_ok(t, REF_READS);
                redis_fault_end(t, true);
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
            redis_reader_give(t, slot, !ok);
            if (refused) redis_refusal_note(t, REF_READS, sink.err);
        }
    }
    kv_tier_note_read(base, found, n, t0);
    return lead;
}

static int redis_contains(kv_tier *base, int n, const kv_key *keys) {
    redis_tier *t = (redis_tier *)base;
    if (n <= 0) return 0;
    double deadline = util_now_s() + t->timeout_ms / 1000.0;
    int slot = redis_reader_take(t, deadline, NULL);
    if (slot < 0) return 0;
    rconn *c = t->readers[slot].c;
    redis_pipe_guard g;
    redis_pipe_block(&g);
    rconn_set_limits(c, &rconn_small);
    bool ok = true;
    for (int i = 0; ok && i < n; i++) {
        char name[KEY_LEN + 1];
        redis_key_name(&keys[i], name);
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
        if (ok && r->type == REDIS_REPLY_ERROR && !err[0]) redis_copy_err(err, sizeof err, r->str, r->len);
        if (ok && r->type == REDIS_REPLY_INTEGER && r->integer == 1 && !gap) lead++;
        else gap = true;
        if (r) freeReplyObject(r);
    }
    redis_pipe_restore(&g);
    redis_reader_give(t, slot, !ok);
    if (ok && err[0]) redis_refusal_note(t, REF_READS, err);
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
    redis_key_name(key, name);
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

bool redis_put(kv_tier *base, const kv_key *key, const void *data, size_t len) {
    redis_tier *t = (redis_tier *)base;
    qnode *q = NULL;
    /* down: drop without copying; the writer drops what was queued before */
    if (atomic_load(&t->base.n.up) && len > 0 && len <= KV_REDIS_MAX_BLOCK && (q = qnode_make(OP_SET, key, data, len))) {
        if (enqueue(t, q)) return true;
    }
    atomic_fetch_add(&t->base.n.dropped, 1);
    return false;
}

void redis_drop(kv_tier *base, const kv_key *key) {
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
void redis_flush(kv_tier *base) {
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
        redis_abs_deadline(&ts, now + 0.05);
        pthread_cond_timedwait(&t->done_cv, &t->q_mu, &ts);
    }
    pthread_mutex_unlock(&t->q_mu);
}

/* ---- the writer thread ---- */

static void set_up(redis_tier *t) { atomic_store(&t->base.n.up, t->w != NULL); }

/* The writer's connection broke: closed, and the idle readers with it (as
 * redis_reader_give does: they are in the same state; left open to a server that
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
        redis_reader *o = &t->readers[k];
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
                redis_note_ok(t, REF_WRITES);
            } else { /* e.g. OOM under maxmemory with noeviction */
                atomic_fetch_add(&t->base.n.dropped, 1);
                atomic_fetch_add(&t->base.n.errors, 1);
                if (r->type == REDIS_REPLY_ERROR && r->str) {
                    redis_copy_err(err, sizeof err, r->str, r->len);
                    redis_refusal_note(t, REF_WRITES, err);
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
        redis_fault_end(t, true);
    }
}

/* Reconnects broken reader slots whose retry time has come; stops at the
 * first failure (the server is not there: the rest would fail too). */
static void readers_reconnect(redis_tier *t) {
    for (int i = 0; i < KV_REDIS_READERS; i++) {
        pthread_mutex_lock(&t->r_mu);
        redis_reader *r = &t->readers[i];
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
int redis_start_unsignalled(pthread_t *th, void *(*fn)(void *), void *arg) {
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
            redis_abs_deadline(&ts, util_now_s() + 0.1); /* reconnects and the stats poll */
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

void redis_auth_free(redis_auth *a) {
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
    redis_auth_free(t->own_auth);
    free(t);
}

void redis_close(kv_tier *base) {
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
static bool parse_hostport(const redis_url *u, const char *h, const char *stops, redis_hostport *hp, const char **end,
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
redis_tier *redis_node_open(const char *host, int port, int db, int timeout_ms, const redis_auth *auth,
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
    redis_cond_init_mono(&t->q_cv);
    redis_cond_init_mono(&t->done_cv);
    redis_cond_init_mono(&t->r_cv);

    /* One try now, so a tier opened beside a running server takes puts at
     * once; a server that is not there is not an error (the writer thread
     * keeps trying), but it is said, once. */
    redis_pipe_guard g;
    redis_pipe_block(&g);
    t->w = rconnect(t, false);
    if (t->w) {
        t->readers[0].c = rconnect(t, true);
    } else {
        atomic_fetch_add(&t->base.n.errors, 1);
        t->w_next_try = util_now_s() + KV_REDIS_RETRY_MS / 1000.0;
        for (int i = 0; i < KV_REDIS_READERS; i++) t->readers[i].next_try = t->w_next_try;
    }
    redis_pipe_restore(&g);
    set_up(t);

    int rc = redis_start_unsignalled(&t->thread, writer_main, t);
    if (rc != 0) {
        tier_free(t);
        util_err_set(err, KVLM_ENOMEM, "redis tier: cannot start its writer thread (%s)", strerror(rc));
        return NULL;
    }
    t->thread_started = true;
    return t;
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
        redis_auth_free(auth);
        return NULL;
    }
    if (u.tls && !(auth->tls = rconn_tls_new(o->tls_ca, o->tls_cert, o->tls_key, err))) {
        redis_auth_free(auth);
        return NULL;
    }
    if (u.cluster) return redis_cluster_open(&u, timeout_ms, auth, err);
    redis_tier *t = redis_node_open(u.hosts[0].host, u.hosts[0].port, u.db, timeout_ms, auth, NULL, u.proxy, err);
    if (!t) {
        redis_auth_free(auth);
        return NULL;
    }
    t->own_auth = auth;
    return &t->base;
}
