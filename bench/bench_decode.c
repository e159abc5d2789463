/* bench/bench_decode: decode tokens/s on random-weight models of real shapes
 * (stories15M, TinyLlama-1.1B) in F32, F16, Q8_0 and Q4_0, and the fraction of
 * the machine's read bandwidth (measured in the same run) that represents:
 * bytes of weights streamed per token x tokens/s / bandwidth. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench_common.h"
#include "kvlm.h"
#include "ops/ops.h"
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

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0;
    bool big = !(argc > 2 && !strcmp(argv[2], "--small"));
    bench_shape shapes[] = {
        {"stories15M", 288, 768, 6, 6, 6, 32000, 2048},
        {"tinyllama-1.1B", 2048, 5632, 22, 32, 4, 32000, 2048},
    };
    const char *types[] = {"f32", "f16", "q8_0", "q4_0"};
    util_pool *pool = util_pool_create(threads);
    double bw = op_measure_read_bandwidth(pool, (size_t)1 << 30);
    printf("bench_decode: %d threads, read bandwidth %.1f GB/s (measured now)\n", util_pool_size(pool), bw / 1e9);
    util_pool_free(pool);
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
