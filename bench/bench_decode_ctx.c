/* bench/bench_decode_ctx: decode tokens/s against context length for f16,
 * q8_0 and q4_0 KV caches, on random-weight models of real shapes, with the
 * naive attention (dequantize everything, materialise the softmax) run in the
 * same process as the baseline, and the fraction of each step spent in
 * attention. The cache is filled with synthetic keys/values through the
 * normal write path: decode speed does not depend on their values. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench_common.h"
#include "engine/engine.h"
#include "kvlm.h"
#include "util/timing.h"

static kvlm_model *load_shape(const bench_shape *s, const char *wtype) {
    char path[512];
    return bench_load(bench_model_path(s, wtype, path, sizeof path));
}

/* Decode tokens/s at context n (mean over `steps` tokens) and the share of
 * the time spent in attention. */
static double decode_at(kvlm_ctx *ctx, int n, int steps, bool naive, double *attn_share) {
    kvlm_error err = {0};
    kvlm_seq_free(ctx, 0);
    if (engine_seq_fill_synthetic(ctx, 0, n, 7, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    engine_set_naive_attention(ctx, naive);
    int32_t tok = 5;
    kvlm_batch b = {1, &tok, NULL, NULL, NULL};
    if (kvlm_decode(ctx, &b, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); } /* warm */
    double a0 = engine_attention_seconds(ctx), t0 = util_now_s();
    for (int i = 0; i < steps; i++)
        if (kvlm_decode(ctx, &b, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    double dt = util_now_s() - t0;
    *attn_share = (engine_attention_seconds(ctx) - a0) / dt;
    return steps / dt;
}

static kvlm_ctx *make_ctx(kvlm_model *m, int n_ctx, const char *cache, int threads) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = n_ctx;
    cp.n_threads = threads;
    cp.cache_type_k = cp.cache_type_v = kvlm_cache_type_from_name(cache);
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    return ctx;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0;
    int max_ctx = argc > 2 ? atoi(argv[2]) : 16384;
    const char *caches[] = {"f16", "q8_0", "q4_0"};
    bench_shape smol = {"smollm2-135M", 576, 1536, 30, 9, 3, 49152, 32768};
    kvlm_model *m = load_shape(&smol, "q8_0");
    char desc[512];
    kvlm_model_describe(m, desc, sizeof desc);
    printf("bench_decode_ctx: decode tokens/s against context, random weights of SmolLM2-135M's shape (GQA 9:3)\n  %s\n", desc);
    printf("  %-5s %7s %12s %12s %9s %12s\n", "cache", "context", "tokens/s", "naive tok/s", "speedup", "attention");
    for (int c = 0; c < 3; c++) {
        kvlm_ctx *ctx = make_ctx(m, max_ctx + 64, caches[c], threads);
        for (int n = 256; n <= max_ctx; n *= 2) {
            int steps = n >= 8192 ? 6 : 12;
            double share, nshare;
            double fast = decode_at(ctx, n, steps, false, &share);
            double naive = decode_at(ctx, n, n >= 8192 ? 3 : 6, true, &nshare);
            printf("  %-5s %7d %12.2f %12.2f %8.2fx %11.0f%%\n", caches[c], n, fast, naive, fast / naive, 100 * share);
            fflush(stdout);
        }
        kvlm_ctx_free(ctx);
    }
    kvlm_model_free(m);

    /* The target: stories110M's shape in Q8_0 with a q8_0 cache, 4096 vs 128. */
    bench_shape s110 = {"stories110M", 768, 2048, 12, 12, 12, 32000, 32768};
    m = load_shape(&s110, "q8_0");
    kvlm_ctx *ctx = make_ctx(m, 4096 + 64, "q8_0", threads);
    double s128, s4k, tps128 = decode_at(ctx, 128, 24, false, &s128), tps4k = decode_at(ctx, 4096, 24, false, &s4k);
    printf("stories110M shape, Q8_0 weights, q8_0 cache: %.1f tokens/s at 128, %.1f at 4096 -> %.0f%% slower "
           "(attention %.0f%% of the step at 4096)\n",
           tps128, tps4k, 100 * (tps128 / tps4k - 1), 100 * s4k);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
    return 0;
}
