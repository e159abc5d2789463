/* kv/paged: the paged KV cache: one pool of fixed-size blocks shared by all
 * sequences, a block table per sequence (shared by all layers), reference
 * counts with copy-on-write, and a prefix index (chained hashes of full
 * blocks) with an LRU of cached blocks that finished sequences left behind. */
#ifndef KVLM_KV_PAGED_H
#define KVLM_KV_PAGED_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kvlm.h"

typedef struct kv_cache kv_cache;

typedef struct {
    int n_layers, n_kv_heads, head_dim;
    int block_size;       /* tokens per block */
    int n_blocks;         /* blocks in the pool */
    int max_seqs;         /* sequence ids are 0..max_seqs-1 */
    int max_seq_tokens;   /* the context: most tokens one sequence may hold */
    uint64_t salt;        /* identifies model + element type in prefix hashes */
    bool prefix_cache;    /* index full blocks for reuse by later sequences */
} kv_params;

kv_cache *kv_create(const kv_params *p, kvlm_error *err);
void kv_free(kv_cache *c);
const kv_params *kv_get_params(const kv_cache *c);

/* Bytes of one block: 2 x layers x KV heads x block_size x head dim x 4. */
size_t kv_block_bytes(const kv_cache *c);
/* Keys of (layer, KV head) in a block: block_size rows of head_dim floats;
 * the values follow at kv_v_offset() floats after the keys. */
float *kv_block_k(const kv_cache *c, int32_t block, int layer, int head);
float *kv_block_v(const kv_cache *c, int32_t block, int layer, int head);

/* ---- sequences ---- */
int kv_seq_len(const kv_cache *c, int seq);
const int32_t *kv_seq_blocks(const kv_cache *c, int seq, int *n_blocks);
const int32_t *kv_seq_tokens(const kv_cache *c, int seq);
bool kv_seq_valid(const kv_cache *c, int seq);

/* Makes room for n_new more tokens after the sequence's current length:
 * allocates blocks and copies a shared partly-filled last block (copy-on-
 * write). KVLM_EFULL if the pool cannot supply the blocks (then nothing
 * changes), KVLM_ERANGE past max_seq_tokens. */
int kv_seq_reserve(kv_cache *c, int seq, int n_new, kvlm_error *err);
/* Undoes reservations beyond the first n_keep token slots (used when a batch
 * fails after some sequences reserved). */
void kv_seq_trim(kv_cache *c, int seq, int n_keep);
/* Records that tokens (n of them) now fill the next slots (their K/V have
 * been written); indexes blocks that became full. */
void kv_seq_commit(kv_cache *c, int seq, const int32_t *tokens, int n);
/* Frees the sequence's blocks (indexed ones stay cached, on the LRU). */
void kv_seq_release(kv_cache *c, int seq);
/* dst (empty or not: it is released first) shares all of src's blocks. */
int kv_seq_fork(kv_cache *c, int src, int dst, kvlm_error *err);
/* For an empty sequence about to take `tokens`: attaches the longest run of
 * indexed full blocks matching them, leaving at least one token to compute.
 * Returns the number of tokens now in the cache (a multiple of block_size). */
int kv_seq_match_prefix(kv_cache *c, int seq, const int32_t *tokens, int n);

typedef struct {
    int n_blocks, used, cached, free;   /* used: referenced; cached: unreferenced but indexed */
    uint64_t hits, misses, evictions;   /* prefix lookups (per block) and index evictions */
    int shared;                         /* blocks referenced by more than one sequence */
} kv_stats;
void kv_get_stats(const kv_cache *c, kv_stats *s);
/* Checks every invariant (reference counts equal table references, lists
 * consistent, index consistent); returns NULL or a description. For tests. */
const char *kv_check(const kv_cache *c);
#endif
