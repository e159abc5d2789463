/* bench/bench_decode_ctx: decode tokens/s against context length for f16,
 * q8_0 and q4_0 KV caches, on random-weight models of real shapes, with the
 * naive attention (dequantize everything, materialise the softmax) run in the
 * same process as the baseline, and the fraction of each step spent in
 * attention. The cache is filled with synthetic keys/values through the
 * normal write path: decode speed does not depend on their values. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "bench_common.h"
#include "engine/engine.h"
#include "kvlm.h"
#include "dtype/dtype.h"
#include "model/model.h"
#include "ops/ops.h"
#include "util/pool.h"
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

/* (a) tokens/s against context for f16, q8_0 and q4_0 caches, with the
 * naive attention in the same run (best of two rounds each). */
static void context_sweep(int threads, int max_ctx, const char *only) {
    const char *caches[] = {"f16", "q8_0", "q4_0"};
    bench_shape smol = {"smollm2-135M", 576, 1536, 30, 9, 3, 49152, 32768};
    kvlm_model *m = load_shape(&smol, "q8_0");
    char desc[512];
    kvlm_model_describe(m, desc, sizeof desc);
    printf("bench_decode_ctx: decode tokens/s against context, random weights of SmolLM2-135M's shape (GQA 9:3)\n  %s\n", desc);
    printf("  %-5s %7s %12s %12s %9s %12s\n", "cache", "context", "tokens/s", "naive tok/s", "speedup", "attention");
    for (int c = 0; c < 3; c++) {
        if (only && strcmp(only, caches[c])) continue;
        kvlm_ctx *ctx = make_ctx(m, max_ctx + 64, caches[c], threads);
        for (int n = 256; n <= max_ctx; n *= 2) {
            /* fast and naive alternate, each keeping its best of two, so a
             * burst of load from elsewhere does not decide the ratio */
            int steps = n >= 8192 ? 6 : 12;
            double share = 0, fast = 0, naive = 0;
            for (int r = 0; r < 2; r++) {
                double s, t = decode_at(ctx, n, steps, false, &s);
                if (t > fast) { fast = t; share = s; }
                t = decode_at(ctx, n, n >= 8192 ? 3 : 6, true, &s);
                if (t > naive) naive = t;
            }
            printf("  %-5s %7d %12.2f %12.2f %8.2fx %11.0f%%\n", caches[c], n, fast, naive, fast / naive, 100 * share);
            fflush(stdout);
        }
        kvlm_ctx_free(ctx);
    }
    kvlm_model_free(m);
}

/* (b) The target: stories110M's shape in Q8_0 with a q8_0 cache, decode at
 * 4096 against 128, beside the bound that the machine's read bandwidth puts
 * on it (every step reads all weights and the whole cache once). The two
 * contexts alternate over `rounds` and each keeps its best, so a burst of
 * load from elsewhere does not land on one side only. */
static void target(int threads, int rounds) {
    bench_shape s110 = {"stories110M", 768, 2048, 12, 12, 12, 32000, 32768};
    kvlm_model *m = load_shape(&s110, "q8_0");
    kvlm_ctx *ctx = make_ctx(m, 4096 + 64, "q8_0", threads);
    double best128 = 0, best4k = 0, share4k = 0, kv128 = 0, kv4k = 0;
    for (int r = 0; r < rounds; r++) {
        double s, t = decode_at(ctx, 128, 24, false, &s);
        kv128 = (double)kvlm_ctx_kv_bytes(ctx);
        if (t > best128) best128 = t;
        t = decode_at(ctx, 4096, 24, false, &s);
        kv4k = (double)kvlm_ctx_kv_bytes(ctx);
        if (t > best4k) { best4k = t; share4k = s; }
    }
    kvlm_ctx_free(ctx);
    util_pool *pool = util_pool_create(threads > 0 ? threads : (int)sysconf(_SC_NPROCESSORS_ONLN));
    double bw = op_measure_read_bandwidth(pool, (size_t)256 << 20);
    util_pool_free(pool);
    /* a step reads every weight but the token embeddings (one row of them),
     * unless the output projection is the embedding matrix */
    double w = (double)kvlm_model_weight_bytes(m);
    if (m->output.data != m->tok_embd.data)
        w -= (double)dt_row_size(m->tok_embd.type, (int)m->tok_embd.n_in) * (double)m->tok_embd.n_out;
    double t128 = (w + kv128) / bw, t4k = (w + kv4k) / bw;
    printf("stories110M shape, Q8_0 weights, q8_0 cache (best of %d rounds): %.1f tokens/s at 128, %.1f at 4096 -> "
           "%.0f%% slower (target <= 30%%; attention %.0f%% of the step at 4096)\n",
           rounds, best128, best4k, 100 * (best128 / best4k - 1), 100 * share4k);
    printf("  bandwidth bound: %.1f MB weights read + %.1f / %.1f MB cache per token at %.1f GB/s -> at most %.0f / %.0f "
           "tokens/s, at least %.0f%% slower; measured %.0f%% / %.0f%% of that bound\n",
           w / 1e6, kv128 / 1e6, kv4k / 1e6, bw / 1e9, 1 / t128, 1 / t4k, 100 * (t4k / t128 - 1), 100 * best128 * t128,
           100 * best4k * t4k);
    kvlm_model_free(m);
}

/* (c) Sliding window (docs/sliding-window.md): SmolLM2-135M's shape as a
 * llama with every layer local (Mistral-style) and as gemma2 (every second
 * layer local), window 1024, against the same weights without a window, at
 * a long context: decode tokens/s and the KV bytes held, each as a ratio
 * measured in the same run (rounds alternate, each keeps its best). */
static void window_line(int threads, int n_ctx, int rounds) {
    const int W = 1024;
    const char *dir = getenv("KVLM_BENCH_DIR") ? getenv("KVLM_BENCH_DIR") : "/tmp/kvlm-bench";
    mkdir(dir, 0755);
    printf("sliding window %d, SmolLM2-135M's shape (q8_0 weights, f16 cache), decode at %d tokens, best of %d:\n", W,
           n_ctx, rounds);
    printf("  %-8s %14s %14s %10s %16s %16s %10s\n", "arch", "tok/s window", "tok/s full", "speed", "KV held window",
           "KV held full", "bytes");
    const kvlm_arch archs[2] = {KVLM_ARCH_LLAMA, KVLM_ARCH_GEMMA2};
    for (int a = 0; a < 2; a++) {
        kvlm_model *m[2];
        for (int w = 0; w < 2; w++) {
            char path[600];
            snprintf(path, sizeof path, "%s/swa-%s-%s.gguf", dir, a ? "gemma2" : "llama", w ? "full" : "w1024");
            struct stat st;
            if (stat(path, &st) != 0) {
                kvlm_synth_params p = {0};
                p.arch = archs[a];
                p.dim = 576; p.hidden_dim = 1536; p.n_layers = 30; p.n_heads = 9; p.n_kv_heads = 3;
                p.head_dim = 64; p.vocab_size = 49152; p.n_ctx = 32768; p.seed = 1; p.tied_output = true;
                p.type = kvlm_type_from_name("q8_0");
                /* gemma: a window longer than the context is no window */
                p.sliding_window = w ? (a ? 1 << 20 : 0) : W;
                kvlm_error err = {0};
                fprintf(stderr, "  (writing %s ...)\n", path);
                if (kvlm_model_synth(&p, path, &err)) { fprintf(stderr, "synth: %s\n", err.msg); exit(1); }
            }
            m[w] = bench_load(path);
        }
        double best[2] = {0, 0}, held[2] = {0, 0};
        for (int r = 0; r < rounds; r++)
            for (int w = 0; w < 2; w++) {
                kvlm_ctx *ctx = make_ctx(m[w], n_ctx + 64, "f16", threads);
                double s, t = decode_at(ctx, n_ctx, 16, false, &s);
                held[w] = (double)kvlm_ctx_kv_bytes(ctx);
                if (t > best[w]) best[w] = t;
                kvlm_ctx_free(ctx);
            }
        printf("  %-8s %14.1f %14.1f %9.2fx %13.1f MB %13.1f MB %9.3fx\n", a ? "gemma2" : "llama", best[0], best[1],
               best[0] / best[1], held[0] / 1e6, held[1] / 1e6, held[0] / held[1]);
        fflush(stdout);
        kvlm_model_free(m[0]);
        kvlm_model_free(m[1]);
    }
}

/* (d) Issue 19: stories110M's shape, Q8_0 weights, f16 and q8_0 caches at
 * 4,096 and 16,384 tokens: decode tokens/s beside the bound that the read
 * bandwidth puts on it (weights + the whole cache read once per token), and
 * attention alone (its seconds per token) beside the time to read the cache
 * at that bandwidth. The machine may be shared and its bandwidth swings
 * (24-52 GB/s between rounds seen on one VM), so each decode run is framed
 * by two bandwidth measurements, its share of the bound uses their mean,
 * and the table gives the median over `rounds` of each share (caches and
 * contexts alternate within a round). */
static int cmp_dbl(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_dbl);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

enum { BOUND_ROUNDS_MAX = 32 };

static void bound_table(int threads, int max_ctx, int rounds) {
    bench_shape s110 = {"stories110M", 768, 2048, 12, 12, 12, 32000, 32768};
    kvlm_model *m = load_shape(&s110, "q8_0");
    const char *caches[2] = {"f16", "q8_0"};
    int ctxs[2] = {4096, max_ctx > 4096 ? max_ctx : 16384};
    if (rounds < 1) rounds = 1;
    if (rounds > BOUND_ROUNDS_MAX) rounds = BOUND_ROUNDS_MAX;
    double tps[2][2][BOUND_ROUNDS_MAX], share[2][2][BOUND_ROUNDS_MAX], att[2][2][BOUND_ROUNDS_MAX],
        att_share[2][2][BOUND_ROUNDS_MAX], bws[2][2][BOUND_ROUNDS_MAX], kv[2][2] = {{0}};
    util_pool *pool = util_pool_create(threads > 0 ? threads : (int)sysconf(_SC_NPROCESSORS_ONLN));
    double w = (double)kvlm_model_weight_bytes(m);
    if (m->output.data != m->tok_embd.data)
        w -= (double)dt_row_size(m->tok_embd.type, (int)m->tok_embd.n_in) * (double)m->tok_embd.n_out;
    kvlm_ctx *ctx[2];
    for (int c = 0; c < 2; c++) ctx[c] = make_ctx(m, ctxs[1] + 64, caches[c], threads);
    for (int r = 0; r < rounds; r++) {
        double b0 = op_measure_read_bandwidth(pool, (size_t)256 << 20);
        for (int c = 0; c < 2; c++)
            for (int n = 0; n < 2; n++) {
                int steps = ctxs[n] >= 8192 ? 8 : 16;
                double s, t = decode_at(ctx[c], ctxs[n], steps, false, &s);
                double b1 = op_measure_read_bandwidth(pool, (size_t)256 << 20), bw = (b0 + b1) / 2;
                b0 = b1;
                kv[c][n] = (double)kvlm_ctx_kv_bytes(ctx[c]);
                tps[c][n][r] = t;
                share[c][n][r] = t * (w + kv[c][n]) / bw;
                att[c][n][r] = s / t; /* attention seconds per token */
                att_share[c][n][r] = kv[c][n] / bw / (s / t);
                bws[c][n][r] = bw;
            }
    }
    for (int c = 0; c < 2; c++) kvlm_ctx_free(ctx[c]);
    util_pool_free(pool);
    printf("stories110M shape, Q8_0 weights (%.1f MB read per token), %d threads, medians of %d alternating rounds, "
           "each run's bound from the read bandwidth measured just before and after it\n",
           w / 1e6, threads, rounds);
    printf("  %-5s %7s %9s %10s %8s %8s | %10s %8s\n", "cache", "context", "cache MB", "tokens/s", "GB/s", "share",
           "attn ms/tok", "share");
    for (int c = 0; c < 2; c++)
        for (int n = 0; n < 2; n++)
            printf("  %-5s %7d %9.1f %10.1f %8.1f %7.0f%% | %10.2f %7.0f%%\n", caches[c], ctxs[n], kv[c][n] / 1e6,
                   median(tps[c][n], rounds), median(bws[c][n], rounds) / 1e9, 100 * median(share[c][n], rounds),
                   1e3 * median(att[c][n], rounds), 100 * median(att_share[c][n], rounds));
    kvlm_model_free(m);
}

/* bench_decode_ctx [threads] [max context] [sweep|target|window|bound] [cache type of the sweep] */
int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0;
    int max_ctx = argc > 2 ? atoi(argv[2]) : 16384;
    const char *what = argc > 3 ? argv[3] : "all";
    if (!strcmp(what, "all") || !strcmp(what, "sweep")) context_sweep(threads, max_ctx, argc > 4 ? argv[4] : NULL);
    if (!strcmp(what, "all") || !strcmp(what, "target")) target(threads, 3);
    if (!strcmp(what, "all") || !strcmp(what, "window")) window_line(threads, max_ctx < 8192 ? max_ctx : 8192, 2);
    if (!strcmp(what, "bound")) bound_table(threads, max_ctx, argc > 4 ? atoi(argv[4]) : 3);
    return 0;
}
