/* cli/cmd_perplexity: `kvlm perplexity`: perplexity of a text file, computed
 * as llama.cpp's perplexity tool does. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli/cli.h"

static void progress(void *user, int chunk, double ppl) {
    (void)user;
    printf("[%d]%.4f,", chunk + 1, ppl);
    fflush(stdout);
}

int cmd_perplexity(int argc, char **argv) {
    const char *model_path = NULL, *file = NULL, *tok_path = NULL;
    int n_chunks = 0;
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 512;
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) {
            printf("usage: kvlm perplexity -m MODEL -f TEXT [-c N] [--chunks K] [-t THREADS]\n"
                   "                        [--cache-type-k T] [--cache-type-v T]\n\n"
                   "Tokenizes TEXT once (BOS first where the model adds one), cuts it into consecutive\n"
                   "chunks of N tokens (default 512; the first K chunks, default all), puts BOS first in\n"
                   "each chunk, and scores each token of a chunk's second half given everything before it\n"
                   "in the chunk, as llama.cpp's perplexity tool does. Ends with\n"
                   "  Final estimate: PPL = <ppl> +/- <standard error>\n"
                   "--cache-type-k/-v: KV cache element types (f32 default, f16, bf16, q8_0, q4_0;\n"
                   "q4_kc for keys only).\n");
            return 0;
        } else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, "-f", "--file", &file, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, "-c", "--ctx", &cp.n_ctx, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--chunks", &n_chunks, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, "-t", "--threads", &cp.n_threads, &bad)) {}
        else if (cli_opt_cache_type(argc, argv, &i, "--cache-type-k", false, &cp.cache_type_k, &bad)) {}
        else if (cli_opt_cache_type(argc, argv, &i, "--cache-type-v", true, &cp.cache_type_v, &bad)) {}
        else return cli_fail("perplexity", "unknown option '%s'", argv[i]);
        if (bad) return 1;
    }
    if (!model_path || !file) return cli_fail("perplexity", "give -m MODEL and -f TEXT");
    if (cp.n_ctx < 8) return cli_fail("perplexity", "the context must be at least 8 tokens");
    size_t len;
    char *text = cli_read_file("perplexity", file, &len);
    if (!text) return 1;
    kvlm_error err = {0};
    kvlm_model_params mp = {0};
    mp.tokenizer_path = tok_path;
    int rc = 1;
    int32_t *toks = NULL;
    kvlm_ctx *ctx = NULL;
    kvlm_model *m = kvlm_model_load(model_path, &mp, &err);
    if (!m) { cli_fail("perplexity", "%s", err.msg); goto done; }
    int n = kvlm_tokenize(m, text, len, kvlm_add_bos(m), false, NULL, 0, &err);
    if (n < 0) { cli_fail("perplexity", "%s", err.msg); goto done; }
    toks = malloc(((size_t)n + 1) * sizeof *toks);
    if (!toks) { cli_fail("perplexity", "out of memory"); goto done; }
    kvlm_tokenize(m, text, len, kvlm_add_bos(m), false, toks, n, &err);
    ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) { cli_fail("perplexity", "%s", err.msg); goto done; }
    kvlm_kv_stats ks;
    kvlm_kv_stats_get(ctx, &ks);
    fprintf(stderr, "perplexity: %d tokens, chunks of %d, KV cache %s/%s, %zu bytes per token\n", n, cp.n_ctx,
            kvlm_cache_type_name(cp.cache_type_k), kvlm_cache_type_name(cp.cache_type_v), ks.bytes_per_token);
    kvlm_ppl_result r;
    if (kvlm_perplexity(ctx, toks, n, n_chunks, progress, NULL, &r, &err)) {
        printf("\n");
        cli_fail("perplexity", "%s", err.msg);
        goto done;
    }
    printf("\nFinal estimate: PPL = %.4f +/- %.5f\n", r.ppl, r.ppl_stderr);
    fprintf(stderr, "perplexity: %d chunks, %d tokens scored\n", r.n_chunks, r.n_scored);
    rc = 0;
done:
    free(toks);
    free(text);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
    return rc;
}
