/* kv/cache: a contiguous f32 KV cache for one sequence, laid out
 * [layer][kv head][position][head dim] so attention streams each head's
 * keys and values sequentially. */
#include "kv/cache.h"
#include <stdlib.h>
#include <string.h>
#include "util/error.h"

struct kv_cache {
    kv_cache_params p;
    float *k, *v;
    int len;
};

kv_cache *kv_cache_create(const kv_cache_params *p, kvlm_error *err) {
    if (p->n_layers <= 0 || p->n_kv_heads <= 0 || p->head_dim <= 0 || p->n_ctx <= 0) {
        util_err_set(err, KVLM_EINVAL, "bad KV cache shape");
        return NULL;
    }
    kv_cache *c = calloc(1, sizeof *c);
    size_t n = (size_t)p->n_layers * p->n_kv_heads * p->n_ctx * p->head_dim;
    if (c) {
        c->p = *p;
        c->k = malloc(n * sizeof(float));
        c->v = malloc(n * sizeof(float));
    }
    if (!c || !c->k || !c->v) {
        kv_cache_free(c);
        util_err_set(err, KVLM_ENOMEM, "cannot allocate a KV cache of %zu bytes", 2 * n * sizeof(float));
        return NULL;
    }
    return c;
}

void kv_cache_free(kv_cache *c) {
    if (!c) return;
    free(c->k);
    free(c->v);
    free(c);
}

int kv_cache_reserve(kv_cache *c, int n_tokens, kvlm_error *err) {
    if (n_tokens > c->p.n_ctx)
        return util_err_set(err, KVLM_EFULL, "the sequence needs %d tokens but the context holds %d", n_tokens,
                            c->p.n_ctx);
    return KVLM_OK;
}

void kv_cache_write(kv_cache *c, int layer, int pos, int n, const float *k, const float *v) {
    const kv_cache_params *p = &c->p;
    size_t hd = (size_t)p->head_dim, head_stride = (size_t)p->n_ctx * hd;
    size_t layer_off = (size_t)layer * p->n_kv_heads * head_stride;
    for (int t = 0; t < n; t++)
        for (int h = 0; h < p->n_kv_heads; h++) {
            size_t dst = layer_off + h * head_stride + (size_t)(pos + t) * hd;
            size_t src = ((size_t)t * p->n_kv_heads + h) * hd;
            memcpy(c->k + dst, k + src, hd * sizeof(float));
            memcpy(c->v + dst, v + src, hd * sizeof(float));
        }
    if (pos + n > c->len) c->len = pos + n;
}

kv_view kv_cache_view(const kv_cache *c, int layer) {
    size_t head_stride = (size_t)c->p.n_ctx * c->p.head_dim;
    size_t off = (size_t)layer * c->p.n_kv_heads * head_stride;
    kv_view v = {c->k + off, c->v + off, head_stride};
    return v;
}

int kv_cache_len(const kv_cache *c) { return c->len; }
void kv_cache_set_len(kv_cache *c, int len) { c->len = len; }
void kv_cache_reset(kv_cache *c) { c->len = 0; }
int kv_cache_capacity(const kv_cache *c) { return c->p.n_ctx; }
size_t kv_cache_bytes_per_token(const kv_cache *c) {
    return 2 * (size_t)c->p.n_layers * c->p.n_kv_heads * c->p.head_dim * sizeof(float);
}
