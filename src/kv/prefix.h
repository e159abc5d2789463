/* kv/prefix: the prefix index and the LRU of cached blocks, by block number:
 * full blocks under their chained keys (kv/blockfmt.h), each with its parent
 * key and its tokens for exact matches, and the least-recently-used order of
 * the indexed blocks no sequence holds (the pool reuses the head first, after
 * its demote hook). Knows nothing of block bytes or reference counts: the
 * pool (kv/paged) says when a block becomes cached or held again. */
#ifndef KVLM_KV_PREFIX_H
#define KVLM_KV_PREFIX_H
#include <stdbool.h>
#include <stdint.h>
#include "kv/tier.h"

typedef struct kv_prefix kv_prefix;

kv_prefix *kv_prefix_create(int n_blocks, int block_size);
void kv_prefix_free(kv_prefix *x);

/* The indexed block with this key, parent key and exactly these tokens, or -1. */
int32_t kv_prefix_find(const kv_prefix *x, const kv_key *key, const kv_key *parent, const int32_t *tokens);
void kv_prefix_insert(kv_prefix *x, int32_t b, const kv_key *key, const kv_key *parent, const int32_t *tokens);
/* Takes b out of the index (and off the LRU if it is there). */
void kv_prefix_remove(kv_prefix *x, int32_t b);
bool kv_prefix_indexed(const kv_prefix *x, int32_t b);
const kv_key *kv_prefix_key(const kv_prefix *x, int32_t b);
const kv_key *kv_prefix_parent(const kv_prefix *x, int32_t b); /* all zero: a first block */
const int32_t *kv_prefix_tokens(const kv_prefix *x, int32_t b);

/* The LRU of cached (indexed, unheld) blocks: pushed at the tail when the
 * last holder lets go, taken off when held again or reused. */
void kv_prefix_lru_push(kv_prefix *x, int32_t b);
void kv_prefix_lru_remove(kv_prefix *x, int32_t b);
int32_t kv_prefix_lru_head(const kv_prefix *x); /* -1: empty */
int32_t kv_prefix_lru_next(const kv_prefix *x, int32_t b);
int kv_prefix_cached(const kv_prefix *x);

/* Checks the index's and the LRU's own consistency; NULL or a description. */
const char *kv_prefix_check(const kv_prefix *x, char *msg, size_t cap);
#endif
