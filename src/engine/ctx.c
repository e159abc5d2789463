/* engine/ctx: creating a kvlm_ctx (checks, pool sizing, the KV store and its
 * tiers, scratch), a draft context in its target's pool, freeing, getters;
 * the public names of eviction policies and devices. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "kv/planner.h"
#include "kv/store.h"
#include "kv/tier_host.h"
#include "model/model.h"
#include "ops/backend.h"
#include "ops/kvtype.h"
#include "ops/ops.h"
#include "util/error.h"
#include "util/log.h"
#include "util/pool.h"
#include "engine/ctx.h"
#include "engine/engine.h"
#include "engine/forward_cuda.h"
#include "engine/forward_enc.h"
#include "engine/forward_mla.h"
#include "engine/moe.h"

kvlm_ctx_params kvlm_ctx_default_params(void) {
    kvlm_ctx_params p = {0};
    p.cache_type_k = p.cache_type_v = KVLM_CACHE_F16; /* as llama.cpp: half of f32's bytes, its perplexity */
    return p;
}

static const char *const k_evict_names[] = {"none", "window", "sinks", "h2o"};

int kvlm_evict_from_name(const char *name) {
    for (int i = 0; name && i < 4; i++)
        if (!strcmp(name, k_evict_names[i])) return i;
    return -1;
}

const char *kvlm_evict_name(int policy) { return policy >= 0 && policy < 4 ? k_evict_names[policy] : NULL; }

static const char *const k_device_names[] = {"cpu", "cuda"};

int kvlm_device_from_name(const char *name) {
    for (int i = 0; name && i < 2; i++)
        if (!strcmp(name, k_device_names[i])) return i;
    return -1;
}

const char *kvlm_device_name(int device) { return device >= 0 && device < 2 ? k_device_names[device] : NULL; }

void kvlm_ctx_describe_device(const kvlm_ctx *ctx, char *buf, size_t cap) {
    if (ctx->be.cuda) engine_cuda_describe(ctx->be.cuda, buf, cap);
    else snprintf(buf, cap, "cpu: %s, %d threads", op_simd_name(), util_pool_size(ctx->pool));
}

double kvlm_cache_type_elem_bytes(int type, int head_dim, int block_size) {
    if (!op_kv_type_valid(type, false) || head_dim <= 0) return 0;
    if (block_size <= 0) block_size = DEFAULT_BLOCK_SIZE;
    return (double)op_kv_region_bytes(type, head_dim, block_size) / ((double)head_dim * block_size);
}

static size_t max_mm_work(const kvlm_model *m, int T) {
    const kvlm_config *c = &m->cfg;
    size_t w = op_backend_cpu()->matmul_work_size(m->output.type, T, c->dim);
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        const model_tensor *ts[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_down, &L->w_up};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) {
            size_t s = op_backend_cpu()->matmul_work_size(ts[i]->type, T, (int)ts[i]->n_in);
            if (s > w) w = s;
        }
    }
    return w;
}

static int open_tiers(const kvlm_ctx *ctx, kv_store_params *sp, const char *sub, kvlm_error *err);

/* How the layers' caches split under sliding windows: the local layers'
 * pool (its geometry and size) and the blocks one sequence holds there. */
typedef struct {
    int window, n_local;   /* window 0: no windowed store (none, or --no-kv-cache) */
    int per_seq;           /* local blocks one sequence holds at most */
    kv_params local;       /* with global layers too: the local layers' pool */
} swa_split;

/* The same sliding windows on every layer (of the same layer count). */
static bool same_windows(const kvlm_config *a, const kvlm_config *b) {
    if (a->n_layers != b->n_layers || a->sliding_window != b->sliding_window || a->n_local_layers != b->n_local_layers)
        return false;
    for (int l = 0; l < a->n_layers; l++)
        if (model_layer_window(a, l) != model_layer_window(b, l)) return false;
    return true;
}

static bool draft_is_guest(const kvlm_config *t, const kvlm_config *d, const kvlm_ctx_params *tp);

static swa_split swa_plan(const kvlm_ctx *ctx, const kv_params *kp) {
    const kvlm_config *c = &ctx->model->cfg;
    swa_split w = {0};
    if (c->sliding_window <= 0 || c->n_local_layers <= 0 || ctx->p.no_kv_cache) return w;
    w.window = c->sliding_window;
    w.n_local = c->n_local_layers;
    /* kv_store_blocks_held's bound (kv/planner, which kvlm plan shows); one
     * more for a copy-on-write of a shared last block */
    w.per_seq = kv_plan_window_blocks(w.window, ctx->n_batch, kp->block_size, ctx->p.n_ctx) + 1;
    if (w.n_local < c->n_layers) {
        w.local = *kp;
        w.local.n_layers = w.n_local;
        w.local.layer_group = KV_LAYER_GROUP_LOCAL; /* other keys than the global layers' blocks of the same tokens */
        /* every sequence's window twice over (a draft context's too, unless
         * it is a guest, all of whose layers are in the global store): live,
         * and cached for prefix reuse */
        const kvlm_model *dm = ctx->p.draft_model;
        bool guest = dm && dm->layers && draft_is_guest(c, &dm->cfg, &ctx->p);
        w.local.n_blocks = 2 * w.per_seq * (ctx->p.n_seq_max + (guest ? 0 : ctx->p.n_seq_draft));
    }
    return w;
}

/* A draft model's cache d in the pool of a context with params tp: its
 * shape, in the pool's element types but for keys whose table row names
 * another draft type (q4_kc's: q8_0; its drafts are taken back across
 * blocks, which q4_kc's staging cannot). */
static kv_guest draft_guest(const kvlm_config *d, const kvlm_ctx_params *tp) {
    kv_guest g = {d->n_layers, d->n_kv_heads, d->head_dim, tp->cache_type_k, tp->cache_type_v};
    g.k_type = op_kv_draft_type(g.k_type);
    return g;
}

/* Whether that cache needs the pool's guest layout: another shape or types,
 * or other windows than the model's windowed layers drop blocks by (a
 * guest's sequences keep all theirs, all its layers in the global store). */
static bool draft_is_guest(const kvlm_config *t, const kvlm_config *d, const kvlm_ctx_params *tp) {
    bool windowed = t->sliding_window > 0 && t->n_local_layers > 0;
    return !same_cache_shape(t, d) || op_kv_draft_type(tp->cache_type_k) != tp->cache_type_k || (windowed && !same_windows(t, d));
}

/* The blocks a draft sequence holds at most (n_seq_draft): per_seq, the
 * model's, unless p.draft_model names the draft: then a full context (a draft
 * context never evicts) in its layout's tokens a block (kv_guest_block_size
 * for a guest). */
static int draft_blocks_per_seq(const kvlm_ctx *ctx, const kv_params *kp, int per_seq) {
    const kvlm_model *d = ctx->p.draft_model;
    if (!d || !d->layers) return per_seq;
    kv_guest g = draft_guest(&d->cfg, &ctx->p);
    bool guest = draft_is_guest(&ctx->model->cfg, &d->cfg, &ctx->p);
    if (!guest && ctx->evict.budget == ctx->p.n_ctx) return per_seq; /* the model's (a sliding window's, too) */
    int bs = guest ? kv_guest_block_size(kp, &g) : kp->block_size;
    return bs > 0 ? (ctx->p.n_ctx + bs - 1) / bs : per_seq;
}

static int make_cache(kvlm_ctx *ctx, kvlm_error *err) {
    const kvlm_config *c = &ctx->model->cfg;
    kv_params kp = {0};
    kp.n_layers = c->n_layers;
    kp.n_kv_heads = c->n_kv_heads;
    kp.head_dim = c->head_dim;
    kp.block_size = ctx->p.block_size;
    kp.max_seqs = ctx->p.n_seq_max + ctx->p.n_seq_draft; /* a draft context's sequences after the model's */
    kp.max_seq_tokens = ctx->p.n_ctx;
    kp.prefix_cache = !ctx->p.no_prefix_cache && !ctx->p.no_kv_cache;
    kp.k_type = ctx->p.cache_type_k;
    kp.v_type = ctx->p.cache_type_v;
    if (c->arch == KVLM_ARCH_DEEPSEEK2) { /* one latent row per token: docs/mla.md */
        kp.n_kv_heads = 1;
        kp.head_dim = c->kv_lora_rank + c->rope_dim;
        kp.v_in_k = true;
        kp.v_type = kp.k_type;
    }
    /* block keys name the model by its fingerprint (kv/blockfmt.h) */
    kv_model_fingerprint(ctx->model, ctx->rope_freqs, &kp.model);
    kp.storage = ctx->be.cuda ? engine_cuda_storage(ctx->be.cuda) : NULL;
    swa_split win = swa_plan(ctx, &kp);
    if (win.window > 0 && win.n_local < c->n_layers) kp.n_layers = c->n_layers - win.n_local;
    size_t block_bytes = kv_params_block_bytes(&kp);
    /* a sequence holds at most budget tokens; evicting may copy one shared block */
    int per_seq = (ctx->evict.budget + kp.block_size - 1) / kp.block_size + (ctx->p.kv_evict ? 1 : 0);
    if (win.window > 0 && win.n_local == c->n_layers && win.per_seq < per_seq) per_seq = win.per_seq;
    size_t local_bytes = win.local.n_layers ? kv_params_block_bytes(&win.local) * (size_t)win.local.n_blocks : 0;
    if (ctx->p.kv_blocks > 0) kp.n_blocks = ctx->p.kv_blocks;
    else if (ctx->p.kv_mem > 0) {
        if (local_bytes + block_bytes > ctx->p.kv_mem)
            return util_err_set(err, KVLM_EINVAL, "a KV budget of %zu bytes is less than the local layers' %zu "
                                "bytes (their windows) and one block of the global layers (%zu)", ctx->p.kv_mem,
                                local_bytes, block_bytes);
        size_t nb = (ctx->p.kv_mem - local_bytes) / block_bytes;
        if (nb < 1)
            return util_err_set(err, KVLM_EINVAL, "a KV budget of %zu bytes holds no block (one block is %zu bytes)",
                                ctx->p.kv_mem, block_bytes);
        kp.n_blocks = nb > (1u << 30) ? (1 << 30) : (int)nb;
    } else kp.n_blocks = per_seq * ctx->p.n_seq_max + draft_blocks_per_seq(ctx, &kp, per_seq) * ctx->p.n_seq_draft;
    /* the pool is allocated up front: one clear error rather than an
     * allocation the machine cannot back (a file claiming a huge context) */
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    double want = (double)kp.n_blocks * (double)block_bytes, have = pages > 0 && page > 0 ? (double)pages * page : 0;
    if (!ctx->be.cuda && have > 0 && want > have)
        return util_err_set(err, KVLM_ENOMEM,
                            "a KV pool of %d blocks (%.1f GiB, a context of %d tokens%s x %d sequences) is more than "
                            "this machine's %.1f GiB of memory: ask for a smaller context (n_ctx, -c) or pool (--kv-mem)",
                            kp.n_blocks, want / (1 << 30), ctx->p.n_ctx,
                            ctx->ctx_from_file ? " (the model file's context length)" : "", ctx->p.n_seq_max,
                            have / (1 << 30));
    kv_store_params sp = {.pool = kp, .threads = ctx->pool}, lp = {0};
    /* sliding-window layers (docs/sliding-window.md): all local, one store
     * with the window; some local, a second store for them */
    uint8_t *layer_local = NULL;
    if (win.window > 0 && win.n_local == c->n_layers) {
        sp.window = win.window;
        sp.window_slack = ctx->n_batch;
    } else if (win.window > 0) {
        lp = sp;
        lp.pool = win.local;
        lp.window = win.window;
        lp.window_slack = ctx->n_batch;
        sp.local = &lp;
        if (!(layer_local = malloc((size_t)c->n_layers))) return util_err_set(err, KVLM_ENOMEM, "out of memory");
        for (int l = 0; l < c->n_layers; l++) layer_local[l] = model_layer_window(c, l) > 0;
        sp.layer_local = layer_local;
    }
    /* swap space: by default as large as the pool (every sequence could be out at once) */
    if (!ctx->p.no_kv_swap && !ctx->p.no_kv_cache) {
        sp.swap_bytes = ctx->p.kv_swap_size ? (size_t)ctx->p.kv_swap_size : block_bytes * (size_t)kp.n_blocks;
        if (sp.local)
            lp.swap_bytes = ctx->p.kv_swap_size ? (size_t)ctx->p.kv_swap_size
                                                : kv_params_block_bytes(&lp.pool) * (size_t)lp.pool.n_blocks;
    }
    if (open_tiers(ctx, &sp, NULL, err) || (sp.local && open_tiers(ctx, &lp, "swa-local", err))) {
        for (int t = 0; t < sp.n_tiers; t++) kv_tier_close(sp.tiers[t]);
        free(layer_local);
        return err ? err->code : KVLM_EINVAL;
    }
    if (ctx->p.kv_mac_key && !(sp.auth = kv_blockauth_create(ctx->p.kv_mac_key, ctx->p.kv_mac_key_len, err))) {
        for (int t = 0; t < sp.n_tiers; t++) kv_tier_close(sp.tiers[t]);
        for (int t = 0; t < lp.n_tiers; t++) kv_tier_close(lp.tiers[t]);
        free(layer_local);
        return err ? err->code : KVLM_EINVAL;
    }
    ctx->kv = kv_store_create(&sp, err);
    free(layer_local);
    return ctx->kv ? KVLM_OK : (err ? err->code : KVLM_ENOMEM);
}

/* A tier others can write decides, without a signing key, what this
 * process computes with: said once at start (docs/kv-tiers.md, "Trust"). */
static void warn_unsigned(const kvlm_ctx *ctx) {
    if (ctx->p.kv_mac_key) return;
    const char *fix = "give every instance the same signing key (--kv-key FILE; docs/kv-tiers.md)";
    if (ctx->p.kv_redis && *ctx->p.kv_redis)
        LOG_WARN("the Redis tier is shared and its blocks are not signed: whoever can write to the Redis server "
                 "decides what this process computes with; %s", fix);
    struct stat st;
    if (ctx->p.kv_disk && *ctx->p.kv_disk && stat(ctx->p.kv_disk, &st) == 0 &&
        ((st.st_mode & (S_IWGRP | S_IWOTH)) || st.st_uid != geteuid()))
        LOG_WARN("the disk tier's folder %s is writable by other users and its blocks are not signed: they decide "
                 "what this process computes with; %s", ctx->p.kv_disk, fix);
}

/* The context's tiers into sp, in lookup order (nearest first); sub: a
 * folder of the disk tier's for the local layers' store, whose blocks are
 * other bytes under other keys (NULL: the folder itself). On failure the
 * ones opened are closed. */
static int open_tiers(const kvlm_ctx *ctx, kv_store_params *sp, const char *sub, kvlm_error *err) {
    if (ctx->p.kv_host_size) {
        if (!(sp->tiers[sp->n_tiers] = kv_tier_host_open(ctx->p.kv_host_size, err))) goto tier_fail;
        sp->roles[sp->n_tiers++] = KV_TIER_DEMOTE;
    }
    if (ctx->p.kv_disk && *ctx->p.kv_disk) {
        uint64_t cap = ctx->p.kv_disk_size ? ctx->p.kv_disk_size : (uint64_t)20 << 30;
        char path[4096];
        snprintf(path, sizeof path, "%s%s%s", ctx->p.kv_disk, sub ? "/" : "", sub ? sub : "");
        if (!(sp->tiers[sp->n_tiers] = kv_tier_disk_open(path, cap, err))) goto tier_fail;
        sp->roles[sp->n_tiers++] = KV_TIER_DEMOTE | KV_TIER_DURABLE;
    }
    if (ctx->p.kv_redis && *ctx->p.kv_redis) {
        kv_redis_opts ro = {0, ctx->p.kv_redis_password, ctx->p.kv_redis_tls_ca, ctx->p.kv_redis_tls_cert,
                            ctx->p.kv_redis_tls_key};
        if (!(sp->tiers[sp->n_tiers] = kv_tier_redis_open(ctx->p.kv_redis, &ro, err))) goto tier_fail;
        sp->roles[sp->n_tiers++] = KV_TIER_THROUGH;
    }
    if (!sub) warn_unsigned(ctx);
    return KVLM_OK;
tier_fail:
    for (int t = 0; t < sp->n_tiers; t++) kv_tier_close(sp->tiers[t]);
    sp->n_tiers = 0;
    return err ? err->code : KVLM_EINVAL;
}

/* What sliding windows and gemma do not run with (docs/sliding-window.md). */
static int swa_refuse(const kvlm_ctx *ctx, kvlm_error *err) {
    const kvlm_config *c = &ctx->model->cfg;
    bool gemma = c->arch == KVLM_ARCH_GEMMA2 || c->arch == KVLM_ARCH_GEMMA3;
    if (!gemma && c->sliding_window <= 0) return KVLM_OK;
    if (ctx->p.device == KVLM_DEVICE_CUDA)
        return util_err_set(err, KVLM_EUNSUPPORTED, "--device cuda: %s%s runs on the CPU only", model_arch_name(c->arch),
                            c->sliding_window > 0 ? " with a sliding window" : "");
    if (ctx->p.kv_evict != KVLM_EVICT_NONE || ctx->evict.budget < ctx->p.n_ctx)
        return util_err_set(err, KVLM_EUNSUPPORTED, "eviction policies (--kv-evict, --kv-budget) compact a sequence's "
                            "positions; a model with sliding-window layers (window %d) masks by position instead: "
                            "run it without them", c->sliding_window);
    return KVLM_OK;
}

/* A context; host non-NULL: a draft context in host's store (kvlm_ctx_create_draft). */
static kvlm_ctx *ctx_create(const kvlm_model *model, const kvlm_ctx_params *params, kvlm_ctx *host, kvlm_error *err) {
    if (!model || !model->layers) {
        util_err_set(err, KVLM_EINVAL, "the model has no weights (vocabulary-only file?)");
        return NULL;
    }
    const kvlm_config *c = &model->cfg;
    kvlm_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    ctx->model = model;
    ctx->p = params ? *params : kvlm_ctx_default_params();
    kvlm_ctx_params *p = &ctx->p;
    ctx->ctx_from_file = p->n_ctx <= 0;
    if (p->n_ctx <= 0) p->n_ctx = c->n_ctx_train;
    if (p->n_ctx > (1 << 22)) p->n_ctx = 1 << 22;
    if (p->n_seq_max <= 0) p->n_seq_max = 1;
    if (p->block_size <= 0) p->block_size = DEFAULT_BLOCK_SIZE;
    if (p->block_size > p->n_ctx) p->block_size = p->n_ctx;
    if (p->n_seq_draft < 0) p->n_seq_draft = 0;
    ctx->host = host;
    ctx->seq_lo = host ? host->p.n_seq_max : 0;
    ctx->seq_end = ctx->seq_lo + p->n_seq_max;
    if (!op_kv_type_valid(p->cache_type_k, false)) {
        util_err_set(err, KVLM_EINVAL, "unknown KV cache type id %d for keys", p->cache_type_k);
        goto fail;
    }
    if (!op_kv_type_valid(p->cache_type_v, true)) {
        if (op_kv_type_valid(p->cache_type_v, false))
            util_err_set(err, KVLM_EINVAL, "%s quantizes keys per channel; it is not a type for values "
                                           "(use q4_0 or q8_0 for values)", op_kv_type_name(p->cache_type_v));
        else util_err_set(err, KVLM_EINVAL, "unknown KV cache type id %d for values", p->cache_type_v);
        goto fail;
    }
    if (c->encoder) { /* no KV cache is kept: each input is attended to whole, in one pass */
        if (host || p->kv_evict || p->kv_budget || p->device != KVLM_DEVICE_CPU || p->kv_host_size || p->kv_disk ||
            p->kv_redis || p->n_seq_draft) {
            util_err_set(err, KVLM_EUNSUPPORTED, "%s is an encoder: it keeps no KV cache (no eviction, budget or "
                         "tiers), runs on the CPU and takes no draft model", model_arch_name(c->arch));
            goto fail;
        }
        if (p->n_ctx > c->n_ctx_train) p->n_ctx = c->n_ctx_train; /* bert's positions end there */
        if (p->n_batch < p->n_ctx) p->n_batch = p->n_ctx;          /* an input whole in one chunk */
        p->kv_blocks = 1;
        p->kv_mem = 0;
        p->block_size = p->n_ctx < DEFAULT_BLOCK_SIZE ? p->n_ctx : DEFAULT_BLOCK_SIZE;
        p->no_prefix_cache = p->no_kv_swap = true;
    }
    ctx->evict.budget = p->kv_budget > 0 ? p->kv_budget : p->n_ctx;
    ctx->rope_freqs = model_rope_freqs(&model->cfg, p->n_ctx);
    if (p->kv_budget < 0 || p->kv_budget > p->n_ctx) {
        util_err_set(err, KVLM_EINVAL, "a KV budget of %d tokens must be within the context of %d (raise n_ctx)",
                     p->kv_budget, p->n_ctx);
        goto fail;
    }
    if (!kvlm_evict_name(p->kv_evict)) {
        util_err_set(err, KVLM_EINVAL, "unknown eviction policy %d (none, window, sinks, h2o)", p->kv_evict);
        goto fail;
    }
    ctx->evict.ev.policy = p->kv_evict;
    ctx->evict.ev.sinks = p->kv_sinks > 0 ? p->kv_sinks : 4;
    ctx->evict.ev.h2o_recent = p->h2o_recent;
    ctx->evict.ev.h2o_heavy = p->h2o_heavy > 0 ? p->h2o_heavy : 0.5f;
    if (p->kv_evict && (p->no_kv_cache || p->kv_sinks < 0 || p->h2o_recent < 0 || p->h2o_recent >= ctx->evict.budget ||
                        !(ctx->evict.ev.h2o_heavy <= 1) ||
                        (p->kv_evict == KVLM_EVICT_SINKS && ctx->evict.ev.sinks >= ctx->evict.budget))) {
        util_err_set(err, KVLM_EINVAL, "eviction needs the KV cache, sinks and h2o_recent below the budget of %d "
                     "tokens and h2o_heavy in 0..1 (sinks %d, h2o_recent %d, h2o_heavy %g)", ctx->evict.budget,
                     ctx->evict.ev.sinks, p->h2o_recent, (double)p->h2o_heavy);
        goto fail;
    }
    /* latent rows: eviction re-rotates their RoPE part with plain RoPE (not
     * YaRN's angles), and h2o would need the latent kernel's weights */
    if (c->arch == KVLM_ARCH_DEEPSEEK2 &&
        (p->device != KVLM_DEVICE_CPU || p->kv_evict == KVLM_EVICT_H2O || op_kv_per_block(p->cache_type_k) ||
         (c->yarn_factor > 0 && (p->kv_evict != KVLM_EVICT_NONE || ctx->evict.budget < p->n_ctx)))) {
        util_err_set(err, KVLM_EUNSUPPORTED, "deepseek2 (latent attention) runs on the CPU, without q4_kc keys, and "
                                             "evicts by window or sinks only (not h2o; not with YaRN)");
        goto fail;
    }
    /* gpt-oss's sinks take a share of each row's softmax that h2o's scores
     * (op_attn_args.key_weights) do not model (a file without a window reaches here) */
    if (p->kv_evict == KVLM_EVICT_H2O && model->layers && model->layers[0].attn_sinks.data) {
        util_err_set(err, KVLM_EUNSUPPORTED, "--kv-evict h2o: %s's attention sinks are not in h2o's scores; evict by "
                     "window or sinks", model_arch_name(c->arch));
        goto fail;
    }
    if (swa_refuse(ctx, err)) goto fail;
    ctx->n_batch = kv_plan_step(p->n_batch, p->n_ctx);
    ctx->pool = util_pool_create(p->n_threads);
    if (!ctx->pool) { util_err_set(err, KVLM_ENOMEM, "cannot create the thread pool"); goto fail; }
    if (!kvlm_device_name(p->device)) {
        util_err_set(err, KVLM_EINVAL, "unknown device %d (cpu, cuda)", p->device);
        goto fail;
    }
    if (p->device == KVLM_DEVICE_CUDA) {
        if (!op_kv_traits_of(p->cache_type_k)->cuda || p->kv_evict != KVLM_EVICT_NONE || ctx->evict.budget < p->n_ctx) {
            util_err_set(err, KVLM_EUNSUPPORTED, "--device cuda: q4_kc keys and eviction (--kv-evict, --kv-budget) "
                                                 "run on the CPU only");
            goto fail;
        }
        if (c->embed_mult > 0 || c->residual_mult > 0 || c->logit_div > 0) {
            util_err_set(err, KVLM_EUNSUPPORTED, "--device cuda: %s's multipliers run on the CPU only",
                         model_arch_name(c->arch));
            goto fail;
        }
        if (c->no_rope_period > 0) {
            util_err_set(err, KVLM_EUNSUPPORTED, "--device cuda: %s's layers without RoPE run on the CPU only",
                         model_arch_name(c->arch));
            goto fail;
        }
        if (c->n_expert > 0) {
            util_err_set(err, KVLM_EUNSUPPORTED, "--device cuda: a mixture of experts (%s) runs on the CPU only",
                         model_arch_name(c->arch));
            goto fail;
        }
        if (model->layers[0].q_norm.data) {
            util_err_set(err, KVLM_EUNSUPPORTED, "--device cuda: %s's q and k norms run on the CPU only",
                         model_arch_name(c->arch));
            goto fail;
        }
        if (ctx->rope_freqs) {
            util_err_set(err, KVLM_EUNSUPPORTED, "--device cuda: scaled RoPE (Llama 3.1's rope_freqs, linear, YaRN, "
                                                 "LongRoPE) runs on the CPU only");
            goto fail;
        }
        if (!(ctx->be.cuda = engine_cuda_create(model, ctx->n_batch, (p->n_ctx + p->block_size - 1) / p->block_size,
                                             p->n_seq_max, err)))
            goto fail;
    }
    if (host) {
        ctx->kv = host->kv;
        /* its blocks' keys chain from its model's fingerprint: never the host model's */
        kv_key root;
        kv_model_fingerprint(model, ctx->rope_freqs, &root);
        /* another cache shape or types: the pool's guest layout, as many of
         * its tokens per block as the model's block bytes hold */
        kv_guest g = draft_guest(c, &host->p);
        if (draft_is_guest(&host->model->cfg, c, &host->p) &&
            kv_store_add_guest(ctx->kv, ctx->seq_lo, &g, &root, &p->block_size, err))
            goto fail;
        for (int s = ctx->seq_lo; s < ctx->seq_end; s++) kv_store_set_root(ctx->kv, s, &root);
    } else if (make_cache(ctx, err)) goto fail;
    if (c->arch == KVLM_ARCH_DEEPSEEK2 &&
        !(ctx->be.mla = engine_mla_create(model, ctx->n_batch, p->n_ctx, p->block_size, util_pool_size(ctx->pool), err)))
        goto fail;
    size_t T = (size_t)ctx->n_batch, q_dim = (size_t)c->n_heads * c->head_dim,
           kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    /* engine_seq_fill_synthetic writes rows of the cache's width */
    const kv_params *ckp = kv_store_params_of(ctx->kv);
    if ((size_t)ckp->n_kv_heads * ckp->head_dim > kv_dim) kv_dim = (size_t)ckp->n_kv_heads * ckp->head_dim;
    size_t wide = q_dim > (size_t)c->dim ? q_dim : (size_t)c->dim;
    ctx->rs.x = malloc(T * c->dim * sizeof(float));
    ctx->rs.xb = malloc(T * wide * sizeof(float));
    ctx->rs.q = malloc(T * q_dim * sizeof(float));
    ctx->rs.k = malloc(T * kv_dim * sizeof(float));
    ctx->rs.v = malloc(T * kv_dim * sizeof(float));
    ctx->rs.att = malloc(T * q_dim * sizeof(float));
    ctx->rs.hb = malloc(T * c->hidden_dim * sizeof(float));
    ctx->rs.hb2 = malloc(T * c->hidden_dim * sizeof(float));
    ctx->rs.out_rows = malloc(T * c->dim * sizeof(float));
    ctx->rs.mm_work = malloc(max_mm_work(model, ctx->n_batch) + 64);
    ctx->rs.attn_work = malloc(op_backend_cpu()->attention_work_size(util_pool_size(ctx->pool), c->head_dim) + 64);
    /* a step's attention runs ATT_RUNS sequences per pass of the threads */
    ctx->rs.att_runs = p->n_seq_max < ATT_RUNS ? p->n_seq_max : ATT_RUNS;
    ctx->rs.block_ptrs = malloc((size_t)ctx->rs.att_runs * ((size_t)p->n_ctx / p->block_size + 2) * sizeof(float *));
    size_t half = c->rope_dim / 2 > 0 ? (size_t)c->rope_dim / 2 : 1;
    ctx->rs.rope_cs = malloc(T * half * sizeof(float));
    ctx->rs.rope_sn = malloc(T * half * sizeof(float));
    /* the local layers' own RoPE: gemma3's base, and plain where the scaling turns the global layers only */
    bool plain_local = model_scaling_global_only(c) && ctx->rope_freqs;
    if (c->rope_base_local > 0 && (c->rope_base_local != c->rope_base || plain_local) &&
        (!(ctx->rs.rope_cs_local = malloc(T * half * sizeof(float))) || !(ctx->rs.rope_sn_local = malloc(T * half * sizeof(float))))) {
        util_err_set(err, KVLM_ENOMEM, "out of memory for the context's scratch buffers");
        goto fail;
    }
    ctx->rs.out_tok = malloc(T * sizeof(int));
    ctx->rs.emb_row = malloc(T * sizeof(int));
    ctx->rs.tok_next = malloc(T * sizeof(int));
    ctx->rs.grp_first = malloc(T * sizeof(int));
    ctx->rs.seq_at = malloc((size_t)ctx->seq_end * sizeof(int));
    for (int s = 0; ctx->rs.seq_at && s < ctx->seq_end; s++) ctx->rs.seq_at[s] = -1;
    ctx->evict.n_evicted = calloc((size_t)ctx->seq_end, sizeof(long));
    ctx->evict.keep = malloc((size_t)ctx->evict.budget * sizeof(int32_t));
    if (p->kv_evict == KVLM_EVICT_H2O) {
        ctx->evict.h2o = calloc((size_t)ctx->seq_end * ctx->evict.budget, sizeof(float));
        /* scores of up to 32 query tokens over the budget's keys; longer
         * prefill pieces go 32 tokens at a time */
        int n_tok = ctx->n_batch < 32 ? ctx->n_batch : 32;
        ctx->evict.h2o_work_floats = op_attention_score_floats(n_tok, c->n_heads, ctx->evict.budget);
        ctx->evict.h2o_work = malloc(ctx->evict.h2o_work_floats * sizeof(float));
    }
    if (!ctx->evict.n_evicted || !ctx->evict.keep || (p->kv_evict == KVLM_EVICT_H2O && (!ctx->evict.h2o || !ctx->evict.h2o_work)) ||
        !ctx->rs.x || !ctx->rs.xb || !ctx->rs.q || !ctx->rs.k || !ctx->rs.v || !ctx->rs.att || !ctx->rs.hb || !ctx->rs.hb2 || !ctx->rs.out_rows ||
        !ctx->rs.mm_work || !ctx->rs.attn_work || !ctx->rs.block_ptrs || !ctx->rs.rope_cs || !ctx->rs.rope_sn || !ctx->rs.out_tok ||
        !ctx->rs.tok_next || !ctx->rs.grp_first || !ctx->rs.seq_at || !ctx->rs.emb_row) {
        util_err_set(err, KVLM_ENOMEM, "out of memory for the context's scratch buffers");
        goto fail;
    }
    if (c->n_expert > 0 && c->arch != KVLM_ARCH_DEEPSEEK2 && !(ctx->be.moe = engine_moe_create(model, ctx->n_batch, err)))
        goto fail;
    if (c->encoder) {
        engine_enc_scratch es = {ctx->rs.x, ctx->rs.xb, ctx->rs.q, ctx->rs.k, ctx->rs.v, ctx->rs.att, ctx->rs.hb, ctx->rs.hb2,
                                 ctx->rs.rope_cs, ctx->rs.rope_sn, ctx->rs.mm_work};
        if (!(ctx->be.enc = engine_enc_create(model, ctx->n_batch, util_pool_size(ctx->pool), &es, err))) goto fail;
    }
    return ctx;
fail:
    kvlm_ctx_free(ctx);
    return NULL;
}

kvlm_ctx *kvlm_ctx_create(const kvlm_model *model, const kvlm_ctx_params *params, kvlm_error *err) {
    return ctx_create(model, params, NULL, err);
}

/* Why a draft model's cache cannot be a sequence range of the target's pool
 * (KVLM_OK: it can). Another cache shape is the pool's guest layout
 * (kv_add_guest): one of its tokens must fit in one of the model's blocks. */
static int draft_pool_refuse(const kvlm_model *target, const kvlm_model *draft, const kvlm_ctx_params *tp,
                             kvlm_error *err) {
    const kvlm_config *t = &target->cfg, *d = &draft->cfg;
    if (draft_is_guest(t, d, tp)) {
        kv_params tk = {.n_layers = t->n_layers, .n_kv_heads = t->n_kv_heads, .head_dim = t->head_dim,
                        .block_size = tp->block_size > 0 ? tp->block_size : DEFAULT_BLOCK_SIZE,
                        .k_type = tp->cache_type_k, .v_type = tp->cache_type_v};
        kv_guest g = draft_guest(d, tp);
        if (!kv_guest_block_size(&tk, &g))
            return util_err_set(err, KVLM_EUNSUPPORTED, "the draft model's cache (%d layers x %d KV heads x %d) takes "
                                "more bytes for one token than the model's block of %d tokens (%d x %d x %d): it "
                                "cannot live in the model's blocks", d->n_layers, d->n_kv_heads, d->head_dim,
                                tk.block_size, t->n_layers, t->n_kv_heads, t->head_dim);
    }
    bool tl = t->arch == KVLM_ARCH_DEEPSEEK2, dl = d->arch == KVLM_ARCH_DEEPSEEK2;
    if ((tl || dl) && (tl != dl || draft_is_guest(t, d, tp) || t->kv_lora_rank != d->kv_lora_rank ||
                       t->rope_dim != d->rope_dim))
        return util_err_set(err, KVLM_EUNSUPPORTED, "a latent (deepseek2) cache shares its pool only with a draft of "
                            "the same latent rows (a quantized copy)");
    if (tp->device != KVLM_DEVICE_CPU || tp->no_kv_cache)
        return util_err_set(err, KVLM_EUNSUPPORTED, "a draft model shares the model's pool on the CPU, with the KV "
                            "cache");
    return KVLM_OK;
}

bool kvlm_draft_shares_pool(const kvlm_model *target, const kvlm_model *draft, const kvlm_ctx_params *target_params) {
    kvlm_ctx_params p = target_params ? *target_params : kvlm_ctx_default_params();
    return target && draft && target->layers && draft->layers && draft_pool_refuse(target, draft, &p, NULL) == KVLM_OK;
}

kvlm_ctx *kvlm_ctx_create_draft(const kvlm_model *draft, kvlm_ctx *target, const kvlm_ctx_params *params,
                                kvlm_error *err) {
    if (!draft || !draft->layers || !target) {
        util_err_set(err, KVLM_EINVAL, "a draft context needs the draft model and the model's context");
        return NULL;
    }
    if (target->host || target->p.n_seq_draft <= 0 || target->hosts) {
        if (target->hosts) util_err_set(err, KVLM_EINVAL, "the model's context already has a draft context");
        else util_err_set(err, KVLM_EINVAL, "the model's context keeps no sequences for a draft context (n_seq_draft)");
        return NULL;
    }
    if (draft_pool_refuse(target->model, draft, &target->p, err)) return NULL;
    kvlm_ctx_params p = params ? *params : kvlm_ctx_default_params();
    const kvlm_ctx_params *tp = &target->p;
    /* the pool's: context, block layout, types, prefix cache; no eviction */
    p.n_ctx = tp->n_ctx;
    p.n_seq_max = tp->n_seq_draft;
    p.n_seq_draft = 0;
    p.draft_model = NULL;
    p.block_size = tp->block_size;
    kv_guest g = draft_guest(&draft->cfg, tp); /* q4_kc keys: q8_0 */
    p.cache_type_k = g.k_type;
    p.cache_type_v = g.v_type;
    p.no_kv_cache = false;
    p.no_prefix_cache = tp->no_prefix_cache;
    p.kv_budget = 0;
    p.kv_evict = KVLM_EVICT_NONE;
    p.device = KVLM_DEVICE_CPU;
    p.kv_mem = 0;
    p.kv_blocks = 0;
    p.kv_host_size = p.kv_disk_size = p.kv_swap_size = 0;
    p.kv_disk = p.kv_redis = NULL;
    p.no_kv_swap = true;
    if (!p.n_threads) p.n_threads = util_pool_size(target->pool);
    kvlm_ctx *ctx = ctx_create(draft, &p, target, err);
    if (ctx) target->hosts = true;
    return ctx;
}

int kvlm_ctx_seq_first(const kvlm_ctx *ctx) { return ctx->seq_lo; }

void kvlm_ctx_free(kvlm_ctx *ctx) {
    if (!ctx) return;
    util_pool_free(ctx->pool);
    if (ctx->host) { /* its sequences' blocks go back to the host's pool (and its layout, if a guest's) */
        if (ctx->kv) {
            kvlm_ctx_reset(ctx);
            kv_store_drop_guest(ctx->kv, NULL);
        }
        ctx->host->hosts = false;
    }
    else kv_store_free(ctx->kv); /* before the device its blocks live on */
    engine_cuda_free(ctx->be.cuda);
    free(ctx->rs.x); free(ctx->rs.xb); free(ctx->rs.q); free(ctx->rs.k); free(ctx->rs.v); free(ctx->rs.att);
    free(ctx->rs.hb); free(ctx->rs.hb2); free(ctx->rs.out_rows); free(ctx->rs.mm_work); free(ctx->rs.attn_work);
    free(ctx->rs.block_ptrs); free(ctx->rs.tok_seq); free(ctx->rs.tok_pos); free(ctx->rs.logits);
    free(ctx->evict.h2o); free(ctx->evict.h2o_work); free(ctx->evict.keep); free(ctx->evict.n_evicted);
    free(ctx->rs.rope_cs); free(ctx->rs.rope_sn); free(ctx->rs.out_tok); free(ctx->rs.tok_next); free(ctx->rs.grp_first);
    free(ctx->rs.seq_at);
    free(ctx->blocks_tmp);
    engine_mla_free(ctx->be.mla);
    engine_moe_free(ctx->be.moe);
    engine_enc_free(ctx->be.enc);
    free(ctx->rs.embd); free(ctx->rs.emb_row);
    free(ctx->rs.rope_cs_local); free(ctx->rs.rope_sn_local);
    for (int s = 0; ctx->spec.seq && s < ctx->seq_end; s++) free(ctx->spec.seq[s].rows);
    free(ctx->spec.seq);
    free(ctx);
}

int kvlm_ctx_n_ctx(const kvlm_ctx *ctx) { return ctx->p.n_ctx; }
int kvlm_ctx_n_seq_max(const kvlm_ctx *ctx) { return ctx->p.n_seq_max; }
const kvlm_model *kvlm_ctx_model(const kvlm_ctx *ctx) { return ctx->model; }
int kvlm_seq_n_past(const kvlm_ctx *ctx, int seq) {
    return seq_ok(ctx, seq) ? kv_store_seq_len(ctx->kv, seq) : 0;
}
int kvlm_ctx_n_past(const kvlm_ctx *ctx) { return kvlm_seq_n_past(ctx, ctx->seq_lo); }
int kvlm_ctx_kv_budget(const kvlm_ctx *ctx) { return ctx->evict.budget; }
int kvlm_ctx_kv_evict(const kvlm_ctx *ctx) { return ctx->evict.ev.policy; }
int kvlm_ctx_kv_max_feed(const kvlm_ctx *ctx) {
    return ctx->evict.budget - (ctx->evict.ev.policy == KVLM_EVICT_SINKS ? ctx->evict.ev.sinks : 0);
}
long kvlm_seq_n_evicted(const kvlm_ctx *ctx, int seq) {
    return seq_ok(ctx, seq) ? ctx->evict.n_evicted[seq] : 0;
}

int kvlm_ctx_device(const kvlm_ctx *ctx) { return ctx->p.device; }

/* ---- engine.h hooks ------------------------------------------------------------ */

void engine_set_naive_attention(kvlm_ctx *ctx, bool naive) { ctx->be.naive_attention = naive; }
int engine_ctx_n_batch(const kvlm_ctx *ctx) { return ctx->n_batch; }
const char *engine_kv_check(const kvlm_ctx *ctx) { return kv_check(kv_store_pool(ctx->kv)); }
void engine_set_spec_h2o_defer(kvlm_ctx *ctx, bool defer) { ctx->spec.h2o_direct = !defer; }
double engine_attention_seconds(const kvlm_ctx *ctx) { return ctx->stats.attn_seconds; }
struct kv_store *engine_kv_store(kvlm_ctx *ctx) { return ctx->kv; }
kvlm_ctx *engine_ctx_host(const kvlm_ctx *ctx) { return ctx->host; }
double engine_evict_seconds(const kvlm_ctx *ctx) { return ctx->stats.evict_seconds; }
