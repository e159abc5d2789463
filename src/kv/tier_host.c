/* kv/tier_host: a tier in this process's memory (like llama.cpp's
 * --cache-ram): serialized blocks under their keys, capped in bytes, least
 * recently used dropped first. Cheaper than recompute and than disk; gone
 * with the process. Thread-safe behind one mutex; puts copy. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "kv/tier.h"
#include "kv/tier_host.h"
#include "util/error.h"
#include "util/timing.h"

typedef struct entry {
    kv_key key;
    uint8_t *data;
    size_t len;
    bool watched;                      /* kv_tier_host_watch's added said so */
    struct entry *hnext, *prev, *next; /* bucket chain; LRU list (head: oldest) */
} entry;

typedef struct {
    kv_tier base;
    pthread_mutex_t mu;
    uint64_t max_bytes;
    entry **buckets;
    size_t n_buckets; /* a power of two */
    entry *head, *tail;
    kv_tier_stats st;
    kv_tier_host_watch watch;
} host_tier;

static size_t bucket_of(const host_tier *h, const kv_key *k) {
    uint64_t v;
    memcpy(&v, k->b, 8);
    return (size_t)(v & (h->n_buckets - 1));
}

static entry *find(host_tier *h, const kv_key *k) {
    for (entry *e = h->buckets[bucket_of(h, k)]; e; e = e->hnext)
        if (!memcmp(e->key.b, k->b, 16)) return e;
    return NULL;
}

static void lru_unlink(host_tier *h, entry *e) {
    if (e->prev) e->prev->next = e->next; else h->head = e->next;
    if (e->next) e->next->prev = e->prev; else h->tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_append(host_tier *h, entry *e) {
    e->prev = h->tail;
    e->next = NULL;
    if (h->tail) h->tail->next = e; else h->head = e;
    h->tail = e;
}

/* told: whether a watched entry's leaving is told (not when overwritten or closing) */
static void remove_entry(host_tier *h, entry *e, bool told) {
    if (told && e->watched && h->watch.removed) h->watch.removed(h->watch.user, &e->key);
    entry **pp = &h->buckets[bucket_of(h, &e->key)];
    while (*pp != e) pp = &(*pp)->hnext;
    *pp = e->hnext;
    lru_unlink(h, e);
    h->st.blocks--;
    h->st.bytes -= e->len;
    free(e->data);
    free(e);
}

static bool host_put(kv_tier *t, const kv_key *key, const void *data, size_t len) {
    host_tier *h = (host_tier *)t;
    uint8_t *copy = len <= h->max_bytes ? malloc(len) : NULL;
    entry *ne = copy ? malloc(sizeof *ne) : NULL;
    pthread_mutex_lock(&h->mu);
    if (!ne) {
        free(copy);
        h->st.dropped_writes++;
        pthread_mutex_unlock(&h->mu);
        return false;
    }
    memcpy(copy, data, len);
    entry *old = find(h, key);
    bool had = old != NULL, watched = had && old->watched;
    if (had) remove_entry(h, old, false);
    while (h->head && h->st.bytes + len > h->max_bytes) {
        remove_entry(h, h->head, true);
        h->st.evicted++;
    }
    ne->key = *key;
    ne->data = copy;
    ne->len = len;
    ne->watched = had ? watched : h->watch.added && h->watch.added(h->watch.user, key);
    size_t b = bucket_of(h, key);
    ne->hnext = h->buckets[b];
    h->buckets[b] = ne;
    lru_append(h, ne);
    h->st.blocks++;
    h->st.bytes += len;
    h->st.writes++;
    h->st.write_bytes += len;
    pthread_mutex_unlock(&h->mu);
    return true;
}

static int host_get(kv_tier *t, int n, const kv_key *keys, void *const *bufs, size_t cap, size_t *lens) {
    host_tier *h = (host_tier *)t;
    double t0 = util_now_s();
    int lead = 0;
    bool broken = false;
    pthread_mutex_lock(&h->mu);
    for (int i = 0; i < n; i++) {
        entry *e = find(h, &keys[i]);
        lens[i] = 0;
        if (e && e->len <= cap) {
            memcpy(bufs[i], e->data, e->len);
            lens[i] = e->len;
            lru_unlink(h, e);
            lru_append(h, e);
            h->st.hits++;
            if (!broken) lead++;
        } else {
            h->st.misses++;
            broken = true;
        }
    }
    h->st.reads++;
    h->st.read_seconds += util_now_s() - t0;
    pthread_mutex_unlock(&h->mu);
    return lead;
}

static int host_contains(kv_tier *t, int n, const kv_key *keys) {
    host_tier *h = (host_tier *)t;
    int i = 0;
    pthread_mutex_lock(&h->mu);
    while (i < n && find(h, &keys[i])) i++;
    pthread_mutex_unlock(&h->mu);
    return i;
}

static void host_drop(kv_tier *t, const kv_key *key) {
    host_tier *h = (host_tier *)t;
    pthread_mutex_lock(&h->mu);
    entry *e = find(h, key);
    if (e) remove_entry(h, e, true);
    pthread_mutex_unlock(&h->mu);
}

static void host_flush(kv_tier *t) { (void)t; } /* puts are done when they return */

static void host_stats(kv_tier *t, kv_tier_stats *out) {
    host_tier *h = (host_tier *)t;
    pthread_mutex_lock(&h->mu);
    *out = h->st;
    pthread_mutex_unlock(&h->mu);
}

static void host_close(kv_tier *t) {
    host_tier *h = (host_tier *)t;
    while (h->head) remove_entry(h, h->head, false);
    pthread_mutex_destroy(&h->mu);
    free(h->buckets);
    free(h);
}

static const kv_tier_ops k_host_ops = {"host", host_put, host_get, host_contains, host_drop,
                                       host_flush, host_stats, host_close};

bool kv_tier_is_host(const kv_tier *t) { return t && t->ops == &k_host_ops; }

void kv_tier_host_set_watch(kv_tier *t, const kv_tier_host_watch *w) {
    host_tier *h = (host_tier *)t;
    pthread_mutex_lock(&h->mu);
    if (w) h->watch = *w;
    else memset(&h->watch, 0, sizeof h->watch);
    if (!w) /* what a later watch is told starts afresh */
        for (entry *e = h->head; e; e = e->next) e->watched = false;
    pthread_mutex_unlock(&h->mu);
}

int kv_tier_host_watched(kv_tier *t, kv_key *keys, int cap) {
    host_tier *h = (host_tier *)t;
    int n = 0;
    pthread_mutex_lock(&h->mu);
    for (entry *e = h->head; e; e = e->next)
        if (e->watched) {
            if (n < cap) keys[n] = e->key;
            n++;
        }
    pthread_mutex_unlock(&h->mu);
    return n;
}

kv_tier *kv_tier_host_open(uint64_t max_bytes, kvlm_error *err) {
    if (max_bytes == 0) {
        util_err_set(err, KVLM_EINVAL, "a host-memory KV tier needs a size above 0 bytes");
        return NULL;
    }
    host_tier *h = calloc(1, sizeof *h);
    if (h) {
        h->n_buckets = 1024;
        h->buckets = calloc(h->n_buckets, sizeof *h->buckets);
    }
    if (!h || !h->buckets) {
        free(h);
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        return NULL;
    }
    h->base.ops = &k_host_ops;
    h->max_bytes = max_bytes;
    h->st.up = true;
    pthread_mutex_init(&h->mu, NULL);
    return &h->base;
}
