/* tests/test_kv_window: the block pool under a sliding window: releasing the
 * blocks before a window (the null block in their place), the windowed
 * prefix match (vLLM's rule), its probe, fork and restore with null entries,
 * kv_check's invariants throughout, and each live position reading back its
 * own data. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "kv/paged.h"

enum { BS = 4, W = 6 };

static kv_cache *make(int n_blocks, int max_seqs) {
    kv_params p = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 4, .block_size = BS, .n_blocks = n_blocks,
                   .max_seqs = max_seqs, .max_seq_tokens = 4096, .salt = 99, .prefix_cache = true,
                   .k_type = KVLM_CACHE_F32, .v_type = KVLM_CACHE_F32};
    kvlm_error err = {0};
    kv_cache *c = kv_create(&p, &err);
    assert_non_null(c);
    return c;
}

static float tag(int32_t tok, int l, int h) { return (float)tok + 0.25f * (float)l + 0.0625f * (float)h; }

/* Appends tokens one block-step at a time, releasing what falls before the window. */
static void append(kv_cache *c, int seq, const int32_t *toks, int n) {
    kvlm_error err = {0};
    const kv_params *p = kv_get_params(c);
    for (int i = 0; i < n; i++) {
        if (kv_seq_reserve(c, seq, 1, &err)) fail_msg("reserve: %s", err.msg);
        int pos = kv_seq_len(c, seq);
        const int32_t *blocks = kv_seq_blocks(c, seq, NULL);
        assert_int_not_equal(blocks[pos / BS], kv_null_block(c));
        for (int l = 0; l < p->n_layers; l++)
            for (int h = 0; h < p->n_kv_heads; h++)
                ((float *)kv_block_k(c, blocks[pos / BS], l, h))[(pos % BS) * p->head_dim] = tag(toks[i], l, h);
        kv_seq_commit(c, seq, toks + i, 1);
        int first = kv_seq_len(c, seq) - W + 1;
        if (first >= BS) kv_seq_drop_front(c, seq, first / BS);
    }
}

/* Every position a next query's window needs reads back its token's data;
 * the blocks before it are the null block. */
static void check_live(kv_cache *c, int seq) {
    const kv_params *p = kv_get_params(c);
    int len = kv_seq_len(c, seq), nb;
    const int32_t *blocks = kv_seq_blocks(c, seq, &nb), *toks = kv_seq_tokens(c, seq);
    int first = len - W + 1 > 0 ? len - W + 1 : 0;
    for (int b = 0; b < nb; b++)
        if ((blocks[b] == kv_null_block(c)) != (b < kv_seq_dropped(c, seq)))
            fail_msg("seq %d block %d: null %d, dropped %d", seq, b, blocks[b] == kv_null_block(c), kv_seq_dropped(c, seq));
    assert_true(kv_seq_dropped(c, seq) <= first / BS);
    for (int pos = first; pos < len; pos++)
        for (int l = 0; l < p->n_layers; l++)
            for (int h = 0; h < p->n_kv_heads; h++) {
                float got = ((float *)kv_block_k(c, blocks[pos / BS], l, h))[(pos % BS) * p->head_dim];
                if (got != tag(toks[pos], l, h)) fail_msg("seq %d pos %d: %g, wrote %g", seq, pos, got, tag(toks[pos], l, h));
            }
    const char *bad = kv_check(c);
    if (bad) fail_msg("kv_check: %s", bad);
}

static void test_window(void **state) {
    (void)state;
    kv_cache *c = make(10, 3);
    int32_t t[41];
    for (int i = 0; i < 41; i++) t[i] = 100 + i;
    /* 41 tokens in a pool of 10 blocks: only the window's blocks stay held */
    append(c, 0, t, 41);
    check_live(c, 0);
    kv_stats st;
    kv_get_stats(c, &st);
    int nb;
    kv_seq_blocks(c, 0, &nb);
    printf("  41 tokens: %d blocks in the table, %d released, %d held, %d cached, %d free\n", nb, kv_seq_dropped(c, 0),
           st.used, st.cached, st.free);
    assert_int_equal(nb, 11);
    assert_int_equal(st.used, nb - kv_seq_dropped(c, 0));
    assert_true(st.used <= (W + BS - 2) / BS + 1);
    assert_true(st.cached > 0);
    /* fork: the null entries are shared as well; the child grows on its own */
    kvlm_error err = {0};
    assert_int_equal(kv_seq_fork(c, 0, 1, &err), KVLM_OK);
    check_live(c, 1);
    int32_t u[9] = {7, 8, 9, 10, 11, 12, 13, 14, 15};
    append(c, 1, u, 9);
    check_live(c, 0);
    check_live(c, 1);
    kv_seq_release(c, 1);
    kv_seq_release(c, 0);
    kv_get_stats(c, &st);
    assert_int_equal(st.used, 0);
    assert_null(kv_check(c));
    /* the windowed match: the prefix's early blocks were evicted (10 blocks
     * for 11), its last window's are cached: a hit of 40 tokens (10 blocks),
     * the first ones the null block; the probe says the same */
    int live = -1, probe = kv_prefix_probe_window(c, t, 41, W, 100, &live);
    int hit = kv_seq_match_prefix_window(c, 2, t, 41, W, 100);
    printf("  windowed match: %d tokens, %d blocks live (probe %d blocks, %d live); the chained match finds %d\n", hit,
           kv_seq_blocks(c, 2, NULL) ? 10 - kv_seq_dropped(c, 2) : 0, probe, live, kv_prefix_probe(c, t, 41, NULL, NULL));
    assert_int_equal(hit, 40);
    assert_int_equal(probe, 10);
    assert_int_equal(live, 10 - kv_seq_dropped(c, 2));
    assert_true(kv_prefix_probe(c, t, 41, NULL, NULL) < 10);
    check_live(c, 2);
    append(c, 2, t + 40, 1);
    check_live(c, 2);
    /* capped: at most 3 blocks, whose window (block 2 and before) is there? */
    kv_seq_release(c, 2);
    int capped = kv_seq_match_prefix_window(c, 0, t, 41, W, 3);
    assert_true(capped <= 3 * BS);
    kv_seq_release(c, 0);
    /* restore with the first blocks dropped: the null block there */
    kv_key keys[10] = {{{0}}};
    int32_t got[10];
    assert_int_equal(kv_seq_restore_from(c, 1, t, keys, 40, false, 8, got, &err), KVLM_OK);
    assert_int_equal(kv_seq_dropped(c, 1), 8);
    kv_get_stats(c, &st);
    assert_int_equal(st.used, 2);
    assert_null(kv_check(c));
    kv_seq_release(c, 1);
    assert_null(kv_check(c));
    kv_free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
