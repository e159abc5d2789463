/* engine/moe: the mixture-of-experts feed-forward (deepseek2, Mixtral,
 * qwen2moe, qwen3moe, granitemoe, gpt-oss). Per token the
 * router picks n_expert_used experts; each expert then runs once over the
 * rows of the tokens that chose it (gathered, so its weights are read once
 * per chunk), and the shared experts run over every token. Experts are row
 * views of the stacked 3-D tensors (model_tensor_rows). */
#include "engine/moe.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "ops/backend.h"
#include "ops/ops.h"
#include "util/error.h"

struct engine_moe {
    const kvlm_model *m;
    int n_batch;
    float *logits, *w, *xe, *ge, *ue, *ye;
    int *idx, *rows;
    void *mm_work;
};

void engine_moe_free(engine_moe *e) {
    if (!e) return;
    free(e->logits); free(e->w); free(e->xe); free(e->ge); free(e->ue); free(e->ye);
    free(e->idx); free(e->rows); free(e->mm_work);
    free(e);
}

static size_t mm_need(const model_tensor *t, int T) {
    return t->data ? op_backend_cpu()->matmul_work_size(t->type, T, (int)t->n_in) : 0;
}

engine_moe *engine_moe_create(const kvlm_model *m, int n_batch, kvlm_error *err) {
    const kvlm_config *c = &m->cfg;
    engine_moe *e = calloc(1, sizeof *e);
    if (!e) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    e->m = m;
    e->n_batch = n_batch;
    size_t T = (size_t)n_batch, E = (size_t)c->n_expert, K = (size_t)c->n_expert_used;
    size_t F = (size_t)c->expert_ff * (c->n_expert_shared > 1 ? (size_t)c->n_expert_shared : 1);
    if ((size_t)c->expert_shared_ff > F) F = (size_t)c->expert_shared_ff; /* qwen2moe's shared expert */
    e->logits = malloc(T * E * sizeof(float));
    e->w = malloc(T * K * sizeof(float));
    e->idx = malloc(T * K * sizeof(int));
    e->rows = malloc(T * sizeof(int));
    e->xe = malloc(T * c->dim * sizeof(float));
    e->ge = malloc(T * F * sizeof(float));
    e->ue = malloc(T * F * sizeof(float));
    e->ye = malloc(T * c->dim * sizeof(float));
    size_t w = 0;
    for (int l = c->n_dense_lead; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        const model_tensor *ts[] = {&L->ffn_gate_inp, &L->gate_exps, &L->up_exps, &L->down_exps,
                                    &L->gate_shexp, &L->up_shexp, &L->down_shexp};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
            if (mm_need(ts[i], n_batch) > w) w = mm_need(ts[i], n_batch);
    }
    e->mm_work = malloc(w + 64);
    if (!e->logits || !e->w || !e->idx || !e->rows || !e->xe || !e->ge || !e->ue || !e->ye || !e->mm_work) {
        util_err_set(err, KVLM_ENOMEM, "out of memory for the MoE scratch buffers");
        engine_moe_free(e);
        return NULL;
    }
    return e;
}

/* Rows [row0, row0 + n) of stacked experts: model_tensor_rows, and their
 * packed copy when they are whole 16-row groups of it (model_api.c packs the
 * stacks; a group straddling two experts is read from the file's rows). */
static model_tensor expert_rows(const model_tensor *t, int64_t row0, int64_t n) {
    model_tensor v = model_tensor_rows(t, row0, n);
    if (t->packed && row0 % 16 == 0 && n % 16 == 0) {
        v.packed = (const char *)t->packed + (size_t)row0 * op_pack_row_size(t->type, (int)t->n_in);
        v.packed_type = t->packed_type;
    }
    return v;
}

static op_mm_out mm_of(float *y, const model_tensor *w) {
    return (op_mm_out){y, w->packed ? w->packed : w->data, w->packed ? w->packed_type : w->type, (int)w->n_out};
}

static void matmul(engine_moe *e, util_pool *pool, float *y, const float *x, const model_tensor *w, int T) {
    op_mm_out o = mm_of(y, w);
    op_backend_cpu()->matmul_n(pool, x, T, (int)w->n_in, &o, 1, e->mm_work);
}


void engine_moe_route(const kvlm_config *c, const float *logits, const float *bias, int *idx, float *w) {
    int E = c->n_expert, K = c->n_expert_used;
    float prob[ENGINE_MOE_MAX_EXPERTS], s[ENGINE_MOE_MAX_EXPERTS];
    if (c->expert_gating == 2) {
        for (int i = 0; i < E; i++) prob[i] = 1.0f / (1.0f + expf(-logits[i]));
    } else {
        float mx = -INFINITY, sum = 0;
        for (int i = 0; i < E; i++) mx = logits[i] > mx ? logits[i] : mx;
        for (int i = 0; i < E; i++) sum += (prob[i] = expf(logits[i] - mx));
        for (int i = 0; i < E; i++) prob[i] /= sum;
    }
    /* the selection bias (V3's exp_probs_b) only chooses; weights stay the probabilities */
    for (int i = 0; i < E; i++) s[i] = prob[i] + (bias ? bias[i] : 0.0f);
    for (int k = 0; k < K; k++) { /* highest first; ties: the lower index */
        int best = -1;
        for (int i = 0; i < E; i++) {
            bool taken = false;
            for (int j = 0; j < k; j++) taken |= idx[j] == i;
            if (!taken && (best < 0 || s[i] > s[best])) best = i;
        }
        idx[k] = best;
        w[k] = prob[best];
    }
    if (c->expert_weights_norm) {
        float sum = 0;
        for (int k = 0; k < K; k++) sum += w[k];
        for (int k = 0; k < K; k++) w[k] /= sum;
    }
    float scale = c->expert_weights_scale > 0 ? c->expert_weights_scale : 1.0f;
    for (int k = 0; k < K; k++) w[k] *= scale;
}

/* An expert's biases (gpt-oss; NULL elsewhere): gate, up (F each), down (D). */
typedef struct {
    const float *g, *u, *d;
} expert_bias;

/* ye = down(silu(gate xe) * up xe) for n rows, F wide inside (gate and up in
 * one pass); with biases (gpt-oss) each product's bias added and the clamped
 * SwiGLU (op_swiglu_oai) in place of silu. */
static void ffn(engine_moe *e, util_pool *pool, const model_tensor *g, const model_tensor *u, const model_tensor *d,
                const float *xe, int n, const expert_bias *b) {
    int F = (int)g->n_out, D = (int)d->n_out;
    const op_mm_out gu[2] = {mm_of(e->ge, g), mm_of(e->ue, u)};
    op_backend_cpu()->matmul_n(pool, xe, n, (int)g->n_in, gu, 2, e->mm_work);
    for (int r = 0; r < n; r++) {
        float *ge = e->ge + (size_t)r * F, *ue = e->ue + (size_t)r * F;
        if (!b) {
            op_backend_cpu()->swiglu(ge, ue, F);
            continue;
        }
        op_backend_cpu()->add(ge, b->g, F);
        op_backend_cpu()->add(ue, b->u, F);
        op_swiglu_oai(ge, ue, F, 1.702f, 7.0f);
    }
    matmul(e, pool, e->ye, e->ge, d, n);
    if (b)
        for (int r = 0; r < n; r++) op_backend_cpu()->add(e->ye + (size_t)r * D, b->d, D);
}

void engine_moe_forward(engine_moe *e, util_pool *pool, const model_layer *L, const float *xn, float *x, int T) {
    const kvlm_config *c = &e->m->cfg;
    int D = c->dim, E = c->n_expert, K = c->n_expert_used, F = c->expert_ff;
    const float rs = c->residual_mult > 0 ? c->residual_mult : 1.0f; /* granitemoe: the branch's multiplier */
    matmul(e, pool, e->logits, xn, &L->ffn_gate_inp, T);
    if (L->ffn_gate_inp_b.data) /* gpt-oss: the router's bias */
        for (int t = 0; t < T; t++) op_backend_cpu()->add(e->logits + (size_t)t * E, L->ffn_gate_inp_b.data, E);
    for (int t = 0; t < T; t++)
        engine_moe_route(c, e->logits + (size_t)t * E, L->exp_probs_b.data, e->idx + (size_t)t * K,
                         e->w + (size_t)t * K);
    for (int ex = 0; ex < E; ex++) {
        int n = 0;
        for (int t = 0; t < T; t++)
            for (int k = 0; k < K; k++)
                if (e->idx[(size_t)t * K + k] == ex) {
                    e->rows[n] = t * K + k;
                    memcpy(e->xe + (size_t)n++ * D, xn + (size_t)t * D, (size_t)D * sizeof(float));
                }
        if (!n) continue;
        model_tensor g = expert_rows(&L->gate_exps, (int64_t)ex * F, F);
        model_tensor u = expert_rows(&L->up_exps, (int64_t)ex * F, F);
        model_tensor d = expert_rows(&L->down_exps, (int64_t)ex * D, D);
        const expert_bias eb = {(const float *)L->gate_exps_b.data + (size_t)ex * F,
                                (const float *)L->up_exps_b.data + (size_t)ex * F,
                                (const float *)L->down_exps_b.data + (size_t)ex * D};
        ffn(e, pool, &g, &u, &d, e->xe, n, L->gate_exps_b.data ? &eb : NULL);
        for (int r = 0; r < n; r++) {
            float wt = e->w[e->rows[r]] * rs, *dst = x + (size_t)(e->rows[r] / K) * D;
            const float *y = e->ye + (size_t)r * D;
            for (int i = 0; i < D; i++) dst[i] += wt * y[i];
        }
    }
    if (L->gate_shexp.data) {
        ffn(e, pool, &L->gate_shexp, &L->up_shexp, &L->down_shexp, xn, T, NULL);
        const float *gw = L->ffn_gate_inp_shexp.data; /* qwen2moe: sigmoid(xn . gw) scales the shared expert */
        for (int t = 0; t < T; t++) {
            float *dst = x + (size_t)t * D, *y = e->ye + (size_t)t * D;
            float g = rs;
            if (gw) {
                double s = 0;
                for (int i = 0; i < D; i++) s += (double)xn[(size_t)t * D + i] * gw[i];
                g *= (float)(1.0 / (1.0 + exp(-s)));
            }
            if (g != 1.0f)
                for (int i = 0; i < D; i++) y[i] *= g;
            op_backend_cpu()->add(dst, y, D);
        }
    }
}
