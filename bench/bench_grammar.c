/* bench/bench_grammar: what structured output costs a decode step. On a
 * random-weight model of the stories110M shape with a 32,000-token vocabulary
 * (Q8_0), the same sampling decode (temperature 0.8, 200 tokens, one seed) is
 * timed without a grammar, with the JSON mode's grammar, with a JSON schema
 * and with a GBNF grammar, all in this run: the ratio to the plain decode is
 * what a user sees; the mask's own time per token is printed beside it, and
 * the first mask's (which sorts the vocabulary's texts once per model).
 * Usage: bench_grammar [THREADS] [N_TOKENS] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench_common.h"
#include "kvlm.h"
#include "util/timing.h"

typedef struct { double total, sample; int n, closed; } result;

static void die(const char *what, const kvlm_error *err) {
    fprintf(stderr, "bench_grammar: %s: %s\n", what, err->msg);
    exit(1);
}

/* Decodes up to n tokens after the prompt, sampling with grammar g (or none);
 * stops at an end token. Times the whole loop and the sampler's part. */
static result generate(kvlm_ctx *c, const kvlm_grammar *g, const int32_t *prompt, int np, int n) {
    kvlm_error err = {0};
    kvlm_ctx_reset(c);
    kvlm_batch b = {np, prompt, NULL, NULL, NULL};
    if (kvlm_decode(c, &b, &err)) die("prefill", &err);
    kvlm_sampler_params sp = kvlm_sampler_default_params();
    sp.seed = 42;
    sp.grammar = g;
    const kvlm_model *m = kvlm_ctx_model(c);
    kvlm_sampler *s = kvlm_sampler_create(&sp, kvlm_vocab_size(m));
    if (!s) { fprintf(stderr, "bench_grammar: sampler\n"); exit(1); }
    result r = {0};
    double t0 = util_now_s();
    for (int i = 0; i < n; i++) {
        double ts = util_now_s();
        int32_t t = kvlm_sampler_sample(s, kvlm_get_logits(c, -1));
        r.sample += util_now_s() - ts;
        r.n++;
        if (kvlm_token_is_eog(m, t)) { r.closed = 1; break; }
        kvlm_batch one = {1, &t, NULL, NULL, NULL};
        b = one;
        if (kvlm_decode(c, &b, &err)) die("decode", &err);
    }
    r.total = util_now_s() - t0;
    kvlm_sampler_free(s);
    return r;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2, n = argc > 2 ? atoi(argv[2]) : 200;
    bench_shape shape = {"stories110M", 768, 2048, 12, 12, 12, 32000, 1024};
    char path[512];
    kvlm_model *m = bench_load(bench_model_path(&shape, "q8_0", path, sizeof path));
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_threads = threads;
    cp.n_ctx = 1024;
    kvlm_error err = {0};
    kvlm_ctx *c = kvlm_ctx_create(m, &cp, &err);
    if (!c) die("context", &err);
    int32_t prompt[64];
    int np = kvlm_tokenize(m, "Here is the answer as JSON:", 27, true, false, prompt, 64, &err);
    if (np < 0) die("tokenize", &err);

    const char *schema = "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\", \"maxLength\": 12},"
                         "\"age\": {\"type\": \"integer\", \"minimum\": 0}, \"tags\": {\"type\": \"array\", \"items\":"
                         "{\"enum\": [\"red\", \"green\", \"blue\"]}}}, \"required\": [\"name\", \"age\", \"tags\"]}";
    const char *gbnf = "root ::= (line \"\\n\")+\nline ::= [a-z]+ (\" \" [a-z]+)* [.!?]\n";
    struct { const char *name; kvlm_grammar *g; } cases[4] = {{"none", NULL}};
    double t0 = util_now_s();
    cases[1].name = "json_object";
    cases[1].g = kvlm_grammar_from_json_schema(m, "{\"type\": \"object\"}", &err);
    cases[2].name = "json_schema";
    cases[2].g = kvlm_grammar_from_json_schema(m, schema, &err);
    cases[3].name = "gbnf";
    cases[3].g = kvlm_grammar_from_gbnf(m, gbnf, NULL, &err);
    double compile = util_now_s() - t0;
    for (int i = 1; i < 4; i++)
        if (!cases[i].g) die(cases[i].name, &err);
    /* the first mask sorts the vocabulary's texts (once per model) */
    kvlm_sampler_params sp = kvlm_sampler_default_params();
    sp.grammar = cases[1].g;
    kvlm_sampler *s = kvlm_sampler_create(&sp, kvlm_vocab_size(m));
    float *z = calloc((size_t)kvlm_vocab_size(m), sizeof *z);
    t0 = util_now_s();
    kvlm_sampler_sample(s, z);
    double first = util_now_s() - t0;
    kvlm_sampler_free(s);
    free(z);
    printf("bench_grammar: stories110M shape, Q8_0, vocabulary %d, %d threads, up to %d tokens sampled (T 0.8)\n",
           kvlm_vocab_size(m), threads, n);
    printf("  three grammars compiled in %.2f ms; the first mask (sorting the vocabulary) %.1f ms\n", compile * 1e3,
           first * 1e3);
    printf("  %-12s %7s %10s %12s %14s %8s\n", "grammar", "tokens", "tokens/s", "sampler ms", "sampler ms/tok", "ratio");
    double base = 0;
    for (int i = 0; i < 4; i++) {
        result r = generate(c, cases[i].g, prompt, np, n);
        double tps = r.n / r.total;
        if (!i) base = tps;
        printf("  %-12s %7d %10.1f %12.1f %14.3f %7.2fx%s\n", cases[i].name, r.n, tps, r.sample * 1e3,
               r.sample * 1e3 / r.n, tps / base, r.closed ? "  (ended: the grammar complete)" : "");
    }
    printf("  ratio: decode tokens/s against the same decode without a grammar\n");
    for (int i = 1; i < 4; i++) kvlm_grammar_free(cases[i].g);
    kvlm_ctx_free(c);
    kvlm_model_free(m);
    return 0;
}
