/* engine/forward_enc: the encoders' forward pass (bert, nomic-bert), as
 * llama.cpp's graph and Hugging Face's models compute it: the token
 * embedding plus token type 0's (plus bert's absolute position's), a
 * LayerNorm; then per layer Q, K, V (bert: biased; nomic-bert: one fused
 * matrix, NeoX RoPE on q and k), attention over the whole input in both
 * directions (no mask but the input's own end), the output projection, the
 * residual and a LayerNorm; the FFN (bert: GELU with erf, biased;
 * nomic-bert: SwiGLU), the residual and a LayerNorm. The last layer's output
 * is what pools into an embedding. Nothing is cached: each input is whole in
 * the chunk it comes in. Matrix products on the context's kernels; the rest
 * per token (or per input and head, attention) on the context's threads. */
#include "engine/forward_enc.h"
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "dtype/dtype.h"
#include "model/model.h"
#include "ops/backend.h"
#include "ops/ops.h"
#include "util/error.h"
#include "util/timing.h"

struct engine_enc {
    const kvlm_model *m;
    engine_enc_scratch s;
    int n_batch, n_threads;
    float *scores;    /* per thread: a query's scores over an input's keys (n_batch) */
    int *runs;        /* the chunk's inputs: start, length pairs */
};

engine_enc *engine_enc_create(const kvlm_model *model, int n_batch, int n_threads, const engine_enc_scratch *s,
                              kvlm_error *err) {
    engine_enc *e = calloc(1, sizeof *e);
    if (!e) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    e->m = model;
    e->s = *s;
    e->n_batch = n_batch;
    e->n_threads = n_threads > 0 ? n_threads : 1;
    e->scores = malloc((size_t)e->n_threads * n_batch * sizeof(float));
    e->runs = malloc((size_t)n_batch * 2 * sizeof(int));
    if (!e->scores || !e->runs) {
        engine_enc_free(e);
        util_err_set(err, KVLM_ENOMEM, "out of memory for the encoder's scratch");
        return NULL;
    }
    return e;
}

void engine_enc_free(engine_enc *e) {
    if (!e) return;
    free(e->scores);
    free(e->runs);
    free(e);
}

static op_mm_out mm_out(float *y, const model_tensor *w) {
    op_mm_out o = {y, w->packed ? w->packed : w->data, w->packed ? w->packed_type : w->type, (int)w->n_out};
    return o;
}

/* y[0, n) = LayerNorm(x) with weight w and bias b (y may be x) */
static void layer_norm(float *y, const float *x, const float *w, const float *b, int n, float eps) {
    double mean = 0, var = 0;
    for (int i = 0; i < n; i++) mean += x[i];
    mean /= n;
    for (int i = 0; i < n; i++) var += ((double)x[i] - mean) * ((double)x[i] - mean);
    float inv = (float)(1.0 / sqrt(var / n + eps)), mu = (float)mean;
    for (int i = 0; i < n; i++) y[i] = (x[i] - mu) * inv * w[i] + b[i];
}

static void add_bias(float *y, const model_tensor *b, int n) {
    if (!b->data) return;
    const float *bb = b->data;
    for (int i = 0; i < n; i++) y[i] += bb[i];
}

/* One pass of the threads: the work of kind `stage` for the chunk. */
enum { ST_EMBED, ST_QKV, ST_ATTN, ST_RESID_ATTN, ST_FFN_ACT, ST_RESID_FFN };
typedef struct {
    engine_enc *e;
    const int32_t *tokens, *pos;
    int T, n_runs, stage;
    const model_layer *L;
    atomic_int next;
} enc_job;

static void token_work(enc_job *j, int t) {
    engine_enc *e = j->e;
    const kvlm_model *m = e->m;
    const kvlm_config *c = &m->cfg;
    int D = c->dim, F = c->hidden_dim, half = c->rope_dim / 2;
    float *x = e->s.x + (size_t)t * D, *xb = e->s.xb + (size_t)t * D;
    const model_layer *L = j->L;
    switch (j->stage) {
    case ST_EMBED: {
        dt_dequantize_row(m->tok_embd.type, (const char *)m->tok_embd.data + (size_t)j->tokens[t] *
                          dt_row_size(m->tok_embd.type, D), x, D);
        dt_dequantize_row(m->type_embd.type, m->type_embd.data, xb, D); /* token type 0 ("sentence A") */
        op_backend_cpu()->add(x, xb, D);
        if (m->pos_embd.data) { /* bert: position pos's row */
            dt_dequantize_row(m->pos_embd.type, (const char *)m->pos_embd.data + (size_t)j->pos[t] *
                              dt_row_size(m->pos_embd.type, D), xb, D);
            op_backend_cpu()->add(x, xb, D);
        } else
            op_backend_cpu()->rope_cossin(e->s.cs + (size_t)t * half, e->s.sn + (size_t)t * half, c->rope_dim,
                                          j->pos[t], c->rope_base, NULL);
        layer_norm(x, x, m->embd_norm.data, m->embd_norm_b.data, D, c->norm_eps);
        break;
    }
    case ST_QKV: {
        float *q = e->s.q + (size_t)t * D, *k = e->s.k + (size_t)t * D, *v = e->s.v + (size_t)t * D;
        add_bias(q, &L->bq, D);
        add_bias(k, &L->bk, D);
        add_bias(v, &L->bv, D);
        if (!m->pos_embd.data) { /* nomic-bert: NeoX RoPE over each head */
            const float *cs = e->s.cs + (size_t)t * half, *sn = e->s.sn + (size_t)t * half;
            op_backend_cpu()->rope_apply(q, c->n_heads, c->head_dim, c->rope_dim, cs, sn, c->rope_neox);
            op_backend_cpu()->rope_apply(k, c->n_heads, c->head_dim, c->rope_dim, cs, sn, c->rope_neox);
        }
        break;
    }
    case ST_RESID_ATTN: /* x = LN(x + attention's output (+ bias)) */
        add_bias(xb, &L->bo, D);
        op_backend_cpu()->add(x, xb, D);
        layer_norm(x, x, L->attn_out_norm.data, L->attn_out_norm_b.data, D, c->norm_eps);
        break;
    case ST_FFN_ACT: {
        float *h = e->s.hb + (size_t)t * F;
        if (L->w_gate.data) { /* nomic-bert: silu(gate) * up */
            op_backend_cpu()->swiglu(h, e->s.hb2 + (size_t)t * F, F);
        } else { /* bert: GELU (erf, as Hugging Face's "gelu") of up + its bias */
            add_bias(h, &L->b_up, F);
            for (int i = 0; i < F; i++) h[i] = 0.5f * h[i] * (1.0f + erff(h[i] * 0.70710678118654752f));
        }
        break;
    }
    case ST_RESID_FFN:
        add_bias(xb, &L->b_down, D);
        op_backend_cpu()->add(x, xb, D);
        layer_norm(x, x, L->out_norm.data, L->out_norm_b.data, D, c->norm_eps);
        break;
    }
}

/* Attention of one input and one head: every query over every key of its input. */
static void attn_unit(enc_job *j, int u, float *sc) {
    engine_enc *e = j->e;
    const kvlm_config *c = &e->m->cfg;
    int H = c->n_heads, HD = c->head_dim, D = c->dim;
    int r = u / H, h = u % H, start = e->runs[2 * r], len = e->runs[2 * r + 1];
    float scale = c->attn_scale > 0 ? c->attn_scale : 1.0f / sqrtf((float)HD);
    for (int i = 0; i < len; i++) {
        const float *q = e->s.q + (size_t)(start + i) * D + (size_t)h * HD;
        float mx = -INFINITY;
        for (int k = 0; k < len; k++) {
            const float *kk = e->s.k + (size_t)(start + k) * D + (size_t)h * HD;
            float d = 0;
            for (int x = 0; x < HD; x++) d += q[x] * kk[x];
            sc[k] = d * scale;
            if (sc[k] > mx) mx = sc[k];
        }
        float sum = 0;
        for (int k = 0; k < len; k++) sum += sc[k] = expf(sc[k] - mx);
        float inv = 1.0f / sum, *o = e->s.att + (size_t)(start + i) * D + (size_t)h * HD;
        memset(o, 0, (size_t)HD * sizeof(float));
        for (int k = 0; k < len; k++) {
            const float *vv = e->s.v + (size_t)(start + k) * D + (size_t)h * HD;
            float p = sc[k] * inv;
            for (int x = 0; x < HD; x++) o[x] += p * vv[x];
        }
    }
}

static void enc_worker(void *p, int ith, int nth) {
    enc_job *j = p;
    if (j->stage == ST_ATTN) { /* units of an input and a head, taken as they come */
        int n_units = j->n_runs * j->e->m->cfg.n_heads;
        float *sc = j->e->scores + (size_t)ith * j->e->n_batch;
        for (int u; (u = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < n_units;) attn_unit(j, u, sc);
        return;
    }
    long lo, hi;
    util_split(j->T, ith, nth, &lo, &hi);
    for (long t = lo; t < hi; t++) token_work(j, (int)t);
}

static void run_stage(util_pool *pool, enc_job *j, int stage) {
    j->stage = stage;
    atomic_store_explicit(&j->next, 0, memory_order_relaxed);
    util_pool_run(pool, enc_worker, j);
}

int engine_enc_forward(engine_enc *e, util_pool *pool, const int32_t *tokens, const int32_t *seq, const int32_t *pos,
                       int T, const int8_t *emb, float *out, double *attn_seconds) {
    const kvlm_model *m = e->m;
    const kvlm_config *c = &m->cfg;
    int D = c->dim, F = c->hidden_dim;
    enc_job j = {.e = e, .tokens = tokens, .pos = pos, .T = T};
    for (int t = 0; t < T; t++) /* the chunk's inputs: runs of one sequence */
        if (t == 0 || seq[t] != seq[t - 1]) {
            e->runs[2 * j.n_runs] = t;
            e->runs[2 * j.n_runs + 1] = 1;
            j.n_runs++;
        } else e->runs[2 * (j.n_runs - 1) + 1]++;
    run_stage(pool, &j, ST_EMBED);
    const op_backend *be = op_backend_cpu();
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        j.L = L;
        const op_mm_out qkv[3] = {mm_out(e->s.q, &L->wq), mm_out(e->s.k, &L->wk), mm_out(e->s.v, &L->wv)};
        be->matmul_n(pool, e->s.x, T, D, qkv, 3, e->s.mm_work);
        run_stage(pool, &j, ST_QKV);
        double t0 = util_now_s();
        run_stage(pool, &j, ST_ATTN);
        if (attn_seconds) *attn_seconds += util_now_s() - t0;
        const op_mm_out o = mm_out(e->s.xb, &L->wo);
        be->matmul_n(pool, e->s.att, T, D, &o, 1, e->s.mm_work);
        run_stage(pool, &j, ST_RESID_ATTN);
        if (L->w_gate.data) {
            const op_mm_out gu[2] = {mm_out(e->s.hb, &L->w_gate), mm_out(e->s.hb2, &L->w_up)};
            be->matmul_n(pool, e->s.x, T, D, gu, 2, e->s.mm_work);
        } else {
            const op_mm_out up = mm_out(e->s.hb, &L->w_up);
            be->matmul_n(pool, e->s.x, T, D, &up, 1, e->s.mm_work);
        }
        run_stage(pool, &j, ST_FFN_ACT);
        const op_mm_out down = mm_out(e->s.xb, &L->w_down);
        be->matmul_n(pool, e->s.hb, T, F, &down, 1, e->s.mm_work);
        run_stage(pool, &j, ST_RESID_FFN);
    }
    int n = 0;
    for (int t = 0; emb && t < T; t++)
        if (emb[t]) memcpy(out + (size_t)n++ * D, e->s.x + (size_t)t * D, (size_t)D * sizeof(float));
    return n;
}
