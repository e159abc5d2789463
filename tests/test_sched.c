/* tests/test_sched: the scheduler: 32 concurrent greedy requests (some n = 3) under a pool
 * too small for all of them (so some are preempted, recomputed or swapped) each give
 * what their prompt gives alone; cancel frees blocks at once; n > 1 forks
 * share the prompt's blocks; logprobs; under sinks eviction, requests run far past
 * the context within the KV budget and give what kvlm_decode gives alone;
 * a completion the pool cannot hold ends with KV_FULL; chat templates render
 * the known formats. */
#define _XOPEN_SOURCE 700
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "kvlm.h"

enum { MAXGEN = TU_SCHED_MAXGEN };
typedef tu_sched_result result;

static kvlm_model *load_stories(void) {
    const char *path = tu_model_path("stories260K.gguf");
    if (!path) return NULL;
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("load: %s", err.msg);
    return m;
}

static bool g_no_swap; /* make_ctx: preemption only by recompute */
static int g_cache_k = KVLM_CACHE_F16; /* make_ctx: the keys' cache type */

static kvlm_ctx *make_ctx(kvlm_model *m, int n_seq, int kv_blocks) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.no_kv_swap = g_no_swap;
    cp.cache_type_k = g_cache_k;
    cp.n_threads = 2;
    cp.n_ctx = 256;
    cp.n_seq_max = n_seq;
    cp.block_size = 16;
    cp.kv_blocks = kv_blocks;
    cp.n_batch = 256;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) fail_msg("ctx: %s", err.msg);
    return ctx;
}

static int make_prompt(kvlm_model *m, int i, int32_t *toks, int cap) {
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
static int greedy_alone(kvlm_model *m, const int32_t *prompt, int n, int max_tokens, int32_t *out) {
    kvlm_ctx *ctx = make_ctx(m, 1, 0);
    int n_out = tu_greedy_alone(ctx, prompt, n, max_tokens, out);
    kvlm_ctx_free(ctx);
    return n_out;
}

static void print_preempt(const kvlm_sched_stats *st) {
    printf("  preemptions %llu: %llu swapped out, %llu swapped in, %llu recomputed; %llu bytes swapped\n",
           (unsigned long long)st->preemptions, (unsigned long long)st->swaps_out, (unsigned long long)st->swaps_in,
           (unsigned long long)st->recomputes, (unsigned long long)st->swap_bytes);
}

static void concurrent_equals_alone(bool swap) {
    g_no_swap = !swap;
    kvlm_model *m = load_stories();
    TU_REQUIRE(m);
    int R = tu_quick() ? 12 : 32, max_tokens = tu_quick() ? 24 : 48;
    /* 40 (quick: 20) blocks of 16 tokens: far fewer than the requests of ~40-60 tokens need */
    kvlm_ctx *ctx = make_ctx(m, 32, tu_quick() ? 20 : 40);
    kvlm_sched_params sp = {.batch_tokens = 64, .max_seqs = 32};
    kvlm_error err = {0};
    kvlm_sched *s = kvlm_sched_create(ctx, &sp, &err);
    assert_non_null(s);
    result *res = calloc((size_t)R, sizeof *res);
    int32_t prompts[32][64];
    int n_prompt[32];
    for (int i = 0; i < R; i++) {
        n_prompt[i] = make_prompt(m, i, prompts[i], 64);
        kvlm_request_params p = tu_greedy_params(max_tokens);
        p.logprobs = i % 4 == 0 ? 5 : -1;
        p.n = i % 5 == 2 ? 3 : 1; /* forks, preempted with or without their leader */
        res[i].logprobs_ok = true;
        assert_true(kvlm_sched_submit(s, prompts[i], n_prompt[i], &p, tu_sched_collect, &res[i], &err) > 0);
    }
    int steps = 0;
    while (kvlm_sched_step(s) > 0) assert_true(++steps < 100000);
    kvlm_sched_stats st;
    kvlm_sched_stats_get(s, &st);
    printf("  %d requests in %d steps, %llu preemptions, %llu tokens, %llu prompt tokens of which %llu cached\n", R,
           steps, (unsigned long long)st.preemptions, (unsigned long long)st.generated_tokens,
           (unsigned long long)st.prompt_tokens, (unsigned long long)st.cached_tokens);
    printf("  recompute after preemption found %llu blocks in the prefix index; %llu tokens computed\n",
           (unsigned long long)st.kv.prefix_hits, (unsigned long long)st.kv.tokens_computed);
    print_preempt(&st);
    assert_true(st.preemptions > 0);
    assert_int_equal(st.preemptions, st.swaps_out + st.recomputes);
    if (swap) { /* swap wins by far on this model: every preemption swaps, every swap comes back */
        assert_true(st.swaps_out > 0);
        assert_int_equal(st.swaps_in, st.swaps_out);
        assert_int_equal(st.kv.swap_used, 0);
    } else {
        assert_int_equal(st.swaps_out, 0);
        /* the prompts share no full block: every hit is a preempted sequence taking its blocks back */
        assert_true(st.kv.prefix_hits > 0);
    }
    assert_int_equal(st.kv.used, 0);
    assert_int_equal(st.running + st.waiting, 0);
    for (int i = 0; i < R; i++) {
        int32_t want[MAXGEN];
        int n_want = greedy_alone(m, prompts[i], n_prompt[i], max_tokens, want);
        tu_sched_expect_alone(&res[i], i % 5 == 2 ? 3 : 1, want, n_want, max_tokens);
        assert_true(res[i].logprobs_ok);
    }
    free(res);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
    g_no_swap = false;
}

/* Preemption by recompute (no swap space), then by swap: the same outputs. */
static void test_concurrent_equals_alone(void **state) {
    (void)state;
    concurrent_equals_alone(false);
}
static void test_concurrent_swap(void **state) {
    (void)state;
    concurrent_equals_alone(true);
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f) {
    (void)st, (void)flag, (void)f;
    return remove(p);
}

/* Eight long greedy generations in a pool just above one sequence's need:
 * constant preemption; by swap (the rule picks it here), by recompute (swap
 * space off), with a swap space of two blocks (too small for most victims:
 * some swap, the rest recompute), and with a swap space of one block over a
 * disk tier (victims go to disk and come back); every output equals its
 * prompt alone. With q4_kc keys (the filling block's f16 staging travels with
 * the sequence): by swap. (Not by recompute only: a recomputed q4_kc sequence
 * does not always give the uninterrupted run's tokens, which is what swap fixes.) */
static void swap_tight_pool(int cache_k, int n_modes) {
    g_cache_k = cache_k;
    kvlm_model *m = load_stories();
    TU_REQUIRE(m);
    enum { R = 8 };
    int max_tokens = tu_quick() ? 40 : MAXGEN;
    int32_t prompts[R][64], want[R][MAXGEN];
    int n_prompt[R], n_want[R];
    for (int i = 0; i < R; i++) {
        n_prompt[i] = make_prompt(m, 3 * i + 1, prompts[i], 64);
        n_want[i] = greedy_alone(m, prompts[i], n_prompt[i], max_tokens, want[i]);
    }
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/kvlm-swap-XXXXXX");
    assert_non_null(mkdtemp(dir));
    for (int mode = 0; mode < n_modes; mode++) {
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.cache_type_k = cache_k;
        cp.n_threads = 2;
        cp.n_ctx = 256;
        cp.n_seq_max = R;
        cp.block_size = 16;
        cp.kv_blocks = 7; /* one sequence needs at most (~12 + 64) / 16 + 1 = 6 */
        cp.no_kv_swap = mode == 1;
        kvlm_error err = {0};
        kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
        assert_non_null(ctx);
        if (mode >= 2) { /* a swap space of two blocks; of one, over a disk tier */
            kvlm_kv_stats ks;
            kvlm_kv_stats_get(ctx, &ks);
            kvlm_ctx_free(ctx);
            cp.kv_swap_size = (mode == 2 ? 2 : 1) * ks.block_bytes;
            cp.kv_disk = mode == 3 ? dir : NULL;
            ctx = kvlm_ctx_create(m, &cp, &err);
            assert_non_null(ctx);
        }
        kvlm_sched_params sp = {.batch_tokens = 64, .max_seqs = R};
        kvlm_sched *s = kvlm_sched_create(ctx, &sp, &err);
        assert_non_null(s);
        result *res = calloc(R, sizeof *res);
        for (int i = 0; i < R; i++) {
            kvlm_request_params p = tu_greedy_params(max_tokens);
            assert_true(kvlm_sched_submit(s, prompts[i], n_prompt[i], &p, tu_sched_collect, &res[i], &err) > 0);
        }
        int steps = 0;
        while (kvlm_sched_step(s) > 0) assert_true(++steps < 100000);
        kvlm_sched_stats st;
        kvlm_sched_stats_get(s, &st);
        double copy_rate, prefill_rate;
        kvlm_ctx_preempt_rates(ctx, &copy_rate, &prefill_rate);
        static const char *names[] = {"swap", "no swap space", "swap space of 2 blocks",
                                      "swap space of 1 block over a disk tier"};
        printf("  %s keys, %s, 8 requests in 7 blocks, %d steps; round trip %.2f GB/s, %.0f tokens/s computed\n",
               kvlm_cache_type_name(cache_k), names[mode], steps, copy_rate / 1e9, prefill_rate);
        if (mode == 3)
            printf("  to disk: %llu sequences, %llu lost\n", (unsigned long long)st.kv.swap_tier_out,
                   (unsigned long long)st.kv.swap_tier_lost);
        print_preempt(&st);
        assert_true(st.preemptions > 0);
        assert_int_equal(st.preemptions, st.swaps_out + st.recomputes);
        assert_int_equal(st.swaps_in, st.swaps_out);
        /* (the swap space, as large as the pool, may be full: then a victim is recomputed) */
        if (mode == 0) assert_true(st.swaps_out > st.recomputes);
        if (mode == 1) assert_true(st.swaps_out == 0 && st.recomputes > 0);
        if (mode == 2) assert_true(st.swaps_out > 0 && st.recomputes > 0);
        if (mode == 3) assert_true(st.kv.swap_tier_out > 0 && st.kv.swap_tier_lost == 0 && st.swaps_out > st.recomputes);
        assert_int_equal(st.kv.used, 0);
        assert_int_equal(st.kv.swap_used, 0);
        assert_int_equal(st.kv.swap_tier_used, 0);
        for (int i = 0; i < R; i++) {
            assert_int_equal(res[i].n_final, 1);
            assert_int_equal(res[i].n_out[0], n_want[i]);
            assert_memory_equal(res[i].out[0], want[i], (size_t)n_want[i] * sizeof(int32_t));
        }
        free(res);
        kvlm_sched_free(s);
        kvlm_ctx_free(ctx);
    }
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    kvlm_model_free(m);
    g_cache_k = KVLM_CACHE_F16;
}

static void test_swap_tight_pool(void **state) {
    (void)state;
    swap_tight_pool(KVLM_CACHE_F16, 4);
    swap_tight_pool(KVLM_CACHE_Q4_KC, 1);
}

static void test_cancel_and_stop(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    TU_REQUIRE(m);
    kvlm_ctx *ctx = make_ctx(m, 4, 0);
    kvlm_error err = {0};
    kvlm_sched *s = kvlm_sched_create(ctx, NULL, &err);
    int32_t prompt[64];
    int n = make_prompt(m, 5, prompt, 64);
    result a = {0}, b = {0};
    b.stop_after = 3; /* the callback ends it after 3 tokens */
    kvlm_request_params p = tu_greedy_params(60);
    uint64_t ida = kvlm_sched_submit(s, prompt, n, &p, tu_sched_collect, &a, &err);
    kvlm_sched_submit(s, prompt, n, &p, tu_sched_collect, &b, &err);
    for (int i = 0; i < 5; i++) kvlm_sched_step(s);
    assert_int_equal(b.n_out[0], 3);
    assert_int_equal(b.finish[0], KVLM_FINISH_STOP);
    kvlm_sched_stats st;
    kvlm_sched_stats_get(s, &st);
    assert_true(st.kv.used > 0);
    assert_int_equal(st.running, 1);
    kvlm_sched_cancel(s, ida);
    assert_int_equal(kvlm_sched_step(s), 0);
    assert_int_equal(a.finish[0], KVLM_FINISH_CANCELLED);
    assert_int_equal(a.n_final, 1);
    kvlm_sched_stats_get(s, &st);
    assert_int_equal(st.kv.used, 0);
    /* bad requests are refused at submit */
    int32_t big[300] = {1};
    assert_int_equal(kvlm_sched_submit(s, big, 300, &p, tu_sched_collect, &a, &err), 0);
    assert_int_equal(err.code, KVLM_ERANGE);
    p.max_tokens = 0;
    assert_int_equal(kvlm_sched_submit(s, prompt, n, &p, tu_sched_collect, &a, &err), 0);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

static void test_fork_n(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    TU_REQUIRE(m);
    kvlm_ctx *ctx = make_ctx(m, 4, 0);
    kvlm_error err = {0};
    kvlm_sched *s = kvlm_sched_create(ctx, NULL, &err);
    int32_t prompt[64];
    int n = make_prompt(m, 9, prompt, 64);
    for (int n0 = n; n < 40; n++) prompt[n] = prompt[1 + (n - n0) % (n0 - 1)]; /* two full blocks */
    result r = {0};
    kvlm_request_params p = tu_greedy_params(20);
    p.n = 3;
    kvlm_sched_submit(s, prompt, n, &p, tu_sched_collect, &r, &err);
    kvlm_sched_step(s);
    kvlm_sched_step(s);
    kvlm_sched_req_info info[4];
    assert_int_equal(kvlm_sched_requests(s, info, 4), 1);
    kvlm_sched_stats st;
    kvlm_sched_stats_get(s, &st);
    printf("  n=3: %d blocks held, %d shared, request blocks %d (%d shared)\n", st.kv.used, st.kv.shared,
           info[0].blocks, info[0].shared_blocks);
    assert_int_equal(st.kv.shared, 2);            /* the prompt's two full blocks */
    assert_int_equal(info[0].shared_blocks, 3 * 2);
    while (kvlm_sched_step(s) > 0) {}
    int32_t want[MAXGEN];
    int n_want = greedy_alone(m, prompt, n, 20, want);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(r.n_out[i], n_want);
        assert_memory_equal(r.out[i], want, (size_t)n_want * sizeof(int32_t));
    }
    assert_int_equal(r.n_final, 3);
    kvlm_sched_stats_get(s, &st);
    assert_int_equal(st.kv.used, 0);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

/* One request alone in a pool of 2 blocks (32 tokens) under a context of 256:
 * when its cache outgrows the pool there is nothing to preempt, so it ends
 * where it is with KV_FULL (not LENGTH: neither max_tokens nor the context was
 * reached), what it made so far equals the run alone, and its blocks are back. */
static void test_kv_full_finish(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    TU_REQUIRE(m);
    kvlm_ctx *ctx = make_ctx(m, 1, 2);
    kvlm_error err = {0};
    kvlm_sched *s = kvlm_sched_create(ctx, NULL, &err);
    assert_non_null(s);
    int32_t prompt[64];
    int n_prompt = make_prompt(m, 1, prompt, 64);
    result *res = calloc(1, sizeof *res);
    kvlm_request_params p = tu_greedy_params(MAXGEN);
    assert_true(kvlm_sched_submit(s, prompt, n_prompt, &p, tu_sched_collect, res, &err) > 0);
    int steps = 0;
    while (kvlm_sched_step(s) > 0) assert_true(++steps < 1000);
    int32_t want[MAXGEN];
    int n_want = greedy_alone(m, prompt, n_prompt, MAXGEN, want);
    printf("  pool of 32 tokens, prompt of %d: %d tokens made, finish %d (alone: %d tokens)\n", n_prompt,
           res->n_out[0], res->finish[0], n_want);
    assert_true(n_want > 32 - n_prompt); /* the model would go on: the pool is what stops it */
    assert_int_equal(res->finish[0], KVLM_FINISH_KV_FULL);
    assert_int_equal(res->n_final, 1);
    assert_true(res->n_out[0] > 0 && res->n_out[0] <= 32 - n_prompt + 1);
    assert_memory_equal(res->out[0], want, (size_t)res->n_out[0] * sizeof(int32_t));
    kvlm_sched_stats st;
    kvlm_sched_stats_get(s, &st);
    assert_int_equal(st.kv.used, 0);
    free(res);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

enum { EV_MAX = 400 };
typedef struct { int32_t out[EV_MAX]; int n_out, finish; } ev_result;

static bool on_ev_event(void *user, const kvlm_sched_event *ev) {
    ev_result *r = user;
    if (ev->finish) r->finish = ev->finish;
    else {
        assert_true(r->n_out < EV_MAX);
        r->out[r->n_out++] = ev->token;
    }
    return true;
}

static int g_policy = KVLM_EVICT_SINKS; /* evict_params' */

static kvlm_ctx_params evict_params(void) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_threads = 2;
    cp.n_ctx = 128;
    cp.n_seq_max = 2;
    cp.kv_budget = 64;
    cp.kv_evict = g_policy;
    return cp;
}

/* The reference: greedy through kvlm_decode alone, the prompt in pieces of at
 * most kvlm_ctx_kv_max_feed tokens, under the same context parameters. */
static int greedy_evict_alone(kvlm_model *m, const int32_t *prompt, int n, int max_tokens, int32_t *out) {
    kvlm_ctx_params cp = evict_params();
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(ctx);
    int n_out = tu_greedy_alone(ctx, prompt, n, max_tokens, out);
    kvlm_ctx_free(ctx);
    return n_out;
}

/* Two requests under sinks (budget 64, context 128), one with a prompt longer
 * than the budget, each generating 400 tokens: neither ends at the context, their
 * blocks stay within the budget's after every step, and each gives what it
 * gives alone through kvlm_decode. */
static void test_evict_past_context(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    TU_REQUIRE(m);
    kvlm_ctx_params cp = evict_params();
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(ctx);
    kvlm_sched *s = kvlm_sched_create(ctx, NULL, &err);
    assert_non_null(s);
    int32_t prompts[2][200];
    int n_prompt[2] = {make_prompt(m, 0, prompts[0], 200), 0};
    while (n_prompt[1] < 100) /* 100+ tokens: more than the budget, fed in pieces */
        n_prompt[1] += make_prompt(m, 3 + n_prompt[1], prompts[1] + n_prompt[1], 200 - n_prompt[1]);
    ev_result *res = calloc(2, sizeof *res);
    for (int i = 0; i < 2; i++) {
        kvlm_request_params p = tu_greedy_params(EV_MAX);
        assert_true(kvlm_sched_submit(s, prompts[i], n_prompt[i], &p, on_ev_event, &res[i], &err) > 0);
    }
    int steps = 0, most_blocks = 0, cap = (64 + 15) / 16;
    kvlm_sched_req_info info[2];
    while (kvlm_sched_step(s) > 0) {
        assert_true(++steps < 10000);
        for (int k = 0, n = kvlm_sched_requests(s, info, 2); k < n; k++) {
            assert_true(info[k].blocks <= cap);
            if (info[k].blocks > most_blocks) most_blocks = info[k].blocks;
        }
    }
    printf("  sinks, budget 64, context 128: prompts of %d and %d tokens, %d + %d tokens in %d steps, at most %d "
           "blocks a request (cap %d)\n", n_prompt[0], n_prompt[1], res[0].n_out, res[1].n_out, steps, most_blocks, cap);
    assert_int_equal(most_blocks, cap);
    for (int i = 0; i < 2; i++) {
        int32_t want[EV_MAX];
        int n_want = greedy_evict_alone(m, prompts[i], n_prompt[i], EV_MAX, want);
        assert_int_equal(res[i].n_out, n_want);
        assert_memory_equal(res[i].out, want, (size_t)n_want * sizeof(int32_t));
        assert_int_equal(res[i].finish, n_want < EV_MAX ? KVLM_FINISH_STOP : KVLM_FINISH_LENGTH);
    }
    assert_int_equal(res[0].n_out, EV_MAX); /* far past the context of 128 */
    assert_int_equal(res[0].finish, KVLM_FINISH_LENGTH);
    kvlm_sched_stats st;
    kvlm_sched_stats_get(s, &st);
    assert_int_equal(st.kv.used, 0);
    free(res);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

/* Four requests under sinks in a pool of 10 blocks (each may hold 4), the
 * newest with a prompt longer than the budget (it evicts at once): the
 * newest is preempted, by swap (one that evicted too: its cache travels
 * whole) or, before it evicts, by recompute; each still gives what it gives
 * alone. */
static void test_evict_preempt(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    TU_REQUIRE(m);
    kvlm_ctx_params cp = evict_params();
    cp.n_seq_max = 4;
    cp.kv_blocks = 10;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(ctx);
    kvlm_sched *s = kvlm_sched_create(ctx, NULL, &err);
    assert_non_null(s);
    enum { R = 4 };
    int max_tokens = tu_quick() ? 100 : 200, n_prompt[R];
    int32_t prompts[R][200];
    ev_result *res = calloc(R, sizeof *res);
    for (int i = 0; i < R; i++) {
        n_prompt[i] = make_prompt(m, 5 * i + 1, prompts[i], 200);
        while (i == R - 1 && n_prompt[i] < 100)
            n_prompt[i] += make_prompt(m, n_prompt[i], prompts[i] + n_prompt[i], 200 - n_prompt[i]);
        kvlm_request_params p = tu_greedy_params(max_tokens);
        assert_true(kvlm_sched_submit(s, prompts[i], n_prompt[i], &p, on_ev_event, &res[i], &err) > 0);
    }
    int steps = 0;
    while (kvlm_sched_step(s) > 0) assert_true(++steps < 10000);
    kvlm_sched_stats st;
    kvlm_sched_stats_get(s, &st);
    printf("  sinks, 4 requests in 10 blocks: %d steps, %llu preemptions\n", steps, (unsigned long long)st.preemptions);
    print_preempt(&st);
    assert_true(st.preemptions > 0);
    assert_int_equal(st.kv.used, 0);
    for (int i = 0; i < R; i++) {
        int32_t want[EV_MAX];
        int n_want = greedy_evict_alone(m, prompts[i], n_prompt[i], max_tokens, want);
        assert_int_equal(res[i].n_out, n_want);
        assert_memory_equal(res[i].out, want, (size_t)n_want * sizeof(int32_t));
        assert_int_equal(res[i].finish, n_want < max_tokens ? KVLM_FINISH_STOP : KVLM_FINISH_LENGTH);
    }
    free(res);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

static kvlm_model *synth_with_template(const char *tmpl) {
    kvlm_synth_params sp = {0};
    sp.dim = 32; sp.hidden_dim = 64; sp.n_layers = 1; sp.n_heads = 4; sp.vocab_size = 64; sp.n_ctx = 64;
    sp.type = kvlm_type_from_name("f32");
    sp.chat_template = tmpl;
    const char *path = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, path, &err)) fail_msg("synth: %s", err.msg);
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("load: %s", err.msg);
    return m;
}

static void test_chat_templates(void **state) {
    (void)state;
    struct { const char *tmpl, *family, *want; } cases[] = {
        {"{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n'}}{% endfor %}",
         "chatml",
         "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
         "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"},
        {"{{ bos_token }}{% if m['role'] == 'user' %}{{ '[INST] ' + content + ' [/INST]' }}<<SYS>>", "llama2",
         "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]Hello!</s>[INST] Why? [/INST]"},
        {"{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}",
         "llama3",
         "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhy?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n"},
        {"{% if message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + eos_token }}", "zephyr",
         "<|system|>\nBe brief.<|endoftext|>\n<|user|>\nHi<|endoftext|>\n<|assistant|>\nHello!<|endoftext|>\n<|user|>\nWhy?"
         "<|endoftext|>\n<|assistant|>\n"},
        {"{{ '<|' + message['role'] + '|>' + '\n' + message['content'] + '<|end|>' + '\n' }}...<|assistant|>", "phi3",
         "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nWhy?<|end|>\n"
         "<|assistant|>\n"},
        {"{{'<|im_start|>' + message['role'] + '<|im_sep|>' + message['content'] + '<|im_end|>'}}", "phi4",
         "<|im_start|>system<|im_sep|>Be brief.<|im_end|><|im_start|>user<|im_sep|>Hi<|im_end|>"
         "<|im_start|>assistant<|im_sep|>Hello!<|im_end|><|im_start|>user<|im_sep|>Why?<|im_end|>"
         "<|im_start|>assistant<|im_sep|>"},
        /* Gemma has no system role: the system text opens the first user turn */
        {"{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}", "gemma",
         "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
         "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"},
        {"{{ '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}",
         "granite",
         "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Hi"
         "<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Hello!<|end_of_text|>\n<|start_of_role|>user"
         "<|end_of_role|>Why?<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"},
        /* Mistral Large 2411 (v7: a space after the markers) and Small 3.1 (v7-tekken: none) */
        {"{{- '[SYSTEM_PROMPT] ' + system_message + '[/SYSTEM_PROMPT]' }}{{- '[INST] ' + message['content'] + '[/INST]' }}",
         "mistral-v7", "[SYSTEM_PROMPT] Be brief.[/SYSTEM_PROMPT][INST] Hi[/INST] Hello!</s>[INST] Why?[/INST]"},
        {"{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}{{- '[INST]' + message['content'] + '[/INST]' }}",
         "mistral-v7-tekken", "[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi[/INST]Hello!</s>[INST]Why?[/INST]"},
        /* gpt-oss's harmony, as llama.cpp's built-in renders it */
        {"{{- '<|start|>' + message['role'] + '<|message|>' }}{{- '<|channel|>final' }}", "gpt-oss",
         "<|start|>system<|message|>Be brief.<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant<|message|>"
         "Hello!<|return|><|start|>user<|message|>Why?<|end|><|start|>assistant"},
        {NULL, "plain", "System: Be brief.\nUser: Hi\nAssistant: Hello!\nUser: Why?\nAssistant:"},
    };
    const char *req = "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", "
                      "\"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello!\"}, {\"role\": \"user\", "
                      "\"content\": \"Why?\"}]}";
    kvlm_error err = {0};
    kvlm_model *plain = synth_with_template(NULL);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        /* each family by name, whatever the model carries */
        kvlm_chat_params cp = {.template_name = cases[i].family};
        kvlm_chat *c = kvlm_chat_create(plain, &cp, &err);
        assert_non_null(c);
        assert_string_equal(kvlm_chat_family(c), cases[i].family);
        char *out = NULL;
        assert_int_equal(kvlm_chat_render(c, req, &out, NULL, &err), KVLM_OK);
        assert_string_equal(out, cases[i].want);
        free(out);
        kvlm_chat_free(c);
        /* a model template Jinja cannot parse falls back to the family its markers show (llama.cpp's detection) */
        if (!cases[i].tmpl) continue;
        char broken[1024];
        snprintf(broken, sizeof broken, "{%% if %%}%s", cases[i].tmpl);
        kvlm_model *m = synth_with_template(broken);
        assert_non_null(c = kvlm_chat_create(m, NULL, &err));
        assert_string_equal(kvlm_chat_family(c), cases[i].family);
        kvlm_chat_free(c);
        kvlm_model_free(m);
    }
    /* no template: plain */
    kvlm_chat *c = kvlm_chat_create(plain, NULL, &err);
    assert_non_null(c);
    assert_string_equal(kvlm_chat_family(c), "plain");
    kvlm_chat_free(c);
    /* a model's own template renders through Jinja, whatever its family */
    kvlm_model *m = synth_with_template("{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}### assistant:{% endif %}");
    assert_non_null(c = kvlm_chat_create(m, NULL, &err));
    assert_string_equal(kvlm_chat_family(c), "jinja");
    char *out = NULL;
    assert_int_equal(kvlm_chat_render(c, req, &out, NULL, &err), KVLM_OK);
    assert_string_equal(out, "### system: Be brief.\n### user: Hi\n### assistant: Hello!\n### user: Why?\n### assistant:");
    free(out);
    kvlm_chat_free(c);
    kvlm_model_free(m);
    /* one Jinja cannot parse and without a family's markers: an error saying what to do */
    m = synth_with_template("{% for message in messages %}### Instruction:\n{{ message['content'] }}");
    assert_null(kvlm_chat_create(m, NULL, &err));
    assert_int_equal(err.code, KVLM_EINVAL);
    assert_non_null(strstr(err.msg, "--chat-template"));
    printf("  unparsable: %s\n", err.msg);
    kvlm_model_free(m);
    /* the built-in families have system, user and assistant only; unknown names are refused */
    kvlm_chat_params cp = {.template_name = "plain"};
    assert_non_null(c = kvlm_chat_create(plain, &cp, &err));
    assert_int_equal(kvlm_chat_render(c, "{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}", &out, NULL, &err),
                     KVLM_EINVAL);
    kvlm_chat_free(c);
    cp.template_name = "nope";
    assert_null(kvlm_chat_create(plain, &cp, &err));
    assert_int_equal(err.code, KVLM_EINVAL);
    kvlm_model_free(plain);
}

/* Under sinks (then h2o, whose attention scores travel too), in a pool of
 * 10 blocks (each request may hold 4): two short prompts, then two longer
 * than the budget (they evict at once, so they are the newest and have
 * compacted when the short ones grow and the pool runs out). Before swap they
 * could not be preempted (a short one was recomputed instead); now the newest
 * is swapped out with its compacted cache and resumes with the output it
 * gives alone. */
static void evict_swap(int policy) {
    g_policy = policy;
    kvlm_model *m = load_stories();
    TU_REQUIRE(m);
    kvlm_ctx_params cp = evict_params();
    cp.n_seq_max = 4;
    cp.kv_blocks = 10;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(ctx);
    kvlm_sched *s = kvlm_sched_create(ctx, NULL, &err);
    assert_non_null(s);
    enum { R = 4 };
    int max_tokens = tu_quick() ? 100 : 200, n_prompt[R];
    int32_t prompts[R][200];
    ev_result *res = calloc(R, sizeof *res);
    for (int i = 0; i < R; i++) {
        n_prompt[i] = make_prompt(m, 7 * i + 2, prompts[i], 200);
        while (i >= 2 && n_prompt[i] < 80)
            n_prompt[i] += make_prompt(m, n_prompt[i] + i, prompts[i] + n_prompt[i], 200 - n_prompt[i]);
        kvlm_request_params p = tu_greedy_params(max_tokens);
        assert_true(kvlm_sched_submit(s, prompts[i], n_prompt[i], &p, on_ev_event, &res[i], &err) > 0);
    }
    int steps = 0;
    while (kvlm_sched_step(s) > 0) assert_true(++steps < 10000);
    kvlm_sched_stats st;
    kvlm_sched_stats_get(s, &st);
    printf("  %s, 2 short then 2 evicting requests in 10 blocks: %d steps; %llu swaps of sequences that had evicted\n",
           kvlm_evict_name(policy), steps, (unsigned long long)st.swaps_evicted);
    print_preempt(&st);
    assert_true(st.swaps_out > 0);
    assert_true(st.swaps_evicted > 0);
    assert_int_equal(st.recomputes, 0);
    assert_int_equal(st.swaps_in, st.swaps_out);
    assert_int_equal(st.kv.used, 0);
    for (int i = 0; i < R; i++) {
        int32_t want[EV_MAX];
        int n_want = greedy_evict_alone(m, prompts[i], n_prompt[i], max_tokens, want);
        assert_int_equal(res[i].n_out, n_want);
        assert_memory_equal(res[i].out, want, (size_t)n_want * sizeof(int32_t));
        assert_int_equal(res[i].finish, n_want < max_tokens ? KVLM_FINISH_STOP : KVLM_FINISH_LENGTH);
    }
    free(res);
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
    g_policy = KVLM_EVICT_SINKS;
}

static void test_evict_swap(void **state) {
    (void)state;
    evict_swap(KVLM_EVICT_SINKS);
    evict_swap(KVLM_EVICT_H2O);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_concurrent_equals_alone),
        cmocka_unit_test(test_concurrent_swap),
        cmocka_unit_test(test_swap_tight_pool),
        cmocka_unit_test(test_evict_swap),
        cmocka_unit_test(test_cancel_and_stop),
        cmocka_unit_test(test_fork_n),
        cmocka_unit_test(test_kv_full_finish),
        cmocka_unit_test(test_evict_past_context),
        cmocka_unit_test(test_evict_preempt),
        cmocka_unit_test(test_chat_templates),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
