/* engine/forward_mla: the deepseek2 forward pass (docs/mla.md): multi-head
 * latent attention with the up-projections absorbed (the cache holds one
 * latent row per token; queries move into the latent space, outputs back
 * out of it) for prefill and decode alike, then a dense or mixture-of-
 * experts feed-forward (engine/moe.c). */
#include "engine/forward_mla.h"
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "engine/moe.h"
#include "dtype/dtype.h"
#include "ops/backend.h"
#include "ops/ops.h"
#include "util/error.h"
#include "util/timing.h"

struct engine_mla {
    const kvlm_model *m;
    int n_batch, n_ctx, block_size;
    /* per layer and head, f32: W_UK transposed (kv_lora rows of nope: the
     * query's absorption) and W_UV (v_dim rows of kv_lora: the output's) */
    float **uk_t, **uv;
    /* scratch for n_batch tokens */
    float *x, *xb, *qa, *q, *kva, *row, *ql, *ol, *av, *hb, *hb2, *cs, *sn, *outs;
    float *gin, *gout;  /* per thread: one head's rows of the chunk, gathered for the absorption products */
    size_t g_floats;    /* floats of each thread's gin (and gout) */
    void *mm_work, *attn_work;
    size_t attn_work_bytes;
    const float **block_ptrs;
    engine_moe *moe;
};

static size_t mm_need(const model_tensor *t, int T) {
    return t->data ? op_backend_cpu()->matmul_work_size(t->packed ? t->packed_type : t->type, T, (int)t->n_in) : 0;
}

static void matmul(engine_mla *e, util_pool *pool, float *y, const float *x, const model_tensor *w, int T) {
    op_mm_out o = {y, w->packed ? w->packed : w->data, w->packed ? w->packed_type : w->type, (int)w->n_out};
    op_backend_cpu()->matmul_n(pool, x, T, (int)w->n_in, &o, 1, e->mm_work);
}

/* Row r of a 2-D weight as floats. */
static void weight_row(const model_tensor *t, int64_t r, float *y) {
    dt_dequantize_row(t->type, (const char *)t->data + (size_t)r * dt_row_size(t->type, t->n_in), y, t->n_in);
}

/* W_UK^T and W_UV of every layer from attn_kv_b (rows per head: nope key
 * rows, then v_dim value rows, each kv_lora wide), or from attn_k_b and
 * attn_v_b, which hold them per head already. */
static int make_absorbed(engine_mla *e, kvlm_error *err) {
    const kvlm_config *c = &e->m->cfg;
    int H = c->n_heads, R = c->kv_lora_rank, nope = c->head_dim - c->rope_dim, V = c->v_head_dim;
    e->uk_t = calloc((size_t)c->n_layers, sizeof(float *));
    e->uv = calloc((size_t)c->n_layers, sizeof(float *));
    float *tmp = malloc((size_t)R * sizeof(float));
    if (!e->uk_t || !e->uv || !tmp) { free(tmp); return util_err_set(err, KVLM_ENOMEM, "out of memory"); }
    for (int l = 0; l < c->n_layers; l++) {
        const model_tensor *kvb = &e->m->layers[l].wkv_b;
        e->uk_t[l] = malloc((size_t)H * R * nope * sizeof(float));
        e->uv[l] = malloc((size_t)H * V * R * sizeof(float));
        if (!e->uk_t[l] || !e->uv[l]) { free(tmp); return util_err_set(err, KVLM_ENOMEM, "out of memory"); }
        const model_tensor *kb = &e->m->layers[l].wk_b, *vb = &e->m->layers[l].wv_b;
        if (!kvb->data) {
            for (int64_t r = 0; r < (int64_t)H * R; r++) weight_row(kb, r, e->uk_t[l] + (size_t)r * nope);
            for (int64_t r = 0; r < (int64_t)H * V; r++) weight_row(vb, r, e->uv[l] + (size_t)r * R);
            continue;
        }
        for (int h = 0; h < H; h++) {
            int64_t base = (int64_t)h * (nope + V);
            float *uk = e->uk_t[l] + (size_t)h * R * nope;
            for (int i = 0; i < nope; i++) {
                weight_row(kvb, base + i, tmp);
                for (int r = 0; r < R; r++) uk[(size_t)r * nope + i] = tmp[r];
            }
            for (int i = 0; i < V; i++) weight_row(kvb, base + nope + i, e->uv[l] + ((size_t)h * V + i) * R);
        }
    }
    free(tmp);
    return KVLM_OK;
}

void engine_mla_free(engine_mla *e) {
    if (!e) return;
    for (int l = 0; e->uk_t && l < e->m->cfg.n_layers; l++) free(e->uk_t[l]);
    for (int l = 0; e->uv && l < e->m->cfg.n_layers; l++) free(e->uv[l]);
    free(e->uk_t); free(e->uv);
    free(e->x); free(e->xb); free(e->qa); free(e->q); free(e->kva); free(e->row); free(e->ql); free(e->ol);
    free(e->av); free(e->hb); free(e->hb2); free(e->cs); free(e->sn); free(e->outs); free(e->gin); free(e->gout);
    free(e->mm_work); free(e->attn_work); free(e->block_ptrs);
    engine_moe_free(e->moe);
    free(e);
}

engine_mla *engine_mla_create(const kvlm_model *m, int n_batch, int n_ctx, int block_size, int n_threads,
                              kvlm_error *err) {
    const kvlm_config *c = &m->cfg;
    engine_mla *e = calloc(1, sizeof *e);
    if (!e) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    e->m = m;
    e->n_batch = n_batch;
    e->n_ctx = n_ctx;
    e->block_size = block_size;
    size_t T = (size_t)n_batch, H = (size_t)c->n_heads, Dk = (size_t)c->head_dim;
    size_t row = (size_t)c->kv_lora_rank + c->rope_dim, V = (size_t)c->v_head_dim;
    size_t F = (size_t)c->hidden_dim;
    e->x = malloc(T * c->dim * sizeof(float));
    e->xb = malloc(T * c->dim * sizeof(float));
    e->qa = malloc(T * (c->q_lora_rank ? c->q_lora_rank : 1) * sizeof(float));
    e->q = malloc(T * H * Dk * sizeof(float));
    e->kva = malloc(T * row * sizeof(float));
    e->row = malloc(T * row * sizeof(float));
    e->ql = malloc(T * H * row * sizeof(float));
    e->ol = malloc(T * H * c->kv_lora_rank * sizeof(float));
    e->av = malloc(T * H * V * sizeof(float));
    e->hb = malloc(T * (F ? F : 1) * sizeof(float));
    e->hb2 = malloc(T * (F ? F : 1) * sizeof(float));
    e->cs = malloc(T * (size_t)c->rope_dim / 2 * sizeof(float));
    e->sn = malloc(T * (size_t)c->rope_dim / 2 * sizeof(float));
    e->outs = malloc(T * c->dim * sizeof(float));
    size_t wide = (size_t)c->kv_lora_rank > Dk ? (size_t)c->kv_lora_rank : Dk;
    if (V > wide) wide = V;
    e->g_floats = T * wide;
    e->gin = malloc((size_t)(n_threads > 0 ? n_threads : 1) * e->g_floats * sizeof(float));
    e->gout = malloc((size_t)(n_threads > 0 ? n_threads : 1) * e->g_floats * sizeof(float));
    e->block_ptrs = malloc(((size_t)n_ctx / block_size + 2) * sizeof(float *));
    size_t w = mm_need(&m->output, n_batch);
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        const model_tensor *ts[] = {&L->wq, &L->wq_a, &L->wq_b, &L->wkv_a, &L->wo, &L->w_gate, &L->w_up,
                                    &L->w_down, &L->ffn_gate_inp};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
            if (mm_need(ts[i], n_batch) > w) w = mm_need(ts[i], n_batch);
    }
    e->mm_work = malloc(w + 64);
    e->attn_work_bytes = op_attention_mla_work_size(n_threads, c->n_heads, (int)row, n_ctx);
    e->attn_work = malloc(e->attn_work_bytes);
    if (!e->x || !e->xb || !e->qa || !e->q || !e->kva || !e->row || !e->ql || !e->ol || !e->av || !e->hb ||
        !e->hb2 || !e->cs || !e->sn || !e->outs || !e->block_ptrs || !e->mm_work || !e->attn_work || !e->gin ||
        !e->gout) {
        util_err_set(err, KVLM_ENOMEM, "out of memory for the MLA scratch buffers");
        engine_mla_free(e);
        return NULL;
    }
    if (make_absorbed(e, err)) { engine_mla_free(e); return NULL; }
    if (c->n_expert > 0 && c->n_dense_lead < c->n_layers && !(e->moe = engine_moe_create(m, n_batch, err))) {
        engine_mla_free(e);
        return NULL;
    }
    return e;
}

/* YaRN (as llama.cpp's ggml rope with ext_factor 1): pair i rotates by a mix
 * of the position's angle (high frequencies: extrapolation) and that angle
 * over the factor (low: interpolation), the mix ramping between the pair
 * indices where beta_fast and beta_slow rotations fit the original context;
 * the magnitude correction (1 + 0.1 ln factor) cancels against the one the
 * attention factor takes out for deepseek2, and the attention scale gets
 * mscale^2 instead (mla_scale). */
static float yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return (float)n_dims * logf((float)n_ctx_orig / (n_rot * 2 * (float)M_PI)) / (2 * logf(base));
}

static void yarn_cossin(const kvlm_config *c, float *cs, float *sn, int pos) {
    int n = c->rope_dim;
    float fs = 1.0f / c->yarn_factor;
    float lo = floorf(yarn_corr_dim(n, c->yarn_orig_ctx, c->yarn_beta_fast, c->rope_base));
    float hi = ceilf(yarn_corr_dim(n, c->yarn_orig_ctx, c->yarn_beta_slow, c->rope_base));
    lo = lo > 0 ? lo : 0;
    hi = hi < n - 1 ? hi : (float)(n - 1);
    float mag = 1.0f / (1.0f + 0.1f * logf(1.0f / fs)) * (1.0f + 0.1f * logf(1.0f / fs));
    for (int i = 0; i < n / 2; i++) {
        float extrap = (float)pos * powf(c->rope_base, -2.0f * (float)i / (float)n), interp = fs * extrap;
        float y = ((float)i - lo) / fmaxf(0.001f, hi - lo);
        float mix = 1.0f - fminf(1.0f, fmaxf(0.0f, y));
        float theta = interp * (1 - mix) + extrap * mix;
        cs[i] = cosf(theta) * mag;
        sn[i] = sinf(theta) * mag;
    }
}

/* q.k of the decompressed heads over sqrt(key length); YaRN: times mscale^2 */
static float mla_scale(const kvlm_config *c) {
    float ms = c->yarn_factor > 0 ? 1.0f + c->yarn_log_mul * logf(c->yarn_factor) : 1.0f;
    return ms * ms / sqrtf((float)c->head_dim);
}

/* Per head: y[t] (n_out wide, stride ys) = W x[t] (n_in wide, stride xs)
 * for the chunk's T tokens, W an f32 matrix of n_out rows: the rows are
 * gathered so one product reads W once for all of them (on this thread:
 * the heads are the pass's units; f32 products need no work buffer). */
static void head_product(const float *W, int n_in, int n_out, const float *x, size_t xs, float *y, size_t ys, int T,
                         float *gin, float *gout) {
    for (int t = 0; t < T; t++) memcpy(gin + (size_t)t * n_in, x + (size_t)t * xs, (size_t)n_in * sizeof(float));
    op_mm_out o = {gout, W, DT_F32, n_out};
    op_backend_cpu()->matmul_n(NULL, gin, T, n_in, &o, 1, NULL);
    for (int t = 0; t < T; t++) memcpy(y + (size_t)t * ys, gout + (size_t)t * n_out, (size_t)n_out * sizeof(float));
}

typedef struct {
    engine_mla *e;
    int layer, T;
    bool outputs;   /* W_UV on the attention outputs, else W_UK^T on the queries */
    atomic_int next;
} absorb_job;

static void absorb_worker(void *p, int ith, int nth) {
    (void)nth;
    absorb_job *j = p;
    engine_mla *e = j->e;
    const kvlm_config *c = &e->m->cfg;
    int H = c->n_heads, Dk = c->head_dim, nope = Dk - c->rope_dim, R = c->kv_lora_rank, W = R + c->rope_dim;
    int V = c->v_head_dim;
    float *gin = e->gin + (size_t)ith * e->g_floats, *gout = e->gout + (size_t)ith * e->g_floats;
    for (int h; (h = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < H;) {
        if (j->outputs)
            head_product(e->uv[j->layer] + (size_t)h * V * R, R, V, e->ol + (size_t)h * R, (size_t)H * R,
                         e->av + (size_t)h * V, (size_t)H * V, j->T, gin, gout);
        else
            head_product(e->uk_t[j->layer] + (size_t)h * R * nope, nope, R, e->q + (size_t)h * Dk, (size_t)H * Dk,
                         e->ql + (size_t)h * W, (size_t)H * W, j->T, gin, gout);
    }
}

static void absorb(engine_mla *e, util_pool *pool, int layer, int T, bool outputs) {
    absorb_job j = {.e = e, .layer = layer, .T = T, .outputs = outputs};
    atomic_store_explicit(&j.next, 0, memory_order_relaxed);
    util_pool_run(pool, absorb_worker, &j);
}

/* The layer's queries in the latent space: per head, W_UK^T q_nope (kv_lora)
 * then q_pe after RoPE (rope_dim): rows of the cache's width. */
static void absorb_queries(engine_mla *e, util_pool *pool, int layer, int T) {
    const kvlm_config *c = &e->m->cfg;
    int H = c->n_heads, Dk = c->head_dim, nope = Dk - c->rope_dim, R = c->kv_lora_rank, W = R + c->rope_dim;
    int half = c->rope_dim / 2;
    for (int t = 0; t < T; t++) {
        float *q = e->q + (size_t)t * H * Dk;
        op_backend_cpu()->rope_apply(q + nope, H, Dk, c->rope_dim, e->cs + (size_t)t * half, e->sn + (size_t)t * half,
                                     false);
        for (int h = 0; h < H; h++)
            memcpy(e->ql + ((size_t)t * H + h) * W + R, q + (size_t)h * Dk + nope, (size_t)c->rope_dim * sizeof(float));
    }
    absorb(e, pool, layer, T, false);
}

/* Each head's attention output, kv_lora wide, through W_UV into v_dim. */
static void absorb_outputs(engine_mla *e, util_pool *pool, int layer, int T) { absorb(e, pool, layer, T, true); }

static void attention(engine_mla *e, util_pool *pool, kv_store *kv, int layer, const int32_t *seq,
                      const int32_t *pos, int T, bool naive) {
    const kvlm_config *c = &e->m->cfg;
    int H = c->n_heads, R = c->kv_lora_rank, W = R + c->rope_dim;
    for (int t0 = 0; t0 < T;) {
        int t1 = t0 + 1;
        while (t1 < T && seq[t1] == seq[t0] && pos[t1] == pos[t1 - 1] + 1) t1++;
        op_attn_args a;
        memset(&a, 0, sizeof a);
        kv_store_attn_view(kv, layer, seq[t0], pos[t1 - 1], e->block_ptrs, &a);
        a.T = t1 - t0;
        a.q_pos0 = pos[t0];
        a.n_heads = H;
        a.n_kv_heads = 1;
        a.head_dim = W;
        a.v_dim = R;
        /* the scores equal q.k of the decompressed heads: 1/sqrt(key length) */
        a.scale = mla_scale(c);
        float *out = e->ol + (size_t)t0 * H * R;
        const float *q = e->ql + (size_t)t0 * H * W;
        if (naive) op_attention_ref(out, q, &a);
        else op_attention_mla(pool, out, q, &a, e->attn_work);
        t0 = t1;
    }
}

int engine_mla_chunk(engine_mla *e, util_pool *pool, kv_store *kv, const int32_t *tokens, const int32_t *seq,
                     const int32_t *pos, int T, const int8_t *want, float *logits, bool naive, double *attn_seconds) {
    const kvlm_model *m = e->m;
    const kvlm_config *c = &m->cfg;
    const op_backend *B = op_backend_cpu();
    int D = c->dim, R = c->kv_lora_rank, W = R + c->rope_dim, half = c->rope_dim / 2;
    for (int t = 0; t < T; t++) {
        dt_dequantize_row(m->tok_embd.type,
                          (const char *)m->tok_embd.data + (size_t)tokens[t] * dt_row_size(m->tok_embd.type, D),
                          e->x + (size_t)t * D, D);
        if (c->yarn_factor > 0) yarn_cossin(c, e->cs + (size_t)t * half, e->sn + (size_t)t * half, pos[t]);
        else B->rope_cossin(e->cs + (size_t)t * half, e->sn + (size_t)t * half, c->rope_dim, pos[t], c->rope_base, NULL);
    }
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        for (int t = 0; t < T; t++) B->rmsnorm(e->xb + (size_t)t * D, e->x + (size_t)t * D, L->attn_norm.data, D, c->norm_eps);
        if (c->q_lora_rank) {
            matmul(e, pool, e->qa, e->xb, &L->wq_a, T);
            for (int t = 0; t < T; t++) {
                float *r = e->qa + (size_t)t * c->q_lora_rank;
                B->rmsnorm(r, r, L->q_a_norm.data, c->q_lora_rank, c->norm_eps);
            }
            matmul(e, pool, e->q, e->qa, &L->wq_b, T);
        } else matmul(e, pool, e->q, e->xb, &L->wq, T);
        matmul(e, pool, e->kva, e->xb, &L->wkv_a, T);
        /* the cache row: the normed latent, then the shared key part after RoPE */
        for (int t = 0; t < T; t++) {
            float *in = e->kva + (size_t)t * W, *row = e->row + (size_t)t * W;
            B->rmsnorm(row, in, L->kv_a_norm.data, R, c->norm_eps);
            memcpy(row + R, in + R, (size_t)c->rope_dim * sizeof(float));
            B->rope_apply(row + R, 1, c->rope_dim, c->rope_dim, e->cs + (size_t)t * half, e->sn + (size_t)t * half,
                          false);
            kv_store_write_row(kv, l, seq[t], pos[t], 0, row, NULL);
        }
        absorb_queries(e, pool, l, T);
        double t_attn = util_now_s();
        attention(e, pool, kv, l, seq, pos, T, naive);
        *attn_seconds += util_now_s() - t_attn;
        absorb_outputs(e, pool, l, T);
        matmul(e, pool, e->xb, e->av, &L->wo, T);
        for (int t = 0; t < T; t++) B->add(e->x + (size_t)t * D, e->xb + (size_t)t * D, D);
        for (int t = 0; t < T; t++) B->rmsnorm(e->xb + (size_t)t * D, e->x + (size_t)t * D, L->ffn_norm.data, D, c->norm_eps);
        if (l < c->n_dense_lead) {
            int F = c->hidden_dim;
            matmul(e, pool, e->hb, e->xb, &L->w_gate, T);
            matmul(e, pool, e->hb2, e->xb, &L->w_up, T);
            for (int t = 0; t < T; t++) B->swiglu(e->hb + (size_t)t * F, e->hb2 + (size_t)t * F, F);
            matmul(e, pool, e->xb, e->hb, &L->w_down, T);
            for (int t = 0; t < T; t++) B->add(e->x + (size_t)t * D, e->xb + (size_t)t * D, D);
        } else engine_moe_forward(e->moe, pool, L, e->xb, e->x, T);
    }
    int n_out = 0;
    for (int t = 0; t < T; t++)
        if (want[t]) B->rmsnorm(e->outs + (size_t)n_out++ * D, e->x + (size_t)t * D, m->output_norm.data, D, c->norm_eps);
    if (n_out) matmul(e, pool, logits, e->outs, &m->output, n_out);
    return n_out;
}
