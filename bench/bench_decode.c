/* bench/bench_decode: decode tokens/s on random-weight models of real shapes
 * (stories15M, TinyLlama-1.1B) in F32, F16, Q8_0 and Q4_0, and the fraction of
 * the machine's read bandwidth (measured in the same run) that represents:
 * bytes of weights streamed per token x tokens/s / bandwidth.
 * `bench_decode THREADS --types q4_K,q2_K,...` (or --low-bit: q4_K, q2_K,
 * q3_K, iq4_nl, iq4_xs; --codebook: q4_K, q2_K, q3_K and the seven codebook
 * types IQ3_S ... IQ1_S; --mxfp4-tq: q4_K, iq4_nl, mxfp4, q2_K, tq2_0, tq1_0)
 * runs the TinyLlama shape only, those types in
 * alternating rounds, each against the first type as the baseline.
 * `--shape stories110M` (or stories15M, tinyllama-1.1B) picks the shape of
 * --types; a type written `f16@avx2` runs with the kernels capped at the AVX2
 * level (op_set_simd_level), to compare a kernel with the one below it in the
 * same run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench_common.h"
#include "kvlm.h"
#include "ops/ops.h"
#include "ops/ops_internal.h"
#include "util/pool.h"
#include "util/timing.h"

/* Bytes the decode of one token streams: every weight except the embedding
 * table (only one row of it is read) unless the classifier is tied to it. */
static double streamed_bytes(kvlm_model *m) {
    size_t total = 0, emb = 0;
    bool tied = true;
    for (int i = 0; i < kvlm_model_n_tensors(m); i++) {
        kvlm_tensor_info t;
        kvlm_model_tensor(m, i, &t);
        total += t.nbytes;
        if (!strcmp(t.name, "token_embd.weight")) emb = t.nbytes;
        if (!strcmp(t.name, "output.weight")) tied = false;
    }
    return (double)(tied ? total : total - emb);
}

/* The types of `list` (comma-separated) on the TinyLlama shape: every model
 * loaded first, then `rounds` rounds of n tokens each in turn, so a busy
 * moment of the shared machine hits all types alike; the best round counts. */
static int typed_table(const bench_shape *shape, int threads, const char *list, double bw) {
    enum { MAXT = 16 };
    /* small shapes: more tokens and rounds, so a round is not one scheduler slice */
    const int ROUNDS = shape->dim < 1024 ? 6 : 3, N = shape->dim < 1024 ? 48 : 12;
    char buf[256], *names[MAXT], *save = NULL, tname[MAXT][32];
    int level[MAXT];
    snprintf(buf, sizeof buf, "%s", list);
    int nt = 0;
    for (char *t = strtok_r(buf, ",", &save); t && nt < MAXT; t = strtok_r(NULL, ",", &save)) {
        snprintf(tname[nt], sizeof tname[nt], "%s", t);
        char *at = strchr(tname[nt], '@');
        level[nt] = -1;
        if (at) {
            if (strcmp(at, "@avx2")) { fprintf(stderr, "bench_decode: unknown level '%s'\n", at); return 1; }
            *at = 0;
            level[nt] = OP_SIMD_AVX2;
        }
        if (kvlm_type_from_name(tname[nt]) < 0) { fprintf(stderr, "bench_decode: unknown type '%s'\n", t); return 1; }
        names[nt++] = t;
    }
    kvlm_model *m[MAXT];
    kvlm_ctx *ctx[MAXT];
    double best[MAXT] = {0}, bytes[MAXT];
    int32_t tok[MAXT];
    for (int i = 0; i < nt; i++) {
        char path[4096];
        m[i] = bench_load(bench_model_path(shape, tname[i], path, sizeof path));
        kvlm_error err = {0};
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.n_threads = threads;
        cp.n_ctx = ROUNDS * (2 + N) + 8;
        if (!(ctx[i] = kvlm_ctx_create(m[i], &cp, &err))) { fprintf(stderr, "%s\n", err.msg); return 1; }
        bytes[i] = streamed_bytes(m[i]);
        tok[i] = 1;
    }
    for (int r = 0; r < ROUNDS; r++)
        for (int i = 0; i < nt; i++) {
            kvlm_error err = {0};
            double t0 = 0;
            op_set_simd_level(level[i]);
            for (int k = 0; k < 2 + N; k++) { /* 2 warm-up tokens: the weights back in the caches' way */
                if (k == 2) t0 = util_now_s();
                kvlm_batch b = {1, &tok[i], NULL, NULL, NULL};
                if (kvlm_decode(ctx[i], &b, &err)) { fprintf(stderr, "%s\n", err.msg); return 1; }
                tok[i] = 1 + (tok[i] * 7919) % 31000;
            }
            double tps = N / (util_now_s() - t0);
            op_set_simd_level(-1);
            if (tps > best[i]) best[i] = tps;
        }
    printf("  %-16s %-7s %10s %12s %10s %8s %12s %12s\n", "model", "type", "MiB/token", "tokens/s", "GB/s", "of bw",
           "tok/s ratio", "share ratio");
    for (int i = 0; i < nt; i++) {
        double share = bytes[i] * best[i] / bw, share0 = bytes[0] * best[0] / bw;
        printf("  %-16s %-7s %10.1f %12.2f %10.2f %7.0f%% %12.2f %12.2f\n", shape->name, names[i], bytes[i] / (1 << 20),
               best[i], bytes[i] * best[i] / 1e9, 100.0 * share, best[i] / best[0], share / share0);
        kvlm_ctx_free(ctx[i]);
        kvlm_model_free(m[i]);
    }
    return 0;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0;
    bool big = true;
    const char *list = NULL, *shape = "tinyllama-1.1B";
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--small")) big = false;
        else if (!strcmp(argv[i], "--low-bit")) list = "q4_K,q2_K,q3_K,iq4_nl,iq4_xs";
        else if (!strcmp(argv[i], "--codebook")) list = "q4_K,q2_K,q3_K,iq3_s,iq3_xxs,iq2_s,iq2_xs,iq2_xxs,iq1_m,iq1_s";
        else if (!strcmp(argv[i], "--mxfp4-tq")) list = "q4_K,iq4_nl,mxfp4,q2_K,tq2_0,tq1_0";
        else if (!strcmp(argv[i], "--types") && i + 1 < argc) list = argv[++i];
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc) shape = argv[++i];
    }
    bench_shape shapes[] = {
        {"stories15M", 288, 768, 6, 6, 6, 32000, 2048},
        {"tinyllama-1.1B", 2048, 5632, 22, 32, 4, 32000, 2048},
        {"stories110M", 768, 2048, 12, 12, 12, 32000, 2048},
    };
    const char *types[] = {"f32", "f16", "q8_0", "q4_0"};
    util_pool *pool = util_pool_create(threads);
    double bw = op_measure_read_bandwidth(pool, (size_t)1 << 30);
    printf("bench_decode: %d threads, read bandwidth %.1f GB/s (measured now)\n", util_pool_size(pool), bw / 1e9);
    util_pool_free(pool);
    if (list) {
        for (int si = 0; si < 3; si++)
            if (!strcmp(shapes[si].name, shape)) return typed_table(&shapes[si], threads, list, bw);
        fprintf(stderr, "bench_decode: unknown shape '%s'\n", shape);
        return 1;
    }
    printf("  %-16s %-5s %10s %12s %10s %10s\n", "model", "type", "MiB/token", "tokens/s", "GB/s", "of bw");
    for (int si = 0; si < (big ? 2 : 1); si++)
        for (int ti = 0; ti < 4; ti++) {
            char path[4096];
            kvlm_model *m = bench_load(bench_model_path(&shapes[si], types[ti], path, sizeof path));
            kvlm_error err = {0};
            kvlm_ctx_params cp = kvlm_ctx_default_params();
            cp.n_threads = threads;
            cp.n_ctx = 256;
            kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
            if (!ctx) { fprintf(stderr, "%s\n", err.msg); return 1; }
            int32_t tok = 1;
            int warm = 3, n = si == 0 ? 64 : 12;
            double t0 = 0;
            for (int i = 0; i < warm + n; i++) {
                if (i == warm) t0 = util_now_s();
                kvlm_batch b = {1, &tok, NULL, NULL, NULL};
                if (kvlm_decode(ctx, &b, &err)) { fprintf(stderr, "%s\n", err.msg); return 1; }
                tok = 1 + (i * 7919) % 31000;
            }
            double tps = n / (util_now_s() - t0);
            double bytes = streamed_bytes(m);
            printf("  %-16s %-5s %10.1f %12.2f %10.2f %9.0f%%\n", shapes[si].name, types[ti], bytes / (1 << 20), tps,
                   bytes * tps / 1e9, 100.0 * bytes * tps / bw);
            fflush(stdout);
            kvlm_ctx_free(ctx);
            kvlm_model_free(m);
        }
    return 0;
}
