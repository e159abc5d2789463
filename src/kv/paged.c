/* kv/paged: block pool (storage, reference counts, free stack), block
 * tables, copy-on-write and compaction; the prefix index and LRU are
 * kv/prefix's. A block is in exactly one state: referenced (ref > 0), cached
 * (ref == 0, indexed, on the LRU list: reusable by a later prompt until the
 * pool needs it) or free (ref == 0, not indexed, on the free stack). */
#include "kv/paged.h"
#include "kv/prefix.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "dtype/dtype.h"
#include "ops/kvtype.h"
#include "util/error.h"
#include "util/mem.h"

typedef struct {
    int32_t *blocks;
    int n_blocks, cap_blocks;
    int32_t *tokens;
    kv_key *keys;               /* chained key of each full block */
    int len;                    /* tokens committed */
    bool compacted;             /* evicted: its tokens no longer match the text, do not index */
    int n_dropped;              /* sliding window: blocks [0, n_dropped) are the null block */
    bool held;                  /* speculative: blocks reaching past hold_from are not indexed yet */
    int hold_from;
    int32_t held_cow1;          /* held: 1 + the shared partial block copied at the first unverified write
                                   (its reference kept, so a rollback to hold_from takes it back); 0: none */
    kv_key root;                /* the parent of its first block's key (kv_seq_set_root; zeros: none) */
} kv_seq;

/* How a block's bytes are laid out and indexed: the pool's own layout, or a
 * guest's (kv_add_guest: a draft model of another cache shape). */
typedef struct {
    int n_layers, n_kv_heads, block_size;
    size_t k_bytes, v_bytes;    /* one (layer, head)'s K and V regions */
    kv_blockfmt fmt;            /* what keys (and stored blocks) depend on */
    kv_prefix *ix;              /* the prefix index and LRU of cached blocks of this layout */
} kv_layout;

struct kv_cache {
    kv_params p;
    size_t block_bytes;         /* a block, in every layout */
    kv_layout lay[2];           /* [0] the pool's; [1] the guest's, for sequences guest_lo.. */
    int n_lay, guest_lo;
    uint8_t *blay;              /* per block: the layout its bytes and index entry are in */
    uint8_t *data;
    uint16_t *stage;            /* q4_kc: per sequence, layers x heads x block_size x head_dim f16 */
    size_t stage_per_seq;       /* elements */
    int32_t *ref;               /* per block: sequences holding it */
    int32_t *free_stack;
    int n_free;
    kv_seq *seqs;
    uint64_t hits, misses, evictions;
    kv_hooks hooks;
    kv_index_fn on_index;       /* KV events: blocks entering and leaving the index */
    void *on_index_user;
};

static void *host_alloc(void *user, size_t bytes) { (void)user; return util_big_alloc(bytes, true); }
static void host_free(void *user, void *p, size_t bytes) { (void)user; util_big_free(p, bytes); }
static void host_copy(void *user, void *dst, const void *src, size_t n) { (void)user; memcpy(dst, src, n); }
const kv_storage kv_storage_host = {"host", host_alloc, host_free, host_copy, host_copy, host_copy, true, NULL};

static const kv_key k_no_parent; /* zeros: a sequence's first block */

static bool key_eq(const kv_key *a, const kv_key *b) { return !memcmp(a->b, b->b, 16); }

static int seq_lay(const kv_cache *c, int seq) { return seq >= c->guest_lo; }
static const kv_layout *lay_of_seq(const kv_cache *c, int seq) { return &c->lay[seq_lay(c, seq)]; }
static const kv_layout *lay_of_block(const kv_cache *c, int32_t b) { return &c->lay[c->blay[b]]; }
static kv_prefix *ix_of(const kv_cache *c, int32_t b) { return c->lay[c->blay[b]].ix; }

/* Every change of the prefix index goes through these two, so the index
 * listener (KV events) sees each block enter and leave exactly once. */
static void index_insert(kv_cache *c, int32_t b, const kv_key *key, const kv_key *parent, const int32_t *tokens) {
    kv_prefix_insert(ix_of(c, b), b, key, parent, tokens);
    if (c->on_index) c->on_index(c->on_index_user, c, KV_INDEX_ADDED, b);
}
static void index_remove(kv_cache *c, int32_t b) {
    if (c->on_index && kv_block_indexed(c, b)) c->on_index(c->on_index_user, c, KV_INDEX_REMOVED, b);
    kv_prefix_remove(ix_of(c, b), b);
}

/* Regions rounded up to 4 bytes so f32 and f16 data stay aligned; this pads
 * only odd cases (odd block sizes with q8_0/q4_0/q4_kc rows of an odd byte
 * count), and the padding counts in every bytes figure. */
static size_t region_bytes(int type, const kv_params *p) {
    return (op_kv_region_bytes(type, p->head_dim, p->block_size) + 3) & ~(size_t)3;
}

size_t kv_params_block_bytes(const kv_params *p) {
    return (size_t)p->n_layers * p->n_kv_heads *
           (region_bytes(p->k_type, p) + (p->v_in_k ? 0 : region_bytes(p->v_type, p)));
}

/* Keys name the model, both element types and the geometry: blocks of
 * another model or layout never match. payload: the pool's block bytes. */
static void layout_init(kv_layout *L, const kv_params *p, const kv_key *model, size_t payload) {
    L->n_layers = p->n_layers;
    L->n_kv_heads = p->n_kv_heads;
    L->block_size = p->block_size;
    L->k_bytes = region_bytes(p->k_type, p);
    L->v_bytes = p->v_in_k ? 0 : region_bytes(p->v_type, p);
    memset(&L->fmt, 0, sizeof L->fmt);
    L->fmt.model = *model;
    L->fmt.k_type = p->k_type;
    L->fmt.v_type = p->v_type;
    L->fmt.block_size = p->block_size;
    L->fmt.n_layers = p->n_layers;
    L->fmt.n_kv_heads = p->n_kv_heads;
    L->fmt.head_dim = p->head_dim;
    L->fmt.v_in_k = p->v_in_k;
    L->fmt.payload_bytes = payload;
    L->fmt.auth = p->auth;
}

kv_cache *kv_create(const kv_params *p, kvlm_error *err) {
    if (p->n_layers <= 0 || p->n_kv_heads <= 0 || p->head_dim <= 0 || p->block_size <= 0 || p->n_blocks <= 0 ||
        p->max_seqs <= 0 || p->max_seq_tokens <= 0) {
        util_err_set(err, KVLM_EINVAL, "bad KV cache parameters");
        return NULL;
    }
    if (!op_kv_type_valid(p->k_type, false) || !op_kv_type_valid(p->v_type, true)) {
        util_err_set(err, KVLM_EINVAL, "bad KV cache element types (keys %d, values %d)", p->k_type, p->v_type);
        return NULL;
    }
    if (p->v_in_k && (p->v_type != p->k_type || p->k_type == KVLM_CACHE_Q4_KC)) {
        util_err_set(err, KVLM_EINVAL, "a latent cache (values inside keys) needs one per-token element type");
        return NULL;
    }
    kv_cache *c = calloc(1, sizeof *c);
    if (!c) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    c->p = *p;
    if (!c->p.storage) c->p.storage = &kv_storage_host;
    c->n_lay = 1;
    c->guest_lo = p->max_seqs;
    c->block_bytes = kv_params_block_bytes(p);
    static const kv_key zero;
    kv_key model = p->model;
    if (key_eq(&p->model, &zero))
        for (int i = 0; i < 8; i++) model.b[i] = (uint8_t)(p->salt >> (8 * i));
    layout_init(&c->lay[0], p, &model, c->block_bytes);
    size_t nb = (size_t)p->n_blocks;
    /* one block more: the null block (kv_null_block), which sliding-window
     * sequences hold in place of blocks before their window */
    c->data = c->p.storage->alloc(c->p.storage->user, (nb + 1) * c->block_bytes);
    if (p->k_type == KVLM_CACHE_Q4_KC) {
        c->stage_per_seq = (size_t)p->n_layers * p->n_kv_heads * p->block_size * p->head_dim;
        c->stage = calloc((size_t)p->max_seqs * c->stage_per_seq, sizeof(uint16_t));
    }
    c->ref = calloc(nb, sizeof *c->ref);
    c->blay = calloc(nb + 1, 1);
    c->lay[0].ix = kv_prefix_create(p->n_blocks, p->block_size);
    c->free_stack = malloc(nb * sizeof(int32_t));
    c->seqs = calloc((size_t)p->max_seqs, sizeof *c->seqs);
    if (!c->data || !c->ref || !c->blay || !c->lay[0].ix || !c->free_stack || !c->seqs ||
        (c->stage_per_seq && !c->stage)) {
        util_err_set(err, KVLM_ENOMEM, "cannot allocate a KV cache of %d blocks (%zu bytes)", p->n_blocks,
                     nb * c->block_bytes);
        kv_free(c);
        return NULL;
    }
    /* Pop order: block 0 first. */
    for (int i = 0; i < p->n_blocks; i++) c->free_stack[i] = p->n_blocks - 1 - i;
    c->n_free = p->n_blocks;
    return c;
}

void kv_free(kv_cache *c) {
    if (!c) return;
    if (c->seqs)
        for (int s = 0; s < c->p.max_seqs; s++) {
            free(c->seqs[s].blocks);
            free(c->seqs[s].tokens);
            free(c->seqs[s].keys);
        }
    free(c->seqs);
    if (c->data) c->p.storage->free(c->p.storage->user, c->data, ((size_t)c->p.n_blocks + 1) * c->block_bytes);
    free(c->stage);
    free(c->ref);
    free(c->blay);
    for (int l = 0; l < c->n_lay; l++) kv_prefix_free(c->lay[l].ix);
    free(c->free_stack);
    free(c);
}

/* p with a guest's cache shape and types (its block size still p's) */
static kv_params guest_params(const kv_params *p, const kv_guest *gu) {
    kv_params g = *p;
    g.n_layers = gu->n_layers;
    g.n_kv_heads = gu->n_kv_heads;
    g.head_dim = gu->head_dim;
    g.k_type = gu->k_type;
    g.v_type = gu->v_type;
    return g;
}

int kv_guest_block_size(const kv_params *p, const kv_guest *gu) {
    kv_params g = guest_params(p, gu);
    size_t block = kv_params_block_bytes(p);
    int bs = p->block_size, m_max = p->max_seq_tokens > 0 ? (p->max_seq_tokens + bs - 1) / bs : 1, m = 0;
    for (int t = 1; t <= m_max; t++) {
        g.block_size = t * bs;
        if (kv_params_block_bytes(&g) > block) break;
        m = t;
    }
    if (m) return m * bs;
    /* a cache larger per token than the pool's: fewer tokens than p's */
    int t = bs - 1;
    for (; t > 0; t--) {
        g.block_size = t;
        if (kv_params_block_bytes(&g) <= block) break;
    }
    return t;
}

/* The first of sequences first.. that holds tokens or blocks; -1: none. */
static int first_busy_seq(const kv_cache *c, int first) {
    for (int s = first; s < c->p.max_seqs; s++)
        if (c->seqs[s].len || c->seqs[s].n_blocks) return s;
    return -1;
}

/* Empty sequences first.. drop their arrays (sized for another block size). */
static void seqs_shed(kv_cache *c, int first) {
    for (int s = first; s < c->p.max_seqs; s++) {
        free(c->seqs[s].blocks); free(c->seqs[s].tokens); free(c->seqs[s].keys);
        c->seqs[s].blocks = NULL; c->seqs[s].tokens = NULL; c->seqs[s].keys = NULL;
        c->seqs[s].cap_blocks = 0;
    }
}

int kv_add_guest(kv_cache *c, int first_seq, const kv_guest *gu, const kv_key *model, int *block_size,
                 kvlm_error *err) {
    if (c->n_lay > 1) return util_err_set(err, KVLM_EINVAL, "the pool already has a guest layout");
    if (first_seq <= 0 || first_seq >= c->p.max_seqs || gu->n_layers <= 0 || gu->n_kv_heads <= 0 || gu->head_dim <= 0 ||
        !op_kv_type_valid(gu->k_type, true) || !op_kv_type_valid(gu->v_type, true))
        return util_err_set(err, KVLM_EINVAL, "bad guest layout (sequences %d.., %d x %d x %d, types %d, %d: "
                            "per-token types only)", first_seq, gu->n_layers, gu->n_kv_heads, gu->head_dim, gu->k_type,
                            gu->v_type);
    if (c->p.v_in_k) return util_err_set(err, KVLM_EUNSUPPORTED, "a latent cache holds one layout");
    int busy = first_busy_seq(c, first_seq);
    if (busy >= 0)
        return util_err_set(err, KVLM_EINVAL, "sequence %d holds tokens: a guest layout takes empty ones", busy);
    kv_params g = guest_params(&c->p, gu);
    if (!(g.block_size = kv_guest_block_size(&c->p, gu)))
        return util_err_set(err, KVLM_EUNSUPPORTED, "a guest cache of %d x %d x %d takes more bytes for one token "
                            "than the pool's block holds", gu->n_layers, gu->n_kv_heads, gu->head_dim);
    kv_layout *L = &c->lay[1];
    layout_init(L, &g, model, kv_params_block_bytes(&g)); /* stored blocks carry the bytes it uses */
    if (!(L->ix = kv_prefix_create(c->p.n_blocks, g.block_size)))
        return util_err_set(err, KVLM_ENOMEM, "out of memory for the guest's prefix index");
    seqs_shed(c, first_seq);
    c->n_lay = 2;
    c->guest_lo = first_seq;
    if (block_size) *block_size = g.block_size;
    return KVLM_OK;
}

int kv_drop_guest(kv_cache *c, kvlm_error *err) {
    if (c->n_lay < 2) return KVLM_OK;
    int busy = first_busy_seq(c, c->guest_lo);
    if (busy >= 0) return util_err_set(err, KVLM_EINVAL, "guest sequence %d still holds blocks", busy);
    /* what is left of the guest's is cached: out of its index, onto the free stack */
    for (int32_t b = kv_prefix_lru_head(c->lay[1].ix); b >= 0; b = kv_prefix_lru_head(c->lay[1].ix)) {
        index_remove(c, b);
        c->free_stack[c->n_free++] = b;
    }
    memset(c->blay, 0, (size_t)c->p.n_blocks + 1); /* every guest block is free now */
    kv_prefix_free(c->lay[1].ix);
    memset(&c->lay[1], 0, sizeof c->lay[1]);
    seqs_shed(c, c->guest_lo);
    c->n_lay = 1;
    c->guest_lo = c->p.max_seqs;
    return KVLM_OK;
}

int kv_seq_block_size(const kv_cache *c, int seq) { return lay_of_seq(c, seq)->block_size; }
size_t kv_seq_head_bytes(const kv_cache *c, int seq) {
    const kv_layout *L = lay_of_seq(c, seq);
    return L->k_bytes + L->v_bytes;
}
size_t kv_seq_v_offset_bytes(const kv_cache *c, int seq) { return lay_of_seq(c, seq)->k_bytes; }

const kv_params *kv_get_params(const kv_cache *c) { return &c->p; }
const kv_blockfmt *kv_get_blockfmt(const kv_cache *c) { return &c->lay[0].fmt; }
const kv_blockfmt *kv_seq_blockfmt(const kv_cache *c, int seq) { return &lay_of_seq(c, seq)->fmt; }
const kv_blockfmt *kv_block_blockfmt(const kv_cache *c, int32_t b) { return &lay_of_block(c, b)->fmt; }
size_t kv_block_bytes(const kv_cache *c) { return c->block_bytes; }
size_t kv_head_bytes(const kv_cache *c) { return c->lay[0].k_bytes + c->lay[0].v_bytes; }
size_t kv_v_offset_bytes(const kv_cache *c) { return c->lay[0].k_bytes; }
size_t kv_token_bytes(const kv_cache *c) { return c->block_bytes / (size_t)c->p.block_size; }
size_t kv_stage_bytes(const kv_cache *c) { return c->stage_per_seq * (size_t)c->p.max_seqs * sizeof(uint16_t); }

uint8_t *kv_block_k(const kv_cache *c, int32_t block, int layer, int head) {
    const kv_layout *L = lay_of_block(c, block);
    return c->data + (size_t)block * c->block_bytes + ((size_t)layer * L->n_kv_heads + head) * (L->k_bytes + L->v_bytes);
}
uint8_t *kv_block_v(const kv_cache *c, int32_t block, int layer, int head) {
    return kv_block_k(c, block, layer, head) + lay_of_block(c, block)->k_bytes;
}
uint16_t *kv_seq_stage(const kv_cache *c, int seq, int layer, int head) {
    if (!c->stage || seq >= c->guest_lo) return NULL; /* a guest's keys are per-token */
    return c->stage + (size_t)seq * c->stage_per_seq +
           ((size_t)layer * c->p.n_kv_heads + head) * (size_t)c->p.block_size * c->p.head_dim;
}

/* ---- LRU and index ---------------------------------------------------------- */

/* ---- blocks ------------------------------------------------------------------ */

static int cached(const kv_cache *c) {
    int n = 0;
    for (int l = 0; l < c->n_lay; l++) n += kv_prefix_cached(c->lay[l].ix);
    return n;
}
static int available(const kv_cache *c) { return c->n_free + cached(c); }

/* A block for a sequence of layout lay: a free one, else the least recently
 * used cached one, the guest's first (a draft's cache is the cheaper one to
 * recompute), offered to the tiers first (demote). */
static int32_t block_alloc(kv_cache *c, int lay) {
    int32_t b = -1;
    if (c->n_free > 0) b = c->free_stack[--c->n_free];
    else {
        for (int l = c->n_lay - 1; l >= 0 && b < 0; l--) b = kv_prefix_lru_head(c->lay[l].ix);
        if (b < 0) return -1;
        if (c->hooks.demote) c->hooks.demote(c->hooks.user, c, b);
        index_remove(c, b);
        c->evictions++;
    }
    c->ref[b] = 1;
    c->blay[b] = (uint8_t)lay;
    return b;
}

static void block_unref(kv_cache *c, int32_t b) {
    if (b == c->p.n_blocks) return; /* the null block is nobody's */
    if (--c->ref[b] > 0) return;
    if (kv_block_indexed(c, b)) kv_prefix_lru_push(ix_of(c, b), b);
    else c->free_stack[c->n_free++] = b;
}

static void block_ref(kv_cache *c, int32_t b) {
    if (b == c->p.n_blocks) return;
    if (c->ref[b]++ == 0) kv_prefix_lru_remove(ix_of(c, b), b);
}

/* ---- sequences ------------------------------------------------------------- */

bool kv_seq_valid(const kv_cache *c, int seq) { return seq >= 0 && seq < c->p.max_seqs; }

void kv_seq_set_root(kv_cache *c, int seq, const kv_key *root) {
    static const kv_key zero;
    c->seqs[seq].root = root ? *root : zero;
}

const kv_key *kv_seq_root(const kv_cache *c, int seq) { return &c->seqs[seq].root; }
int kv_seq_len(const kv_cache *c, int seq) { return c->seqs[seq].len; }
const int32_t *kv_seq_tokens(const kv_cache *c, int seq) { return c->seqs[seq].tokens; }
const int32_t *kv_seq_blocks(const kv_cache *c, int seq, int *n) {
    if (n) *n = c->seqs[seq].n_blocks;
    return c->seqs[seq].blocks;
}

/* Grows the per-sequence arrays to hold n_tokens tokens. */
static int seq_grow(kv_cache *c, kv_seq *s, int n_tokens) {
    int bs = lay_of_seq(c, (int)(s - c->seqs))->block_size, need_blocks = (n_tokens + bs - 1) / bs;
    if (need_blocks <= s->cap_blocks) return 0;
    int cap = s->cap_blocks ? s->cap_blocks : 4;
    while (cap < need_blocks) cap *= 2;
    int max_blocks = (c->p.max_seq_tokens + bs - 1) / bs;
    if (cap > max_blocks) cap = max_blocks;
    int32_t *nb = realloc(s->blocks, (size_t)cap * sizeof(int32_t));
    if (!nb) return -1;
    s->blocks = nb;
    int32_t *nt = realloc(s->tokens, (size_t)cap * bs * sizeof(int32_t));
    if (!nt) return -1;
    s->tokens = nt;
    kv_key *nk = realloc(s->keys, (size_t)cap * sizeof(kv_key));
    if (!nk) return -1;
    s->keys = nk;
    s->cap_blocks = cap;
    return 0;
}

int kv_seq_reserve(kv_cache *c, int seq, int n_new, kvlm_error *err) {
    kv_seq *s = &c->seqs[seq];
    int lay = seq_lay(c, seq), bs = c->lay[lay].block_size, need_tokens = s->len + n_new;
    if (need_tokens > c->p.max_seq_tokens)
        return util_err_set(err, KVLM_ERANGE, "sequence %d would hold %d tokens, more than the context of %d", seq,
                            need_tokens, c->p.max_seq_tokens);
    int need_blocks = (need_tokens + bs - 1) / bs;
    /* (an indexed partial block: kept by kv_seq_trim, its bytes name its key) */
    bool cow = s->len % bs != 0 && s->len / bs < s->n_blocks &&
               (c->ref[s->blocks[s->len / bs]] > 1 || kv_block_indexed(c, s->blocks[s->len / bs]));
    int extra = need_blocks - s->n_blocks + (cow ? 1 : 0);
    if (extra > available(c))
        return util_err_set(err, KVLM_EFULL, "the KV cache is full: sequence %d needs %d more blocks, %d are free", seq,
                            extra, available(c));
    if (seq_grow(c, s, need_tokens)) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    if (cow) { /* first write into a shared, partly filled block: copy it */
        int32_t old = s->blocks[s->len / bs], nb = block_alloc(c, lay);
        /* raw bytes: a q4_kc block still filling has no valid K here yet
         * (its keys are in the sequence's staging), which copies harmlessly */
        c->p.storage->copy(c->p.storage->user, c->data + (size_t)nb * c->block_bytes, c->data + (size_t)old * c->block_bytes, c->block_bytes);
        if (s->held && s->len == s->hold_from && !s->held_cow1) s->held_cow1 = old + 1;
        else block_unref(c, old);
        s->blocks[s->len / bs] = nb;
    }
    while (s->n_blocks < need_blocks) s->blocks[s->n_blocks++] = block_alloc(c, lay);
    return KVLM_OK;
}

void kv_seq_trim(kv_cache *c, int seq, int n_keep) {
    kv_seq *s = &c->seqs[seq];
    int bs = lay_of_seq(c, seq)->block_size, keep = (n_keep + bs - 1) / bs;
    if (s->held_cow1) { /* back to hold_from or before: the shared block again, not its copy */
        int32_t old = s->held_cow1 - 1;
        int i = s->hold_from / bs;
        s->held_cow1 = 0;
        if (n_keep <= s->hold_from && i < keep && i < s->n_blocks) {
            block_unref(c, s->blocks[i]);
            s->blocks[i] = old;
        } else block_unref(c, old);
    }
    while (s->n_blocks > keep) { /* a block a window dropped is no longer the sequence's */
        --s->n_blocks;
        if (s->n_blocks >= s->n_dropped) block_unref(c, s->blocks[s->n_blocks]);
    }
    if (s->len > n_keep) s->len = n_keep;
    if (s->n_dropped > s->n_blocks) s->n_dropped = s->n_blocks;
}

/* Keys and indexes the sequence's full blocks [i0, i1): each is indexed
 * unless an identical block already is (e.g. two requests computed the same
 * prefix at once: then this copy stays private). */
static void index_full(kv_cache *c, kv_seq *s, int i0, int i1) {
    int lay = seq_lay(c, (int)(s - c->seqs)), bs = c->lay[lay].block_size;
    const kv_layout *L = &c->lay[lay];
    for (int i = i0; i < i1; i++) {
        const kv_key *parent = i == 0 ? &s->root : &s->keys[i - 1];
        const int32_t *bt = s->tokens + (size_t)i * bs;
        int32_t b = s->blocks[i];
        if (!c->p.prefix_cache || s->compacted) continue; /* keys only name blocks that can be indexed */
        /* speculative tokens: no key, no index entry until they are verified */
        if (s->held && (i + 1) * bs > s->hold_from) break;
        kv_block_key(&L->fmt, parent, bt, &s->keys[i]);
        if (!kv_prefix_indexed(L->ix, b) && kv_prefix_find(L->ix, &s->keys[i], parent, bt) < 0) {
            index_insert(c, b, &s->keys[i], parent, bt);
            if (c->hooks.indexed) c->hooks.indexed(c->hooks.user, c, b);
        }
    }
}

void kv_seq_commit(kv_cache *c, int seq, const int32_t *tokens, int n) {
    kv_seq *s = &c->seqs[seq];
    int bs = lay_of_seq(c, seq)->block_size, old = s->len;
    memcpy(s->tokens + old, tokens, (size_t)n * sizeof(int32_t));
    s->len += n;
    index_full(c, s, old / bs, s->len / bs);
}

void kv_seq_hold(kv_cache *c, int seq, int from) {
    kv_seq *s = &c->seqs[seq];
    s->held = true;
    s->hold_from = from;
}

void kv_seq_unhold(kv_cache *c, int seq) {
    kv_seq *s = &c->seqs[seq];
    if (!s->held) return;
    s->held = false;
    int bs = lay_of_seq(c, seq)->block_size;
    index_full(c, s, s->hold_from / bs, s->len / bs);
}

bool kv_seq_held(const kv_cache *c, int seq, int *from) {
    if (from) *from = c->seqs[seq].hold_from;
    return c->seqs[seq].held;
}

void kv_seq_release(kv_cache *c, int seq) {
    kv_seq *s = &c->seqs[seq];
    /* Release back to front so a prefix's first blocks are the last evicted. */
    while (s->n_blocks > 0) block_unref(c, s->blocks[--s->n_blocks]);
    s->len = 0;
    s->compacted = false;
    s->n_dropped = 0;
    s->held = false;
    if (s->held_cow1) block_unref(c, s->held_cow1 - 1);
    s->held_cow1 = 0;
}

int kv_seq_fork(kv_cache *c, int src, int dst, kvlm_error *err) {
    if (src == dst) return KVLM_OK;
    if (seq_lay(c, src) != seq_lay(c, dst))
        return util_err_set(err, KVLM_EINVAL, "sequences %d and %d hold blocks of two layouts: no fork", src, dst);
    kv_seq *a = &c->seqs[src], *b = &c->seqs[dst];
    kv_seq_release(c, dst);
    if (seq_grow(c, b, a->len > 0 ? a->len : 1)) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    for (int i = 0; i < a->n_blocks; i++) {
        b->blocks[i] = a->blocks[i];
        block_ref(c, a->blocks[i]);
    }
    b->n_blocks = a->n_blocks;
    if (a->len) { /* a sequence never used has no arrays */
        memcpy(b->tokens, a->tokens, (size_t)a->len * sizeof(int32_t));
        memcpy(b->keys, a->keys, (size_t)(a->len / lay_of_seq(c, src)->block_size) * sizeof(kv_key));
    }
    b->len = a->len;
    b->compacted = a->compacted;
    b->n_dropped = a->n_dropped;
    b->held = a->held;
    b->hold_from = a->hold_from;
    if (c->stage) /* the shared partial block's keys are in src's staging */
        memcpy(c->stage + (size_t)dst * c->stage_per_seq, c->stage + (size_t)src * c->stage_per_seq,
               c->stage_per_seq * sizeof(uint16_t));
    return KVLM_OK;
}

int kv_seq_match_prefix(kv_cache *c, int seq, const int32_t *tokens, int n) {
    kv_seq *s = &c->seqs[seq];
    int lay = seq_lay(c, seq), bs = c->lay[lay].block_size;
    const kv_layout *L = &c->lay[lay];
    if (!c->p.prefix_cache || s->len != 0 || s->n_blocks != 0) return s->len;
    int eligible = (n - 1) / bs; /* full blocks, leaving one token to compute */
    if (eligible * bs > c->p.max_seq_tokens) eligible = c->p.max_seq_tokens / bs;
    if (eligible <= 0 || seq_grow(c, s, eligible * bs)) return 0;
    int i = 0;
    for (; i < eligible; i++) {
        const int32_t *bt = tokens + (size_t)i * bs;
        const kv_key *parent = i == 0 ? &s->root : &s->keys[i - 1];
        kv_block_key(&L->fmt, parent, bt, &s->keys[i]);
        int32_t b = kv_prefix_find(L->ix, &s->keys[i], parent, bt);
        if (b < 0) break;
        block_ref(c, b);
        s->blocks[s->n_blocks++] = b;
    }
    c->hits += (uint64_t)i;
    c->misses += (uint64_t)(eligible - i);
    memcpy(s->tokens, tokens, (size_t)i * bs * sizeof(int32_t));
    s->len = i * bs;
    if (i < eligible && c->hooks.miss) c->hooks.miss(c->hooks.user, c, seq, tokens, i, eligible);
    return s->len;
}

void kv_set_hooks(kv_cache *c, const kv_hooks *h) {
    if (h) c->hooks = *h;
    else memset(&c->hooks, 0, sizeof c->hooks);
}
const kv_key *kv_block_key_of(const kv_cache *c, int32_t b) { return kv_prefix_key(ix_of(c, b), b); }
const kv_key *kv_block_parent_of(const kv_cache *c, int32_t b) { return kv_prefix_parent(ix_of(c, b), b); }
void kv_set_index_listener(kv_cache *c, kv_index_fn fn, void *user) {
    c->on_index = fn;
    c->on_index_user = user;
}
int kv_indexed_blocks(const kv_cache *c, int32_t *out, int cap) {
    int n = 0;
    for (int32_t b = 0; b < c->p.n_blocks; b++)
        if (kv_block_indexed(c, b)) {
            if (n < cap) out[n] = b;
            n++;
        }
    return n;
}
const int32_t *kv_block_tokens(const kv_cache *c, int32_t b) { return kv_prefix_tokens(ix_of(c, b), b); }
bool kv_block_indexed(const kv_cache *c, int32_t b) { return kv_prefix_indexed(ix_of(c, b), b); }
int kv_block_size_of(const kv_cache *c, int32_t b) { return lay_of_block(c, b)->block_size; }
bool kv_block_guest(const kv_cache *c, int32_t b) { return c->blay[b] != 0; }
const kv_key *kv_seq_key(const kv_cache *c, int seq, int i) { return &c->seqs[seq].keys[i]; }

void kv_block_read(const kv_cache *c, int32_t b, void *host_dst) {
    c->p.storage->read(c->p.storage->user, host_dst, c->data + (size_t)b * c->block_bytes,
                       lay_of_block(c, b)->fmt.payload_bytes);
}
void kv_block_write(kv_cache *c, int32_t b, const void *host_src) {
    c->p.storage->write(c->p.storage->user, c->data + (size_t)b * c->block_bytes, host_src,
                        lay_of_block(c, b)->fmt.payload_bytes);
}

int32_t kv_seq_attach_block(kv_cache *c, int seq, const int32_t *tokens, const kv_key *key) {
    kv_seq *s = &c->seqs[seq];
    int lay = seq_lay(c, seq), bs = c->lay[lay].block_size, i = s->n_blocks;
    if (s->len != i * bs || (i + 1) * bs > c->p.max_seq_tokens || !c->p.prefix_cache || s->compacted) return -1;
    if (available(c) < 1 || seq_grow(c, s, (i + 1) * bs)) return -1;
    const kv_key *parent = i == 0 ? &s->root : &s->keys[i - 1];
    int32_t b = block_alloc(c, lay);
    s->blocks[s->n_blocks++] = b;
    s->keys[i] = *key;
    memcpy(s->tokens + (size_t)i * bs, tokens, (size_t)bs * sizeof(int32_t));
    s->len += bs;
    if (kv_prefix_find(c->lay[lay].ix, key, parent, tokens) < 0) index_insert(c, b, key, parent, tokens);
    return b;
}

bool kv_seq_compacted(const kv_cache *c, int seq) { return c->seqs[seq].compacted; }

int kv_seq_restore(kv_cache *c, int seq, const int32_t *tokens, const kv_key *keys, int len, bool compacted,
                   int32_t *blocks_out, kvlm_error *err) {
    return kv_seq_restore_from(c, seq, tokens, keys, len, compacted, 0, blocks_out, err);
}

int kv_seq_restore_from(kv_cache *c, int seq, const int32_t *tokens, const kv_key *keys, int len, bool compacted,
                        int first, int32_t *blocks_out, kvlm_error *err) {
    kv_seq *s = &c->seqs[seq];
    int bs = c->p.block_size, nb = (len + bs - 1) / bs;
    if (first < 0 || first > nb) return util_err_set(err, KVLM_EINVAL, "sequence %d: %d dropped blocks of %d", seq, first, nb);
    if (seq_lay(c, seq)) return util_err_set(err, KVLM_EUNSUPPORTED, "sequence %d holds a guest's blocks: no swap", seq);
    if (s->len != 0 || s->n_blocks != 0) return util_err_set(err, KVLM_EINVAL, "sequence %d is not empty", seq);
    if (len > c->p.max_seq_tokens)
        return util_err_set(err, KVLM_ERANGE, "%d tokens are more than the context of %d", len, c->p.max_seq_tokens);
    if (nb - first > available(c))
        return util_err_set(err, KVLM_EFULL, "the KV cache is full: swapping sequence %d in needs %d blocks, %d are free",
                            seq, nb - first, available(c));
    if (len == 0) return KVLM_OK;
    if (seq_grow(c, s, len)) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    for (int i = 0; i < nb; i++) {
        s->blocks[i] = i < first ? c->p.n_blocks : block_alloc(c, 0);
        if (blocks_out && i >= first) blocks_out[i - first] = s->blocks[i];
    }
    s->n_blocks = nb;
    s->n_dropped = first;
    memcpy(s->tokens, tokens, (size_t)len * sizeof(int32_t));
    memcpy(s->keys, keys, (size_t)(len / bs) * sizeof(kv_key));
    s->len = len;
    s->compacted = compacted;
    return KVLM_OK;
}

int kv_prefix_probe(const kv_cache *c, const int32_t *tokens, int n, int *unreferenced, kv_key *last) {
    int bs = c->p.block_size, i = 0, unref = 0;
    int eligible = (n - 1) / bs;
    if (eligible * bs > c->p.max_seq_tokens) eligible = c->p.max_seq_tokens / bs;
    kv_key parent = k_no_parent, key;
    for (; c->p.prefix_cache && i < eligible; i++) {
        const int32_t *bt = tokens + (size_t)i * bs;
        kv_block_key(&c->lay[0].fmt, i == 0 ? NULL : &parent, bt, &key);
        int32_t b = kv_prefix_find(c->lay[0].ix, &key, &parent, bt);
        if (b < 0) break;
        unref += c->ref[b] == 0;
        parent = key;
    }
    if (unreferenced) *unreferenced = unref;
    if (last) *last = parent;
    return i;
}

int kv_available_blocks(const kv_cache *c) { return available(c); }

/* q4_kc keys for kv_seq_compact: each destination block is rebuilt whole
 * (its tokens' keys gathered as f32 from their per-channel blocks or from the
 * staging of the old filling block, re-encoded, then quantized per channel
 * again), and a partial last block goes to the staging, where the engine
 * expects the filling block's keys. Blocks are rebuilt in order and every
 * source lies at or after its destination, so nothing is read after it was
 * rewritten. rows: n_rows x head_dim floats; tmp: n_rows x block_size x
 * head_dim halves. */
static void compact_kc_keys(kv_cache *c, int seq, const int32_t *keep, int n_keep, int first, kv_rekey_fn rekey,
                            void *user, float *rows, uint16_t *tmp) {
    kv_seq *s = &c->seqs[seq];
    int bs = c->p.block_size, hd = c->p.head_dim, H = c->p.n_kv_heads, n_rows = c->p.n_layers * H;
    int old_stage = s->len % bs ? s->len / bs : -1;
    int lo = first < n_keep / bs * bs ? first / bs : n_keep / bs; /* a now-partial last block moves to staging */
    for (int j = lo; j * bs < n_keep; j++) {
        int n_tok = n_keep - j * bs < bs ? n_keep - j * bs : bs;
        for (int t = 0; t < n_tok; t++) {
            int i = j * bs + t, src = keep[i];
            for (int r = 0; r < n_rows; r++) {
                float *y = rows + (size_t)r * hd;
                if (src / bs == old_stage) {
                    const uint16_t *st = kv_seq_stage(c, seq, r / H, r % H) + (size_t)(src % bs) * hd;
                    for (int d = 0; d < hd; d++) y[d] = dt_f16_to_f32(st[d]);
                } else op_kv_dequantize_kc(kv_block_k(c, s->blocks[src / bs], r / H, r % H), y, hd, bs, src % bs, 1);
            }
            if (rekey && src != i) rekey(user, rows, n_rows, src - i);
            for (int r = 0; r < n_rows; r++)
                for (int d = 0; d < hd; d++)
                    tmp[((size_t)r * bs + t) * hd + d] = dt_f32_to_f16(rows[(size_t)r * hd + d]);
        }
        for (int r = 0; r < n_rows; r++) {
            const uint16_t *blk = tmp + (size_t)r * bs * hd;
            if (n_tok == bs) op_kv_quantize_kc(blk, kv_block_k(c, s->blocks[j], r / H, r % H), hd, bs, bs);
            else memcpy(kv_seq_stage(c, seq, r / H, r % H), blk, (size_t)n_tok * hd * sizeof(uint16_t));
        }
    }
}

int kv_seq_compact(kv_cache *c, int seq, const int32_t *keep, int n_keep, kv_rekey_fn rekey, void *user,
                   kvlm_error *err) {
    kv_seq *s = &c->seqs[seq];
    int bs = c->p.block_size, hd = c->p.head_dim, first = 0;
    if (!c->p.storage->host_addressable)
        return util_err_set(err, KVLM_EUNSUPPORTED, "eviction compacts blocks on the CPU; the %s cache cannot",
                            c->p.storage->name);
    if (seq_lay(c, seq)) return util_err_set(err, KVLM_EUNSUPPORTED, "sequence %d holds a guest's blocks: no eviction", seq);
    while (first < n_keep && keep[first] == first) first++;
    if (n_keep > s->len || (n_keep > 0 && keep[n_keep - 1] >= s->len))
        return util_err_set(err, KVLM_EINVAL, "sequence %d: cannot keep tokens past its %d", seq, s->len);
    int b_lo = first / bs, b_hi = (n_keep + bs - 1) / bs, copies = 0; /* blocks written: [b_lo, b_hi) */
    for (int j = b_lo; j < b_hi; j++) copies += c->ref[s->blocks[j]] > 1;
    if (copies > available(c))
        return util_err_set(err, KVLM_EFULL, "the KV cache is full: evicting from sequence %d needs %d block "
                                             "copies, %d blocks are free", seq, copies, available(c));
    size_t krow = op_kv_row_bytes(c->p.k_type, hd), vrow = op_kv_row_bytes(c->p.v_type, hd);
    int n_rows = c->p.n_layers * c->p.n_kv_heads;
    bool kc = c->p.k_type == KVLM_CACHE_Q4_KC;
    float *rows = malloc((size_t)n_rows * hd * sizeof(float));
    uint16_t *kc_tmp = kc ? malloc((size_t)n_rows * bs * hd * sizeof(uint16_t)) : NULL;
    if (!rows || (kc && !kc_tmp)) { free(rows); return util_err_set(err, KVLM_ENOMEM, "out of memory"); }
    for (int j = b_lo; j < b_hi; j++) {
        int32_t b = s->blocks[j];
        if (c->ref[b] > 1) { /* shared: write into a private copy */
            int32_t nb = block_alloc(c, 0);
            c->p.storage->copy(c->p.storage->user, c->data + (size_t)nb * c->block_bytes, c->data + (size_t)b * c->block_bytes, c->block_bytes);
            block_unref(c, b);
            s->blocks[j] = nb;
        } else index_remove(c, b); /* indexed: its contents change */
    }
    if (kc) compact_kc_keys(c, seq, keep, n_keep, first, rekey, user, rows, kc_tmp);
    free(kc_tmp);
    /* Forward: keep[i] >= i, so a slot is overwritten only after it was read.
     * A token's keys of every layer and head are re-encoded in one call. */
    for (int i = first; i < n_keep; i++) {
        int32_t src = s->blocks[keep[i] / bs], dst = s->blocks[i / bs];
        int ss = keep[i] % bs, ds = i % bs;
        if (rekey && !kc) {
            for (int r = 0; r < n_rows; r++)
                op_kv_dequantize_row(c->p.k_type, kv_block_k(c, src, r / c->p.n_kv_heads, r % c->p.n_kv_heads) + ss * krow,
                                     rows + (size_t)r * hd, hd);
            rekey(user, rows, n_rows, keep[i] - i);
        }
        for (int r = 0; r < n_rows; r++) {
            int l = r / c->p.n_kv_heads, h = r % c->p.n_kv_heads;
            uint8_t *kd = kv_block_k(c, dst, l, h) + ds * krow;
            if (kc) {} /* moved above */
            else if (rekey) op_kv_quantize_row(c->p.k_type, rows + (size_t)r * hd, kd, hd);
            else memmove(kd, kv_block_k(c, src, l, h) + ss * krow, krow);
            if (!c->p.v_in_k) /* else the value moved with its key */
                memmove(kv_block_v(c, dst, l, h) + ds * vrow, kv_block_v(c, src, l, h) + ss * vrow, vrow);
        }
        s->tokens[i] = s->tokens[keep[i]];
    }
    free(rows);
    for (int i = 0; i < first; i++) s->tokens[i] = s->tokens[keep[i]];
    while (s->n_blocks > b_hi) block_unref(c, s->blocks[--s->n_blocks]);
    if (n_keep < s->len) s->compacted = true;
    s->len = n_keep;
    return KVLM_OK;
}

void kv_get_stats(const kv_cache *c, kv_stats *st) {
    memset(st, 0, sizeof *st);
    st->n_blocks = c->p.n_blocks;
    st->free = c->n_free;
    st->cached = cached(c);
    st->used = c->p.n_blocks - c->n_free - st->cached;
    for (int b = 0; b < c->p.n_blocks; b++) st->shared += c->ref[b] > 1;
    st->hits = c->hits;
    st->misses = c->misses;
    st->evictions = c->evictions;
}

int kv_block_refs(const kv_cache *c, int32_t block) {
    return block >= 0 && block < c->p.n_blocks ? c->ref[block] : 0;
}

const char *kv_check(const kv_cache *c) {
    static char msg[256];
    int nb = c->p.n_blocks;
    int32_t *refs = calloc((size_t)nb, sizeof(int32_t));
    char *state = calloc((size_t)nb, 1);
    const char *bad = NULL;
    if (!refs || !state) { free(refs); free(state); return "out of memory in kv_check"; }
    for (int s = 0; s < c->p.max_seqs && !bad; s++) {
        const kv_seq *q = &c->seqs[s];
        int bs = lay_of_seq(c, s)->block_size;
        if (q->len > q->n_blocks * bs) { snprintf(msg, sizeof msg, "seq %d: %d tokens in %d blocks", s, q->len, q->n_blocks); bad = msg; }
        for (int i = 0; i < q->n_blocks; i++) {
            bool null = q->blocks[i] == nb;
            if (null != (i < q->n_dropped)) {
                snprintf(msg, sizeof msg, "seq %d: block %d is %sthe null block, %d dropped", s, i, null ? "" : "not ",
                         q->n_dropped);
                bad = msg;
            } else if (!null && c->blay[q->blocks[i]] != seq_lay(c, s)) {
                snprintf(msg, sizeof msg, "seq %d: block %d is in layout %d, the sequence's is %d", s, q->blocks[i],
                         c->blay[q->blocks[i]], seq_lay(c, s));
                bad = msg;
            } else if (!null) refs[q->blocks[i]]++;
        }
        if (q->held_cow1) refs[q->held_cow1 - 1]++;
    }
    for (int b = 0; b < nb && !bad; b++)
        if (refs[b] != c->ref[b]) { snprintf(msg, sizeof msg, "block %d: ref %d, referenced %d times", b, c->ref[b], refs[b]); bad = msg; }
    for (int i = 0; i < c->n_free && !bad; i++) {
        int32_t b = c->free_stack[i];
        if (state[b]++ || c->ref[b] || kv_block_indexed(c, b)) { snprintf(msg, sizeof msg, "free block %d is in use or indexed", b); bad = msg; }
    }
    for (int l = 0; l < c->n_lay; l++)
        for (int32_t b = kv_prefix_lru_head(c->lay[l].ix); b >= 0 && !bad; b = kv_prefix_lru_next(c->lay[l].ix, b))
            if (state[b]++ || c->ref[b] || c->blay[b] != l) { snprintf(msg, sizeof msg, "cached block %d is in use, free or of another layout", b); bad = msg; }
    for (int b = 0; b < nb && !bad; b++) {
        if (!state[b] && c->ref[b] == 0) { snprintf(msg, sizeof msg, "block %d is lost (unreferenced, not free, not cached)", b); bad = msg; }
        for (int l = 0; l < c->n_lay && !bad; l++)
            if (l != c->blay[b] && kv_prefix_indexed(c->lay[l].ix, b)) { snprintf(msg, sizeof msg, "block %d is indexed under layout %d, its bytes are in %d", b, l, c->blay[b]); bad = msg; }
    }
    for (int l = 0; l < c->n_lay && !bad; l++) bad = kv_prefix_check(c->lay[l].ix, msg, sizeof msg);
    free(refs);
    free(state);
    return bad;
}

/* ---- sliding window ------------------------------------------------------ */

int32_t kv_null_block(const kv_cache *c) { return c->p.n_blocks; }
int kv_seq_dropped(const kv_cache *c, int seq) { return c->seqs[seq].n_dropped; }

int kv_seq_drop_front(kv_cache *c, int seq, int n) {
    kv_seq *s = &c->seqs[seq];
    if (n > s->n_blocks) n = s->n_blocks;
    int dropped = 0;
    /* newest first, so the LRU evicts a prefix's first blocks last, as release does */
    for (int i = n - 1; i >= s->n_dropped; i--) {
        block_unref(c, s->blocks[i]);
        s->blocks[i] = c->p.n_blocks;
        dropped++;
    }
    if (n > s->n_dropped) s->n_dropped = n;
    return dropped;
}

/* The longest hit of at most `eligible` blocks under the window rule, from
 * the blocks found (-1: not in the index); *first gets the blocks before
 * its window. */
static int window_hit(const int32_t *found, int eligible, int bs, int window, int *first) {
    int best = 0;
    for (int i = eligible; i > 0 && !best; i--) {
        int lo = i * bs - window + 1 > 0 ? (i * bs - window + 1) / bs : 0, j = i - 1;
        while (j >= lo && found[j] >= 0) j--;
        if (j < lo) best = i;
    }
    *first = best * bs - window + 1 > 0 ? (best * bs - window + 1) / bs : 0;
    return best;
}

int kv_prefix_probe_window(const kv_cache *c, const int32_t *tokens, int n, int window, int max_blocks, int *live) {
    int bs = c->p.block_size, eligible = n > 0 ? (n - 1) / bs : 0, first = 0;
    if (eligible * bs > c->p.max_seq_tokens) eligible = c->p.max_seq_tokens / bs;
    if (eligible > max_blocks) eligible = max_blocks;
    *live = 0;
    if (!c->p.prefix_cache || eligible <= 0) return 0;
    int32_t *found = malloc((size_t)eligible * sizeof *found);
    kv_key *keys = malloc((size_t)eligible * sizeof *keys);
    int best = 0;
    if (found && keys) {
        for (int i = 0; i < eligible; i++) {
            kv_block_key(&c->lay[0].fmt, i == 0 ? NULL : &keys[i - 1], tokens + (size_t)i * bs, &keys[i]);
            found[i] = kv_prefix_find(c->lay[0].ix, &keys[i], i == 0 ? &k_no_parent : &keys[i - 1], tokens + (size_t)i * bs);
        }
        best = window_hit(found, eligible, bs, window, &first);
    }
    free(found);
    free(keys);
    *live = best - first;
    return best;
}

int kv_seq_match_prefix_window(kv_cache *c, int seq, const int32_t *tokens, int n, int window, int max_blocks) {
    kv_seq *s = &c->seqs[seq];
    int bs = c->p.block_size;
    if (!c->p.prefix_cache || s->len != 0 || s->n_blocks != 0) return s->len;
    int eligible = (n - 1) / bs;
    if (eligible * bs > c->p.max_seq_tokens) eligible = c->p.max_seq_tokens / bs;
    if (eligible > max_blocks) eligible = max_blocks;
    if (eligible <= 0 || seq_grow(c, s, eligible * bs)) return 0;
    /* every block's key (they chain on tokens, not on blocks), and where the
     * index has it */
    int32_t *found = malloc((size_t)eligible * sizeof *found);
    if (!found) return 0;
    for (int i = 0; i < eligible; i++) {
        const kv_key *parent = i == 0 ? &s->root : &s->keys[i - 1];
        kv_block_key(&c->lay[0].fmt, parent, tokens + (size_t)i * bs, &s->keys[i]);
        found[i] = kv_prefix_find(c->lay[0].ix, &s->keys[i], parent, tokens + (size_t)i * bs);
    }
    /* the longest hit of i blocks whose next token's window is all there:
     * blocks [(i * bs - window + 1) / bs, i) (vLLM's sliding-window rule) */
    int first, best = window_hit(found, eligible, bs, window, &first);
    for (int i = 0; i < best; i++) {
        if (i < first) s->blocks[s->n_blocks++] = c->p.n_blocks;
        else {
            block_ref(c, found[i]);
            s->blocks[s->n_blocks++] = found[i];
        }
    }
    s->n_dropped = first;
    c->hits += (uint64_t)(best - first);
    c->misses += (uint64_t)(eligible - best);
    free(found);
    memcpy(s->tokens, tokens, (size_t)best * bs * sizeof(int32_t));
    s->len = best * bs;
    return s->len;
}
