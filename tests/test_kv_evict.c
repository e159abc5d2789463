/* tests/test_kv_evict: eviction policies on hand-built cases, compaction of
 * the paged cache (shared blocks are copied, never changed or freed while in
 * use; every invariant holds), H2O's accumulated attention against a brute
 * force, and the engine: a budget larger than the sequence changes nothing
 * (bit-identical logits), and on a one-layer model an evicted cache equals a
 * fresh run over the kept tokens (re-rotated keys). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "engine/engine.h"
#include "kv/evict.h"
#include "kv/paged.h"
#include "kv/store.h"
#include "ops/kvtype.h"
#include "ops/ops.h"

static void expect_keep(const kv_evict_params *p, int n, int n_keep, const float *scores, const int32_t *want) {
    int32_t keep[64];
    assert_int_equal(kv_evict_select(p, n, n_keep, scores, keep), n_keep);
    for (int i = 0; i < n_keep; i++)
        if (keep[i] != want[i]) fail_msg("policy %d, n %d keep %d: keep[%d] = %d, want %d", p->policy, n, n_keep, i, keep[i], want[i]);
}

static void test_policies(void **state) {
    (void)state;
    kv_evict_params w = {KVLM_EVICT_WINDOW, 0, 0, 0};
    expect_keep(&w, 10, 4, NULL, (int32_t[]){6, 7, 8, 9});
    expect_keep(&w, 10, 0, NULL, NULL);
    kv_evict_params s = {KVLM_EVICT_SINKS, 2, 0, 0};
    expect_keep(&s, 10, 5, NULL, (int32_t[]){0, 1, 7, 8, 9});
    expect_keep(&s, 10, 2, NULL, (int32_t[]){0, 1});
    expect_keep(&s, 10, 1, NULL, (int32_t[]){0});
    s.sinks = 4;
    expect_keep(&s, 6, 6, NULL, (int32_t[]){0, 1, 2, 3, 4, 5}); /* keeping all: none changes */
    /* h2o: the 2 most recent, then the 3 best-scored of the rest (tie: earlier) */
    float sc[10] = {5, 0.1f, 3, 3, 0.2f, 4, 0.3f, 9, 100, 100};
    kv_evict_params h = {KVLM_EVICT_H2O, 0, 2, 0.5f};
    expect_keep(&h, 10, 5, sc, (int32_t[]){0, 5, 7, 8, 9});
    expect_keep(&h, 10, 6, sc, (int32_t[]){0, 2, 5, 7, 8, 9});
    /* heavy share instead of a recent count: 4 kept, half heavy */
    h.h2o_recent = 0;
    expect_keep(&h, 10, 4, sc, (int32_t[]){0, 7, 8, 9});
    h.h2o_heavy = 1.0f; /* all by score: the recent 100s win too */
    expect_keep(&h, 10, 3, sc, (int32_t[]){7, 8, 9});
    int32_t keep[4];
    assert_int_equal(kv_evict_select(&h, 3, 4, sc, keep), -1); /* keep more than there is */
    kv_evict_params bad = {99, 0, 0, 0};
    assert_int_equal(kv_evict_select(&bad, 3, 1, sc, keep), -1);
}

/* ---- the paged cache ---- */

static kv_cache *make_cache(int n_blocks, int bs, int max_seqs, int k_type) {
    kv_params p = {2, 2, 8, bs, n_blocks, max_seqs, 4096, 99, true, k_type, KVLM_CACHE_F32, NULL, {{0}}, false, NULL, 0};
    kvlm_error err = {0};
    kv_cache *c = kv_create(&p, &err);
    if (!c) fail_msg("kv_create: %s", err.msg);
    return c;
}

static float tag(int32_t tok, int l, int h) { return (float)tok + 0.25f * l + 0.0625f * h; }

/* Appends tokens whose K and V rows encode (token, layer, head). */
static void append(kv_cache *c, int seq, const int32_t *toks, int n) {
    const kv_params *p = kv_get_params(c);
    kvlm_error err = {0};
    if (kv_seq_reserve(c, seq, n, &err)) fail_msg("reserve: %s", err.msg);
    int len = kv_seq_len(c, seq);
    const int32_t *blocks = kv_seq_blocks(c, seq, NULL);
    float row[8];
    for (int i = 0; i < n; i++) {
        int pos = len + i, b = blocks[pos / p->block_size], slot = pos % p->block_size;
        for (int l = 0; l < p->n_layers; l++)
            for (int h = 0; h < p->n_kv_heads; h++) {
                for (int d = 0; d < 8; d++) row[d] = tag(toks[i], l, h);
                op_kv_quantize_row(p->k_type, row, kv_block_k(c, b, l, h) + slot * op_kv_row_bytes(p->k_type, 8), 8);
                for (int d = 0; d < 8; d++) row[d] = -row[d];
                op_kv_quantize_row(p->v_type, row, kv_block_v(c, b, l, h) + slot * op_kv_row_bytes(p->v_type, 8), 8);
            }
    }
    kv_seq_commit(c, seq, toks, n);
}

/* Every sequence reads back its own tokens' rows. */
static void check_contents(const kv_cache *c, int max_seqs, float tol) {
    const kv_params *p = kv_get_params(c);
    float row[8];
    for (int s = 0; s < max_seqs; s++) {
        const int32_t *blocks = kv_seq_blocks(c, s, NULL), *toks = kv_seq_tokens(c, s);
        for (int pos = 0; pos < kv_seq_len(c, s); pos++) {
            int b = blocks[pos / p->block_size], slot = pos % p->block_size;
            for (int l = 0; l < p->n_layers; l++)
                for (int h = 0; h < p->n_kv_heads; h++) {
                    float want = tag(toks[pos], l, h);
                    op_kv_dequantize_row(p->k_type, kv_block_k(c, b, l, h) + slot * op_kv_row_bytes(p->k_type, 8), row, 8);
                    if (fabsf(row[0] - want) > tol * fabsf(want) || fabsf(row[7] - want) > tol * fabsf(want))
                        fail_msg("seq %d pos %d layer %d head %d: key %g, want %g", s, pos, l, h, row[0], want);
                    const float *v = (const float *)kv_block_v(c, b, l, h) + slot * 8;
                    if (v[0] != -want) fail_msg("seq %d pos %d: value %g, want %g", s, pos, v[0], -want);
                }
        }
    }
}

static void check(const kv_cache *c) {
    const char *bad = kv_check(c);
    if (bad) fail_msg("kv_check: %s", bad);
}

/* A fork shares its parent's blocks; evicting from the fork copies what it
 * writes, leaves the parent's blocks, data and index entries alone, and the
 * evicted fork is no longer indexed. */
static void test_compact_shared(void **state) {
    (void)state;
    kv_cache *c = make_cache(32, 4, 3, KVLM_CACHE_F32);
    int32_t toks[10];
    for (int i = 0; i < 10; i++) toks[i] = 100 + i;
    append(c, 0, toks, 10); /* blocks [100..103] [104..107] indexed, [108 109] partial */
    kvlm_error err = {0};
    assert_int_equal(kv_seq_fork(c, 0, 1, &err), KVLM_OK);
    kv_stats st;
    kv_get_stats(c, &st);
    assert_int_equal(st.shared, 3);
    int nb0;
    const int32_t *b0 = kv_seq_blocks(c, 0, &nb0);
    int32_t parent_blocks[3];
    memcpy(parent_blocks, b0, sizeof parent_blocks);
    int32_t keep[] = {0, 1, 5, 6, 7, 8, 9};
    assert_int_equal(kv_seq_compact(c, 1, keep, 7, NULL, NULL, &err), KVLM_OK);
    check(c);
    check_contents(c, 3, 0);
    assert_int_equal(kv_seq_len(c, 1), 7);
    assert_int_equal(kv_seq_tokens(c, 1)[2], 105);
    /* the parent still holds the same blocks and tokens */
    b0 = kv_seq_blocks(c, 0, &nb0);
    assert_int_equal(nb0, 3);
    assert_memory_equal(b0, parent_blocks, sizeof parent_blocks);
    int nb1;
    const int32_t *b1 = kv_seq_blocks(c, 1, &nb1);
    assert_int_equal(nb1, 2);
    assert_int_not_equal(b1[0], parent_blocks[0]); /* both written: private copies */
    assert_int_not_equal(b1[1], parent_blocks[1]);
    kv_get_stats(c, &st);
    assert_int_equal(st.shared, 0); /* the fork dropped the partial block it no longer needs */
    /* fill the fork's blocks: nothing of it is indexed */
    int32_t more[5] = {7, 7, 7, 7, 7};
    append(c, 1, more, 5);
    check(c);
    check_contents(c, 3, 0);
    kv_seq_release(c, 1);
    /* the parent's blocks still match a new prompt with its text */
    kv_seq_release(c, 0);
    check(c);
    assert_int_equal(kv_seq_match_prefix(c, 2, toks, 10), 8);
    const int32_t *b2 = kv_seq_blocks(c, 2, NULL);
    assert_int_equal(b2[0], parent_blocks[0]);
    assert_int_equal(b2[1], parent_blocks[1]);
    check_contents(c, 3, 0);
    kv_free(c);
}

/* Evicting from a sequence alone unindexes the blocks it rewrites, returns
 * whole blocks to the pool, and keeps untouched indexed blocks reusable. */
static void test_compact_alone(void **state) {
    (void)state;
    kv_cache *c = make_cache(16, 4, 2, KVLM_CACHE_F32);
    int32_t toks[16];
    for (int i = 0; i < 16; i++) toks[i] = 200 + i;
    append(c, 0, toks, 16); /* 4 full blocks, all indexed */
    kv_stats st;
    kv_get_stats(c, &st);
    assert_int_equal(st.used, 4);
    int32_t keep[] = {0, 1, 2, 3, 4, 13, 14, 15}; /* block 0 untouched; block 1 rewritten */
    kvlm_error err = {0};
    assert_int_equal(kv_seq_compact(c, 0, keep, 8, NULL, NULL, &err), KVLM_OK);
    check(c);
    check_contents(c, 2, 0);
    kv_get_stats(c, &st);
    assert_int_equal(st.used, 2);
    assert_int_equal(st.cached, 2); /* blocks 2 and 3 were untouched: cached for reuse */
    /* a new prompt with the original text finds block 0 only */
    assert_int_equal(kv_seq_match_prefix(c, 1, toks, 16), 4);
    check(c);
    kv_free(c);
}

/* Random appends, forks, evictions and releases: invariants and contents
 * hold after every step, for f32 and q8_0 keys. */
static void test_randomized(void **state) {
    (void)state;
    int types[] = {KVLM_CACHE_F32, KVLM_CACHE_Q8_0};
    for (int t = 0; t < 2; t++) {
        kv_cache *c = make_cache(48, 4, 4, types[t]);
        uint64_t r = 7;
        kvlm_error err = {0};
        int steps = tu_quick() ? 400 : 3000;
        for (int step = 0; step < steps; step++) {
            r = r * 6364136223846793005ULL + 1442695040888963407ULL;
            int op = (int)((r >> 33) % 10), s = (int)((r >> 40) % 4), len = kv_seq_len(c, s);
            if (op < 5) {
                int32_t tk[5];
                int n = 1 + (int)((r >> 20) % 5);
                for (int i = 0; i < n; i++) tk[i] = (int32_t)((r >> (8 + i)) % 50) + 1;
                kvlm_error e2 = {0};
                if (kv_seq_reserve(c, s, n, &e2) == KVLM_OK) {
                    kv_seq_trim(c, s, len);
                    append(c, s, tk, n);
                }
            } else if (op < 8 && len > 0) {
                int32_t keep[4096];
                int n_keep = 0;
                for (int i = 0; i < len; i++)
                    if ((r >> (i % 50)) & 1 || i < 2) keep[n_keep++] = i;
                int rc = kv_seq_compact(c, s, keep, n_keep, NULL, NULL, &err);
                assert_true(rc == KVLM_OK || rc == KVLM_EFULL);
            } else if (op == 8) assert_int_equal(kv_seq_fork(c, s, (s + 1) % 4, &err), KVLM_OK);
            else kv_seq_release(c, s);
            check(c);
            check_contents(c, 4, types[t] == KVLM_CACHE_F32 ? 0 : 0.01f);
        }
        kv_free(c);
    }
}

/* ---- H2O weights from the attention kernel ---- */

static void test_h2o_weights(void **state) {
    (void)state;
    enum { T = 3, P0 = 20, NH = 4, NKV = 2, HD = 16, N = P0 + T };
    uint64_t rs = 3;
    float *k = malloc(sizeof(float) * NKV * N * HD), *v = malloc(sizeof(float) * NKV * N * HD);
    float q[T * NH * HD], out[T * NH * HD], w[N] = {0}, wr[N] = {0};
    tu_fill_random(k, (size_t)NKV * N * HD, &rs, 1.0f);
    tu_fill_random(v, (size_t)NKV * N * HD, &rs, 1.0f);
    tu_fill_random(q, sizeof q / sizeof q[0], &rs, 2.0f);
    op_attn_args a = {0};
    a.T = T; a.q_pos0 = P0; a.n_heads = NH; a.n_kv_heads = NKV; a.head_dim = HD;
    a.k = k; a.v = v; a.kv_head_stride = (size_t)N * HD; a.scale = 0.25f; a.stage_block = -1;
    float plain[T * NH * HD];
    util_pool *pool = util_pool_create(2);
    void *work = malloc(op_attention_work_size(util_pool_size(pool), HD) + 64);
    op_attention(pool, plain, q, &a, work);
    a.key_weights = w;
    op_attention(pool, out, q, &a, work);
    assert_memory_equal(out, plain, sizeof out); /* the weights leave the output alone */
    op_attention_ref(out, q, &a);
    /* brute force: softmax of each query head's scores, summed */
    double total = 0;
    for (int t = 0; t < T; t++)
        for (int hq = 0; hq < NH; hq++) {
            int kv = hq / (NH / NKV), n = P0 + t + 1;
            double s[N], mx = -1e30, sum = 0;
            for (int p = 0; p < n; p++) {
                s[p] = 0;
                for (int i = 0; i < HD; i++) s[p] += (double)q[(t * NH + hq) * HD + i] * k[((size_t)kv * N + p) * HD + i];
                s[p] *= 0.25;
                mx = fmax(mx, s[p]);
            }
            for (int p = 0; p < n; p++) sum += exp(s[p] - mx);
            for (int p = 0; p < n; p++) wr[p] += (float)(exp(s[p] - mx) / sum);
        }
    for (int p = 0; p < N; p++) {
        total += w[p];
        /* op_attention and op_attention_ref each added once */
        if (fabsf(w[p] - 2 * wr[p]) > 1e-5f) fail_msg("key %d: weight %g, brute force %g", p, w[p] / 2, wr[p]);
    }
    assert_true(fabs(total - 2.0 * T * NH) < 1e-4);
    /* the kernels' own weights (room for the scores of all T tokens, then of
     * one at a time): once more against the brute force, output unchanged */
    size_t swn = op_attention_score_floats(T, NH, N);
    float *sw = malloc(sizeof(float) * swn);
    a.score_work = sw;
    for (int pass = 0; pass < 2; pass++) {
        a.score_work_floats = pass ? op_attention_score_floats(1, NH, N) : swn;
        memset(w, 0, sizeof w);
        op_attention(pool, out, q, &a, work);
        for (int i = 0; i < T * NH * HD; i++)
            if (fabsf(out[i] - plain[i]) > (pass ? 1e-5f : 0.0f)) fail_msg("pass %d: out[%d] changed", pass, i);
        for (int p = 0; p < N; p++)
            if (fabsf(w[p] - wr[p]) > 1e-5f * wr[p] + 1e-7f)
                fail_msg("pass %d key %d: weight %g, brute force %g", pass, p, w[p], wr[p]);
    }
    free(sw);
    free(k); free(v); free(work);
    util_pool_free(pool);
}

/* ---- the engine ---- */

/* scaling: 0 plain RoPE, 1 Llama 3.1's rope_freqs (factor 4), 2 YaRN (factor 4),
 * 3 a phi3 with LongRoPE (factor 4: long factors past n_ctx / 4 tokens) */
static kvlm_model *synth_scaled(int n_layers, int n_ctx, int scaling) {
    kvlm_synth_params sp = {0};
    sp.arch = KVLM_ARCH_LLAMA;
    sp.dim = 64; sp.hidden_dim = 160; sp.n_layers = n_layers; sp.n_heads = 4; sp.n_kv_heads = 2;
    sp.vocab_size = 200; sp.n_ctx = n_ctx; sp.type = kvlm_type_from_name("f32"); sp.seed = 11;
    if (scaling == 1) sp.rope_llama3 = 4;
    if (scaling == 2) sp.yarn_factor = 4;
    if (scaling == 3) sp.arch = KVLM_ARCH_PHI3, sp.longrope = 4;
    const char *path = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, path, &err)) fail_msg("synth: %s", err.msg);
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("load: %s", err.msg);
    return m;
}
static kvlm_model *synth(int n_layers, int n_ctx) { return synth_scaled(n_layers, n_ctx, 0); }

static kvlm_ctx *ctx_with(kvlm_model *m, int n_ctx, int budget, int policy, int k_type) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_threads = 2; cp.n_ctx = n_ctx; cp.block_size = 8;
    cp.kv_budget = budget; cp.kv_evict = policy; cp.h2o_recent = budget > 16 ? 8 : 0;
    cp.cache_type_k = k_type;
    cp.cache_type_v = k_type == KVLM_CACHE_Q4_KC ? KVLM_CACHE_Q8_0 : k_type;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) fail_msg("ctx: %s", err.msg);
    return ctx;
}

static void ids_of(int32_t *ids, int n, uint64_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        ids[i] = 3 + (int32_t)((seed >> 33) % 197);
    }
    ids[0] = 1;
}

/* Feeds ids in pieces of `step`; returns the logits after the last token. */
static void feed(kvlm_ctx *ctx, const int32_t *ids, int n, int step, float *last) {
    kvlm_error err = {0};
    for (int i = 0; i < n; i += step) {
        kvlm_batch b = {n - i < step ? n - i : step, ids + i, NULL, NULL, NULL};
        if (kvlm_decode(ctx, &b, &err)) fail_msg("decode at %d: %s", i, err.msg);
    }
    memcpy(last, kvlm_get_logits(ctx, -1), 200 * sizeof(float));
}

static void test_big_budget_is_none(void **state) {
    (void)state;
    kvlm_model *m = synth(2, 128);
    int32_t ids[100];
    ids_of(ids, 100, 5);
    float want[200], got[200];
    kvlm_ctx *none = ctx_with(m, 128, 0, KVLM_EVICT_NONE, KVLM_CACHE_F32);
    feed(none, ids, 100, 7, want);
    for (int pol = KVLM_EVICT_WINDOW; pol <= KVLM_EVICT_H2O; pol++) {
        kvlm_ctx *ctx = ctx_with(m, 128, 120, pol, KVLM_CACHE_F32);
        feed(ctx, ids, 100, 7, got);
        assert_memory_equal(got, want, sizeof got);
        assert_int_equal(kvlm_seq_n_evicted(ctx, 0), 0);
        kvlm_ctx_free(ctx);
    }
    kvlm_ctx_free(none);
    kvlm_model_free(m);
}

static double rel_err(const float *got, const float *want) {
    double worst = 0, scale = 1e-3;
    for (int v = 0; v < 200; v++) scale = fmax(scale, fabs(want[v]));
    for (int v = 0; v < 200; v++) worst = tu_worse(worst, fabs(got[v] - want[v]) / scale);
    return worst;
}

/* One layer: a token's key and value depend only on it and its position, so
 * an evicted cache (keys re-rotated to their new places) must give what a
 * fresh run over the kept tokens gives. */
static void test_evicted_equals_fresh(void **state) {
    (void)state;
    kvlm_model *m = synth(1, 256);
    int n = tu_quick() ? 90 : 200;
    int32_t ids[200];
    ids_of(ids, n, 9);
    int types[] = {KVLM_CACHE_F32, KVLM_CACHE_Q8_0, KVLM_CACHE_F16, KVLM_CACHE_Q4_KC};
    double tols[] = {1e-4, 3e-2, 1e-2, 0.2};
    for (int t = 0; t < 4; t++)
        for (int pol = KVLM_EVICT_WINDOW; pol <= KVLM_EVICT_H2O; pol++) {
            kvlm_ctx *ctx = ctx_with(m, 256, 40, pol, types[t]);
            float got[200], want[200];
            feed(ctx, ids, n, pol == KVLM_EVICT_SINKS ? 3 : 1, got);
            int n_kept;
            const int32_t *kept = engine_seq_tokens(ctx, 0, &n_kept);
            assert_true(n_kept <= 40 && n_kept >= 40 - 8);
            assert_int_equal(n_kept + kvlm_seq_n_evicted(ctx, 0), n);
            assert_int_equal(kept[n_kept - 1], ids[n - 1]);
            if (pol == KVLM_EVICT_SINKS) assert_memory_equal(kept, ids, 4 * sizeof(int32_t));
            if (pol == KVLM_EVICT_WINDOW) assert_memory_equal(kept, ids + n - n_kept, (size_t)n_kept * sizeof(int32_t));
            int32_t copy[40];
            memcpy(copy, kept, (size_t)n_kept * sizeof(int32_t));
            kvlm_ctx *fresh = ctx_with(m, 256, 0, KVLM_EVICT_NONE, types[t]);
            feed(fresh, copy, n_kept, n_kept, want);
            double worst = rel_err(got, want);
            /* what the cache type alone costs: the fresh run against f32 */
            float exact[200];
            kvlm_ctx *f32 = ctx_with(m, 256, 0, KVLM_EVICT_NONE, KVLM_CACHE_F32);
            feed(f32, copy, n_kept, n_kept, exact);
            kvlm_ctx_free(f32);
            double type_err = rel_err(want, exact);
            printf("  %s cache, %s: %d kept, %ld evicted, vs fresh run %.2e (the type alone: %.2e)\n",
                   kvlm_cache_type_name(types[t]), kvlm_evict_name(pol), n_kept, kvlm_seq_n_evicted(ctx, 0), worst,
                   type_err);
            assert_true(worst < tols[t]);
            kvlm_ctx_free(fresh);
            kvlm_ctx_free(ctx);
        }
    kvlm_model_free(m);
    /* scaled RoPE (per-pair factors; YaRN's magnitude in the attention
     * scale): the re-rotation by the shift is still exact */
    static const char *const names[] = {"", "rope_freqs", "YaRN", "LongRoPE (long factors)", "LongRoPE (short factors)"};
    for (int sc = 1; sc <= 4; sc++) {
        /* LongRoPE: a context of 256 turns keys by the long factors, one of
         * 64 (its original context) by the short ones, re-rotation too */
        int n_ctx = sc == 4 ? 64 : 256;
        m = synth_scaled(1, 256, sc < 4 ? sc : 3);
        kvlm_ctx *ctx = ctx_with(m, n_ctx, 40, KVLM_EVICT_SINKS, KVLM_CACHE_F32);
        float got[200], want[200];
        feed(ctx, ids, n, 3, got);
        int n_kept;
        const int32_t *kept = engine_seq_tokens(ctx, 0, &n_kept);
        int32_t copy[40];
        memcpy(copy, kept, (size_t)n_kept * sizeof(int32_t));
        kvlm_ctx *fresh = ctx_with(m, n_ctx, 0, KVLM_EVICT_NONE, KVLM_CACHE_F32);
        feed(fresh, copy, n_kept, n_kept, want);
        double worst = rel_err(got, want);
        printf("  %s RoPE, sinks: %d kept, vs fresh run %.2e\n", names[sc], n_kept, worst);
        assert_true(worst < 1e-4);
        kvlm_ctx_free(fresh);
        kvlm_ctx_free(ctx);
        kvlm_model_free(m);
    }
}

/* Key row (f32 cache) of token t, layer l, KV head h of sequence 0. */
static const float *key_row(kvlm_ctx *ctx, int l, int h, int t) {
    const kv_store *s = engine_kv_store(ctx);
    const kv_params *p = kv_store_params_of(s);
    int n_blocks;
    const int32_t *table = kv_store_seq_table(s, 0, &n_blocks);
    uint8_t *base;
    size_t block_bytes, head_bytes, v_offset;
    kv_store_layout(s, &base, &block_bytes, &head_bytes, &v_offset);
    assert_true(t / p->block_size < n_blocks);
    return (const float *)(base + (size_t)table[t / p->block_size] * block_bytes +
                           ((size_t)l * p->n_kv_heads + h) * head_bytes) + (size_t)(t % p->block_size) * p->head_dim;
}

/* smollm3: every fourth layer has no RoPE, so a kept key of that layer holds
 * no position and eviction must move it as it is, while the other layers'
 * keys turn by the shift. 4 layers, sinks, 40 distinct tokens fill the
 * budget, one more evicts; then layer 3's kept keys equal what they were
 * (bit for bit), and layer 0's equal a fresh run's of the kept tokens (a
 * first layer's key depends only on its token and position). */
static void test_nope_rekey(void **state) {
    (void)state;
    kvlm_synth_params sp = {0};
    sp.arch = KVLM_ARCH_SMOLLM3;
    sp.dim = 64; sp.hidden_dim = 160; sp.n_layers = 4; sp.n_heads = 4; sp.n_kv_heads = 2;
    sp.vocab_size = 200; sp.n_ctx = 256; sp.type = kvlm_type_from_name("f32"); sp.seed = 12;
    const char *path = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, path, &err)) fail_msg("synth: %s", err.msg);
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("load: %s", err.msg);
    const int HD = 16, N = 40;
    int32_t ids[41];
    for (int i = 0; i < 41; i++) ids[i] = 3 + i; /* distinct: a kept token names its old position */
    kvlm_ctx *ctx = ctx_with(m, 256, N, KVLM_EVICT_SINKS, KVLM_CACHE_F32);
    float last[200];
    feed(ctx, ids, N, N, last);
    assert_int_equal(kvlm_seq_n_evicted(ctx, 0), 0);
    float before[4][40][16];
    for (int l = 0; l < 4; l++)
        for (int t = 0; t < N; t++) memcpy(before[l][t], key_row(ctx, l, 1, t), sizeof before[l][t]);
    feed(ctx, ids + N, 1, 1, last);
    int n_kept;
    const int32_t *kept = engine_seq_tokens(ctx, 0, &n_kept);
    assert_true(kvlm_seq_n_evicted(ctx, 0) > 0);
    int32_t copy[41];
    memcpy(copy, kept, (size_t)n_kept * sizeof(int32_t));
    kvlm_ctx *fresh = ctx_with(m, 256, 0, KVLM_EVICT_NONE, KVLM_CACHE_F32);
    feed(fresh, copy, n_kept - 1, n_kept - 1, last);
    int moved = 0;
    double worst0 = 0;
    for (int i = 0; i < n_kept - 1; i++) {
        int p = copy[i] - 3;
        moved += p != i;
        assert_memory_equal(key_row(ctx, 3, 1, i), before[3][p], sizeof before[3][p]); /* NoPE: as it was */
        const float *a = key_row(ctx, 0, 1, i), *b = key_row(fresh, 0, 1, i);
        for (int d = 0; d < HD; d++) worst0 = fmax(worst0, fabs(a[d] - b[d]));
    }
    printf("  smollm3, sinks: %d kept, %d moved; NoPE layer's keys unchanged, layer 0's vs fresh run %.2e\n",
           n_kept - 1, moved, worst0);
    assert_true(moved > 0);
    assert_true(worst0 < 1e-5);
    kvlm_ctx_free(fresh);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

/* Sinks runs far past the context; none stops at the budget with a reason;
 * bad parameters are refused clearly. */
static void test_limits(void **state) {
    (void)state;
    kvlm_model *m = synth(2, 64);
    int32_t ids[300];
    ids_of(ids, 300, 3);
    float last[200];
    kvlm_ctx *s = ctx_with(m, 64, 48, KVLM_EVICT_SINKS, KVLM_CACHE_F32);
    feed(s, ids, 300, 1, last);
    assert_true(kvlm_seq_n_past(s, 0) <= 48);
    assert_int_equal(kvlm_seq_n_past(s, 0) + kvlm_seq_n_evicted(s, 0), 300);
    kvlm_error err = {0};
    kvlm_batch big = {46, ids, NULL, NULL, NULL}; /* more than budget - sinks */
    assert_int_equal(kvlm_decode(s, &big, &err), KVLM_ERANGE);
    assert_non_null(strstr(err.msg, "feed at most 44"));
    kvlm_ctx_free(s);
    kvlm_ctx *none = ctx_with(m, 64, 32, KVLM_EVICT_NONE, KVLM_CACHE_F32);
    kvlm_batch b = {32, ids, NULL, NULL, NULL}, one = {1, ids, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(none, &b, &err), KVLM_OK);
    assert_int_equal(kvlm_decode(none, &one, &err), KVLM_ERANGE);
    assert_non_null(strstr(err.msg, "KV budget of 32"));
    kvlm_ctx_free(none);
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 64;
    cp.kv_budget = 65;
    assert_null(kvlm_ctx_create(m, &cp, &err));
    cp.kv_budget = 4;
    cp.kv_evict = KVLM_EVICT_SINKS;
    assert_null(kvlm_ctx_create(m, &cp, &err)); /* 4 sinks fill a budget of 4 */
    cp.kv_evict = 7;
    assert_null(kvlm_ctx_create(m, &cp, &err));
    cp.kv_budget = 32;
    cp.kv_evict = KVLM_EVICT_WINDOW;
    cp.no_kv_cache = true;
    assert_null(kvlm_ctx_create(m, &cp, &err));
    assert_int_equal(kvlm_evict_from_name("sinks"), KVLM_EVICT_SINKS);
    assert_int_equal(kvlm_evict_from_name("lru"), -1);
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_policies),         cmocka_unit_test(test_compact_shared),
        cmocka_unit_test(test_compact_alone),    cmocka_unit_test(test_randomized),
        cmocka_unit_test(test_h2o_weights),      cmocka_unit_test(test_big_budget_is_none),
        cmocka_unit_test(test_evicted_equals_fresh), cmocka_unit_test(test_nope_rekey), cmocka_unit_test(test_limits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
