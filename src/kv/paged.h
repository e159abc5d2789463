/* kv/paged: the paged KV cache: one pool of fixed-size blocks shared by all
 * sequences, a block table per sequence (shared by all layers), reference
 * counts with copy-on-write, a prefix index (chained keys of full blocks,
 * kv/blockfmt.h: the same keys the tiers use; kept by kv/prefix)
 * with an LRU of cached blocks that finished sequences left behind, and the
 * byte layout of keys and values of any element type (ops/kvtype.h). A
 * second layout, the guest's (kv_add_guest), lets a smaller draft model's
 * sequences keep their cache in the same blocks. */
#ifndef KVLM_KV_PAGED_H
#define KVLM_KV_PAGED_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kv/blockfmt.h"
#include "kvlm.h"

typedef struct kv_cache kv_cache;

/* Where the pool's block bytes live: host memory (NULL in kv_params: the
 * default), or a device's memory (ops/cuda). The pool keeps its metadata on
 * the host and touches block bytes only through this table; kv_block_k/v
 * then return addresses in that memory, for kernels of the same device. */
typedef struct {
    const char *name;                                   /* "host", "cuda" */
    void *(*alloc)(void *user, size_t bytes);           /* zeroed; NULL on failure */
    void (*free)(void *user, void *p, size_t bytes);
    void (*copy)(void *user, void *dst, const void *src, size_t n);       /* within the storage */
    void (*read)(void *user, void *host_dst, const void *src, size_t n);  /* storage -> host */
    /* host -> storage: host_src may be reused at once; the bytes may land
     * later, but before anything on the storage's device reads the block
     * (the CUDA storage stages them and copies on a stream of its own) */
    void (*write)(void *user, void *dst, const void *host_src, size_t n);
    bool host_addressable;                              /* the CPU may dereference block addresses */
    void *user;
} kv_storage;
extern const kv_storage kv_storage_host;

/* kv_params.layer_group: all the model's layers, or its global ones when
 * the local (sliding-window) layers have a pool of their own. */
enum { KV_LAYER_GROUP_ALL = 0, KV_LAYER_GROUP_LOCAL = 1 };

typedef struct {
    int n_layers, n_kv_heads, head_dim;
    int block_size;       /* tokens per block */
    int n_blocks;         /* blocks in the pool */
    int max_seqs;         /* sequence ids are 0..max_seqs-1 */
    int max_seq_tokens;   /* the context: most tokens one sequence may hold */
    uint64_t salt;        /* tests: names the model in block keys when `model` is all zero */
    bool prefix_cache;    /* index full blocks for reuse by later sequences */
    int k_type, v_type;   /* element types (KVLM_CACHE_*; 0 = f32) */
    const kv_storage *storage; /* NULL: host memory */
    kv_key model;         /* the model's fingerprint (kv/blockfmt.h), part of every block key */
    /* Multi-head latent attention (docs/mla.md): a token's value is the first
     * elements of its key row, so blocks have no V regions (kv_block_v is
     * kv_block_k, v_type must equal k_type, a per-token type). */
    bool v_in_k;
    const kv_blockauth *auth; /* stored blocks are signed with this key (kv/blockfmt.h); NULL: checksummed only */
    /* Which of the model's layers the pool holds (KV_LAYER_GROUP_*), part of
     * every block key but group 0's: two pools of one model (gemma's global
     * and local layers) never give the same tokens' blocks one key. */
    int layer_group;
} kv_params;

kv_cache *kv_create(const kv_params *p, kvlm_error *err);
void kv_free(kv_cache *c);
const kv_params *kv_get_params(const kv_cache *c);
/* What this pool's block keys and stored blocks depend on. */
const kv_blockfmt *kv_get_blockfmt(const kv_cache *c);
/* The same for a sequence's blocks and for block b: the pool's, or the
 * guest layout's (kv_add_guest) for a guest sequence or a block in its layout. */
const kv_blockfmt *kv_seq_blockfmt(const kv_cache *c, int seq);
const kv_blockfmt *kv_block_blockfmt(const kv_cache *c, int32_t b);

/* A block holds, for each (layer, KV head) in turn, [K region][V region],
 * each op_kv_region_bytes(type, head_dim, block_size) bytes: for per-token
 * types block_size rows of op_kv_row_bytes; for q4_kc keys the per-channel
 * block; each region is padded to a multiple of 4 bytes (no padding when
 * block_size is a multiple of 4 and head_dim even). Bytes of one block: layers x KV heads x (K + V region). */
size_t kv_block_bytes(const kv_cache *c);
/* The same, from the parameters alone (for sizing a pool before creating it). */
size_t kv_params_block_bytes(const kv_params *p);
/* Bytes from one (layer, head)'s K region to the next, and K to V. */
size_t kv_head_bytes(const kv_cache *c);
size_t kv_v_offset_bytes(const kv_cache *c);
/* Bytes of K and V of one token (block bytes / block size; exact for
 * per-token types, and for q4_kc when block_size divides 4 x head_dim). */
size_t kv_token_bytes(const kv_cache *c);
/* A guest layout's cache: its shape and element types (per-token types:
 * not q4_kc). */
typedef struct kv_guest {
    int n_layers, n_kv_heads, head_dim;
    int k_type, v_type;
} kv_guest;
/* A second block layout in the same pool: a draft model of another cache
 * shape or other element types (engine/forward's kvlm_ctx_create_draft)
 * keeps its cache in the pool's blocks. From now on sequences first_seq..
 * (which must be empty) hold blocks of g's shape and types, laid out as the
 * pool's, in the pool's block bytes; *block_size receives their tokens per
 * block (kv_guest_block_size: stories260K in a stories4M_hd64 pool of
 * 16-token f16 blocks, 64; the other way round, 3). Their keys
 * are the guest's (its own format, under model), in a prefix index of their
 * own; a cached guest block is reused before a cached one of the pool's.
 * Guest blocks reach the tier hooks as the pool's do, stored in the guest's
 * format (kv_block_blockfmt: its geometry, the bytes it uses of a block).
 * Guest sequences neither swap nor compact nor fork to the pool's, and
 * keep no q4_kc staging (a pool of q4_kc keys takes a guest of per-token
 * types). Not in a latent cache. */
int kv_add_guest(kv_cache *c, int first_seq, const kv_guest *g, const kv_key *model, int *block_size,
                 kvlm_error *err);
/* The guest's tokens per block in a pool of p: the most whole multiples of
 * p's block size (up to its context, rounded up to one) whose bytes fit in
 * one of p's blocks; when not even one does (a cache larger per token than
 * p's), the most tokens below p's block size that fit; 0 when not one. */
int kv_guest_block_size(const kv_params *p, const kv_guest *g);
/* Takes the guest layout back (its sequences must be empty): its cached
 * blocks go back to the free stack, its sequences hold the pool's layout. */
int kv_drop_guest(kv_cache *c, kvlm_error *err);
/* A sequence's tokens per block, and (layer, KV head) stride and K-to-V
 * offset in its blocks (the pool's, or the guest's for guest sequences). */
int kv_seq_block_size(const kv_cache *c, int seq);
size_t kv_seq_head_bytes(const kv_cache *c, int seq);
size_t kv_seq_v_offset_bytes(const kv_cache *c, int seq);
/* Tokens in block b (the block size of the layout its bytes are in), and
 * whether that layout is the guest's. */
int kv_block_size_of(const kv_cache *c, int32_t b);
bool kv_block_guest(const kv_cache *c, int32_t b);
/* K (V) region of (layer, KV head) in a block (in its layout). */
uint8_t *kv_block_k(const kv_cache *c, int32_t block, int layer, int head);
uint8_t *kv_block_v(const kv_cache *c, int32_t block, int layer, int head);
/* q4_kc keys only (NULL otherwise): the f16 keys of the sequence's block that
 * is still filling, block_size rows of head_dim for (layer, KV head). Kept per
 * sequence rather than in every block: only one block per sequence is ever
 * partial, so this costs layers x KV heads x block_size x head_dim x 2 bytes
 * per sequence instead of doubling every block. Forks copy it. */
uint16_t *kv_seq_stage(const kv_cache *c, int seq, int layer, int head);
/* Bytes of the staging of all sequences (0 unless keys are q4_kc). */
size_t kv_stage_bytes(const kv_cache *c);

/* ---- sequences ---- */
int kv_seq_len(const kv_cache *c, int seq);
const int32_t *kv_seq_blocks(const kv_cache *c, int seq, int *n_blocks);
const int32_t *kv_seq_tokens(const kv_cache *c, int seq);
bool kv_seq_valid(const kv_cache *c, int seq);
/* The parent of the sequence's first block key (default zeros, as a NULL
 * parent): a second model whose sequences share this pool (a draft model,
 * engine/forward's kvlm_ctx_create_draft) roots its keys at its own
 * fingerprint, so its blocks and the pool model's never match one another in
 * the prefix index or the tiers. Kept across kv_seq_release. The
 * sequence-less probes (kv_prefix_probe, kv_prefix_probe_window) look up
 * zero-rooted keys. */
void kv_seq_set_root(kv_cache *c, int seq, const kv_key *root);
const kv_key *kv_seq_root(const kv_cache *c, int seq);

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
/* Speculative decoding: while held, blocks that reach past position `from`
 * are neither keyed nor indexed as they fill (their tokens are unverified:
 * no prefix-index entry, no tier write-through, no demotion); unhold, after
 * kv_seq_trim took the rejected tokens back, indexes the full blocks then
 * held. A partial block left indexed by a trim is copied before it is
 * written to (kv_seq_reserve). */
void kv_seq_hold(kv_cache *c, int seq, int from);
void kv_seq_unhold(kv_cache *c, int seq);
bool kv_seq_held(const kv_cache *c, int seq, int *from);
/* dst (empty or not: it is released first) shares all of src's blocks. */
int kv_seq_fork(kv_cache *c, int src, int dst, kvlm_error *err);
/* For an empty sequence about to take `tokens`: attaches the longest run of
 * indexed full blocks matching them, leaving at least one token to compute.
 * Returns the number of tokens now in the cache (a multiple of block_size). */
int kv_seq_match_prefix(kv_cache *c, int seq, const int32_t *tokens, int n);
/* What kv_seq_match_prefix would attach, without attaching or counting:
 * the matching full blocks, and (unreferenced) how many of them sit on the
 * LRU (attaching takes them off it); last (may be NULL): the last one's key. */
int kv_prefix_probe(const kv_cache *c, const int32_t *tokens, int n, int *unreferenced, kv_key *last);
/* Free blocks plus cached ones: what reservations may still take. */
int kv_available_blocks(const kv_cache *c);

/* Re-encodes the keys of a moved token, n_rows rows of head_dim floats (every
 * layer and KV head), whose place in the cache drops by `shift` slots (the
 * engine re-rotates RoPE, one set of angles for all rows). */
typedef void (*kv_rekey_fn)(void *user, float *keys, int n_rows, int shift);
/* Keeps only the tokens keep[0..n_keep-1] (strictly increasing indices) of
 * the sequence, token keep[i] moving to slot i: rows are moved within the
 * sequence's blocks (keys through rekey when non-NULL, dequantized and
 * requantized for quantized types; q4_kc blocks rebuilt whole, a partial last
 * block's keys put in the staging), blocks no longer needed go back to the
 * pool (indexed untouched ones stay cached), a block that is written to and
 * shared with another sequence is copied first (never changed in place), an
 * indexed one leaves the index, and the sequence is no longer indexed for
 * prefix reuse. KVLM_EFULL if the copies need blocks the pool lacks (then
 * nothing changes). */
int kv_seq_compact(kv_cache *c, int seq, const int32_t *keep, int n_keep, kv_rekey_fn rekey, void *user,
                   kvlm_error *err);

/* Swap (kv/store's swap space): whether the sequence has compacted, and,
 * for an empty sequence, takes len tokens back with their keys (len /
 * block_size of them) in fresh private blocks (not indexed: the caller
 * writes their bytes, kv_block_write, before anything reads them);
 * blocks_out (may be NULL) receives them. KVLM_EFULL if the pool lacks the
 * blocks (then nothing changes). */
bool kv_seq_compacted(const kv_cache *c, int seq);
int kv_seq_restore(kv_cache *c, int seq, const int32_t *tokens, const kv_key *keys, int len, bool compacted,
                   int32_t *blocks_out, kvlm_error *err);

/* ---- hooks for the tiers (kv/store sets them) ---- */
typedef struct {
    /* A cached (unreferenced, indexed) block is about to be reused for other
     * data: its bytes, key and tokens are still intact for this call. */
    void (*demote)(void *user, kv_cache *c, int32_t block);
    /* kv_seq_commit indexed a full block (its bytes are final). */
    void (*indexed)(void *user, kv_cache *c, int32_t block);
    /* kv_seq_match_prefix found only the first `have` of `want` eligible
     * blocks in the index: the hook may attach more (kv_seq_attach_block). */
    void (*miss)(void *user, kv_cache *c, int seq, const int32_t *tokens, int have, int want);
    void *user;
} kv_hooks;
void kv_set_hooks(kv_cache *c, const kv_hooks *h);
/* An indexed block's key, its parent's key (all zero for a sequence's first
 * block) and tokens (block_size of them). */
const kv_key *kv_block_key_of(const kv_cache *c, int32_t block);
const kv_key *kv_block_parent_of(const kv_cache *c, int32_t block);
const int32_t *kv_block_tokens(const kv_cache *c, int32_t block);
bool kv_block_indexed(const kv_cache *c, int32_t block);
/* The key of a sequence's full block i (computed when it was committed or matched). */
const kv_key *kv_seq_key(const kv_cache *c, int seq, int i);
/* A block's bytes through the storage table: the payload_bytes of its
 * layout's format (kv_block_bytes for the pool's own layout). */
void kv_block_read(const kv_cache *c, int32_t block, void *host_dst);
void kv_block_write(kv_cache *c, int32_t block, const void *host_src);
/* For a sequence that holds only full blocks (len = blocks x its block size):
 * appends a fresh block (in the sequence's layout) for these tokens under key (which must
 * chain on the sequence's last key), indexes it and counts its tokens as
 * committed. The caller writes its bytes (kv_block_write) before anything
 * reads them. Returns the block, or -1 when the pool has no block to give. */
int32_t kv_seq_attach_block(kv_cache *c, int seq, const int32_t *tokens, const kv_key *key);

/* ---- changes of the prefix index (KV events: kv/store passes them up) ---- */
enum { KV_INDEX_ADDED = 1, KV_INDEX_REMOVED = 2 };
/* Called right after a full block enters the index and right before it
 * leaves it (reused for other data, or changed by compaction): its key,
 * parent and tokens are readable during the call. Every block that enters
 * leaves exactly once, so a listener can mirror the index; kv_free drops the
 * rest without calls. */
typedef void (*kv_index_fn)(void *user, const kv_cache *c, int what, int32_t block);
void kv_set_index_listener(kv_cache *c, kv_index_fn fn, void *user);
/* The indexed blocks, in block order: returns how many (at most cap written). */
int kv_indexed_blocks(const kv_cache *c, int32_t *out, int cap);

typedef struct {
    int n_blocks, used, cached, free;   /* used: referenced; cached: unreferenced but indexed */
    uint64_t hits, misses, evictions;   /* prefix lookups in RAM (per block) and index evictions */
    int shared;                         /* blocks referenced by more than one sequence */
} kv_stats;
void kv_get_stats(const kv_cache *c, kv_stats *s);
/* References to a block (how many sequences hold it). */
int kv_block_refs(const kv_cache *c, int32_t block);
/* Checks every invariant (reference counts equal table references, lists
 * consistent, index consistent); returns NULL or a description. For tests. */
const char *kv_check(const kv_cache *c);
/* ---- sliding window (docs/sliding-window.md) ---- */
/* A block that belongs to no one and is never written: sliding-window
 * sequences hold it in place of the blocks before their window, so block
 * tables keep one entry per block_size positions (attention never reads it:
 * it skips keys before the window). Reference counts ignore it. */
int32_t kv_null_block(const kv_cache *c);
/* Releases the sequence's blocks [0, n) (they go back to the pool; indexed
 * ones stay cached on the LRU for prefix reuse) and puts the null block in
 * their place. Returns how many were released now. */
int kv_seq_drop_front(kv_cache *c, int seq, int n);
/* How many of the sequence's first blocks are the null block. */
int kv_seq_dropped(const kv_cache *c, int seq);
/* kv_seq_match_prefix for a pool whose layers see `window` keys: the longest
 * run of at most max_blocks full blocks whose next token's window is all in
 * the index (the blocks before it need not be: they become the null block),
 * as vLLM's sliding-window manager does. No tier promotion. */
int kv_seq_match_prefix_window(kv_cache *c, int seq, const int32_t *tokens, int n, int window, int max_blocks);
/* What kv_seq_match_prefix_window would attach (blocks), without attaching;
 * *live gets how many of them it would hold (the rest: the null block). */
int kv_prefix_probe_window(const kv_cache *c, const int32_t *tokens, int n, int window, int max_blocks, int *live);
/* kv_seq_restore for a sequence whose first `first` blocks were dropped:
 * those become the null block; blocks_out gets the other ones. */
int kv_seq_restore_from(kv_cache *c, int seq, const int32_t *tokens, const kv_key *keys, int len, bool compacted,
                        int first, int32_t *blocks_out, kvlm_error *err);
#endif
