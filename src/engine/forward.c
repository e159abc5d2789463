/* engine/forward: the kvlm_ctx (paged KV cache, scratch, threads) and the
 * forward pass: a batch of tokens of one or many sequences through every
 * layer, each weight matrix read once for all of them (matrix-matrix), keys
 * and values written into each sequence's blocks, logits on request. */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "kv/evict.h"
#include "kv/session.h"
#include "kv/store.h"
#include "kv/tier_host.h"
#include "dtype/dtype.h"
#include "model/model.h"
#include "ops/backend.h"
#include "ops/kvtype.h"
#include "ops/ops.h"
#include "util/error.h"
#include "util/log.h"
#include "util/pool.h"
#include "util/timing.h"
#include "engine/engine.h"
#include "engine/forward_cuda.h"
#include "engine/forward_enc.h"
#include "engine/forward_mla.h"
#include "engine/moe.h"

/* attention calls per pass of the threads (op_attention_n) */
#define ATT_RUNS 64

/* kvlm_ctx_params.block_size 0: tokens per KV block */
enum { DEFAULT_BLOCK_SIZE = 16 };

/* A sequence taking speculative (unverified) tokens: from kvlm_seq_spec_begin
 * until kvlm_seq_trim. Under h2o the attention of its unverified query rows
 * is kept apart, one row of budget floats per token, and added to the scores
 * only for the tokens kept, in their order. */
typedef struct {
    bool on;
    int from;        /* its first unverified position (-1: none fed yet) */
    float *rows;     /* h2o: rows_cap rows of budget floats */
    int rows_cap;
} spec_seq;

struct kvlm_ctx {
    const kvlm_model *model;
    kvlm_ctx_params p;
    util_pool *pool;
    kv_store *kv;
    int n_batch;
    /* Scratch for n_batch tokens. */
    float *x, *xb, *q, *k, *v, *att, *hb, *hb2;
    void *mm_work, *attn_work;
    engine_moe *moe;           /* Mixtral's and qwen3moe's experts (deepseek2's are forward_mla's); NULL: a dense FFN */
    const float **block_ptrs;  /* the blocks of att_runs sequences for attention */
    int att_runs;
    int32_t *tok_seq, *tok_pos;  /* per token of the current batch */
    /* Per token of the chunk in forward_chunk: */
    float *rope_cs, *rope_sn;  /* cos/sin of its position's RoPE angles (rope_dim / 2 each) */
    int *out_tok;              /* per row of out_rows: its token */
    int *tok_next;             /* q4_kc: the next token of its sequence in the chunk, -1: none */
    int *grp_first;            /* q4_kc: each sequence's first token in the chunk */
    int *seq_at;               /* per sequence: scratch of group_by_seq, -1 between calls */
    /* Logits of the tokens that asked for them in the last call. */
    float *logits;
    int n_logits, logits_cap;
    /* Hidden states (dim each) of the tokens that asked for them (kvlm_batch.embd) in the last call. */
    float *embd;
    int n_embd, embd_cap;
    int *emb_row;              /* forward_chunk: each token's row in out_rows */
    engine_enc *enc;           /* an encoder's (bert, nomic-bert) forward pass (engine/forward_enc.c) */
    float *out_rows;
    uint64_t tokens_computed;
    double compute_seconds;    /* forward passes, for the tokens/s preemption weighs */
    bool naive_attention;      /* engine.h: reference attention, the baseline */
    /* Eviction (kvlm.h KVLM_EVICT_*). */
    int budget;
    bool ctx_from_file;        /* n_ctx was not asked for: the model file's */
    kv_evict_params ev;
    float *h2o;                /* h2o: accumulated attention per sequence and cache slot (budget apart) */
    float *h2o_work;           /* h2o: the attention kernels' score scratch (h2o_work_floats) */
    size_t h2o_work_floats;
    int32_t *keep;             /* budget: the tokens a policy keeps */
    long *n_evicted;           /* per sequence */
    double evict_seconds;
    double attn_seconds;
    engine_cuda *cuda;         /* device CUDA: weights, KV blocks and the forward pass on the GPU */
    kvlm_kv_event_sink events; /* KV events (kvlm_ctx_set_kv_event_sink); event NULL: none */
    int32_t *blocks_tmp;       /* kvlm_kv_cached_blocks' scratch, n_blocks */
    engine_mla *mla;           /* deepseek2: the latent-attention forward pass (engine/forward_mla.c) */
    /* gemma3: the local layers' RoPE cos/sin (their own base), NULL when
     * every layer has the same base */
    float *rope_cs_local, *rope_sn_local;
    const float *rope_freqs; /* the RoPE factors its keys turn by (model_rope_freqs of its n_ctx), or NULL */
    spec_seq *spec;            /* speculative decoding, per sequence (allocated at the first kvlm_seq_spec_begin) */
    bool spec_h2o_direct;      /* engine.h, tests: unverified attention not kept apart */
    /* Its sequences are the store's ids [seq_lo, seq_end): a draft context
     * (kvlm_ctx_create_draft) takes those after its host's, in the host's
     * store, which it does not own. Per-sequence arrays have seq_end entries. */
    int seq_lo, seq_end;
    kvlm_ctx *host;
    bool hosts;                /* a draft context uses this one's store */
};

/* Whether seq is one of the context's sequences. */
static bool seq_ok(const kvlm_ctx *ctx, int seq) { return seq >= ctx->seq_lo && seq < ctx->seq_end; }

static int bad_seq(const kvlm_ctx *ctx, kvlm_error *err) {
    return util_err_set(err, KVLM_EINVAL, "sequence ids must be in %d..%d", ctx->seq_lo, ctx->seq_end - 1);
}

kvlm_ctx_params kvlm_ctx_default_params(void) {
    kvlm_ctx_params p = {0};
    p.cache_type_k = p.cache_type_v = KVLM_CACHE_F16; /* as llama.cpp: half of f32's bytes, its perplexity */
    return p;
}

static const struct { const char *name; int id; } k_cache_types[] = {
    {"f32", KVLM_CACHE_F32}, {"f16", KVLM_CACHE_F16}, {"bf16", KVLM_CACHE_BF16},
    {"q8_0", KVLM_CACHE_Q8_0}, {"q4_0", KVLM_CACHE_Q4_0}, {"q4_kc", KVLM_CACHE_Q4_KC},
};

int kvlm_cache_type_from_name(const char *name) {
    if (!name) return -1;
    for (size_t i = 0; i < sizeof k_cache_types / sizeof k_cache_types[0]; i++)
        if (!strcmp(name, k_cache_types[i].name)) return k_cache_types[i].id;
    return -1;
}

const char *kvlm_cache_type_name(int type) {
    for (size_t i = 0; i < sizeof k_cache_types / sizeof k_cache_types[0]; i++)
        if (type == k_cache_types[i].id) return k_cache_types[i].name;
    return NULL;
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
    if (ctx->cuda) engine_cuda_describe(ctx->cuda, buf, cap);
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

static bool same_cache_shape(const kvlm_config *a, const kvlm_config *b) {
    return a->n_layers == b->n_layers && a->n_kv_heads == b->n_kv_heads && a->head_dim == b->head_dim;
}

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
    int bs = kp->block_size, all = (ctx->p.n_ctx + bs - 1) / bs;
    /* kv_store_blocks_held's bound: the window, one step and two partial
     * blocks; one more for a copy-on-write of a shared last block */
    w.per_seq = (w.window + ctx->n_batch + 2 * bs - 3) / bs + 1;
    if (w.per_seq > all + 1) w.per_seq = all + 1;
    if (w.n_local < c->n_layers) {
        w.local = *kp;
        w.local.n_layers = w.n_local;
        w.local.model.b[15] ^= 0x5a; /* other bytes than the global layers' blocks of the same tokens */
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
 * shape, in the pool's element types but for q4_kc keys, which become q8_0
 * (its drafts are taken back across blocks, which q4_kc's staging cannot). */
static kv_guest draft_guest(const kvlm_config *d, const kvlm_ctx_params *tp) {
    kv_guest g = {d->n_layers, d->n_kv_heads, d->head_dim, tp->cache_type_k, tp->cache_type_v};
    if (g.k_type == KVLM_CACHE_Q4_KC) g.k_type = KVLM_CACHE_Q8_0;
    return g;
}

/* Whether that cache needs the pool's guest layout: another shape or types,
 * or other windows than the model's windowed layers drop blocks by (a
 * guest's sequences keep all theirs, all its layers in the global store). */
static bool draft_is_guest(const kvlm_config *t, const kvlm_config *d, const kvlm_ctx_params *tp) {
    bool windowed = t->sliding_window > 0 && t->n_local_layers > 0;
    return !same_cache_shape(t, d) || tp->cache_type_k == KVLM_CACHE_Q4_KC || (windowed && !same_windows(t, d));
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
    if (!guest && ctx->budget == ctx->p.n_ctx) return per_seq; /* the model's (a sliding window's, too) */
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
    kp.storage = ctx->cuda ? engine_cuda_storage(ctx->cuda) : NULL;
    swa_split win = swa_plan(ctx, &kp);
    if (win.window > 0 && win.n_local < c->n_layers) kp.n_layers = c->n_layers - win.n_local;
    size_t block_bytes = kv_params_block_bytes(&kp);
    /* a sequence holds at most budget tokens; evicting may copy one shared block */
    int per_seq = (ctx->budget + kp.block_size - 1) / kp.block_size + (ctx->p.kv_evict ? 1 : 0);
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
    if (!ctx->cuda && have > 0 && want > have)
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
    if (ctx->p.kv_evict != KVLM_EVICT_NONE || ctx->budget < ctx->p.n_ctx)
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
        if (p->cache_type_v == KVLM_CACHE_Q4_KC)
            util_err_set(err, KVLM_EINVAL, "q4_kc quantizes keys per channel; it is not a type for values "
                                           "(use q4_0 or q8_0 for values)");
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
    ctx->budget = p->kv_budget > 0 ? p->kv_budget : p->n_ctx;
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
    ctx->ev.policy = p->kv_evict;
    ctx->ev.sinks = p->kv_sinks > 0 ? p->kv_sinks : 4;
    ctx->ev.h2o_recent = p->h2o_recent;
    ctx->ev.h2o_heavy = p->h2o_heavy > 0 ? p->h2o_heavy : 0.5f;
    if (p->kv_evict && (p->no_kv_cache || p->kv_sinks < 0 || p->h2o_recent < 0 || p->h2o_recent >= ctx->budget ||
                        !(ctx->ev.h2o_heavy <= 1) ||
                        (p->kv_evict == KVLM_EVICT_SINKS && ctx->ev.sinks >= ctx->budget))) {
        util_err_set(err, KVLM_EINVAL, "eviction needs the KV cache, sinks and h2o_recent below the budget of %d "
                     "tokens and h2o_heavy in 0..1 (sinks %d, h2o_recent %d, h2o_heavy %g)", ctx->budget,
                     ctx->ev.sinks, p->h2o_recent, (double)p->h2o_heavy);
        goto fail;
    }
    /* latent rows: eviction re-rotates their RoPE part with plain RoPE (not
     * YaRN's angles), and h2o would need the latent kernel's weights */
    if (c->arch == KVLM_ARCH_DEEPSEEK2 &&
        (p->device != KVLM_DEVICE_CPU || p->kv_evict == KVLM_EVICT_H2O || p->cache_type_k == KVLM_CACHE_Q4_KC ||
         (c->yarn_factor > 0 && (p->kv_evict != KVLM_EVICT_NONE || ctx->budget < p->n_ctx)))) {
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
    ctx->n_batch = p->n_batch > 0 ? p->n_batch : (p->n_ctx < 512 ? p->n_ctx : 512);
    ctx->pool = util_pool_create(p->n_threads);
    if (!ctx->pool) { util_err_set(err, KVLM_ENOMEM, "cannot create the thread pool"); goto fail; }
    if (!kvlm_device_name(p->device)) {
        util_err_set(err, KVLM_EINVAL, "unknown device %d (cpu, cuda)", p->device);
        goto fail;
    }
    if (p->device == KVLM_DEVICE_CUDA) {
        if (p->cache_type_k == KVLM_CACHE_Q4_KC || p->kv_evict != KVLM_EVICT_NONE || ctx->budget < p->n_ctx) {
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
        if (!(ctx->cuda = engine_cuda_create(model, ctx->n_batch, (p->n_ctx + p->block_size - 1) / p->block_size,
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
        !(ctx->mla = engine_mla_create(model, ctx->n_batch, p->n_ctx, p->block_size, util_pool_size(ctx->pool), err)))
        goto fail;
    size_t T = (size_t)ctx->n_batch, q_dim = (size_t)c->n_heads * c->head_dim,
           kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    /* engine_seq_fill_synthetic writes rows of the cache's width */
    const kv_params *ckp = kv_store_params_of(ctx->kv);
    if ((size_t)ckp->n_kv_heads * ckp->head_dim > kv_dim) kv_dim = (size_t)ckp->n_kv_heads * ckp->head_dim;
    size_t wide = q_dim > (size_t)c->dim ? q_dim : (size_t)c->dim;
    ctx->x = malloc(T * c->dim * sizeof(float));
    ctx->xb = malloc(T * wide * sizeof(float));
    ctx->q = malloc(T * q_dim * sizeof(float));
    ctx->k = malloc(T * kv_dim * sizeof(float));
    ctx->v = malloc(T * kv_dim * sizeof(float));
    ctx->att = malloc(T * q_dim * sizeof(float));
    ctx->hb = malloc(T * c->hidden_dim * sizeof(float));
    ctx->hb2 = malloc(T * c->hidden_dim * sizeof(float));
    ctx->out_rows = malloc(T * c->dim * sizeof(float));
    ctx->mm_work = malloc(max_mm_work(model, ctx->n_batch) + 64);
    ctx->attn_work = malloc(op_backend_cpu()->attention_work_size(util_pool_size(ctx->pool), c->head_dim) + 64);
    /* a step's attention runs ATT_RUNS sequences per pass of the threads */
    ctx->att_runs = p->n_seq_max < ATT_RUNS ? p->n_seq_max : ATT_RUNS;
    ctx->block_ptrs = malloc((size_t)ctx->att_runs * ((size_t)p->n_ctx / p->block_size + 2) * sizeof(float *));
    size_t half = c->rope_dim / 2 > 0 ? (size_t)c->rope_dim / 2 : 1;
    ctx->rope_cs = malloc(T * half * sizeof(float));
    ctx->rope_sn = malloc(T * half * sizeof(float));
    /* the local layers' own RoPE: gemma3's base, and plain where the scaling turns the global layers only */
    bool plain_local = model_scaling_global_only(c) && ctx->rope_freqs;
    if (c->rope_base_local > 0 && (c->rope_base_local != c->rope_base || plain_local) &&
        (!(ctx->rope_cs_local = malloc(T * half * sizeof(float))) || !(ctx->rope_sn_local = malloc(T * half * sizeof(float))))) {
        util_err_set(err, KVLM_ENOMEM, "out of memory for the context's scratch buffers");
        goto fail;
    }
    ctx->out_tok = malloc(T * sizeof(int));
    ctx->emb_row = malloc(T * sizeof(int));
    ctx->tok_next = malloc(T * sizeof(int));
    ctx->grp_first = malloc(T * sizeof(int));
    ctx->seq_at = malloc((size_t)ctx->seq_end * sizeof(int));
    for (int s = 0; ctx->seq_at && s < ctx->seq_end; s++) ctx->seq_at[s] = -1;
    ctx->n_evicted = calloc((size_t)ctx->seq_end, sizeof(long));
    ctx->keep = malloc((size_t)ctx->budget * sizeof(int32_t));
    if (p->kv_evict == KVLM_EVICT_H2O) {
        ctx->h2o = calloc((size_t)ctx->seq_end * ctx->budget, sizeof(float));
        /* scores of up to 32 query tokens over the budget's keys; longer
         * prefill pieces go 32 tokens at a time */
        int n_tok = ctx->n_batch < 32 ? ctx->n_batch : 32;
        ctx->h2o_work_floats = op_attention_score_floats(n_tok, c->n_heads, ctx->budget);
        ctx->h2o_work = malloc(ctx->h2o_work_floats * sizeof(float));
    }
    if (!ctx->n_evicted || !ctx->keep || (p->kv_evict == KVLM_EVICT_H2O && (!ctx->h2o || !ctx->h2o_work)) ||
        !ctx->x || !ctx->xb || !ctx->q || !ctx->k || !ctx->v || !ctx->att || !ctx->hb || !ctx->hb2 || !ctx->out_rows ||
        !ctx->mm_work || !ctx->attn_work || !ctx->block_ptrs || !ctx->rope_cs || !ctx->rope_sn || !ctx->out_tok ||
        !ctx->tok_next || !ctx->grp_first || !ctx->seq_at || !ctx->emb_row) {
        util_err_set(err, KVLM_ENOMEM, "out of memory for the context's scratch buffers");
        goto fail;
    }
    if (c->n_expert > 0 && c->arch != KVLM_ARCH_DEEPSEEK2 && !(ctx->moe = engine_moe_create(model, ctx->n_batch, err)))
        goto fail;
    if (c->encoder) {
        engine_enc_scratch es = {ctx->x, ctx->xb, ctx->q, ctx->k, ctx->v, ctx->att, ctx->hb, ctx->hb2,
                                 ctx->rope_cs, ctx->rope_sn, ctx->mm_work};
        if (!(ctx->enc = engine_enc_create(model, ctx->n_batch, util_pool_size(ctx->pool), &es, err))) goto fail;
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
    engine_cuda_free(ctx->cuda);
    free(ctx->x); free(ctx->xb); free(ctx->q); free(ctx->k); free(ctx->v); free(ctx->att);
    free(ctx->hb); free(ctx->hb2); free(ctx->out_rows); free(ctx->mm_work); free(ctx->attn_work);
    free(ctx->block_ptrs); free(ctx->tok_seq); free(ctx->tok_pos); free(ctx->logits);
    free(ctx->h2o); free(ctx->h2o_work); free(ctx->keep); free(ctx->n_evicted);
    free(ctx->rope_cs); free(ctx->rope_sn); free(ctx->out_tok); free(ctx->tok_next); free(ctx->grp_first);
    free(ctx->seq_at);
    free(ctx->blocks_tmp);
    engine_mla_free(ctx->mla);
    engine_moe_free(ctx->moe);
    engine_enc_free(ctx->enc);
    free(ctx->embd); free(ctx->emb_row);
    free(ctx->rope_cs_local); free(ctx->rope_sn_local);
    for (int s = 0; ctx->spec && s < ctx->seq_end; s++) free(ctx->spec[s].rows);
    free(ctx->spec);
    free(ctx);
}

int kvlm_ctx_n_ctx(const kvlm_ctx *ctx) { return ctx->p.n_ctx; }
int kvlm_ctx_n_seq_max(const kvlm_ctx *ctx) { return ctx->p.n_seq_max; }
const kvlm_model *kvlm_ctx_model(const kvlm_ctx *ctx) { return ctx->model; }
int kvlm_seq_n_past(const kvlm_ctx *ctx, int seq) {
    return seq_ok(ctx, seq) ? kv_store_seq_len(ctx->kv, seq) : 0;
}
int kvlm_ctx_n_past(const kvlm_ctx *ctx) { return kvlm_seq_n_past(ctx, ctx->seq_lo); }
int kvlm_ctx_kv_budget(const kvlm_ctx *ctx) { return ctx->budget; }
int kvlm_ctx_kv_evict(const kvlm_ctx *ctx) { return ctx->ev.policy; }
int kvlm_ctx_kv_max_feed(const kvlm_ctx *ctx) {
    return ctx->budget - (ctx->ev.policy == KVLM_EVICT_SINKS ? ctx->ev.sinks : 0);
}
long kvlm_seq_n_evicted(const kvlm_ctx *ctx, int seq) {
    return seq_ok(ctx, seq) ? ctx->n_evicted[seq] : 0;
}

static float *h2o_scores(const kvlm_ctx *ctx, int seq) {
    return ctx->h2o ? ctx->h2o + (size_t)seq * ctx->budget : NULL;
}

void kvlm_seq_free(kvlm_ctx *ctx, int seq) {
    if (!seq_ok(ctx, seq)) return;
    kv_store_release(ctx->kv, seq);
    ctx->n_evicted[seq] = 0;
    if (ctx->h2o) memset(h2o_scores(ctx, seq), 0, (size_t)ctx->budget * sizeof(float));
    if (ctx->spec) { ctx->spec[seq].on = false; ctx->spec[seq].from = -1; }
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
    if (!h || (ctx->h2o && !(h->h2o = malloc((size_t)ctx->budget * sizeof(float))))) {
        free(h);
        return util_err_set(err, KVLM_ENOMEM, "out of memory");
    }
    int rc = kv_store_swap_out(ctx->kv, seq, &h->kv, err);
    if (rc) { free(h->h2o); free(h); return rc; }
    h->n_evicted = ctx->n_evicted[seq];
    if (h->h2o) memcpy(h->h2o, h2o_scores(ctx, seq), (size_t)ctx->budget * sizeof(float));
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
    ctx->n_evicted[seq] = h->n_evicted;
    if (h->h2o) memcpy(h2o_scores(ctx, seq), h->h2o, (size_t)ctx->budget * sizeof(float));
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
        *tokens_per_s = ctx->compute_seconds > 0 ? (double)ctx->tokens_computed / ctx->compute_seconds : 0;
}

void kvlm_ctx_reset(kvlm_ctx *ctx) {
    for (int s = ctx->seq_lo; s < ctx->seq_end; s++) kvlm_seq_free(ctx, s);
    ctx->n_logits = 0;
}

int kvlm_seq_fork(kvlm_ctx *ctx, int src, int dst, kvlm_error *err) {
    if (!seq_ok(ctx, src) || !seq_ok(ctx, dst)) return bad_seq(ctx, err);
    if (ctx->spec && (ctx->spec[src].on || ctx->spec[dst].on) && src != dst)
        return util_err_set(err, KVLM_EINVAL, "sequence %d holds unverified tokens: trim it before forking",
                            ctx->spec[src].on ? src : dst);
    int rc = kv_store_fork(ctx->kv, src, dst, err);
    if (rc || src == dst) return rc;
    ctx->n_evicted[dst] = ctx->n_evicted[src];
    if (ctx->h2o) memcpy(h2o_scores(ctx, dst), h2o_scores(ctx, src), (size_t)ctx->budget * sizeof(float));
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
    if (ctx->n_evicted[seq])
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

int kvlm_ctx_device(const kvlm_ctx *ctx) { return ctx->p.device; }

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
    st->tokens_computed = ctx->tokens_computed;
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

/* ---- the forward pass --------------------------------------------------------- */

static op_mm_out mm_out(float *y, const model_tensor *w) {
    op_mm_out o = {y, w->packed ? w->packed : w->data, w->packed ? w->packed_type : w->type, (int)w->n_out};
    return o;
}

static void matmul(kvlm_ctx *ctx, float *y, const float *x, const model_tensor *w, int T) {
    op_mm_out o = mm_out(y, w);
    op_backend_cpu()->matmul_n(ctx->pool, x, T, (int)w->n_in, &o, 1, ctx->mm_work);
}

/* y[0, n) += the bias's elements [i0, i0 + n), if the tensor has one */
static void add_bias(float *y, const model_tensor *b, int i0, int n) {
    if (b->data) op_backend_cpu()->add(y, (const float *)b->data + i0, n);
}

static void attend_runs(kvlm_ctx *ctx, int n, float *const *out, const float *const *q, const op_attn_args *a) {
    if (ctx->naive_attention)
        for (int i = 0; i < n; i++) op_attention_ref(out[i], q[i], &a[i]);
    else op_backend_cpu()->attention_n(ctx->pool, n, out, q, a, ctx->attn_work);
}

/* h2o, an unverified token of a speculating sequence: where its query's
 * attention goes until kvlm_seq_trim keeps or drops it; else NULL. */
static float *spec_row(const kvlm_ctx *ctx, int seq, int pos) {
    if (!ctx->h2o || !ctx->spec || !ctx->spec[seq].on || ctx->spec[seq].from < 0 || ctx->spec_h2o_direct) return NULL;
    return ctx->spec[seq].rows + (size_t)(pos - ctx->spec[seq].from) * ctx->budget;
}

/* Attention for tokens [0, T): each run of consecutive positions of one
 * sequence is one call over that sequence's blocks; the calls of a step (one
 * per sequence in batched decode) go to the threads together. */
static void attention(kvlm_ctx *ctx, int layer, const int32_t *seq, const int32_t *pos, int T) {
    const kvlm_config *c = &ctx->model->cfg;
    int HD = c->head_dim, QD = c->n_heads * HD;
    /* the context's block size: a guest layout's for a draft context */
    const size_t per_run = (size_t)ctx->p.n_ctx / ctx->p.block_size + 2;
    op_attn_args args[ATT_RUNS];
    float *outs[ATT_RUNS];
    const float *qs[ATT_RUNS];
    int n = 0;
    double t_start = util_now_s();
    for (int t0 = 0; t0 < T;) {
        int t1 = t0 + 1;
        float *kw = spec_row(ctx, seq[t0], pos[t0]);
        while (!kw && t1 < T && seq[t1] == seq[t0] && pos[t1] == pos[t1 - 1] + 1) t1++;
        op_attn_args *a = &args[n];
        memset(a, 0, sizeof *a);
        kv_store_attn_view(ctx->kv, layer, seq[t0], pos[t1 - 1], ctx->block_ptrs + (size_t)n * per_run, a);
        a->T = t1 - t0;
        a->q_pos0 = pos[t0];
        a->n_heads = c->n_heads;
        a->n_kv_heads = c->n_kv_heads;
        a->head_dim = HD;
        a->scale = c->attn_scale > 0 ? c->attn_scale : 1.0f / sqrtf((float)HD);
        /* YaRN's magnitude rides the rotation: not in NoPE layers, nor in OLMo 3's plain local ones */
        if (!model_layer_rope(c, layer) || (model_scaling_global_only(c) && model_layer_window(c, layer) > 0))
            a->scale /= model_yarn_mscale2(c);
        a->window = model_layer_window(c, layer);
        a->softcap = c->attn_softcap;
        a->sinks = ctx->model->layers[layer].attn_sinks.data; /* gpt-oss; NULL elsewhere */
        a->key_weights = kw ? kw : h2o_scores(ctx, seq[t0]);
        a->score_work = ctx->h2o_work;
        a->score_work_floats = ctx->h2o_work_floats;
        outs[n] = ctx->att + (size_t)t0 * QD;
        qs[n] = ctx->q + (size_t)t0 * QD;
        if (++n == ctx->att_runs) { attend_runs(ctx, n, outs, qs, args); n = 0; }
        t0 = t1;
    }
    if (n) attend_runs(ctx, n, outs, qs, args);
    ctx->attn_seconds += util_now_s() - t_start;
}

/* ---- per-token work -----------------------------------------------------------------
 * What lies between the matrix products is per token (or per token and KV
 * head). Most of it prepares the next product's input rows and runs in the
 * threads' pass that quantizes them (op_matmul_prep); the work after the Q, K,
 * V product has a pass of its own, whose units go out through one counter, so
 * a thread that was descheduled holds no one up. Which thread runs a unit
 * never changes its result. */
typedef struct {
    kvlm_ctx *ctx;
    const int32_t *tokens, *seq, *pos;
    int T, layer, n_units;
    const model_layer *L;
    const float *norm;   /* prep_residual's rmsnorm weights */
    atomic_int next;
    const float *post_norm; /* gemma: the norm of the product in xb before it joins the residual (NULL: none) */
    const float *rcs, *rsn; /* this layer's RoPE cos/sin (rope_cs, or gemma3's local ones) */
    float q_mag;            /* multiplies q's rotated dimensions: LongRoPE's magnitude squared, else 1 */
    bool rope;              /* this layer turns q and k (smollm3's NoPE layers do not) */
} fwd_pass;

static int next_unit(fwd_pass *j) {
    int u = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
    return u < j->n_units ? u : -1;
}

static void run_pass(kvlm_ctx *ctx, util_pool_fn fn, fwd_pass *j, int n_units) {
    j->n_units = n_units;
    atomic_store_explicit(&j->next, 0, memory_order_relaxed);
    if (j->T >= OP_MM_PREP_MIN_T) util_pool_run(ctx->pool, fn, j); /* fewer: a pass costs more than the work */
    else fn(j, 0, 1);
}

/* x[t] += xb[t] (add; normed first with post when non-NULL), then dst =
 * rmsnorm(x[t]) with weights w. */
static void residual_norm(kvlm_ctx *ctx, int t, bool add, float *dst, const float *w, const float *post) {
    const kvlm_config *c = &ctx->model->cfg;
    float *x = ctx->x + (size_t)t * c->dim;
    float *xb = ctx->xb + (size_t)t * c->dim;
    if (add && post) op_backend_cpu()->rmsnorm(xb, xb, post, c->dim, c->norm_eps);
    if (add && c->residual_mult > 0) /* granite: the branch's output scaled before it joins */
        for (int i = 0; i < c->dim; i++) xb[i] *= c->residual_mult;
    if (add) op_backend_cpu()->add(x, xb, c->dim);
    if (w) op_backend_cpu()->rmsnorm(dst, x, w, c->dim, c->norm_eps);
    else memcpy(dst, x, (size_t)c->dim * sizeof(float)); /* olmo2: no norm before the next product */
}

/* Layer 0's input row t: the token's embedding, its position's RoPE cos/sin
 * (for every layer's q and k), the first rmsnorm. */
static void prep_embed(void *p, int t) {
    fwd_pass *j = p;
    const kvlm_model *m = j->ctx->model;
    int D = m->cfg.dim, half = m->cfg.rope_dim / 2;
    float *x = j->ctx->x + (size_t)t * D;
    dt_dequantize_row(m->tok_embd.type,
                      (const char *)m->tok_embd.data + (size_t)j->tokens[t] * dt_row_size(m->tok_embd.type, D), x, D);
    float es = model_embed_scale(&m->cfg);
    if (es != 1.0f)
        for (int i = 0; i < D; i++) x[i] *= es;
    op_backend_cpu()->rope_cossin(j->ctx->rope_cs + (size_t)t * half, j->ctx->rope_sn + (size_t)t * half, m->cfg.rope_dim,
                   j->pos[t], m->cfg.rope_base, j->ctx->rope_freqs);
    if (j->ctx->rope_cs_local) /* gemma3's local layers: plain RoPE */
        op_backend_cpu()->rope_cossin(j->ctx->rope_cs_local + (size_t)t * half, j->ctx->rope_sn_local + (size_t)t * half,
                                      m->cfg.rope_dim, j->pos[t], m->cfg.rope_base_local, NULL);
    residual_norm(j->ctx, t, false, j->ctx->xb + (size_t)t * D, j->norm, NULL);
}

/* The residual of the product in xb, then the next rmsnorm, back into xb. */
static void prep_residual(void *p, int t) {
    fwd_pass *j = p;
    residual_norm(j->ctx, t, true, j->ctx->xb + (size_t)t * j->ctx->model->cfg.dim, j->norm, j->post_norm);
}

static void prep_swiglu(void *p, int t) {
    fwd_pass *j = p;
    size_t F = (size_t)j->ctx->model->cfg.hidden_dim;
    kvlm_arch arch = j->ctx->model->cfg.arch;
    if (arch == KVLM_ARCH_GEMMA2 || arch == KVLM_ARCH_GEMMA3) op_geglu(j->ctx->hb + t * F, j->ctx->hb2 + t * F, (int)F);
    else op_backend_cpu()->swiglu(j->ctx->hb + t * F, j->ctx->hb2 + t * F, (int)F);
}

/* Row r of out_rows: its token's last residual and the output norm. */
static void prep_output(void *p, int r) {
    fwd_pass *j = p;
    residual_norm(j->ctx, j->ctx->out_tok[r], true, j->ctx->out_rows + (size_t)r * j->ctx->model->cfg.dim,
                  j->ctx->model->output_norm.data, j->post_norm);
}

/* KV head h of token t: biases, RoPE of the key, both rows into the cache. */
static void kv_head(fwd_pass *j, int t, int h) {
    kvlm_ctx *ctx = j->ctx;
    const kvlm_config *c = &ctx->model->cfg;
    int HD = c->head_dim, half = c->rope_dim / 2;
    size_t row = ((size_t)t * c->n_kv_heads + h) * HD;
    add_bias(ctx->k + row, &j->L->bk, h * HD, HD);
    add_bias(ctx->v + row, &j->L->bv, h * HD, HD);
    if (j->L->k_norm.data && !c->qk_norm_full)
        op_backend_cpu()->rmsnorm(ctx->k + row, ctx->k + row, j->L->k_norm.data, HD, c->norm_eps);
    if (j->rope)
        op_backend_cpu()->rope_apply(ctx->k + row, 1, HD, c->rope_dim, j->rcs + (size_t)t * half, j->rsn + (size_t)t * half,
                                     c->rope_neox);
    kv_store_write_row(ctx->kv, j->layer, j->seq[t], j->pos[t], h, ctx->k + row, ctx->v + row);
}

/* After the Q, K, V products. Units [0, T): token t's query (bias, RoPE) and,
 * unless keys are q4_kc, its keys and values. q4_kc: then one unit per
 * sequence of the chunk and KV head writes that sequence's tokens in order
 * (they share the staging: see kv_store_write_row). */
static void qkv_worker(void *p, int ith, int nth) {
    (void)ith, (void)nth;
    fwd_pass *j = p;
    kvlm_ctx *ctx = j->ctx;
    const kvlm_config *c = &ctx->model->cfg;
    int QD = c->n_heads * c->head_dim, half = c->rope_dim / 2, H = c->n_kv_heads;
    bool kc = ctx->p.cache_type_k == KVLM_CACHE_Q4_KC; /* the context's: a draft's guest keys are per-token */
    for (int u; (u = next_unit(j)) >= 0;) {
        if (u < j->T) {
            float *q = ctx->q + (size_t)u * QD;
            add_bias(q, &j->L->bq, 0, QD);
            if (j->L->q_norm.data && !c->qk_norm_full)
                for (int h = 0; h < c->n_heads; h++)
                    op_backend_cpu()->rmsnorm(q + (size_t)h * c->head_dim, q + (size_t)h * c->head_dim, j->L->q_norm.data,
                                              c->head_dim, c->norm_eps);
            if (j->rope)
                op_backend_cpu()->rope_apply(q, c->n_heads, c->head_dim, c->rope_dim, j->rcs + (size_t)u * half,
                                             j->rsn + (size_t)u * half, c->rope_neox);
            if (j->q_mag != 1.0f) /* LongRoPE's magnitude, q's and k's, on q's turned dimensions */
                for (int h = 0; h < c->n_heads; h++)
                    for (int i = 0; i < c->rope_dim; i++) q[(size_t)h * c->head_dim + i] *= j->q_mag;
            for (int h = 0; !kc && h < H; h++) kv_head(j, u, h);
        } else {
            u -= j->T;
            for (int t = ctx->grp_first[u / H]; t >= 0; t = ctx->tok_next[t]) kv_head(j, t, u % H);
        }
    }
}

/* Links the chunk's tokens of each sequence in batch order (tok_next) and
 * returns the number of sequences, their first tokens in grp_first. */
static int group_by_seq(kvlm_ctx *ctx, const int32_t *seq, int T) {
    int n = 0;
    for (int t = T - 1; t >= 0; t--) {
        ctx->tok_next[t] = ctx->seq_at[seq[t]];
        ctx->seq_at[seq[t]] = t;
    }
    for (int t = 0; t < T; t++)
        if (ctx->seq_at[seq[t]] == t) ctx->grp_first[n++] = t;
    for (int t = 0; t < T; t++) ctx->seq_at[seq[t]] = -1;
    return n;
}

/* One chunk of at most n_batch tokens; want[t] marks tokens whose logits
 * go to ctx->logits. */
/* Hidden states of the chunk's tokens that asked for them (emb), from the
 * rows prep_output left in out_rows, in token order into ctx->embd. */
static void take_embd(kvlm_ctx *ctx, const int8_t *emb, int T, int n_out) {
    int D = ctx->model->cfg.dim;
    for (int r = 0; r < n_out; r++) ctx->emb_row[ctx->out_tok[r]] = r;
    for (int t = 0; t < T; t++)
        if (emb[t])
            memcpy(ctx->embd + (size_t)ctx->n_embd++ * D, ctx->out_rows + (size_t)ctx->emb_row[t] * D,
                   (size_t)D * sizeof(float));
}

static void forward_chunk(kvlm_ctx *ctx, const int32_t *tokens, const int32_t *seq, const int32_t *pos, int T,
                          const int8_t *want, const int8_t *emb) {
    const kvlm_model *m = ctx->model;
    const kvlm_config *c = &m->cfg;
    if (ctx->mla) {
        kv_store_rows_written(ctx->kv, seq, pos, T);
        ctx->n_logits += engine_mla_chunk(ctx->mla, ctx->pool, ctx->kv, tokens, seq, pos, T, want,
                                          ctx->logits + (size_t)ctx->n_logits * c->vocab_size, ctx->naive_attention,
                                          &ctx->attn_seconds);
        ctx->tokens_computed += (uint64_t)T;
        return;
    }
    fwd_pass j = {.ctx = ctx, .tokens = tokens, .seq = seq, .pos = pos, .T = T, .q_mag = model_longrope_mscale2(c)};
    int n_out = 0, n_lg;
    for (int t = 0; t < T; t++)
        if (want[t]) ctx->out_tok[n_out++] = t;
    n_lg = n_out; /* rows past these want the final norm's output only: no logits */
    for (int t = 0; emb && t < T; t++)
        if (emb[t] && !want[t]) ctx->out_tok[n_out++] = t;
    kv_store_rows_written(ctx->kv, seq, pos, T);
    int n_groups = ctx->p.cache_type_k == KVLM_CACHE_Q4_KC ? group_by_seq(ctx, seq, T) : 0;
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        j.L = L;
        j.layer = l;
        j.norm = L->attn_norm.data;
        j.post_norm = l ? m->layers[l - 1].post_ffn_norm.data : NULL;
        bool local_rope = ctx->rope_cs_local && model_layer_window(c, l) > 0;
        j.rcs = local_rope ? ctx->rope_cs_local : ctx->rope_cs;
        j.rsn = local_rope ? ctx->rope_sn_local : ctx->rope_sn;
        j.rope = model_layer_rope(c, l);
        /* matrices that read the same input: one quantization, one pass of the threads */
        const op_mm_out qkv[3] = {mm_out(ctx->q, &L->wq), mm_out(ctx->k, &L->wk), mm_out(ctx->v, &L->wv)};
        op_backend_cpu()->matmul_prep(ctx->pool, ctx->xb, T, c->dim, qkv, 3, ctx->mm_work, l ? prep_residual : prep_embed, &j);
        if (c->qk_norm_full) /* olmo2: q and k normed across all their heads, before the per-head work */
            for (int t = 0; t < T; t++) {
                float *q = ctx->q + (size_t)t * c->n_heads * c->head_dim, *k = ctx->k + (size_t)t * c->n_kv_heads * c->head_dim;
                op_backend_cpu()->rmsnorm(q, q, L->q_norm.data, c->n_heads * c->head_dim, c->norm_eps);
                op_backend_cpu()->rmsnorm(k, k, L->k_norm.data, c->n_kv_heads * c->head_dim, c->norm_eps);
            }
        run_pass(ctx, qkv_worker, &j, T + n_groups * c->n_kv_heads);
        attention(ctx, l, seq, pos, T);
        matmul(ctx, ctx->xb, ctx->att, &L->wo, T);
        if (L->bo.data) /* gpt-oss: the output's bias */
            for (int t = 0; t < T; t++) add_bias(ctx->xb + (size_t)t * c->dim, &L->bo, 0, c->dim);
        j.norm = L->ffn_norm.data;
        j.post_norm = L->post_attn_norm.data;
        if (L->ffn_gate_inp.data) { /* experts: x += MoE(norm(x + attention)), and nothing left in xb to add */
            for (int t = 0; t < T; t++) prep_residual(&j, t);
            engine_moe_forward(ctx->moe, ctx->pool, L, ctx->xb, ctx->x, T);
            memset(ctx->xb, 0, (size_t)T * c->dim * sizeof(float));
            continue;
        }
        const op_mm_out gate_up[2] = {mm_out(ctx->hb, &L->w_gate), mm_out(ctx->hb2, &L->w_up)};
        op_backend_cpu()->matmul_prep(ctx->pool, ctx->xb, T, c->dim, gate_up, 2, ctx->mm_work, prep_residual, &j);
        const op_mm_out down = mm_out(ctx->xb, &L->w_down);
        op_backend_cpu()->matmul_prep(ctx->pool, ctx->hb, T, c->hidden_dim, &down, 1, ctx->mm_work, prep_swiglu, &j);
    }
    if (n_out) {
        j.post_norm = m->layers[c->n_layers - 1].post_ffn_norm.data;
        if (n_lg) {
            const op_mm_out out = mm_out(ctx->logits + (size_t)ctx->n_logits * c->vocab_size, &m->output);
            op_backend_cpu()->matmul_prep(ctx->pool, ctx->out_rows, n_lg, c->dim, &out, 1, ctx->mm_work, prep_output, &j);
            if (c->final_softcap > 0)
                op_softcap(ctx->logits + (size_t)ctx->n_logits * c->vocab_size, n_lg * c->vocab_size, c->final_softcap);
            if (c->logit_div > 0) { /* granite */
                float *lg = ctx->logits + (size_t)ctx->n_logits * c->vocab_size, inv = 1.0f / c->logit_div;
                for (size_t i = 0; i < (size_t)n_lg * c->vocab_size; i++) lg[i] *= inv;
            }
            ctx->n_logits += n_lg;
        }
        for (int r = n_lg; r < n_out; r++) prep_output(&j, r); /* embeddings only: the norm, no product */
        if (emb) take_embd(ctx, emb, T, n_out);
    }
    ctx->tokens_computed += (uint64_t)T;
}

/* The same chunk on the GPU. */
static int forward_chunk_cuda(kvlm_ctx *ctx, const int32_t *tokens, const int32_t *seq, const int32_t *pos, int T,
                              const int8_t *want, kvlm_error *err) {
    int n_out = 0;
    for (int t = 0; t < T; t++) n_out += want[t] != 0;
    int rc = engine_cuda_forward(ctx->cuda, ctx->kv, tokens, seq, pos, T, want,
                                 ctx->logits + (size_t)ctx->n_logits * ctx->model->cfg.vocab_size, err);
    if (rc) return rc;
    ctx->n_logits += n_out;
    ctx->tokens_computed += (uint64_t)T;
    return KVLM_OK;
}

static int forward(kvlm_ctx *ctx, const int32_t *tokens, const int32_t *seq, const int32_t *pos, int n,
                   const int8_t *want, const int8_t *emb, kvlm_error *err) {
    double t0 = util_now_s();
    for (int i = 0; i < n; i += ctx->n_batch) {
        int T = n - i < ctx->n_batch ? n - i : ctx->n_batch;
        if (!ctx->cuda) forward_chunk(ctx, tokens + i, seq + i, pos + i, T, want + i, emb ? emb + i : NULL);
        else {
            int rc = forward_chunk_cuda(ctx, tokens + i, seq + i, pos + i, T, want + i, err);
            if (rc) return rc;
        }
    }
    ctx->compute_seconds += util_now_s() - t0;
    return KVLM_OK;
}

/* Room for n_emb more hidden states after the n_embd held. */
static int grow_embd(kvlm_ctx *ctx, int n_emb) {
    if (ctx->n_embd + n_emb <= ctx->embd_cap) return 0;
    float *e = realloc(ctx->embd, (size_t)(ctx->n_embd + n_emb) * ctx->model->cfg.dim * sizeof(float));
    if (!e) return -1;
    ctx->embd = e;
    ctx->embd_cap = ctx->n_embd + n_emb;
    return 0;
}

static int grow_batch_arrays(kvlm_ctx *ctx, int n, int n_want) {
    if (n_want > ctx->logits_cap) {
        float *nl = realloc(ctx->logits, (size_t)n_want * ctx->model->cfg.vocab_size * sizeof(float));
        if (!nl) return -1;
        ctx->logits = nl;
        ctx->logits_cap = n_want;
    }
    int32_t *a = realloc(ctx->tok_seq, (size_t)n * sizeof(int32_t));
    if (!a) return -1;
    ctx->tok_seq = a;
    int32_t *b = realloc(ctx->tok_pos, (size_t)n * sizeof(int32_t));
    if (!b) return -1;
    ctx->tok_pos = b;
    return 0;
}

/* RoPE composes: rotating a key of position p by -shift gives position p - shift. */
static void rekey(void *user, float *keys, int n_rows, int shift) {
    const kvlm_ctx *ctx = user;
    const kvlm_config *c = &ctx->model->cfg;
    if (c->arch == KVLM_ARCH_DEEPSEEK2) { /* latent rows: only the shared key part at their end turns */
        int W = kv_store_params_of(ctx->kv)->head_dim;
        op_backend_cpu()->rope(keys + c->kv_lora_rank, n_rows, W, c->rope_dim, -shift, c->rope_base, NULL, false);
        return;
    }
    /* rows: layer after layer, n_kv_heads each; smollm3's NoPE layers' keys hold no position */
    for (int l = 0, H = c->n_kv_heads; l * H < n_rows; l++)
        if (model_layer_rope(c, l))
            op_backend_cpu()->rope(keys + (size_t)l * H * c->head_dim, H, c->head_dim, c->rope_dim, -shift, c->rope_base,
                                   ctx->rope_freqs, c->rope_neox);
}

/* Makes room for n_new tokens of sequence s within the budget: evicts by the
 * context's policy down to budget - max(n_new, block_size) tokens (amortised:
 * a compaction every block_size tokens), or fails under none. */
static int evict_for(kvlm_ctx *ctx, int s, int n_new, kvlm_error *err) {
    int len = kv_store_seq_len(ctx->kv, s), budget = ctx->budget, bs = kv_store_params_of(ctx->kv)->block_size;
    if (len + n_new <= budget) return KVLM_OK;
    if (ctx->spec && ctx->spec[s].on && ctx->spec[s].from >= 0 && len > ctx->spec[s].from)
        return util_err_set(err, KVLM_ERANGE, "sequence %d: %d unverified tokens and %d more exceed the KV budget of %d; "
                            "trim (kvlm_seq_trim) before it evicts", s, len - ctx->spec[s].from, n_new, budget);
    if (ctx->ev.policy == KVLM_EVICT_NONE)
        return util_err_set(err, KVLM_ERANGE, "sequence %d: %d more tokens exceed the KV budget of %d tokens (%d held; "
                            "eviction policy none stops there: window, sinks or h2o evict instead)", s, n_new, budget, len);
    int min_keep = ctx->ev.policy == KVLM_EVICT_SINKS ? ctx->ev.sinks : 0;
    if (n_new > budget - min_keep)
        return util_err_set(err, KVLM_ERANGE, "sequence %d: a batch of %d tokens cannot fit a KV budget of %d under "
                            "eviction policy %s (feed at most %d at a time)", s, n_new, budget,
                            kvlm_evict_name(ctx->ev.policy), budget - min_keep);
    int target = budget - (n_new > bs ? n_new : bs);
    if (target < min_keep) target = budget - n_new;
    double t_start = util_now_s();
    float *sc = h2o_scores(ctx, s);
    if (kv_evict_select(&ctx->ev, len, target, sc, ctx->keep) != target)
        return util_err_set(err, KVLM_ENOMEM, "out of memory choosing tokens to evict");
    int rc = kv_store_compact(ctx->kv, s, ctx->keep, target, rekey, ctx, err);
    if (rc) return rc;
    if (sc) {
        for (int i = 0; i < target; i++) sc[i] = sc[ctx->keep[i]];
        memset(sc + target, 0, (size_t)(len - target) * sizeof(float));
    }
    ctx->n_evicted[s] += len - target;
    ctx->evict_seconds += util_now_s() - t_start;
    return KVLM_OK;
}

/* What token i of b asks for (kvlm_batch.logits): its logits, its hidden state. */
static bool wants_logits(const kvlm_batch *b, int i) {
    return b->logits ? b->logits[i] != 0 && b->logits[i] != KVLM_OUTPUT_EMBD : i == b->n_tokens - 1;
}
static bool wants_embd(const kvlm_batch *b, int i) {
    return b->logits && (b->logits[i] == KVLM_OUTPUT_EMBD || b->logits[i] == KVLM_OUTPUT_BOTH);
}

/* --no-kv-cache: forget the sequence's keys and values and recompute the
 * whole sequence from its first token. */
static int decode_recompute(kvlm_ctx *ctx, const kvlm_batch *b, int seq, kvlm_error *err) {
    int past = kv_store_seq_len(ctx->kv, seq), n = past + b->n_tokens;
    int32_t *all = malloc((size_t)n * sizeof(int32_t));
    int8_t *want = calloc((size_t)n * 2, 1), *emb = want ? want + n : NULL;
    int rc = KVLM_OK;
    if (!all || !want || grow_batch_arrays(ctx, n, ctx->n_logits + n) || grow_embd(ctx, b->n_tokens)) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    if (past) memcpy(all, kv_store_seq_tokens(ctx->kv, seq), (size_t)past * sizeof(int32_t));
    memcpy(all + past, b->tokens, (size_t)b->n_tokens * sizeof(int32_t));
    bool any_emb = false;
    for (int i = 0; i < b->n_tokens; i++) {
        want[past + i] = wants_logits(b, i);
        any_emb |= emb[past + i] = wants_embd(b, i);
    }
    kv_store_release(ctx->kv, seq);
    if ((rc = kv_store_reserve(ctx->kv, seq, n, err))) goto done;
    for (int i = 0; i < n; i++) { ctx->tok_seq[i] = seq; ctx->tok_pos[i] = i; }
    if ((rc = forward(ctx, all, ctx->tok_seq, ctx->tok_pos, n, want, any_emb ? emb : NULL, err))) {
        kv_store_release(ctx->kv, seq);
        goto done;
    }
    kv_store_commit(ctx->kv, seq, all, n);
done:
    free(all);
    free(want);
    return rc;
}

static int decode(kvlm_ctx *ctx, const kvlm_batch *b, kvlm_error *err);
/* A speculating sequence about to take n more tokens (after any eviction):
 * its first unverified position, the blocks held from it, and h2o rows. */
static int spec_prepare(kvlm_ctx *ctx, int s, int n, kvlm_error *err) {
    if (!ctx->spec || !ctx->spec[s].on) return KVLM_OK;
    spec_seq *sp = &ctx->spec[s];
    int len = kv_store_seq_len(ctx->kv, s);
    if (sp->from < 0) {
        sp->from = len;
        kv_store_hold(ctx->kv, s, len);
    }
    if (!ctx->h2o) return KVLM_OK;
    int need = len + n - sp->from;
    if (need > sp->rows_cap) {
        float *r = realloc(sp->rows, (size_t)need * ctx->budget * sizeof(float));
        if (!r) return util_err_set(err, KVLM_ENOMEM, "out of memory");
        sp->rows = r;
        sp->rows_cap = need;
    }
    memset(sp->rows + (size_t)(len - sp->from) * ctx->budget, 0, (size_t)n * ctx->budget * sizeof(float));
    return KVLM_OK;
}

int kvlm_decode(kvlm_ctx *ctx, const kvlm_batch *b, kvlm_error *err) {
    ctx->n_logits = 0;
    ctx->n_embd = 0;
    return decode(ctx, b, err);
}

/* A sliding-window cache holds a sequence's window and one step of at most
 * n_batch tokens (its pools are sized so): a longer batch goes through in
 * slices of n_batch, each committed before the next (so a failure leaves
 * the slices before it appended). */
static int decode_sliced(kvlm_ctx *ctx, const kvlm_batch *b, kvlm_error *err) {
    int n = b->n_tokens, rc = KVLM_OK;
    int8_t *want = malloc((size_t)n);
    if (!want) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) want[i] = (int8_t)(wants_logits(b, i) | wants_embd(b, i) << 1);
    for (int i0 = 0; i0 < n && !rc; i0 += ctx->n_batch) {
        kvlm_batch sb = {n - i0 < ctx->n_batch ? n - i0 : ctx->n_batch, b->tokens + i0, b->pos ? b->pos + i0 : NULL,
                         want + i0, b->seq ? b->seq + i0 : NULL};
        rc = decode(ctx, &sb, err);
    }
    free(want);
    return rc;
}

/* An encoder's batch (bert, nomic-bert), checked by decode: each sequence's
 * tokens, adjacent in the batch, are a whole input at positions 0, 1, ...
 * (decode has checked them against an empty cache); chunks of at most
 * n_batch tokens take whole sequences (n_batch >= n_ctx >= any of them).
 * The hidden states asked for go to ctx->embd; nothing is kept. */
static int decode_encoder(kvlm_ctx *ctx, const kvlm_batch *b, kvlm_error *err) {
    int n = b->n_tokens, rc = KVLM_OK;
    int8_t *emb = malloc((size_t)n);
    if (!emb) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) emb[i] = wants_embd(b, i);
    for (int i = 0; i < n && !rc; i++) /* logits NULL asks for the last token's */
        if (wants_logits(b, i))
            rc = util_err_set(err, KVLM_EINVAL, "%s is an encoder: it gives no logits (ask for its hidden states: "
                              "KVLM_OUTPUT_EMBD)", model_arch_name(ctx->model->cfg.arch));
    if (!rc && grow_batch_arrays(ctx, n, 0)) rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
    int set = 0;
    for (int i = 0; i < n && !rc; i++, set++) {
        int s = b->seq ? b->seq[i] : ctx->seq_lo;
        bool starts = i == 0 || ctx->tok_seq[i - 1] != s;
        if (starts && ctx->seq_at[s] >= 0)
            rc = util_err_set(err, KVLM_EINVAL, "batch index %d: an encoder takes each sequence's tokens together "
                              "(sequence %d came before)", i, s);
        ctx->seq_at[s] = 0;
        ctx->tok_seq[i] = s;
        ctx->tok_pos[i] = starts ? 0 : ctx->tok_pos[i - 1] + 1;
    }
    for (int i = 0; i < set; i++) ctx->seq_at[ctx->tok_seq[i]] = -1;
    if (rc) { free(emb); return rc; }
    double t0 = util_now_s();
    for (int i0 = 0; i0 < n;) {
        int T = 0;
        while (i0 + T < n) { /* the next whole sequence, if it fits */
            int k = i0 + T + 1;
            while (k < n && ctx->tok_seq[k] == ctx->tok_seq[i0 + T]) k++;
            if (T && k - i0 > ctx->n_batch) break;
            T = k - i0;
        }
        ctx->n_embd += engine_enc_forward(ctx->enc, ctx->pool, b->tokens + i0, ctx->tok_seq + i0, ctx->tok_pos + i0, T,
                                          emb + i0,
                                          ctx->embd + (size_t)ctx->n_embd * ctx->model->cfg.dim, &ctx->attn_seconds);
        ctx->tokens_computed += (uint64_t)T;
        i0 += T;
    }
    ctx->compute_seconds += util_now_s() - t0;
    free(emb);
    return KVLM_OK;
}

static int decode(kvlm_ctx *ctx, const kvlm_batch *b, kvlm_error *err) {
    const kvlm_config *c = &ctx->model->cfg;
    if (!b || b->n_tokens <= 0 || !b->tokens) return util_err_set(err, KVLM_EINVAL, "empty batch");
    int n = b->n_tokens, n_seq = ctx->seq_end;
    int *count = calloc((size_t)n_seq, sizeof(int));
    int *order = malloc((size_t)n_seq * sizeof(int)); /* sequences in order of first appearance */
    int n_order = 0, rc = KVLM_OK, n_want = 0, n_emb = 0;
    if (!count || !order) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    for (int i = 0; i < n; i++) {
        int s = b->seq ? b->seq[i] : ctx->seq_lo;
        if (!seq_ok(ctx, s)) {
            rc = util_err_set(err, KVLM_EINVAL, "batch index %d: sequence %d is outside %d..%d", i, s, ctx->seq_lo,
                              n_seq - 1);
            goto done;
        }
        if (b->tokens[i] < 0 || b->tokens[i] >= c->vocab_size) {
            rc = util_err_set(err, KVLM_EINVAL, "token %d at batch index %d is outside the vocabulary (0..%d)",
                              b->tokens[i], i, c->vocab_size - 1);
            goto done;
        }
        int expect = kv_store_seq_len(ctx->kv, s) + count[s];
        if (b->pos && ctx->ev.policy != KVLM_EVICT_NONE) {
            rc = util_err_set(err, KVLM_EINVAL, "under an eviction policy the cache assigns positions: pass pos NULL");
            goto done;
        }
        if (b->pos && b->pos[i] != expect) {
            rc = util_err_set(err, KVLM_EINVAL, "batch index %d: position %d, expected %d for sequence %d", i,
                              b->pos[i], expect, s);
            goto done;
        }
        if (count[s]++ == 0) order[n_order++] = s;
        n_want += wants_logits(b, i);
        n_emb += wants_embd(b, i);
    }
    if (n_emb && (ctx->cuda || ctx->mla)) {
        rc = util_err_set(err, KVLM_EUNSUPPORTED, "embeddings (hidden states) are computed on the CPU and not for "
                          "deepseek2's latent attention");
        goto done;
    }
    if (grow_embd(ctx, n_emb)) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    for (int k = 0; k < n_order; k++) {
        int s = order[k];
        if ((ctx->ev.policy != KVLM_EVICT_NONE || ctx->budget < ctx->p.n_ctx) && (rc = evict_for(ctx, s, count[s], err)))
            goto done;
        if (kv_store_seq_len(ctx->kv, s) + count[s] > ctx->p.n_ctx) {
            rc = util_err_set(err, KVLM_ERANGE, "sequence %d: %d tokens do not fit in the context of %d (%d already used)",
                              s, count[s], ctx->p.n_ctx, kv_store_seq_len(ctx->kv, s));
            goto done;
        }
        if ((rc = spec_prepare(ctx, s, count[s], err))) goto done;
    }
    if (c->encoder) { /* no cache: the whole of each sequence now, nothing kept */
        rc = decode_encoder(ctx, b, err);
        goto done;
    }
    if (ctx->p.no_kv_cache) {
        if (n_order != 1) { rc = util_err_set(err, KVLM_EINVAL, "--no-kv-cache runs one sequence per batch"); goto done; }
        rc = decode_recompute(ctx, b, order[0], err);
        goto done;
    }
    if (n > ctx->n_batch && c->sliding_window > 0 && c->n_local_layers > 0) {
        rc = decode_sliced(ctx, b, err);
        goto done;
    }
    if (grow_batch_arrays(ctx, n, ctx->n_logits + n_want)) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    /* Reserve every sequence's slots first: all or nothing. */
    for (int k = 0; k < n_order; k++) {
        if ((rc = kv_store_reserve(ctx->kv, order[k], count[order[k]], err))) {
            for (int j = 0; j < k; j++) kv_store_trim(ctx->kv, order[j], kv_store_seq_len(ctx->kv, order[j]));
            goto done;
        }
    }
    memset(count, 0, (size_t)n_seq * sizeof(int));
    int8_t *want = malloc((size_t)n * 2), *emb = want ? want + n : NULL;
    if (!want) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    for (int i = 0; i < n; i++) {
        int s = b->seq ? b->seq[i] : ctx->seq_lo;
        ctx->tok_seq[i] = s;
        ctx->tok_pos[i] = kv_store_seq_len(ctx->kv, s) + count[s]++;
        want[i] = wants_logits(b, i);
        emb[i] = wants_embd(b, i);
    }
    rc = forward(ctx, b->tokens, ctx->tok_seq, ctx->tok_pos, n, want, n_emb ? emb : NULL, err);
    free(want);
    if (rc) { /* a device error: nothing is appended */
        for (int k = 0; k < n_order; k++) kv_store_trim(ctx->kv, order[k], kv_store_seq_len(ctx->kv, order[k]));
        goto done;
    }
    /* Commit each sequence's tokens in order (indexes blocks that filled). */
    for (int k = 0; k < n_order; k++) {
        int s = order[k], m = 0;
        int32_t *toks = ctx->tok_pos; /* reuse as scratch: positions are no longer needed */
        for (int i = 0; i < n; i++)
            if (ctx->tok_seq[i] == s) toks[m++] = b->tokens[i];
        kv_store_commit(ctx->kv, s, toks, m);
    }
done:
    free(count);
    free(order);
    return rc;
}

/* ---- speculative decoding: unverified tokens and rollback ---- */

int kvlm_seq_spec_begin(kvlm_ctx *ctx, int seq, kvlm_error *err) {
    if (!seq_ok(ctx, seq)) return bad_seq(ctx, err);
    if (ctx->p.no_kv_cache)
        return util_err_set(err, KVLM_EUNSUPPORTED, "speculative decoding needs the KV cache (not --no-kv-cache)");
    /* rollback of GPU-resident blocks has not run on a GPU yet (docs/cuda.md) */
    if (ctx->cuda)
        return util_err_set(err, KVLM_EUNSUPPORTED, "speculative decoding runs on the CPU only (not --device cuda yet)");
    if (!ctx->spec) {
        ctx->spec = calloc((size_t)ctx->seq_end, sizeof *ctx->spec);
        if (!ctx->spec) return util_err_set(err, KVLM_ENOMEM, "out of memory");
        for (int s = 0; s < ctx->seq_end; s++) ctx->spec[s].from = -1;
    }
    if (!ctx->spec[seq].on) {
        ctx->spec[seq].on = true;
        ctx->spec[seq].from = -1;
    }
    return KVLM_OK;
}

int kvlm_seq_trim(kvlm_ctx *ctx, int seq, int n_keep, kvlm_error *err) {
    if (!seq_ok(ctx, seq)) return bad_seq(ctx, err);
    int len = kv_store_seq_len(ctx->kv, seq);
    spec_seq *sp = ctx->spec && ctx->spec[seq].on ? &ctx->spec[seq] : NULL;
    int from = sp && sp->from >= 0 ? sp->from : len;
    if (n_keep < 0 || n_keep > len)
        return util_err_set(err, KVLM_EINVAL, "sequence %d holds %d tokens: cannot keep %d", seq, len, n_keep);
    if (sp && n_keep < from)
        return util_err_set(err, KVLM_EINVAL, "sequence %d: cannot keep %d tokens, fewer than the %d verified ones",
                            seq, n_keep, from);
    if (!sp && ctx->h2o && n_keep < len)
        return util_err_set(err, KVLM_EINVAL, "sequence %d: under h2o the scores hold what the tokens to drop attended; "
                            "mark them unverified first (kvlm_seq_spec_begin)", seq);
    if (ctx->p.no_kv_cache && n_keep < len)
        return util_err_set(err, KVLM_EUNSUPPORTED, "--no-kv-cache keeps no cache to take back");
    int rc = kv_store_rollback(ctx->kv, seq, n_keep, err);
    if (rc) return rc;
    if (sp) {
        float *sc = h2o_scores(ctx, seq);
        /* the kept tokens' attention, in their order, as if fed one by one */
        for (int r = 0; sc && !ctx->spec_h2o_direct && r < n_keep - from; r++) {
            const float *row = sp->rows + (size_t)r * ctx->budget;
            for (int i = 0; i <= from + r; i++) sc[i] += row[i];
        }
        sp->on = false;
        sp->from = -1;
    }
    return KVLM_OK;
}

const float *kvlm_get_embeddings(kvlm_ctx *ctx, int i) {
    if (i < 0) i = ctx->n_embd - 1;
    if (i < 0 || i >= ctx->n_embd) return NULL;
    return ctx->embd + (size_t)i * ctx->model->cfg.dim;
}

const float *kvlm_get_logits(kvlm_ctx *ctx, int i) {
    if (i < 0) i = ctx->n_logits - 1;
    if (i < 0 || i >= ctx->n_logits) return NULL;
    return ctx->logits + (size_t)i * ctx->model->cfg.vocab_size;
}

/* ---- engine.h hooks ------------------------------------------------------------ */

void engine_set_naive_attention(kvlm_ctx *ctx, bool naive) { ctx->naive_attention = naive; }
int engine_ctx_n_batch(const kvlm_ctx *ctx) { return ctx->n_batch; }
const char *engine_kv_check(const kvlm_ctx *ctx) { return kv_check(kv_store_pool(ctx->kv)); }
void engine_set_spec_h2o_defer(kvlm_ctx *ctx, bool defer) { ctx->spec_h2o_direct = !defer; }
double engine_attention_seconds(const kvlm_ctx *ctx) { return ctx->attn_seconds; }
struct kv_store *engine_kv_store(kvlm_ctx *ctx) { return ctx->kv; }
kvlm_ctx *engine_ctx_host(const kvlm_ctx *ctx) { return ctx->host; }
double engine_evict_seconds(const kvlm_ctx *ctx) { return ctx->evict_seconds; }
const float *engine_h2o_scores(const kvlm_ctx *ctx, int seq) {
    return seq_ok(ctx, seq) ? h2o_scores(ctx, seq) : NULL;
}
const int32_t *engine_seq_tokens(const kvlm_ctx *ctx, int seq, int *n) {
    *n = kvlm_seq_n_past(ctx, seq);
    return seq_ok(ctx, seq) ? kv_store_seq_tokens(ctx->kv, seq) : NULL;
}

int engine_seq_fill_synthetic(kvlm_ctx *ctx, int seq, int n, uint64_t seed, kvlm_error *err) {
    const kvlm_config *c = &ctx->model->cfg;
    if (!seq_ok(ctx, seq) || n < 0) return util_err_set(err, KVLM_EINVAL, "bad sequence or count");
    if (ctx->cuda) return util_err_set(err, KVLM_EUNSUPPORTED, "synthetic fill writes the cache from the CPU");
    if (ctx->host && !same_cache_shape(c, &ctx->host->model->cfg))
        return util_err_set(err, KVLM_EUNSUPPORTED, "synthetic fill writes rows of the pool's own layout");
    if (grow_batch_arrays(ctx, ctx->n_batch, 0)) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    int rc;
    const kv_params *kp = kv_store_params_of(ctx->kv); /* a latent cache: one row of its own width */
    int n_kv_heads = kp->n_kv_heads, head_dim = kp->head_dim;
    size_t kv_dim = (size_t)n_kv_heads * head_dim;
    uint64_t s = seed * 2654435761u + 1;
    for (int done = 0; done < n;) {
        int T = n - done < ctx->n_batch ? n - done : ctx->n_batch, past = kv_store_seq_len(ctx->kv, seq);
        /* a chunk at a time: a sliding-window cache releases blocks at each commit */
        if ((rc = kv_store_reserve(ctx->kv, seq, T, err))) return rc;
        for (int t = 0; t < T; t++) {
            ctx->tok_seq[t] = seq;
            ctx->tok_pos[t] = past + t;
        }
        for (int l = 0; l < c->n_layers; l++) {
            for (size_t i = 0; i < (size_t)T * kv_dim; i++) {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                ctx->k[i] = (float)((s >> 40) * (2.0 / 16777216.0)) - 1.0f;
                ctx->v[i] = (float)(((s >> 16) & 0xffffff) * (2.0 / 16777216.0)) - 1.0f;
            }
            for (int t = 0; t < T; t++)
                for (int h = 0; h < n_kv_heads; h++) {
                    size_t row = ((size_t)t * n_kv_heads + h) * head_dim;
                    kv_store_write_row(ctx->kv, l, seq, past + t, h, ctx->k + row, ctx->v + row);
                }
        }
        kv_store_rows_written(ctx->kv, ctx->tok_seq, ctx->tok_pos, T);
        for (int t = 0; t < T; t++) ctx->tok_pos[t] = 3 + (past + t) % (c->vocab_size - 3);
        kv_store_commit(ctx->kv, seq, ctx->tok_pos, T);
        done += T;
    }
    return KVLM_OK;
}
