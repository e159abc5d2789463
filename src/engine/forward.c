/* engine/forward: the forward pass: a batch of tokens of one or many sequences
 * through every layer, each weight matrix read once for all of them
 * (matrix-matrix), keys and values written into each sequence's blocks,
 * logits on request. */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kv/store.h"
#include "dtype/dtype.h"
#include "model/model.h"
#include "ops/backend.h"
#include "ops/kvtype.h"
#include "ops/ops.h"
#include "util/error.h"
#include "util/pool.h"
#include "util/timing.h"
#include "engine/ctx.h"
#include "engine/forward.h"
#include "engine/forward_cuda.h"
#include "engine/forward_mla.h"

/* ---- the forward pass --------------------------------------------------------- */

static op_mm_out mm_out(float *y, const model_tensor *w) {
    op_mm_out o = {y, w->packed ? w->packed : w->data, w->packed ? w->packed_type : w->type, (int)w->n_out};
    return o;
}

static void matmul(kvlm_ctx *ctx, float *y, const float *x, const model_tensor *w, int T) {
    op_mm_out o = mm_out(y, w);
    op_backend_cpu()->matmul_n(ctx->pool, x, T, (int)w->n_in, &o, 1, ctx->rs.mm_work);
}

/* y[0, n) += the bias's elements [i0, i0 + n), if the tensor has one */
static void add_bias(float *y, const model_tensor *b, int i0, int n) {
    if (b->data) op_backend_cpu()->add(y, (const float *)b->data + i0, n);
}

static void attend_runs(kvlm_ctx *ctx, int n, float *const *out, const float *const *q, const op_attn_args *a) {
    if (ctx->be.naive_attention)
        for (int i = 0; i < n; i++) op_attention_ref(out[i], q[i], &a[i]);
    else op_backend_cpu()->attention_n(ctx->pool, n, out, q, a, ctx->rs.attn_work);
}

/* h2o, an unverified token of a speculating sequence: where its query's
 * attention goes until kvlm_seq_trim keeps or drops it; else NULL. */
static float *spec_row(const kvlm_ctx *ctx, int seq, int pos) {
    if (!ctx->evict.h2o || !ctx->spec.seq || !ctx->spec.seq[seq].on || ctx->spec.seq[seq].from < 0 || ctx->spec.h2o_direct) return NULL;
    return ctx->spec.seq[seq].rows + (size_t)(pos - ctx->spec.seq[seq].from) * ctx->evict.budget;
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
        kv_store_attn_view(ctx->kv, layer, seq[t0], pos[t1 - 1], ctx->rs.block_ptrs + (size_t)n * per_run, a);
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
        a->score_work = ctx->evict.h2o_work;
        a->score_work_floats = ctx->evict.h2o_work_floats;
        outs[n] = ctx->rs.att + (size_t)t0 * QD;
        qs[n] = ctx->rs.q + (size_t)t0 * QD;
        if (++n == ctx->rs.att_runs) { attend_runs(ctx, n, outs, qs, args); n = 0; }
        t0 = t1;
    }
    if (n) attend_runs(ctx, n, outs, qs, args);
    ctx->stats.attn_seconds += util_now_s() - t_start;
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
    float *x = ctx->rs.x + (size_t)t * c->dim;
    float *xb = ctx->rs.xb + (size_t)t * c->dim;
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
    float *x = j->ctx->rs.x + (size_t)t * D;
    dt_dequantize_row(m->tok_embd.type,
                      (const char *)m->tok_embd.data + (size_t)j->tokens[t] * dt_row_size(m->tok_embd.type, D), x, D);
    float es = model_embed_scale(&m->cfg);
    if (es != 1.0f)
        for (int i = 0; i < D; i++) x[i] *= es;
    op_backend_cpu()->rope_cossin(j->ctx->rs.rope_cs + (size_t)t * half, j->ctx->rs.rope_sn + (size_t)t * half, m->cfg.rope_dim,
                   j->pos[t], m->cfg.rope_base, j->ctx->rope_freqs);
    if (j->ctx->rs.rope_cs_local) /* gemma3's local layers: plain RoPE */
        op_backend_cpu()->rope_cossin(j->ctx->rs.rope_cs_local + (size_t)t * half, j->ctx->rs.rope_sn_local + (size_t)t * half,
                                      m->cfg.rope_dim, j->pos[t], m->cfg.rope_base_local, NULL);
    residual_norm(j->ctx, t, false, j->ctx->rs.xb + (size_t)t * D, j->norm, NULL);
}

/* The residual of the product in xb, then the next rmsnorm, back into xb. */
static void prep_residual(void *p, int t) {
    fwd_pass *j = p;
    residual_norm(j->ctx, t, true, j->ctx->rs.xb + (size_t)t * j->ctx->model->cfg.dim, j->norm, j->post_norm);
}

static void prep_swiglu(void *p, int t) {
    fwd_pass *j = p;
    size_t F = (size_t)j->ctx->model->cfg.hidden_dim;
    kvlm_arch arch = j->ctx->model->cfg.arch;
    if (arch == KVLM_ARCH_GEMMA2 || arch == KVLM_ARCH_GEMMA3) op_geglu(j->ctx->rs.hb + t * F, j->ctx->rs.hb2 + t * F, (int)F);
    else op_backend_cpu()->swiglu(j->ctx->rs.hb + t * F, j->ctx->rs.hb2 + t * F, (int)F);
}

/* Row r of out_rows: its token's last residual and the output norm. */
static void prep_output(void *p, int r) {
    fwd_pass *j = p;
    residual_norm(j->ctx, j->ctx->rs.out_tok[r], true, j->ctx->rs.out_rows + (size_t)r * j->ctx->model->cfg.dim,
                  j->ctx->model->output_norm.data, j->post_norm);
}

/* KV head h of token t: biases, RoPE of the key, both rows into the cache. */
static void kv_head(fwd_pass *j, int t, int h) {
    kvlm_ctx *ctx = j->ctx;
    const kvlm_config *c = &ctx->model->cfg;
    int HD = c->head_dim, half = c->rope_dim / 2;
    size_t row = ((size_t)t * c->n_kv_heads + h) * HD;
    add_bias(ctx->rs.k + row, &j->L->bk, h * HD, HD);
    add_bias(ctx->rs.v + row, &j->L->bv, h * HD, HD);
    if (j->L->k_norm.data && !c->qk_norm_full)
        op_backend_cpu()->rmsnorm(ctx->rs.k + row, ctx->rs.k + row, j->L->k_norm.data, HD, c->norm_eps);
    if (j->rope)
        op_backend_cpu()->rope_apply(ctx->rs.k + row, 1, HD, c->rope_dim, j->rcs + (size_t)t * half, j->rsn + (size_t)t * half,
                                     c->rope_neox);
    kv_store_write_row(ctx->kv, j->layer, j->seq[t], j->pos[t], h, ctx->rs.k + row, ctx->rs.v + row);
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
    bool kc = op_kv_in_order(ctx->p.cache_type_k); /* the context's: a draft's guest keys are per-token */
    for (int u; (u = next_unit(j)) >= 0;) {
        if (u < j->T) {
            float *q = ctx->rs.q + (size_t)u * QD;
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
            for (int t = ctx->rs.grp_first[u / H]; t >= 0; t = ctx->rs.tok_next[t]) kv_head(j, t, u % H);
        }
    }
}

/* Links the chunk's tokens of each sequence in batch order (tok_next) and
 * returns the number of sequences, their first tokens in grp_first. */
static int group_by_seq(kvlm_ctx *ctx, const int32_t *seq, int T) {
    int n = 0;
    for (int t = T - 1; t >= 0; t--) {
        ctx->rs.tok_next[t] = ctx->rs.seq_at[seq[t]];
        ctx->rs.seq_at[seq[t]] = t;
    }
    for (int t = 0; t < T; t++)
        if (ctx->rs.seq_at[seq[t]] == t) ctx->rs.grp_first[n++] = t;
    for (int t = 0; t < T; t++) ctx->rs.seq_at[seq[t]] = -1;
    return n;
}

/* One chunk of at most n_batch tokens; want[t] marks tokens whose logits
 * go to ctx->rs.logits. */
/* Hidden states of the chunk's tokens that asked for them (emb), from the
 * rows prep_output left in out_rows, in token order into ctx->rs.embd. */
static void take_embd(kvlm_ctx *ctx, const int8_t *emb, int T, int n_out) {
    int D = ctx->model->cfg.dim;
    for (int r = 0; r < n_out; r++) ctx->rs.emb_row[ctx->rs.out_tok[r]] = r;
    for (int t = 0; t < T; t++)
        if (emb[t])
            memcpy(ctx->rs.embd + (size_t)ctx->rs.n_embd++ * D, ctx->rs.out_rows + (size_t)ctx->rs.emb_row[t] * D,
                   (size_t)D * sizeof(float));
}

static void forward_chunk(kvlm_ctx *ctx, const int32_t *tokens, const int32_t *seq, const int32_t *pos, int T,
                          const int8_t *want, const int8_t *emb) {
    const kvlm_model *m = ctx->model;
    const kvlm_config *c = &m->cfg;
    if (ctx->be.mla) {
        kv_store_rows_written(ctx->kv, seq, pos, T);
        ctx->rs.n_logits += engine_mla_chunk(ctx->be.mla, ctx->pool, ctx->kv, tokens, seq, pos, T, want,
                                          ctx->rs.logits + (size_t)ctx->rs.n_logits * c->vocab_size, ctx->be.naive_attention,
                                          &ctx->stats.attn_seconds);
        ctx->stats.tokens_computed += (uint64_t)T;
        return;
    }
    fwd_pass j = {.ctx = ctx, .tokens = tokens, .seq = seq, .pos = pos, .T = T, .q_mag = model_longrope_mscale2(c)};
    int n_out = 0, n_lg;
    for (int t = 0; t < T; t++)
        if (want[t]) ctx->rs.out_tok[n_out++] = t;
    n_lg = n_out; /* rows past these want the final norm's output only: no logits */
    for (int t = 0; emb && t < T; t++)
        if (emb[t] && !want[t]) ctx->rs.out_tok[n_out++] = t;
    kv_store_rows_written(ctx->kv, seq, pos, T);
    int n_groups = op_kv_in_order(ctx->p.cache_type_k) ? group_by_seq(ctx, seq, T) : 0;
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        j.L = L;
        j.layer = l;
        j.norm = L->attn_norm.data;
        j.post_norm = l ? m->layers[l - 1].post_ffn_norm.data : NULL;
        bool local_rope = ctx->rs.rope_cs_local && model_layer_window(c, l) > 0;
        j.rcs = local_rope ? ctx->rs.rope_cs_local : ctx->rs.rope_cs;
        j.rsn = local_rope ? ctx->rs.rope_sn_local : ctx->rs.rope_sn;
        j.rope = model_layer_rope(c, l);
        /* matrices that read the same input: one quantization, one pass of the threads */
        const op_mm_out qkv[3] = {mm_out(ctx->rs.q, &L->wq), mm_out(ctx->rs.k, &L->wk), mm_out(ctx->rs.v, &L->wv)};
        op_backend_cpu()->matmul_prep(ctx->pool, ctx->rs.xb, T, c->dim, qkv, 3, ctx->rs.mm_work, l ? prep_residual : prep_embed, &j);
        if (c->qk_norm_full) /* olmo2: q and k normed across all their heads, before the per-head work */
            for (int t = 0; t < T; t++) {
                float *q = ctx->rs.q + (size_t)t * c->n_heads * c->head_dim, *k = ctx->rs.k + (size_t)t * c->n_kv_heads * c->head_dim;
                op_backend_cpu()->rmsnorm(q, q, L->q_norm.data, c->n_heads * c->head_dim, c->norm_eps);
                op_backend_cpu()->rmsnorm(k, k, L->k_norm.data, c->n_kv_heads * c->head_dim, c->norm_eps);
            }
        run_pass(ctx, qkv_worker, &j, T + n_groups * c->n_kv_heads);
        attention(ctx, l, seq, pos, T);
        matmul(ctx, ctx->rs.xb, ctx->rs.att, &L->wo, T);
        if (L->bo.data) /* gpt-oss: the output's bias */
            for (int t = 0; t < T; t++) add_bias(ctx->rs.xb + (size_t)t * c->dim, &L->bo, 0, c->dim);
        j.norm = L->ffn_norm.data;
        j.post_norm = L->post_attn_norm.data;
        if (L->ffn_gate_inp.data) { /* experts: x += MoE(norm(x + attention)), and nothing left in xb to add */
            for (int t = 0; t < T; t++) prep_residual(&j, t);
            engine_moe_forward(ctx->be.moe, ctx->pool, L, ctx->rs.xb, ctx->rs.x, T);
            memset(ctx->rs.xb, 0, (size_t)T * c->dim * sizeof(float));
            continue;
        }
        const op_mm_out gate_up[2] = {mm_out(ctx->rs.hb, &L->w_gate), mm_out(ctx->rs.hb2, &L->w_up)};
        op_backend_cpu()->matmul_prep(ctx->pool, ctx->rs.xb, T, c->dim, gate_up, 2, ctx->rs.mm_work, prep_residual, &j);
        const op_mm_out down = mm_out(ctx->rs.xb, &L->w_down);
        op_backend_cpu()->matmul_prep(ctx->pool, ctx->rs.hb, T, c->hidden_dim, &down, 1, ctx->rs.mm_work, prep_swiglu, &j);
    }
    if (n_out) {
        j.post_norm = m->layers[c->n_layers - 1].post_ffn_norm.data;
        if (n_lg) {
            const op_mm_out out = mm_out(ctx->rs.logits + (size_t)ctx->rs.n_logits * c->vocab_size, &m->output);
            op_backend_cpu()->matmul_prep(ctx->pool, ctx->rs.out_rows, n_lg, c->dim, &out, 1, ctx->rs.mm_work, prep_output, &j);
            if (c->final_softcap > 0)
                op_softcap(ctx->rs.logits + (size_t)ctx->rs.n_logits * c->vocab_size, n_lg * c->vocab_size, c->final_softcap);
            if (c->logit_div > 0) { /* granite */
                float *lg = ctx->rs.logits + (size_t)ctx->rs.n_logits * c->vocab_size, inv = 1.0f / c->logit_div;
                for (size_t i = 0; i < (size_t)n_lg * c->vocab_size; i++) lg[i] *= inv;
            }
            ctx->rs.n_logits += n_lg;
        }
        for (int r = n_lg; r < n_out; r++) prep_output(&j, r); /* embeddings only: the norm, no product */
        if (emb) take_embd(ctx, emb, T, n_out);
    }
    ctx->stats.tokens_computed += (uint64_t)T;
}

/* The same chunk on the GPU. */
static int forward_chunk_cuda(kvlm_ctx *ctx, const int32_t *tokens, const int32_t *seq, const int32_t *pos, int T,
                              const int8_t *want, kvlm_error *err) {
    int n_out = 0;
    for (int t = 0; t < T; t++) n_out += want[t] != 0;
    int rc = engine_cuda_forward(ctx->be.cuda, ctx->kv, tokens, seq, pos, T, want,
                                 ctx->rs.logits + (size_t)ctx->rs.n_logits * ctx->model->cfg.vocab_size, err);
    if (rc) return rc;
    ctx->rs.n_logits += n_out;
    ctx->stats.tokens_computed += (uint64_t)T;
    return KVLM_OK;
}

int eng_forward(kvlm_ctx *ctx, const int32_t *tokens, const int32_t *seq, const int32_t *pos, int n,
                const int8_t *want, const int8_t *emb, kvlm_error *err) {
    double t0 = util_now_s();
    for (int i = 0; i < n; i += ctx->n_batch) {
        int T = n - i < ctx->n_batch ? n - i : ctx->n_batch;
        if (!ctx->be.cuda) forward_chunk(ctx, tokens + i, seq + i, pos + i, T, want + i, emb ? emb + i : NULL);
        else {
            int rc = forward_chunk_cuda(ctx, tokens + i, seq + i, pos + i, T, want + i, err);
            if (rc) return rc;
        }
    }
    ctx->stats.compute_seconds += util_now_s() - t0;
    return KVLM_OK;
}
