/* bench/bench_spec_pool: one memory budget for a model and its draft model.
 * R concurrent greedy requests through the scheduler, drafted by a q4_0 copy
 * of the model (or DRAFT: a smaller model of the same vocabulary, whose
 * cache has another shape), with the KV memory fixed at B blocks of the
 * model's layout:
 *   plain:  no speculation, a pool of B;
 *   split:  the draft's cache in a pool of its own, the bytes of B split in
 *           two halves (what a user had to choose before);
 *   shared: the draft's cache in the model's pool of B (kvlm_ctx_create_draft),
 *           given back before any request is preempted.
 * Prints tokens/s (the best of three runs), the model's steps (reads of
 * its weights), preemptions, drafts kept, the draft's tokens run and
 * the ratios, in one process;
 * exits 1 unless every mode's texts are the same. On stories4M_hd64 (real
 * weights; $KVLM_MODELS, default ../shared/models) or a model path.
 * K (default 4) drafts a step, ending early where the draft model gives its
 * likeliest token less than P_MIN (default 0: never; --draft-p-min).
 * Usage: bench_spec_pool [THREADS] [MODEL] [R] [B] [DRAFT|-] [K] [P_MIN] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench_common.h"
#include "kvlm.h"
#include "util/timing.h"

enum { GEN = 128, MAXR = 64 };
static int K = 4;
static float P_MIN = 0;

typedef struct { int32_t out[GEN]; int n; } text; /* up to GEN tokens, or fewer at an end token */

static bool on_event(void *user, const kvlm_sched_event *ev) {
    text *t = user;
    if (!ev->finish && t->n < GEN) t->out[t->n++] = ev->token;
    return true;
}

static void die(const char *what, const kvlm_error *err) {
    fprintf(stderr, "bench_spec_pool: %s: %s\n", what, err->msg);
    exit(1);
}

typedef struct { double tps; kvlm_sched_stats st; uint64_t draft_run; } result; /* draft_run: tokens the draft model ran */

/* mode 0 plain, 1 split, 2 shared */
static result run(kvlm_model *m, kvlm_model *dm, int mode, int threads, int R, int B, int32_t (*prompts)[64],
                  const int *n_prompt, text *texts) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_threads = threads;
    cp.n_ctx = 512;
    cp.n_seq_max = R;
    cp.n_batch = 256;
    cp.block_size = 16;
    cp.kv_blocks = mode == 1 ? B / 2 : B;
    cp.no_kv_swap = true; /* preemption recomputes: its cost shows in tokens/s */
    if (mode == 2) cp.n_seq_draft = R;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err), *dctx = NULL;
    if (!ctx) die("context", &err);
    if (mode == 1) { /* the other half of the bytes, in blocks of the draft's own layout */
        kvlm_kv_stats ks;
        kvlm_kv_stats_get(ctx, &ks);
        kvlm_ctx_params dp = cp;
        dp.kv_blocks = 0;
        dp.kv_mem = (size_t)(B - B / 2) * ks.block_bytes;
        if (!(dctx = kvlm_ctx_create(dm, &dp, &err))) die("draft context", &err);
    } else if (mode == 2 && !(dctx = kvlm_ctx_create_draft(dm, ctx, &cp, &err))) {
        die("draft context in the pool", &err);
    }
    kvlm_sched_params sp = {.batch_tokens = 256, .max_seqs = R, .spec_mode = mode ? KVLM_SPEC_DRAFT : KVLM_SPEC_NONE,
                            .spec_n_draft = mode ? K : 0, .draft_ctx = dctx, .spec_p_min = mode ? P_MIN : 0};
    kvlm_sched *s = kvlm_sched_create(ctx, &sp, &err);
    if (!s) die("scheduler", &err);
    for (int i = 0; i < R; i++) {
        kvlm_request_params p = {0};
        p.sampling = kvlm_sampler_default_params();
        p.sampling.temperature = 0;
        p.max_tokens = GEN;
        p.n = 1;
        p.logprobs = -1;
        texts[i].n = 0;
        if (kvlm_sched_submit(s, prompts[i], n_prompt[i], &p, on_event, &texts[i], &err) <= 0) die("submit", &err);
    }
    double t0 = util_now_s();
    while (kvlm_sched_step(s) > 0) {}
    result r;
    long n_tok = 0;
    for (int i = 0; i < R; i++) n_tok += texts[i].n;
    r.tps = (double)n_tok / (util_now_s() - t0);
    kvlm_sched_stats_get(s, &r.st);
    r.draft_run = 0;
    if (dctx) {
        kvlm_kv_stats ds;
        kvlm_kv_stats_get(dctx, &ds);
        r.draft_run = ds.tokens_computed;
    }
    kvlm_sched_free(s);
    kvlm_ctx_free(dctx);
    kvlm_ctx_free(ctx);
    return r;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0;
    char def[4096];
    const char *dir = getenv("KVLM_MODELS") ? getenv("KVLM_MODELS") : "../shared/models";
    snprintf(def, sizeof def, "%s/stories4M_hd64.gguf", dir);
    const char *path = argc > 2 ? argv[2] : def;
    int R = argc > 3 ? atoi(argv[3]) : 16, B = argc > 4 ? atoi(argv[4]) : 192;
    if (R < 1 || R > MAXR || B < 4) { fprintf(stderr, "bench_spec_pool: R in 1..%d, B >= 4\n", MAXR); return 2; }
    kvlm_model *m = bench_load(path);
    char q[4200];
    const char *bd = getenv("KVLM_BENCH_DIR") ? getenv("KVLM_BENCH_DIR") : "/tmp/kvlm-bench";
    mkdir(bd, 0755);
    snprintf(q, sizeof q, "%s/bench_spec_pool-draft-q4_0.gguf", bd);
    kvlm_error err = {0};
    const char *dpath = argc > 5 && strcmp(argv[5], "-") ? argv[5] : NULL;
    if (argc > 6) K = atoi(argv[6]);
    if (argc > 7) P_MIN = (float)atof(argv[7]);
    if (K < 1 || K > 16 || !(P_MIN >= 0 && P_MIN < 1)) {
        fprintf(stderr, "bench_spec_pool: K in 1..16, 0 <= P_MIN < 1\n");
        return 2;
    }
    if (!dpath && kvlm_model_save_gguf(m, q, kvlm_type_from_name("q4_0"), &err)) die("q4_0 copy", &err);
    kvlm_model *dm = bench_load(dpath ? dpath : q);
    static const char *subj[] = {"Lily", "Tom", "A little dog", "The old man", "Sue", "Max", "A bird", "Ben"};
    static const char *verb[] = {"went to the park", "found a ball", "was very sad", "liked to play"};
    int32_t (*prompts)[64] = malloc(sizeof(int32_t[64]) * MAXR);
    int n_prompt[MAXR];
    for (int i = 0; i < R; i++) {
        char t[256];
        snprintf(t, sizeof t, "Once upon a time, %s %s. %s", subj[i % 8], verb[(i / 8) % 4], i % 2 ? "One day" : "Then");
        if ((n_prompt[i] = kvlm_tokenize(m, t, strlen(t), true, false, prompts[i], 64, &err)) <= 0) die("tokenize", &err);
    }
    text *tx[3];
    result r[3];
    static const char *names[] = {"plain (no speculation)", "split (draft pool of its own)", "shared (one pool)"};
    int need = 0;
    for (int i = 0; i < R; i++) need += (n_prompt[i] + GEN + 15) / 16;
    printf("bench_spec_pool: %s, %s%s drafting %d tokens (p_min %.2f); %d greedy requests of %d tokens; KV memory "
           "%d blocks of 16 tokens (the requests alone need about %d); %d threads\n",
           path, dpath ? dpath : "its q4_0 copy", dpath ? " (another cache shape)" : "", K, (double)P_MIN, R, GEN, B,
           need, threads);
    for (int k = 0; k < 3; k++) {
        tx[k] = calloc((size_t)R, sizeof(text));
        for (int rep = 0; rep < 3; rep++) { /* the best of three: the runs are short */
            result x = run(m, dm, k, threads, R, B, prompts, n_prompt, tx[k]);
            if (rep == 0 || x.tps > r[k].tps) r[k] = x;
        }
        printf("  %-30s %7.1f tokens/s  %4llu steps  %4llu preemptions  drafts kept %llu/%llu  draft sequences given "
               "back %llu  draft tokens run %llu  failures %llu  waits %llu\n",
               names[k], r[k].tps, (unsigned long long)r[k].st.steps, (unsigned long long)r[k].st.preemptions,
               (unsigned long long)r[k].st.spec_accepted, (unsigned long long)r[k].st.spec_drafted,
               (unsigned long long)r[k].st.spec_draft_released, (unsigned long long)r[k].draft_run,
               (unsigned long long)r[k].st.spec_draft_failures, (unsigned long long)r[k].st.spec_draft_waits);
    }
    int bad = 0;
    for (int k = 1; k < 3; k++)
        for (int i = 0; i < R; i++)
            if (tx[k][i].n != tx[0][i].n || memcmp(tx[k][i].out, tx[0][i].out, (size_t)tx[0][i].n * sizeof(int32_t)))
                bad++;
    printf("  shared / split: %.2fx   shared / plain: %.2fx   split / plain: %.2fx   texts %s\n", r[2].tps / r[1].tps,
           r[2].tps / r[0].tps, r[1].tps / r[0].tps, bad ? "DIFFER" : "the same in all three");
    for (int k = 0; k < 3; k++) free(tx[k]);
    free(prompts);
    kvlm_model_free(dm);
    kvlm_model_free(m);
    return bad ? 1 : 0;
}
