/* tests/test_embed: embeddings through the library and the scheduler, on
 * random-weight models kvlm_model_synth writes: many inputs in one request,
 * and many requests at once beside generation requests, each give what the
 * input gives alone (kvlm_embed); every block is free afterwards; a pool
 * too small for them all makes them wait, not differ; a batch asking for
 * both logits and hidden states gives what it gives asking for each; an encoder's inputs batched equal them alone;
 * bad requests are refused. (The values themselves are checked against the
 * NumPy reference by tests/cli_embed.sh.) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "kvlm.h"

enum { MAXIN = 24, DIM = 64, MAXTOK = 48 };

typedef struct {
    float vec[MAXIN][MAXTOK * DIM];
    int n_vec[MAXIN], finish[MAXIN], prompt_tokens[MAXIN], n_final;
} got_t;

static bool collect(void *user, const kvlm_sched_event *ev) {
    got_t *g = user;
    if (ev->index < 0 || ev->index >= MAXIN || ev->token != -1 || !ev->finish) return true;
    g->finish[ev->index] = ev->finish;
    g->prompt_tokens[ev->index] = ev->prompt_tokens;
    if (ev->embedding && ev->n_embd <= MAXTOK * DIM) {
        memcpy(g->vec[ev->index], ev->embedding, (size_t)ev->n_embd * sizeof(float));
        g->n_vec[ev->index] = ev->n_embd;
    }
    g->n_final++;
    return true;
}

static kvlm_model *synth(kvlm_arch arch, int pooling_plus1) {
    kvlm_synth_params p = {0};
    p.arch = arch;
    p.dim = DIM;
    p.hidden_dim = 128;
    p.n_layers = 2;
    p.n_heads = 4;
    p.n_kv_heads = arch == KVLM_ARCH_LLAMA ? 2 : 4;
    p.vocab_size = 300;
    p.n_ctx = 64;
    p.type = 0;
    p.seed = 7;
    p.pooling_plus1 = pooling_plus1;
    const char *path = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&p, path, &err)) fail_msg("synth: %s", err.msg);
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("load: %s", err.msg);
    return m;
}

static kvlm_ctx *make_ctx(kvlm_model *m, int n_seq, int kv_blocks) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_threads = 2;
    cp.n_ctx = 64;
    cp.n_seq_max = n_seq;
    cp.block_size = 16;
    cp.kv_blocks = kv_blocks;
    cp.cache_type_k = cp.cache_type_v = KVLM_CACHE_F32;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) fail_msg("ctx: %s", err.msg);
    return ctx;
}

/* input i: 5..44 tokens, distinct, inside the vocabulary, a shared prefix of 16 for even i */
static int make_input(int i, int32_t *t) {
    int n = 5 + (i * 7) % 40;
    for (int k = 0; k < n; k++) t[k] = (int32_t)(i % 2 == 0 && k < 16 ? 10 + k : 3 + (i * 31 + k * 17) % 290);
    return n;
}

static void expect_close(const float *got, const float *want, int n, const char *what, int i) {
    double e = tu_max_rel_diff(got, want, n, 1e-3);
    if (!(e <= 1e-5)) fail_msg("%s: input %d differs from it alone by %g", what, i, e);
}

static int used_blocks(kvlm_ctx *ctx) {
    kvlm_kv_stats st;
    kvlm_kv_stats_get(ctx, &st);
    return st.used;
}

/* Batched through the scheduler (n_seq sequences, kv_blocks of pool) == alone, for a pooling. */
static void batched_equals_alone(kvlm_model *m, int pooling, int n_seq, int kv_blocks, int batch_tokens, bool with_gen) {
    int R = tu_quick() ? 10 : MAXIN;
    static int32_t in[MAXIN][MAXTOK];
    int n_in[MAXIN];
    static float alone[MAXIN][MAXTOK * DIM];
    int n_alone[MAXIN];
    kvlm_embed_params ep = kvlm_embed_default_params();
    ep.pooling = pooling;
    kvlm_ctx *one = make_ctx(m, 1, 0);
    kvlm_error err = {0};
    for (int i = 0; i < R; i++) {
        n_in[i] = make_input(i, in[i]);
        n_alone[i] = kvlm_embed(one, 0, in[i], n_in[i], &ep, alone[i], MAXTOK * DIM, &err);
        if (n_alone[i] <= 0) fail_msg("kvlm_embed: %s", err.msg);
        assert_int_equal(kvlm_seq_n_past(one, 0), 0);
    }
    kvlm_ctx_free(one);

    kvlm_ctx *ctx = make_ctx(m, n_seq, kv_blocks);
    int used0 = used_blocks(ctx);
    kvlm_sched_params sp = {.batch_tokens = batch_tokens};
    kvlm_sched *s = kvlm_sched_create(ctx, &sp, &err);
    if (!s) fail_msg("sched: %s", err.msg);
    static got_t g1, g2[4];
    memset(&g1, 0, sizeof g1);
    memset(g2, 0, sizeof g2);
    /* one request holding half the inputs, then the rest as requests of their own, and
     * generation requests between them */
    const int32_t *ptr[MAXIN];
    int half = R / 2;
    for (int i = 0; i < half; i++) ptr[i] = in[i];
    assert_true(kvlm_sched_submit_embed(s, ptr, n_in, half, &ep, collect, &g1, &err) > 0);
    tu_sched_result gen[2];
    memset(gen, 0, sizeof gen);
    if (with_gen && !kvlm_model_is_encoder(m))
        for (int k = 0; k < 2; k++) {
            kvlm_request_params rp = tu_greedy_params(kv_blocks ? 40 : 6);
            assert_true(kvlm_sched_submit(s, in[k + 1], n_in[k + 1], &rp, tu_sched_collect, &gen[k], &err) > 0);
        }
    int per = (R - half + 3) / 4;
    for (int k = 0; k < 4; k++) {
        int lo = half + k * per, hi = lo + per < R ? lo + per : R;
        if (lo >= hi) continue;
        for (int i = lo; i < hi; i++) ptr[i - lo] = in[i];
        assert_true(kvlm_sched_submit_embed(s, ptr, n_in + lo, hi - lo, &ep, collect, &g2[k], &err) > 0);
    }
    for (int steps = 0; kvlm_sched_step(s) > 0; steps++) assert_true(steps < 10000);
    kvlm_sched_stats st;
    kvlm_sched_stats_get(s, &st);
    assert_int_equal(g1.n_final, half);
    for (int i = 0; i < R; i++) {
        got_t *g = i < half ? &g1 : &g2[(i - half) / per];
        int k = i < half ? i : (i - half) % per;
        if (g->finish[k] != KVLM_FINISH_STOP) fail_msg("input %d ended with finish %d", i, g->finish[k]);
        assert_int_equal(g->n_vec[k], n_alone[i]);
        assert_int_equal(g->prompt_tokens[k], n_in[i]);
        expect_close(g->vec[k], alone[i], n_alone[i], "batched", i);
    }
    assert_int_equal((int)st.embeddings, R);
    if (with_gen && !kvlm_model_is_encoder(m))
        for (int k = 0; k < 2; k++) assert_int_equal(gen[k].n_final, 1);
    printf("  pooling %s, %d inputs, %d at once, %d blocks: %llu steps, %llu preemptions (%llu swapped)\n",
           kvlm_pooling_name(pooling), R, n_seq, kv_blocks, (unsigned long long)st.steps,
           (unsigned long long)st.preemptions, (unsigned long long)st.swaps_out);
    kvlm_sched_free(s);
    assert_int_equal(used_blocks(ctx), used0); /* every block back in the pool */
    kvlm_ctx_free(ctx);
}

static void test_decoder_batched(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_LLAMA, 0);
    batched_equals_alone(m, KVLM_POOLING_LAST, 8, 0, 64, true);
    batched_equals_alone(m, KVLM_POOLING_MEAN, 8, 0, 24, true);
    batched_equals_alone(m, KVLM_POOLING_NONE, 4, 0, 512, false);
    batched_equals_alone(m, KVLM_POOLING_CLS, 6, 0, 32, false);
    kvlm_model_free(m);
}

/* A pool of 6 blocks for 8 inputs of up to 3 blocks each beside two generation
 * requests growing to 4: inputs wait for room (admission counts what each holds). */
static void test_decoder_small_pool(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_LLAMA, 0);
    batched_equals_alone(m, KVLM_POOLING_MEAN, 8, 6, 40, true);
    batched_equals_alone(m, KVLM_POOLING_LAST, 8, 6, 40, true);
    kvlm_model_free(m);
}

static void test_encoder_batched(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_BERT, 0);
    batched_equals_alone(m, KVLM_POOLING_MEAN, 8, 0, 64, false);
    batched_equals_alone(m, KVLM_POOLING_CLS, 3, 0, 64, false);
    batched_equals_alone(m, KVLM_POOLING_MEAN, 8, 0, 16, false); /* inputs past a step's budget: each alone */
    kvlm_model_free(m);
    m = synth(KVLM_ARCH_NOMIC_BERT, 0);
    batched_equals_alone(m, KVLM_POOLING_MEAN, 8, 0, 64, false);
    kvlm_model_free(m);
}

/* logits and hidden states in one batch == each asked alone; no logits: the
 * hidden states still come */
static void test_outputs(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_LLAMA, 0);
    int32_t t[MAXTOK];
    int n = make_input(3, t);
    int8_t fl[MAXTOK];
    float hs[MAXTOK * DIM], lg[4][300];
    kvlm_error err = {0};
    for (int mode = 0; mode < 3; mode++) {
        kvlm_ctx *ctx = make_ctx(m, 1, 0);
        for (int i = 0; i < n; i++)
            fl[i] = mode == 0 ? KVLM_OUTPUT_BOTH : mode == 1 ? KVLM_OUTPUT_EMBD : KVLM_OUTPUT_LOGITS;
        kvlm_batch b = {n, t, NULL, fl, NULL};
        assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK);
        if (mode < 2) {
            for (int i = 0; i < n; i++) {
                const float *h = kvlm_get_embeddings(ctx, i);
                assert_non_null(h);
                if (mode == 0) memcpy(hs + (size_t)i * DIM, h, DIM * sizeof(float));
                else expect_close(h, hs + (size_t)i * DIM, DIM, "hidden state", i);
            }
            assert_null(kvlm_get_embeddings(ctx, n));
        }
        if (mode == 1) assert_null(kvlm_get_logits(ctx, 0));
        else {
            const float *l = kvlm_get_logits(ctx, n - 1);
            assert_non_null(l);
            if (mode == 0) memcpy(lg[0], l, sizeof lg[0]);
            else expect_close(l, lg[0], 300, "logits", n - 1);
        }
        kvlm_ctx_free(ctx);
    }
    kvlm_model_free(m);
}

static void test_refused(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_LLAMA, 0);
    kvlm_ctx *ctx = make_ctx(m, 2, 0);
    kvlm_error err = {0};
    kvlm_sched *s = kvlm_sched_create(ctx, NULL, &err);
    got_t *g = calloc(1, sizeof *g);
    int32_t t[80];
    for (int i = 0; i < 80; i++) t[i] = 5 + i;
    const int32_t *p1[1] = {t};
    int n1 = 10, n0 = 0, nlong = 70;
    kvlm_embed_params ep = kvlm_embed_default_params();
    ep.pooling = KVLM_POOLING_RANK;
    assert_int_equal(kvlm_sched_submit_embed(s, p1, &n1, 1, &ep, collect, g, &err), 0);
    assert_int_equal(err.code, KVLM_EUNSUPPORTED);
    ep.pooling = KVLM_POOLING_MEAN;
    assert_int_equal(kvlm_sched_submit_embed(s, p1, &n0, 1, &ep, collect, g, &err), 0);
    assert_int_equal(kvlm_sched_submit_embed(s, p1, &nlong, 1, &ep, collect, g, &err), 0);
    assert_int_equal(err.code, KVLM_ERANGE);
    ep.dims = DIM + 1;
    assert_int_equal(kvlm_sched_submit_embed(s, p1, &n1, 1, &ep, collect, g, &err), 0);
    ep.dims = 8; /* Matryoshka: the first 8 values, normalised */
    assert_true(kvlm_sched_submit_embed(s, p1, &n1, 1, &ep, collect, g, &err) > 0);
    while (kvlm_sched_step(s) > 0) {}
    assert_int_equal(g->n_vec[0], 8);
    double ss = 0;
    for (int i = 0; i < 8; i++) ss += (double)g->vec[0][i] * g->vec[0][i];
    assert_true(fabs(ss - 1) < 1e-5);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
    /* an encoder: no generation, no logits */
    m = synth(KVLM_ARCH_BERT, 0);
    ctx = make_ctx(m, 2, 0);
    s = kvlm_sched_create(ctx, NULL, &err);
    kvlm_request_params rp = tu_greedy_params(4);
    assert_int_equal(kvlm_sched_submit(s, t, 10, &rp, tu_sched_collect, g, &err), 0);
    assert_int_equal(err.code, KVLM_EUNSUPPORTED);
    kvlm_batch b = {10, t, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_EINVAL);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
    free(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decoder_batched), cmocka_unit_test(test_decoder_small_pool),
        cmocka_unit_test(test_encoder_batched), cmocka_unit_test(test_outputs), cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
