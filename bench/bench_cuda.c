/* bench_cuda: the CUDA backend against the machine's own ceilings, measured
 * in the same run: decode tokens/s as a share of the device-to-device copy
 * bandwidth (every weight read once per token), prefill at 512 tokens
 * against cuBLAS's f16 GEMM rate, batched decode at 1, 16, 64 and 256
 * sequences, and paged attention alone against the bandwidth bound at 4k and
 * 32k context.
 *   bench_cuda model PATH [--batches 1,16,64,256] [--ctx N]
 *   bench_cuda tier PATH
 *   bench_cuda attn */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kvlm.h"
#include "util/timing.h"

#ifdef KVLM_HAVE_CUDA
#include "ops/cuda/cuda.h"

static double g_bw, g_gemm;

static void ceilings(cu_dev *d, const kvlm_config *c) {
    g_bw = cu_measure_copy_bandwidth(d, (size_t)2 << 30);
    int n = c ? c->hidden_dim : 5632, k = c ? c->dim : 2048;
    g_gemm = cu_measure_gemm_flops(d, n, 512, k);
    printf("ceilings: device-to-device copy %.0f GB/s (read + write); cuBLAS f16 GEMM %dx512x%d %.0f TFLOP/s\n",
           g_bw / 1e9, n, k, g_gemm / 1e12);
}

static kvlm_ctx *gpu_ctx(const kvlm_model *m, int n_seq, int n_ctx) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.device = KVLM_DEVICE_CUDA;
    cp.n_seq_max = n_seq;
    cp.n_ctx = n_ctx;
    cp.n_batch = 512;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) {
        fprintf(stderr, "bench_cuda: %s\n", err.msg);
        exit(1);
    }
    return ctx;
}

static void must(int rc, const kvlm_error *err) {
    if (rc) {
        fprintf(stderr, "bench_cuda: %s\n", err->msg);
        exit(1);
    }
}

/* Bytes of the matrices a token reads (every 2-D weight once, the output
 * matrix too; of the embedding table only one row), as stored in the file,
 * and the multiply-adds per token. */
static void weight_cost(const kvlm_model *m, double *bytes, double *flops) {
    const kvlm_config *c = kvlm_model_config(m);
    double params = (double)c->n_layers * ((double)c->dim * c->n_heads * c->head_dim * 2 +
                                           (double)c->dim * c->n_kv_heads * c->head_dim * 2 +
                                           3.0 * c->dim * c->hidden_dim) +
                    (double)c->dim * c->vocab_size;
    *flops = 2 * params;
    double sum = 0, embd = 0;
    bool tied = true;
    for (int i = 0; i < kvlm_model_n_tensors(m); i++) {
        kvlm_tensor_info ti;
        if (!kvlm_model_tensor(m, i, &ti) || ti.n_dims < 2) continue;
        if (!strcmp(ti.name, "token_embd.weight")) embd = (double)ti.nbytes;
        else sum += (double)ti.nbytes;
        if (!strcmp(ti.name, "output.weight")) tied = false;
    }
    *bytes = sum + (tied ? embd : 0);
}

/* Seconds per token of n greedy-free decode steps of sequence 0, after 8 of warm-up. */
static double decode_time(kvlm_ctx *ctx, int n) {
    kvlm_error err = {0};
    int32_t t = 5;
    kvlm_batch one = {1, &t, NULL, NULL, NULL};
    for (int i = 0; i < 8; i++) must(kvlm_decode(ctx, &one, &err), &err);
    double t0 = util_now_s();
    for (int i = 0; i < n; i++) must(kvlm_decode(ctx, &one, &err), &err);
    return (util_now_s() - t0) / n;
}

static void bench_model(const char *path, const int *batches, int n_batches, int n_ctx) {
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) {
        fprintf(stderr, "bench_cuda: %s\n", err.msg);
        exit(1);
    }
    const kvlm_config *c = kvlm_model_config(m);
    char desc[256];
    kvlm_model_describe(m, desc, sizeof desc);
    printf("model: %s\n", desc);
    cu_dev *d = cu_open(0, &err);
    if (!d) must(1, &err);
    ceilings(d, c);
    double wbytes, wflops;
    weight_cost(m, &wbytes, &wflops);
    int max_b = 1;
    for (int i = 0; i < n_batches; i++) max_b = batches[i] > max_b ? batches[i] : max_b;
    kvlm_ctx *ctx = gpu_ctx(m, max_b, n_ctx);
    char dd[256];
    kvlm_ctx_describe_device(ctx, dd, sizeof dd);
    printf("device: %s\n", dd);
    int V = c->vocab_size;
    int32_t *tok = malloc(sizeof(int32_t) * 512 * (size_t)(max_b > 1 ? max_b : 1)), *seq = malloc(sizeof(int32_t) * 512 * (size_t)max_b);
    for (int i = 0; i < 512 * max_b; i++) tok[i] = 3 + (i * 7919) % (V - 3);

    /* prefill: 512 tokens of one sequence, after a warm-up */
    for (int rep = 0; rep < 3; rep++) {
        kvlm_seq_free(ctx, 0);
        for (int i = 0; i < 512; i++) seq[i] = 0;
        kvlm_batch b = {512, tok, NULL, NULL, seq};
        double t0 = util_now_s();
        must(kvlm_decode(ctx, &b, &err), &err);
        double s = util_now_s() - t0;
        if (rep == 2)
            printf("prefill 512 tokens: %.1f ms, %.0f tokens/s, %.0f TFLOP/s in the matrices = %.0f%% of cuBLAS's "
                   "GEMM rate\n", s * 1e3, 512 / s, wflops * 512 / s / 1e12, 100 * wflops * 512 / s / g_gemm);
    }
    /* decode, one sequence: 128 tokens after the 512; then the same without
     * CUDA graphs (a kernel launch at a time), in a context of its own */
    double s_graph = decode_time(ctx, 128);
    printf("decode, 1 sequence at ~600 tokens: %.3f ms/token, %.1f tokens/s; weights %.2f GB per token = %.0f GB/s "
           "= %.0f%% of the copy bandwidth\n", s_graph * 1e3, 1 / s_graph, wbytes / 1e9, wbytes / s_graph / 1e9,
           100 * wbytes / s_graph / g_bw);
    {
        setenv("KVLM_CUDA_GRAPHS", "0", 1);
        kvlm_ctx *c2 = gpu_ctx(m, 1, n_ctx);
        unsetenv("KVLM_CUDA_GRAPHS");
        for (int i = 0; i < 512; i++) seq[i] = 0;
        kvlm_batch b = {512, tok, NULL, NULL, seq};
        must(kvlm_decode(c2, &b, &err), &err);
        double s_plain = decode_time(c2, 128);
        printf("  without CUDA graphs: %.3f ms/token; graphs are %.2fx faster\n", s_plain * 1e3, s_plain / s_graph);
        kvlm_ctx_free(c2);
    }
    /* the same binary with programmatic dependent launch off
     * (KVLM_CUDA_PDL=0), in a context of its own */
    {
        const char *was = getenv("KVLM_CUDA_PDL");
        setenv("KVLM_CUDA_PDL", "0", 1);
        kvlm_ctx *c2 = gpu_ctx(m, 1, n_ctx);
        if (was) setenv("KVLM_CUDA_PDL", was, 1);
        else unsetenv("KVLM_CUDA_PDL");
        for (int i = 0; i < 512; i++) seq[i] = 0;
        kvlm_batch b = {512, tok, NULL, NULL, seq};
        must(kvlm_decode(c2, &b, &err), &err);
        double s_off = decode_time(c2, 128);
        printf("  without programmatic launch: %.3f ms/token = %.0f%% of the copy bandwidth; this run's setting is "
               "%.2fx faster\n", s_off * 1e3, 100 * wbytes / s_off / g_bw, s_off / s_graph);
        kvlm_ctx_free(c2);
    }
    kvlm_seq_free(ctx, 0);
    /* batched decode: B sequences of 64 tokens, then 32 steps of B tokens */
    printf("batched decode (each sequence 64 prompt tokens, then 32 steps):\n");
    printf("  %8s %12s %14s %12s\n", "seqs", "ms/step", "tokens/s", "vs 1 seq");
    double base = 0;
    for (int bi = 0; bi < n_batches; bi++) {
        int B = batches[bi];
        for (int s = 0; s < B; s++) kvlm_seq_free(ctx, s);
        for (int s0 = 0; s0 < B; s0 += 8) { /* prompts, 8 sequences per batch */
            int n = 0;
            for (int s = s0; s < B && s < s0 + 8; s++)
                for (int i = 0; i < 64; i++) seq[n++] = s;
            int8_t *want = calloc((size_t)n, 1);
            kvlm_batch b = {n, tok, NULL, want, seq};
            must(kvlm_decode(ctx, &b, &err), &err);
            free(want);
        }
        for (int s = 0; s < B; s++) seq[s] = s;
        kvlm_batch b = {B, tok, NULL, NULL, seq};
        int8_t *want = malloc((size_t)B);
        memset(want, 1, (size_t)B);
        b.logits = want;
        must(kvlm_decode(ctx, &b, &err), &err);
        double t0 = util_now_s();
        for (int i = 0; i < 32; i++) must(kvlm_decode(ctx, &b, &err), &err);
        double s = (util_now_s() - t0) / 32;
        double tps = B / s;
        if (B == 1 || base == 0) base = tps / B;
        printf("  %8d %12.3f %14.0f %11.1fx\n", B, s * 1e3, tps, tps / base);
        free(want);
    }
    free(tok);
    free(seq);
    kvlm_ctx_free(ctx);
    cu_close(d);
    kvlm_model_free(m);
}

/* Seconds a call of cu_attention takes: B sequences at n_ctx keys each
 * (decode), or a prompt of B tokens of one sequence (positions 0..B-1);
 * f16 cache in blocks of 16 scattered over the pool. */
static double attn_time(cu_dev *d, int H, int KVH, int HD, int n_ctx, int B, bool prompt, bool mma) {
    kvlm_error err = {0};
    const int BS = 16, nb = (prompt ? B : n_ctx) / BS, nseq = prompt ? 1 : B;
    size_t row = (size_t)HD * 2, region = (size_t)BS * row, head = 2 * region, block = (size_t)KVH * head;
    size_t pool = (size_t)nb * nseq * block;
    uint8_t *base = cu_alloc(d, pool);
    float *q = cu_alloc(d, sizeof(float) * (size_t)B * H * HD), *out = cu_alloc(d, sizeof(float) * (size_t)B * H * HD);
    void *work = cu_alloc(d, cu_attention_work_bytes(B, H, KVH, HD));
    size_t n_meta = (size_t)nb * nseq + 2 * (size_t)B;
    int32_t *h = malloc(sizeof(int32_t) * n_meta);
    int32_t *h_pos = h, *h_at = h + B, *h_tab = h + 2 * B;
    for (int s = 0; s < B; s++) {
        h_pos[s] = prompt ? s : n_ctx - 1;
        h_at[s] = prompt ? 0 : s * nb;
    }
    for (int s = 0; s < nseq; s++)
        for (int i = 0; i < nb; i++) h_tab[s * nb + i] = s * nb + (i * 37) % nb; /* scattered blocks */
    int32_t *dm = cu_alloc(d, sizeof(int32_t) * n_meta);
    if (!base || !q || !out || !work || !dm) must(1, &(kvlm_error){KVLM_ENOMEM, "out of device memory"});
    cu_h2d(d, dm, h, sizeof(int32_t) * n_meta);
    cu_kv kv = {base, block, head, region, KVLM_CACHE_F16, KVLM_CACHE_F16, BS, HD, KVH};
    cu_kv_batch b = {dm, dm + B, dm + 2 * B, B, prompt ? B - 1 : n_ctx - 1, prompt ? 64 : 1};
    cu_set_attention_mma(d, mma);
    float scale = 1.0f / sqrtf((float)HD);
    for (int i = 0; i < 3; i++) cu_attention(d, out, q, &kv, 0, &b, H, scale, work);
    cu_timer *t = cu_timer_start(d);
    int reps = 50;
    for (int i = 0; i < reps; i++) cu_attention(d, out, q, &kv, 0, &b, H, scale, work);
    double sec = cu_timer_stop(d, t) / reps;
    must(cu_sync(d, &err), &err);
    cu_free(d, base), cu_free(d, q), cu_free(d, out), cu_free(d, work), cu_free(d, dm);
    free(h);
    cu_set_attention_mma(d, true);
    return sec;
}

/* Paged attention alone, the vector kernel against the tensor-core one in
 * the same run: TinyLlama's attention shape (32 query heads, 4 KV heads,
 * head dim 64) and Llama-2-7B's (32 and 32, head dim 128); decode reads
 * every key and value of one layer once per step (bytes = tokens x KV heads
 * x head dim x 2 x 2 per sequence); a prompt of 512 tokens of one sequence
 * attends causally. */
static void bench_attn(void) {
    kvlm_error err = {0};
    cu_dev *d = cu_open(0, &err);
    if (!d) must(1, &err);
    ceilings(d, NULL);
    struct { const char *name; int H, KVH, HD; } shapes[] = {{"TinyLlama (32/4 heads, hd 64)", 32, 4, 64},
                                                            {"Llama-2-7B (32/32 heads, hd 128)", 32, 32, 128},
                                                            {"Llama-3-8B (32/8 heads, hd 128)", 32, 8, 128}};
    const int ctxs[] = {4096, 32768}, seqs[] = {1, 16};
    printf("paged attention alone (f16 cache, blocks of 16): vector kernel -> tensor cores\n");
    for (int si = 0; si < 3; si++) {
        int H = shapes[si].H, KVH = shapes[si].KVH, HD = shapes[si].HD;
        printf(" %s\n  %8s %6s %22s %8s %16s\n", shapes[si].name, "context", "seqs", "us/step", "speedup", "of copy bw");
        for (int ci = 0; ci < 2; ci++)
            for (int bi = 0; bi < 2; bi++) {
                int n_ctx = ctxs[ci], B = seqs[bi];
                if ((double)B * n_ctx * KVH * HD * 4 > 6e9) continue; /* 7B shape: 16 x 32k is 8.6 GB a layer */
                double v = attn_time(d, H, KVH, HD, n_ctx, B, false, false), m = attn_time(d, H, KVH, HD, n_ctx, B, false, true);
                double bytes = (double)B * n_ctx * KVH * HD * 2 * 2;
                printf("  %8d %6d %10.1f -> %8.1f %7.2fx %6.0f%% -> %4.0f%%\n", n_ctx, B, v * 1e6, m * 1e6, v / m,
                       100 * bytes / v / g_bw, 100 * bytes / m / g_bw);
            }
        double v = attn_time(d, H, KVH, HD, 0, 512, true, false), m = attn_time(d, H, KVH, HD, 0, 512, true, true);
        printf("  %8s %6d %10.1f -> %8.1f %7.2fx  (a 512-token prompt, causal)\n", "prompt", 512, v * 1e6, m * 1e6, v / m);
    }
    cu_close(d);
}

/* The host tier under the GPU: a 1,024-token prompt's blocks pushed out of
 * GPU memory by another prompt, then the prompt again: its prefix comes back
 * from host memory (seconds until its next token's logits), with the tier's
 * copies synchronous on the compute stream, then on the copy stream; against
 * computing the prompt again. */
static void bench_tier(const char *path) {
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) must(1, &err);
    int V = kvlm_vocab_size(m), N = 1024;
    int32_t *a = malloc(sizeof(int32_t) * N), *b = malloc(sizeof(int32_t) * N);
    for (int i = 0; i < N; i++) a[i] = 3 + (i * 7919) % (V - 3), b[i] = 3 + (i * 104729 + 11) % (V - 3);
    double t_recompute = 0;
    printf("host tier under the GPU: a %d-token prompt again after its blocks went to host memory\n", N);
    for (int mode = 0; mode < 3; mode++) {
        if (mode == 1) setenv("KVLM_CUDA_TIER_ASYNC", "0", 1);
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.device = KVLM_DEVICE_CUDA;
        cp.n_ctx = N + 64;
        cp.n_batch = N;
        if (mode) {
            cp.kv_blocks = N / 16 + 16; /* room for one prompt: the second pushes the first out */
            cp.kv_host_size = (size_t)1 << 30;
        }
        kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
        unsetenv("KVLM_CUDA_TIER_ASYNC");
        if (!ctx) must(1, &err);
        kvlm_batch ba = {N, a, NULL, NULL, NULL}, bb = {N, b, NULL, NULL, NULL};
        must(kvlm_decode(ctx, &bb, &err), &err); /* warm-up */
        kvlm_seq_free(ctx, 0);
        if (mode == 0) {
            double best = 1e9;
            for (int r = 0; r < 3; r++) {
                kvlm_seq_free(ctx, 0);
                double t0 = util_now_s();
                must(kvlm_decode(ctx, &ba, &err), &err);
                double t = util_now_s() - t0;
                best = t < best ? t : best;
            }
            t_recompute = best;
            printf("  computed again (no tier):          %8.2f ms\n", best * 1e3);
        } else {
            double best = 1e9, t_back = 0;
            int got = 0;
            for (int r = 0; r < 3; r++) {
                must(kvlm_decode(ctx, &ba, &err), &err);
                kvlm_seq_free(ctx, 0);
                must(kvlm_decode(ctx, &bb, &err), &err); /* A's blocks go to host memory */
                kvlm_seq_free(ctx, 0);
                double t0 = util_now_s();
                got = kvlm_seq_reuse_prefix(ctx, 0, a, N);
                double t1 = util_now_s();
                kvlm_batch rest = {N - got, a + got, NULL, NULL, NULL};
                must(kvlm_decode(ctx, &rest, &err), &err);
                double t = util_now_s() - t0;
                if (t < best) best = t, t_back = t1 - t0;
                kvlm_seq_free(ctx, 0);
            }
            kvlm_kv_stats ks;
            kvlm_kv_stats_get(ctx, &ks);
            size_t bb_bytes = ks.block_bytes;
            printf("  from host memory, copies %-6s %8.2f ms (%d tokens back in %.2f ms, %.1f GB/s; %.2fx the time of "
                   "computing)\n", mode == 1 ? "sync: " : "async:", best * 1e3, got, t_back * 1e3,
                   (double)got / 16 * bb_bytes / best / 1e9, best / t_recompute);
        }
        kvlm_ctx_free(ctx);
    }
    free(a), free(b);
    kvlm_model_free(m);
}

int main(int argc, char **argv) {
    if (kvlm_cuda_device_count() <= 0) {
        printf("bench_cuda: no CUDA GPU here\n");
        return 0;
    }
    if (argc >= 3 && !strcmp(argv[1], "tier")) {
        bench_tier(argv[2]);
        return 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "attn")) {
        bench_attn();
        return 0;
    }
    if (argc >= 3 && !strcmp(argv[1], "model")) {
        int batches[8] = {1, 16, 64, 256}, nb = 4, n_ctx = 1024;
        for (int i = 3; i + 1 < argc; i += 2) {
            if (!strcmp(argv[i], "--ctx")) n_ctx = atoi(argv[i + 1]);
            else if (!strcmp(argv[i], "--batches")) {
                nb = 0;
                for (char *p = argv[i + 1]; *p && nb < 8;) {
                    batches[nb++] = (int)strtol(p, &p, 10);
                    if (*p == ',') p++;
                }
            }
        }
        bench_model(argv[2], batches, nb, n_ctx);
        return 0;
    }
    fprintf(stderr, "usage: bench_cuda model PATH [--batches 1,16,64,256] [--ctx N] | bench_cuda attn | bench_cuda tier PATH\n");
    return 2;
}
#else
int main(void) {
    printf("bench_cuda: kvlm was built without CUDA (cmake -DKVLM_CUDA=ON)\n");
    return 0;
}
#endif
