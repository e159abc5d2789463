/* tests/test_sched_draft: the scheduler speculating with a draft model
 * (kvlm_sched_params.draft_ctx, engine/spec_draft): concurrent greedy
 * requests (some n = 3, some found whole in the prefix index) under a pool
 * small enough to preempt give what their prompt gives alone; with the model itself drafting nearly every draft is
 * kept (so the batched catch-up and rounds propose for the right sequence);
 * a draft pool far too small costs drafts, never requests; finished and
 * cancelled requests leave the draft context empty; sampling runs; a draft
 * of another vocabulary, an evicting draft context and one with fewer
 * sequences are refused. A draft context in the model's pool
 * (kvlm_ctx_create_draft): the same outputs; under a pool the model's
 * sequences fill, the draft gives its blocks back and no request is
 * preempted; the two models' blocks of the same tokens are never shared.
 * A smaller model of another cache shape (stories260K drafting for
 * stories4M_hd64) keeps its cache in the model's pool too, in blocks of its
 * own layout (more of its tokens a block): the same outputs, its blocks
 * given back before a request is preempted; so does a larger one, in blocks
 * of fewer tokens than the model's; a draft whose one token takes more
 * bytes than the model's block is refused there. Its blocks reach the tiers
 * in their own stored form: pushed out to host memory and brought back, and
 * found on disk by the next context. Under a model with sliding windows, a
 * draft of another shape or other windows is a guest that keeps all
 * its blocks, all its layers in the global store (its logits those of a
 * context of its own), gemma's local layers' store beside it or not. The
 * drafter takes only the pool's spare blocks and gives back as few
 * sequences as the model's step lacks. */
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "engine/engine.h"
#include "engine/spec_draft.h"
#include "helpers/testutil.h"
#include "kvlm.h"

enum { MAXGEN = TU_SCHED_MAXGEN };
typedef tu_sched_result result;

static kvlm_model *load(const char *path) {
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("load %s: %s", path, err.msg);
    return m;
}

/* m's q4_0 copy (kvlm_model_save_gguf, as `kvlm convert` makes it), loaded */
static kvlm_model *load_q4_0_copy(const kvlm_model *m) {
    const char *q = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_save_gguf(m, q, kvlm_type_from_name("q4_0"), &err)) fail_msg("convert: %s", err.msg);
    return load(q);
}

static int key_type = -1; /* >= 0: every context's keys of this type (test_draft_q4_kc_pool) */
static int evict_all;     /* every context's eviction, with a budget of 32 tokens (test_draft_shared_evict) */

static kvlm_ctx_params ctx_params(int n_seq, int kv_blocks, int evict) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    if (key_type >= 0) cp.cache_type_k = key_type;
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
    } else if (evict_all) {
        cp.kv_evict = evict_all;
        cp.kv_budget = 32;
    }
    return cp;
}

static kvlm_ctx *make_ctx(const kvlm_model *m, int n_seq, int kv_blocks, int evict) {
    kvlm_ctx_params cp = ctx_params(n_seq, kv_blocks, evict);
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
 * drafted by dm in a pool of draft_blocks; outputs against greedy_alone.
 * draft_blocks < 0: dm's cache in the target's pool, of -draft_blocks blocks;
 * dm NULL: no speculation, in a pool of -draft_blocks blocks. */
static void draft_concurrent(const kvlm_model *m, const kvlm_model *dm, int draft_blocks, int K, bool preempts,
                             kvlm_sched_stats *st) {
    int R = tu_quick() ? 12 : 32, max_tokens = tu_quick() ? 24 : 48;
    kvlm_ctx *ctx, *dctx = NULL;
    if (!dm) {
        ctx = make_ctx(m, 32, -draft_blocks, 0);
    } else if (draft_blocks < 0) {
        kvlm_ctx_params cp = ctx_params(32, -draft_blocks, 0);
        cp.n_seq_draft = 32;
        kvlm_error e = {0};
        if (!(ctx = kvlm_ctx_create(m, &cp, &e)) || !(dctx = kvlm_ctx_create_draft(dm, ctx, &cp, &e)))
            fail_msg("shared pool: %s", e.msg);
        assert_int_equal(kvlm_ctx_seq_first(dctx), 32);
    } else {
        ctx = make_ctx(m, 32, tu_quick() ? 20 : 40, 0);
        dctx = make_ctx(dm, 32, draft_blocks, 0);
    }
    kvlm_sched_params sp = {.batch_tokens = 64, .max_seqs = 32, .spec_mode = dm ? KVLM_SPEC_DRAFT : KVLM_SPEC_NONE,
                            .spec_n_draft = dm ? K : 0, .draft_ctx = dctx};
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
        assert_true(kvlm_sched_submit(s, prompts[i], n_prompt[i], &p, tu_sched_collect, &res[i], &err) > 0);
    }
    int steps = 0;
    while (kvlm_sched_step(s) > 0) assert_true(++steps < 100000);
    kvlm_sched_stats_get(s, st);
    kvlm_kv_stats dk = {0};
    if (dctx) kvlm_kv_stats_get(dctx, &dk);
    printf("  %s pool of %d blocks, K = %d: %d requests in %d steps, %llu preemptions, %llu/%llu drafts kept, "
           "%llu draft steps, %llu draft-context failures, %llu draft sequences given back\n",
           !dm ? "no draft," : draft_blocks < 0 ? "shared" : "draft", abs(draft_blocks), K, R, steps,
           (unsigned long long)st->preemptions, (unsigned long long)st->spec_accepted,
           (unsigned long long)st->spec_drafted, (unsigned long long)st->spec_draft_steps,
           (unsigned long long)st->spec_draft_failures, (unsigned long long)st->spec_draft_released);
    if (preempts) assert_true(st->preemptions > 0);
    const char *bad = engine_kv_check(ctx);
    if (bad) fail_msg("pool invariants: %s", bad);
    assert_int_equal(st->kv.used, 0);
    assert_int_equal(dk.used, 0); /* every finished request's draft sequence went */
    for (int i = 0; i < R; i++) {
        int32_t want[MAXGEN];
        int n_want = greedy_alone(m, prompts[i], n_prompt[i], max_tokens, want);
        tu_sched_expect_alone(&res[i], i % 5 == 2 ? 3 : 1, want, n_want, max_tokens);
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

/* spec_n_min (llama.cpp's --draft-min) with a draft model whose drafts end
 * early (p_min): one request, so a step's drafts are its own; a step checks
 * none or at least n_min; the text is greedy's alone. n_min 0 shows short
 * steps (the check can fail). */
static int draft_min_steps(const kvlm_model *m, int n_min, int *bad, int *shorts) {
    kvlm_ctx *ctx = make_ctx(m, 4, 0, 0), *dctx = make_ctx(m, 4, 0, 0);
    kvlm_sched_params sp = {.spec_mode = KVLM_SPEC_DRAFT, .spec_n_draft = 4, .draft_ctx = dctx, .spec_p_min = 0.6f,
                            .spec_n_min = n_min};
    kvlm_error err = {0};
    kvlm_sched *s = kvlm_sched_create(ctx, &sp, &err);
    if (!s) fail_msg("sched: %s", err.msg);
    int32_t prompt[64];
    int n = make_prompt(m, 3, prompt, 64), max_tokens = MAXGEN;
    result res = {0};
    kvlm_request_params p = tu_greedy_params(max_tokens);
    assert_true(kvlm_sched_submit(s, prompt, n, &p, tu_sched_collect, &res, &err) > 0);
    *bad = *shorts = 0;
    kvlm_sched_stats a, b;
    kvlm_sched_stats_get(s, &a);
    int steps = 0;
    while (kvlm_sched_step(s) > 0) {
        assert_true(++steps < 10000);
        kvlm_sched_stats_get(s, &b);
        int d = (int)(b.spec_drafted - a.spec_drafted);
        if (d > 0 && d < 3) (*shorts)++;
        if (n_min && d > 0 && d < n_min) (*bad)++;
        a = b;
    }
    int32_t want[MAXGEN];
    int n_want = greedy_alone(m, prompt, n, max_tokens, want);
    tu_sched_expect_alone(&res, 1, want, n_want, max_tokens);
    kvlm_sched_free(s);
    kvlm_ctx_free(dctx);
    kvlm_ctx_free(ctx);
    return steps;
}

static void test_draft_min(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path);
    int bad0, shorts0, bad3, shorts3;
    int s0 = draft_min_steps(m, 0, &bad0, &shorts0), s3 = draft_min_steps(m, 3, &bad3, &shorts3);
    printf("  draft p_min 0.6, K = 4: steps checking 1..2 drafts: %d of %d with n_min 0, %d of %d with n_min 3\n",
           shorts0, s0, shorts3, s3);
    assert_true(shorts0 > 0);
    assert_int_equal(shorts3, 0);
    assert_int_equal(bad3, 0);
    kvlm_model_free(m);
}

/* A q4_0 copy drafting: the same outputs. */
static void test_draft_q4_0_copy(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path), *dm = load_q4_0_copy(m);
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
    for (int i = 0; i < 4; i++) id[i] = kvlm_sched_submit(s, prompt, n, &p, tu_sched_collect, &a[i], &err);
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
    assert_true(kvlm_sched_submit(s, prompt, n, &p, tu_sched_collect, &b, &err) > 0);
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

/* dm's cache in m's pool of `blocks`, too small for every draft sequence
 * beside the model's: the drafts give their blocks back, and requests are
 * preempted no more often than without speculation. */
static void gives_back(const kvlm_model *m, const kvlm_model *dm, int blocks, kvlm_sched_stats *st) {
    draft_concurrent(m, NULL, -blocks, 4, false, st);
    uint64_t plain_preempt = st->preemptions;
    draft_concurrent(m, dm, -blocks, 4, false, st);
    assert_true(st->preemptions <= plain_preempt);
    assert_true(st->spec_draft_released > 0);
    assert_true(st->spec_accepted > 0);
    /* a draft sequence is built or grown only into blocks the model's next
     * step leaves: it waits rather than fails (measured before, dropping
     * every draft sequence at once: 6 failed draft decodes and 52 sequences
     * given back with the q4_0 copy in 100 blocks, 70 and 84 with the larger
     * guest in 80; now none and 12, none and 8) */
    assert_int_equal(st->spec_draft_failures, 0);
    assert_true(st->spec_draft_waits > 0);
}

/* The draft model's cache in the model's pool. A pool the model's own
 * sequences fit (no preemption without drafts) but not with every draft
 * sequence beside them: the drafts give their blocks back, no request is
 * preempted, and the outputs are the same. */
static void test_draft_shared_pool(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path), *dm = load_q4_0_copy(m);
    kvlm_ctx_params tp = ctx_params(32, 0, 0);
    assert_true(kvlm_draft_shares_pool(m, dm, &tp));
    kvlm_sched_stats st;
    /* roomy: every sequence of both models at once */
    draft_concurrent(m, dm, -1000, 4, false, &st);
    assert_int_equal(st.preemptions, 0);
    assert_true(st.spec_accepted * 2 > st.spec_drafted);
    /* a pool too small for every draft sequence beside the model's: the
     * drafts give their blocks back, and no request is preempted for them
     * (measured: none, where the same requests without speculation are
     * preempted 5 times in the full run) */
    gives_back(m, dm, tu_quick() ? 50 : 100, &st);
    /* the model drafting for itself: blocks of the same tokens, other keys */
    draft_concurrent(m, m, -1000, 4, false, &st);
    assert_true(st.spec_accepted * 100 >= st.spec_drafted * 95);
    kvlm_model_free(dm);
    kvlm_model_free(m);
}

/* The drafter in the model's pool (engine/spec_draft), driven directly:
 * four sequences of 20, 40, 60 and 80 tokens. A draft sequence is built
 * only when what it will hold fits in the spare blocks it is given (else it
 * waits, counted); spec_drafter_release gives back as few sequences as the
 * blocks asked for take, the longest first, and the rest keep their caches. */
static void test_draft_release_some(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path), *dm = load_q4_0_copy(m);
    kvlm_ctx_params cp = ctx_params(4, 64, 0);
    cp.n_seq_draft = 4;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err), *dctx = ctx ? kvlm_ctx_create_draft(dm, ctx, &cp, &err) : NULL;
    if (!dctx) fail_msg("shared pool: %s", err.msg);
    spec_drafter *d = spec_drafter_create(ctx, dctx, 0, &err);
    if (!d) fail_msg("drafter: %s", err.msg);
    const int lo = kvlm_ctx_seq_first(dctx), V = kvlm_vocab_size(m);
    int32_t hist[80], out[4][SPEC_DRAFT_MAX];
    for (int t = 0; t < 80; t++) hist[t] = (int32_t)(3 + (t * 37) % (V - 3));
    spec_draft_req reqs[4];
    uint64_t steps, failures, released, windows, waits;
#define REQS()                                                                                                         \
    for (int i = 0; i < 4; i++) reqs[i] = (spec_draft_req){i, hist, 20 * (i + 1), 2, out[i], 0, NULL, NULL}
    /* no spare blocks: nothing is built, four waits */
    REQS();
    spec_drafter_propose(d, reqs, 4, 512, 0);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(reqs[i].n_out, 0);
        assert_int_equal(kvlm_seq_n_past(dctx, lo + i), 0);
    }
    spec_drafter_counts(d, &steps, &failures, &released, &windows, &waits);
    assert_int_equal(waits, 4);
    /* two spare blocks: the 20 tokens and a draft (21, 2 blocks of 16) fit, the 40 do not */
    REQS();
    spec_drafter_propose(d, reqs, 4, 512, 2);
    assert_int_equal(reqs[0].n_out, 2);
    for (int i = 1; i < 4; i++) assert_int_equal(reqs[i].n_out, 0);
    /* room for all: each holds its text and its first draft */
    REQS();
    spec_drafter_propose(d, reqs, 4, 512, 1000);
    int held[4];
    for (int i = 0; i < 4; i++) {
        assert_int_equal(reqs[i].n_out, 2);
        held[i] = kvlm_seq_n_past(dctx, lo + i);
        assert_int_equal(held[i], 20 * (i + 1) + 1); /* its text, then its first draft fed */
    }
    /* one block asked for: the longest alone gives its blocks back */
    kvlm_kv_stats a, b;
    kvlm_kv_stats_get(ctx, &a);
    assert_int_equal(spec_drafter_release(d, 1), 1);
    kvlm_kv_stats_get(ctx, &b);
    assert_true(b.free + b.cached >= a.free + a.cached + 1);
    assert_int_equal(kvlm_seq_n_past(dctx, lo + 3), 0);
    for (int i = 0; i < 3; i++) assert_int_equal(kvlm_seq_n_past(dctx, lo + i), held[i]);
    /* the pool's whole spare asked for: every one left goes */
    assert_int_equal(spec_drafter_release(d, 0), 3);
    for (int i = 0; i < 4; i++) assert_int_equal(kvlm_seq_n_past(dctx, lo + i), 0);
    spec_drafter_counts(d, &steps, &failures, &released, &windows, &waits);
    assert_int_equal(released, 4);
    assert_int_equal(failures, 0);
    assert_int_equal(waits, 4 + 3);
#undef REQS
    const char *bad = engine_kv_check(ctx);
    if (bad) fail_msg("pool invariants: %s", bad);
    spec_drafter_free(d);
    kvlm_ctx_free(dctx);
    kvlm_ctx_free(ctx);
    kvlm_model_free(dm);
    kvlm_model_free(m);
}

/* stories4M_hd64 and stories260K (a draft of another cache shape), loaded;
 * false when either file is absent. */
static bool load_guest_pair(kvlm_model **m, kvlm_model **dm) {
    const char *path = tu_model_path("stories4M_hd64.gguf"); /* one buffer: load before the next path */
    if (!path) return false;
    *m = load(path);
    if (!(path = tu_model_path("stories260K.gguf"))) {
        kvlm_model_free(*m);
        return false;
    }
    *dm = load(path);
    return true;
}

/* stories260K (5 layers x 4 KV heads x 8) drafting for stories4M_hd64
 * (6 x 2 x 64) in one pool: 4 blocks' worth of its tokens fit in one of the
 * model's blocks. The same outputs; under a pool the model's sequences fill,
 * the draft gives its blocks back and no request is preempted for it. */
static void test_draft_guest_pool(void **state) {
    (void)state;
    kvlm_model *m, *dm;
    TU_REQUIRE(load_guest_pair(&m, &dm));
    kvlm_ctx_params cp = ctx_params(32, 0, 0);
    assert_true(kvlm_draft_shares_pool(m, dm, &cp));
    kvlm_sched_stats st;
    draft_concurrent(m, dm, -1000, 4, false, &st);
    assert_int_equal(st.preemptions, 0);
    assert_true(st.spec_accepted > 0);
    gives_back(m, dm, tu_quick() ? 40 : 80, &st); /* measured: 8 preemptions against 11, 31 given back */
    /* the layout: the draft context's own block size, its blocks found again
     * by its sequences only, and all of it gone with the context (a second
     * draft context then takes the layout again) */
    cp = ctx_params(1, 0, 0);
    cp.n_seq_draft = 1;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err), *dctx;
    assert_non_null(ctx);
    /* sized for the draft model: its sequence takes 256 / 64 blocks, not the model's 256 / 16 */
    kvlm_kv_stats ks;
    kvlm_kv_stats_get(ctx, &ks);
    assert_int_equal(ks.n_blocks, 16 + 16);
    cp.draft_model = dm;
    kvlm_ctx *sized = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(sized);
    kvlm_kv_stats_get(sized, &ks);
    assert_int_equal(ks.n_blocks, 16 + 4);
    kvlm_ctx_free(sized);
    for (int round = 0; round < 2; round++) {
        kvlm_kv_stats ks, ds, ks0;
        kvlm_kv_stats_get(ctx, &ks0); /* round 1: the model's blocks of round 0, cached */
        assert_non_null(dctx = kvlm_ctx_create_draft(dm, ctx, NULL, &err));
        kvlm_kv_stats_get(ctx, &ks);
        kvlm_kv_stats_get(dctx, &ds);
        assert_int_equal(ks.block_size, 16);
        assert_int_equal(ds.block_size, 64);
        int d = kvlm_ctx_seq_first(dctx);
        int32_t prompt[150];
        for (int i = 0; i < 150; i++) prompt[i] = 1 + (i * 37) % 200;
        kvlm_batch b = {150, prompt, NULL, NULL, NULL};
        assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK);
        assert_int_equal(kvlm_seq_reuse_prefix(dctx, d, prompt, 150), 0);
        assert_int_equal(kvlm_decode(dctx, &b, &err), KVLM_OK);
        const float *l = kvlm_get_logits(dctx, -1);
        int V = kvlm_vocab_size(dm);
        float *want = malloc((size_t)V * sizeof *want);
        memcpy(want, l, (size_t)V * sizeof *want);
        kvlm_kv_stats_get(ctx, &ks);
        assert_int_equal(ks.used, 10 + 3); /* 150 tokens: the model's 10 blocks of 16, the draft's 3 of 64 */
        kvlm_seq_free(dctx, d);
        assert_int_equal(kvlm_seq_reuse_prefix(dctx, d, prompt, 150), 128);
        kvlm_batch rest = {22, prompt + 128, NULL, NULL, NULL};
        assert_int_equal(kvlm_decode(dctx, &rest, &err), KVLM_OK);
        /* its cached blocks' bytes are its own: the same logits as computed whole */
        assert_true(tu_max_rel_diff(kvlm_get_logits(dctx, -1), want, V, 1e-2) < 1e-3);
        free(want);
        const char *bad = engine_kv_check(ctx);
        if (bad) fail_msg("pool invariants: %s", bad);
        kvlm_ctx_free(dctx);
        kvlm_kv_stats_get(ctx, &ks);
        assert_int_equal(ks.used, 10);
        assert_int_equal(ks.cached, ks0.cached); /* the guest's cached blocks went with its layout */
        bad = engine_kv_check(ctx);
        if (bad) fail_msg("pool invariants after the draft context: %s", bad);
        kvlm_seq_free(ctx, 0);
    }
    kvlm_ctx_free(ctx);
    kvlm_model_free(dm);
    kvlm_model_free(m);
}

/* The other way round: stories4M_hd64 (6 x 2 x 64, 4.8 times stories260K's
 * 5 x 4 x 8 per token) drafting for stories260K keeps its cache in the
 * model's pool too, in blocks of fewer tokens than the model's (3 of its
 * tokens in a 16-token f16 block): the same outputs as alone, its blocks
 * given back before a request is preempted, its logits those of a pool of
 * its own, its blocks found again by its prefix. */
static void test_draft_guest_larger(void **state) {
    (void)state;
    kvlm_model *dm, *m; /* load_guest_pair's roles swapped */
    TU_REQUIRE(load_guest_pair(&dm, &m));
    kvlm_ctx_params cp = ctx_params(32, 0, 0);
    assert_true(kvlm_draft_shares_pool(m, dm, &cp));
    kvlm_sched_stats st;
    draft_concurrent(m, dm, -3000, 4, false, &st);
    assert_int_equal(st.preemptions, 0);
    assert_true(st.spec_accepted > 0);
    gives_back(m, dm, tu_quick() ? 40 : 80, &st);
    cp = ctx_params(1, 0, 0);
    cp.n_seq_draft = 1;
    cp.draft_model = dm; /* the pool sized for its cache: 256 / 16 blocks for the model, 86 of 3 tokens for it */
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err), *dctx, *own = make_ctx(dm, 1, 0, 0);
    assert_non_null(ctx);
    assert_non_null(dctx = kvlm_ctx_create_draft(dm, ctx, NULL, &err));
    kvlm_kv_stats ks, ds;
    kvlm_kv_stats_get(ctx, &ks);
    kvlm_kv_stats_get(dctx, &ds);
    assert_int_equal(ks.n_blocks, 16 + 86);
    assert_int_equal(ks.block_size, 16);
    assert_int_equal(ds.block_size, 3); /* 3 x 3,072 bytes in a block of 16 x 640 */
    int d = kvlm_ctx_seq_first(dctx), V = kvlm_vocab_size(dm);
    int32_t prompt[150];
    for (int i = 0; i < 150; i++) prompt[i] = 1 + (i * 37) % 200;
    kvlm_batch b = {150, prompt, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(own, &b, &err), KVLM_OK);
    float *want = malloc((size_t)V * sizeof *want);
    memcpy(want, kvlm_get_logits(own, -1), (size_t)V * sizeof *want);
    assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK);
    assert_int_equal(kvlm_decode(dctx, &b, &err), KVLM_OK);
    assert_true(tu_max_rel_diff(kvlm_get_logits(dctx, -1), want, V, 1e-2) < 1e-3);
    kvlm_kv_stats_get(ctx, &ks);
    assert_int_equal(ks.used, 10 + 50); /* 150 tokens: the model's 10 blocks of 16, the draft's 50 of 3 */
    kvlm_seq_free(dctx, d);
    assert_int_equal(kvlm_seq_reuse_prefix(dctx, d, prompt, 150), 147);
    kvlm_batch rest = {3, prompt + 147, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(dctx, &rest, &err), KVLM_OK);
    assert_true(tu_max_rel_diff(kvlm_get_logits(dctx, -1), want, V, 1e-2) < 1e-3);
    const char *bad = engine_kv_check(ctx);
    if (bad) fail_msg("pool invariants: %s", bad);
    kvlm_ctx_free(dctx);
    kvlm_kv_stats_get(ctx, &ks);
    assert_int_equal(ks.used, 10);
    free(want);
    kvlm_ctx_free(own);
    kvlm_ctx_free(ctx);
    kvlm_model_free(dm);
    kvlm_model_free(m);
}

/* A model with q4_kc keys (stories4M_hd64) and its q4_0 copy drafting in
 * its pool: the draft's cache is a guest layout of the same shape with q8_0
 * keys (q4_kc's staging cannot take drafts back across blocks), fewer of
 * its tokens a block; its logits are those of a q8_0-key context of its
 * own, after a rollback across blocks too; 32 concurrent requests give
 * what each gives alone with q4_kc keys. */
static void test_draft_q4_kc_pool(void **state) {
    (void)state;
    const char *path = tu_model_path("stories4M_hd64.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path), *dm = load_q4_0_copy(m);
    key_type = KVLM_CACHE_Q4_KC;
    kvlm_ctx_params cp = ctx_params(1, 0, 0);
    assert_true(kvlm_draft_shares_pool(m, dm, &cp));
    cp.n_seq_draft = 1;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err), *dctx;
    assert_non_null(ctx);
    assert_non_null(dctx = kvlm_ctx_create_draft(dm, ctx, NULL, &err));
    kvlm_kv_stats ks, ds;
    kvlm_kv_stats_get(ctx, &ks);
    kvlm_kv_stats_get(dctx, &ds);
    assert_int_equal(ks.type_k, KVLM_CACHE_Q4_KC);
    assert_int_equal(ds.type_k, KVLM_CACHE_Q8_0);
    assert_int_equal(ds.type_v, ks.type_v);
    printf("  q4_kc pool, 16-token blocks: the draft's q8_0 keys take %d of its tokens a block\n", ds.block_size);
    assert_true(ds.block_size > 0 && ds.block_size < 16);
    key_type = KVLM_CACHE_Q8_0;
    kvlm_ctx *own = make_ctx(dm, 1, 0, 0);
    key_type = KVLM_CACHE_Q4_KC;
    int32_t prompt[150];
    for (int i = 0; i < 150; i++) prompt[i] = 1 + (i * 37) % 200;
    kvlm_batch b = {150, prompt, NULL, NULL, NULL};
    int V = kvlm_vocab_size(dm);
    assert_int_equal(kvlm_decode(own, &b, &err), KVLM_OK);
    assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK);
    assert_int_equal(kvlm_decode(dctx, &b, &err), KVLM_OK);
    assert_true(tu_max_rel_diff(kvlm_get_logits(dctx, -1), kvlm_get_logits(own, -1), V, 1e-2) < 1e-3);
    /* a rollback of the draft's sequence across its blocks (q4_kc keys would refuse it) */
    int d = kvlm_ctx_seq_first(dctx);
    assert_int_equal(kvlm_seq_trim(dctx, d, 100, &err), KVLM_OK);
    assert_int_equal(kvlm_seq_trim(own, 0, 100, &err), KVLM_OK);
    kvlm_batch rest = {50, prompt + 100, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(dctx, &rest, &err), KVLM_OK);
    assert_int_equal(kvlm_decode(own, &rest, &err), KVLM_OK);
    assert_true(tu_max_rel_diff(kvlm_get_logits(dctx, -1), kvlm_get_logits(own, -1), V, 1e-2) < 1e-3);
    const char *bad = engine_kv_check(ctx);
    if (bad) fail_msg("pool invariants: %s", bad);
    kvlm_ctx_free(own);
    kvlm_ctx_free(dctx);
    kvlm_ctx_free(ctx);
    /* against each alone, q4_kc keys; no preemption, whose recompute of a
     * sequence quantizes its blocks before its tokens see them, where one at
     * a time sees their staged f16 keys (q4_kc's text then differs, with or
     * without drafts) */
    kvlm_sched_stats st;
    draft_concurrent(m, dm, -1000, 4, false, &st);
    key_type = -1;
    assert_int_equal(st.preemptions, 0);
    assert_true(st.spec_accepted * 2 > st.spec_drafted);
    kvlm_model_free(dm);
    kvlm_model_free(m);
}

/* A model that evicts (sinks, h2o; a budget of 32 tokens, which every
 * request but the shortest outgrows) with its q4_0 copy drafting in its pool: the draft
 * context does not evict, and drafts while the text fits its context. The
 * 32 requests give what each gives alone with the same eviction, and the
 * pool's invariants hold. */
static void test_draft_shared_evict(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path), *dm = load_q4_0_copy(m);
    const int policies[] = {KVLM_EVICT_SINKS, KVLM_EVICT_H2O};
    for (int i = 0; i < 2; i++) {
        evict_all = policies[i];
        kvlm_ctx_params cp = ctx_params(32, 0, 0);
        assert_true(kvlm_draft_shares_pool(m, dm, &cp));
        kvlm_sched_stats st;
        draft_concurrent(m, dm, -1000, 4, false, &st); /* requests that end at max_tokens: they evicted */
        assert_true(st.spec_accepted * 2 > st.spec_drafted);
    }
    evict_all = 0;
    kvlm_model_free(dm);
    kvlm_model_free(m);
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

/* The context's figures for its tier called name. */
static kvlm_kv_tier_stats tier_named(const kvlm_ctx *ctx, const char *name) {
    kvlm_kv_tier_stats ts[KVLM_MAX_KV_TIERS];
    int n = kvlm_kv_tier_stats_get(ctx, ts, KVLM_MAX_KV_TIERS);
    for (int t = 0; t < n; t++)
        if (!strcmp(ts[t].name, name)) return ts[t];
    fail_msg("no %s tier", name);
    return ts[0];
}

/* The draft's sequence d computes the n-token prompt whole (its logits into
 * out), then lets it go: its full blocks stay cached. */
static void draft_computes(kvlm_ctx *dctx, int d, const int32_t *prompt, int n, float *out, int V) {
    kvlm_error err = {0};
    kvlm_batch b = {n, (int32_t *)prompt, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(dctx, &b, &err), KVLM_OK);
    memcpy(out, kvlm_get_logits(dctx, -1), (size_t)V * sizeof *out);
    kvlm_seq_free(dctx, d);
}

/* The draft's sequence d finds the prompt's 2 full blocks (128 tokens)
 * again, the tier called tier then counting `promoted` blocks brought back;
 * the rest of the prompt gives the logits computed whole, the pool's
 * invariants hold, and d lets it go. */
static void draft_finds(kvlm_ctx *ctx, kvlm_ctx *dctx, int d, const int32_t *prompt, int n, const char *tier,
                        uint64_t promoted, const float *want, int V) {
    kvlm_error err = {0};
    assert_int_equal(kvlm_seq_reuse_prefix(dctx, d, prompt, n), 128);
    assert_int_equal(tier_named(ctx, tier).promoted, promoted);
    kvlm_batch rest = {n - 128, (int32_t *)prompt + 128, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(dctx, &rest, &err), KVLM_OK);
    assert_true(tu_max_rel_diff(kvlm_get_logits(dctx, -1), want, V, 1e-2) < 1e-3);
    const char *bad = engine_kv_check(ctx);
    if (bad) fail_msg("pool invariants: %s", bad);
    kvlm_seq_free(dctx, d);
}

/* The guest layout's blocks (stories260K drafting for stories4M_hd64, 64 of
 * its tokens a block) go to the tiers as the model's do, in their own
 * stored form: pushed out of a full pool into host memory and brought back
 * on the draft's prefix miss; those it still holds written to disk when
 * the draft context is freed, and found there by the next context's draft.
 * Their bytes come back whole (the logits of the prompt computed whole), the
 * model's sequences never find them, and the pool's invariants hold. */
static void test_draft_guest_tiers(void **state) {
    (void)state;
    kvlm_model *m, *dm;
    TU_REQUIRE(load_guest_pair(&m, &dm));
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/kvlm-guest-XXXXXX");
    assert_non_null(mkdtemp(dir));
    enum { N = 150, FILL = 320 };
    int32_t prompt[N], prompt2[N], other[FILL];
    for (int i = 0; i < N; i++) prompt[i] = 1 + (i * 37) % 200;
    for (int i = 0; i < N; i++) prompt2[i] = 3 + (i * 41) % 250;
    for (int i = 0; i < FILL; i++) other[i] = 2 + (i * 53) % 300;
    int V = kvlm_vocab_size(dm);
    float *want = malloc((size_t)V * sizeof *want), *want2 = malloc((size_t)V * sizeof *want2);
    for (int round = 0; round < 2; round++) {
        kvlm_ctx_params cp = ctx_params(1, FILL / 16, 0); /* the model's FILL tokens take every block */
        cp.n_ctx = 512;
        cp.n_seq_draft = 1;
        cp.kv_host_size = 16 << 20;
        cp.kv_disk = dir;
        kvlm_error err = {0};
        kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err), *dctx;
        assert_non_null(ctx);
        assert_non_null(dctx = kvlm_ctx_create_draft(dm, ctx, NULL, &err));
        int d = kvlm_ctx_seq_first(dctx);
        if (round == 0) {
            assert_int_equal(kvlm_seq_reuse_prefix(dctx, d, prompt, N), 0);
            draft_computes(dctx, d, prompt, N, want, V); /* its 2 full blocks of 64 stay cached */
            kvlm_batch fill = {FILL, other, NULL, NULL, NULL};
            assert_int_equal(kvlm_decode(ctx, &fill, &err), KVLM_OK);
            assert_int_equal(tier_named(ctx, "host").demoted, 2); /* the model's blocks were all in use */
            kvlm_seq_free(ctx, 0);
            draft_finds(ctx, dctx, d, prompt, N, "host", 2, want, V);
            /* blocks only the pool holds when the draft context goes: to disk then */
            draft_computes(dctx, d, prompt2, N, want2, V);
        } else { /* a new context: host memory is empty, the disk kept the draft's blocks */
            assert_int_equal(kvlm_seq_reuse_prefix(ctx, 0, prompt, N), 0); /* the model's keys are not the draft's */
            draft_finds(ctx, dctx, d, prompt, N, "disk", 2, want, V);
            draft_finds(ctx, dctx, d, prompt2, N, "disk", 4, want2, V);
        }
        uint64_t persisted = tier_named(ctx, "disk").persisted;
        kvlm_ctx_free(dctx);
        if (round == 0) assert_true(tier_named(ctx, "disk").persisted >= persisted + 2);
        kvlm_ctx_free(ctx);
    }
    free(want);
    free(want2);
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    kvlm_model_free(dm);
    kvlm_model_free(m);
}

/* The two models' blocks of the same tokens never meet: the draft's
 * sequence finds none of the model's blocks, and each finds its own again. */
static void test_draft_shared_keys(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_model *m = load(path);
    kvlm_ctx_params cp = ctx_params(1, 0, 0);
    cp.n_seq_draft = 1;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err), *dctx = NULL;
    assert_non_null(ctx);
    /* the model itself as the draft: the same bytes, so only the keys keep them apart */
    assert_non_null(dctx = kvlm_ctx_create_draft(m, ctx, NULL, &err));
    int d = kvlm_ctx_seq_first(dctx);
    assert_int_equal(d, 1);
    int32_t prompt[80];
    for (int i = 0; i < 80; i++) prompt[i] = 1 + (i * 37) % 200;
    kvlm_batch b = {80, prompt, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK);
    assert_int_equal(kvlm_seq_reuse_prefix(dctx, d, prompt, 80), 0); /* the model's 5 full blocks: not the draft's */
    kvlm_batch db = {80, prompt, NULL, NULL, NULL};                  /* seq NULL: the draft context's first */
    assert_int_equal(kvlm_decode(dctx, &db, &err), KVLM_OK);
    assert_int_equal(kvlm_seq_n_past(dctx, d), 80);
    int nb, shared;
    kvlm_seq_kv_info(ctx, 0, &nb, &shared);
    assert_int_equal(nb, 5);
    assert_int_equal(shared, 0);
    kvlm_kv_stats ks;
    kvlm_kv_stats_get(ctx, &ks);
    assert_int_equal(ks.used, 10); /* one pool: both sequences' blocks */
    /* each finds its own blocks again */
    kvlm_seq_free(ctx, 0);
    kvlm_seq_free(dctx, d);
    assert_int_equal(kvlm_seq_reuse_prefix(dctx, d, prompt, 80), 64);
    assert_int_equal(kvlm_seq_reuse_prefix(ctx, 0, prompt, 80), 64);
    kvlm_seq_kv_info(ctx, 0, &nb, &shared);
    assert_int_equal(shared, 0);
    /* ids: each context only its own */
    kvlm_batch wrong = {1, prompt, NULL, NULL, (int32_t[]){0}};
    assert_int_equal(kvlm_decode(dctx, &wrong, &err), KVLM_EINVAL);
    printf("  refused: %s\n", err.msg);
    wrong.seq = (int32_t[]){1};
    assert_int_equal(kvlm_decode(ctx, &wrong, &err), KVLM_EINVAL);
    /* one draft context a model's context */
    assert_null(kvlm_ctx_create_draft(m, ctx, NULL, &err));
    printf("  refused: %s\n", err.msg);
    const char *bad = engine_kv_check(ctx);
    if (bad) fail_msg("pool invariants: %s", bad);
    kvlm_ctx_free(dctx);
    kvlm_kv_stats_get(ctx, &ks);
    assert_int_equal(ks.used, 4); /* the draft's sequence went with its context; the model's holds 4 cached blocks */
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

/* A random-weight model of 512 tokens (the stories' and synth's vocabulary
 * size): `layers` x 2 KV heads x 16, windows of `window` keys (gemma2: on its
 * local layers, its classifier tied; llama: on every layer; 0: none). */
static kvlm_model *synth_small(int arch, int layers, int window, uint64_t seed) {
    kvlm_synth_params sp = {0};
    sp.arch = arch;
    sp.dim = 64;
    sp.hidden_dim = 128;
    sp.n_layers = layers;
    sp.n_heads = 4;
    sp.n_kv_heads = 2;
    sp.vocab_size = 512;
    sp.n_ctx = 256;
    sp.sliding_window = window;
    sp.tied_output = arch == KVLM_ARCH_GEMMA2;
    sp.type = kvlm_type_from_name("f32");
    sp.seed = seed;
    const char *p = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, p, &err)) fail_msg("synth: %s", err.msg);
    return load(p);
}
static kvlm_model *synth_gemma2(int layers, uint64_t seed) { return synth_small(KVLM_ARCH_GEMMA2, layers, 8, seed); }
static kvlm_model *synth_llama(int window, uint64_t seed) { return synth_small(KVLM_ARCH_LLAMA, 2, window, seed); }

/* Drafts of another shape or other windows, as guests that keep all their
 * blocks, all their layers in the global store: under a llama with a window
 * of 8 on every layer (its pool's one store drops the blocks before each
 * sequence's window), a gemma2 of another shape (its own local windows) and
 * a llama of the same shape without windows; under a gemma2 of 4 layers (its
 * local layers in a store of their own), a gemma2 of 2 (the pattern of Gemma
 * 2 2B drafting for 9B). Over a prompt of 100 tokens fed in two pieces each
 * one's logits equal those of a context of its own, and the pool then holds
 * every one of its blocks beside the model's; 32 concurrent requests equal
 * each alone in a pool small enough that the drafts give blocks back. */
static void test_draft_guest_windows(void **state) {
    (void)state;
    kvlm_model *wm = synth_llama(8, 11), *gm = synth_gemma2(4, 14);
    struct { kvlm_model *m, *dm; const char *what; } cases[3] = {
        {wm, synth_gemma2(4, 12), "a windowed llama, a gemma2 (4 x 2 x 16) drafting"},
        {wm, synth_llama(0, 13), "a windowed llama, a llama without windows drafting"},
        {gm, synth_gemma2(2, 15), "a gemma2 of 4 layers, one of 2 drafting"},
    };
    for (int k = 0; k < 3; k++) {
        kvlm_model *m = cases[k].m, *dm = cases[k].dm;
        kvlm_ctx_params cp = ctx_params(2, 0, 0);
        cp.block_size = 4;
        assert_true(kvlm_draft_shares_pool(m, dm, &cp));
        cp.n_seq_draft = 2;
        cp.draft_model = dm;
        kvlm_error err = {0};
        kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err), *dctx = ctx ? kvlm_ctx_create_draft(dm, ctx, NULL, &err) : NULL;
        if (!dctx) fail_msg("draft in the windowed pool: %s", err.msg);
        kvlm_ctx_params op = ctx_params(1, 0, 0);
        op.block_size = 4;
        kvlm_ctx *own = kvlm_ctx_create(dm, &op, &err);
        assert_non_null(own);
        int32_t prompt[100];
        for (int i = 0; i < 100; i++) prompt[i] = 3 + (i * 37) % 500;
        kvlm_batch b = {100, prompt, NULL, NULL, NULL};
        assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK);
        int V = kvlm_vocab_size(dm), d = kvlm_ctx_seq_first(dctx);
        float *want = malloc((size_t)V * sizeof *want), *got = malloc((size_t)V * sizeof *got);
        draft_computes(own, 0, prompt, 100, want, V);
        kvlm_kv_stats before, ks, ds;
        kvlm_kv_stats_get(ctx, &before);
        /* in two pieces: the second's queries read the blocks of the first */
        kvlm_batch b1 = {60, prompt, NULL, NULL, NULL}, b2 = {40, prompt + 60, NULL, NULL, NULL};
        assert_int_equal(kvlm_decode(dctx, &b1, &err), KVLM_OK);
        assert_int_equal(kvlm_decode(dctx, &b2, &err), KVLM_OK);
        memcpy(got, kvlm_get_logits(dctx, -1), (size_t)V * sizeof *got);
        double diff = tu_max_rel_diff(got, want, V, 1e-2);
        kvlm_kv_stats_get(ctx, &ks);
        kvlm_kv_stats_get(dctx, &ds);
        int dblocks = (100 + ds.block_size - 1) / ds.block_size;
        printf("  %s: %d of its tokens a block, logits against its own context %.2g; it holds %d blocks beside "
               "the model's %d\n", cases[k].what, ds.block_size, diff, ks.used - before.used, before.used);
        assert_true(diff < 1e-3);
        assert_int_equal(ks.used - before.used, dblocks); /* all of its 100 tokens' blocks */
        const char *bad = engine_kv_check(ctx);
        if (bad) fail_msg("pool invariants: %s", bad);
        kvlm_seq_free(dctx, d);
        free(want);
        free(got);
        kvlm_ctx_free(own);
        kvlm_ctx_free(dctx);
        kvlm_ctx_free(ctx);
        kvlm_sched_stats st;
        draft_concurrent(m, dm, tu_quick() ? -60 : -120, 4, false, &st);
        assert_true(st.spec_drafted > 0);
        assert_int_equal(st.spec_draft_failures, 0);
    }
    for (int k = 0; k < 3; k++) kvlm_model_free(cases[k].dm);
    kvlm_model_free(gm);
    kvlm_model_free(wm);
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
    syp.n_layers = 8; /* 8 x 4 KV heads x 16: more bytes per token than stories260K's 5 x 4 x 8 */
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
    /* the shared pool: a cache larger per token than the model's whole
     * block (om's 512 elements a token, 2-token blocks of stories260K's
     * 160), and a context without sequences for a draft */
    kvlm_ctx_params cp = ctx_params(4, 0, 0);
    cp.block_size = 2;
    assert_false(kvlm_draft_shares_pool(m, om, &cp));
    cp.block_size = 4;
    assert_true(kvlm_draft_shares_pool(m, om, &cp)); /* 1 of its tokens a block */
    cp.block_size = 2;
    cp.n_seq_draft = 4;
    kvlm_ctx *host = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(host);
    assert_null(kvlm_ctx_create_draft(om, host, NULL, &err));
    assert_non_null(strstr(err.msg, "bytes for one token"));
    printf("  refused: %s\n", err.msg);
    assert_null(kvlm_ctx_create_draft(m, ctx, NULL, &err));
    assert_non_null(strstr(err.msg, "n_seq_draft"));
    printf("  refused: %s\n", err.msg);
    /* sliding windows: a draft with the model's shape and windows shares
     * its pool, and so does one with another shape, other windows or none
     * (as a guest that keeps all its blocks, all its layers in the global
     * store), either way round, gemma's local store or not */
    syp.n_layers = 2;
    syp.vocab_size = 512;
    kvlm_model *wm[3];
    for (int i = 0; i < 3; i++) {
        syp.sliding_window = i == 2 ? 0 : 8;
        syp.seed = 5 + (uint64_t)i;
        const char *wp = tu_tmp_path(".gguf");
        if (kvlm_model_synth(&syp, wp, &err)) fail_msg("synth: %s", err.msg);
        wm[i] = load(wp);
    }
    kvlm_ctx_params wcp = ctx_params(2, 0, 0);
    assert_true(kvlm_draft_shares_pool(wm[0], wm[1], &wcp));
    assert_true(kvlm_draft_shares_pool(wm[0], wm[2], &wcp));
    assert_true(kvlm_draft_shares_pool(wm[2], wm[0], &wcp));
    kvlm_model *gm[2];
    for (int i = 0; i < 2; i++) gm[i] = synth_gemma2(4 - 2 * i, 6 + (uint64_t)i);
    assert_true(kvlm_draft_shares_pool(gm[0], gm[0], &wcp));
    assert_true(kvlm_draft_shares_pool(wm[2], gm[0], &wcp)); /* a gemma draft, its layers in the guest layout */
    assert_true(kvlm_draft_shares_pool(wm[0], gm[0], &wcp));
    assert_true(kvlm_draft_shares_pool(gm[0], gm[1], &wcp));
    assert_true(kvlm_draft_shares_pool(gm[0], wm[2], &wcp));
    for (int i = 0; i < 2; i++) kvlm_model_free(gm[i]);
    /* latent rows (deepseek2): the model itself shares its pool, a llama does not (either way round) */
    kvlm_synth_params dsp = {0};
    dsp.arch = KVLM_ARCH_DEEPSEEK2;
    dsp.dim = 128;
    dsp.n_heads = 4;
    dsp.n_kv_heads = 4;
    dsp.head_dim = 48;
    dsp.kv_lora_rank = 64;
    dsp.rope_dim = 16;
    dsp.hidden_dim = 256;
    dsp.n_layers = 2;
    dsp.vocab_size = 512;
    dsp.n_ctx = 256;
    dsp.type = kvlm_type_from_name("f32");
    dsp.seed = 7;
    const char *dp = tu_tmp_path(".gguf");
    if (kvlm_model_synth(&dsp, dp, &err)) fail_msg("synth: %s", err.msg);
    kvlm_model *ds = load(dp);
    assert_true(kvlm_draft_shares_pool(ds, ds, &wcp));
    assert_false(kvlm_draft_shares_pool(ds, wm[2], &wcp));
    assert_false(kvlm_draft_shares_pool(wm[2], ds, &wcp));
    kvlm_model_free(ds);
    for (int i = 0; i < 3; i++) kvlm_model_free(wm[i]);
    kvlm_ctx_free(host);
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
        cmocka_unit_test(test_draft_min),
        cmocka_unit_test(test_draft_q4_0_copy),
        cmocka_unit_test(test_draft_cancel_and_sample),
        cmocka_unit_test(test_draft_shared_pool),
        cmocka_unit_test(test_draft_release_some),
        cmocka_unit_test(test_draft_shared_keys),
        cmocka_unit_test(test_draft_guest_pool),
        cmocka_unit_test(test_draft_guest_tiers),
        cmocka_unit_test(test_draft_guest_larger),
        cmocka_unit_test(test_draft_q4_kc_pool),
        cmocka_unit_test(test_draft_shared_evict),
        cmocka_unit_test(test_draft_guest_windows),
        cmocka_unit_test(test_draft_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
