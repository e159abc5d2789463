/* bench/bench_evict: decode tokens/s along a long stream with a growing cache
 * (none) against a cache bounded to 256 tokens by attention sinks, printed
 * as a ratio in one run; h2o (whose attention kernels also add up each key's
 * weight) against sinks at the same budget; and the cost of keeping RoPE positions by place in
 * the cache: re-rotating moved keys at each eviction (what kvlm does) against
 * rotating every cached key at attention time (the alternative).
 * Random weights of SmolLM2-135M's shape; the cache of `none` is filled with
 * synthetic keys/values through the normal write path (decode speed does not
 * depend on their values). */
#include <math.h>
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

static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
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
    int max_len = argc > 2 ? atoi(argv[2]) : 8192, budget = 256, steps = 16; /* a stretch crosses one eviction */
    bench_shape smol = {"smollm2-135M", 576, 1536, 30, 9, 3, 49152, 32768};
    char path[512];
    kvlm_model *m = bench_load(bench_model_path(&smol, "q8_0", path, sizeof path));
    const kvlm_config *c = kvlm_model_config(m);
    printf("bench_evict: decode tokens/s along a stream, q8_0 cache, random weights of SmolLM2-135M's shape\n");

    /* The three run side by side, a stretch of each in turn, so that a
     * change in the machine's load hits all of them alike. sinks and h2o go
     * on with one long stream (their caches stay within the budget); none is
     * measured at each stream length with a cache holding all of it. */
    kvlm_ctx *sk = make_ctx(m, budget, budget, KVLM_EVICT_SINKS, threads);
    kvlm_ctx *hh = make_ctx(m, budget, budget, KVLM_EVICT_H2O, threads);
    kvlm_ctx *none = make_ctx(m, max_len + 64, 0, KVLM_EVICT_NONE, threads);
    kvlm_error err = {0};
    if (engine_seq_fill_synthetic(sk, 0, budget - 8, 7, &err) || engine_seq_fill_synthetic(hh, 0, budget - 8, 7, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        exit(1);
    }
    decode(sk, 1);
    decode(hh, 1);
    printf("  best of 3 stretches each (%d tokens for none, %d for sinks and h2o, crossing one eviction)\n", steps / 2, steps);
    printf("  %-13s %12s %12s %12s %12s %9s %9s\n", "stream length", "none tok/s", "sinks tok/s", "sinks cache",
           "h2o tok/s", "sinks/none", "h2o/sinks");
    double sinks_tps = 0, none_tps = 0, ev_s = 0, sk_s = 0, hh_ratio[32];
    int n_sk = 0, n_rows = 0;
    for (int n = budget; n <= max_len; n *= 2) {
        kvlm_seq_free(none, 0);
        if (engine_seq_fill_synthetic(none, 0, n, 7, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
        decode(none, 1);
        none_tps = sinks_tps = 0;
        double h2o_tps = 0;
        for (int rep = 0; rep < 3; rep++) { /* best of 3, interleaved */
            none_tps = fmax(none_tps, decode(none, steps / 2));
            double ev0 = engine_evict_seconds(sk), tps = decode(sk, steps);
            sinks_tps = fmax(sinks_tps, tps);
            ev_s += engine_evict_seconds(sk) - ev0;
            sk_s += steps / tps;
            n_sk += steps;
            h2o_tps = fmax(h2o_tps, decode(hh, steps));
        }
        printf("  %-13d %12.2f %12.2f %12d %12.2f %8.2fx %8.2fx\n", n, none_tps, sinks_tps, kvlm_seq_n_past(sk, 0),
               h2o_tps, sinks_tps / none_tps, h2o_tps / sinks_tps);
        if (n_rows < 32) hh_ratio[n_rows++] = h2o_tps / sinks_tps;
        fflush(stdout);
    }
    printf("sinks vs none at %d tokens: %.2fx the decode speed (%.2f vs %.2f tokens/s); sinks evicted %ld tokens so far\n",
           max_len, sinks_tps / none_tps, sinks_tps, none_tps, kvlm_seq_n_evicted(sk, 0));
    /* both stay at the budget whatever the stream length: every row is a
     * sample of the same ratio, and the median shrugs off a disturbed one */
    qsort(hh_ratio, (size_t)n_rows, sizeof(double), cmp_double);
    printf("h2o vs sinks (median of the %d rows): %.2fx the decode speed\n", n_rows,
           n_rows % 2 ? hh_ratio[n_rows / 2] : (hh_ratio[n_rows / 2 - 1] + hh_ratio[n_rows / 2]) / 2);
    double ev_per_tok = ev_s / n_sk, step_s = sk_s / n_sk;
    kvlm_ctx_free(sk);
    kvlm_ctx_free(hh);
    kvlm_ctx_free(none);

    /* The alternative to re-rotating at eviction: keys stored unrotated and
     * rotated at attention time, i.e. every cached key of every layer and KV
     * head rotated at every step. */
    int per_pos = c->n_layers * c->n_kv_heads; /* one set of angles per position for all its rows */
    float *k = calloc((size_t)budget * per_pos * c->head_dim, sizeof(float));
    double rope_per_tok = 1e30;
    for (int r = 0; r < 10; r++) { /* best of 10 */
        double t0 = util_now_s();
        for (int p = 0; p < budget; p++)
            op_rope(k + (size_t)p * per_pos * c->head_dim, per_pos, c->head_dim, c->rope_dim, p + r, c->rope_base, NULL, false);
        if (util_now_s() - t0 < rope_per_tok) rope_per_tok = util_now_s() - t0;
    }
    free(k);
    printf("positions by place in the cache, per decoded token: re-rotating at eviction %.3f ms (%.1f%% of a %.1f ms "
           "step), rotating all %d cached keys at attention time %.3f ms -> %.1fx more\n",
           1e3 * ev_per_tok, 100 * ev_per_tok / step_s, 1e3 * step_s, budget, 1e3 * rope_per_tok,
           rope_per_tok / ev_per_tok);
    kvlm_model_free(m);
    return 0;
}
