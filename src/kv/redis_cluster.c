/* kv/redis_cluster: the Redis tier over a Redis Cluster: the slot map (CLUSTER
 * SLOTS), one node tier (kv/tier_redis) per master, reads pipelined per node
 * under one deadline, MOVED / ASK redirections, a dead node costing only its
 * own blocks. */
#include "kv/redis_cluster.h"
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include "util/error.h"
#include "util/log.h"
#include "util/timing.h"

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
 * - every master is a node tier of its own (kv/tier_redis.c, the single-server tier:
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
    redis_hostport seeds[KV_CLUSTER_MAX_SEEDS];
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
    redis_tier *nd = redis_node_open(host, port, 0, t->timeout_ms, t->auth, &t->refresh, false, &err);
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
        redis_copy_err(e, sizeof e, r->str, r->len);
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
        if (strlen(mh) >= sizeof ((redis_hostport *)0)->host) continue;
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
        redis_abs_deadline(&ts, util_now_s() + 0.05);
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
        redis_copy_err(s->err, sizeof s->err, str, len);
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
static redisReplyObjectFunctions psink_fns = {psink_string, psink_array, psink_integer, psink_nil, redis_sink_free};

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
    redis_reader_give(r, slot, broken);
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
    rconn_limits lim = bufs ? redis_block_limits(cap) : rconn_small;
    redis_pipe_guard g;
    redis_pipe_block(&g);
    bool unmapped = false;
    for (int i = 0; i < n; i++) {
        redis_key_name(&keys[i], names[i]);
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
        int slot = redis_reader_take(r, deadline, &down);
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
                        redis_refusal_note(r, REF_READS, s.err);
                    }
                } else if (bufs) {
                    redis_note_ok(r, REF_READS);
                    redis_fault_end(r, true);
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
        int slot = redis_reader_take(r, deadline, NULL);
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
        redis_reader_give(r, slot, !ok);
    }
    redis_pipe_restore(&g);
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
    redis_key_name(key, name);
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
    redis_auth_free(t->auth);
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

kv_tier *redis_cluster_open(const redis_url *u, int timeout_ms, redis_auth *auth, kvlm_error *err) {
    cluster_tier *t = calloc(1, sizeof *t);
    if (!t) {
        redis_auth_free(auth);
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
    redis_cond_init_mono(&t->m_cv);
    /* One map now (each seed at most one timeout), so puts route at once; a
     * cluster that is not there is not an error (the mapper keeps asking),
     * but it is said, once. */
    redis_pipe_guard g;
    redis_pipe_block(&g);
    cluster_refresh(t);
    redis_pipe_restore(&g);

    int rc = redis_start_unsignalled(&t->thread, mapper_main, t);
    if (rc != 0) {
        cluster_free(t);
        util_err_set(err, KVLM_ENOMEM, "redis tier: cannot start its slot-map thread (%s)", strerror(rc));
        return NULL;
    }
    t->thread_started = true;
    return &t->base;
}
