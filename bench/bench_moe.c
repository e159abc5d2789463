/* bench/bench_moe: decode with a mixture of experts (qwen3moe: 32 experts of
 * width 512, 4 used per token) against two dense qwen3 models of the same
 * attention: one whose FFN is as wide as the 4 chosen experts together (the
 * weights a token reads: the bound a MoE decode can reach) and one as wide as
 * all 32 (the same total weights, every one read per token). Random weights,
 * 8 layers of width 1024. Prints weights in all and read per token, decode
 * tokens/s (best of the rounds, the three models alternating) and prefill
 * tokens/s of a 256-token prompt, and the ratios, measured in the same run.
 * `bench_moe THREADS ROUNDS TYPE gpt-oss`: the MoE model is gpt-oss's kind
 * instead (its sinks, biases, clamped SwiGLU, even layers in a window of 128). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "engine/engine.h"
#include "kvlm.h"
#include "util/timing.h"

enum { MOE, ACTIVE, TOTAL };
static const char *names[] = {"qwen3moe 32x512, 4 used", "qwen3 FFN 2048 (= 4 experts)",
                              "qwen3 FFN 16384 (= 32 experts)"};
static bool gpt_oss;

static kvlm_model *model(int kind, const char *wtype) {
    const char *dir = getenv("KVLM_BENCH_DIR") ? getenv("KVLM_BENCH_DIR") : "/tmp/kvlm-bench";
    mkdir(dir, 0755);
    char path[512];
    snprintf(path, sizeof path, "%s/moe-bench-%d-%s%s.gguf", dir, kind, wtype, gpt_oss && kind == MOE ? "-gpt-oss" : "");
    struct stat st;
    kvlm_error err = {0};
    if (stat(path, &st) != 0) {
        kvlm_synth_params p = {0};
        p.arch = kind == MOE ? KVLM_ARCH_QWEN3MOE : KVLM_ARCH_QWEN3;
        p.dim = 1024, p.n_layers = 8, p.n_heads = 16, p.n_kv_heads = 4, p.head_dim = 64, p.vocab_size = 32000;
        p.n_ctx = 4096, p.type = kvlm_type_from_name(wtype), p.seed = 1;
        p.hidden_dim = kind == MOE ? 2048 : kind == ACTIVE ? 4 * 512 : 32 * 512;
        if (kind == MOE) p.n_expert = 32, p.n_expert_used = 4, p.expert_ff = 512;
        if (kind == MOE && gpt_oss) p.arch = KVLM_ARCH_GPTOSS, p.sliding_window = 128;
        fprintf(stderr, "  (writing %s ...)\n", path);
        if (kvlm_model_synth(&p, path, &err)) { fprintf(stderr, "synth: %s\n", err.msg); exit(1); }
    }
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    return m;
}

static void die(const kvlm_error *err) {
    fprintf(stderr, "%s\n", err->msg);
    exit(1);
}

/* Tokens/s decoding `steps` tokens after 64 cached ones. */
static double decode(kvlm_ctx *ctx, int steps) {
    kvlm_error err = {0};
    kvlm_seq_free(ctx, 0);
    if (engine_seq_fill_synthetic(ctx, 0, 64, 7, &err)) die(&err);
    int32_t tok = 5;
    kvlm_batch b = {1, &tok, NULL, NULL, NULL};
    if (kvlm_decode(ctx, &b, &err)) die(&err); /* warm */
    double t0 = util_now_s();
    for (int i = 0; i < steps; i++) {
        tok = 3 + (i * 7919) % 31000; /* other tokens, other experts */
        if (kvlm_decode(ctx, &b, &err)) die(&err);
    }
    return steps / (util_now_s() - t0);
}

/* Tokens/s of one n-token prefill. */
static double prefill(kvlm_ctx *ctx, int n) {
    kvlm_error err = {0};
    kvlm_seq_free(ctx, 0);
    int32_t *ids = malloc(sizeof *ids * (size_t)n);
    for (int i = 0; i < n; i++) ids[i] = 3 + (i * 104729) % 31000;
    kvlm_batch b = {n, ids, NULL, NULL, NULL};
    double t0 = util_now_s();
    if (kvlm_decode(ctx, &b, &err)) die(&err);
    double t = n / (util_now_s() - t0);
    free(ids);
    return t;
}

/* bench_moe [threads] [rounds] [weight type] */
int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0, rounds = argc > 2 ? atoi(argv[2]) : 3;
    const char *wtype = argc > 3 ? argv[3] : "q8_0";
    if (argc > 4 && !strcmp(argv[4], "gpt-oss")) gpt_oss = true, names[MOE] = "gpt-oss 32x512, 4 used";
    kvlm_model *m[3];
    kvlm_ctx *ctx[3];
    double tps[3] = {0}, pre[3] = {0}, total[3], read[3];
    for (int i = 0; i < 3; i++) {
        m[i] = model(i, wtype);
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.n_ctx = 512;
        cp.n_threads = threads;
        kvlm_error err = {0};
        if (!(ctx[i] = kvlm_ctx_create(m[i], &cp, &err))) die(&err);
        total[i] = read[i] = (double)kvlm_model_weight_bytes(m[i]);
        char desc[512];
        kvlm_model_describe(m[i], desc, sizeof desc);
        printf("  %s\n", desc);
    }
    /* a token reads every weight but the experts it does not choose (and all
     * but one row of the embedding, in every model): an expert's bytes from
     * the dense models' difference, which is 28 experts' worth of FFN */
    double expert_bytes = (total[TOTAL] - total[ACTIVE]) / 28.0;
    read[MOE] = total[MOE] - 28.0 * expert_bytes;
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < 3; i++) {
            double t = decode(ctx[i], 48);
            if (t > tps[i]) tps[i] = t;
            t = prefill(ctx[i], 256);
            if (t > pre[i]) pre[i] = t;
        }
    printf("bench_moe: decode after 64 tokens and a 256-token prefill, %s weights, 8 layers of width 1024 (best of %d "
           "rounds)\n", wtype, rounds);
    printf("  %-32s %12s %16s %12s %14s\n", "", "weights MB", "in use/token MB", "decode tok/s", "prefill tok/s");
    for (int i = 0; i < 3; i++)
        printf("  %-32s %12.1f %16.1f %12.1f %14.1f\n", names[i], total[i] / 1e6, read[i] / 1e6, tps[i], pre[i]);
    printf("  decode: MoE %.2fx the dense model of the same weights (%.2fx fewer weight bytes in use), %.2fx the dense model "
           "of its active weights; prefill: %.2fx and %.2fx\n", tps[MOE] / tps[TOTAL], total[MOE] / read[MOE],
           tps[MOE] / tps[ACTIVE], pre[MOE] / pre[TOTAL], pre[MOE] / pre[ACTIVE]);
    for (int i = 0; i < 3; i++) {
        kvlm_ctx_free(ctx[i]);
        kvlm_model_free(m[i]);
    }
    return 0;
}
