/* kv/store: the facade over the block pool (kv/paged): the engine's write
 * path and attention view, the scheduler's admission probe, sequence
 * operations, which block of each sequence keeps q4_kc keys in staging, and
 * the tiers: demotion of dropped cached blocks, write-through of committed
 * ones, promotion on a prefix miss, persistence at a clean stop. */
#include "kv/store.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "kv/tier_host.h"
#include "dtype/dtype.h"
#include "ops/kvtype.h"
#include "util/error.h"
#include "util/log.h"
#include "util/pool.h"
#include "util/timing.h"

/* blocks asked of the tiers per round of a promotion */
#define PROMOTE_BATCH 32

struct kv_store {
    kv_cache *c;
    kv_params p;           /* the pool's, as it settled them */
    size_t k_row, v_row;   /* bytes of one token's row of one head (per-token types) */
    int *stage_block;      /* per sequence: q4_kc keys' block still filling, -1: none */
    /* sequences guest_lo.. hold a guest layout's blocks (kv_store_add_guest) */
    int guest_lo, g_head_dim, gk_type, gv_type;
    size_t gk_row, gv_row;
    /* tiers */
    kv_tier *tiers[KV_STORE_MAX_TIERS];
    int roles[KV_STORE_MAX_TIERS], n_tiers;
    kv_blockfmt fmt;       /* the pool's layout's (a guest's: kv_block_blockfmt) */
    size_t blob_bytes;     /* one of the pool's blocks serialized */
    size_t blob_cap;       /* room for one serialized block of either layout */
    uint8_t *ser;          /* one serialized block (demote, write-through, persist) */
    uint8_t *in_tier;      /* per block: bit t set when tier t is known to hold its current contents */
    uint8_t *pbuf;         /* promotion: PROMOTE_BATCH serialized blocks */
    void *bufs[PROMOTE_BATCH];
    size_t lens[PROMOTE_BATCH];
    kv_key keys[PROMOTE_BATCH];
    const uint8_t *payloads[PROMOTE_BATCH]; /* check_batch's verdicts */
    const char *whys[PROMOTE_BATCH];
    util_pool *threads;    /* not owned: signed blocks are checked on them */
    uint64_t promoted[KV_STORE_MAX_TIERS], demoted[KV_STORE_MAX_TIERS], through[KV_STORE_MAX_TIERS],
        persisted[KV_STORE_MAX_TIERS];
    bool logged_corrupt[KV_STORE_MAX_TIERS], logged_forged[KV_STORE_MAX_TIERS];
    /* KV events for the host tier (kv_store_set_tier_listener) */
    kv_tier_event_fn tier_fn;
    void *tier_user;
    int32_t putting;       /* the pool block put_block is putting; -1: none */
    /* swap space: slots of one block each, allocated at the first swap */
    size_t swap_bytes;
    uint8_t *swap_mem;
    int32_t *swap_free;
    int swap_slots, swap_n_free;
    kv_store_swap_stats swap;
    double copy_rate;
    int swap_tier;         /* the durable (disk) tier that takes what the swap space cannot; -1: none */
    uint64_t swap_nonce, swap_count; /* names of swapped blocks there: never a content key */
    /* sliding window (kv_store_params.window, .local) */
    int window, slack;
    kv_store *local;       /* the local layers' store, or NULL */
    int *layer_at;         /* with local: per model layer, its index in its store */
    uint8_t *is_local;     /* with local: per model layer */
    kv_blockauth *auth;    /* owned (the global store's; the local store's pool shares it) */
};

struct kv_swap {
    int len, n_blocks, stage_block;
    bool compacted;
    int32_t *tokens;
    kv_key *keys;
    int32_t *slots;    /* per block: its slot in the swap space */
    kv_key *dkeys;     /* or, when the swap space was full, its key in the swap tier */
    uint16_t *stage;   /* q4_kc: the sequence's staging; NULL otherwise */
    struct kv_swap *local; /* the local layers' store's part, or NULL */
    int first;         /* sliding window: blocks before this one were dropped (not kept; n_blocks counts from it) */
};

static void window_drop(kv_store *s, int seq);
static void on_demote(void *user, kv_cache *c, int32_t b);
static void on_indexed(void *user, kv_cache *c, int32_t b);
static void on_miss(void *user, kv_cache *c, int seq, const int32_t *tokens, int have, int want);

static kv_store *store_create(const kv_store_params *p, const kv_blockauth *auth, kvlm_error *err);
static int tier_buffers(kv_store *s, size_t blob, kvlm_error *err);

kv_store *kv_store_create(const kv_store_params *p, kvlm_error *err) {
    kv_store *local = NULL;
    if (p->local) {
        if (p->local->local || !p->layer_local || p->local->window <= 0 || p->local->auth) {
            for (int t = 0; t < p->n_tiers; t++) kv_tier_close(p->tiers[t]);
            for (int t = 0; t < p->local->n_tiers; t++) kv_tier_close(p->local->tiers[t]);
            kv_blockauth_free(p->auth);
            util_err_set(err, KVLM_EINVAL, "a local layers' store needs a window, a layer map and no store or key of its own");
            return NULL;
        }
        if (!(local = store_create(p->local, p->auth, err))) {
            for (int t = 0; t < p->n_tiers; t++) kv_tier_close(p->tiers[t]);
            kv_blockauth_free(p->auth);
            return NULL;
        }
    }
    kv_store *s = store_create(p, p->auth, err);
    if (!s) {
        kv_store_free(local);
        kv_blockauth_free(p->auth);
        return NULL;
    }
    s->auth = p->auth;
    if (local) {
        int n = p->pool.n_layers + p->local->pool.n_layers, at[2] = {0, 0};
        s->local = local;
        s->layer_at = malloc((size_t)n * sizeof(int));
        s->is_local = malloc((size_t)n);
        if (!s->layer_at || !s->is_local) {
            util_err_set(err, KVLM_ENOMEM, "out of memory");
            kv_store_free(s);
            return NULL;
        }
        for (int l = 0; l < n; l++) {
            s->is_local[l] = p->layer_local[l] ? 1 : 0;
            s->layer_at[l] = at[s->is_local[l]]++;
        }
        if (at[0] != p->pool.n_layers || at[1] != p->local->pool.n_layers) {
            util_err_set(err, KVLM_EINVAL, "the layer map names %d global and %d local layers; the stores have %d and %d",
                         at[0], at[1], p->pool.n_layers, p->local->pool.n_layers);
            kv_store_free(s);
            return NULL;
        }
    }
    return s;
}

static kv_store *store_create(const kv_store_params *p, const kv_blockauth *auth, kvlm_error *err) {
    kv_store *s = calloc(1, sizeof *s);
    if (!s) {
        for (int t = 0; t < p->n_tiers; t++) kv_tier_close(p->tiers[t]);
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        return NULL;
    }
    s->window = p->window > 0 ? p->window : 0;
    s->threads = p->threads;
    s->slack = p->window_slack > 0 ? p->window_slack : 1;
    for (int t = 0; t < p->n_tiers && t < KV_STORE_MAX_TIERS; t++)
        if (p->tiers[t]) {
            s->tiers[s->n_tiers] = p->tiers[t];
            s->roles[s->n_tiers++] = p->roles[t];
        }
    kv_params pool = p->pool;
    pool.auth = auth;
    s->c = kv_create(&pool, err);
    if (!s->c) { kv_store_free(s); return NULL; }
    s->p = *kv_get_params(s->c);
    s->guest_lo = s->p.max_seqs;
    s->putting = -1;
    s->k_row = op_kv_row_bytes(s->p.k_type, s->p.head_dim);
    s->v_row = op_kv_row_bytes(s->p.v_type, s->p.head_dim);
    s->stage_block = malloc((size_t)s->p.max_seqs * sizeof(int));
    if (!s->stage_block) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        kv_store_free(s);
        return NULL;
    }
    for (int i = 0; i < s->p.max_seqs; i++) s->stage_block[i] = -1;
    s->swap_bytes = p->swap_bytes;
    size_t slots = p->swap_bytes / kv_block_bytes(s->c);
    s->swap_slots = slots > (1u << 30) ? (1 << 30) : (int)slots;
    s->swap.slots = (uint64_t)s->swap_slots;
    s->swap_tier = -1;
    for (int t = 0; t < s->n_tiers; t++)
        if (s->swap_bytes && s->swap_tier < 0 && (s->roles[t] & KV_TIER_DURABLE)) s->swap_tier = t;
    /* swapped blocks in a shared directory must not meet another process's */
    s->swap_nonce = (uint64_t)(uintptr_t)s ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(util_now_s() * 1e9);
    if (s->n_tiers) {
        s->fmt = *kv_get_blockfmt(s->c);
        s->blob_bytes = kv_blockfmt_bytes(&s->fmt);
        s->in_tier = calloc((size_t)s->p.n_blocks, 1);
        if (!s->in_tier || tier_buffers(s, s->blob_bytes, err)) {
            util_err_set(err, KVLM_ENOMEM, "out of memory for the KV tiers' buffers");
            kv_store_free(s);
            return NULL;
        }
        kv_hooks h = {on_demote, on_indexed, on_miss, s};
        kv_set_hooks(s->c, &h);
    }
    return s;
}

void kv_store_free(kv_store *s) {
    if (!s) return;
    kv_store_free(s->local); /* persists itself */
    s->local = NULL;
    free(s->layer_at);
    free(s->is_local);
    if (s->c) kv_store_persist(s);
    for (int t = 0; t < s->n_tiers; t++) kv_tier_close(s->tiers[t]);
    kv_free(s->c);
    free(s->stage_block);
    free(s->ser);
    free(s->in_tier);
    free(s->pbuf);
    free(s->swap_mem);
    free(s->swap_free);
    kv_blockauth_free(s->auth); /* after the pool and the local store, whose layouts point at it */
    free(s);
}

/* ---- tiers ---- */

/* Room for serialized blocks of up to blob bytes (one to write, a promotion's
 * batch to read); grows only. */
static int tier_buffers(kv_store *s, size_t blob, kvlm_error *err) {
    if (blob <= s->blob_cap) return KVLM_OK;
    uint8_t *ser = malloc(blob), *pbuf = malloc(PROMOTE_BATCH * blob);
    if (!ser || !pbuf) {
        free(ser);
        free(pbuf);
        return util_err_set(err, KVLM_ENOMEM, "out of memory for the KV tiers' buffers");
    }
    free(s->ser);
    free(s->pbuf);
    s->ser = ser;
    s->pbuf = pbuf;
    s->blob_cap = blob;
    for (int i = 0; i < PROMOTE_BATCH; i++) s->bufs[i] = s->pbuf + (size_t)i * blob;
    return KVLM_OK;
}

/* Block b in its layout's stored form into out; returns its bytes. */
static size_t serialize(kv_store *s, int32_t b, uint8_t *out) {
    const kv_blockfmt *f = kv_block_blockfmt(s->c, b);
    kv_blockfmt_begin(f, kv_block_key_of(s->c, b), kv_block_tokens(s->c, b), out);
    kv_block_read(s->c, b, out + kv_blockfmt_payload_offset(f));
    kv_blockfmt_seal(f, out);
    return kv_blockfmt_bytes(f);
}

/* Puts block b to every tier with one of these roles that lacks it. ask:
 * ask each tier first (a block's key names its bytes, so a tier that has
 * the key has the block: a block pushed out again after it came back from
 * another instance, or after being computed again, costs no read from the
 * pool and no write). */
static void put_block(kv_store *s, int32_t b, int role, uint64_t *count, bool ask) {
    size_t len = 0;
    for (int t = 0; t < s->n_tiers; t++) {
        if (!(s->roles[t] & role) || (s->in_tier[b] & (1u << t))) continue;
        if (ask && kv_tier_contains(s->tiers[t], 1, kv_block_key_of(s->c, b)) == 1) {
            s->in_tier[b] |= (uint8_t)(1u << t);
            continue;
        }
        if (!len) len = serialize(s, b, s->ser);
        s->putting = b; /* a host tier's watch tells the event what the block holds */
        bool ok = kv_tier_put(s->tiers[t], kv_block_key_of(s->c, b), s->ser, len);
        s->putting = -1;
        if (ok) {
            s->in_tier[b] |= (uint8_t)(1u << t);
            count[t]++;
        }
    }
}

static void on_demote(void *user, kv_cache *c, int32_t b) {
    (void)c;
    kv_store *s = user;
    put_block(s, b, KV_TIER_DEMOTE, s->demoted, true);
    s->in_tier[b] = 0; /* the block is about to hold something else */
}

static void on_indexed(void *user, kv_cache *c, int32_t b) {
    (void)c;
    kv_store *s = user;
    s->in_tier[b] = 0;
    put_block(s, b, KV_TIER_THROUGH, s->through, false);
}

static void note_corrupt(kv_store *s, int t, const kv_key *key, const char *why) {
    bool forged = why == kv_blockfmt_why_forged;
    if (forged) kv_tier_note_forged(s->tiers[t]);
    else kv_tier_note_corrupt(s->tiers[t]);
    kv_tier_drop(s->tiers[t], key);
    bool *logged = forged ? &s->logged_forged[t] : &s->logged_corrupt[t];
    if (!*logged) {
        char hex[KV_KEY_HEX];
        kv_key_hex(key, hex);
        LOG_WARN("kv tier %s: block %s is %s (%s); dropped and recomputed (further ones are only counted)",
                 s->tiers[t]->ops->name, hex, forged ? "not authentic" : "damaged", why);
        *logged = true;
    }
}

/* The keys of blocks [i, i + n) of tokens after parent (i == 0: the
 * sequence's root), blocks of format f. */
static void chain_keys(const kv_blockfmt *f, const kv_key *parent, const int32_t *tokens, int i, int n, kv_key *out) {
    int bs = f->block_size;
    for (int j = 0; j < n; j++) kv_block_key(f, j ? &out[j - 1] : parent, tokens + (size_t)(i + j) * bs, &out[j]);
}

/* Checks promoted blocks [lo, hi) of a batch (tokens: the batch's first
 * block's) into payloads[] and whys[]; signed blocks on the store's threads
 * (HMAC-SHA-256 is ~0.4 ms a 576 KiB block: a 2,048-token prefix's 128
 * blocks cost 54 ms on one thread), checksummed ones on this one. */
typedef struct {
    kv_store *s;
    const kv_blockfmt *f;
    const int32_t *tokens;
    int lo, hi;
} check_job;

static void check_range(void *arg, int ith, int nth) {
    check_job *c = arg;
    kv_store *s = c->s;
    long a, b;
    util_split(c->hi - c->lo, ith, nth, &a, &b);
    for (int j = c->lo + (int)a; j < c->lo + (int)b; j++) {
        s->whys[j] = NULL;
        s->payloads[j] = s->lens[j] ? kv_blockfmt_check(c->f, &s->keys[j], c->tokens + (size_t)j * c->f->block_size,
                                                        s->bufs[j], s->lens[j], &s->whys[j])
                                    : NULL;
    }
}

static void check_batch(kv_store *s, const kv_blockfmt *f, const int32_t *tokens, int lo, int hi) {
    check_job c = {s, f, tokens, lo, hi};
    if (f->auth && s->threads && hi - lo > 1) util_pool_run(s->threads, check_range, &c);
    else check_range(&c, 0, 1);
}

static void on_miss(void *user, kv_cache *c, int seq, const int32_t *tokens, int have, int want) {
    kv_store *s = user;
    const kv_blockfmt *f = kv_seq_blockfmt(c, seq); /* the pool's, or a guest sequence's */
    int bs = f->block_size, i = have;
    kv_key parent = i > 0 ? *kv_seq_key(c, seq, i - 1) : *kv_seq_root(c, seq);
    while (i < want) {
        int n = want - i < PROMOTE_BATCH ? want - i : PROMOTE_BATCH, got = 0;
        chain_keys(f, &parent, tokens, i, n, s->keys);
        for (int t = 0; t < s->n_tiers && got < n; t++) {
            int k = kv_tier_get(s->tiers[t], n - got, s->keys + got, s->bufs + got, s->blob_cap, s->lens + got);
            check_batch(s, f, tokens + (size_t)i * bs, got, got + k);
            for (int j = got; j < got + k; j++) {
                const uint8_t *payload = s->payloads[j];
                if (!payload) { /* damaged: recompute it (a colder tier may still have it) */
                    /* the ones after it are not used: each damaged one is
                     * still counted and dropped, not met again later */
                    for (int u = j; u < got + k; u++)
                        if (!s->payloads[u] && s->whys[u]) note_corrupt(s, t, &s->keys[u], s->whys[u]);
                    k = j - got;
                    break;
                }
                int32_t b = kv_seq_attach_block(c, seq, tokens + (size_t)(i + j) * bs, &s->keys[j]);
                if (b < 0) return; /* the pool has no room: the rest is computed */
                kv_block_write(c, b, payload);
                s->in_tier[b] = (uint8_t)(1u << t);
                s->promoted[t]++;
                /* a windowed store lets the blocks before the window go as it
                 * promotes, so a prefix longer than its pool still comes back */
                window_drop(s, seq);
            }
            got += k;
        }
        if (got == 0) return;
        parent = s->keys[got - 1];
        i += got;
        if (got < n) return;
    }
}

int kv_store_tier_stats_get(const kv_store *s, kv_store_tier_stats *out, int cap) {
    for (int t = 0; t < s->n_tiers && t < cap; t++) {
        memset(&out[t], 0, sizeof out[t]);
        out[t].name = s->tiers[t]->ops->name;
        kv_tier_stats_get(s->tiers[t], &out[t].st);
        out[t].promoted = s->promoted[t];
        out[t].demoted = s->demoted[t];
        out[t].written_through = s->through[t];
        out[t].persisted = s->persisted[t];
    }
    return s->n_tiers;
}

/* Every indexed block (only_guest: of the guest layout) to each durable
 * tier that lacks it, then waits for the writes. */
static void persist_blocks(kv_store *s, bool only_guest) {
    for (int32_t b = 0; b < s->p.n_blocks; b++) {
        if (!kv_block_indexed(s->c, b) || (only_guest && !kv_block_guest(s->c, b))) continue;
        for (int t = 0; t < s->n_tiers; t++) {
            if (!(s->roles[t] & KV_TIER_DURABLE) || (s->in_tier[b] & (1u << t))) continue;
            size_t len = serialize(s, b, s->ser);
            const kv_key *key = kv_block_key_of(s->c, b);
            /* a full queue: wait for it once rather than lose the block */
            bool ok = kv_tier_put(s->tiers[t], key, s->ser, len);
            if (!ok) {
                kv_tier_flush(s->tiers[t]);
                ok = kv_tier_put(s->tiers[t], key, s->ser, len);
            }
            if (ok) {
                s->in_tier[b] |= (uint8_t)(1u << t);
                s->persisted[t]++;
            }
        }
    }
    for (int t = 0; t < s->n_tiers; t++) kv_tier_flush(s->tiers[t]);
}

void kv_store_persist(kv_store *s) {
    if (s->local) kv_store_persist(s->local);
    if (s->n_tiers) persist_blocks(s, false);
}

const kv_params *kv_store_params_of(const kv_store *s) { return &s->p; }
const int32_t *kv_store_seq_table(const kv_store *s, int seq, int *n_blocks) {
    return kv_seq_blocks(s->c, seq, n_blocks);
}

void kv_store_layout(const kv_store *s, uint8_t **base, size_t *block_bytes, size_t *head_bytes, size_t *v_offset) {
    *base = kv_block_k(s->c, 0, 0, 0);
    *block_bytes = kv_block_bytes(s->c);
    *head_bytes = kv_head_bytes(s->c);
    *v_offset = kv_v_offset_bytes(s->c);
}

kv_cache *kv_store_pool(kv_store *s) { return s->c; }
void kv_store_set_index_listener(kv_store *s, kv_index_fn fn, void *user) { kv_set_index_listener(s->c, fn, user); }

/* A host tier took a key: a pool block's (put_block) is told, with its
 * parent and tokens; anything else (swapped blocks) is not watched. */
static bool host_added(void *user, const kv_key *key) {
    kv_store *s = user;
    if (s->putting < 0) return false;
    int32_t b = s->putting;
    s->tier_fn(s->tier_user, KV_INDEX_ADDED, key, kv_block_parent_of(s->c, b), kv_block_tokens(s->c, b),
               kv_block_size_of(s->c, b));
    return true;
}

static void host_removed(void *user, const kv_key *key) {
    kv_store *s = user;
    s->tier_fn(s->tier_user, KV_INDEX_REMOVED, key, NULL, NULL, 0);
}

static kv_tier *host_tier_of(const kv_store *s) {
    for (int t = 0; t < s->n_tiers; t++)
        if (kv_tier_is_host(s->tiers[t])) return s->tiers[t];
    return NULL;
}

void kv_store_set_tier_listener(kv_store *s, kv_tier_event_fn fn, void *user) {
    kv_tier *h = host_tier_of(s);
    s->tier_fn = fn;
    s->tier_user = user;
    if (!h) return;
    kv_tier_host_watch w = {host_added, host_removed, s};
    kv_tier_host_set_watch(h, fn ? &w : NULL);
}

int kv_store_tier_blocks(kv_store *s, kv_key *out, int cap) {
    kv_tier *h = host_tier_of(s);
    return h ? kv_tier_host_watched(h, out, cap) : 0;
}
int kv_store_indexed_blocks(const kv_store *s, int32_t *out, int cap) { return kv_indexed_blocks(s->c, out, cap); }

/* ---- sequences ---- */

int kv_store_add_guest(kv_store *s, int first_seq, const kv_guest *g, const kv_key *model, int *block_size,
                       kvlm_error *err) {
    int rc = kv_add_guest(s->c, first_seq, g, model, block_size, err);
    if (rc) return rc;
    if (s->n_tiers && (rc = tier_buffers(s, kv_blockfmt_bytes(kv_seq_blockfmt(s->c, first_seq)), err))) {
        kv_drop_guest(s->c, NULL);
        return rc;
    }
    s->guest_lo = first_seq;
    s->g_head_dim = g->head_dim;
    s->gk_type = g->k_type;
    s->gv_type = g->v_type;
    s->gk_row = op_kv_row_bytes(g->k_type, g->head_dim);
    s->gv_row = op_kv_row_bytes(g->v_type, g->head_dim);
    return KVLM_OK;
}

/* The guest's cached blocks go to the durable tiers first, as every block
 * does at a clean stop: the draft context is freed before the pool is. */
int kv_store_drop_guest(kv_store *s, kvlm_error *err) {
    if (s->guest_lo >= s->p.max_seqs) return KVLM_OK;
    if (s->n_tiers) persist_blocks(s, true);
    int rc = kv_drop_guest(s->c, err);
    if (rc) return rc;
    s->guest_lo = s->p.max_seqs;
    /* the guest's blocks are free now: what the tiers hold names no block's bytes */
    for (int32_t b = 0; s->n_tiers && b < s->p.n_blocks; b++)
        if (!kv_block_indexed(s->c, b)) s->in_tier[b] = 0;
    return KVLM_OK;
}

int kv_store_seq_block_size(const kv_store *s, int seq) { return kv_seq_block_size(s->c, seq); }

bool kv_store_seq_valid(const kv_store *s, int seq) { return kv_seq_valid(s->c, seq); }

void kv_store_set_root(kv_store *s, int seq, const kv_key *root) {
    kv_seq_set_root(s->c, seq, root);
    if (s->local) kv_store_set_root(s->local, seq, root);
}
int kv_store_seq_len(const kv_store *s, int seq) { return kv_seq_len(s->c, seq); }
const int32_t *kv_store_seq_tokens(const kv_store *s, int seq) { return kv_seq_tokens(s->c, seq); }
/* Sliding window: the next query (position len) and every later one see
 * keys from len - window + 1 on; the blocks wholly before that go back. */
static void window_drop(kv_store *s, int seq) {
    /* speculating: the window of the first unverified position, which a
     * rollback may return to */
    if (seq >= s->guest_lo) return; /* a guest keeps all its blocks, whatever its model's windows */
    int len = kv_seq_len(s->c, seq), from;
    if (kv_seq_held(s->c, seq, &from) && from < len) len = from;
    int first = len - s->window + 1;
    if (s->window > 0 && first >= s->p.block_size) kv_seq_drop_front(s->c, seq, first / s->p.block_size);
}

/* The local layers' store, for a sequence that has blocks there: a guest's
 * layers are all in this one (kv_store_add_guest). */
static kv_store *local_of(const kv_store *s, int seq) { return seq < s->guest_lo ? s->local : NULL; }

int kv_store_reserve(kv_store *s, int seq, int n_new, kvlm_error *err) {
    int rc = kv_seq_reserve(s->c, seq, n_new, err);
    if (rc || !local_of(s, seq)) return rc;
    if ((rc = kv_store_reserve(s->local, seq, n_new, err))) kv_seq_trim(s->c, seq, kv_seq_len(s->c, seq));
    return rc;
}
void kv_store_trim(kv_store *s, int seq, int n_keep) {
    kv_seq_trim(s->c, seq, n_keep);
    if (local_of(s, seq)) kv_store_trim(s->local, seq, n_keep);
}
void kv_store_commit(kv_store *s, int seq, const int32_t *tokens, int n) {
    kv_seq_commit(s->c, seq, tokens, n);
    window_drop(s, seq);
    if (local_of(s, seq)) kv_store_commit(s->local, seq, tokens, n);
}
void kv_store_release(kv_store *s, int seq) {
    kv_seq_release(s->c, seq);
    if (local_of(s, seq)) kv_store_release(s->local, seq);
}

void kv_store_hold(kv_store *s, int seq, int from) {
    kv_seq_hold(s->c, seq, from);
    if (local_of(s, seq)) kv_store_hold(s->local, seq, from);
}

/* Taken back to n_keep tokens, the sequence's next query (position n_keep)
 * sees keys from n_keep - window + 1 on: none of them may be in a block the
 * window already gave back. */
static bool window_allows(const kv_store *s, int seq, int n_keep) {
    int dropped = s->window && seq < s->guest_lo ? kv_seq_dropped(s->c, seq) : 0;
    return !dropped || !n_keep || n_keep - s->window + 1 >= dropped * s->p.block_size;
}

int kv_store_rollback(kv_store *s, int seq, int n_keep, kvlm_error *err) {
    int len = kv_seq_len(s->c, seq), bs = s->p.block_size;
    if (n_keep < 0 || n_keep > len)
        return util_err_set(err, KVLM_EINVAL, "sequence %d: cannot keep %d tokens of %d", seq, n_keep, len);
    const kv_store *w = !window_allows(s, seq, n_keep) ? s
                        : local_of(s, seq) && !window_allows(s->local, seq, n_keep) ? s->local : NULL;
    if (w)
        return util_err_set(err, KVLM_EINVAL, "sequence %d: the sliding window gave back its first %d tokens' blocks; "
                            "kept to %d tokens, it would need them again (start it over)", seq,
                            kv_seq_dropped(w->c, seq) * w->p.block_size, n_keep);
    bool kc = s->p.k_type == KVLM_CACHE_Q4_KC && seq < s->guest_lo;
    /* q4_kc: a block cut back to partial needs its f16 keys, which the
     * staging keeps only until the next block's first row overwrites them */
    if (kc && n_keep % bs && n_keep < len && len > (n_keep / bs + 1) * bs)
        return util_err_set(err, KVLM_EUNSUPPORTED, "sequence %d: q4_kc keys cannot be taken back across a block "
                            "boundary (from %d to %d tokens, blocks of %d)", seq, len, n_keep, bs);
    kv_seq_trim(s->c, seq, n_keep);
    if (kc && n_keep < len) s->stage_block[seq] = n_keep % bs ? n_keep / bs : -1;
    kv_seq_unhold(s->c, seq);
    window_drop(s, seq);
    return local_of(s, seq) ? kv_store_rollback(s->local, seq, n_keep, err) : KVLM_OK;
}
int kv_store_fork(kv_store *s, int src, int dst, kvlm_error *err) {
    int rc = kv_seq_fork(s->c, src, dst, err);
    if (!rc) s->stage_block[dst] = s->stage_block[src];
    if (!rc && local_of(s, src) && (rc = kv_store_fork(s->local, src, dst, err))) kv_seq_release(s->c, dst);
    return rc;
}

/* A windowed store: the ordinary match first (it promotes from the tiers
 * into RAM), then vLLM's rule over what RAM now holds, which may find a
 * longer hit whose early blocks were dropped. At most max_blocks blocks. */
static int match_window(kv_store *s, int seq, const int32_t *tokens, int n, int max_blocks) {
    int bs = s->p.block_size, cap = max_blocks * bs + 1;
    if (s->n_tiers) {
        kv_seq_match_prefix(s->c, seq, tokens, n < cap ? n : cap);
        kv_seq_release(s->c, seq);
    }
    return kv_seq_match_prefix_window(s->c, seq, tokens, n, s->window, max_blocks);
}

int kv_store_match_prefix(kv_store *s, int seq, const int32_t *tokens, int n) {
    if ((!s->window && !s->local) || seq >= s->guest_lo) return kv_seq_match_prefix(s->c, seq, tokens, n);
    int bs = s->p.block_size, max = n > 0 ? (n - 1) / bs : 0;
    int m = s->window ? match_window(s, seq, tokens, n, max) : kv_seq_match_prefix(s->c, seq, tokens, n);
    if (!s->local || m == 0) return m;
    /* the local layers' hit decides; the global layers keep as much of theirs
     * (a hit of fewer blocks is always one for them) */
    int ml = match_window(s->local, seq, tokens, n, m / bs);
    if (ml < m) kv_seq_trim(s->c, seq, ml);
    return ml;
}

int kv_store_compact(kv_store *s, int seq, const int32_t *keep, int n_keep, kv_rekey_fn rekey, void *user,
                     kvlm_error *err) {
    if (s->window || s->local)
        return util_err_set(err, KVLM_EUNSUPPORTED, "a sliding-window cache keeps absolute positions: no compaction");
    int rc = kv_seq_compact(s->c, seq, keep, n_keep, rekey, user, err);
    if (rc) return rc;
    /* q4_kc: a partial last block's keys now sit in the staging */
    int bs = s->p.block_size;
    s->stage_block[seq] = s->p.k_type == KVLM_CACHE_Q4_KC && n_keep % bs ? n_keep / bs : -1;
    return KVLM_OK;
}

/* ---- the write path and the attention view ---- */

/* The store that holds a model layer of sequence seq, and the layer's index
 * there (a guest's layers: all in this one). */
static kv_store *store_of(const kv_store *s, int seq, int *layer) {
    if (!local_of(s, seq)) return (kv_store *)s;
    int l = *layer;
    *layer = s->layer_at[l];
    return s->is_local[l] ? s->local : (kv_store *)s;
}

void kv_store_write_row(kv_store *s, int layer, int seq, int pos, int head, const float *k, const float *v) {
    s = store_of(s, seq, &layer);
    bool g = seq >= s->guest_lo; /* a guest's row: its own head dimension and block size */
    int HD = g ? s->g_head_dim : s->p.head_dim, bs = g ? kv_seq_block_size(s->c, seq) : s->p.block_size,
        slot = pos % bs;
    size_t k_row = g ? s->gk_row : s->k_row, v_row = g ? s->gv_row : s->v_row;
    int kt = g ? s->gk_type : s->p.k_type, vt = g ? s->gv_type : s->p.v_type;
    int32_t b = kv_seq_blocks(s->c, seq, NULL)[pos / bs];
    if (kt == KVLM_CACHE_Q4_KC) {
        uint16_t *st = kv_seq_stage(s->c, seq, layer, head);
        for (int i = 0; i < HD; i++) st[(size_t)slot * HD + i] = dt_f32_to_f16(k[i]);
        if (slot == bs - 1) op_kv_quantize_kc(st, kv_block_k(s->c, b, layer, head), HD, bs, bs);
    } else op_kv_quantize_row(kt, k, kv_block_k(s->c, b, layer, head) + slot * k_row, HD);
    if (!s->p.v_in_k) op_kv_quantize_row(vt, v, kv_block_v(s->c, b, layer, head) + slot * v_row, HD);
}

void kv_store_rows_written(kv_store *s, const int32_t *seq, const int32_t *pos, int T) {
    int bs = s->p.block_size;
    bool kc = s->p.k_type == KVLM_CACHE_Q4_KC;
    for (int t = 0; t < T; t++) /* a guest's keys are per-token */
        s->stage_block[seq[t]] = kc && seq[t] < s->guest_lo && pos[t] % bs != bs - 1 ? pos[t] / bs : -1;
    if (s->local) kv_store_rows_written(s->local, seq, pos, T);
}

void kv_store_attn_view(const kv_store *s, int layer, int seq, int last_pos, const float **bp, op_attn_args *a) {
    s = store_of(s, seq, &layer);
    const int32_t *blocks = kv_seq_blocks(s->c, seq, NULL);
    int bs = kv_seq_block_size(s->c, seq), need = last_pos / bs + 1;
    for (int i = 0; i < need; i++) bp[i] = (const float *)kv_block_k(s->c, blocks[i], layer, 0);
    a->blocks = bp;
    a->block_size = bs;
    bool g = seq >= s->guest_lo;
    a->k_type = g ? s->gk_type : s->p.k_type;
    a->v_type = g ? s->gv_type : s->p.v_type;
    a->head_bytes = kv_seq_head_bytes(s->c, seq);
    a->v_bytes = kv_seq_v_offset_bytes(s->c, seq);
    a->k_stage = kv_seq_stage(s->c, seq, layer, 0);
    /* the sequence's newest block holds keys in staging only while it
     * fills; blocks before it were quantized when they filled */
    a->stage_block = a->k_stage ? s->stage_block[seq] : -1;
    if (a->stage_block >= need) a->stage_block = -1;
}

/* ---- admission ---- */

static int blocks_for(const kv_store *s, int n) { return (n + s->p.block_size - 1) / s->p.block_size; }

void kv_store_probe_prefix(const kv_store *s, const int32_t *tokens, int n_lookup, int n_hold, kv_store_probe *out) {
    memset(out, 0, sizeof *out);
    int bs = s->p.block_size;
    kv_key last;
    int unref = 0, matched = n_lookup > 0 ? kv_prefix_probe(s->c, tokens, n_lookup, &unref, &last) : 0;
    out->ram_tokens = matched * bs;
    out->cached_tokens = out->ram_tokens;
    int eligible = n_lookup > 0 ? (n_lookup - 1) / bs : 0;
    if (eligible * bs > s->p.max_seq_tokens) eligible = s->p.max_seq_tokens / bs;
    if (s->n_tiers && s->p.prefix_cache && matched < eligible) {
        int n = eligible - matched, at = 0;
        kv_key *keys = malloc((size_t)n * sizeof *keys);
        if (keys) {
            chain_keys(&s->fmt, matched ? &last : NULL, tokens, matched, n, keys);
            for (int t = 0; t < s->n_tiers && at < n; t++) {
                int k = kv_tier_contains(s->tiers[t], n - at, keys + at);
                out->tier_tokens[t] = k * bs;
                out->cached_tokens += k * bs;
                at += k;
            }
            free(keys);
        }
    }
    /* under a window: the window rule may find a longer hit, and the
     * blocks before its window are not held */
    int live = matched;
    if (s->window > 0 && n_lookup > 0) {
        int wl, wm = kv_prefix_probe_window(s->c, tokens, n_lookup, s->window, eligible, &wl);
        if (wm > matched) {
            out->ram_tokens = out->cached_tokens = wm * bs;
            memset(out->tier_tokens, 0, sizeof out->tier_tokens);
            matched = wm;
        }
        live = wm >= matched ? wl : matched;
    }
    /* gemma: the local layers' window rule caps the hit */
    if (s->local && n_lookup > 0 && matched > 0) {
        int wl, wm = kv_prefix_probe_window(s->local->c, tokens, n_lookup, s->local->window, matched, &wl);
        if (wm < matched) {
            out->ram_tokens = out->cached_tokens = wm * bs;
            memset(out->tier_tokens, 0, sizeof out->tier_tokens);
            matched = live = wm;
        }
    }
    int held = kv_store_blocks_held(s, matched * bs);
    out->blocks_needed = kv_store_blocks_held(s, n_hold) - (live < held ? live : held);
    if (out->blocks_needed < 0) out->blocks_needed = 0;
    out->blocks_available = kv_available_blocks(s->c) - unref;
}

int kv_store_blocks_held(const kv_store *s, int n) {
    int all = blocks_for(s, n);
    if (s->window <= 0) return all;
    /* the blocks from the one holding position n - window - slack on: one
     * step's tokens are reserved before the blocks before their window drop */
    int first = n - s->window - s->slack + 1, gone = first > 0 ? first / s->p.block_size : 0;
    return all - gone;
}

int kv_store_seq_blocks_needed(const kv_store *s, int seq, int n_hold) {
    int have = 0, gbs = seq >= s->guest_lo ? kv_seq_block_size(s->c, seq) : 0;
    kv_seq_blocks(s->c, seq, &have);
    have -= kv_seq_dropped(s->c, seq);
    int need = (gbs ? (n_hold + gbs - 1) / gbs : kv_store_blocks_held(s, n_hold)) - have;
    return need > 0 ? need : 0;
}

void kv_store_seq_info(const kv_store *s, int seq, int *n_blocks, int *n_shared) {
    int n = 0, shared = 0;
    const int32_t *b = kv_seq_blocks(s->c, seq, &n);
    for (int i = 0; i < n; i++) shared += kv_block_refs(s->c, b[i]) > 1;
    n -= kv_seq_dropped(s->c, seq);
    if (local_of(s, seq)) { /* both stores' blocks */
        int nl = 0, sl = 0;
        kv_store_seq_info(s->local, seq, &nl, &sl);
        n += nl;
        shared += sl;
    }
    if (n_blocks) *n_blocks = n;
    if (n_shared) *n_shared = shared;
}

/* ---- swap ---- */

static size_t stage_per_seq(const kv_store *s) { return kv_store_stage_bytes(s) / (size_t)s->p.max_seqs; }

size_t kv_store_swap_bytes(const kv_store *s, int seq) {
    int n = 0;
    kv_seq_blocks(s->c, seq, &n);
    n -= kv_seq_dropped(s->c, seq);
    return (size_t)n * kv_block_bytes(s->c) + stage_per_seq(s) + (s->local ? kv_store_swap_bytes(s->local, seq) : 0);
}

static int swap_free_slots(const kv_store *s) { return s->swap_mem ? s->swap_n_free : s->swap_slots; }

bool kv_store_swap_fits(const kv_store *s, int seq) {
    int n = 0;
    kv_seq_blocks(s->c, seq, &n);
    n -= kv_seq_dropped(s->c, seq);
    /* the swap tier takes what the swap space cannot (its puts may still be
     * dropped: kv_store_swap_out then answers EFULL) */
    return seq < s->guest_lo && s->swap_slots > 0 && (n <= swap_free_slots(s) || s->swap_tier >= 0) &&
           (!s->local || kv_store_swap_fits(s->local, seq));
}

/* The swap space, at the first swap: most contexts never preempt. */
static int swap_space(kv_store *s, kvlm_error *err) {
    if (s->swap_mem) return KVLM_OK;
    s->swap_mem = malloc((size_t)s->swap_slots * kv_block_bytes(s->c));
    s->swap_free = malloc((size_t)s->swap_slots * sizeof(int32_t));
    if (!s->swap_mem || !s->swap_free) {
        free(s->swap_mem);
        free(s->swap_free);
        s->swap_mem = NULL;
        s->swap_free = NULL;
        return util_err_set(err, KVLM_ENOMEM, "cannot allocate a KV swap space of %zu bytes", s->swap_bytes);
    }
    for (int i = 0; i < s->swap_slots; i++) s->swap_free[i] = s->swap_slots - 1 - i;
    s->swap_n_free = s->swap_slots;
    return KVLM_OK;
}

static uint8_t *slot_at(const kv_store *s, int32_t slot) {
    return s->swap_mem + (size_t)slot * kv_block_bytes(s->c);
}

/* Block i's tokens as a stored block carries them: block_size of them, a
 * partial last block padded with zeros. */
static const int32_t *swap_block_tokens(const kv_store *s, const kv_swap *h, int i, int32_t *pad) {
    int bs = s->p.block_size;
    i += h->first; /* the handle's block i is the sequence's block first + i */
    if ((i + 1) * bs <= h->len) return h->tokens + (size_t)i * bs;
    memset(pad, 0, (size_t)bs * sizeof *pad);
    memcpy(pad, h->tokens + (size_t)i * bs, (size_t)(h->len - i * bs) * sizeof *pad);
    return pad;
}

void kv_store_swap_drop(kv_store *s, kv_swap *h) {
    if (!h) return;
    if (s->local) kv_store_swap_drop(s->local, h->local);
    if (h->dkeys) {
        for (int i = 0; i < h->n_blocks; i++) kv_tier_drop(s->tiers[s->swap_tier], &h->dkeys[i]);
        s->swap.disk_blocks_used -= (uint64_t)h->n_blocks;
    } else {
        for (int i = 0; i < h->n_blocks; i++) s->swap_free[s->swap_n_free++] = h->slots[i];
        s->swap.slots_used -= (uint64_t)h->n_blocks;
    }
    free(h->tokens);
    free(h->keys);
    free(h->slots);
    free(h->dkeys);
    free(h->stage);
    free(h);
}

/* The victim's blocks to the swap tier, each a stored block (kv/blockfmt)
 * under a fresh key, checked when read back. false: a put was dropped (the
 * ones made are dropped again). */
static bool swap_out_tier(kv_store *s, kv_swap *h, const int32_t *blocks, int32_t *pad) {
    kv_tier *t = s->tiers[s->swap_tier];
    for (int i = 0; i < h->n_blocks; i++) {
        uint64_t id = ++s->swap_count;
        for (int k = 0; k < 8; k++) {
            h->dkeys[i].b[k] = (uint8_t)(s->swap_nonce >> (8 * k));
            h->dkeys[i].b[8 + k] = (uint8_t)(id >> (8 * k));
        }
        kv_blockfmt_begin(&s->fmt, &h->dkeys[i], swap_block_tokens(s, h, i, pad), s->ser);
        kv_block_read(s->c, blocks[i], s->ser + kv_blockfmt_payload_offset(&s->fmt));
        kv_blockfmt_seal(&s->fmt, s->ser);
        if (!kv_tier_put(t, &h->dkeys[i], s->ser, s->blob_bytes)) {
            for (int j = 0; j < i; j++) kv_tier_drop(t, &h->dkeys[j]);
            return false;
        }
    }
    return true;
}

static int swap_out(kv_store *s, int seq, kv_swap **out, kvlm_error *err);

/* With a local layers' store, its part first: undone if the rest fails. */
int kv_store_swap_out(kv_store *s, int seq, kv_swap **out, kvlm_error *err) {
    *out = NULL;
    if (!s->local) return swap_out(s, seq, out, err);
    kv_swap *lh = NULL;
    int rc = swap_out(s->local, seq, &lh, err);
    if (rc) return rc;
    if ((rc = swap_out(s, seq, out, err))) {
        kvlm_error e2 = {0};
        if (kv_store_swap_in(s->local, seq, lh, &e2)) kv_store_swap_drop(s->local, lh);
        return rc;
    }
    (*out)->local = lh;
    return KVLM_OK;
}

static int swap_out(kv_store *s, int seq, kv_swap **out, kvlm_error *err) {
    *out = NULL;
    if (seq >= s->guest_lo)
        return util_err_set(err, KVLM_EUNSUPPORTED, "sequence %d holds a guest layout's blocks: no swap", seq);
    if (!kv_store_swap_fits(s, seq))
        return util_err_set(err, KVLM_EFULL, "the KV swap space has no room for sequence %d", seq);
    int rc = swap_space(s, err);
    if (rc) return rc;
    int n = 0, len = kv_seq_len(s->c, seq), bs = s->p.block_size;
    const int32_t *blocks = kv_seq_blocks(s->c, seq, &n);
    /* blocks beyond len (reserved, not committed) are not kept, nor those a
     * sliding window dropped: keep counts from `first` */
    int first = kv_seq_dropped(s->c, seq), keep = (len + bs - 1) / bs;
    if (keep > n) keep = n;
    keep -= first;
    blocks += first;
    bool to_tier = keep > s->swap_n_free;
    size_t st = stage_per_seq(s);
    kv_swap *h = calloc(1, sizeof *h);
    int32_t *pad = malloc((size_t)bs * sizeof *pad);
    if (!h || !pad || !(h->tokens = malloc((size_t)(len + 1) * sizeof(int32_t))) ||
        !(h->keys = malloc((size_t)(len / bs + 1) * sizeof(kv_key))) ||
        !(h->slots = malloc((size_t)(keep + 1) * sizeof(int32_t))) ||
        (to_tier && !(h->dkeys = malloc((size_t)(keep + 1) * sizeof(kv_key)))) || (st && !(h->stage = malloc(st)))) {
        if (h) { free(h->tokens); free(h->keys); free(h->slots); free(h->dkeys); free(h); }
        free(pad);
        return util_err_set(err, KVLM_ENOMEM, "out of memory");
    }
    h->len = len;
    h->n_blocks = keep;
    h->first = first;
    h->compacted = kv_seq_compacted(s->c, seq);
    h->stage_block = s->stage_block[seq];
    if (len) memcpy(h->tokens, kv_seq_tokens(s->c, seq), (size_t)len * sizeof(int32_t));
    for (int i = 0; i < len / bs; i++) h->keys[i] = *kv_seq_key(s->c, seq, i);
    if (to_tier) {
        bool ok = swap_out_tier(s, h, blocks, pad);
        free(pad);
        if (!ok) {
            free(h->tokens); free(h->keys); free(h->slots); free(h->dkeys); free(h->stage); free(h);
            return util_err_set(err, KVLM_EFULL, "the KV swap space is full and the %s tier dropped a block",
                                s->tiers[s->swap_tier]->ops->name);
        }
        s->swap.disk_blocks_used += (uint64_t)keep;
        s->swap.disk_swaps_out++;
    } else {
        free(pad);
        for (int i = 0; i < keep; i++) {
            h->slots[i] = s->swap_free[--s->swap_n_free];
            kv_block_read(s->c, blocks[i], slot_at(s, h->slots[i]));
        }
        s->swap.slots_used += (uint64_t)keep;
    }
    if (st) memcpy(h->stage, kv_seq_stage(s->c, seq, 0, 0), st);
    s->swap.swaps_out++;
    s->swap.bytes_out += (uint64_t)keep * kv_block_bytes(s->c) + st;
    kv_seq_release(s->c, seq);
    s->stage_block[seq] = -1;
    *out = h;
    return KVLM_OK;
}

/* Reads h's blocks back from the swap tier into host (n_blocks x block
 * bytes), each checked against its key and tokens: false if one is missing
 * or damaged (counted as corrupt, logged once). */
static bool swap_in_tier(kv_store *s, kv_swap *h, uint8_t *host) {
    int t = s->swap_tier;
    kv_tier_flush(s->tiers[t]); /* the puts may still be queued */
    int32_t *pad = malloc((size_t)s->p.block_size * sizeof *pad);
    if (!pad) return false;
    bool ok = true;
    for (int i = 0; i < h->n_blocks && ok; i += PROMOTE_BATCH) {
        int n = h->n_blocks - i < PROMOTE_BATCH ? h->n_blocks - i : PROMOTE_BATCH;
        int got = kv_tier_get(s->tiers[t], n, h->dkeys + i, s->bufs, s->blob_bytes, s->lens);
        for (int j = 0; j < n; j++) { /* every one got: each damaged one is counted and dropped */
            const char *why = NULL;
            const uint8_t *payload =
                j < got && s->lens[j] ? kv_blockfmt_check(&s->fmt, &h->dkeys[i + j], swap_block_tokens(s, h, i + j, pad),
                                                          s->bufs[j], s->lens[j], &why)
                                      : NULL;
            if (!payload) {
                if (why) note_corrupt(s, t, &h->dkeys[i + j], why);
                ok = false;
            } else if (ok) memcpy(host + (size_t)(i + j) * kv_block_bytes(s->c), payload, kv_block_bytes(s->c));
        }
    }
    free(pad);
    return ok;
}

static int swap_in(kv_store *s, int seq, kv_swap *h, kvlm_error *err);

/* With a local layers' store: the global part must fit before the local
 * part comes in; a global part lost in a tier takes the local part with it. */
int kv_store_swap_in(kv_store *s, int seq, kv_swap *h, kvlm_error *err) {
    if (!s->local) return swap_in(s, seq, h, err);
    if (kv_available_blocks(s->c) < h->n_blocks)
        return util_err_set(err, KVLM_EFULL, "the KV cache is full: swapping sequence %d in needs %d blocks", seq,
                            h->n_blocks);
    int rc = swap_in(s->local, seq, h->local, err);
    if (rc == KVLM_EIO) {
        h->local = NULL;
        kv_store_swap_drop(s, h);
    }
    if (rc) return rc;
    h->local = NULL;
    if ((rc = swap_in(s, seq, h, err))) kv_store_release(s->local, seq);
    return rc;
}

static int swap_in(kv_store *s, int seq, kv_swap *h, kvlm_error *err) {
    size_t bb = kv_block_bytes(s->c);
    int32_t *blocks = malloc((size_t)(h->n_blocks + 1) * sizeof(int32_t));
    uint8_t *host = h->dkeys ? malloc((size_t)h->n_blocks * bb + 1) : NULL;
    if (!blocks || (h->dkeys && !host)) {
        free(blocks);
        free(host);
        return util_err_set(err, KVLM_ENOMEM, "out of memory");
    }
    if (kv_available_blocks(s->c) < h->n_blocks) {
        free(blocks);
        free(host);
        return util_err_set(err, KVLM_EFULL, "the KV cache is full: swapping sequence %d in needs %d blocks", seq,
                            h->n_blocks);
    }
    if (h->dkeys && !swap_in_tier(s, h, host)) {
        s->swap.disk_lost++;
        free(blocks);
        free(host);
        kv_store_swap_drop(s, h);
        return util_err_set(err, KVLM_EIO, "a swapped-out block of sequence %d was lost or damaged in the %s tier",
                            seq, s->tiers[s->swap_tier]->ops->name);
    }
    int rc = kv_seq_restore_from(s->c, seq, h->tokens, h->keys, h->len, h->compacted, h->first, blocks, err);
    if (rc) { free(blocks); free(host); return rc; }
    for (int i = 0; i < h->n_blocks; i++)
        kv_block_write(s->c, blocks[i], h->dkeys ? host + (size_t)i * bb : slot_at(s, h->slots[i]));
    free(blocks);
    free(host);
    size_t st = stage_per_seq(s);
    if (st) memcpy(kv_seq_stage(s->c, seq, 0, 0), h->stage, st);
    s->stage_block[seq] = h->stage_block;
    s->swap.swaps_in++;
    if (h->dkeys) s->swap.disk_swaps_in++;
    s->swap.bytes_in += (uint64_t)h->n_blocks * bb + st;
    kv_store_swap_drop(s, h);
    return KVLM_OK;
}

int kv_swap_blocks(const kv_swap *h) { return h->n_blocks; }
int kv_swap_tokens(const kv_swap *h) { return h->len; }

double kv_store_copy_rate(kv_store *s) {
    if (s->copy_rate > 0) return s->copy_rate;
    size_t bb = kv_block_bytes(s->c);
    int n = (int)((8u << 20) / bb);
    if (n < 1) n = 1;
    if (n > s->p.n_blocks) n = s->p.n_blocks;
    uint8_t *buf = malloc((size_t)n * bb);
    if (!buf) return 0;
    /* a round trip of the same bytes: what swapping out and back in costs */
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = util_now_s();
        for (int b = 0; b < n; b++) kv_block_read(s->c, b, buf + (size_t)b * bb);
        for (int b = 0; b < n; b++) kv_block_write(s->c, b, buf + (size_t)b * bb);
        double dt = util_now_s() - t0;
        double rate = dt > 0 ? (double)n * bb / dt : 0;
        if (rate > best) best = rate;
    }
    free(buf);
    s->copy_rate = best;
    return best;
}

void kv_store_swap_stats_get(const kv_store *s, kv_store_swap_stats *st) { *st = s->swap; }

/* ---- sizes and statistics ---- */

size_t kv_store_block_bytes(const kv_store *s) { return kv_block_bytes(s->c); }
size_t kv_store_token_bytes(const kv_store *s) {
    return kv_token_bytes(s->c) + (s->local ? kv_store_token_bytes(s->local) : 0);
}
size_t kv_store_stage_bytes(const kv_store *s) {
    return kv_stage_bytes(s->c) + (s->local ? kv_store_stage_bytes(s->local) : 0);
}
/* With a local layers' store, both pools' blocks are counted together. */
void kv_store_stats(const kv_store *s, kv_stats *st) {
    kv_get_stats(s->c, st);
    if (!s->local) return;
    kv_stats l;
    kv_store_stats(s->local, &l);
    st->n_blocks += l.n_blocks;
    st->used += l.used;
    st->cached += l.cached;
    st->free += l.free;
    st->hits += l.hits;
    st->misses += l.misses;
    st->evictions += l.evictions;
    st->shared += l.shared;
}
kv_store *kv_store_local(kv_store *s) { return s->local; }
size_t kv_store_held_bytes(const kv_store *s) {
    kv_stats st;
    kv_get_stats(s->c, &st);
    return (size_t)st.used * kv_block_bytes(s->c) + (s->local ? kv_store_held_bytes(s->local) : 0);
}
