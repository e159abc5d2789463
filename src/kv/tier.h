/* kv/tier: a colder store of whole KV blocks below the block pool (local
 * disk, a shared Redis server, pinned host memory under a GPU): put / get /
 * contains / drop of a block's serialized bytes under its 16-byte key.
 *
 * A tier moves opaque bytes; it never interprets them. The bytes are a block
 * in kv/blockfmt's format (header with format version, key, element types,
 * token count and payload length; the payload in the cache's element types; a
 * checksum of both, or a signature under the deployment's key), and whoever
 * reads a block back checks it there: a tier that returns damaged bytes costs
 * a recompute, never a wrong answer (kv_tier_drop it and count it with
 * kv_tier_note_corrupt). A checksum guards against accidents only: whoever
 * can write the tier can recompute it, and without a key decides what the
 * readers compute with; signed blocks (--kv-key) guard against that too.
 *
 * Every call is safe from any thread and bounded in time: put never waits
 * for I/O (it copies the bytes into a bounded queue, or drops them and counts
 * a dropped write); get and contains give up after the tier's timeout and
 * answer "miss". A tier that is down, slow or full makes misses, never a
 * failed or stuck request. */
#ifndef KVLM_KV_TIER_H
#define KVLM_KV_TIER_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kvlm.h"

/* A block's key (kv/blockfmt.h computes it): 16 bytes, the same in every
 * process and on every machine. Tiers name blocks by its 32 lower-case hex
 * digits (kv_key_hex). */
typedef struct {
    uint8_t b[16];
} kv_key;
#define KV_KEY_HEX 33 /* 32 digits and a NUL */
void kv_key_hex(const kv_key *k, char out[KV_KEY_HEX]);
/* Parses 32 hex digits; false if s is not exactly that. */
bool kv_key_parse(const char *s, kv_key *k);

typedef struct {
    uint64_t blocks, bytes;        /* held now, as far as this process knows */
    uint64_t hits, misses;         /* blocks asked for by get */
    uint64_t writes, write_bytes;  /* puts written */
    uint64_t dropped_writes;       /* puts dropped: queue full, tier down or over its size */
    uint64_t corrupt;              /* blocks found damaged by their reader (kv_tier_note_corrupt), or by the tier */
    uint64_t forged;               /* blocks whose signature failed (kv_tier_note_forged; signed deployments) */
    uint64_t errors;               /* I/O or connection errors */
    uint64_t reads;                /* get calls */
    double read_seconds;           /* their summed latency */
    uint64_t evicted;              /* blocks the tier removed to stay under its size */
    bool up;                       /* reachable (Redis: connected) */
} kv_tier_stats;

typedef struct kv_tier kv_tier;
typedef struct {
    const char *name; /* "disk", "redis", "host" */
    /* Queues len bytes under key (copied before returning). false: dropped
     * and counted. A key already present may be overwritten or kept. */
    bool (*put)(kv_tier *t, const kv_key *key, const void *data, size_t len);
    /* Reads n blocks in one go (one round trip where the tier has round
     * trips): lens[i] gets the bytes written to bufs[i] (at most cap each),
     * 0 for a miss or a block longer than cap. Returns how many of the
     * leading keys were all found (the caller wants an unbroken prefix). */
    int (*get)(kv_tier *t, int n, const kv_key *keys, void *const *bufs, size_t cap, size_t *lens);
    /* How many of the leading keys are present (no side effects, no stats). */
    int (*contains)(kv_tier *t, int n, const kv_key *keys);
    void (*drop)(kv_tier *t, const kv_key *key);
    /* Waits until every queued put is written or dropped (a clean stop). */
    void (*flush)(kv_tier *t);
    void (*stats)(kv_tier *t, kv_tier_stats *out);
    void (*close)(kv_tier *t); /* flushes, stops threads, frees */
} kv_tier_ops;

/* What a tier counts, from any thread (the tier updates its own;
 * kv_tier_stats_get reads them before the tier's stats op adds the rest). */
typedef struct {
    _Atomic uint64_t hits, misses, writes, write_bytes, dropped, errors, reads, read_ns, evicted;
    _Atomic bool up;
} kv_tier_counters;
/* Implementations put this first in their own struct. */
struct kv_tier {
    const kv_tier_ops *ops;
    _Atomic uint64_t corrupt, forged;
    kv_tier_counters n;
};

static inline bool kv_tier_put(kv_tier *t, const kv_key *k, const void *d, size_t n) { return t->ops->put(t, k, d, n); }
static inline int kv_tier_get(kv_tier *t, int n, const kv_key *k, void *const *b, size_t cap, size_t *lens) {
    return t->ops->get(t, n, k, b, cap, lens);
}
static inline int kv_tier_contains(kv_tier *t, int n, const kv_key *k) { return t->ops->contains(t, n, k); }
static inline void kv_tier_drop(kv_tier *t, const kv_key *k) { t->ops->drop(t, k); }
static inline void kv_tier_flush(kv_tier *t) { t->ops->flush(t); }
static inline void kv_tier_close(kv_tier *t) {
    if (t) t->ops->close(t);
}
/* Fills out: t's counters, then its stats op, then corrupt from the readers' notes. */
void kv_tier_stats_get(kv_tier *t, kv_tier_stats *out);
/* A reader found a block of this tier damaged: counts it (the reader also drops it). */
void kv_tier_note_corrupt(kv_tier *t);
/* ... or forged: of the right shape, but its signature fails (kv/blockfmt.h). */
void kv_tier_note_forged(kv_tier *t);
/* A get of `found` blocks of n asked for, begun at t0 (util_now_s): counts
 * the read, its hits and misses, and its time. */
void kv_tier_note_read(kv_tier *t, int found, int n, double t0);

/* Local disk: one file per block under dir (created if missing), written by
 * a writer thread with a bounded queue to a temporary name then renamed, so
 * a block is visible only once whole; size-capped (max_bytes) with an LRU of
 * its own, rebuilt from the directory at open; several processes may share
 * dir. */
kv_tier *kv_tier_disk_open(const char *dir, uint64_t max_bytes, kvlm_error *err);
/* Redis: url "redis://HOST:PORT[/DB]" (one server; "?proxy=1": a twemproxy
 * in front), or "redis-cluster://HOST:PORT[,HOST:PORT...]" (a Redis Cluster:
 * seed nodes, the rest discovered; blocks spread over the masters by slot);
 * a writer thread per server pipelines puts; reads are bounded by timeout_ms
 * (0: 200) as a whole; reconnects on its own. Redis evicts (maxmemory +
 * allkeys-lru). */
kv_tier *kv_tier_redis_open(const char *url, int timeout_ms, kvlm_error *err);
#endif
