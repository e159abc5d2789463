/* tests/test_sched_params: what the scheduler does for the request fields
 * vLLM's and llama-server's clients send: prompt logprobs (equal to a
 * log-softmax of kvlm_decode's logits, over prefill chunks, never from the
 * prefix cache), cache_prompt false (no prefix reuse), stop token ids (the
 * token given, then the end), and a prefill's progress (running, tokens done
 * of total) published before the step's forward pass ends. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "kvlm.h"

static kvlm_model *load_stories(void) {
    const char *path = tu_model_path("stories260K.gguf");
    if (!path) return NULL;
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("load: %s", err.msg);
    return m;
}

static kvlm_ctx *make_ctx(kvlm_model *m, int n_batch) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_threads = 2;
    cp.n_ctx = 256;
    cp.n_seq_max = 4;
    cp.block_size = 16;
    cp.n_batch = n_batch;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) fail_msg("ctx: %s", err.msg);
    return ctx;
}

static int long_prompt(kvlm_model *m, int32_t *toks, int cap) {
    const char *text = "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                       "park with her friend Tom and their big red ball.";
    kvlm_error err = {0};
    int n = kvlm_tokenize(m, text, strlen(text), true, false, toks, cap, &err);
    assert_true(n > 32 && n <= cap);
    return n;
}

typedef struct {
    int n_prompt_ev, n_gen, finish;
    int32_t pos[128], tok[128], gen[128];
    float lp[128], top_lp[128][3];
    int32_t top_tok[128][3];
    int n_top[128];
    int cached;
    bool order_ok; /* prompt events before generated tokens, positions rising */
} collected;

static bool collect(void *user, const kvlm_sched_event *ev) {
    collected *c = user;
    c->cached = ev->cached_tokens;
    if (ev->finish) {
        c->finish = ev->finish;
        return true;
    }
    if (ev->prompt_token) {
        int k = c->n_prompt_ev++;
        c->order_ok &= c->n_gen == 0 && (k == 0 ? ev->pos == 1 : ev->pos == c->pos[k - 1] + 1);
        c->pos[k] = ev->pos;
        c->tok[k] = ev->token;
        c->lp[k] = ev->logprob;
        c->n_top[k] = ev->n_top;
        for (int i = 0; i < ev->n_top && i < 3; i++) {
            c->top_tok[k][i] = ev->top_tokens[i];
            c->top_lp[k][i] = ev->top_logprobs[i];
        }
        return true;
    }
    if (c->n_gen < 128) c->gen[c->n_gen] = ev->token;
    c->n_gen++;
    return true;
}

static void run(kvlm_sched *s) {
    while (kvlm_sched_step(s) > 0) {}
}

static void test_prompt_logprobs(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    TU_REQUIRE(m);
    int32_t prompt[128];
    int n = long_prompt(m, prompt, 128);
    int V = kvlm_vocab_size(m);
    /* the reference: every position's logits from one kvlm_decode */
    kvlm_ctx *ref = make_ctx(m, 256);
    int8_t *want = malloc((size_t)n);
    memset(want, 1, (size_t)n);
    kvlm_batch b = {.n_tokens = n, .tokens = prompt, .logits = want};
    kvlm_error err = {0};
    assert_int_equal(kvlm_decode(ref, &b, &err), KVLM_OK);
    /* chunks of 8 tokens a step; a first request puts the prompt in the prefix cache */
    kvlm_ctx *ctx = make_ctx(m, 8);
    kvlm_sched_params sp = {.batch_tokens = 8};
    kvlm_sched *s = kvlm_sched_create(ctx, &sp, &err);
    assert_non_null(s);
    kvlm_request_params rp = tu_greedy_params(4);
    collected first = {.order_ok = true}, c = {.order_ok = true};
    assert_true(kvlm_sched_submit(s, prompt, n, &rp, collect, &first, &err) > 0);
    run(s);
    rp.prompt_logprobs = true;
    rp.prompt_top_logprobs = 3;
    assert_true(kvlm_sched_submit(s, prompt, n, &rp, collect, &c, &err) > 0);
    run(s);
    assert_int_equal(c.cached, 0); /* not from the cache: it gives no logits */
    assert_int_equal(c.n_prompt_ev, n - 1);
    assert_true(c.order_ok);
    assert_int_equal(c.n_gen, 4);
    assert_memory_equal(c.gen, first.gen, 4 * sizeof(int32_t));
    double worst = 0;
    for (int k = 0; k < n - 1; k++) {
        const float *row = kvlm_get_logits(ref, k); /* after token k: predicts token k + 1 */
        double mx = row[0], sum = 0;
        for (int v = 1; v < V; v++) mx = fmax(mx, row[v]);
        for (int v = 0; v < V; v++) sum += exp(row[v] - mx);
        double lse = mx + log(sum);
        assert_int_equal(c.pos[k], k + 1);
        assert_int_equal(c.tok[k], prompt[k + 1]);
        worst = tu_worse(worst, fabs(c.lp[k] - (row[prompt[k + 1]] - lse)));
        assert_int_equal(c.n_top[k], 3);
        for (int i = 0; i < 3; i++) {
            worst = tu_worse(worst, fabs(c.top_lp[k][i] - (row[c.top_tok[k][i]] - lse)));
            for (int v = 0; v < V; v++) /* none left out is likelier */
                assert_true(row[v] - lse <= c.top_lp[k][2] + 1e-4 || v == c.top_tok[k][0] || v == c.top_tok[k][1] ||
                            v == c.top_tok[k][2]);
        }
    }
    printf("  %d prompt logprobs, worst difference from kvlm_decode's log-softmax %.3g\n", n - 1, worst);
    assert_true(worst < 1e-3);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_ctx_free(ref);
    free(want);
    kvlm_model_free(m);
}

static void test_no_prefix_reuse_and_stop_ids(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    TU_REQUIRE(m);
    int32_t prompt[128];
    int n = long_prompt(m, prompt, 128);
    kvlm_ctx *ctx = make_ctx(m, 64);
    kvlm_error err = {0};
    kvlm_sched *s = kvlm_sched_create(ctx, NULL, &err);
    kvlm_request_params rp = tu_greedy_params(12);
    collected a = {0}, b = {0}, c = {0};
    assert_true(kvlm_sched_submit(s, prompt, n, &rp, collect, &a, &err) > 0);
    run(s);
    assert_int_equal(a.n_gen, 12);
    assert_true(kvlm_sched_submit(s, prompt, n, &rp, collect, &b, &err) > 0);
    run(s);
    assert_true(b.cached >= 16); /* the prefix cache at work */
    rp.no_prefix_reuse = true;
    /* the first token of the text that does not occur before it ends it */
    int at = 3;
    while (at < 12) {
        bool earlier = false;
        for (int i = 0; i < at; i++) earlier |= a.gen[i] == a.gen[at];
        if (!earlier) break;
        at++;
    }
    assert_true(at < 12);
    int32_t stop = a.gen[at];
    rp.sampling.stop_ids = &stop;
    rp.sampling.n_stop_ids = 1;
    assert_true(kvlm_sched_submit(s, prompt, n, &rp, collect, &c, &err) > 0);
    stop = -5; /* the scheduler holds its own copy */
    run(s);
    assert_int_equal(c.cached, 0);
    assert_int_equal(c.n_gen, at + 1); /* the stop token is given, then the end */
    assert_memory_equal(c.gen, a.gen, (size_t)(at + 1) * sizeof(int32_t));
    assert_int_equal(c.finish, KVLM_FINISH_STOP);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

/* A prefill of 8 tokens a step: between steps the request is running (not
 * waiting, not absent), in state prefill, with its tokens done of total. */
static void test_prefill_progress(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    TU_REQUIRE(m);
    int32_t prompt[128];
    int n = long_prompt(m, prompt, 128);
    kvlm_ctx *ctx = make_ctx(m, 8);
    kvlm_sched_params sp = {.batch_tokens = 8};
    kvlm_error err = {0};
    kvlm_sched *s = kvlm_sched_create(ctx, &sp, &err);
    kvlm_request_params rp = tu_greedy_params(2);
    collected c = {0};
    assert_true(kvlm_sched_submit(s, prompt, n, &rp, collect, &c, &err) > 0);
    kvlm_sched_stats st;
    kvlm_sched_stats_get(s, &st);
    assert_int_equal(st.waiting, 1);
    for (int step = 1; step * 8 < n; step++) {
        kvlm_sched_step(s);
        kvlm_sched_stats_get(s, &st);
        kvlm_sched_req_info info[2];
        assert_int_equal(kvlm_sched_requests(s, info, 2), 1);
        assert_int_equal(st.running, 1);
        assert_int_equal(st.waiting, 0);
        assert_int_equal(info[0].state, 1);
        assert_int_equal(info[0].prefill_done, step * 8);
        assert_int_equal(info[0].prefill_total, n);
    }
    run(s);
    assert_int_equal(c.n_gen, 2);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prompt_logprobs),
        cmocka_unit_test(test_no_prefix_reuse_and_stop_ids),
        cmocka_unit_test(test_prefill_progress),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
