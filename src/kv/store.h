/* kv/store: the one facade the engine and the scheduler use for the KV cache
 * (vLLM's KVCacheManager): sequences' slots (reserve / commit / fork /
 * release / compact), writing a layer's key and value rows, the view that
 * fills attention's arguments and a side-effect-free admission probe. Block numbers, regions and staging stay behind it (kv/paged
 * is the block pool, block tables and prefix index underneath). */
#ifndef KVLM_KV_STORE_H
#define KVLM_KV_STORE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kv/paged.h"
#include "kv/tier.h"
#include "kvlm.h"
#include "ops/ops.h"

typedef struct kv_store kv_store;

#define KV_STORE_MAX_TIERS 4

/* How the store uses a tier. */
enum {
    KV_TIER_DEMOTE = 1,    /* cached blocks about to be dropped from RAM are put there (host, disk) */
    KV_TIER_THROUGH = 2,   /* full blocks are put there as they are committed (redis: other processes) */
    KV_TIER_DURABLE = 4,   /* survives the process: kv_store_persist writes what it lacks (disk) */
};

typedef struct kv_store_params {
    kv_params pool;
    /* Colder tiers in the order they are asked (host, disk, redis); the store
     * owns them (closes them in kv_store_free). */
    kv_tier *tiers[KV_STORE_MAX_TIERS];
    int roles[KV_STORE_MAX_TIERS]; /* KV_TIER_* bits */
    int n_tiers;
    /* Bytes of the swap space (kv_store_swap_out): preempted sequences' blocks
     * in host memory outside the pool, allocated at the first swap; 0: none. */
    size_t swap_bytes;
    /* Sliding-window attention (docs/sliding-window.md). window > 0: this
     * store's layers see only the last `window` keys, so blocks wholly before
     * every future query's window are released as sequences grow (the null
     * block takes their place); window_slack: the most tokens one step adds
     * to a sequence (the engine's batch), for the blocks a sequence holds at
     * most. local (NULL: none): a second store for the layers with a window
     * when others have none (gemma); layer_local then says, per model layer
     * (pool.n_layers of this store plus local->pool.n_layers), which store
     * holds it. The local store is sized so it never refuses what the global
     * one admitted: admission counts this store's blocks. */
    int window, window_slack;
    const struct kv_store_params *local;
    const uint8_t *layer_local;
    /* The deployment's block-signing key (kv/blockfmt.h), or NULL: every
     * block this store (and its local store) writes to a tier or a session
     * is signed with it and every block read back is verified. The store owns
     * it (frees it, also on failure); pool.auth and local's are set from it. */
    kv_blockauth *auth;
} kv_store_params;

/* On failure the tiers in p are closed (and its auth freed) too. */
kv_store *kv_store_create(const kv_store_params *p, kvlm_error *err);
/* Persists (kv_store_persist), closes the tiers, frees. */

void kv_store_free(kv_store *s);
const kv_params *kv_store_params_of(const kv_store *s);

/* ---- sequences (the engine) ---- */
/* As kv/paged's kv_add_guest: sequences first_seq.. (empty) hold blocks of
 * another cache shape or other types (a draft model's) in this pool;
 * *block_size gets their tokens per block. Guest sequences write their rows
 * (kv_store_write_row) with the guest's layers, heads, head dimension and
 * types; their blocks go to the tiers in the guest's stored form
 * (kv_block_blockfmt), never to the swap space or compaction. They keep
 * all their blocks in a store with a window (their model's windows, if
 * any, are its attention's), and all their layers in this store when a
 * local layers' one is beside it. */
int kv_store_add_guest(kv_store *s, int first_seq, const kv_guest *g, const kv_key *model, int *block_size,
                       kvlm_error *err);
/* As kv_drop_guest: the guest's sequences, now empty, hold the pool's layout
 * again; its cached blocks first go to the durable tiers that lack them. */
int kv_store_drop_guest(kv_store *s, kvlm_error *err);
/* Tokens per block of the sequence's layout. */
int kv_store_seq_block_size(const kv_store *s, int seq);
bool kv_store_seq_valid(const kv_store *s, int seq);
/* As kv/paged's kv_seq_set_root: the sequence's block keys are rooted at
 * root (a second model's sequences in this store). */
void kv_store_set_root(kv_store *s, int seq, const kv_key *root);
int kv_store_seq_len(const kv_store *s, int seq);
const int32_t *kv_store_seq_tokens(const kv_store *s, int seq);
/* As kv/paged's kv_seq_reserve / trim / commit / release / fork. */
int kv_store_reserve(kv_store *s, int seq, int n_new, kvlm_error *err);
void kv_store_trim(kv_store *s, int seq, int n_keep);
void kv_store_commit(kv_store *s, int seq, const int32_t *tokens, int n);
void kv_store_release(kv_store *s, int seq);
/* Speculative decoding (kv_seq_hold / unhold): tokens from position `from`
 * on are unverified until kv_store_rollback keeps the first n_keep tokens
 * (n_keep >= from), takes the rest back and indexes what was held. q4_kc
 * keys: only while the staging still holds the block n_keep falls in (no
 * token past that block's end was written), else KVLM_EUNSUPPORTED. */
void kv_store_hold(kv_store *s, int seq, int from);
int kv_store_rollback(kv_store *s, int seq, int n_keep, kvlm_error *err);
int kv_store_fork(kv_store *s, int src, int dst, kvlm_error *err);
/* For an empty sequence about to take `tokens`: attaches the longest run of
 * cached full blocks matching them, from RAM and then from the tiers
 * (promoted: one batched get per tier, each block checked against its key,
 * model, types, geometry, tokens and checksum, then written into a fresh
 * block; a damaged one is counted, logged once, dropped from its tier and
 * recomputed), leaving at least one token to compute. Returns the tokens now cached. */
int kv_store_match_prefix(kv_store *s, int seq, const int32_t *tokens, int n);
/* Keeps tokens keep[0..n_keep-1] (kv_seq_compact), then points the q4_kc
 * staging at the new last block. */
int kv_store_compact(kv_store *s, int seq, const int32_t *keep, int n_keep, kv_rekey_fn rekey, void *user,
                     kvlm_error *err);

/* Writes one token's key and value rows of one KV head (head_dim floats each;
 * a latent cache, kv_params.v_in_k, writes only the key row and v may be NULL)
 * into slot pos of the sequence for this layer, quantized to the cache's
 * types. q4_kc keys go to the sequence's f16 staging and the block is
 * quantized per channel when its last slot fills, so one sequence's tokens
 * must be written in position order by one thread. Slots must be reserved. */
void kv_store_write_row(kv_store *s, int layer, int seq, int pos, int head, const float *k, const float *v);
/* After tokens (seq[t], pos[t]) of a chunk were written for every layer:
 * remembers which block of each sequence still has its keys in staging. */
void kv_store_rows_written(kv_store *s, const int32_t *seq, const int32_t *pos, int T);
/* Fills a's cache fields (blocks, block_size, types, head_bytes, v_bytes,
 * k_stage, stage_block) for queries of the sequence up to position last_pos;
 * block_ptrs receives last_pos / block_size + 1 pointers. The caller fills
 * the query fields (T, q_pos0, heads, scale, weights). */
void kv_store_attn_view(const kv_store *s, int layer, int seq, int last_pos, const float **block_ptrs,
                        op_attn_args *a);

/* ---- admission (the scheduler) ---- */
typedef struct {
    int ram_tokens;          /* prompt tokens found in RAM blocks */
    int tier_tokens[KV_STORE_MAX_TIERS]; /* then found in each tier, in order (contains: not yet checked) */
    int cached_tokens;       /* all of them: what match_prefix would attach */
    int blocks_needed;       /* blocks to allocate to hold n_hold tokens after the match */
    int blocks_available;    /* free + cached blocks, less the cached ones the match would take */
} kv_store_probe;
/* What kv_store_match_prefix(tokens, n_lookup) would find for an empty
 * sequence and what holding n_hold tokens would then cost: no side effects
 * (no statistics, no LRU order; tiers are asked with contains only). */
void kv_store_probe_prefix(const kv_store *s, const int32_t *tokens, int n_lookup, int n_hold, kv_store_probe *out);
/* Blocks the sequence still needs to hold n_hold tokens (0 if it has them). */
int kv_store_seq_blocks_needed(const kv_store *s, int seq, int n_hold);
/* Blocks the sequence holds, and how many of them other sequences share. */
void kv_store_seq_info(const kv_store *s, int seq, int *n_blocks, int *n_shared);

/* ---- swap (preemption without recompute) ---- */
/* A sequence swapped out: its blocks' bytes in the swap space, its tokens,
 * keys, whether it compacted, and q4_kc's staging of its filling block. */
typedef struct kv_swap kv_swap;
/* Bytes swapping the sequence out moves (its blocks, plus its staging). */
size_t kv_store_swap_bytes(const kv_store *s, int seq);
/* Whether the swap space has room for the sequence now. */
bool kv_store_swap_fits(const kv_store *s, int seq);
/* Copies every block of the sequence (kv_block_read: any storage) to the
 * swap space and releases the sequence (blocks other sequences share stay
 * theirs); when the swap space is full, to the first durable (disk) tier, as
 * stored blocks under fresh keys. KVLM_EFULL when neither takes it (nothing
 * changes). */
int kv_store_swap_out(kv_store *s, int seq, kv_swap **out, kvlm_error *err);
/* For an empty sequence: fresh blocks written back from the handle, which
 * is then freed. KVLM_EFULL when the pool lacks the blocks (the handle
 * stays); KVLM_EIO when a block in the tier was lost or damaged (counted;
 * the handle is freed: the sequence must be recomputed). */
int kv_store_swap_in(kv_store *s, int seq, kv_swap *h, kvlm_error *err);
/* Frees a handle that will not be swapped in (its request ended). */
void kv_store_swap_drop(kv_store *s, kv_swap *h);
/* Blocks swapping in takes, and the tokens it brings back. */
int kv_swap_blocks(const kv_swap *h);
int kv_swap_tokens(const kv_swap *h);
/* Bytes per second of a round trip of block bytes through the storage
 * (kv_block_read then kv_block_write), measured once, at the first call,
 * over up to 8 MiB of the pool's blocks. */
double kv_store_copy_rate(kv_store *s);
typedef struct {
    uint64_t slots, slots_used;     /* the swap space, in blocks */
    uint64_t swaps_out, swaps_in, bytes_out, bytes_in;
    uint64_t disk_swaps_out, disk_swaps_in, disk_blocks_used; /* through the swap tier */
    uint64_t disk_lost;             /* swap-ins that found a block there missing or damaged */
} kv_store_swap_stats;
void kv_store_swap_stats_get(const kv_store *s, kv_store_swap_stats *st);

/* ---- sizes and statistics ---- */
size_t kv_store_block_bytes(const kv_store *s);
size_t kv_store_token_bytes(const kv_store *s);
size_t kv_store_stage_bytes(const kv_store *s);
void kv_store_stats(const kv_store *s, kv_stats *st);
typedef struct {
    const char *name;
    kv_tier_stats st;
    uint64_t promoted, demoted, written_through, persisted; /* blocks this store moved */
} kv_store_tier_stats;
/* Per tier, in order; returns the number of tiers (at most cap written). */
int kv_store_tier_stats_get(const kv_store *s, kv_store_tier_stats *out, int cap);
/* Writes every indexed block that a durable tier lacks there, then flushes
 * every tier (a clean stop: a restart finds what was cached). */
void kv_store_persist(kv_store *s);
/* For a device backend whose kernels address the blocks themselves (the
 * CUDA forward pass): the sequence's block table, and where block b's
 * (layer, KV head) K region is: base + b * block_bytes + (layer * n_kv_heads
 * + head) * head_bytes, its V region v_offset after it. */
const int32_t *kv_store_seq_table(const kv_store *s, int seq, int *n_blocks);
void kv_store_layout(const kv_store *s, uint8_t **base, size_t *block_bytes, size_t *head_bytes, size_t *v_offset);
/* KV events: the pool's prefix index as it changes (kv/paged's
 * kv_set_index_listener; fn NULL: none), and the blocks it holds now. */
void kv_store_set_index_listener(kv_store *s, kv_index_fn fn, void *user);
int kv_store_indexed_blocks(const kv_store *s, int32_t *out, int cap);
/* KV events for the host tier (the one tier this process alone fills and
 * empties, so its events are exact): fn(user, KV_INDEX_ADDED, key, parent,
 * tokens, n_tokens) when a pool block's contents enter it, fn(user,
 * KV_INDEX_REMOVED, key, NULL, NULL, 0) when they leave (pushed out by its
 * size, or dropped as damaged). Called on the thread that writes to the tier
 * (the engine's). Swapped sequences' blocks are not told. fn NULL: none. */
typedef void (*kv_tier_event_fn)(void *user, int what, const kv_key *key, const kv_key *parent,
                                 const int32_t *tokens, int n_tokens);
void kv_store_set_tier_listener(kv_store *s, kv_tier_event_fn fn, void *user);
/* The keys the host tier holds that were told (at most cap written); returns
 * how many (0 without a host tier). */
int kv_store_tier_blocks(kv_store *s, kv_key *out, int cap);
/* The pool underneath, for tests and kv_check. */
kv_cache *kv_store_pool(kv_store *s);
/* The local layers' store (kv_store_params.local), or NULL. */
kv_store *kv_store_local(kv_store *s);
/* The most blocks a sequence of n tokens holds in this store (fewer than
 * n / block_size under a sliding window). */
int kv_store_blocks_held(const kv_store *s, int n);
/* Blocks of both stores held by sequences now, and the bytes they take. */
size_t kv_store_held_bytes(const kv_store *s);
#endif
