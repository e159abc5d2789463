/* engine/ctx: the kvlm_ctx every engine file shares (model, params, threads,
 * KV store, scratch, eviction and speculation state); private to src/engine. */
#ifndef KVLM_ENGINE_CTX_H
#define KVLM_ENGINE_CTX_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kv/evict.h"
#include "kv/store.h"
#include "kvlm.h"
#include "model/model.h"
#include "util/error.h"
#include "util/pool.h"
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

/* Scratch for n_batch tokens, allocated once at creation (llama2.c's
 * RunState), and the outputs of the last kvlm_decode. */
typedef struct {
    float *x, *xb, *q, *k, *v, *att, *hb, *hb2;
    void *mm_work, *attn_work;
    const float **block_ptrs;  /* the blocks of att_runs sequences for attention */
    int att_runs;
    int32_t *tok_seq, *tok_pos;  /* per token of the current batch */
    /* Per token of the chunk in forward_chunk: */
    float *rope_cs, *rope_sn;  /* cos/sin of its position's RoPE angles (rope_dim / 2 each) */
    /* gemma3: the local layers' RoPE cos/sin (their own base), NULL when
     * every layer has the same base */
    float *rope_cs_local, *rope_sn_local;
    int *out_tok;              /* per row of out_rows: its token */
    int *tok_next;             /* q4_kc: the next token of its sequence in the chunk, -1: none */
    int *grp_first;            /* q4_kc: each sequence's first token in the chunk */
    int *seq_at;               /* per sequence: scratch of group_by_seq, -1 between calls */
    int *emb_row;              /* forward_chunk: each token's row in out_rows */
    float *out_rows;
    /* Logits of the tokens that asked for them in the last call. */
    float *logits;
    int n_logits, logits_cap;
    /* Hidden states (dim each) of the tokens that asked for them (kvlm_batch.embd) in the last call. */
    float *embd;
    int n_embd, embd_cap;
} eng_run_state;

/* Eviction (kvlm.h KVLM_EVICT_*): the budget, the policy and h2o's scores. */
typedef struct {
    int budget;
    kv_evict_params ev;
    float *h2o;                /* h2o: accumulated attention per sequence and cache slot (budget apart) */
    float *h2o_work;           /* h2o: the attention kernels' score scratch (h2o_work_floats) */
    size_t h2o_work_floats;
    int32_t *keep;             /* budget: the tokens a policy keeps */
    long *n_evicted;           /* per sequence */
} eng_evict_state;

/* Speculative decoding. */
typedef struct {
    spec_seq *seq;             /* per sequence (allocated at the first kvlm_seq_spec_begin) */
    bool h2o_direct;           /* engine.h, tests: unverified attention not kept apart */
} eng_spec_state;

/* The forward passes other than the dense CPU one, and the reference attention. */
typedef struct {
    engine_cuda *cuda;         /* device CUDA: weights, KV blocks and the forward pass on the GPU */
    engine_mla *mla;           /* deepseek2: the latent-attention forward pass (engine/forward_mla.c) */
    engine_moe *moe;           /* Mixtral's and qwen3moe's experts (deepseek2's are forward_mla's); NULL: a dense FFN */
    engine_enc *enc;           /* an encoder's (bert, nomic-bert) forward pass (engine/forward_enc.c) */
    bool naive_attention;      /* engine.h: reference attention, the baseline */
} eng_backend;

typedef struct {
    uint64_t tokens_computed;
    double compute_seconds;    /* forward passes, for the tokens/s preemption weighs */
    double attn_seconds;
    double evict_seconds;
} eng_stats;

struct kvlm_ctx {
    const kvlm_model *model;
    kvlm_ctx_params p;
    bool ctx_from_file;        /* n_ctx was not asked for: the model file's */
    int n_batch;
    const float *rope_freqs; /* the RoPE factors its keys turn by (model_rope_freqs of its n_ctx), or NULL */
    util_pool *pool;
    kv_store *kv;
    /* Its sequences are the store's ids [seq_lo, seq_end): a draft context
     * (kvlm_ctx_create_draft) takes those after its host's, in the host's
     * store, which it does not own. Per-sequence arrays have seq_end entries. */
    int seq_lo, seq_end;
    kvlm_ctx *host;
    bool hosts;                /* a draft context uses this one's store */
    kvlm_kv_event_sink events; /* KV events (kvlm_ctx_set_kv_event_sink); event NULL: none */
    int32_t *blocks_tmp;       /* kvlm_kv_cached_blocks' scratch, n_blocks */
    eng_backend be;
    eng_run_state rs;
    eng_evict_state evict;
    eng_spec_state spec;
    eng_stats stats;
};

/* Whether seq is one of the context's sequences. */
static inline bool seq_ok(const kvlm_ctx *ctx, int seq) { return seq >= ctx->seq_lo && seq < ctx->seq_end; }

static inline int bad_seq(const kvlm_ctx *ctx, kvlm_error *err) {
    return util_err_set(err, KVLM_EINVAL, "sequence ids must be in %d..%d", ctx->seq_lo, ctx->seq_end - 1);
}

static inline float *h2o_scores(const kvlm_ctx *ctx, int seq) {
    return ctx->evict.h2o ? ctx->evict.h2o + (size_t)seq * ctx->evict.budget : NULL;
}

static inline bool same_cache_shape(const kvlm_config *a, const kvlm_config *b) {
    return a->n_layers == b->n_layers && a->n_kv_heads == b->n_kv_heads && a->head_dim == b->head_dim;
}

#endif
