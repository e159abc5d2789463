/* engine/kv_api: the public KV calls of a context (sequences, swap, fork,
 * prefix reuse and probes, tiers, sessions, events, stats) passed to kv/store. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kv/session.h"
#include "kv/store.h"
#include "util/error.h"
#include "engine/ctx.h"
#include "engine/engine.h"

void kvlm_seq_free(kvlm_ctx *ctx, int seq) {
    if (!seq_ok(ctx, seq)) return;
    kv_store_release(ctx->kv, seq);
    ctx->evict.n_evicted[seq] = 0;
    if (ctx->evict.h2o) memset(h2o_scores(ctx, seq), 0, (size_t)ctx->evict.budget * sizeof(float));
    if (ctx->spec.seq) { ctx->spec.seq[seq].on = false; ctx->spec.seq[seq].from = -1; }
}

/* ---- swap ---- */

struct kvlm_swap {
    kv_swap *kv;
    long n_evicted;
    float *h2o; /* h2o: the sequence's accumulated attention */
};

size_t kvlm_seq_swap_bytes(const kvlm_ctx *ctx, int seq) {
    return seq_ok(ctx, seq) ? kv_store_swap_bytes(ctx->kv, seq) : 0;
}

bool kvlm_seq_swap_fits(const kvlm_ctx *ctx, int seq) {
    return seq_ok(ctx, seq) && kv_store_swap_fits(ctx->kv, seq);
}

int kvlm_seq_swap_out(kvlm_ctx *ctx, int seq, kvlm_swap **out, kvlm_error *err) {
    *out = NULL;
    if (!seq_ok(ctx, seq)) return bad_seq(ctx, err);
    kvlm_swap *h = calloc(1, sizeof *h);
    if (!h || (ctx->evict.h2o && !(h->h2o = malloc((size_t)ctx->evict.budget * sizeof(float))))) {
        free(h);
        return util_err_set(err, KVLM_ENOMEM, "out of memory");
    }
    int rc = kv_store_swap_out(ctx->kv, seq, &h->kv, err);
    if (rc) { free(h->h2o); free(h); return rc; }
    h->n_evicted = ctx->evict.n_evicted[seq];
    if (h->h2o) memcpy(h->h2o, h2o_scores(ctx, seq), (size_t)ctx->evict.budget * sizeof(float));
    kvlm_seq_free(ctx, seq); /* the store released it: this clears the rest */
    *out = h;
    return KVLM_OK;
}

int kvlm_seq_swap_in(kvlm_ctx *ctx, int seq, kvlm_swap *h, kvlm_error *err) {
    if (!seq_ok(ctx, seq) || !h) return bad_seq(ctx, err);
    kvlm_seq_free(ctx, seq);
    int rc = kv_store_swap_in(ctx->kv, seq, h->kv, err);
    if (rc == KVLM_EIO) { /* the store freed its part: lost in the tier */
        free(h->h2o);
        free(h);
    }
    if (rc) return rc;
    ctx->evict.n_evicted[seq] = h->n_evicted;
    if (h->h2o) memcpy(h2o_scores(ctx, seq), h->h2o, (size_t)ctx->evict.budget * sizeof(float));
    free(h->h2o);
    free(h);
    return KVLM_OK;
}

void kvlm_swap_free(kvlm_ctx *ctx, kvlm_swap *h) {
    if (!h) return;
    kv_store_swap_drop(ctx->kv, h->kv);
    free(h->h2o);
    free(h);
}

int kvlm_swap_blocks(const kvlm_swap *h) { return h ? kv_swap_blocks(h->kv) : 0; }

void kvlm_ctx_preempt_rates(kvlm_ctx *ctx, double *copy_bytes_per_s, double *tokens_per_s) {
    if (copy_bytes_per_s) *copy_bytes_per_s = kv_store_copy_rate(ctx->kv);
    if (tokens_per_s)
        *tokens_per_s = ctx->stats.compute_seconds > 0 ? (double)ctx->stats.tokens_computed / ctx->stats.compute_seconds : 0;
}

void kvlm_ctx_reset(kvlm_ctx *ctx) {
    for (int s = ctx->seq_lo; s < ctx->seq_end; s++) kvlm_seq_free(ctx, s);
    ctx->rs.n_logits = 0;
}

int kvlm_seq_fork(kvlm_ctx *ctx, int src, int dst, kvlm_error *err) {
    if (!seq_ok(ctx, src) || !seq_ok(ctx, dst)) return bad_seq(ctx, err);
    if (ctx->spec.seq && (ctx->spec.seq[src].on || ctx->spec.seq[dst].on) && src != dst)
        return util_err_set(err, KVLM_EINVAL, "sequence %d holds unverified tokens: trim it before forking",
                            ctx->spec.seq[src].on ? src : dst);
    int rc = kv_store_fork(ctx->kv, src, dst, err);
    if (rc || src == dst) return rc;
    ctx->evict.n_evicted[dst] = ctx->evict.n_evicted[src];
    if (ctx->evict.h2o) memcpy(h2o_scores(ctx, dst), h2o_scores(ctx, src), (size_t)ctx->evict.budget * sizeof(float));
    return KVLM_OK;
}

int kvlm_seq_reuse_prefix(kvlm_ctx *ctx, int seq, const int32_t *tokens, int n) {
    if (!seq_ok(ctx, seq) || n <= 0) return 0;
    return kv_store_match_prefix(ctx->kv, seq, tokens, n);
}

void kvlm_seq_kv_info(const kvlm_ctx *ctx, int seq, int *n_blocks, int *n_shared) {
    int n = 0, shared = 0;
    if (seq_ok(ctx, seq)) kv_store_seq_info(ctx->kv, seq, &n, &shared);
    if (n_blocks) *n_blocks = n;
    if (n_shared) *n_shared = shared;
}

void kvlm_seq_probe_prefix(const kvlm_ctx *ctx, const int32_t *tokens, int n_lookup, int n_hold,
                           kvlm_prefix_probe *out) {
    kv_store_probe pr;
    kv_store_probe_prefix(ctx->kv, tokens, ctx->p.no_kv_cache ? 0 : n_lookup, n_hold, &pr);
    memset(out, 0, sizeof *out);
    out->cached_tokens = pr.cached_tokens;
    out->ram_tokens = pr.ram_tokens;
    for (int t = 0; t < 4 && t < KV_STORE_MAX_TIERS; t++) out->tier_tokens[t] = pr.tier_tokens[t];
    out->blocks_needed = pr.blocks_needed;
    out->blocks_available = pr.blocks_available;
}

int kvlm_seq_blocks_needed(const kvlm_ctx *ctx, int seq, int n_hold) {
    return seq_ok(ctx, seq) ? kv_store_seq_blocks_needed(ctx->kv, seq, n_hold) : 0;
}

int kvlm_kv_tier_stats_get(const kvlm_ctx *ctx, kvlm_kv_tier_stats *out, int cap) {
    kv_store_tier_stats ts[KV_STORE_MAX_TIERS];
    int n = kv_store_tier_stats_get(ctx->kv, ts, KV_STORE_MAX_TIERS);
    for (int t = 0; t < n && t < cap; t++) {
        kvlm_kv_tier_stats *o = &out[t];
        const kv_tier_stats *st = &ts[t].st;
        memset(o, 0, sizeof *o);
        snprintf(o->name, sizeof o->name, "%s", ts[t].name);
        o->blocks = st->blocks;
        o->bytes = st->bytes;
        o->hits = st->hits;
        o->misses = st->misses;
        o->writes = st->writes;
        o->write_bytes = st->write_bytes;
        o->dropped_writes = st->dropped_writes;
        o->corrupt = st->corrupt;
        o->forged = st->forged;
        o->errors = st->errors;
        o->evicted = st->evicted;
        o->reads = st->reads;
        o->read_seconds = st->read_seconds;
        o->up = st->up;
        o->promoted = ts[t].promoted;
        o->demoted = ts[t].demoted;
        o->written_through = ts[t].written_through;
        o->persisted = ts[t].persisted;
    }
    return n;
}

/* Whether the cache has sliding-window stores (kv_store_params.window, .local). */
static bool swa_cache(const kvlm_ctx *ctx) {
    const kvlm_config *c = &ctx->model->cfg;
    return c->sliding_window > 0 && c->n_local_layers > 0 && !ctx->p.no_kv_cache;
}

int kvlm_session_save(kvlm_ctx *ctx, int seq, const char *path, kvlm_error *err) {
    if (!seq_ok(ctx, seq) || !path)
        return util_err_set(err, KVLM_EINVAL, "bad sequence or session path");
    if (ctx->evict.n_evicted[seq])
        return util_err_set(err, KVLM_EINVAL, "sequence %d evicted tokens: its cache no longer matches its text", seq);
    if (swa_cache(ctx))
        return util_err_set(err, KVLM_EUNSUPPORTED, "sessions of a sliding-window model are not supported (its cache "
                            "released the blocks before the window, and keeps the local layers apart)");
    return kv_session_save(ctx->kv, seq, path, err);
}

int kvlm_session_load(kvlm_ctx *ctx, int seq, const int32_t *tokens, int n, const char *path, kvlm_error *err) {
    if (!seq_ok(ctx, seq) || !path || n <= 0) return -util_err_set(err, KVLM_EINVAL, "bad arguments");
    if (swa_cache(ctx))
        return -util_err_set(err, KVLM_EUNSUPPORTED, "sessions of a sliding-window model are not supported");
    return kv_session_load(ctx->kv, seq, tokens, n, path, err);
}

void kvlm_ctx_kv_persist(kvlm_ctx *ctx) {
    if (ctx && ctx->kv) kv_store_persist(ctx->kv);
}

/* layers x KV heads x (K + V bytes of a block) / block size: the types' real
 * bytes per element (q8_0 at head_dim 64: 34/32) times the elements. */
static size_t bytes_per_token(const kvlm_ctx *ctx) { return kv_store_token_bytes(ctx->kv); }

size_t kvlm_ctx_kv_bytes(const kvlm_ctx *ctx) {
    /* a sliding window holds blocks, not tokens: what they take */
    if (swa_cache(ctx)) return kv_store_held_bytes(ctx->kv);
    /* from the block bytes, so q4_kc's per-block figures stay exact (a
     * draft's guest layout: more tokens a block) */
    size_t bytes = 0, bb = kv_store_block_bytes(ctx->kv);
    for (int s = 0; s < kv_store_params_of(ctx->kv)->max_seqs; s++)
        bytes += (size_t)kv_store_seq_len(ctx->kv, s) * bb / (size_t)kv_store_seq_block_size(ctx->kv, s);
    return bytes;
}

size_t kvlm_ctx_kv_capacity_bytes(const kvlm_ctx *ctx) {
    kv_store *l = kv_store_local(ctx->kv);
    size_t local = l ? kv_store_block_bytes(l) * (size_t)kv_store_params_of(l)->n_blocks : 0;
    return kv_store_block_bytes(ctx->kv) * (size_t)kv_store_params_of(ctx->kv)->n_blocks + local +
           kv_store_stage_bytes(ctx->kv);
}

/* ---- KV events ---------------------------------------------------------------- */

/* One event to the sink: a block of medium entered (with its parent and
 * tokens) or left. */
static void send_event(kvlm_ctx *ctx, int medium, int what, const kv_key *key, const kv_key *parent,
                       const int32_t *tokens, int n_tokens) {
    kvlm_kv_event ev;
    memset(&ev, 0, sizeof ev);
    memcpy(ev.hash, key->b, 16);
    ev.medium = medium;
    if (what == KV_INDEX_ADDED) {
        static const uint8_t zero[16];
        ev.kind = KVLM_KV_EVENT_STORED;
        memcpy(ev.parent, parent->b, 16);
        ev.has_parent = memcmp(ev.parent, zero, 16) != 0;
        ev.tokens = tokens;
        ev.n_tokens = n_tokens;
    } else ev.kind = KVLM_KV_EVENT_REMOVED;
    ctx->events.event(ctx->events.user, &ev);
}

static void on_index(void *user, const kv_cache *c, int what, int32_t b) {
    bool added = what == KV_INDEX_ADDED; /* a draft's guest layout holds more tokens a block */
    send_event(user, KVLM_KV_MEDIUM_POOL, what, kv_block_key_of(c, b), added ? kv_block_parent_of(c, b) : NULL,
               added ? kv_block_tokens(c, b) : NULL, added ? kv_block_size_of(c, b) : 0);
}

static void on_tier(void *user, int what, const kv_key *key, const kv_key *parent, const int32_t *tokens,
                    int n_tokens) {
    send_event(user, KVLM_KV_MEDIUM_HOST, what, key, parent, tokens, n_tokens);
}

void kvlm_ctx_set_kv_event_sink(kvlm_ctx *ctx, const kvlm_kv_event_sink *sink) {
    if (sink && sink->event) ctx->events = *sink;
    else memset(&ctx->events, 0, sizeof ctx->events);
    kv_store_set_index_listener(ctx->kv, ctx->events.event ? on_index : NULL, ctx);
    kv_store_set_tier_listener(ctx->kv, ctx->events.event ? on_tier : NULL, ctx);
}

void kvlm_ctx_kv_events_flush(kvlm_ctx *ctx) {
    if (ctx->events.flush) ctx->events.flush(ctx->events.user);
}

int kvlm_kv_cached_blocks(kvlm_ctx *ctx, uint8_t (*keys)[16], int cap) {
    int nb = kv_store_params_of(ctx->kv)->n_blocks;
    if (!ctx->blocks_tmp && !(ctx->blocks_tmp = malloc((size_t)nb * sizeof(int32_t)))) return -1;
    int n = kv_store_indexed_blocks(ctx->kv, ctx->blocks_tmp, nb);
    kv_cache *c = kv_store_pool(ctx->kv);
    for (int i = 0; i < n && i < cap; i++) memcpy(keys[i], kv_block_key_of(c, ctx->blocks_tmp[i])->b, 16);
    return n;
}

int kvlm_kv_host_blocks(kvlm_ctx *ctx, uint8_t (*keys)[16], int cap) {
    kv_key *k = cap > 0 ? malloc((size_t)cap * sizeof *k) : NULL;
    if (cap > 0 && !k) return -1;
    int n = kv_store_tier_blocks(ctx->kv, k, cap);
    for (int i = 0; i < n && i < cap; i++) memcpy(keys[i], k[i].b, 16);
    free(k);
    return n;
}

void kvlm_kv_stats_get(const kvlm_ctx *ctx, kvlm_kv_stats *st) {
    kv_stats s;
    kv_store_stats(ctx->kv, &s);
    memset(st, 0, sizeof *st);
    st->block_size = kv_store_seq_block_size(ctx->kv, ctx->seq_lo); /* a guest layout's: a draft context's own */
    st->n_blocks = s.n_blocks;
    st->used = s.used;
    st->cached = s.cached;
    st->free = s.free;
    st->shared = s.shared;
    st->prefix_hits = s.hits;
    st->prefix_misses = s.misses;
    st->evictions = s.evictions;
    st->block_bytes = kv_store_block_bytes(ctx->kv);
    st->bytes_per_token = bytes_per_token(ctx);
    st->tokens_computed = ctx->stats.tokens_computed;
    st->type_k = ctx->host ? ctx->p.cache_type_k : kv_store_params_of(ctx->kv)->k_type; /* a draft's own */
    st->type_v = ctx->host ? ctx->p.cache_type_v : kv_store_params_of(ctx->kv)->v_type;
    st->stage_bytes = kv_store_stage_bytes(ctx->kv);
    kv_store_swap_stats sw;
    kv_store_swap_stats_get(ctx->kv, &sw);
    st->swap_slots = sw.slots;
    st->swap_used = sw.slots_used;
    st->swap_tier_used = sw.disk_blocks_used;
    st->swap_tier_out = sw.disk_swaps_out;
    st->swap_tier_lost = sw.disk_lost;
}

const int32_t *engine_seq_tokens(const kvlm_ctx *ctx, int seq, int *n) {
    *n = kvlm_seq_n_past(ctx, seq);
    return seq_ok(ctx, seq) ? kv_store_seq_tokens(ctx->kv, seq) : NULL;
}
