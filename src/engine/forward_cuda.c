/* engine/forward_cuda: the forward pass on a CUDA GPU (see forward_cuda.h):
 * per layer rmsnorm -> Q, K, V products -> bias and RoPE -> the rows into
 * the cache's blocks -> paged attention -> output product -> residual and
 * rmsnorm -> gate, up -> SwiGLU -> down, all on the device; the host only
 * uploads each chunk's tokens, positions and block tables, and reads back
 * the logits asked for. */
#include "engine/forward_cuda.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "model/model.h"
#include "util/error.h"

#ifdef KVLM_HAVE_CUDA
#include "ops/cuda/cuda.h"

#define GRAPH_T 8

typedef struct {
    cu_weight wq, wk, wv, wo, w_gate, w_up, w_down;
    float *attn_norm, *ffn_norm, *bq, *bk, *bv;
} cu_layer;

struct engine_cuda {
    const kvlm_model *m;
    cu_dev *dev;
    kv_storage storage;
    int n_batch, max_blocks, n_seq_max;
    cu_weight tok_embd, output;
    bool output_shared;
    float *output_norm;
    cu_layer *layers;
    size_t weight_bytes;
    /* activations for n_batch tokens */
    float *x, *xb, *q, *k, *v, *att, *ao, *hb, *hb2, *fo, *out_rows, *logits;
    void *att_work;
    int32_t *meta;             /* device: tokens, pos, table_at, rows, tables */
    int32_t *h_meta;           /* host staging of the same */
    int *seq_at;               /* per sequence: its table's offset in this chunk, -1 */
    size_t meta_cap;
    /* decode steps of T <= 8 tokens replay a recorded graph of the whole
     * pass (one launch instead of ~14 per layer), one per (T, rows out) */
    bool use_graphs;
    cu_graph *graphs[GRAPH_T + 1][GRAPH_T + 1];
};

static void *st_alloc(void *u, size_t n) { return cu_alloc(u, n); }
static void st_free(void *u, void *p, size_t n) { (void)n; cu_free(u, p); }
static void st_copy(void *u, void *dst, const void *src, size_t n) { cu_d2d(u, dst, src, n); }
static void st_read(void *u, void *dst, const void *src, size_t n) { cu_tier_read(u, dst, src, n); }
static void st_write(void *u, void *dst, const void *src, size_t n) { cu_tier_write(u, dst, src, n); }

static int upload_vec(engine_cuda *e, float **out, const model_tensor *t, size_t n, kvlm_error *err) {
    *out = NULL;
    if (!t->data) return KVLM_OK;
    if (t->type != 0)
        return util_err_set(err, KVLM_EUNSUPPORTED, "CUDA: tensor %s is not f32", t->name ? t->name : "(norm/bias)");
    *out = cu_alloc(e->dev, n * sizeof(float));
    if (!*out) return util_err_set(err, KVLM_ENOMEM, "CUDA: out of device memory");
    e->weight_bytes += n * sizeof(float);
    return cu_h2d(e->dev, *out, t->data, n * sizeof(float));
}

static int upload_w(engine_cuda *e, cu_weight *w, const model_tensor *t, kvlm_error *err) {
    int rc = cu_weight_upload(e->dev, w, t->data, t->type, t->n_in, t->n_out, err);
    if (rc == KVLM_OK) e->weight_bytes += w->bytes;
    else if (err) {
        size_t n = strlen(err->msg);
        snprintf(err->msg + n, sizeof err->msg - n, " (tensor %.64s)", t->name ? t->name : "?");
    }
    return rc;
}

engine_cuda *engine_cuda_create(const kvlm_model *m, int n_batch, int max_blocks, int n_seq_max, kvlm_error *err) {
    const char *why = cu_unavailable();
    if (why) {
        util_err_set(err, KVLM_EUNSUPPORTED, "--device cuda: the CUDA backend could not be loaded: %s", why);
        return NULL;
    }
    if (cu_device_count() <= 0) {
        util_err_set(err, KVLM_EUNSUPPORTED, "--device cuda: no CUDA GPU is visible (driver missing or no device)");
        return NULL;
    }
    engine_cuda *e = calloc(1, sizeof *e);
    if (!e) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    e->m = m;
    e->n_batch = n_batch;
    e->max_blocks = max_blocks;
    e->n_seq_max = n_seq_max;
    if (!(e->dev = cu_open(0, err))) { free(e); return NULL; }
    e->storage = (kv_storage){"cuda", st_alloc, st_free, st_copy, st_read, st_write, false, e->dev};
    const kvlm_config *c = &m->cfg;
    int L = c->n_layers;
    e->layers = calloc((size_t)L, sizeof *e->layers);
    if (!e->layers) { util_err_set(err, KVLM_ENOMEM, "out of memory"); goto fail; }
    if (upload_w(e, &e->tok_embd, &m->tok_embd, err)) goto fail;
    e->output_shared = m->output.data == m->tok_embd.data && m->output.type == m->tok_embd.type;
    if (e->output_shared) e->output = e->tok_embd;
    else if (upload_w(e, &e->output, &m->output, err)) goto fail;
    if (upload_vec(e, &e->output_norm, &m->output_norm, (size_t)c->dim, err)) goto fail;
    size_t q_dim = (size_t)c->n_heads * c->head_dim, kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    for (int l = 0; l < L; l++) {
        const model_layer *ml = &m->layers[l];
        cu_layer *cl = &e->layers[l];
        if (upload_w(e, &cl->wq, &ml->wq, err) || upload_w(e, &cl->wk, &ml->wk, err) ||
            upload_w(e, &cl->wv, &ml->wv, err) || upload_w(e, &cl->wo, &ml->wo, err) ||
            upload_w(e, &cl->w_gate, &ml->w_gate, err) || upload_w(e, &cl->w_up, &ml->w_up, err) ||
            upload_w(e, &cl->w_down, &ml->w_down, err) ||
            upload_vec(e, &cl->attn_norm, &ml->attn_norm, (size_t)c->dim, err) ||
            upload_vec(e, &cl->ffn_norm, &ml->ffn_norm, (size_t)c->dim, err) ||
            upload_vec(e, &cl->bq, &ml->bq, q_dim, err) || upload_vec(e, &cl->bk, &ml->bk, kv_dim, err) ||
            upload_vec(e, &cl->bv, &ml->bv, kv_dim, err))
            goto fail;
    }
    size_t T = (size_t)n_batch, wide = q_dim > (size_t)c->dim ? q_dim : (size_t)c->dim;
    float **bufs[] = {&e->x, &e->xb, &e->q, &e->k, &e->v, &e->att, &e->ao, &e->hb, &e->hb2, &e->fo, &e->out_rows, &e->logits};
    size_t sizes[] = {T * c->dim, T * wide, T * q_dim, T * kv_dim, T * kv_dim, T * q_dim, T * c->dim,
                      T * c->hidden_dim, T * c->hidden_dim, T * c->dim, T * c->dim, T * c->vocab_size};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (!(*bufs[i] = cu_alloc(e->dev, sizes[i] * sizeof(float)))) {
            util_err_set(err, KVLM_ENOMEM, "CUDA: out of device memory for activations");
            goto fail;
        }
    e->att_work = cu_alloc(e->dev, cu_attention_work_bytes(n_batch, c->n_heads, c->n_kv_heads, c->head_dim));
    /* tokens, pos, table_at, rows: 4 T; tables: at most T sequences' tables */
    size_t tables = (size_t)max_blocks * (n_seq_max < n_batch ? n_seq_max : n_batch);
    e->meta_cap = 4 * T + tables;
    e->meta = cu_alloc(e->dev, e->meta_cap * sizeof(int32_t));
    e->h_meta = malloc(e->meta_cap * sizeof(int32_t));
    e->seq_at = malloc((size_t)n_seq_max * sizeof(int));
    if (!e->att_work || !e->meta || !e->h_meta || !e->seq_at) {
        util_err_set(err, KVLM_ENOMEM, "CUDA: out of memory for the batch's buffers");
        goto fail;
    }
    for (int s = 0; s < n_seq_max; s++) e->seq_at[s] = -1;
    const char *g = getenv("KVLM_CUDA_GRAPHS");
    e->use_graphs = !(g && !strcmp(g, "0"));
    if (cu_sync(e->dev, err)) goto fail;
    return e;
fail:
    engine_cuda_free(e);
    return NULL;
}

void engine_cuda_free(engine_cuda *e) {
    if (!e) return;
    if (e->dev) {
        cu_weight_free(e->dev, &e->tok_embd);
        if (!e->output_shared) cu_weight_free(e->dev, &e->output);
        cu_free(e->dev, e->output_norm);
        for (int l = 0; e->layers && l < e->m->cfg.n_layers; l++) {
            cu_layer *cl = &e->layers[l];
            cu_weight *ws[] = {&cl->wq, &cl->wk, &cl->wv, &cl->wo, &cl->w_gate, &cl->w_up, &cl->w_down};
            for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) cu_weight_free(e->dev, ws[i]);
            float *vs[] = {cl->attn_norm, cl->ffn_norm, cl->bq, cl->bk, cl->bv};
            for (size_t i = 0; i < sizeof vs / sizeof vs[0]; i++) cu_free(e->dev, vs[i]);
        }
        float *bufs[] = {e->x, e->xb, e->q, e->k, e->v, e->att, e->ao, e->hb, e->hb2, e->fo, e->out_rows, e->logits};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cu_free(e->dev, bufs[i]);
        cu_free(e->dev, e->att_work);
        cu_free(e->dev, e->meta);
        for (int t = 0; t <= GRAPH_T; t++)
            for (int o = 0; o <= GRAPH_T; o++) cu_graph_free(e->graphs[t][o]);
        cu_close(e->dev);
    }
    free(e->layers);
    free(e->h_meta);
    free(e->seq_at);
    free(e);
}

const kv_storage *engine_cuda_storage(engine_cuda *e) { return &e->storage; }

void engine_cuda_describe(engine_cuda *e, char *buf, size_t cap) {
    char d[160];
    cu_describe(e->dev, d, sizeof d);
    snprintf(buf, cap, "cuda: %s; weights %.2f GiB on the device", d, (double)e->weight_bytes / (1u << 30));
}

/* The kernels of one pass over the chunk whose metadata is in e->meta: T
 * tokens, n_out rows of logits into e->logits; max_pos bounds the
 * positions (it sets attention's split count). */
static void run_pass(engine_cuda *e, kv_store *kv, int T, int n_out, int max_pos, int run) {
    const kvlm_config *c = &e->m->cfg;
    const kv_params *kp = kv_store_params_of(kv);
    cu_dev *d = e->dev;
    int32_t *m = e->meta;
    const int32_t *d_tok = m, *d_pos = m + T, *d_at = m + 2 * T, *d_rows = m + 3 * T, *d_tab = m + 4 * T;
    cu_kv ckv = {NULL, 0, 0, 0, kp->k_type, kp->v_type, kp->block_size, c->head_dim, c->n_kv_heads};
    kv_store_layout(kv, &ckv.base, &ckv.block_bytes, &ckv.head_bytes, &ckv.v_offset);
    cu_kv_batch b = {d_pos, d_at, d_tab, T, max_pos, run};
    int D = c->dim;
    float scale = 1.0f / sqrtf((float)c->head_dim);
    cu_embed(d, e->x, &e->tok_embd, d_tok, T);
    for (int l = 0; l < c->n_layers; l++) {
        const cu_layer *L = &e->layers[l];
        cu_rmsnorm(d, e->xb, e->x, l ? e->fo : NULL, L->attn_norm, NULL, T, D, c->norm_eps, &L->wq);
        float *qkv_y[3] = {e->q, e->k, e->v};
        const cu_weight *qkv_w[3] = {&L->wq, &L->wk, &L->wv};
        cu_matmul_n(d, qkv_y, e->xb, qkv_w, 3, T);
        cu_qkv_rope_store(d, e->q, e->k, e->v, L->bq, L->bk, L->bv, c->n_heads, c->rope_dim, c->rope_base,
                          c->rope_neox, &ckv, l, &b);
        cu_attention(d, e->att, e->q, &ckv, l, &b, c->n_heads, scale, e->att_work);
        cu_matmul(d, e->ao, e->att, &L->wo, T);
        cu_rmsnorm(d, e->xb, e->x, e->ao, L->ffn_norm, NULL, T, D, c->norm_eps, &L->w_gate);
        float *gu_y[2] = {e->hb, e->hb2};
        const cu_weight *gu_w[2] = {&L->w_gate, &L->w_up};
        cu_matmul_n(d, gu_y, e->xb, gu_w, 2, T);
        cu_swiglu(d, e->hb, e->hb2, T, c->hidden_dim, &L->w_down);
        cu_matmul(d, e->fo, e->hb, &L->w_down, T);
    }
    if (n_out) {
        cu_rmsnorm(d, e->out_rows, e->x, e->fo, e->output_norm, d_rows, n_out, D, c->norm_eps, &e->output);
        cu_matmul(d, e->logits, e->out_rows, &e->output, n_out);
    }
}

int engine_cuda_forward(engine_cuda *e, kv_store *kv, const int32_t *tokens, const int32_t *seq, const int32_t *pos,
                        int T, const int8_t *want, float *logits, kvlm_error *err) {
    const kvlm_config *c = &e->m->cfg;
    const kv_params *kp = kv_store_params_of(kv);
    if (T > e->n_batch) return util_err_set(err, KVLM_EINVAL, "CUDA: a chunk of %d tokens (at most %d)", T, e->n_batch);
    /* the chunk's metadata, one upload */
    int32_t *h = e->h_meta, *h_tok = h, *h_pos = h + T, *h_at = h + 2 * T, *h_rows = h + 3 * T, *h_tab = h + 4 * T;
    int n_tab = 0, n_out = 0, max_pos = 0;
    for (int t = 0; t < T; t++) {
        h_tok[t] = tokens[t];
        h_pos[t] = pos[t];
        if (pos[t] > max_pos) max_pos = pos[t];
        int s = seq[t];
        if (e->seq_at[s] < 0) {
            int nb;
            const int32_t *blocks = kv_store_seq_table(kv, s, &nb);
            if ((size_t)(4 * T + n_tab + nb) > e->meta_cap) {
                for (int u = 0; u < t; u++) e->seq_at[seq[u]] = -1;
                return util_err_set(err, KVLM_EINVAL, "CUDA: block tables beyond the batch buffer");
            }
            memcpy(h_tab + n_tab, blocks, (size_t)nb * sizeof(int32_t));
            e->seq_at[s] = n_tab;
            n_tab += nb;
        }
        h_at[t] = e->seq_at[s];
        if (want[t]) h_rows[n_out++] = t;
    }
    for (int t = 0; t < T; t++) e->seq_at[seq[t]] = -1;
    cu_dev *d = e->dev;
    cu_tier_join(d); /* blocks the tiers brought back are in before the kernels read them */
    cu_h2d_async(d, e->meta, h, (size_t)(4 * T + n_tab) * sizeof(int32_t));
    if (e->use_graphs && T <= GRAPH_T) {
        /* a recorded pass: attention's split count set for the longest
         * context, as the graph cannot change it per step (blocks past a
         * sequence's keys return at once) */
        cu_graph **g = &e->graphs[T][n_out];
        if (!*g) {
            if (cu_graph_begin(d)) return cu_sync(d, err);
            run_pass(e, kv, T, n_out, e->max_blocks * kp->block_size - 1, 1);
            *g = cu_graph_end(d);
            if (!*g) return cu_sync(d, err);
        }
        cu_graph_launch(d, *g);
    } else {
        /* the longest power-of-two run (up to 64) whose aligned groups of
         * tokens each belong to one sequence: attention reads their keys
         * once for the group (a graph, replayed for any batch, takes 1) */
        int run = 64;
        for (; run > 1; run >>= 1) {
            int t = 0;
            while (t < T && h_at[t] == h_at[t - t % run]) t++;
            if (t == T) break;
        }
        run_pass(e, kv, T, n_out, max_pos, run);
    }
    if (n_out && cu_d2h(d, logits, e->logits, (size_t)n_out * c->vocab_size * sizeof(float))) return cu_sync(d, err);
    return cu_sync(d, err);
}

int kvlm_cuda_device_count(void) { return cu_device_count(); }

#else /* built without CUDA */

int kvlm_cuda_device_count(void) { return 0; }

engine_cuda *engine_cuda_create(const struct kvlm_model *m, int n_batch, int max_blocks, int n_seq_max,
                                kvlm_error *err) {
    (void)m, (void)n_batch, (void)max_blocks, (void)n_seq_max;
    util_err_set(err, KVLM_EUNSUPPORTED, "--device cuda: this kvlm was built without CUDA "
                                         "(cmake -DKVLM_CUDA=ON with nvcc installed)");
    return NULL;
}
void engine_cuda_free(engine_cuda *e) { (void)e; }
const kv_storage *engine_cuda_storage(engine_cuda *e) { (void)e; return NULL; }
int engine_cuda_forward(engine_cuda *e, kv_store *kv, const int32_t *tokens, const int32_t *seq, const int32_t *pos,
                        int T, const int8_t *want, float *logits, kvlm_error *err) {
    (void)e, (void)kv, (void)tokens, (void)seq, (void)pos, (void)T, (void)want, (void)logits;
    return util_err_set(err, KVLM_EUNSUPPORTED, "built without CUDA");
}
void engine_cuda_describe(engine_cuda *e, char *buf, size_t cap) {
    (void)e;
    snprintf(buf, cap, "cuda: not built");
}
#endif
