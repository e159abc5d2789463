/* engine/embed: embeddings: pooling names, the model's pooling, an input's
 * tokens, pooling hidden states as they arrive and L2-normalising them, and
 * kvlm_embed (one input through one sequence). */
#include "engine/embed.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "engine/engine.h"
#include "util/error.h"

static const char *const k_pooling_names[] = {"none", "mean", "cls", "last", "rank"};

int kvlm_pooling_from_name(const char *name) {
    for (int i = 0; name && i < 5; i++)
        if (!strcmp(name, k_pooling_names[i])) return i;
    return -1;
}

const char *kvlm_pooling_name(int pooling) { return pooling >= 0 && pooling < 5 ? k_pooling_names[pooling] : NULL; }

int kvlm_model_pooling(const kvlm_model *model) {
    const kvlm_config *c = kvlm_model_config(model);
    if (c->pooling >= 0) return c->pooling;
    return c->encoder ? KVLM_POOLING_CLS : KVLM_POOLING_LAST;
}

bool kvlm_model_is_encoder(const kvlm_model *model) { return kvlm_model_config(model)->encoder; }

kvlm_embed_params kvlm_embed_default_params(void) {
    kvlm_embed_params p = {0};
    p.pooling = KVLM_POOLING_UNSPECIFIED;
    return p;
}

int embed_resolve(const kvlm_model *model, const kvlm_embed_params *p, int *dims, kvlm_error *err) {
    kvlm_embed_params d = kvlm_embed_default_params();
    if (!p) p = &d;
    int pooling = p->pooling == KVLM_POOLING_UNSPECIFIED ? kvlm_model_pooling(model) : p->pooling;
    int width = kvlm_model_config(model)->dim;
    if (pooling == KVLM_POOLING_RANK)
        return util_err_set(err, KVLM_EUNSUPPORTED, "pooling rank (a reranker's classification head) is not "
                            "supported; pool by none, mean, cls or last"), -1;
    if (!kvlm_pooling_name(pooling))
        return util_err_set(err, KVLM_EINVAL, "unknown pooling %d (none, mean, cls, last)", pooling), -1;
    if (p->dims < 0 || p->dims > width)
        return util_err_set(err, KVLM_EINVAL, "dimensions %d: the model's vectors have %d (ask for 1 to %d)", p->dims,
                            width, width), -1;
    if (dims) *dims = p->dims ? p->dims : width;
    return pooling;
}

int kvlm_embed_dims(const kvlm_model *model, const kvlm_embed_params *p, kvlm_error *err) {
    int dims;
    return embed_resolve(model, p, &dims, err) < 0 ? -1 : dims;
}

int kvlm_embed_tokenize(const kvlm_model *model, const char *text, size_t len, int32_t *tokens, int max,
                        kvlm_error *err) {
    /* llama-server's: special tokens parsed, BOS and EOS as the vocabulary adds them */
    int n = kvlm_tokenize(model, text, len, kvlm_add_bos(model), true, tokens, max, err);
    if (n < 0 || !kvlm_add_eos(model)) return n;
    if (tokens && n < max) tokens[n] = kvlm_token_eos(model);
    return n + 1;
}

int embed_pool_init(embed_pool *a, int pooling, int dim, int n_tokens) {
    memset(a, 0, sizeof *a);
    a->pooling = pooling;
    a->dim = dim;
    a->n_tokens = n_tokens;
    if (pooling == KVLM_POOLING_NONE) a->rows = malloc((size_t)n_tokens * dim * sizeof(float));
    else a->acc = calloc((size_t)dim, sizeof(double));
    return a->rows || a->acc ? KVLM_OK : KVLM_ENOMEM;
}

void embed_pool_free(embed_pool *a) {
    free(a->acc);
    free(a->rows);
    a->acc = NULL;
    a->rows = NULL;
}

void embed_pool_reset(embed_pool *a) {
    a->n_rows = 0;
    if (a->acc) memset(a->acc, 0, (size_t)a->dim * sizeof(double));
}

bool embed_pool_wants(const embed_pool *a, int pos) {
    switch (a->pooling) {
    case KVLM_POOLING_CLS: return pos == 0;
    case KVLM_POOLING_LAST: return pos == a->n_tokens - 1;
    default: return true;
    }
}

void embed_pool_add(embed_pool *a, int pos, const float *row) {
    if (pos < 0 || pos >= a->n_tokens) return;
    if (a->pooling == KVLM_POOLING_NONE) memcpy(a->rows + (size_t)pos * a->dim, row, (size_t)a->dim * sizeof(float));
    else if (a->pooling == KVLM_POOLING_MEAN)
        for (int i = 0; i < a->dim; i++) a->acc[i] += row[i];
    else
        for (int i = 0; i < a->dim; i++) a->acc[i] = row[i];
    a->n_rows++;
}

bool embed_pool_done(const embed_pool *a) {
    return a->pooling == KVLM_POOLING_NONE || a->pooling == KVLM_POOLING_MEAN ? a->n_rows >= a->n_tokens
                                                                              : a->n_rows >= 1;
}

/* out[0, dims) = v's first dims values, over their L2 norm unless raw (a zero vector stays zero) */
static void finish_row(const double *v, int dims, bool raw, float *out) {
    double ss = 0;
    for (int i = 0; i < dims; i++) ss += v[i] * v[i];
    double k = raw || ss <= 0 ? 1.0 : 1.0 / sqrt(ss);
    for (int i = 0; i < dims; i++) out[i] = (float)(v[i] * k);
}

size_t embed_pool_finish(const embed_pool *a, int dims, bool no_normalize, float *out, size_t cap) {
    size_t n_out = a->pooling == KVLM_POOLING_NONE ? (size_t)a->n_tokens * dims : (size_t)dims;
    double *v = malloc((size_t)a->dim * sizeof(double));
    if (!v) return 0;
    if (a->pooling == KVLM_POOLING_NONE) {
        for (int t = 0; t < a->n_tokens && (size_t)(t + 1) * dims <= cap; t++) {
            for (int i = 0; i < dims; i++) v[i] = a->rows[(size_t)t * a->dim + i];
            finish_row(v, dims, no_normalize, out + (size_t)t * dims);
        }
    } else if ((size_t)dims <= cap) {
        double k = a->pooling == KVLM_POOLING_MEAN && a->n_rows > 0 ? 1.0 / a->n_rows : 1.0;
        for (int i = 0; i < dims; i++) v[i] = a->acc[i] * k;
        finish_row(v, dims, no_normalize, out);
    }
    free(v);
    return n_out;
}

int kvlm_embed(kvlm_ctx *ctx, int seq, const int32_t *tokens, int n, const kvlm_embed_params *p, float *out,
               size_t cap, kvlm_error *err) {
    const kvlm_model *m = kvlm_ctx_model(ctx);
    kvlm_embed_params d = kvlm_embed_default_params();
    if (!p) p = &d;
    int dims, pooling = embed_resolve(m, p, &dims, err);
    if (pooling < 0) return -1;
    if (!tokens || n <= 0) return util_err_set(err, KVLM_EINVAL, "an empty input has no embedding"), -1;
    int most = kvlm_ctx_kv_budget(ctx); /* under eviction the states would not be the input's */
    if (n > most)
        return util_err_set(err, KVLM_ERANGE, "the input is %d tokens, longer than the %s of %d", n,
                            most < kvlm_ctx_n_ctx(ctx) ? "KV budget" : "context", most), -1;
    if (kvlm_seq_n_past(ctx, seq) != 0)
        return util_err_set(err, KVLM_EINVAL, "sequence %d is not empty", seq), -1;
    int chunk = kvlm_model_is_encoder(m) ? n : engine_ctx_n_batch(ctx);
    embed_pool a;
    int8_t *flags = calloc((size_t)chunk, 1); /* no logits: the states asked for */
    int32_t *seqv = malloc((size_t)chunk * sizeof(int32_t));
    if (embed_pool_init(&a, pooling, kvlm_model_config(m)->dim, n) || !flags || !seqv) {
        embed_pool_free(&a);
        free(flags);
        free(seqv);
        return util_err_set(err, KVLM_ENOMEM, "out of memory"), -1;
    }
    int rc = KVLM_OK;
    for (int i0 = 0; i0 < n && !rc; i0 += chunk) {
        int T = n - i0 < chunk ? n - i0 : chunk;
        for (int t = 0; t < T; t++) {
            flags[t] = embed_pool_wants(&a, i0 + t) ? KVLM_OUTPUT_EMBD : 0;
            seqv[t] = seq;
        }
        kvlm_batch b = {.n_tokens = T, .tokens = tokens + i0, .logits = flags, .seq = seqv};
        if ((rc = kvlm_decode(ctx, &b, err))) break;
        for (int t = 0, k = 0; t < T; t++)
            if (flags[t]) embed_pool_add(&a, i0 + t, kvlm_get_embeddings(ctx, k++));
    }
    kvlm_seq_free(ctx, seq);
    size_t got = rc ? 0 : embed_pool_finish(&a, dims, p->no_normalize, out, cap);
    embed_pool_free(&a);
    free(flags);
    free(seqv);
    if (rc) return -1;
    if (got > (size_t)INT32_MAX) return util_err_set(err, KVLM_ERANGE, "the vectors hold %zu floats", got), -1;
    return (int)got;
}
