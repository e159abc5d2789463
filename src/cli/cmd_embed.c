/* cli/cmd_embed: `kvlm embed`: embeddings of texts (or token ids), all
 * inputs through the scheduler at once, printed as text or JSON. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli/cli.h"

typedef struct {
    int32_t *toks;
    int n;
    float *vec; /* its vector(s), once its event came */
    int n_vec;
    int finish;
    char error[256];
} input;

typedef struct {
    input *in;
    int n, n_done;
} run_state;

static bool on_event(void *user, const kvlm_sched_event *ev) {
    run_state *r = user;
    input *x = &r->in[ev->index];
    x->finish = ev->finish;
    if (ev->embedding && ev->n_embd > 0 && (x->vec = malloc((size_t)ev->n_embd * sizeof(float)))) {
        memcpy(x->vec, ev->embedding, (size_t)ev->n_embd * sizeof(float));
        x->n_vec = ev->n_embd;
    }
    if (ev->error) snprintf(x->error, sizeof x->error, "%s", ev->error);
    r->n_done++;
    return true;
}

/* "1 2 3" (or commas) as token ids; -1 after an error message. */
static int parse_ids(const char *s, int32_t **out) {
    size_t cap = strlen(s) / 2 + 1;
    int32_t *ids = malloc(cap * sizeof *ids);
    int n = 0;
    if (!ids) return cli_fail("embed", "out of memory"), -1;
    while (*s) {
        while (*s == ' ' || *s == ',') s++;
        if (!*s) break;
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || v < 0 || v > 0x7fffffff) {
            free(ids);
            return cli_fail("embed", "bad token id near '%.20s'", s), -1;
        }
        ids[n++] = (int32_t)v;
        s = end;
    }
    *out = ids;
    return n;
}

static void print_vec(const float *v, int n, bool json) {
    for (int i = 0; i < n; i++) printf(json ? "%s%.9g" : "%s%.9g", i ? (json ? ", " : " ") : "", (double)v[i]);
}

int cmd_embed(int argc, char **argv) {
    const char *model_path = NULL, *file = NULL, *pooling = NULL, *format = "text", *kv_mem = NULL, *evict = NULL;
    const char **texts = calloc((size_t)argc, sizeof *texts), **idss = calloc((size_t)argc, sizeof *idss);
    int n_texts = 0, n_ids = 0, parallel = 0, batch = 0;
    kvlm_embed_params ep = kvlm_embed_default_params();
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    if (!texts || !idss) return cli_fail("embed", "out of memory");
    int rc = 1;
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        const char *one = NULL;
        if (cli_is(argv[i], "-h", "--help")) {
            printf("usage: kvlm embed -m MODEL (-p TEXT ... | -f FILE | --ids \"1 2 3\" ...) [options]\n\n"
                   "Prints the embedding of each input (docs/embeddings.md): its tokens' hidden states pooled\n"
                   "into one vector by the model's rule ({arch}.pooling_type) and L2-normalised, as\n"
                   "POST /v1/embeddings gives them. Every input goes through the scheduler at once.\n"
                   "  -p, --prompt TEXT   an input (repeatable)\n"
                   "  -f, --file FILE     one input per line (empty lines skipped)\n"
                   "      --ids IDS       an input as token ids, \"1 2 3\" (repeatable; no BOS or EOS added)\n"
                   "      --pooling P     none (a vector per token), mean, cls or last instead of the model's\n"
                   "      --no-normalize  the pooled vector as it is (default: unit length)\n"
                   "      --dimensions N  the vector's first N values (Matryoshka), normalised after\n"
                   "      --format F      text (default: one vector a line, values separated by spaces; pooling\n"
                   "                      none: a line per token, an empty line after each input) or json (an\n"
                   "                      array with one vector per input; pooling none: one array of vectors)\n"
                   "      --parallel N    inputs at once (sequences; default: up to 16)\n"
                   "      --batch N       most tokens per step (default 512)\n"
                   CLI_CTX_USAGE);
            rc = 0;
            goto done;
        } else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, "-p", "--prompt", &one, &bad)) { if (one) texts[n_texts++] = one; }
        else if (cli_opt_str(argc, argv, &i, NULL, "--ids", &one, &bad)) { if (one) idss[n_ids++] = one; }
        else if (cli_opt_str(argc, argv, &i, "-f", "--file", &file, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--pooling", &pooling, &bad)) {}
        else if (cli_is(argv[i], NULL, "--no-normalize")) ep.no_normalize = true;
        else if (cli_opt_int(argc, argv, &i, NULL, "--dimensions", &ep.dims, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--format", &format, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--parallel", &parallel, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--batch", &batch, &bad)) {}
        else if (cli_opt_ctx(argc, argv, &i, &cp, &kv_mem, &evict, &bad)) {}
        else { cli_fail("embed", "unknown option '%s'", argv[i]); goto done; }
        if (bad) goto done;
    }
    bool json = !strcmp(format, "json");
    if (!json && strcmp(format, "text")) { cli_fail("embed", "--format is text or json, not '%s'", format); goto done; }
    if (pooling && (ep.pooling = kvlm_pooling_from_name(pooling)) < 0) {
        cli_fail("embed", "unknown pooling '%s' (none, mean, cls, last)", pooling);
        goto done;
    }
    if (ep.dims < 0) { cli_fail("embed", "--dimensions must be at least 1"); goto done; }
    if (!model_path) { cli_fail("embed", "no model given (-m FILE)"); goto done; }
    if (!n_texts && !n_ids && !file) { cli_fail("embed", "no input given (-p TEXT, -f FILE or --ids IDS)"); goto done; }
    if (cli_ctx_finish("embed", &cp, kv_mem, evict)) goto done;
    char *buf = NULL;
    size_t len = 0;
    if (file && !(buf = cli_read_file("embed", file, &len))) goto done;
    /* the inputs: -p texts, then the file's lines, then --ids */
    int n_lines = 0;
    for (size_t k = 0; buf && k < len; k++) n_lines += buf[k] == '\n';
    int cap = n_texts + n_ids + n_lines + 1, n_in = 0;
    const char **all = calloc((size_t)cap, sizeof *all);
    input *in = calloc((size_t)cap, sizeof *in);
    kvlm_error err = {0};
    kvlm_model *m = NULL;
    kvlm_ctx *ctx = NULL;
    kvlm_sched *s = NULL;
    int32_t **prompts = NULL;
    int *lens = NULL;
    if (!all || !in) { cli_fail("embed", "out of memory"); goto out; }
    for (int k = 0; k < n_texts; k++) all[n_in++] = texts[k];
    for (char *p = buf; p && p < buf + len;) {
        char *nl = memchr(p, '\n', (size_t)(buf + len - p));
        if (nl) *nl = 0;
        if (*p) all[n_in++] = p;
        p = nl ? nl + 1 : buf + len;
    }
    if (!(m = kvlm_model_load(model_path, NULL, &err))) { cli_fail("embed", "%s", err.msg); goto out; }
    for (int k = 0; k < n_in; k++) {
        const char *t = all[k];
        int n = kvlm_embed_tokenize(m, t, strlen(t), NULL, 0, &err);
        if (n < 0) { cli_fail("embed", "input %d: %s", k, err.msg); goto out; }
        if (!(in[k].toks = malloc(((size_t)n + 1) * sizeof(int32_t)))) { cli_fail("embed", "out of memory"); goto out; }
        in[k].n = kvlm_embed_tokenize(m, t, strlen(t), in[k].toks, n, &err);
    }
    for (int k = 0; k < n_ids; k++) {
        int n = parse_ids(idss[k], &in[n_in].toks);
        if (n < 0) goto out;
        in[n_in++].n = n;
    }
    if (n_in == 0) { cli_fail("embed", "no input (the file has no non-empty line)"); goto out; }
    if (cp.n_seq_max <= 0) cp.n_seq_max = parallel > 0 ? parallel : n_in < 16 ? n_in : 16;
    if (!(ctx = kvlm_ctx_create(m, &cp, &err))) { cli_fail("embed", "%s", err.msg); goto out; }
    kvlm_sched_params sp = {.batch_tokens = batch};
    if (!(s = kvlm_sched_create(ctx, &sp, &err))) { cli_fail("embed", "%s", err.msg); goto out; }
    prompts = calloc((size_t)n_in, sizeof *prompts);
    lens = calloc((size_t)n_in, sizeof *lens);
    if (!prompts || !lens) { cli_fail("embed", "out of memory"); goto out; }
    for (int k = 0; k < n_in; k++) prompts[k] = in[k].toks, lens[k] = in[k].n;
    run_state st = {in, n_in, 0};
    if (!kvlm_sched_submit_embed(s, (const int32_t *const *)prompts, lens, n_in, &ep, on_event, &st, &err)) {
        cli_fail("embed", "%s", err.msg);
        goto out;
    }
    while (kvlm_sched_step(s) > 0) {}
    int dims = kvlm_embed_dims(m, &ep, &err);
    bool per_token = (ep.pooling == KVLM_POOLING_UNSPECIFIED ? kvlm_model_pooling(m) : ep.pooling) == KVLM_POOLING_NONE;
    if (json) printf("[");
    for (int k = 0; k < n_in; k++) {
        if (in[k].finish != KVLM_FINISH_STOP || !in[k].vec) {
            if (json) printf("]\n");
            fflush(stdout);
            cli_fail("embed", "input %d: %s", k, in[k].error[0] ? in[k].error : "no embedding");
            goto out;
        }
        int rows = in[k].n_vec / dims;
        if (json) printf("%s%s", k ? ", " : "", per_token ? "[" : "");
        for (int r = 0; r < rows; r++) {
            if (json) printf("%s[", r ? ", " : "");
            print_vec(in[k].vec + (size_t)r * dims, dims, json);
            printf(json ? "]" : "\n");
        }
        if (json && per_token) printf("]");
        if (!json && per_token) printf("\n");
    }
    if (json) printf("]\n");
    rc = 0;
out:
    kvlm_sched_free(s);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
    for (int k = 0; in && k < cap; k++) free(in[k].toks), free(in[k].vec);
    free(in);
    free(all);
    free(prompts);
    free(lens);
    free(buf);
done:
    free(texts);
    free(idss);
    return rc;
}
