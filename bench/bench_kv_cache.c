/* bench/bench_kv_cache: generating N tokens with the KV cache against the
 * naive loop that recomputes the whole sequence for every token, in one run:
 * the cached loop grows linearly with N, the naive one quadratically. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kvlm.h"
#include "util/timing.h"

/* Seconds to prefill `prompt` tokens and then decode n tokens greedily. */
static double time_generate(kvlm_model *m, bool no_cache, int n, int threads) {
    kvlm_error err = {0};
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.no_kv_cache = no_cache;
    cp.n_threads = threads;
    cp.n_ctx = n + 8;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    int32_t tok = kvlm_token_bos(m) >= 0 ? kvlm_token_bos(m) : 0;
    int V = kvlm_model_config(m)->vocab_size;
    double t0 = util_now_s();
    for (int i = 0; i < n; i++) {
        kvlm_batch b = {1, &tok, NULL, NULL, NULL};
        if (kvlm_decode(ctx, &b, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
        const float *l = kvlm_get_logits(ctx, -1);
        int best = 0;
        for (int v = 1; v < V; v++) if (l[v] > l[best]) best = v;
        tok = best;
    }
    double dt = util_now_s() - t0;
    kvlm_ctx_free(ctx);
    return dt;
}

int main(int argc, char **argv) {
    const char *models = getenv("KVLM_MODELS") ? getenv("KVLM_MODELS") : "../shared/models";
    char def[4096];
    snprintf(def, sizeof def, "%s/stories260K.gguf", models);
    const char *path = argc > 1 ? argv[1] : def;
    int threads = argc > 2 ? atoi(argv[2]) : 0;
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) { fprintf(stderr, "bench_kv_cache: %s\n", err.msg); return 1; }
    char desc[512];
    kvlm_model_describe(m, desc, sizeof desc);
    printf("bench_kv_cache: %s\n  %s\n", path, desc);
    printf("  %6s %14s %14s %10s\n", "N", "with cache s", "recompute s", "ratio");
    int ns[] = {64, 128, 256, 512};
    double prev_c = 0, prev_n = 0;
    for (int i = 0; i < 4; i++) {
        int n = ns[i];
        double tc = time_generate(m, false, n, threads);
        double tn = time_generate(m, true, n, threads);
        printf("  %6d %14.4f %14.4f %9.1fx", n, tc, tn, tn / tc);
        if (prev_c > 0) printf("   (x2 tokens: cache %.2fx time, recompute %.2fx time)", tc / prev_c, tn / prev_n);
        printf("\n");
        prev_c = tc;
        prev_n = tn;
    }
    kvlm_model_free(m);
    return 0;
}
