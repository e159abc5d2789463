/* bench/bench_mla: decode at 4k context with multi-head latent attention
 * (deepseek2: one 576-wide latent row per token and layer, the absorbed
 * path) against the same model's multi-head-attention cache (a llama of the
 * same width, 16 KV heads of head dim 160: per token the same bytes as
 * DeepSeek's decompressed heads, 16 x (192 key + 128 value)). Both random
 * weights of DeepSeek-V2-Lite's attention shape, narrower; dense FFNs of the
 * same size so the cache is what differs. Prints KV bytes read per token,
 * tokens/s at 4096 and at 128, and the time the extra 3968 cached tokens add
 * per step, and the time in attention per step (best of the rounds), as
 * MHA / MLA ratios measured in the same run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "engine/engine.h"
#include "kvlm.h"
#include "util/timing.h"

static kvlm_model *model(bool mla, const char *wtype, int layers) {
    const char *dir = getenv("KVLM_BENCH_DIR") ? getenv("KVLM_BENCH_DIR") : "/tmp/kvlm-bench";
    mkdir(dir, 0755);
    char path[512];
    snprintf(path, sizeof path, "%s/mla-bench-%s-%s-l%d.gguf", dir, mla ? "deepseek2" : "llama-mha", wtype, layers);
    struct stat st;
    kvlm_error err = {0};
    if (stat(path, &st) != 0) {
        kvlm_synth_params p = {0};
        p.dim = 1024, p.hidden_dim = 1024, p.n_layers = layers, p.n_heads = 16, p.vocab_size = 2048;
        p.n_ctx = 8192, p.type = kvlm_type_from_name(wtype), p.seed = 1;
        if (mla) {
            p.arch = KVLM_ARCH_DEEPSEEK2;
            p.head_dim = 192, p.rope_dim = 64, p.v_head_dim = 128, p.kv_lora_rank = 512;
            p.n_expert = -1; /* dense: the FFN equals the llama's */
        } else {
            p.arch = KVLM_ARCH_LLAMA;
            p.n_kv_heads = 16, p.head_dim = 160;
        }
        fprintf(stderr, "  (writing %s ...)\n", path);
        if (kvlm_model_synth(&p, path, &err)) { fprintf(stderr, "synth: %s\n", err.msg); exit(1); }
    }
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    return m;
}

/* Tokens/s decoding `steps` tokens after n cached ones; *attn: seconds of
 * attention per step. */
static double decode_at(kvlm_ctx *ctx, int n, int steps, double *attn) {
    kvlm_error err = {0};
    kvlm_seq_free(ctx, 0);
    if (engine_seq_fill_synthetic(ctx, 0, n, 7, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    int32_t tok = 5;
    kvlm_batch b = {1, &tok, NULL, NULL, NULL};
    if (kvlm_decode(ctx, &b, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); } /* warm */
    double t0 = util_now_s(), a0 = engine_attention_seconds(ctx);
    for (int i = 0; i < steps; i++)
        if (kvlm_decode(ctx, &b, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    *attn = (engine_attention_seconds(ctx) - a0) / steps;
    return steps / (util_now_s() - t0);
}

typedef struct { double tps_short, tps_long, kv_bytes_long, attn_long; size_t per_token; } figures;

/* bench_mla [threads] [context] [rounds] [cache type] [weight type] [layers] */
int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0, n = argc > 2 ? atoi(argv[2]) : 4096;
    int rounds = argc > 3 ? atoi(argv[3]) : 3, layers = argc > 6 ? atoi(argv[6]) : 4;
    const char *cache = argc > 4 ? argv[4] : "f16", *wtype = argc > 5 ? argv[5] : "q8_0";
    kvlm_model *m[2] = {model(true, wtype, layers), model(false, wtype, layers)};
    kvlm_ctx *ctx[2];
    figures f[2] = {{0}};
    for (int i = 0; i < 2; i++) {
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.n_ctx = n + 64;
        cp.n_threads = threads;
        cp.cache_type_k = cp.cache_type_v = kvlm_cache_type_from_name(cache);
        kvlm_error err = {0};
        if (!(ctx[i] = kvlm_ctx_create(m[i], &cp, &err))) { fprintf(stderr, "%s\n", err.msg); return 1; }
        char desc[512];
        kvlm_model_describe(m[i], desc, sizeof desc);
        printf("  %s: %s\n", i ? "MHA" : "MLA", desc);
    }
    /* the two models alternate, each keeping its best, so load from elsewhere
     * does not land on one side only */
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < 2; i++) {
            double attn, t = decode_at(ctx[i], 128, 32, &attn);
            if (t > f[i].tps_short) f[i].tps_short = t;
            t = decode_at(ctx[i], n, 32, &attn);
            if (t > f[i].tps_long) f[i].tps_long = t;
            if (!f[i].attn_long || attn < f[i].attn_long) f[i].attn_long = attn;
            kvlm_kv_stats st;
            kvlm_kv_stats_get(ctx[i], &st);
            f[i].per_token = st.bytes_per_token;
            f[i].kv_bytes_long = (double)kvlm_ctx_kv_bytes(ctx[i]); /* a decode step reads all of it */
        }
    printf("bench_mla: decode at %d tokens of context, %s cache, %s weights, %d layers (best of %d rounds)\n", n,
           cache, wtype, layers, rounds);
    printf("  %-4s %14s %16s %12s %12s %16s %16s\n", "", "KV B/token", "KV read/step", "tok/s @128", "tok/s @ctx",
           "extra ms/step", "attention ms");
    double extra[2];
    for (int i = 0; i < 2; i++) {
        extra[i] = 1e3 * (1 / f[i].tps_long - 1 / f[i].tps_short);
        printf("  %-4s %14zu %13.1f MB %12.2f %12.2f %16.2f %16.2f\n", i ? "MHA" : "MLA", f[i].per_token,
               f[i].kv_bytes_long / 1e6, f[i].tps_short, f[i].tps_long, extra[i], 1e3 * f[i].attn_long);
    }
    printf("  MHA / MLA: KV bytes read per token %.2fx; tokens/s at %d: MLA %.2fx MHA's; time the long context adds "
           "per step: MHA %.2fx MLA's; attention per step at %d: MHA %.2fx MLA's (%.1f against %.1f GB/s of cache "
           "read)\n", f[1].kv_bytes_long / f[0].kv_bytes_long, n, f[0].tps_long / f[1].tps_long,
           extra[0] > 0 ? extra[1] / extra[0] : 0, n, f[1].attn_long / f[0].attn_long,
           f[1].kv_bytes_long / f[1].attn_long / 1e9, f[0].kv_bytes_long / f[0].attn_long / 1e9);
    for (int i = 0; i < 2; i++) {
        kvlm_ctx_free(ctx[i]);
        kvlm_model_free(m[i]);
    }
    return 0;
}
