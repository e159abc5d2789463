/* fuzz/fuzz_kvstore: a small KV store (2 layers, 2 KV heads of 4, blocks of
 * 4 tokens, f32) for the stored-block and session harnesses, and a sequence
 * written into it with known rows, to save as seeds. */
#ifndef KVLM_FUZZ_KVSTORE_H
#define KVLM_FUZZ_KVSTORE_H
#include "kv/session.h"
#include "kv/store.h"

enum { FZ_NL = 2, FZ_NH = 2, FZ_HD = 4, FZ_BS = 4 };

static inline kv_store *fuzz_store(void) {
    kv_store_params sp = {0};
    kv_params p = {FZ_NL, FZ_NH, FZ_HD, FZ_BS, 16, 1, 64, 1234, true, KVLM_CACHE_F32, KVLM_CACHE_F32, NULL, {{0}}, false, NULL, 0};
    sp.pool = p;
    kvlm_error err = {0};
    kv_store *s = kv_store_create(&sp, &err);
    if (!s) { fprintf(stderr, "fuzz: store: %s\n", err.msg); abort(); }
    return s;
}

/* Tokens 0..n-1 of sequence 0: t, rows from t, layer and head. */
static inline void fuzz_store_fill(kv_store *s, const int32_t *toks, int n) {
    kvlm_error err = {0};
    if (kv_store_reserve(s, 0, n, &err)) abort();
    float k[FZ_HD], v[FZ_HD];
    for (int i = 0; i < n; i++)
        for (int l = 0; l < FZ_NL; l++)
            for (int h = 0; h < FZ_NH; h++) {
                for (int d = 0; d < FZ_HD; d++) {
                    k[d] = (float)toks[i] + 0.25f * l + 0.0625f * h + d;
                    v[d] = -k[d];
                }
                kv_store_write_row(s, l, 0, i, h, k, v);
            }
    kv_store_commit(s, 0, toks, n);
}
#endif
