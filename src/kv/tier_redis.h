/* kv/tier_redis: one Redis server's tier (a single server, or one node of a
 * Redis Cluster: kv/redis_cluster): what the cluster router uses of it: the
 * node tier itself (its queue and writer thread, its reader connections,
 * its faults), the block's key name, the URL, and the helpers both share.
 * kv_tier_redis_open (kv/tier.h) is the way in for everyone else. */
#ifndef KVLM_KV_TIER_REDIS_H
#define KVLM_KV_TIER_REDIS_H
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>
#include <hiredis/hiredis.h>
#include "kv/redis_conn.h"
#include "kv/tier.h"

/* Reader connections: parallel get/contains callers beyond this wait. */
#define KV_REDIS_READERS 4

#define KEY_PREFIX "kvlm:blk:"
#define KEY_LEN (sizeof KEY_PREFIX - 1 + 32)

typedef struct {
    rconn *c;        /* NULL: down */
    bool busy;       /* taken by a caller, or by the writer reconnecting it */
    double next_try; /* earliest next connection attempt */
} redis_reader;

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
} redis_refusal;

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
    struct qnode *head, *tail; /* head..: queued; the first `inflight` are being written */
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
    redis_reader readers[KV_REDIS_READERS];
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
    redis_refusal ref[REF_N];
    _Atomic uint64_t missed, ok[REF_N];
    _Atomic bool f_on; /* f_kind != 0, read without the lock */
} redis_tier;

#define KV_CLUSTER_MAX_SEEDS 16

typedef struct {
    char host[256];
    int port;
} redis_hostport;

typedef struct {
    bool tls, cluster, proxy;
    int db;
    char *user, *password; /* decoded, malloc'd; NULL: none */
    int n_hosts;
    redis_hostport hosts[KV_CLUSTER_MAX_SEEDS];
    char shown[300]; /* the URL redacted, for messages */
} redis_url;

/* SIGPIPE blocked around a caller's socket I/O; one it raised is consumed. */
typedef struct {
    sigset_t old;
    bool was_pending;
} redis_pipe_guard;

/* A block's key "kvlm:blk:<32 hex digits>". */
void redis_key_name(const kv_key *k, char out[KEY_LEN + 1]);
/* deadline (util_now_s's clock) as a CLOCK_MONOTONIC timespec, for condvars made by redis_cond_init_mono. */
void redis_abs_deadline(struct timespec *ts, double deadline);
void redis_cond_init_mono(pthread_cond_t *cv);
void redis_pipe_block(redis_pipe_guard *g);
void redis_pipe_restore(redis_pipe_guard *g);
/* Starts a thread that takes no signals; the pthread_create status. */
int redis_start_unsignalled(pthread_t *th, void *(*fn)(void *), void *arg);
/* Copies an error reply's text (printable bytes only). */
void redis_copy_err(char *out, size_t cap, const char *str, size_t len);
/* What a read of blocks of at most cap bytes may receive. */
rconn_limits redis_block_limits(size_t cap);
/* The no-op free of the reply sinks (parsed straight into the caller's buffers). */
void redis_sink_free(void *obj);
void redis_auth_free(redis_auth *a);

/* One server's tier. auth: kept by pointer (the caller's, outliving it);
 * refresh: a cluster's flag to set on a redirection or CLUSTERDOWN (NULL:
 * a single server); proxy: a twemproxy in front. */
redis_tier *redis_node_open(const char *host, int port, int db, int timeout_ms, const redis_auth *auth,
                            _Atomic bool *refresh, bool proxy, kvlm_error *err);
/* Takes a connected reader slot, waiting for a busy one until deadline.
 * -1: none is connected (*down set), or none came free in time. Given back
 * with redis_reader_give, closed if broken (its unread replies). */
int redis_reader_take(redis_tier *t, double deadline, bool *down);
void redis_reader_give(redis_tier *t, int i, bool broken);
/* An error reply to a command of direction dir (REF_*), and a success. */
void redis_refusal_note(redis_tier *t, int dir, const char *e);
void redis_note_ok(redis_tier *t, int dir);
/* A connection answered (data: a command of data succeeded): its fault,
 * if any, ends (a reply refused ends only with data). */
void redis_fault_end(redis_tier *t, bool data);
/* The node's kv_tier_ops, called by the cluster for the node a key maps to. */
bool redis_put(kv_tier *base, const kv_key *key, const void *data, size_t len);
void redis_drop(kv_tier *base, const kv_key *key);
void redis_flush(kv_tier *base);
void redis_close(kv_tier *base);
#endif
