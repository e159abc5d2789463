/* bench/bench_evict: decode tokens/s along a long stream with a growing cache
 * (none) against a cache bounded to 256 tokens by attention sinks, printed
 * as a ratio in one run; and the cost of keeping RoPE positions by place in
 * the cache: re-rotating moved keys at each eviction (what kvlm does) against
 * rotating every cached key at attention time (the alternative).
 * Random weights of SmolLM2-135M's shape; the cache of `none` is filled with
 * synthetic keys/values through the normal write path (decode speed does not
 * depend on their values). */
#include <stdio.h>
#include <stdlib.h>
#include "bench_common.h"
#include "engine/engine.h"
#include "kvlm.h"
#include "ops/ops.h"
#include "util/timing.h"

static kvlm_ctx *make_ctx(kvlm_model *m, int n_ctx, int budget, int policy, int threads) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = n_ctx;
    cp.n_threads = threads;
    cp.kv_budget = budget;
    cp.kv_evict = policy;
    cp.cache_type_k = cp.cache_type_v = KVLM_CACHE_Q8_0;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    return ctx;
}

static double decode(kvlm_ctx *ctx, int steps) {
    kvlm_error err = {0};
    int32_t tok = 5;
    kvlm_batch b = {1, &tok, NULL, NULL, NULL};
    double t0 = util_now_s();
    for (int i = 0; i < steps; i++)
        if (kvlm_decode(ctx, &b, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    return steps / (util_now_s() - t0);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0;
    int max_len = argc > 2 ? atoi(argv[2]) : 8192, budget = 256, steps = 16;
    bench_shape smol = {"smollm2-135M", 576, 1536, 30, 9, 3, 49152, 32768};
    char path[512];
    kvlm_model *m = bench_load(bench_model_path(&smol, "q8_0", path, sizeof path));
    const kvlm_config *c = kvlm_model_config(m);
    printf("bench_evict: decode tokens/s along a stream, q8_0 cache, random weights of SmolLM2-135M's shape\n");

    /* sinks: the cache stays within the budget; tokens/s over consecutive stretches of the stream */
    kvlm_ctx *sk = make_ctx(m, budget, budget, KVLM_EVICT_SINKS, threads);
    kvlm_error err = {0};
    if (engine_seq_fill_synthetic(sk, 0, budget - 8, 7, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    decode(sk, 2); /* warm */
    int n_seg = 4, seg = 48;
    double sinks_tps = 0, sinks_best = 0, t_all = util_now_s(), ev0 = engine_evict_seconds(sk);
    printf("  sinks, budget %d (evicting %d tokens at a time):\n", budget, 16);
    for (int s = 0; s < n_seg; s++) {
        double tps = decode(sk, seg);
        sinks_tps += tps / n_seg;
        if (tps > sinks_best) sinks_best = tps;
        printf("    stream tokens %4d-%4d: %7.2f tokens/s, cache %d tokens, %ld evicted so far\n", budget - 6 + s * seg,
               budget - 6 + (s + 1) * seg - 1, tps, kvlm_seq_n_past(sk, 0), kvlm_seq_n_evicted(sk, 0));
    }
    double ev_per_tok = (engine_evict_seconds(sk) - ev0) / (n_seg * seg), step_s = (util_now_s() - t_all) / (n_seg * seg);
    kvlm_ctx_free(sk);
    /* h2o: the same, plus the attention weights pass of every layer */
    kvlm_ctx *hh = make_ctx(m, budget, budget, KVLM_EVICT_H2O, threads);
    if (engine_seq_fill_synthetic(hh, 0, budget - 8, 7, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    decode(hh, 2);
    double h2o_tps = 0;
    for (int s = 0; s < n_seg; s++) {
        double tps = decode(hh, seg);
        if (tps > h2o_tps) h2o_tps = tps;
    }
    printf("  h2o, budget %d: %.2f tokens/s, best of %d stretches (%.2fx sinks' best: the cost of accumulating "
           "attention weights)\n", budget, h2o_tps, n_seg, h2o_tps / sinks_best);
    kvlm_ctx_free(hh);

    /* none: the cache holds the whole stream */
    kvlm_ctx *none = make_ctx(m, max_len + 64, 0, KVLM_EVICT_NONE, threads);
    double none_tps = 0;
    printf("  none (the cache grows with the stream):\n");
    for (int n = budget; n <= max_len; n *= 2) {
        kvlm_seq_free(none, 0);
        if (engine_seq_fill_synthetic(none, 0, n, 7, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
        decode(none, 1);
        none_tps = decode(none, n >= 4096 ? steps / 2 : steps);
        printf("    stream token  %5d: %7.2f tokens/s (sinks: %.2f, %.2fx)\n", n, none_tps, sinks_tps, sinks_tps / none_tps);
        fflush(stdout);
    }
    kvlm_ctx_free(none);
    printf("sinks vs none at %d tokens: %.2fx the decode speed (%.2f vs %.2f tokens/s)\n", max_len, sinks_tps / none_tps,
           sinks_tps, none_tps);

    /* The alternative to re-rotating at eviction: keys stored unrotated and
     * rotated at attention time, i.e. every cached key of every layer and KV
     * head rotated at every step. */
    int per_pos = c->n_layers * c->n_kv_heads; /* one set of angles per position for all its rows */
    float *k = calloc((size_t)budget * per_pos * c->head_dim, sizeof(float));
    double t0 = util_now_s();
    int reps = 20;
    for (int r = 0; r < reps; r++)
        for (int p = 0; p < budget; p++)
            op_rope(k + (size_t)p * per_pos * c->head_dim, per_pos, c->head_dim, c->rope_dim, p + r, c->rope_base, false);
    double rope_per_tok = (util_now_s() - t0) / reps;
    free(k);
    printf("positions by place in the cache, per decoded token: re-rotating at eviction %.3f ms (%.1f%% of a %.1f ms "
           "step), rotating all %d cached keys at attention time %.3f ms -> %.1fx more\n",
           1e3 * ev_per_tok, 100 * ev_per_tok / step_s, 1e3 * step_s, budget, 1e3 * rope_per_tok,
           rope_per_tok / ev_per_tok);
    kvlm_model_free(m);
    return 0;
}
