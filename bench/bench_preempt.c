/* bench/bench_preempt: the two costs preemption weighs, per model: a round
 * trip of a sequence's KV bytes through the swap space (kvlm_seq_swap_out +
 * kvlm_seq_swap_in, timed, against the copy rate the context measured) and
 * recomputing its tokens (the forward pass's prefill tokens/s); the rule in
 * engine/sched.c swaps when bytes / copy_rate < tokens / prefill_rate.
 * Arguments: GGUF files (default: stories260K and stories4M_hd64 from
 * $KVLM_MODELS, and random-weight stories110M and TinyLlama-1.1B shapes). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench_common.h"
#include "kvlm.h"
#include "util/timing.h"

static void measure(const char *path, int n_tok) {
    kvlm_model *m = bench_load(path);
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = n_tok + 16;
    cp.n_batch = 256;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    int32_t *toks = malloc((size_t)n_tok * sizeof *toks);
    for (int i = 0; i < n_tok; i++) toks[i] = 3 + (i * 7919) % (kvlm_vocab_size(m) - 3);
    kvlm_batch b = {n_tok, toks, NULL, NULL, NULL};
    double t0 = util_now_s();
    if (kvlm_decode(ctx, &b, &err)) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    double t_prefill = util_now_s() - t0;
    double copy_rate, prefill_rate;
    kvlm_ctx_preempt_rates(ctx, &copy_rate, &prefill_rate);
    size_t bytes = kvlm_seq_swap_bytes(ctx, 0);
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        kvlm_swap *h;
        t0 = util_now_s();
        if (kvlm_seq_swap_out(ctx, 0, &h, &err) || kvlm_seq_swap_in(ctx, 0, h, &err)) {
            fprintf(stderr, "%s\n", err.msg);
            exit(1);
        }
        double dt = util_now_s() - t0;
        if (dt < best) best = dt;
    }
    const char *name = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    double t_swap_rule = (double)bytes / copy_rate, t_recompute_rule = n_tok / prefill_rate;
    printf("%-32s %5d tokens, %9zu bytes: round trip %.2f GB/s (measured), swap out+in %8.3f ms "
           "(rule %8.3f ms); prefill %9.0f tokens/s, recompute %9.3f ms (rule %9.3f ms): swap %.0fx cheaper\n",
           name, n_tok, bytes, copy_rate / 1e9, best * 1e3, t_swap_rule * 1e3, prefill_rate, t_prefill * 1e3,
           t_recompute_rule * 1e3, t_recompute_rule / t_swap_rule);
    free(toks);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

int main(int argc, char **argv) {
    if (argc > 1) {
        for (int i = 1; i < argc; i++) measure(argv[i], 256);
        return 0;
    }
    const char *dir = getenv("KVLM_MODELS") ? getenv("KVLM_MODELS") : "../shared/models";
    char p[1024];
    snprintf(p, sizeof p, "%s/stories260K.gguf", dir);
    measure(p, 256);
    snprintf(p, sizeof p, "%s/stories4M_hd64.gguf", dir);
    measure(p, 256);
    bench_shape s110 = {"stories110M", 768, 2048, 12, 12, 12, 32000, 1024};
    measure(bench_model_path(&s110, "q8_0", p, sizeof p), 256);
    bench_shape tl = {"tinyllama1.1B", 2048, 5632, 22, 32, 4, 32000, 4096};
    measure(bench_model_path(&tl, "q8_0", p, sizeof p), 256);
    return 0;
}
