/* engine/forward: the kvlm_ctx (KV cache, scratch, threads) and the forward
 * pass: a batch of tokens through every layer, prefill as matrix-matrix
 * products, keys and values appended to the cache, logits on request. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kv/cache.h"
#include "model/dtype.h"
#include "model/model.h"
#include "ops/ops.h"
#include "util/error.h"
#include "util/pool.h"

struct kvlm_ctx {
    const kvlm_model *model;
    kvlm_ctx_params p;
    util_pool *pool;
    kv_cache *kv;
    int n_batch;
    /* Scratch for n_batch tokens. */
    float *x, *xb, *q, *k, *v, *att, *hb, *hb2;
    void *mm_work, *attn_work;
    /* Logits of the tokens that asked for them in the last call. */
    float *logits;
    int n_logits, logits_cap;
    float *out_rows;       /* normalised final states of those tokens */
    /* --no-kv-cache: every token seen, recomputed on each call. */
    int32_t *history;
    int n_history;
};

kvlm_ctx_params kvlm_ctx_default_params(void) {
    kvlm_ctx_params p = {0};
    return p;
}

static size_t max_mm_work(const kvlm_model *m, int T) {
    const kvlm_config *c = &m->cfg;
    size_t w = op_matmul_work_size(m->output.type, T, c->dim);
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        const model_tensor *ts[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_down, &L->w_up};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) {
            size_t s = op_matmul_work_size(ts[i]->type, T, (int)ts[i]->n_in);
            if (s > w) w = s;
        }
    }
    return w;
}

kvlm_ctx *kvlm_ctx_create(const kvlm_model *model, const kvlm_ctx_params *params, kvlm_error *err) {
    if (!model || !model->layers) {
        util_err_set(err, KVLM_EINVAL, "the model has no weights (vocabulary-only file?)");
        return NULL;
    }
    const kvlm_config *c = &model->cfg;
    kvlm_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    ctx->model = model;
    ctx->p = params ? *params : kvlm_ctx_default_params();
    if (ctx->p.n_ctx <= 0) ctx->p.n_ctx = c->n_ctx_train;
    if (ctx->p.n_ctx > (1 << 22)) ctx->p.n_ctx = 1 << 22;
    ctx->n_batch = ctx->p.n_batch > 0 ? ctx->p.n_batch : (ctx->p.n_ctx < 512 ? ctx->p.n_ctx : 512);
    if (ctx->n_batch > ctx->p.n_ctx) ctx->n_batch = ctx->p.n_ctx;
    ctx->pool = util_pool_create(ctx->p.n_threads);
    kv_cache_params kp = {c->n_layers, c->n_kv_heads, c->head_dim, ctx->p.n_ctx};
    ctx->kv = kv_cache_create(&kp, err);
    if (!ctx->pool || !ctx->kv) goto fail;
    size_t T = (size_t)ctx->n_batch, q_dim = (size_t)c->n_heads * c->head_dim,
           kv_dim = (size_t)c->n_kv_heads * c->head_dim;
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
    ctx->attn_work = malloc(op_attention_work_size(util_pool_size(ctx->pool), c->head_dim) + 64);
    if (ctx->p.no_kv_cache) ctx->history = malloc((size_t)ctx->p.n_ctx * sizeof(int32_t));
    if (!ctx->x || !ctx->xb || !ctx->q || !ctx->k || !ctx->v || !ctx->att || !ctx->hb || !ctx->hb2 ||
        !ctx->out_rows || !ctx->mm_work || !ctx->attn_work || (ctx->p.no_kv_cache && !ctx->history)) {
        util_err_set(err, KVLM_ENOMEM, "out of memory for the context's scratch buffers");
        goto fail;
    }
    return ctx;
fail:
    if (err && err->code == KVLM_OK) util_err_set(err, KVLM_ENOMEM, "cannot create the thread pool");
    kvlm_ctx_free(ctx);
    return NULL;
}

void kvlm_ctx_free(kvlm_ctx *ctx) {
    if (!ctx) return;
    util_pool_free(ctx->pool);
    kv_cache_free(ctx->kv);
    free(ctx->x); free(ctx->xb); free(ctx->q); free(ctx->k); free(ctx->v); free(ctx->att);
    free(ctx->hb); free(ctx->hb2); free(ctx->out_rows); free(ctx->mm_work); free(ctx->attn_work);
    free(ctx->logits); free(ctx->history);
    free(ctx);
}

int kvlm_ctx_n_ctx(const kvlm_ctx *ctx) { return ctx->p.n_ctx; }
int kvlm_ctx_n_past(const kvlm_ctx *ctx) { return ctx->p.no_kv_cache ? ctx->n_history : kv_cache_len(ctx->kv); }
void kvlm_ctx_reset(kvlm_ctx *ctx) {
    kv_cache_reset(ctx->kv);
    ctx->n_history = 0;
    ctx->n_logits = 0;
}
size_t kvlm_ctx_kv_bytes(const kvlm_ctx *ctx) {
    if (ctx->p.no_kv_cache) return 0;
    return kv_cache_bytes_per_token(ctx->kv) * (size_t)kv_cache_len(ctx->kv);
}
size_t kvlm_ctx_kv_capacity_bytes(const kvlm_ctx *ctx) {
    return kv_cache_bytes_per_token(ctx->kv) * (size_t)kv_cache_capacity(ctx->kv);
}

static void matmul(kvlm_ctx *ctx, float *y, const float *x, const model_tensor *w, int T) {
    op_matmul(ctx->pool, y, x, w->data, w->type, T, (int)w->n_in, (int)w->n_out, ctx->mm_work);
}

static void add_bias(float *y, const model_tensor *b, int T) {
    if (!b->data) return;
    for (int t = 0; t < T; t++) op_add(y + (size_t)t * b->n_in, (const float *)b->data, (int)b->n_in);
}

/* One chunk of at most n_batch tokens at consecutive positions pos0...
 * want[t] marks tokens whose logits are wanted; they go to ctx->logits. */
static void forward_chunk(kvlm_ctx *ctx, const int32_t *tokens, int T, int pos0, const int8_t *want) {
    const kvlm_model *m = ctx->model;
    const kvlm_config *c = &m->cfg;
    int D = c->dim, HD = c->head_dim, QD = c->n_heads * HD, KVD = c->n_kv_heads * HD, F = c->hidden_dim;
    size_t emb_row = dt_row_size(m->tok_embd.type, D);
    for (int t = 0; t < T; t++)
        dt_dequantize_row(m->tok_embd.type, (const char *)m->tok_embd.data + (size_t)tokens[t] * emb_row,
                          ctx->x + (size_t)t * D, D);
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        for (int t = 0; t < T; t++)
            op_rmsnorm(ctx->xb + (size_t)t * D, ctx->x + (size_t)t * D, L->attn_norm.data, D, c->norm_eps);
        matmul(ctx, ctx->q, ctx->xb, &L->wq, T);
        matmul(ctx, ctx->k, ctx->xb, &L->wk, T);
        matmul(ctx, ctx->v, ctx->xb, &L->wv, T);
        add_bias(ctx->q, &L->bq, T);
        add_bias(ctx->k, &L->bk, T);
        add_bias(ctx->v, &L->bv, T);
        for (int t = 0; t < T; t++) {
            op_rope(ctx->q + (size_t)t * QD, c->n_heads, HD, c->rope_dim, pos0 + t, c->rope_base, c->rope_neox);
            op_rope(ctx->k + (size_t)t * KVD, c->n_kv_heads, HD, c->rope_dim, pos0 + t, c->rope_base, c->rope_neox);
        }
        kv_cache_write(ctx->kv, l, pos0, T, ctx->k, ctx->v);
        kv_view view = kv_cache_view(ctx->kv, l);
        op_attn_args a = {T, pos0, c->n_heads, c->n_kv_heads, HD, view.k, view.v, view.head_stride,
                          1.0f / sqrtf((float)HD)};
        op_attention(ctx->pool, ctx->att, ctx->q, &a, ctx->attn_work);
        matmul(ctx, ctx->xb, ctx->att, &L->wo, T);
        op_add(ctx->x, ctx->xb, T * D);
        for (int t = 0; t < T; t++)
            op_rmsnorm(ctx->xb + (size_t)t * D, ctx->x + (size_t)t * D, L->ffn_norm.data, D, c->norm_eps);
        matmul(ctx, ctx->hb, ctx->xb, &L->w_gate, T);
        matmul(ctx, ctx->hb2, ctx->xb, &L->w_up, T);
        op_swiglu(ctx->hb, ctx->hb2, T * F);
        matmul(ctx, ctx->xb, ctx->hb, &L->w_down, T);
        op_add(ctx->x, ctx->xb, T * D);
    }
    int n_out = 0;
    for (int t = 0; t < T; t++)
        if (want[t])
            op_rmsnorm(ctx->out_rows + (size_t)(n_out++) * D, ctx->x + (size_t)t * D, m->output_norm.data, D,
                       c->norm_eps);
    if (n_out) {
        matmul(ctx, ctx->logits + (size_t)ctx->n_logits * c->vocab_size, ctx->out_rows, &m->output, n_out);
        ctx->n_logits += n_out;
    }
}

/* Runs tokens at consecutive positions from pos0 in chunks of n_batch. */
static void forward(kvlm_ctx *ctx, const int32_t *tokens, int n, int pos0, const int8_t *want) {
    for (int i = 0; i < n; i += ctx->n_batch) {
        int T = n - i < ctx->n_batch ? n - i : ctx->n_batch;
        forward_chunk(ctx, tokens + i, T, pos0 + i, want + i);
    }
    kv_cache_set_len(ctx->kv, pos0 + n);
}

int kvlm_decode(kvlm_ctx *ctx, const kvlm_batch *b, kvlm_error *err) {
    const kvlm_config *c = &ctx->model->cfg;
    if (!b || b->n_tokens <= 0 || !b->tokens) return util_err_set(err, KVLM_EINVAL, "empty batch");
    int n = b->n_tokens, past = kvlm_ctx_n_past(ctx);
    for (int i = 0; i < n; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= c->vocab_size)
            return util_err_set(err, KVLM_EINVAL, "token %d at batch index %d is outside the vocabulary (0..%d)",
                                b->tokens[i], i, c->vocab_size - 1);
        /* One sequence per context: positions must continue the sequence. */
        if (b->pos && b->pos[i] != past + i)
            return util_err_set(err, KVLM_EINVAL, "batch index %d has position %d, expected %d", i, b->pos[i],
                                past + i);
    }
    if (past + n > ctx->p.n_ctx)
        return util_err_set(err, KVLM_ERANGE, "%d tokens do not fit in the context of %d (%d already used)", n,
                            ctx->p.n_ctx, past);
    int n_want = 0;
    for (int i = 0; i < n; i++) n_want += b->logits ? b->logits[i] != 0 : i == n - 1;
    if (n_want > ctx->logits_cap) {
        float *nl = realloc(ctx->logits, (size_t)n_want * c->vocab_size * sizeof(float));
        if (!nl) return util_err_set(err, KVLM_ENOMEM, "out of memory for %d rows of logits", n_want);
        ctx->logits = nl;
        ctx->logits_cap = n_want;
    }
    int8_t *want = malloc((size_t)(ctx->p.no_kv_cache ? past + n : n));
    if (!want) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    ctx->n_logits = 0;
    if (!ctx->p.no_kv_cache) {
        for (int i = 0; i < n; i++) want[i] = b->logits ? b->logits[i] != 0 : i == n - 1;
        forward(ctx, b->tokens, n, past, want);
    } else {
        /* The naive loop: forget every key and value, recompute the whole
         * sequence from its first token. */
        memcpy(ctx->history + past, b->tokens, (size_t)n * sizeof(int32_t));
        ctx->n_history = past + n;
        memset(want, 0, (size_t)past);
        for (int i = 0; i < n; i++) want[past + i] = b->logits ? b->logits[i] != 0 : i == n - 1;
        kv_cache_reset(ctx->kv);
        forward(ctx, ctx->history, past + n, 0, want);
    }
    free(want);
    return KVLM_OK;
}

const float *kvlm_get_logits(kvlm_ctx *ctx, int i) {
    if (i < 0) i = ctx->n_logits - 1;
    if (i < 0 || i >= ctx->n_logits) return NULL;
    return ctx->logits + (size_t)i * ctx->model->cfg.vocab_size;
}
