/* bench/bench_paged: what paging buys, each figure a ratio measured in one run:
 *  1. memory waste: 1,000 requests with random prompt and output lengths up
 *     to the context, served by a simulated continuous-batching loop over the
 *     real block allocator: bytes reserved against bytes holding live tokens,
 *     contiguous max-length reservation against paged;
 *  2. capacity: how many such requests fit at once in a fixed budget;
 *  3. time to first token for a request sharing a 1,000-token prefix with an
 *     earlier one, cold against warm (prefix reuse), on a random-weight model
 *     of a real shape. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench_common.h"
#include "kv/paged.h"
#include "kvlm.h"
#include "util/timing.h"

static uint64_t rng = 12345;
static int rnd(int n) {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (int)((rng >> 33) % (uint64_t)n);
}

typedef struct { int prompt, output, done; } request;

/* 1 + 2: a serving loop over the real paged allocator (no model math: only
 * the bookkeeping decides memory). Requests arrive, prefill their prompt,
 * then grow one token per step until their output is done. */
static void memory_and_capacity(void) {
    const int n_ctx = 2048, bs = 16, n_req = 1000, slots = 64;
    /* Shape of stories110M's cache does not matter for ratios; use 1 layer/head. */
    kv_params p = {1, 1, 4, bs, slots * n_ctx / bs, slots, n_ctx, 1, false, KVLM_CACHE_F32, KVLM_CACHE_F32, NULL, {{0}}, false, NULL, 0};
    kvlm_error err = {0};
    kv_cache *c = kv_create(&p, &err);
    if (!c) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    request *rq = calloc(n_req, sizeof *rq);
    for (int i = 0; i < n_req; i++) {
        int total = 2 + rnd(n_ctx - 1);          /* 2..n_ctx tokens */
        rq[i].prompt = 1 + rnd(total - 1);
        rq[i].output = total - rq[i].prompt;
    }
    int slot_req[64];
    for (int s = 0; s < slots; s++) slot_req[s] = -1;
    int next = 0, finished = 0;
    double live_sum = 0, paged_sum = 0, contig_sum = 0;
    long steps = 0;
    int32_t toks[2048] = {0};
    while (finished < n_req) {
        for (int s = 0; s < slots; s++) {
            if (slot_req[s] < 0 && next < n_req) { /* admit and prefill */
                slot_req[s] = next++;
                if (kv_seq_reserve(c, s, rq[slot_req[s]].prompt, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
                kv_seq_commit(c, s, toks, rq[slot_req[s]].prompt);
            } else if (slot_req[s] >= 0) { /* one decode step */
                request *r = &rq[slot_req[s]];
                if (r->done == r->output) {
                    kv_seq_release(c, s);
                    slot_req[s] = -1;
                    finished++;
                    continue;
                }
                if (kv_seq_reserve(c, s, 1, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
                kv_seq_commit(c, s, toks, 1);
                r->done++;
            }
        }
        kv_stats st;
        kv_get_stats(c, &st);
        long live = 0, active = 0;
        for (int s = 0; s < slots; s++)
            if (slot_req[s] >= 0) { live += kv_seq_len(c, s); active++; }
        live_sum += (double)live;
        paged_sum += (double)st.used * bs;
        contig_sum += (double)active * n_ctx;
        steps++;
    }
    double waste_paged = 1.0 - live_sum / paged_sum, waste_contig = 1.0 - live_sum / contig_sum;
    printf("memory waste: %d requests, lengths uniform in 2..%d, %d at a time, blocks of %d, %ld steps\n", n_req,
           n_ctx, slots, bs, steps);
    printf("  contiguous (reserve %d per request): %5.1f%% of reserved bytes hold no token\n", n_ctx,
           100 * waste_contig);
    printf("  paged:                                %5.2f%% of reserved bytes hold no token\n", 100 * waste_paged);
    printf("  reserved bytes per live byte: contiguous %.2f, paged %.3f -> paged reserves %.1fx less\n",
           contig_sum / live_sum, paged_sum / live_sum, contig_sum / paged_sum);

    /* 2: capacity. A budget of 16 full contexts; admit requests (at their
     * final length) until the next one does not fit. */
    int budget_tokens = 16 * n_ctx;
    long fit_contig = budget_tokens / n_ctx, used_blocks = 0, fit_paged = 0;
    for (int i = 0; i < n_req; i++) {
        long need = (rq[i].prompt + rq[i].output + bs - 1) / bs;
        if (used_blocks + need > budget_tokens / bs) break;
        used_blocks += need;
        fit_paged++;
    }
    printf("capacity: a budget of %d tokens' KV (%d full contexts):\n", budget_tokens, budget_tokens / n_ctx);
    printf("  contiguous fits %ld requests at once, paged fits %ld -> %.1fx\n", fit_contig, fit_paged,
           (double)fit_paged / (double)fit_contig);
    free(rq);
    kv_free(c);
}

/* 3: time to first token with and without a shared 1,000-token prefix. */
static void ttft(const char *model_path, int threads) {
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(model_path, NULL, &err);
    if (!m) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    char desc[512];
    kvlm_model_describe(m, desc, sizeof desc);
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 1536;
    cp.n_seq_max = 2;
    cp.n_threads = threads;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    int V = kvlm_model_config(m)->vocab_size, np = 1000, ns = 24;
    int32_t *a = malloc(sizeof(int32_t) * (np + ns)), *b = malloc(sizeof(int32_t) * (np + ns));
    for (int i = 0; i < np + ns; i++) a[i] = b[i] = 3 + rnd(V - 3);
    for (int i = np; i < np + ns; i++) b[i] = 3 + rnd(V - 3);
    a[0] = b[0] = 1;
    /* Cold: request A, nothing cached. */
    double t0 = util_now_s();
    kvlm_batch ba = {np + ns, a, NULL, NULL, NULL};
    if (kvlm_decode(ctx, &ba, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    double cold = util_now_s() - t0;
    kvlm_seq_free(ctx, 0);
    /* Warm: request B shares A's first 1,000 tokens. */
    kvlm_kv_stats s0, s1;
    kvlm_kv_stats_get(ctx, &s0);
    t0 = util_now_s();
    int reused = kvlm_seq_reuse_prefix(ctx, 1, b, np + ns);
    int32_t seq1[1100];
    for (int i = 0; i < 1100; i++) seq1[i] = 1;
    kvlm_batch bb = {np + ns - reused, b + reused, NULL, NULL, seq1};
    if (kvlm_decode(ctx, &bb, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    double warm = util_now_s() - t0;
    kvlm_kv_stats_get(ctx, &s1);
    printf("time to first token, %d-token prompt sharing a %d-token prefix with an earlier request:\n", np + ns, np);
    printf("  model: %s\n  %s\n", model_path, desc);
    printf("  cold %.1f ms (%d tokens computed), warm %.1f ms (%d reused, %llu computed) -> %.1fx faster\n",
           cold * 1e3, np + ns, warm * 1e3, reused, (unsigned long long)(s1.tokens_computed - s0.tokens_computed),
           cold / warm);
    free(a);
    free(b);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

int main(int argc, char **argv) {
    memory_and_capacity();
    const char *path = argc > 1 ? argv[1] : NULL;
    char tmp[512];
    bench_shape s15 = {"stories15M", 288, 768, 6, 6, 6, 32000, 2048}; /* random weights, real shape */
    if (!path) path = bench_model_path(&s15, "f32", tmp, sizeof tmp);
    ttft(path, argc > 2 ? atoi(argv[2]) : 0);
    return 0;
}
