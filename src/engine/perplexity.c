/* engine/perplexity: perplexity over a token stream, chunked exactly as
 * llama.cpp's perplexity tool does so that figures compare. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kvlm.h"
#include "util/error.h"

/* -log softmax(logits)[target], in double. */
static double nll_of(const float *logits, int n_vocab, int32_t target) {
    float maxl = logits[0];
    for (int i = 1; i < n_vocab; i++) if (logits[i] > maxl) maxl = logits[i];
    double sum = 0;
    for (int i = 0; i < n_vocab; i++) sum += exp((double)logits[i] - maxl);
    return -(((double)logits[target] - maxl) - log(sum));
}

int kvlm_perplexity(kvlm_ctx *ctx, const int32_t *tokens, int n_tokens, int n_chunks,
                    void (*on_chunk)(void *user, int chunk, double ppl), void *user, kvlm_ppl_result *out,
                    kvlm_error *err) {
    int n_ctx = kvlm_ctx_n_ctx(ctx);
    const kvlm_model *m = kvlm_ctx_model(ctx);
    int n_vocab = kvlm_model_config(m)->vocab_size;
    if (n_tokens < 2 * n_ctx)
        return util_err_set(err, KVLM_ERANGE, "the text has %d tokens; a context of %d needs at least %d", n_tokens,
                            n_ctx, 2 * n_ctx);
    int max_chunks = n_tokens / n_ctx;
    if (n_chunks <= 0 || n_chunks > max_chunks) n_chunks = max_chunks;
    int first = n_ctx / 2;
    int32_t *chunk = malloc((size_t)n_ctx * sizeof(int32_t));
    int8_t *want = calloc((size_t)n_ctx, 1);
    if (!chunk || !want) { free(chunk); free(want); return util_err_set(err, KVLM_ENOMEM, "out of memory"); }
    for (int j = first; j < n_ctx - 1; j++) want[j] = 1;
    int32_t bos = kvlm_token_bos(m);
    bool add_bos = kvlm_add_bos(m);
    double nll = 0, nll2 = 0;
    long count = 0;
    int rc = KVLM_OK;
    for (int c = 0; c < n_chunks; c++) {
        memcpy(chunk, tokens + (size_t)c * n_ctx, (size_t)n_ctx * sizeof(int32_t));
        if (add_bos) chunk[0] = bos;
        kvlm_ctx_reset(ctx);
        kvlm_batch b = {n_ctx, chunk, NULL, want, NULL};
        if ((rc = kvlm_decode(ctx, &b, err))) break;
        for (int j = first; j < n_ctx - 1; j++) {
            /* The target is the original next token (never the BOS swap). */
            double v = nll_of(kvlm_get_logits(ctx, j - first), n_vocab, tokens[(size_t)c * n_ctx + j + 1]);
            nll += v;
            nll2 += v * v;
            count++;
        }
        if (on_chunk) on_chunk(user, c, exp(nll / (double)count));
    }
    kvlm_ctx_reset(ctx);
    free(chunk);
    free(want);
    if (rc) return rc;
    double mean = nll / (double)count, var = nll2 / (double)count - mean * mean;
    out->ppl = exp(mean);
    out->ppl_stderr = var > 0 ? sqrt(var / (double)(count - 1)) * out->ppl : 0;
    out->n_chunks = n_chunks;
    out->n_scored = (int)count;
    return KVLM_OK;
}

int kvlm_perplexity_stream(kvlm_ctx *ctx, const int32_t *tokens, int n_tokens, int stride, double *stretch_ppl,
                           kvlm_ppl_result *out, kvlm_error *err) {
    if (n_tokens < 2 || stride < 1) return util_err_set(err, KVLM_EINVAL, "need at least 2 tokens and a stride >= 1");
    int n_vocab = kvlm_model_config(kvlm_ctx_model(ctx))->vocab_size, n_str = (n_tokens + stride - 1) / stride;
    double *nll = calloc((size_t)n_str, sizeof(double));
    int *cnt = calloc((size_t)n_str, sizeof(int));
    if (!nll || !cnt) { free(nll); free(cnt); return util_err_set(err, KVLM_ENOMEM, "out of memory"); }
    kvlm_ctx_reset(ctx);
    double sum = 0, sum2 = 0;
    int rc = KVLM_OK;
    for (int i = 0; i + 1 < n_tokens; i++) {
        kvlm_batch b = {1, tokens + i, NULL, NULL, NULL};
        if ((rc = kvlm_decode(ctx, &b, err))) break;
        double v = nll_of(kvlm_get_logits(ctx, -1), n_vocab, tokens[i + 1]);
        nll[(i + 1) / stride] += v;
        cnt[(i + 1) / stride]++;
        sum += v;
        sum2 += v * v;
    }
    kvlm_ctx_reset(ctx);
    if (!rc) {
        int n = n_tokens - 1;
        double mean = sum / n, var = sum2 / n - mean * mean;
        for (int k = 0; k < n_str; k++) stretch_ppl[k] = cnt[k] ? exp(nll[k] / cnt[k]) : NAN;
        out->ppl = exp(mean);
        out->ppl_stderr = var > 0 && n > 1 ? sqrt(var / (double)(n - 1)) * out->ppl : 0;
        out->n_chunks = n_str;
        out->n_scored = n;
    }
    free(nll);
    free(cnt);
    return rc;
}
