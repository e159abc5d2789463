/* cli/cmd_perplexity: `kvlm perplexity`: perplexity of a text file, computed
 * as llama.cpp's perplexity tool does, or (--stream) per stretch of positions
 * through bounded caches under each eviction policy, as a table, CSV and SVG. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "cli/cli.h"
#include "cli/llama_flags.h"
#include "cli/progress.h"

/* The chunks' running perplexity on stdout, as llama.cpp prints it; on a
 * terminal, the time left on stderr: one line before the first value when
 * stdout shares the terminal (llama.cpp's "ETA"), else a progress line. */
typedef struct {
    cli_progress pr;
    int total;
    bool line_once; /* stdout is a terminal too: the one line */
} ppl_progress;

static void progress(void *user, int chunk, double ppl) {
    ppl_progress *p = user;
    if (p->pr.on && p->line_once && chunk == 0) {
        double s = cli_now() - p->pr.t0;
        long left = (long)(s * (p->total - 1) + 0.5);
        fprintf(stderr, "perplexity: %.2f s per chunk, %d chunks: about %ld min %02ld s left\n", s, p->total,
                left / 60, left % 60);
    }
    printf("[%d]%.4f,", chunk + 1, ppl);
    fflush(stdout);
    if (!p->line_once) cli_progress_update(&p->pr, (float)(chunk + 1) / (float)p->total);
}

#define MAX_POLICIES 8

/* Loads the model and tokenizes the text file (BOS first where the model adds
 * one); NULL after an error (*m then freed). */
static int32_t *load_tokens(const char *model_path, const char *tok_path, kvlm_model_params *mp, const char *file,
                            kvlm_model **m, int *n) {
    size_t len;
    char *text = cli_read_file("perplexity", file, &len);
    if (!text) return NULL;
    kvlm_error err = {0};
    mp->tokenizer_path = tok_path;
    int32_t *toks = NULL;
    if (!(*m = cli_model_load(model_path, mp, &err))) cli_fail("perplexity", "%s", err.msg);
    else if ((*n = kvlm_tokenize(*m, text, len, kvlm_add_bos(*m), false, NULL, 0, &err)) < 0)
        cli_fail("perplexity", "%s", err.msg);
    else if (!(toks = malloc(((size_t)*n + 1) * sizeof *toks))) cli_fail("perplexity", "out of memory");
    else kvlm_tokenize(*m, text, len, kvlm_add_bos(*m), false, toks, *n, &err);
    free(text);
    if (!toks) { kvlm_model_free(*m); *m = NULL; }
    return toks;
}

/* One line per policy of log-scaled perplexity against position, hand-written SVG. */
static int write_svg(const char *path, char names[][16], int n_pol, const double *ppl, int n_str, int stride,
                     int budget, int n_ctx_train) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    static const char *colors[] = {"#000000", "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"};
    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < n_pol * n_str; i++)
        if (isfinite(ppl[i])) { lo = fmin(lo, log10(ppl[i])); hi = fmax(hi, log10(ppl[i])); }
    if (!(lo < hi)) { lo = 0; hi = 1; }
    lo = floor(lo * 10) / 10; hi = ceil(hi * 10) / 10;
    const double W = 760, H = 360, X0 = 70, Y0 = 30;
    double xmax = (double)n_str * stride;
#define SX(x) (X0 + (x) / xmax * W)
#define SY(y) (Y0 + H - ((y) - lo) / (hi - lo) * H)
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
               "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W + 200, H + 80);
    fprintf(f, "<text x=\"%.0f\" y=\"18\">perplexity per %d positions (log scale), KV budget %d</text>\n", X0, stride, budget);
    for (double y = lo; y <= hi + 1e-9; y += (hi - lo) / 5)
        fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/><text x=\"5\" y=\"%.1f\">%.1f</text>\n",
                X0, X0 + W, SY(y), SY(y), SY(y) + 4, pow(10, y));
    for (int k = 0; k <= n_str; k += n_str > 16 ? n_str / 8 : 1)
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>\n", SX((double)k * stride), Y0 + H + 16, k * stride);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">position in the text (tokens)</text>\n", X0 + W / 2, Y0 + H + 34);
    int marks[2] = {budget, n_ctx_train};
    const char *mark_names[2] = {"budget", "trained context"};
    for (int m = 0; m < 2; m++)
        if (marks[m] > 0 && marks[m] < xmax)
            fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#888\" stroke-dasharray=\"4\"/>"
                       "<text x=\"%.1f\" y=\"%.1f\" fill=\"#888\">%s</text>\n",
                    SX(marks[m]), SX(marks[m]), Y0, Y0 + H, SX(marks[m]) + 3, Y0 + 12 + 14 * m, mark_names[m]);
    for (int p = 0; p < n_pol; p++) {
        fprintf(f, "<polyline fill=\"none\" stroke-width=\"2\" stroke=\"%s\" points=\"", colors[p % 8]);
        for (int k = 0; k < n_str; k++)
            if (isfinite(ppl[p * n_str + k]))
                fprintf(f, "%.1f,%.1f ", SX((k + 0.5) * stride), SY(log10(ppl[p * n_str + k])));
        fprintf(f, "\"/>\n<text x=\"%.0f\" y=\"%.0f\" fill=\"%s\">%s</text>\n", X0 + W + 15, Y0 + 20 + 18.0 * p,
                colors[p % 8], names[p]);
    }
#undef SX
#undef SY
    fprintf(f, "</svg>\n");
    return fclose(f);
}

static void stream_usage(FILE *f) {
    fprintf(f, "usage: kvlm perplexity --stream -m MODEL -f TEXT [--kv-evict P1,P2,...] [--kv-budget N]\n"
               "                        [--stride N] [--tokens N] [--csv FILE] [--svg FILE] [options]\n\n"
               "Feeds the first N tokens of TEXT (--tokens, default 4096) one at a time through a cache\n"
               "bounded to --kv-budget tokens (default 256) under each policy in turn (default\n"
               "none,window,sinks,h2o; none keeps everything: the full cache) and prints perplexity per\n"
               "stretch of --stride positions (default 256): one row per stretch, one column per policy.\n"
               "  --csv FILE        the table as CSV;  --svg FILE: a chart, one line per policy\n"
               "  --trained-ctx N   where the chart marks the trained context (default: the model's metadata)\n"
               "Context and cache options (-c: the bounded runs' context; --kv-evict: a comma-separated list):\n"
               CLI_CTX_USAGE);
}

static int cmd_perplexity_stream(int argc, char **argv) {
    const char *model_path = NULL, *file = NULL, *tok_path = NULL, *csv = NULL, *svg = NULL, *kv_mem = NULL;
    const char *policies = "none,window,sinks,h2o";
    int stride = 256, n_max = 4096, n_ctx_train = 0;
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.kv_budget = 256;
    cli_llama ll;
    cli_llama_init(&ll);
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) { stream_usage(stdout); return 0; }
        else if (cli_is(argv[i], NULL, "--stream")) {}
        else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, "-f", "--file", &file, &bad)) {}
        else if (cli_opt_ctx(argc, argv, &i, &cp, &kv_mem, &policies, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--stride", &stride, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--tokens", &n_max, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--trained-ctx", &n_ctx_train, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--csv", &csv, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--svg", &svg, &bad)) {}
        else if (cli_opt_llama(argc, argv, &i, &ll, &bad)) {}
        else if (cli_llama_unsupported("perplexity", argv[i])) return 1;
        else { cli_fail("perplexity", "unknown option '%s'", argv[i]); stream_usage(stderr); return 1; }
        if (bad) return 1;
    }
    if (!model_path || !file) return cli_fail("perplexity", "give -m MODEL and -f TEXT");
    if (stride < 1 || n_max < 2 || cp.kv_budget < 1)
        return cli_fail("perplexity", "--stride, --kv-budget must be >= 1 and --tokens >= 2");
    if (cli_ctx_finish("perplexity", &cp, kv_mem, NULL)) return 1; /* the policies are a list: below */
    kvlm_model_params mp = {0};
    if (cli_llama_finish("perplexity", &ll, &cp, &mp)) return 1;
    char names[MAX_POLICIES][16];
    int ids[MAX_POLICIES], n_pol = 0;
    for (const char *p = policies; *p;) {
        size_t l = strcspn(p, ",");
        if (n_pol == MAX_POLICIES || l == 0 || l >= sizeof names[0])
            return cli_fail("perplexity", "--kv-evict takes up to %d of none, window, sinks, h2o, comma-separated", MAX_POLICIES);
        memcpy(names[n_pol], p, l);
        names[n_pol][l] = 0;
        if ((ids[n_pol] = kvlm_evict_from_name(names[n_pol])) < 0)
            return cli_fail("perplexity", "unknown eviction policy '%s' (none, window, sinks, h2o)", names[n_pol]);
        n_pol++;
        p += l + (p[l] == ',');
    }
    kvlm_model *m;
    int n, rc = 1;
    int32_t *toks = load_tokens(model_path, tok_path, &mp, file, &m, &n);
    if (!toks) return 1;
    kvlm_error err = {0};
    double *ppl = NULL;
    if (n > n_max) n = n_max;
    if (n < 2) { cli_fail("perplexity", "the text has fewer than 2 tokens"); goto done; }
    int n_str = (n + stride - 1) / stride;
    ppl = malloc((size_t)n_pol * n_str * sizeof *ppl);
    if (!ppl) { cli_fail("perplexity", "out of memory"); goto done; }
    double total[MAX_POLICIES];
    for (int p = 0; p < n_pol; p++) {
        kvlm_ctx_params q = cp;
        q.kv_evict = ids[p];
        if (ids[p] == KVLM_EVICT_NONE) { q.n_ctx = n; q.kv_budget = 0; } /* the full cache */
        kvlm_ctx *ctx = kvlm_ctx_create(m, &q, &err);
        kvlm_ppl_result r;
        if (!ctx || kvlm_perplexity_stream(ctx, toks, n, stride, ppl + (size_t)p * n_str, &r, &err)) {
            kvlm_ctx_free(ctx);
            cli_fail("perplexity", "%s: %s", names[p], err.msg);
            goto done;
        }
        total[p] = r.ppl;
        fprintf(stderr, "perplexity: %-6s overall PPL %.4f over %d tokens\n", names[p], r.ppl, r.n_scored);
        kvlm_ctx_free(ctx);
    }
    printf("%-11s", "positions");
    for (int p = 0; p < n_pol; p++) printf(" %10s", names[p]);
    printf("\n");
    for (int k = 0; k < n_str; k++) {
        char range[32];
        snprintf(range, sizeof range, "%d-%d", k * stride, (k + 1) * stride < n ? (k + 1) * stride - 1 : n - 1);
        printf("%-11s", range);
        for (int p = 0; p < n_pol; p++) printf(" %10.3f", ppl[(size_t)p * n_str + k]);
        printf("\n");
    }
    printf("%-11s", "all");
    for (int p = 0; p < n_pol; p++) printf(" %10.3f", total[p]);
    printf("\n");
    if (csv) {
        FILE *f = fopen(csv, "w");
        if (!f) { cli_fail("perplexity", "cannot write %s", csv); goto done; }
        fprintf(f, "start,end");
        for (int p = 0; p < n_pol; p++) fprintf(f, ",%s", names[p]);
        fprintf(f, "\n");
        for (int k = 0; k < n_str; k++) {
            fprintf(f, "%d,%d", k * stride, (k + 1) * stride < n ? (k + 1) * stride : n);
            for (int p = 0; p < n_pol; p++) fprintf(f, ",%.6f", ppl[(size_t)p * n_str + k]);
            fprintf(f, "\n");
        }
        if (fclose(f)) { cli_fail("perplexity", "cannot write %s", csv); goto done; }
    }
    if (svg && write_svg(svg, names, n_pol, ppl, n_str, stride, cp.kv_budget,
                         n_ctx_train > 0 ? n_ctx_train : kvlm_model_config(m)->n_ctx_train)) {
        cli_fail("perplexity", "cannot write %s", svg);
        goto done;
    }
    rc = 0;
done:
    free(ppl);
    free(toks);
    kvlm_model_free(m);
    return rc;
}

int cmd_perplexity(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--stream")) return cmd_perplexity_stream(argc, argv);
    const char *model_path = NULL, *file = NULL, *tok_path = NULL, *kv_mem = NULL, *evict = NULL;
    int n_chunks = 0;
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 512;
    cli_llama ll;
    cli_llama_init(&ll);
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) {
            printf("usage: kvlm perplexity -m MODEL -f TEXT [-c N] [--chunks K] [options]\n\n"
                   "Tokenizes TEXT once (BOS first where the model adds one), cuts it into consecutive\n"
                   "chunks of N tokens (default 512; the first K chunks, default all), puts BOS first in\n"
                   "each chunk, and scores each token of a chunk's second half given everything before it\n"
                   "in the chunk, as llama.cpp's perplexity tool does. Ends with\n"
                   "  Final estimate: PPL = <ppl> +/- <standard error>\n"
                   "With --stream: perplexity per stretch of positions through bounded KV caches under\n"
                   "each eviction policy (kvlm perplexity --stream --help), where the eviction options\n"
                   "below apply; -c is the chunk size here (default 512).\n"
                   "On a terminal, stderr tells the time left (nothing is added when it is piped).\n"
                   "  -c, --ctx N             the chunk size (default 512 here)\n"
                   CLI_CTX_USAGE
                   CLI_LLAMA_USAGE);
            return 0;
        } else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, "-f", "--file", &file, &bad)) {}
        else if (cli_opt_ctx(argc, argv, &i, &cp, &kv_mem, &evict, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--chunks", &n_chunks, &bad)) {}
        else if (cli_opt_llama(argc, argv, &i, &ll, &bad)) {}
        else if (cli_llama_unsupported("perplexity", argv[i])) return 1;
        else return cli_fail("perplexity", "unknown option '%s'", argv[i]);
        if (bad) return 1;
    }
    if (!model_path || !file) return cli_fail("perplexity", "give -m MODEL and -f TEXT");
    if (cli_ctx_finish("perplexity", &cp, kv_mem, evict)) return 1;
    kvlm_model_params mp = {0};
    if (cli_llama_finish("perplexity", &ll, &cp, &mp)) return 1;
    if (cp.kv_evict || cp.kv_budget)
        return cli_fail("perplexity", "--kv-evict and --kv-budget bound the cache per policy: use them with --stream");
    if (cp.n_ctx < 8) return cli_fail("perplexity", "the context must be at least 8 tokens");
    kvlm_model *m;
    int n, rc = 1;
    int32_t *toks = load_tokens(model_path, tok_path, &mp, file, &m, &n);
    if (!toks) return 1;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) { cli_fail("perplexity", "%s", err.msg); goto done; }
    kvlm_kv_stats ks;
    kvlm_kv_stats_get(ctx, &ks);
    fprintf(stderr, "perplexity: %d tokens, chunks of %d, KV cache %s/%s, %zu bytes per token\n", n, cp.n_ctx,
            kvlm_cache_type_name(cp.cache_type_k), kvlm_cache_type_name(cp.cache_type_v), ks.bytes_per_token);
    kvlm_ppl_result r;
    ppl_progress pp;
    cli_progress_begin(&pp.pr, "perplexity");
    pp.total = n / cp.n_ctx > 0 ? n / cp.n_ctx : 1;
    if (n_chunks > 0 && n_chunks < pp.total) pp.total = n_chunks;
    pp.line_once = isatty(STDOUT_FILENO);
    int prc = kvlm_perplexity(ctx, toks, n, n_chunks, progress, &pp, &r, &err);
    cli_progress_end(&pp.pr);
    if (prc) {
        printf("\n");
        cli_fail("perplexity", "%s", err.msg);
        goto done;
    }
    printf("\nFinal estimate: PPL = %.4f +/- %.5f\n", r.ppl, r.ppl_stderr);
    fprintf(stderr, "perplexity: %d chunks, %d tokens scored\n", r.n_chunks, r.n_scored);
    rc = 0;
done:
    free(toks);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
    return rc;
}
