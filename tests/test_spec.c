/* tests/test_spec: speculative decoding: rollback of the paged cache
 * (kvlm_seq_spec_begin / kvlm_seq_trim) against a context fed only the kept
 * tokens, greedy output equal to plain decoding (prompt lookup and a draft
 * model; cache types; eviction policies, h2o scores), and the sampled
 * distribution against the target's exact one. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "engine/engine.h"
#include "engine/spec.h"
#include "helpers/testutil.h"
#include "kvlm.h"

static kvlm_model *load(const char *path) {
    kvlm_error err = {0};
    kvlm_model_params mp = {0};
    kvlm_model *m = kvlm_model_load(path, &mp, &err);
    if (!m) fail_msg("load %s: %s", path, err.msg);
    return m;
}

static const char *synth(int dim, int layers, int heads, int kv, int vocab, const char *type, uint64_t seed) {
    kvlm_synth_params sp = {0};
    sp.arch = KVLM_ARCH_LLAMA;
    sp.dim = dim;
    sp.hidden_dim = 2 * dim + 16;
    sp.n_layers = layers;
    sp.n_heads = heads;
    sp.n_kv_heads = kv;
    sp.vocab_size = vocab;
    sp.n_ctx = 512;
    sp.type = kvlm_type_from_name(type);
    sp.seed = seed;
    const char *path = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, path, &err)) fail_msg("synth: %s", err.msg);
    return path;
}

static kvlm_ctx *mkctx(const kvlm_model *m, const kvlm_ctx_params *base) {
    kvlm_ctx_params p = base ? *base : kvlm_ctx_default_params();
    if (!p.n_threads) p.n_threads = 2;
    kvlm_error err = {0};
    kvlm_ctx *c = kvlm_ctx_create(m, &p, &err);
    if (!c) fail_msg("ctx: %s", err.msg);
    return c;
}

static void decode(kvlm_ctx *c, int seq, const int32_t *t, int n, bool all_logits) {
    int32_t *s = malloc((size_t)n * sizeof *s);
    int8_t *w = malloc((size_t)n);
    for (int i = 0; i < n; i++) { s[i] = seq; w[i] = all_logits || i == n - 1; }
    kvlm_batch b = {n, t, NULL, w, s};
    kvlm_error err = {0};
    int rc = kvlm_decode(c, &b, &err);
    free(s);
    free(w);
    if (rc) fail_msg("decode seq %d (%d tokens): %s", seq, n, err.msg);
}

static int cmp_key(const void *a, const void *b) { return memcmp(a, b, 16); }

/* The prefix index's keys, sorted. */
static int index_keys(kvlm_ctx *c, uint8_t (*keys)[16], int cap) {
    int n = kvlm_kv_cached_blocks(c, keys, cap);
    assert_true(n >= 0 && n <= cap);
    qsort(keys, (size_t)n, 16, cmp_key);
    return n;
}

/* The speculating context's prefix index equals the reference's (subset:
 * is contained in it). */
static void expect_index(kvlm_ctx *a, kvlm_ctx *r, bool subset, int step) {
    static uint8_t ka[4096][16], kr[4096][16];
    int na = index_keys(a, ka, 4096), nr = index_keys(r, kr, 4096);
    if (!subset) {
        if (na != nr || memcmp(ka, kr, (size_t)na * 16)) fail_msg("step %d: prefix index differs (%d, reference %d blocks)", step, na, nr);
        return;
    }
    for (int i = 0; i < na; i++)
        if (!bsearch(ka[i], kr, (size_t)nr, 16, cmp_key)) fail_msg("step %d: block %d of the index is not the reference's", step, i);
}

/* ---- rollback: a random walk of speculative steps against a context fed
 * only what was kept. Both must hold the same blocks (used, cached, free),
 * the same prefix index, and give the same logits. host (NULL: none): the
 * speculating context is a draft context in host's pool, with another cache
 * shape (the pool's guest layout), beside a sequence of host's; the
 * reference has a pool of its own with the guest's block size. ---- */
static void rollback_walk(const kvlm_model *m, int k_type, int v_type, int steps, uint64_t seed, bool small_pool,
                          const kvlm_model *host) {
    kvlm_ctx_params p = kvlm_ctx_default_params();
    p.n_ctx = 160;
    p.n_seq_max = 3;
    p.block_size = 4;
    /* a large pool never runs out of free blocks, so both contexts must hold
     * exactly the same; in a small one the speculating context's unverified
     * tokens may take cached blocks the reference keeps: its index is then a
     * subset of the reference's */
    p.kv_blocks = small_pool ? 130 : 4000;
    p.cache_type_k = k_type;
    p.cache_type_v = v_type;
    kvlm_ctx *hc = NULL, *a, *r;
    int lo = 0, host_used = 0; /* a's first sequence id; the blocks host's sequence holds */
    kvlm_kv_stats ks;
    if (host) {
        kvlm_ctx_params hp = p;
        hp.n_seq_max = 1;
        hp.n_seq_draft = 3;
        hc = mkctx(host, &hp);
        int32_t ht[21];
        for (int i = 0; i < 21; i++) ht[i] = 3 + i;
        decode(hc, 0, ht, 21, false);
        kvlm_error e = {0};
        if (!(a = kvlm_ctx_create_draft(m, hc, &p, &e))) fail_msg("draft context: %s", e.msg);
        lo = kvlm_ctx_seq_first(a);
        kvlm_kv_stats_get(a, &ks);
        assert_true(ks.block_size > p.block_size); /* more of the smaller model's tokens in a block */
        p.block_size = ks.block_size;
        kvlm_kv_stats_get(hc, &ks);
        host_used = ks.used;
    } else a = mkctx(m, &p);
    r = mkctx(m, &p);
    int V = kvlm_vocab_size(m);
    uint64_t s = seed;
#define RND(n) (s ^= s << 13, s ^= s >> 7, s ^= s << 17, (int)(s % (uint64_t)(n)))
    int32_t prompt[12];
    for (int i = 0; i < 12; i++) prompt[i] = 3 + RND(V - 3);
    decode(a, lo, prompt, 12, false);
    decode(r, 0, prompt, 12, false);
    kvlm_error err = {0};
    for (int step = 0; step < steps; step++) {
        int op = RND(10), seq = RND(3);
        if (op == 0) { /* fork: shared blocks, copy-on-write when a rollback leaves a shared partial block */
            int src = RND(3);
            if (kvlm_seq_n_past(a, lo + src) == 0 || src == seq) continue;
            assert_int_equal(kvlm_seq_fork(a, lo + src, lo + seq, &err), KVLM_OK);
            assert_int_equal(kvlm_seq_fork(r, src, seq, &err), KVLM_OK);
        } else if (op == 1) {
            kvlm_seq_free(a, lo + seq);
            kvlm_seq_free(r, seq);
        } else {
            int len = kvlm_seq_n_past(a, lo + seq), n = 1 + RND(9);
            if (len + n > p.n_ctx) { kvlm_seq_free(a, lo + seq); kvlm_seq_free(r, seq); continue; }
            int32_t t[10];
            for (int i = 0; i < n; i++) t[i] = 3 + RND(V - 3);
            if (len == 0) { decode(a, lo + seq, t, 1, false); decode(r, seq, t, 1, false); continue; }
            assert_int_equal(kvlm_seq_spec_begin(a, lo + seq, &err), KVLM_OK);
            decode(a, lo + seq, t, n, true);
            /* no block holding unverified tokens entered the index */
            if (!host) expect_index(a, r, small_pool, step);
            int keep = RND(n + 1);
            const float *la = keep ? kvlm_get_logits(a, keep - 1) : NULL;
            float *row = NULL;
            if (la) { row = malloc((size_t)V * sizeof *row); memcpy(row, la, (size_t)V * sizeof *row); }
            assert_int_equal(kvlm_seq_trim(a, lo + seq, len + keep, &err), KVLM_OK);
            assert_int_equal(kvlm_seq_n_past(a, lo + seq), len + keep);
            if (keep) {
                decode(r, seq, t, keep, false);
                /* the kept tokens' logits equal the reference's (same cache before them) */
                assert_true(tu_max_rel_diff(row, kvlm_get_logits(r, -1), V, 1e-2) < 1e-3);
            }
            free(row);
        }
        const char *bad = engine_kv_check(hc ? hc : a);
        if (bad) fail_msg("step %d: kv_check: %s", step, bad);
        kvlm_kv_stats sa, sr;
        kvlm_kv_stats_get(a, &sa);
        kvlm_kv_stats_get(r, &sr);
        sa.used -= host_used; /* host's sequence holds its blocks throughout */
        sa.free += host_used;
        if (sa.used != sr.used || sa.shared != sr.shared ||
            (!small_pool && (sa.cached != sr.cached || sa.free != sr.free)))
            fail_msg("step %d: blocks used/cached/free/shared %d/%d/%d/%d, reference %d/%d/%d/%d", step, sa.used,
                     sa.cached, sa.free, sa.shared, sr.used, sr.cached, sr.free, sr.shared);
        if (!host) expect_index(a, r, small_pool, step); /* a guest's keys are its own model's */
        for (int q = 0; q < 3; q++) assert_int_equal(kvlm_seq_n_past(a, lo + q), kvlm_seq_n_past(r, q));
    }
    /* the caches hold the same keys and values: one more token gives the same logits */
    for (int q = 0; q < 3; q++) {
        if (!kvlm_seq_n_past(a, lo + q)) continue;
        int32_t t = 5;
        decode(a, lo + q, &t, 1, false);
        decode(r, q, &t, 1, false);
        assert_true(tu_max_rel_diff(kvlm_get_logits(a, -1), kvlm_get_logits(r, -1), V, 1e-2) < 1e-3);
    }
#undef RND
    kvlm_ctx_free(a);
    kvlm_ctx_free(r);
    if (hc) { /* the guest's blocks went back with its context; host's sequence is intact */
        const char *bad = engine_kv_check(hc);
        if (bad) fail_msg("after the draft context: kv_check: %s", bad);
        kvlm_kv_stats_get(hc, &ks);
        assert_int_equal(ks.used, host_used);
        kvlm_ctx_free(hc);
    }
}

static void test_rollback_random(void **state) {
    (void)state;
    kvlm_model *m = load(synth(64, 2, 4, 2, 64, "f32", 7));
    int steps = tu_quick() ? 100 : 300;
    rollback_walk(m, KVLM_CACHE_F16, KVLM_CACHE_F16, steps, 11, false, NULL);
    rollback_walk(m, KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0, steps, 12, false, NULL);
    rollback_walk(m, KVLM_CACHE_F32, KVLM_CACHE_Q4_0, steps / 2, 13, false, NULL);
    rollback_walk(m, KVLM_CACHE_F16, KVLM_CACHE_F16, steps, 14, true, NULL);
    /* m as a draft of another cache shape in a larger model's pool (4 layers
     * x 4 KV heads against m's 2 x 2: 4 of its blocks' tokens in one) */
    kvlm_model *h = load(synth(64, 4, 4, 4, 64, "f32", 8));
    rollback_walk(m, KVLM_CACHE_F16, KVLM_CACHE_F16, steps, 15, false, h);
    rollback_walk(m, KVLM_CACHE_Q8_0, KVLM_CACHE_Q4_0, steps / 2, 16, false, h);
    kvlm_model_free(h);
    kvlm_model_free(m);
}

/* Rollback into a block that was indexed before (a plain trim), and the
 * errors. */
static void test_rollback_edges(void **state) {
    (void)state;
    kvlm_model *m = load(synth(64, 2, 4, 2, 64, "f32", 8));
    kvlm_ctx_params p = kvlm_ctx_default_params();
    p.n_ctx = 128;
    p.block_size = 4;
    kvlm_ctx *a = mkctx(m, &p), *r = mkctx(m, &p);
    int32_t t[10] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14}, u[3] = {20, 21, 22};
    kvlm_error err = {0};
    decode(a, 0, t, 8, false); /* two full blocks, indexed */
    assert_int_equal(kvlm_kv_cached_blocks(a, NULL, 0), 2);
    /* cut into the second: it stays indexed (its bytes are intact) and is
     * copied before the next write */
    assert_int_equal(kvlm_seq_trim(a, 0, 6, &err), KVLM_OK);
    decode(a, 0, u, 3, false);
    decode(r, 0, t, 6, false);
    decode(r, 0, u, 3, false);
    assert_null(engine_kv_check(a));
    assert_true(tu_max_rel_diff(kvlm_get_logits(a, -1), kvlm_get_logits(r, -1), 64, 1e-2) < 1e-3);
    /* the old block is still found by a prompt that repeats it */
    kvlm_seq_free(a, 0);
    assert_int_equal(kvlm_seq_reuse_prefix(a, 0, t, 10), 8);
    /* errors */
    assert_int_equal(kvlm_seq_trim(a, 0, 9, &err), KVLM_EINVAL);
    assert_int_equal(kvlm_seq_trim(a, 5, 0, &err), KVLM_EINVAL);
    assert_int_equal(kvlm_seq_spec_begin(a, 0, &err), KVLM_OK);
    decode(a, 0, u, 2, true);
    assert_int_equal(kvlm_seq_trim(a, 0, 7, &err), KVLM_EINVAL); /* fewer than the verified 8 */
    assert_non_null(strstr(err.msg, "verified"));
    assert_int_equal(kvlm_seq_trim(a, 0, 9, &err), KVLM_OK);
    assert_int_equal(kvlm_seq_n_past(a, 0), 9);
    kvlm_ctx_free(a);
    kvlm_ctx_free(r);
    kvlm_model_free(m);
}

/* ---- greedy: speculative output equals plain output ---- */

static int plain_greedy(kvlm_ctx *c, const int32_t *prompt, int n, int n_gen, int32_t *out) {
    const kvlm_model *m = kvlm_ctx_model(c);
    kvlm_ctx_reset(c);
    int piece = kvlm_ctx_kv_evict(c) ? kvlm_ctx_kv_max_feed(c) / 2 : n;
    for (int i = 0; i < n; i += piece) decode(c, 0, prompt + i, n - i < piece ? n - i : piece, false);
    kvlm_sampler_params sp = kvlm_sampler_default_params();
    sp.temperature = 0;
    kvlm_sampler *s = kvlm_sampler_create(&sp, kvlm_vocab_size(m));
    int g = 0;
    while (g < n_gen) {
        int32_t t = kvlm_sampler_sample(s, kvlm_get_logits(c, -1));
        out[g++] = t;
        if (kvlm_token_is_eog(m, t)) break;
        if (!kvlm_ctx_kv_evict(c) && kvlm_ctx_n_past(c) >= kvlm_ctx_kv_budget(c)) break;
        decode(c, 0, &t, 1, false);
    }
    kvlm_sampler_free(s);
    return g;
}

static int spec_greedy(kvlm_ctx *c, kvlm_ctx *draft, const int32_t *prompt, int n, int n_gen, int K, int32_t *out,
                       kvlm_spec_stats *st) {
    const kvlm_model *m = kvlm_ctx_model(c);
    kvlm_ctx_reset(c);
    int piece = kvlm_ctx_kv_evict(c) ? kvlm_ctx_kv_max_feed(c) / 2 : n;
    for (int i = 0; i < n; i += piece) decode(c, 0, prompt + i, n - i < piece ? n - i : piece, false);
    kvlm_sampler_params sp = kvlm_sampler_default_params();
    sp.temperature = 0;
    kvlm_sampler *s = kvlm_sampler_create(&sp, kvlm_vocab_size(m));
    kvlm_spec_params pp = {draft ? KVLM_SPEC_DRAFT : KVLM_SPEC_LOOKUP, K, 0, 0, draft, 0, 0};
    kvlm_error err = {0};
    kvlm_spec *x = kvlm_spec_create(c, 0, prompt, n, &pp, &err);
    if (!x) fail_msg("spec: %s", err.msg);
    int g = 0;
    int32_t buf[65];
    bool done = false;
    while (!done && g < n_gen) {
        int past0 = kvlm_ctx_n_past(c);
        int k = kvlm_spec_next(x, s, buf, 65, &err);
        if (k < 0) fail_msg("spec step: %s", err.msg);
        bool unfed = k == 1 && kvlm_ctx_n_past(c) == past0;
        for (int i = 0; i < k && g < n_gen && !done; i++) {
            out[g++] = buf[i];
            done = kvlm_token_is_eog(m, buf[i]);
        }
        if (unfed) done = true;
        const char *bad = engine_kv_check(c);
        if (bad) fail_msg("kv_check: %s", bad);
    }
    kvlm_spec_stats_get(x, st);
    kvlm_spec_free(x);
    kvlm_sampler_free(s);
    return g;
}

static void expect_same(const kvlm_model *m, const kvlm_ctx_params *p, kvlm_ctx *draft, const int32_t *prompt, int n,
                        int n_gen, const char *what) {
    kvlm_ctx *c = mkctx(m, p);
    int32_t *a = malloc((size_t)n_gen * sizeof *a), *b = malloc((size_t)n_gen * sizeof *b);
    int na = plain_greedy(c, prompt, n, n_gen, a);
    static const int Ks[] = {1, 3, 8};
    for (int ki = 0; ki < 3; ki++) {
        kvlm_spec_stats st;
        int nb = spec_greedy(c, draft, prompt, n, n_gen, Ks[ki], b, &st);
        if (na != nb || memcmp(a, b, (size_t)na * sizeof *a)) {
            int i = 0;
            while (i < na && i < nb && a[i] == b[i]) i++;
            fail_msg("%s, K=%d: speculative output differs from plain at token %d of %d/%d", what, Ks[ki], i, na, nb);
        }
        printf("  %-40s K=%d: %d tokens equal, %llu steps, %llu/%llu drafts accepted\n", what, Ks[ki], na,
               (unsigned long long)st.steps, (unsigned long long)st.accepted, (unsigned long long)st.drafted);
    }
    free(a);
    free(b);
    kvlm_ctx_free(c);
}

static int tokenize(const kvlm_model *m, const char *text, int32_t *out, int cap) {
    kvlm_error err = {0};
    int n = kvlm_tokenize(m, text, strlen(text), kvlm_add_bos(m), false, out, cap, &err);
    if (n < 0 || n > cap) fail_msg("tokenize: %s", err.msg);
    return n;
}

static const char *k_story =
    "Lily had a red ball. She liked to play with the red ball in the park. One day, Lily lost the red ball in the "
    "park. She looked for the red ball under the tree and in the grass. Lily had a red ball.";

static void test_greedy_real(void **state) {
    (void)state;
    const char *names[] = {"stories260K.gguf", "stories4M_hd64.gguf"};
    int ran = 0;
    for (int mi = 0; mi < 2; mi++) {
        const char *path = tu_model_path(names[mi]);
        if (!path) continue;
        kvlm_model *m = load(path);
        ran++;
        int32_t prompt[256];
        int n = tokenize(m, k_story, prompt, 256);
        int n_gen = tu_quick() ? 50 : 100;
        kvlm_ctx_params p = kvlm_ctx_default_params();
        p.n_ctx = 512;
        char what[96];
        static const struct { int k, v; const char *name; } types[] = {
            {KVLM_CACHE_F16, KVLM_CACHE_F16, "f16"}, {KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0, "q8_0"},
            {KVLM_CACHE_Q4_KC, KVLM_CACHE_F16, "q4_kc/f16"}};
        for (int t = 0; t < 3; t++) {
            p.cache_type_k = types[t].k;
            p.cache_type_v = types[t].v;
            snprintf(what, sizeof what, "%s %s", names[mi], types[t].name);
            expect_same(m, &p, NULL, prompt, n, n_gen, what);
        }
        /* eviction: a budget below prompt + text, so every policy evicts */
        p.cache_type_k = p.cache_type_v = KVLM_CACHE_F16;
        p.kv_budget = 96;
        p.block_size = 16;
        for (int e = KVLM_EVICT_WINDOW; e <= KVLM_EVICT_H2O; e++) {
            p.kv_evict = e;
            snprintf(what, sizeof what, "%s evict %s", names[mi], kvlm_evict_name(e));
            expect_same(m, &p, NULL, prompt, n, n_gen, what);
        }
        /* the context's end without eviction */
        kvlm_ctx_params q = kvlm_ctx_default_params();
        q.n_ctx = n + 37;
        snprintf(what, sizeof what, "%s context end", names[mi]);
        expect_same(m, &q, NULL, prompt, n, n_gen, what);
        kvlm_model_free(m);
    }
    if (!ran) skip();
}

/* n_min (llama.cpp's --draft-min): a step checks no drafts or at least
 * n_min of them, and the text is the plain one. Lookup drafts over a story
 * vary in length, so n_min 0 shows steps of 1..4 drafts (the check can fail). */
static int draft_min_run(const kvlm_model *m, const int32_t *prompt, int n, int n_min, int *short_steps,
                         int32_t *out, int n_gen) {
    kvlm_ctx_params p = kvlm_ctx_default_params();
    p.n_ctx = 512;
    kvlm_ctx *c = mkctx(m, &p);
    decode(c, 0, prompt, n, false);
    kvlm_sampler_params sp = kvlm_sampler_default_params();
    sp.temperature = 0;
    kvlm_sampler *s = kvlm_sampler_create(&sp, kvlm_vocab_size(m));
    kvlm_spec_params pp = {KVLM_SPEC_LOOKUP, 8, 0, 0, NULL, 0, n_min};
    kvlm_error err = {0};
    kvlm_spec *x = kvlm_spec_create(c, 0, prompt, n, &pp, &err);
    if (!x) fail_msg("spec: %s", err.msg);
    int g = 0;
    int32_t buf[9];
    *short_steps = 0;
    while (g < n_gen) {
        kvlm_spec_stats a, b;
        kvlm_spec_stats_get(x, &a);
        int k = kvlm_spec_next(x, s, buf, 9, &err);
        if (k < 0) fail_msg("spec step: %s", err.msg);
        kvlm_spec_stats_get(x, &b);
        int d = (int)(b.drafted - a.drafted);
        if (d > 0 && d < 5) (*short_steps)++;
        if (n_min && d) assert_true(d >= n_min);
        for (int i = 0; i < k && g < n_gen; i++) out[g++] = buf[i];
        if (kvlm_token_is_eog(m, buf[k - 1])) break;
    }
    kvlm_spec_free(x);
    kvlm_sampler_free(s);
    kvlm_ctx_free(c);
    return g;
}

static void test_draft_min(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path);
    int32_t prompt[256], a[200], b[200];
    int n = tokenize(m, k_story, prompt, 256), shorts0, shorts5;
    int na = draft_min_run(m, prompt, n, 0, &shorts0, a, 160);
    int nb = draft_min_run(m, prompt, n, 5, &shorts5, b, 160);
    printf("  lookup, K = 8: steps checking 1..4 drafts: %d with n_min 0, %d with n_min 5\n", shorts0, shorts5);
    assert_true(shorts0 > 0);
    assert_int_equal(shorts5, 0);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, (size_t)na * sizeof *a);
    /* refused: a negative floor */
    kvlm_ctx_params p = kvlm_ctx_default_params();
    kvlm_ctx *c = mkctx(m, &p);
    decode(c, 0, prompt, n, false);
    kvlm_spec_params pp = {KVLM_SPEC_LOOKUP, 8, 0, 0, NULL, 0, -1};
    kvlm_error err = {0};
    assert_null(kvlm_spec_create(c, 0, prompt, n, &pp, &err));
    assert_non_null(strstr(err.msg, "n_min"));
    kvlm_ctx_free(c);
    kvlm_model_free(m);
}

static void test_greedy_synth(void **state) {
    (void)state;
    kvlm_model *m = load(synth(64, 2, 4, 2, 96, "q8_0", 21));
    int32_t prompt[120];
    /* a repetitive prompt: lookup finds drafts */
    for (int i = 0; i < 120; i++) prompt[i] = 3 + (i * 7) % 23;
    kvlm_ctx_params p = kvlm_ctx_default_params();
    p.n_ctx = 400;
    expect_same(m, &p, NULL, prompt, 120, 120, "synth q8_0 f16 cache");
    p.kv_budget = 100;
    p.kv_evict = KVLM_EVICT_H2O;
    expect_same(m, &p, NULL, prompt, 60, 150, "synth q8_0 h2o");
    kvlm_model_free(m);
}

/* h2o: scores after speculation equal scores after plain decoding of the
 * same tokens (to float rounding); with the unverified rows added directly
 * (the wrong way) they do not. */
static void test_h2o_exact(void **state) {
    (void)state;
    kvlm_model *m = load(synth(64, 2, 4, 2, 96, "f32", 22));
    kvlm_ctx_params p = kvlm_ctx_default_params();
    p.n_ctx = 256;
    p.kv_budget = 200;
    p.kv_evict = KVLM_EVICT_H2O;
    int32_t t[64];
    for (int i = 0; i < 64; i++) t[i] = 3 + (i * 13) % 90;
    double worst[2] = {0, 0};
    for (int wrong = 0; wrong < 2; wrong++) {
        kvlm_ctx *a = mkctx(m, &p), *r = mkctx(m, &p);
        engine_set_spec_h2o_defer(a, !wrong);
        decode(a, 0, t, 8, false);
        decode(r, 0, t, 8, false);
        kvlm_error err = {0};
        int pos = 8;
        uint64_t s = 5;
        while (pos < 60) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            int n = 1 + (int)((s >> 33) % 6), keep = 1 + (int)((s >> 45) % (uint64_t)n);
            if (pos + n > 64) break;
            int32_t d[8];
            for (int i = 0; i < n; i++) d[i] = i < keep ? t[pos + i] : 3 + (t[pos + i] + 5) % 90; /* rejected: other tokens */
            assert_int_equal(kvlm_seq_spec_begin(a, 0, &err), KVLM_OK);
            decode(a, 0, d, n, true);
            assert_int_equal(kvlm_seq_trim(a, 0, pos + keep, &err), KVLM_OK);
            for (int i = 0; i < keep; i++) decode(r, 0, &t[pos + i], 1, false); /* one at a time, as plain decoding */
            pos += keep;
        }
        const float *ha = engine_h2o_scores(a, 0), *hr = engine_h2o_scores(r, 0);
        assert_int_equal(kvlm_seq_n_past(a, 0), kvlm_seq_n_past(r, 0));
        for (int i = 0; i < kvlm_seq_n_past(a, 0); i++) {
            double e = fabs((double)ha[i] - hr[i]) / (fabs((double)hr[i]) + 1e-3);
            worst[wrong] = tu_worse(worst[wrong], e);
        }
        for (int i = kvlm_seq_n_past(a, 0); i < 200 && !wrong; i++) assert_true(ha[i] == 0);
        kvlm_ctx_free(a);
        kvlm_ctx_free(r);
    }
    printf("  h2o scores, spec against plain: max rel diff %.2e kept apart, %.2e added directly\n", worst[0], worst[1]);
    assert_true(worst[0] < 1e-4);
    assert_true(worst[1] > 1e-2);
    kvlm_model_free(m);
}

/* ---- the draft model ---- */

static void test_draft_model(void **state) {
    (void)state;
    const char *tp = synth(64, 2, 4, 2, 96, "f32", 31);
    kvlm_model *m = load(tp);
    const char *dp = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    assert_int_equal(kvlm_model_save_gguf(m, dp, kvlm_type_from_name("q4_0"), &err), KVLM_OK);
    kvlm_model *dm = load(dp);
    kvlm_ctx_params p = kvlm_ctx_default_params();
    p.n_ctx = 300;
    kvlm_ctx *dc = mkctx(dm, &p);
    int32_t prompt[20];
    for (int i = 0; i < 20; i++) prompt[i] = 3 + (i * 11) % 90;
    expect_same(m, &p, dc, prompt, 20, 150, "synth f32, its q4_0 copy drafting");
    /* acceptance: a 4-bit copy of this tiny random model agrees often (measured: about a third at K = 4) */
    kvlm_ctx *c = mkctx(m, &p);
    int32_t out[100];
    kvlm_spec_stats st;
    spec_greedy(c, dc, prompt, 20, 100, 4, out, &st);
    printf("  q4_0 draft: %llu/%llu accepted\n", (unsigned long long)st.accepted, (unsigned long long)st.drafted);
    assert_true(st.accepted * 5 > st.drafted); /* a random draft: 1 in 96 */
    /* another vocabulary is refused, by name */
    kvlm_model *om = load(synth(64, 2, 4, 2, 97, "f32", 31));
    kvlm_ctx *oc = mkctx(om, &p);
    kvlm_spec_params pp = {KVLM_SPEC_DRAFT, 4, 0, 0, oc, 0, 0};
    assert_null(kvlm_spec_create(c, 0, prompt, 20, &pp, &err));
    assert_non_null(strstr(err.msg, "vocabulary"));
    printf("  refused: %s\n", err.msg);
    kvlm_ctx_free(oc);
    kvlm_model_free(om);
    kvlm_ctx_free(c);
    kvlm_ctx_free(dc);
    kvlm_model_free(dm);
    kvlm_model_free(m);
}

/* ---- sampling keeps the target's distribution ----
 * A tiny model (vocabulary of 12); the outcome is the token at generated
 * positions 1..3, or STOP when an end token came before. Exact
 * probabilities by enumerating the contexts; the draws of many seeds are
 * tested with Pearson's chi-square at p = 1e-4. */
#define SV 12
static void softmax(const float *l, double *p) {
    double mx = l[0], s = 0;
    for (int i = 1; i < SV; i++) mx = l[i] > mx ? l[i] : mx;
    for (int i = 0; i < SV; i++) s += (p[i] = exp(l[i] - mx));
    for (int i = 0; i < SV; i++) p[i] /= s;
}

static void next_probs(kvlm_ctx *c, const int32_t *prompt, int n, const int32_t *gen, int ng, double *p) {
    kvlm_ctx_reset(c);
    decode(c, 0, prompt, n, false);
    if (ng) decode(c, 0, gen, ng, false);
    softmax(kvlm_get_logits(c, -1), p);
}

static double chi2_crit(int dof) { /* Wilson-Hilferty, z = 3.719 (p = 1e-4) */
    double k = dof, a = 2.0 / (9 * k);
    return k * pow(1 - a + 3.719 * sqrt(a), 3);
}

static double chi2(const double *expect, const long *got, int n, long N, int *dof) {
    double x = 0, e_rest = 0;
    long g_rest = 0;
    int k = 0;
    for (int i = 0; i < n; i++) {
        if (expect[i] * N < 5) { e_rest += expect[i] * N; g_rest += got[i]; continue; }
        double d = got[i] - expect[i] * N;
        x += d * d / (expect[i] * N);
        k++;
    }
    if (e_rest > 0) { x += (g_rest - e_rest) * (g_rest - e_rest) / e_rest; k++; }
    else if (g_rest) x = INFINITY;
    *dof = k - 1;
    return x;
}

/* Temperature 1 and no truncation: the sampler draws from softmax(logits). */
static kvlm_sampler *plain_sampler(uint64_t seed) {
    kvlm_sampler_params sp = kvlm_sampler_default_params();
    sp.temperature = 1;
    sp.top_k = 0;
    sp.top_p = 1;
    sp.min_p = 0;
    sp.seed = seed;
    return kvlm_sampler_create(&sp, SV);
}

#define SPEC_P_MIN 0.3f
static void test_sampling_distribution(void **state) {
    (void)state;
    const char *tp = synth(32, 1, 2, 1, SV, "f32", 41);
    kvlm_model *m = load(tp);
    const char *dp = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    assert_int_equal(kvlm_model_save_gguf(m, dp, kvlm_type_from_name("q4_0"), &err), KVLM_OK);
    kvlm_model *dm = load(dp);
    kvlm_ctx_params p = kvlm_ctx_default_params();
    p.n_ctx = 64;
    kvlm_ctx *c = mkctx(m, &p), *dc = mkctx(dm, &p);
    /* a repetitive prompt so that lookup drafts at every position */
    int32_t prompt[12] = {3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8};
    int n = 12;
    /* exact distribution of positions 1..3 (index SV = STOP) */
    double ex[3][SV + 1] = {{0}}, p1[SV], p2[SV], p3[SV];
    next_probs(c, prompt, n, NULL, 0, p1);
    for (int a = 0; a < SV; a++) {
        ex[0][a] += p1[a];
        if (kvlm_token_is_eog(m, a)) { ex[1][SV] += p1[a]; ex[2][SV] += p1[a]; continue; }
        int32_t g[2] = {a, 0};
        next_probs(c, prompt, n, g, 1, p2);
        for (int b = 0; b < SV; b++) {
            double pab = p1[a] * p2[b];
            ex[1][b] += pab;
            if (kvlm_token_is_eog(m, b)) { ex[2][SV] += pab; continue; }
            g[1] = b;
            next_probs(c, prompt, n, g, 2, p3);
            for (int t = 0; t < SV; t++) ex[2][t] += pab * p3[t];
        }
    }
    long N = tu_quick() ? 1500 : 4000;
    /* plain sampler, lookup, q4_0 draft, the draft with --draft-p-min (its
     * drafts end where it is unsure: a rule that looks at the draft alone
     * keeps the distribution, and it must have ended some) */
    uint64_t drafted[4] = {0};
    for (int mode = 0; mode < 4; mode++) {
        long got[3][SV + 1] = {{0}};
        for (long i = 0; i < N; i++) {
            kvlm_sampler *s = plain_sampler(1000 + (uint64_t)i);
            kvlm_ctx_reset(c);
            decode(c, 0, prompt, n, false);
            int32_t out[3];
            int g = 0;
            if (mode == 0) {
                while (g < 3) {
                    out[g] = kvlm_sampler_sample(s, kvlm_get_logits(c, -1));
                    if (kvlm_token_is_eog(m, out[g++])) break;
                    decode(c, 0, &out[g - 1], 1, false);
                }
            } else {
                kvlm_spec_params pp = {mode == 1 ? KVLM_SPEC_LOOKUP : KVLM_SPEC_DRAFT, 3, 0, 0, mode >= 2 ? dc : NULL,
                                       mode == 3 ? SPEC_P_MIN : 0, 0};
                kvlm_spec *x = kvlm_spec_create(c, 0, prompt, n, &pp, &err);
                if (!x) fail_msg("spec: %s", err.msg);
                int32_t buf[8];
                bool end = false;
                while (g < 3 && !end) {
                    int k = kvlm_spec_next(x, s, buf, 8, &err);
                    if (k < 0) fail_msg("spec: %s", err.msg);
                    for (int j = 0; j < k && g < 3 && !end; j++) end = kvlm_token_is_eog(m, out[g++] = buf[j]);
                }
                kvlm_spec_stats st;
                kvlm_spec_stats_get(x, &st);
                drafted[mode] += st.drafted;
                kvlm_spec_free(x);
            }
            kvlm_sampler_free(s);
            for (int q = 0; q < 3; q++) got[q][q < g ? out[q] : SV]++;
        }
        for (int q = 0; q < 3; q++) {
            int dof;
            double x = chi2(ex[q], got[q], SV + 1, N, &dof);
            printf("  %-7s position %d: chi-square %.1f, %d dof, critical %.1f (p = 1e-4)\n",
                   mode == 0 ? "plain" : mode == 1 ? "lookup" : mode == 2 ? "draft" : "p-min", q + 1, x, dof,
                   chi2_crit(dof));
            assert_true(x < chi2_crit(dof));
        }
    }
    printf("  drafts checked: %llu by the draft model, %llu with p_min %.2f\n", (unsigned long long)drafted[2],
           (unsigned long long)drafted[3], SPEC_P_MIN);
    assert_true(drafted[3] > 0 && drafted[3] * 4 < drafted[2] * 3);
    kvlm_ctx_free(c);
    kvlm_ctx_free(dc);
    kvlm_model_free(dm);
    kvlm_model_free(m);
}

/* The rule for a sampled draft (spec_check_q) alone: d drawn from q, the
 * token given out must follow p (chi-square at p = 1e-4), and drafts must
 * be kept at the rate sum_t min(p(t), q(t)) (within 4.5 standard
 * deviations). Three q: close to p, far from it, and with tokens p has
 * and q lacks (q(t) = 0 where p(t) > 0). Two other rules show the checks
 * can fail: the point-mass rule (keep d with probability p(d), else draw
 * from p without d) gives p too, but keeps far fewer drafts; keeping d with
 * probability min(1, p(d) / q(d)) but drawing from p itself on a rejection
 * keeps the right share and gives the wrong distribution. */
static void test_soft_rule(void **state) {
    (void)state;
    float logits[SV];
    double p[SV];
    for (int i = 0; i < SV; i++) logits[i] = (float)sin(1.7 * i) * 2.0f;
    softmax(logits, p);
    int32_t ids[SV];
    float probs[SV];
    long N = tu_quick() ? 20000 : 60000;
    for (int variant = 0; variant < 5; variant++) {
        float q[SV];
        double z = 0;
        for (int i = 0; i < SV; i++) {
            double w = variant == 0 ? p[i] * (1 + 0.3 * cos(i)) : variant == 2 && i % 3 == 0 ? 0 : exp(cos(2.3 * i));
            q[i] = (float)w;
            z += w;
        }
        for (int i = 0; i < SV; i++) q[i] = (float)(q[i] / z);
        double accept_expect = 0;
        for (int i = 0; i < SV; i++) accept_expect += p[i] < q[i] ? p[i] : q[i];
        kvlm_sampler *smp = plain_sampler(77 + (uint64_t)variant);
        long got[SV + 1] = {0}, kept = 0;
        uint64_t rs = 12345 + (uint64_t)variant;
        for (long n = 0; n < N; n++) {
            rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
            double u = (double)(rs >> 11) / 9007199254740992.0, cum = 0;
            int32_t d = SV - 1;
            for (int i = 0; i < SV; i++)
                if (q[i] > 0 && u < (cum += q[i])) { d = i; break; }
            while (q[d] <= 0) d--;
            int32_t next = -1, tok;
            bool keep;
            if (variant < 3) keep = spec_check_q(smp, logits, d, q, ids, probs, &next);
            else if (variant == 3) keep = spec_check(smp, logits, d, ids, probs, &next);
            else { /* rejection draws from p: wrong */
                rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
                keep = (double)(rs >> 11) / 9007199254740992.0 * q[d] < p[d];
                if (!keep) next = kvlm_sampler_sample(smp, logits);
            }
            tok = keep ? d : next;
            kept += keep;
            got[tok]++;
        }
        kvlm_sampler_free(smp);
        int dof;
        double x = chi2(p, got, SV, N, &dof);
        double a = (double)kept / (double)N, sd = sqrt(accept_expect * (1 - accept_expect) / (double)N);
        printf("  q %s: chi-square %.1f (%d dof, critical %.1f); kept %.4f, expected %.4f (sd %.4f)\n",
               variant == 0 ? "near p" : variant == 1 ? "far from p" : variant == 2 ? "lacking tokens"
               : variant == 3 ? "far, point-mass rule (keeps too few)" : "far, draws from p on rejection (wrong p)",
               x, dof, chi2_crit(dof), a, accept_expect, sd);
        bool ok = x < chi2_crit(dof) && fabs(a - accept_expect) < 4.5 * sd;
        if (variant < 3) assert_true(ok);
        else assert_false(ok);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rollback_random),
        cmocka_unit_test(test_rollback_edges),
        cmocka_unit_test(test_greedy_synth),
        cmocka_unit_test(test_greedy_real),
        cmocka_unit_test(test_draft_min),
        cmocka_unit_test(test_h2o_exact),
        cmocka_unit_test(test_draft_model),
        cmocka_unit_test(test_soft_rule),
        cmocka_unit_test(test_sampling_distribution),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
