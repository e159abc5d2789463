/* kv/cache: the per-layer KV cache of one sequence behind a small interface
 * (append K/V at positions, view K/V for attention, reset), so the paged
 * store can replace the storage without touching the forward pass. */
#ifndef KVLM_KV_CACHE_H
#define KVLM_KV_CACHE_H
#include <stddef.h>
#include "kvlm.h"

typedef struct kv_cache kv_cache;

typedef struct {
    int n_layers, n_kv_heads, head_dim;
    int n_ctx;          /* capacity in tokens */
} kv_cache_params;

kv_cache *kv_cache_create(const kv_cache_params *p, kvlm_error *err);
void kv_cache_free(kv_cache *c);

/* Stores keys and values of n tokens at positions pos..pos+n-1 for one
 * layer; k and v are [n][n_kv_heads * head_dim]. The caller has checked
 * pos + n <= capacity (kv_cache_reserve). */
void kv_cache_write(kv_cache *c, int layer, int pos, int n, const float *k, const float *v);
/* Checks that positions up to n_tokens fit; KVLM_EFULL with err if not. */
int kv_cache_reserve(kv_cache *c, int n_tokens, kvlm_error *err);
/* A view of one layer for attention: key of KV head h at position p is
 * k[h * head_stride + p * head_dim] (likewise v). */
typedef struct {
    const float *k, *v;
    size_t head_stride;
} kv_view;
kv_view kv_cache_view(const kv_cache *c, int layer);

/* Tokens held (positions 0..len-1 are valid). */
int kv_cache_len(const kv_cache *c);
void kv_cache_set_len(kv_cache *c, int len);
/* Forgets every token. Stale data is never readable: reads stop at len. */
void kv_cache_reset(kv_cache *c);
int kv_cache_capacity(const kv_cache *c);
/* Bytes per token across all layers: 2 x layers x KV heads x head dim x elem. */
size_t kv_cache_bytes_per_token(const kv_cache *c);
#endif
