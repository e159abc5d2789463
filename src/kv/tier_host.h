/* kv/tier_host: a KV tier in this process's memory, capped in bytes with an
 * LRU (the store's first tier: cheaper than disk; for tests too). */
#ifndef KVLM_KV_TIER_HOST_H
#define KVLM_KV_TIER_HOST_H
#include <stdbool.h>
#include <stdint.h>
#include "kv/tier.h"

kv_tier *kv_tier_host_open(uint64_t max_bytes, kvlm_error *err);
/* Whether t is a host tier. */
bool kv_tier_is_host(const kv_tier *t);

/* Watching what a host tier holds (KV events for it: the tier is this
 * process's alone, so it can tell exactly). added is called when a put stores
 * a key the tier did not hold; its true answer makes the entry watched, and
 * removed is called when a watched entry leaves (pushed out by a put, or
 * dropped; not when the tier closes, nor when a put overwrites it). Both run
 * under the tier's lock on the thread that called put or drop, so they must
 * not call the tier. A NULL w stops the watch. */
typedef struct {
    bool (*added)(void *user, const kv_key *key);
    void (*removed)(void *user, const kv_key *key);
    void *user;
} kv_tier_host_watch;
void kv_tier_host_set_watch(kv_tier *t, const kv_tier_host_watch *w);
/* The watched entries' keys, least recently used first: returns how many
 * there are (at most cap written). */
int kv_tier_host_watched(kv_tier *t, kv_key *keys, int cap);
#endif
