/* cli/cmd_logits: `kvlm logits`: the next-token logits after each token of a
 * prompt, one line per position, for cross-checks against other engines. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli/cli.h"

int cmd_logits(int argc, char **argv) {
    const char *model_path = NULL, *tok_path = NULL, *ids_text = NULL, *prompt = NULL;
    bool one_by_one = false;
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) {
            printf("usage: kvlm logits -m MODEL (--ids \"1 2 3\" | -p PROMPT) [--decode] [--no-kv-cache]\n"
                   "                   [--cache-type-k T] [--cache-type-v T]\n\n"
                   "Prints, for each input position, the next-token logits on one line (%%.6g).\n"
                   "  --decode       feed the tokens one at a time (the decode path) instead of one prefill\n"
                   "  --no-kv-cache  recompute the whole sequence for every token\n"
                   "  -c, --ctx N    context length;  -t, --threads N\n"
                   "  --cache-type-k T, --cache-type-v T  KV cache element types (default f16)\n");
            return 0;
        } else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--ids", &ids_text, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, "-p", "--prompt", &prompt, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, "-c", "--ctx", &cp.n_ctx, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, "-t", "--threads", &cp.n_threads, &bad)) {}
        else if (cli_opt_cache_type(argc, argv, &i, "--cache-type-k", false, &cp.cache_type_k, &bad) ||
                 cli_opt_cache_type(argc, argv, &i, "--cache-type-v", true, &cp.cache_type_v, &bad)) {}
        else if (cli_is(argv[i], NULL, "--decode")) one_by_one = true;
        else if (cli_is(argv[i], NULL, "--no-kv-cache")) cp.no_kv_cache = true;
        else return cli_fail("logits", "unknown option '%s'", argv[i]);
        if (bad) return 1;
    }
    if (!model_path || (!ids_text == !prompt)) return cli_fail("logits", "give -m MODEL and one of --ids or -p");
    kvlm_error err = {0};
    kvlm_model_params mp = {0};
    mp.tokenizer_path = tok_path;
    kvlm_model *m = kvlm_model_load(model_path, &mp, &err);
    if (!m) return cli_fail("logits", "%s", err.msg);
    int rc = 1, n = 0;
    int32_t *ids = NULL;
    int8_t *want = NULL;
    kvlm_ctx *ctx = NULL;
    if (prompt) {
        n = kvlm_tokenize(m, prompt, strlen(prompt), kvlm_add_bos(m), false, NULL, 0, &err);
        if (n < 0) { cli_fail("logits", "%s", err.msg); goto done; }
        ids = malloc(((size_t)n + 1) * sizeof *ids);
        if (!ids) goto done;
        kvlm_tokenize(m, prompt, strlen(prompt), kvlm_add_bos(m), false, ids, n, &err);
    } else {
        size_t cap = strlen(ids_text) / 2 + 1;
        ids = malloc(cap * sizeof *ids);
        if (!ids) goto done;
        const char *s = ids_text;
        char *end;
        while (*s) {
            while (*s == ' ' || *s == ',') s++;
            if (!*s) break;
            errno = 0;
            long v = strtol(s, &end, 10);
            if (end == s || errno || v < 0 || v > 0x7fffffff) { cli_fail("logits", "bad token id near '%s'", s); goto done; }
            ids[n++] = (int32_t)v;
            s = end;
        }
    }
    if (n == 0) { cli_fail("logits", "no tokens"); goto done; }
    ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) { cli_fail("logits", "%s", err.msg); goto done; }
    int vocab = kvlm_model_config(m)->vocab_size;
    want = malloc((size_t)n);
    if (!want) goto done;
    memset(want, 1, (size_t)n);
    for (int i = 0; i < n; i += one_by_one ? 1 : n) {
        kvlm_batch b = {one_by_one ? 1 : n, ids + i, NULL, want, NULL};
        if (kvlm_decode(ctx, &b, &err)) { cli_fail("logits", "%s", err.msg); goto done; }
        for (int r = 0; r < b.n_tokens; r++) {
            const float *l = kvlm_get_logits(ctx, r);
            for (int v = 0; v < vocab; v++) printf(v ? " %.6g" : "%.6g", l[v]);
            printf("\n");
        }
    }
    rc = 0;
done:
    free(want);
    free(ids);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
    return rc;
}
