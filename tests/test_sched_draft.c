/* tests/test_sched_draft: the scheduler speculating with a draft model
 * (kvlm_sched_params.draft_ctx, engine/spec_draft): concurrent greedy
 * requests (some n = 3, some found whole in the prefix index) under a pool
 * small enough to preempt give what their prompt gives alone; with the model itself drafting nearly every draft is
 * kept (so the batched catch-up and rounds propose for the right sequence);
 * a draft pool far too small costs drafts, never requests; finished and
 * cancelled requests leave the draft context empty; sampling runs; a draft
 * of another vocabulary, an evicting draft context and one with fewer
 * sequences are refused. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "kvlm.h"

enum { MAXGEN = 64, MAXN = 3 };
typedef struct {
    int32_t out[MAXN][MAXGEN];
    int n_out[MAXN], finish[MAXN], n_final;
} result;

static bool on_event(void *user, const kvlm_sched_event *ev) {
    result *r = user;
    if (ev->finish) {
        r->finish[ev->index] = ev->finish;
        r->n_final++;
        return true;
    }
    assert_true(r->n_out[ev->index] < MAXGEN);
    r->out[ev->index][r->n_out[ev->index]++] = ev->token;
    return true;
}

static kvlm_model *load(const char *path) {
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("load %s: %s", path, err.msg);
    return m;
}

static kvlm_ctx *make_ctx(const kvlm_model *m, int n_seq, int kv_blocks, int evict) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_threads = 2;
    cp.n_ctx = 256;
    cp.n_seq_max = n_seq;
    cp.block_size = 16;
    cp.kv_blocks = kv_blocks;
    cp.n_batch = 256;
    cp.no_kv_swap = true;
    if (evict) {
        cp.kv_evict = evict;
        cp.kv_budget = 128;
    }
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) fail_msg("ctx: %s", err.msg);
    return ctx;
}

static int make_prompt(const kvlm_model *m, int i, int32_t *toks, int cap) {
    static const char *subj[] = {"Lily", "Tom", "A little dog", "The old man", "Sue", "Max", "A bird", "Ben"};
    static const char *verb[] = {"went to the park", "found a ball", "was very sad", "liked to play"};
    char text[256];
    snprintf(text, sizeof text, "%s %s. %s", subj[i % 8], verb[(i / 8) % 4], i % 3 ? "One day" : "Then");
    kvlm_error err = {0};
    int n = kvlm_tokenize(m, text, strlen(text), true, false, toks, cap, &err);
    assert_true(n > 0 && n <= cap);
    return n;
}

/* The reference: the prompt alone through kvlm_decode, greedy. */
static int greedy_alone(const kvlm_model *m, const int32_t *prompt, int n, int max_tokens, int32_t *out) {
    kvlm_ctx *ctx = make_ctx(m, 1, 0, 0);
    int n_out = tu_greedy_alone(ctx, prompt, n, max_tokens, out);
    kvlm_ctx_free(ctx);
    return n_out;
}

/* R requests (every fifth n = 3) in a target pool of 40 blocks (quick: 20),
 * drafted by dm in a pool of draft_blocks; outputs against greedy_alone. */
static void draft_concurrent(const kvlm_model *m, const kvlm_model *dm, int draft_blocks, int K, bool preempts,
                             kvlm_sched_stats *st) {
    int R = tu_quick() ? 12 : 32, max_tokens = tu_quick() ? 24 : 48;
    kvlm_ctx *ctx = make_ctx(m, 32, tu_quick() ? 20 : 40, 0), *dctx = make_ctx(dm, 32, draft_blocks, 0);
    kvlm_sched_params sp = {.batch_tokens = 64, .max_seqs = 32, .spec_mode = KVLM_SPEC_DRAFT, .spec_n_draft = K,
                            .draft_ctx = dctx};
    kvlm_error err = {0};
    kvlm_sched *s = kvlm_sched_create(ctx, &sp, &err);
    if (!s) fail_msg("sched: %s", err.msg);
    result *res = calloc((size_t)R, sizeof *res);
    int32_t prompts[32][64];
    int n_prompt[32];
    for (int i = 0; i < R; i++) {
        n_prompt[i] = make_prompt(m, i, prompts[i], 64);
        kvlm_request_params p = tu_greedy_params(max_tokens);
        p.n = i % 5 == 2 ? 3 : 1;
        assert_true(kvlm_sched_submit(s, prompts[i], n_prompt[i], &p, on_event, &res[i], &err) > 0);
    }
    int steps = 0;
    while (kvlm_sched_step(s) > 0) assert_true(++steps < 100000);
    kvlm_sched_stats_get(s, st);
    kvlm_kv_stats dk;
    kvlm_kv_stats_get(dctx, &dk);
    printf("  draft pool of %d blocks, K = %d: %d requests in %d steps, %llu preemptions, %llu/%llu drafts kept, "
           "%llu draft steps, %llu draft-context failures\n", draft_blocks, K, R, steps,
           (unsigned long long)st->preemptions, (unsigned long long)st->spec_accepted,
           (unsigned long long)st->spec_drafted, (unsigned long long)st->spec_draft_steps,
           (unsigned long long)st->spec_draft_failures);
    if (preempts) assert_true(st->preemptions > 0);
    assert_int_equal(st->kv.used, 0);
    assert_int_equal(dk.used, 0); /* every finished request's draft sequence went */
    for (int i = 0; i < R; i++) {
        int32_t want[MAXGEN];
        int n_want = greedy_alone(m, prompts[i], n_prompt[i], max_tokens, want);
        int n = i % 5 == 2 ? 3 : 1;
        assert_int_equal(res[i].n_final, n);
        for (int k = 0; k < n; k++) {
            assert_int_equal(res[i].finish[k], n_want < max_tokens ? KVLM_FINISH_STOP : KVLM_FINISH_LENGTH);
            assert_int_equal(res[i].n_out[k], n_want);
            assert_memory_equal(res[i].out[k], want, (size_t)n_want * sizeof(int32_t));
        }
    }
    free(res);
    kvlm_sched_free(s);
    kvlm_ctx_free(dctx);
    kvlm_ctx_free(ctx);
}

static void test_draft_equals_alone(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path);
    kvlm_sched_stats st;
    /* the model drafting for itself: every draft is the target's pick (up to
     * float rounding between batch shapes) when it is proposed for the right
     * sequence from the right cache */
    draft_concurrent(m, m, 400, 4, true, &st);
    assert_true(st.spec_drafted > 0 && st.spec_draft_steps > 0);
    assert_true(st.spec_accepted * 100 >= st.spec_drafted * 95);
    assert_int_equal(st.spec_draft_failures, 0);
    draft_concurrent(m, m, 400, 16, false, &st); /* fewer steps: the pool may suffice */
    assert_true(st.spec_accepted * 100 >= st.spec_drafted * 95);
    /* a draft pool of 6 blocks holds one or two sequences: its decodes fail
     * often, the requests go on with fewer drafts */
    draft_concurrent(m, m, 6, 4, true, &st);
    assert_true(st.spec_draft_failures > 0);
    assert_true(st.spec_accepted > 0);
    kvlm_model_free(m);
}

/* A q4_0 copy drafting (kvlm_model_save_gguf, as `kvlm convert` makes it): the same outputs. */
static void test_draft_q4_0_copy(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path);
    const char *q = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_save_gguf(m, q, kvlm_type_from_name("q4_0"), &err)) fail_msg("convert: %s", err.msg);
    kvlm_model *dm = load(q);
    kvlm_sched_stats st;
    draft_concurrent(m, dm, 60, 4, true, &st);
    assert_true(st.spec_accepted * 2 > st.spec_drafted); /* measured: about 70% */
    kvlm_model_free(dm);
    kvlm_model_free(m);
}

/* Cancelled requests free their draft sequences; sampling requests run to their end. */
static void test_draft_cancel_and_sample(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path);
    kvlm_ctx *ctx = make_ctx(m, 8, 0, 0), *dctx = make_ctx(m, 8, 0, 0);
    kvlm_sched_params sp = {.spec_mode = KVLM_SPEC_DRAFT, .draft_ctx = dctx};
    kvlm_error err = {0};
    kvlm_sched *s = kvlm_sched_create(ctx, &sp, &err);
    if (!s) fail_msg("sched: %s", err.msg);
    int32_t prompt[64];
    int n = make_prompt(m, 3, prompt, 64);
    result a[4];
    memset(a, 0, sizeof a);
    uint64_t id[4];
    kvlm_request_params p = tu_greedy_params(60);
    for (int i = 0; i < 4; i++) id[i] = kvlm_sched_submit(s, prompt, n, &p, on_event, &a[i], &err);
    for (int i = 0; i < 4; i++) kvlm_sched_step(s);
    kvlm_kv_stats dk;
    kvlm_kv_stats_get(dctx, &dk);
    assert_true(dk.used > 0);
    for (int i = 0; i < 4; i++) kvlm_sched_cancel(s, id[i]);
    assert_int_equal(kvlm_sched_step(s), 0);
    for (int i = 0; i < 4; i++) assert_int_equal(a[i].finish[0], KVLM_FINISH_CANCELLED);
    kvlm_kv_stats_get(dctx, &dk);
    assert_int_equal(dk.used, 0);
    /* sampling: each of n = 3 completions runs to max_tokens or an end token;
     * the model drafting for itself samples its drafts from the target's own
     * distribution q = p, so min(1, p/q) keeps (nearly) all of them, where
     * taking the draft's argmax as certain would keep only p(argmax) */
    kvlm_sched_stats st0;
    kvlm_sched_stats_get(s, &st0);
    result b;
    memset(&b, 0, sizeof b);
    p = tu_greedy_params(40);
    p.sampling.temperature = 0.9f;
    p.sampling.seed = 7;
    p.n = 3;
    assert_true(kvlm_sched_submit(s, prompt, n, &p, on_event, &b, &err) > 0);
    int steps = 0;
    while (kvlm_sched_step(s) > 0) assert_true(++steps < 10000);
    assert_int_equal(b.n_final, 3);
    for (int k = 0; k < 3; k++) {
        assert_true(b.finish[k] == KVLM_FINISH_LENGTH || b.finish[k] == KVLM_FINISH_STOP);
        assert_true(b.n_out[k] > 0 && b.n_out[k] <= 40);
        if (b.finish[k] == KVLM_FINISH_LENGTH) assert_int_equal(b.n_out[k], 40);
    }
    kvlm_sched_stats st;
    kvlm_sched_stats_get(s, &st);
    uint64_t drafted = st.spec_drafted - st0.spec_drafted, kept = st.spec_accepted - st0.spec_accepted;
    printf("  sampling, the model drafting for itself: %llu/%llu drafts kept\n", (unsigned long long)kept,
           (unsigned long long)drafted);
    assert_true(drafted > 0);
    assert_true(kept * 100 >= drafted * 97);
    kvlm_kv_stats_get(dctx, &dk);
    assert_int_equal(dk.used, 0);
    kvlm_sched_free(s);
    kvlm_ctx_free(dctx);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

static void test_draft_refused(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path);
    kvlm_synth_params syp = {0};
    syp.arch = KVLM_ARCH_LLAMA;
    syp.dim = 64;
    syp.hidden_dim = 144;
    syp.n_layers = 1;
    syp.n_heads = 4;
    syp.n_kv_heads = 4;
    syp.vocab_size = 300;
    syp.n_ctx = 256;
    syp.type = kvlm_type_from_name("f32");
    syp.seed = 3;
    const char *op = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&syp, op, &err)) fail_msg("synth: %s", err.msg);
    kvlm_model *om = load(op);
    kvlm_ctx *ctx = make_ctx(m, 4, 0, 0), *oc = make_ctx(om, 4, 0, 0);
    kvlm_sched_params sp = {.spec_mode = KVLM_SPEC_DRAFT, .draft_ctx = oc};
    assert_null(kvlm_sched_create(ctx, &sp, &err));
    assert_non_null(strstr(err.msg, "vocabulary"));
    printf("  refused: %s\n", err.msg);
    kvlm_ctx *ec = make_ctx(m, 4, 0, KVLM_EVICT_SINKS), *small = make_ctx(m, 2, 0, 0);
    sp.draft_ctx = ec;
    assert_null(kvlm_sched_create(ctx, &sp, &err));
    assert_non_null(strstr(err.msg, "evict"));
    printf("  refused: %s\n", err.msg);
    sp.draft_ctx = small;
    assert_null(kvlm_sched_create(ctx, &sp, &err));
    printf("  refused: %s\n", err.msg);
    sp.draft_ctx = NULL;
    assert_null(kvlm_sched_create(ctx, &sp, &err));
    printf("  refused: %s\n", err.msg);
    kvlm_ctx_free(small);
    kvlm_ctx_free(ec);
    kvlm_ctx_free(oc);
    kvlm_ctx_free(ctx);
    kvlm_model_free(om);
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_draft_equals_alone),
        cmocka_unit_test(test_draft_q4_0_copy),
        cmocka_unit_test(test_draft_cancel_and_sample),
        cmocka_unit_test(test_draft_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
