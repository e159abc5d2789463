/* tests/test_kv_paged: the paged KV cache's bookkeeping: copy-on-write,
 * prefix reuse, pool exhaustion, and a randomized run of thousands of
 * operations checking every invariant and that each sequence reads back
 * exactly its own tokens' data. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "kv/paged.h"

static kv_cache *make(int n_blocks, int bs, int max_seqs, bool prefix) {
    kv_params p = {2, 2, 4, bs, n_blocks, max_seqs, 4096, 1234, prefix, KVLM_CACHE_F32, KVLM_CACHE_F32, NULL, {{0}}, false, NULL, 0};
    kvlm_error err = {0};
    kv_cache *c = kv_create(&p, &err);
    assert_non_null(c);
    return c;
}

/* Writes a token's "keys": every element of its slot = token id + layer/head tag. */
static void write_tokens(kv_cache *c, int seq, const int32_t *toks, int n) {
    const kv_params *p = kv_get_params(c);
    int len = kv_seq_len(c, seq), nb;
    const int32_t *blocks = kv_seq_blocks(c, seq, &nb);
    for (int i = 0; i < n; i++) {
        int pos = len + i;
        for (int l = 0; l < p->n_layers; l++)
            for (int h = 0; h < p->n_kv_heads; h++) {
                float *k = (float *)kv_block_k(c, blocks[pos / p->block_size], l, h) + (pos % p->block_size) * p->head_dim;
                float *v = (float *)kv_block_v(c, blocks[pos / p->block_size], l, h) + (pos % p->block_size) * p->head_dim;
                for (int d = 0; d < p->head_dim; d++) {
                    k[d] = (float)toks[i] + 0.25f * l + 0.0625f * h;
                    v[d] = -k[d];
                }
            }
    }
    kv_seq_commit(c, seq, toks, n);
}

static void check_contents(kv_cache *c, int max_seqs) {
    const kv_params *p = kv_get_params(c);
    for (int s = 0; s < max_seqs; s++) {
        int len = kv_seq_len(c, s), nb;
        const int32_t *blocks = kv_seq_blocks(c, s, &nb);
        const int32_t *toks = kv_seq_tokens(c, s);
        for (int pos = 0; pos < len; pos++)
            for (int l = 0; l < p->n_layers; l++)
                for (int h = 0; h < p->n_kv_heads; h++) {
                    float want = (float)toks[pos] + 0.25f * l + 0.0625f * h;
                    float *k = (float *)kv_block_k(c, blocks[pos / p->block_size], l, h) + (pos % p->block_size) * p->head_dim;
                    float *v = (float *)kv_block_v(c, blocks[pos / p->block_size], l, h) + (pos % p->block_size) * p->head_dim;
                    if (k[0] != want || v[p->head_dim - 1] != -want)
                        fail_msg("seq %d pos %d layer %d head %d: read %g, wrote %g", s, pos, l, h, k[0], want);
                }
    }
}

static void test_cow(void **state) {
    (void)state;
    kv_cache *c = make(16, 4, 4, true);
    kvlm_error err = {0};
    int32_t t[6] = {10, 11, 12, 13, 14, 15};
    assert_int_equal(kv_seq_reserve(c, 0, 6, &err), KVLM_OK);
    write_tokens(c, 0, t, 6); /* blocks: [10..13] full, [14,15] partial */
    assert_int_equal(kv_seq_fork(c, 0, 1, &err), KVLM_OK);
    kv_stats st;
    kv_get_stats(c, &st);
    assert_int_equal(st.used, 2);
    assert_int_equal(st.shared, 2);
    /* The child writes into the shared partial block: it gets a copy. */
    int32_t u = 99;
    assert_int_equal(kv_seq_reserve(c, 1, 1, &err), KVLM_OK);
    write_tokens(c, 1, &u, 1);
    kv_get_stats(c, &st);
    assert_int_equal(st.used, 3);
    assert_int_equal(st.shared, 1);
    /* The parent writes too: its block is no longer shared, no copy. */
    int32_t w = 77;
    assert_int_equal(kv_seq_reserve(c, 0, 1, &err), KVLM_OK);
    write_tokens(c, 0, &w, 1);
    kv_get_stats(c, &st);
    assert_int_equal(st.used, 3);
    check_contents(c, 4);
    assert_null(kv_check(c));
    kv_seq_release(c, 0);
    kv_seq_release(c, 1);
    kv_get_stats(c, &st);
    assert_int_equal(st.used, 0);
    assert_int_equal(st.free + st.cached, 16);
    assert_null(kv_check(c));
    kv_free(c);
}

static void test_prefix_reuse(void **state) {
    (void)state;
    kv_cache *c = make(32, 4, 4, true);
    kvlm_error err = {0};
    int32_t a[13];
    for (int i = 0; i < 13; i++) a[i] = 100 + i;
    assert_int_equal(kv_seq_reserve(c, 0, 13, &err), KVLM_OK);
    write_tokens(c, 0, a, 13);
    kv_seq_release(c, 0);
    kv_stats st;
    kv_get_stats(c, &st);
    assert_int_equal(st.cached, 3); /* three full blocks stay indexed */
    /* Same first 10 tokens: two blocks reused (the third differs). */
    int32_t b[13];
    memcpy(b, a, sizeof b);
    b[10] = 5;
    assert_int_equal(kv_seq_match_prefix(c, 1, b, 13), 8);
    kv_get_stats(c, &st);
    assert_int_equal(st.hits, 2);
    assert_int_equal(st.misses, 1);
    assert_int_equal(kv_seq_reserve(c, 1, 5, &err), KVLM_OK);
    write_tokens(c, 1, b + 8, 5);
    check_contents(c, 4);
    /* An identical prompt reuses all full blocks but the one holding the last token. */
    assert_int_equal(kv_seq_match_prefix(c, 2, a, 12), 8);
    assert_int_equal(kv_seq_match_prefix(c, 3, a, 13), 12);
    check_contents(c, 4);
    assert_null(kv_check(c));
    /* A different salt (another model or element type) never matches. */
    kv_free(c);
    kv_params p = {2, 2, 4, 4, 32, 4, 4096, 999, true, KVLM_CACHE_F32, KVLM_CACHE_F32, NULL, {{0}}, false, NULL, 0};
    c = kv_create(&p, &err);
    assert_int_equal(kv_seq_match_prefix(c, 0, a, 13), 0);
    kv_free(c);
}

static void test_full_pool(void **state) {
    (void)state;
    kv_cache *c = make(4, 4, 3, false);
    kvlm_error err = {0};
    int32_t t[16] = {0};
    assert_int_equal(kv_seq_reserve(c, 0, 12, &err), KVLM_OK);
    write_tokens(c, 0, t, 12);
    /* 2 more blocks for seq 1: only 1 is free. Nothing may change. */
    assert_int_equal(kv_seq_reserve(c, 1, 5, &err), KVLM_EFULL);
    assert_non_null(strstr(err.msg, "full"));
    kv_stats st;
    kv_get_stats(c, &st);
    assert_int_equal(st.used, 3);
    assert_int_equal(kv_seq_len(c, 1), 0);
    assert_null(kv_check(c));
    /* Past the context: ERANGE. */
    assert_int_equal(kv_seq_reserve(c, 1, 5000, &err), KVLM_ERANGE);
    /* A reservation rolled back with trim returns its blocks. */
    assert_int_equal(kv_seq_reserve(c, 1, 4, &err), KVLM_OK);
    kv_seq_trim(c, 1, 0);
    kv_get_stats(c, &st);
    assert_int_equal(st.used, 3);
    assert_null(kv_check(c));
    kv_free(c);
}

/* The index listener's view (KV events): keys added and removed, mirrored. */
typedef struct { kv_key keys[64]; int n; uint64_t added, removed; } index_mirror;

static void on_index(void *user, const kv_cache *c, int what, int32_t b) {
    index_mirror *m = user;
    const kv_key *k = kv_block_key_of(c, b);
    int at = -1;
    for (int i = 0; i < m->n; i++)
        if (!memcmp(m->keys[i].b, k->b, 16)) at = i;
    if (what == KV_INDEX_ADDED) {
        if (at >= 0 || m->n == 64) fail_msg("block %d added twice, or more than the pool", b);
        assert_true(kv_block_indexed(c, b));
        m->keys[m->n++] = *k;
        m->added++;
    } else {
        if (at < 0) fail_msg("block %d removed but never added", b);
        assert_true(kv_block_indexed(c, b)); /* still readable during the call */
        m->keys[at] = m->keys[--m->n];
        m->removed++;
    }
}

static void check_mirror(const kv_cache *c, const index_mirror *m) {
    int32_t blocks[64];
    int n = kv_indexed_blocks(c, blocks, 64);
    assert_int_equal(n, m->n);
    for (int i = 0; i < n; i++) {
        bool found = false;
        for (int j = 0; j < m->n && !found; j++) found = !memcmp(m->keys[j].b, kv_block_key_of(c, blocks[i])->b, 16);
        if (!found) fail_msg("indexed block %d is not in the listener's mirror", blocks[i]);
    }
}

static void test_randomized(void **state) {
    (void)state;
    int max_seqs = 8, iters = tu_quick() ? 3000 : 20000;
    kv_cache *c = make(40, 4, max_seqs, true);
    static index_mirror mirror;
    memset(&mirror, 0, sizeof mirror);
    kv_set_index_listener(c, on_index, &mirror);
    kvlm_error err = {0};
    uint64_t rng = 42;
    int ok_ops = 0, full = 0;
    for (int it = 0; it < iters; it++) {
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        unsigned r = (unsigned)(rng >> 33);
        int s = (int)(r % (unsigned)max_seqs), op = (int)((r >> 8) % 10);
        if (op < 5) { /* append 1..9 tokens from a small alphabet (so prefixes repeat) */
            int n = 1 + (int)((r >> 12) % 9);
            int32_t toks[9];
            for (int i = 0; i < n; i++) toks[i] = (int32_t)((r >> (i + 3)) % 3);
            int before = kv_seq_len(c, s);
            if (kv_seq_reserve(c, s, n, &err) == KVLM_OK) { write_tokens(c, s, toks, n); ok_ops++; }
            else { assert_true(err.code == KVLM_EFULL || err.code == KVLM_ERANGE); full++; }
            assert_true(kv_seq_len(c, s) == before || kv_seq_len(c, s) == before + n);
        } else if (op < 7) { /* fork */
            int d = (int)((r >> 16) % (unsigned)max_seqs);
            assert_int_equal(kv_seq_fork(c, s, d, &err), KVLM_OK);
        } else if (op < 9) { /* finish */
            kv_seq_release(c, s);
        } else { /* a new request reusing a prefix */
            kv_seq_release(c, s);
            int32_t toks[24];
            for (int i = 0; i < 24; i++) toks[i] = (int32_t)((r >> (i % 20)) % 2);
            int got = kv_seq_match_prefix(c, s, toks, 24);
            assert_true(got % 4 == 0 && got < 24);
            if (kv_seq_reserve(c, s, 24 - got, &err) == KVLM_OK) write_tokens(c, s, toks + got, 24 - got);
        }
        const char *bad = kv_check(c);
        if (bad) fail_msg("after op %d: %s", it, bad);
        if (it % 64 == 0) check_contents(c, max_seqs);
        if (it % 64 == 0) check_mirror(c, &mirror);
    }
    check_mirror(c, &mirror);
    assert_true(mirror.added > 0 && mirror.removed > 0);
    check_contents(c, max_seqs);
    for (int s = 0; s < max_seqs; s++) kv_seq_release(c, s);
    kv_stats st;
    kv_get_stats(c, &st);
    assert_int_equal(st.used, 0); /* every reference returned */
    assert_null(kv_check(c));
    printf("  %d appends, %d refused (pool full), %llu prefix hits, %llu evictions\n", ok_ops, full,
           (unsigned long long)st.hits, (unsigned long long)st.evictions);
    assert_true(st.hits > 0 && st.evictions > 0 && full > 0);
    kv_free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cow),
        cmocka_unit_test(test_prefix_reuse),
        cmocka_unit_test(test_full_pool),
        cmocka_unit_test(test_randomized),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
