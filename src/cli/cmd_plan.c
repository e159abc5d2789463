/* cli/cmd_plan: `kvlm plan`: KV cache memory for a context and batch, how
 * many sequences fit a budget, contiguous against paged, and how many cached
 * tokens each KV tier holds. */
#include <stdio.h>
#include "cli/cli.h"

static void mib(char *buf, size_t cap, size_t bytes) {
    if (bytes >= ((size_t)1 << 30)) snprintf(buf, cap, "%.2f GiB", (double)bytes / (1 << 30));
    else if (bytes >= ((size_t)1 << 20)) snprintf(buf, cap, "%.2f MiB", (double)bytes / (1 << 20));
    else snprintf(buf, cap, "%.2f KiB", (double)bytes / 1024);
}

int cmd_plan(int argc, char **argv) {
    const char *model_path = NULL, *mem = NULL, *tok_path = NULL, *tier_mem[3] = {NULL, NULL, NULL};
    static const char *const tier_opt[3] = {"--kv-host-size", "--kv-disk-size", "--kv-redis-size"};
    kvlm_plan_params pp = {0};
    const kvlm_ctx_params dp = kvlm_ctx_default_params(); /* the cache types run and serve use */
    int tk = dp.cache_type_k, tv = dp.cache_type_v;
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) {
            printf("usage: kvlm plan -m MODEL [--ctx N] [--batch B] [--kv-mem SIZE] [--block-size S] [--avg-tokens A]\n"
                   "                 [--cache-type-k T] [--cache-type-v T] [--ubatch-size U]\n"
                   "                 [--kv-host-size SIZE] [--kv-disk-size SIZE] [--kv-redis-size SIZE]\n\n"
                   "Prints KV cache bytes per token, per sequence and for B sequences of N tokens\n"
                   "(2 x layers x KV heads x head dim x bytes per element x tokens x batch), next to the\n"
                   "weights, and how many sequences fit SIZE (default: B full contexts) when the cache\n"
                   "is reserved contiguously per sequence and when it is paged (blocks of S tokens,\n"
                   "default 16), at full context and at an average of A tokens (default N/2), and how\n"
                   "many cached tokens the pool and each KV tier of the given size hold (a tier stores\n"
                   "a block with a small header: docs/kv-tiers.md; for Redis, its maxmemory).\n"
                   "A sliding window's layers hold at most the window and one step of U tokens\n"
                   "(run's -ub, serve's --batch-tokens; default N up to 512).\n"
                   "SIZE: bytes, or with a unit: 512MiB, 2GiB, 1.5GB.\n");
            return 0;
        } else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, "-c", "--ctx", &pp.n_ctx, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, "-b", "--batch", &pp.n_seq, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--kv-mem", &mem, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--block-size", &pp.block_size, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, tier_opt[0], &tier_mem[0], &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, tier_opt[1], &tier_mem[1], &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, tier_opt[2], &tier_mem[2], &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--avg-tokens", &pp.avg_tokens, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, "-ub", "--ubatch-size", &pp.n_batch, &bad)) {}
        else if (cli_opt_cache_type(argc, argv, &i, "--cache-type-k", false, &tk, &bad)) {}
        else if (cli_opt_cache_type(argc, argv, &i, "--cache-type-v", true, &tv, &bad)) {}
        else return cli_fail("plan", "unknown option '%s'", argv[i]);
        if (bad) return 1;
    }
    if (!model_path) return cli_fail("plan", "no model given (-m FILE)");
    if (pp.n_ctx < 0 || pp.n_seq < 0 || pp.block_size < 0 || pp.avg_tokens < 0 || pp.n_batch < 0)
        return cli_fail("plan", "sizes must be positive");
    if (mem && cli_parse_size(mem, &pp.kv_mem)) return cli_fail("plan", "bad size '%s' (e.g. 512MiB, 2GiB)", mem);
    uint64_t *tier_bytes[3] = {&pp.host_bytes, &pp.disk_bytes, &pp.redis_bytes};
    for (int t = 0; t < 3; t++) {
        size_t v = 0;
        if (tier_mem[t] && cli_parse_size(tier_mem[t], &v))
            return cli_fail("plan", "bad size '%s' for %s (e.g. 4GiB, 20GiB)", tier_mem[t], tier_opt[t]);
        *tier_bytes[t] = v;
    }
    kvlm_error err = {0};
    kvlm_model_params mp = {0};
    mp.tokenizer_path = tok_path;
    kvlm_model *m = kvlm_model_load(model_path, &mp, &err);
    if (!m) return cli_fail("plan", "%s", err.msg);
    const kvlm_config *c = kvlm_model_config(m);
    /* K and V bytes per element averaged: the planner's 2 x ... x elem_bytes */
    double ek = kvlm_cache_type_elem_bytes(tk, c->head_dim, pp.block_size),
           ev = kvlm_cache_type_elem_bytes(tv, c->head_dim, pp.block_size);
    pp.elem_bytes = (ek + ev) / 2;
    int mla_row = c->arch == KVLM_ARCH_DEEPSEEK2 ? c->kv_lora_rank + c->rope_dim : 0;
    if (mla_row) pp.elem_bytes = ek = ev = kvlm_cache_type_elem_bytes(tk, mla_row, pp.block_size);
    kvlm_plan p;
    kvlm_plan_memory(m, &pp, &p);
    char a[32], b[32], d[32], e[32], f[32];
    char desc[512];
    kvlm_model_describe(m, desc, sizeof desc);
    printf("model: %s\n  %s\n", model_path, desc);
    mib(a, sizeof a, p.weight_bytes);
    printf("weights:              %s\n", a);
    if (mla_row) {
        /* latent attention: one row per token and layer, values inside it (docs/mla.md) */
        printf("KV per token:         %zu bytes  (MLA: %d layers x (%d latent + %d RoPE) x %.4g bytes, %s; "
               "values are the latent)\n", p.bytes_per_token, c->n_layers, c->kv_lora_rank, c->rope_dim, ek,
               kvlm_cache_type_name(tk));
        printf("MHA of this model:    %zu bytes per token  (%d layers x %d heads x (%d key + %d value) x %.4g "
               "bytes): %.1fx the MLA cache\n", p.mha_bytes_per_token, c->n_layers, c->n_heads, c->head_dim,
               c->v_head_dim, ek, p.bytes_per_token ? (double)p.mha_bytes_per_token / (double)p.bytes_per_token : 0);
    } else
    printf("KV per token:         %zu bytes  (%d layers x %d KV heads x %d head dim x (%.4g + %.4g) bytes, %s/%s)\n",
           p.bytes_per_token, c->n_layers, c->n_kv_heads, c->head_dim, ek, ev, kvlm_cache_type_name(tk),
           kvlm_cache_type_name(tv));
    mib(a, sizeof a, p.bytes_per_seq);
    mib(b, sizeof b, p.bytes_total);
    mib(d, sizeof d, p.bytes_total + p.weight_bytes);
    printf("KV per sequence:      %s at %d tokens\n", a, p.n_ctx);
    printf("KV for %d sequences:  %s   (weights + KV: %s)\n", p.n_seq, b, d);
    if (p.window > 0) {
        char g[32], h[32];
        mib(a, sizeof a, p.bytes_per_seq_window);
        printf("sliding window:       %d tokens on %d of %d layers: their cache holds at most %d tokens of a "
               "sequence (the window and a step of %d token%s)\n", p.window, p.n_local_layers, c->n_layers,
               p.local_cap_tokens, p.n_batch, p.n_batch == 1 ? "" : "s");
        printf("  KV per token:       %zu bytes global + %zu bytes local (up to %d tokens)\n",
               p.bytes_per_token_global, p.bytes_per_token_local, p.local_cap_tokens);
        mib(g, sizeof g, p.bytes_per_seq);
        mib(h, sizeof h, p.kv_mem);
        printf("  KV per sequence:    %s at %d tokens (%.2fx the %s without the window); %ld fit %s\n", a, p.n_ctx,
               p.bytes_per_seq ? (double)p.bytes_per_seq_window / (double)p.bytes_per_seq : 0.0, g,
               p.fit_window_full, h);
    }
    mib(e, sizeof e, p.kv_mem);
    mib(f, sizeof f, p.block_bytes);
    printf("budget %s, blocks of %d tokens (%s each), %d blocks per full sequence:\n", e, p.block_size, f,
           p.blocks_per_seq);
    printf("  %-34s %12s %12s\n", "sequences that fit", "contiguous", "paged");
    printf("  %-34s %12ld %12ld\n", "at full context", p.fit_contiguous, p.fit_paged_full);
    char lbl[64];
    snprintf(lbl, sizeof lbl, "holding %d tokens on average", p.avg_tokens);
    printf("  %-34s %12ld %12ld   (%.1fx)\n", lbl, p.fit_contiguous_avg, p.fit_paged_avg,
           p.fit_contiguous_avg > 0 ? (double)p.fit_paged_avg / (double)p.fit_contiguous_avg : 0.0);
    if (pp.host_bytes || pp.disk_bytes || pp.redis_bytes) {
        mib(f, sizeof f, p.stored_block_bytes);
        printf("cached tokens each level holds (a stored block: %s):\n", f);
        mib(e, sizeof e, p.kv_mem);
        printf("  %-8s %12s %14llu tokens\n", "RAM pool", e, (unsigned long long)p.tokens_ram);
        const char *names[3] = {"host", "disk", "redis"};
        uint64_t toks[3] = {p.tokens_host, p.tokens_disk, p.tokens_redis};
        for (int t = 0; t < 3; t++) {
            if (!*tier_bytes[t]) continue;
            mib(e, sizeof e, (size_t)*tier_bytes[t]);
            printf("  %-8s %12s %14llu tokens  (%.1fx the pool)\n", names[t], e, (unsigned long long)toks[t],
                   p.tokens_ram ? (double)toks[t] / (double)p.tokens_ram : 0.0);
        }
    }
    kvlm_model_free(m);
    return 0;
}
