/* tests/test_sampler: every sampling parameter against the NumPy reference
 * (scripts/ref/sampler_ref.py) over fixed logits: vLLM's repetition_penalty,
 * min_tokens, ignore_eos and stop ids; llama.cpp's repeat_penalty, typical_p,
 * DRY, XTC and stage orders; OpenAI's penalties and logit_bias; and the
 * stage names, the checks, and greedy bans. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "engine/sampler.h"

#ifndef KVLM_SOURCE_DIR
#define KVLM_SOURCE_DIR "."
#endif
#define PY "/usr/bin/python3"

typedef struct {
    const char *name;
    kvlm_sampler_params p;
    const char *stages[KVLM_MAX_STAGES]; /* names, NULL-terminated (none: kvlm's order) */
    const int32_t *prompt, *picked;
    int n_prompt, n_picked;
    float scale;  /* logits ~ scale * N(0, 1)-ish */
    int hot;      /* > 0: this token's logit raised to the top (an end token, a stop id) */
    const char *off; /* JSON object of params that turn the feature under test off: the reference
                        checks that the distribution then differs (the case tests something) */
} scase;

static kvlm_model *g_model;
static int g_vocab;
static float *g_logits;

static int setup(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    if (!path) return 0;
    kvlm_error err = {0};
    kvlm_model_params mp = {.vocab_only = true};
    g_model = kvlm_model_load(path, &mp, &err);
    if (!g_model) return -1;
    g_vocab = kvlm_vocab_size(g_model);
    g_logits = malloc((size_t)g_vocab * sizeof *g_logits);
    return g_logits ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    kvlm_model_free(g_model);
    free(g_logits);
    return 0;
}

static void fill_logits(const scase *c, uint64_t seed) {
    uint64_t st = seed;
    tu_fill_random(g_logits, (size_t)g_vocab, &st, c->scale);
    /* a sum of two uniforms: a peak, so the cutting stages cut somewhere inside */
    float extra[4096];
    tu_fill_random(extra, (size_t)g_vocab, &st, c->scale);
    for (int i = 0; i < g_vocab; i++) g_logits[i] += extra[i] * fabsf(extra[i]);
    if (c->hot > 0) g_logits[c->hot] = 4 * c->scale;
}

static void put_ids(FILE *f, const char *key, const int32_t *ids, int n) {
    fprintf(f, "\"%s\": [", key);
    for (int i = 0; i < n; i++) fprintf(f, "%s%d", i ? ", " : "", ids[i]);
    fprintf(f, "]");
}

/* Runs the case through kvlm's sampler and writes it, with the distribution, as one line. */
static void run_case(FILE *f, scase *c, int32_t *ids, float *probs) {
    kvlm_sampler_params p = c->p;
    p.model = g_model;
    p.n_stages = 0;
    for (int i = 0; c->stages[i]; i++) p.stages[p.n_stages++] = kvlm_sampler_stage_from_name(c->stages[i]);
    kvlm_error err = {0};
    assert_int_equal(kvlm_sampler_params_check(&p, g_vocab, NULL, &err), 0);
    kvlm_sampler *s = kvlm_sampler_create(&p, g_vocab);
    assert_non_null(s);
    for (int i = 0; i < c->n_prompt; i++) kvlm_sampler_accept(s, c->prompt[i]);
    for (int i = 0; i < c->n_picked; i++) sampler_picked(s, c->picked[i]);
    fill_logits(c, 0x5a3d1e + (uint64_t)strlen(c->name));
    int n = sampler_dist(s, g_logits, ids, probs);
    kvlm_sampler_free(s);
    fprintf(f, "{\"name\": \"%s\", \"logits\": [", c->name);
    for (int i = 0; i < g_vocab; i++) fprintf(f, "%s%.9g", i ? ", " : "", (double)g_logits[i]);
    fprintf(f, "], ");
    put_ids(f, "prompt", c->prompt, c->n_prompt);
    fprintf(f, ", ");
    put_ids(f, "picked", c->picked, c->n_picked);
    /* DRY's breakers and the end tokens, as the sampler takes them from the model */
    int32_t *br = malloc((size_t)g_vocab * sizeof *br), *eog = malloc((size_t)g_vocab * sizeof *eog);
    int nbr = 0, neog = 0;
    for (int t = 0; t < g_vocab; t++) {
        char text[256];
        int k = kvlm_token_to_text(g_model, t, text, sizeof text - 1);
        text[k > 0 ? k : 0] = 0;
        if (k > 0 && strpbrk(text, "\n:\"*")) br[nbr++] = t;
        if (kvlm_token_is_eog(g_model, t)) eog[neog++] = t;
    }
    fprintf(f, ", ");
    put_ids(f, "breakers", br, c->p.dry_sequence_breakers ? 0 : nbr);
    fprintf(f, ", ");
    put_ids(f, "eog", eog, neog);
    free(br);
    free(eog);
    fprintf(f, ", \"params\": {\"temperature\": %.9g, \"top_k\": %d, \"top_p\": %.9g, \"min_p\": %.9g, "
               "\"repeat_penalty\": %.9g, \"repeat_last_n\": %d, \"frequency_penalty\": %.9g, "
               "\"presence_penalty\": %.9g, \"repetition_penalty\": %.9g, \"typical_p\": %.9g, "
               "\"dry_multiplier\": %.9g, \"dry_base\": %.9g, \"dry_allowed_length\": %d, \"dry_penalty_last_n\": %d, "
               "\"xtc_probability\": %.9g, \"xtc_threshold\": %.9g, \"min_tokens\": %d, \"ignore_eos\": %s, ",
            (double)p.temperature, p.top_k, (double)p.top_p, (double)p.min_p, (double)p.repeat_penalty, p.repeat_last_n,
            (double)p.frequency_penalty, (double)p.presence_penalty, (double)p.repetition_penalty,
            (double)p.typical_p, (double)p.dry_multiplier, (double)p.dry_base, p.dry_allowed_length,
            p.dry_penalty_last_n, (double)p.xtc_probability, (double)p.xtc_threshold, p.min_tokens,
            p.ignore_eos ? "true" : "false");
    put_ids(f, "stop_ids", p.stop_ids, p.n_stop_ids);
    fprintf(f, ", ");
    put_ids(f, "bias_ids", p.bias_ids, p.n_bias);
    fprintf(f, ", \"bias\": [");
    for (int i = 0; i < p.n_bias; i++) /* Python's json reads -Infinity */
        fprintf(f, isinf(p.bias[i]) ? "%s-Infinity" : "%s%.9g", i ? ", " : "", (double)p.bias[i]);
    fprintf(f, "], \"stages\": [");
    for (int i = 0; c->stages[i]; i++) fprintf(f, "%s\"%s\"", i ? ", " : "", kvlm_sampler_stage_name(p.stages[i]));
    fprintf(f, "]}, \"off\": %s, \"kvlm\": {", c->off ? c->off : "null");
    put_ids(f, "ids", ids, n);
    fprintf(f, ", \"probs\": [");
    for (int i = 0; i < n; i++) fprintf(f, "%s%.9g", i ? ", " : "", (double)probs[i]);
    fprintf(f, "]}}\n");
}

/* A text that repeats itself (DRY, the penalties): runs of 5, 7, 3 ... tokens again */
static const int32_t k_prompt[] = {1, 300, 301, 302, 303, 304, 400, 13, 300, 301, 302, 303, 410, 411, 300, 301, 302};
static const int32_t k_picked[] = {303, 304, 400, 13, 300, 301};
static const int32_t k_stops[] = {77, 78};
static const int32_t k_bias_ids[] = {5, 300, 311};
static const float k_bias[] = {8.0f, -3.0f, -INFINITY};

static void test_against_numpy(void **state) {
    (void)state;
    if (!g_model) skip();
    FILE *probe = popen(PY " -c 'import numpy' 2>/dev/null", "r");
    if (!probe || pclose(probe) != 0) {
        printf("SKIP: %s with numpy is needed for the reference (Debian's python3-numpy)\n", PY);
        skip();
    }
    kvlm_sampler_params d = kvlm_sampler_default_params(), free_ = d;
    free_.top_k = 0;
    free_.top_p = 1;
    free_.min_p = 0;
    free_.temperature = 1;
    int np = (int)(sizeof k_prompt / sizeof k_prompt[0]), nk = (int)(sizeof k_picked / sizeof k_picked[0]);
    scase cases[32];
    int n = 0;
#define CASE(nm, sc) (cases[n] = (scase){.name = nm, .p = free_, .prompt = k_prompt, .n_prompt = np, \
                                        .picked = k_picked, .n_picked = nk, .scale = sc}, &cases[n++])
    scase *c = CASE("defaults (top_k 40, T 0.8, top_p 0.95, min_p 0.05)", 3);
    c->p = d;
    c = CASE("repeat_penalty 1.5 over the last 8 (llama.cpp)", 3);
    c->off = "{\"repeat_penalty\": 1}";
    c->p.repeat_penalty = 1.5f;
    c->p.repeat_last_n = 8;
    c = CASE("repetition_penalty 1.5 over prompt and output (vLLM)", 3);
    c->off = "{\"repetition_penalty\": 1}";
    c->p.repetition_penalty = 1.5f;
    c = CASE("repetition_penalty 0.7 (encouraging repeats)", 3);
    c->off = "{\"repetition_penalty\": 1}";
    c->p.repetition_penalty = 0.7f;
    c = CASE("frequency 0.6 and presence 0.4 over the output (OpenAI)", 3);
    c->off = "{\"frequency_penalty\": 0, \"presence_penalty\": 0}";
    c->p.frequency_penalty = 0.6f;
    c->p.presence_penalty = 0.4f;
    c = CASE("every penalty at once, top_k 50", 3);
    c->p.repeat_penalty = 1.2f;
    c->p.repetition_penalty = 1.3f;
    c->p.frequency_penalty = -0.5f;
    c->p.presence_penalty = 0.5f;
    c->p.top_k = 50;
    c = CASE("logit_bias (+8, -3, a ban)", 3);
    c->off = "{\"bias_ids\": []}";
    c->p.bias_ids = k_bias_ids;
    c->p.bias = k_bias;
    c->p.n_bias = 3;
    c = CASE("typical_p 0.6", 2);
    c->off = "{\"typical_p\": 1}";
    c->p.typical_p = 0.6f;
    c = CASE("typical_p 0.9, T 0.7, top_k 100", 2);
    c->off = "{\"typical_p\": 1}";
    c->p.typical_p = 0.9f;
    c->p.temperature = 0.7f;
    c->p.top_k = 100;
    c = CASE("dry 0.8 x 1.75^(n-2), whole history", 3);
    c->off = "{\"dry_multiplier\": 0}";
    c->p.dry_multiplier = 0.8f;
    c = CASE("dry 2 x 1.3^(n-1), last 12 tokens", 3);
    c->off = "{\"dry_multiplier\": 0}";
    c->p.dry_multiplier = 2.0f;
    c->p.dry_base = 1.3f;
    c->p.dry_allowed_length = 1;
    c->p.dry_penalty_last_n = 12;
    static const char *const no_breakers[] = {"@@"};
    c = CASE("dry without breakers (a breaker string no token holds)", 3);
    c->off = "{\"dry_multiplier\": 0}";
    c->p.dry_multiplier = 1.0f;
    c->p.dry_sequence_breakers = no_breakers;
    c->p.n_dry_sequence_breakers = 1;
    c = CASE("xtc at probability 1, threshold 0.05, after top_k 20", 1.5f);
    c->off = "{\"xtc_probability\": 0}";
    c->p.xtc_probability = 1;
    c->p.xtc_threshold = 0.05f;
    c->p.top_k = 20;
    c = CASE("xtc at probability 1, threshold 0.1 (one above: nothing removed)", 4);
    c->p.xtc_probability = 1;
    c = CASE("top_p 0.8 then min_p 0.1, T 1.3", 2);
    c->off = "{\"min_p\": 0}";
    c->p.top_p = 0.8f;
    c->p.min_p = 0.1f;
    c->p.temperature = 1.3f;
    c = CASE("llama.cpp's default order (temperature last), T 1.5", 2);
    c->off = "{\"stages\": []}";
    c->p = d;
    c->p.temperature = 1.5f;
    c->p.repeat_penalty = 1.1f;
    c->p.typical_p = 0.95f;
    c->p.dry_multiplier = 0.5f;
    {
        static const char *const order[] = {"penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"};
        for (int i = 0; i < 8; i++) c->stages[i] = order[i];
    }
    c = CASE("kvlm's order named (the general chain), T 1.5", 2);
    c->p = d;
    c->p.temperature = 1.5f;
    {
        static const char *const order[] = {"top_k", "temp", "top-p", "min_p"};
        for (int i = 0; i < 4; i++) c->stages[i] = order[i];
    }
    c = CASE("temperature first, then top_p and top_k, no penalties listed", 2);
    c->off = "{\"stages\": []}";
    c->p.temperature = 0.6f;
    c->p.top_p = 0.9f;
    c->p.top_k = 30;
    c->p.repetition_penalty = 2.0f; /* not listed: not applied */
    {
        static const char *const order[] = {"temperature", "top_p", "top_k"};
        for (int i = 0; i < 3; i++) c->stages[i] = order[i];
    }
    c = CASE("min_tokens 10 after 6: the end token and stop ids banned", 3);
    c->off = "{\"min_tokens\": 0}";
    c->p.min_tokens = 10;
    c->p.stop_ids = k_stops;
    c->p.n_stop_ids = 2;
    c->hot = 2;
    c = CASE("min_tokens 4 after 6: nothing banned", 3);
    c->p.min_tokens = 4;
    c->p.stop_ids = k_stops;
    c->p.n_stop_ids = 2;
    c->hot = 2;
    c = CASE("ignore_eos", 3);
    c->off = "{\"ignore_eos\": false}";
    c->p.ignore_eos = true;
    c->hot = 2;
    c = CASE("greedy with repetition_penalty 3 and dry", 3);
    c->off = "{\"repetition_penalty\": 1, \"dry_multiplier\": 0}";
    c->p.temperature = 0;
    c->p.repetition_penalty = 3.0f;
    c->p.dry_multiplier = 1.0f;
    c->hot = 303; /* in the prompt and the output: penalised below others */
    c = CASE("greedy, ignore_eos with the end token on top", 3);
    c->off = "{\"ignore_eos\": false}";
    c->p.temperature = 0;
    c->p.ignore_eos = true;
    c->hot = 2;
#undef CASE
    const char *path = tu_tmp_path(".jsonl");
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    int32_t *ids = malloc((size_t)g_vocab * sizeof *ids);
    float *probs = malloc((size_t)g_vocab * sizeof *probs);
    for (int i = 0; i < n; i++) run_case(f, &cases[i], ids, probs);
    free(ids);
    free(probs);
    fclose(f);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s '%s/scripts/ref/sampler_ref.py' '%s'", PY, KVLM_SOURCE_DIR, path);
    int rc = system(cmd);
    assert_int_equal(rc, 0);
}

/* The two repetition penalties differ: llama.cpp's sees only the last n tokens,
 * vLLM's the whole prompt; and both differ from none. */
static void test_penalties_differ(void **state) {
    (void)state;
    int32_t hist[40];
    for (int i = 0; i < 40; i++) hist[i] = 100 + i; /* token 100 only far back */
    kvlm_sampler_params a = kvlm_sampler_default_params(), b;
    a.temperature = 0;
    a.repeat_penalty = 50;
    a.repeat_last_n = 8;
    b = a;
    b.repeat_penalty = 1;
    b.repetition_penalty = 50;
    float logits[512] = {0};
    logits[100] = 5;
    logits[200] = 4;
    kvlm_sampler *sa = kvlm_sampler_create(&a, 512), *sb = kvlm_sampler_create(&b, 512);
    for (int i = 0; i < 40; i++) kvlm_sampler_accept(sa, hist[i]), kvlm_sampler_accept(sb, hist[i]);
    assert_int_equal(kvlm_sampler_sample(sa, logits), 100); /* 100 is not among the last 8 */
    assert_int_equal(kvlm_sampler_sample(sb, logits), 200); /* vLLM's sees the whole prompt */
    kvlm_sampler_free(sa);
    kvlm_sampler_free(sb);
}

static void test_stage_names_and_checks(void **state) {
    (void)state;
    assert_int_equal(kvlm_sampler_stage_from_name("typ_p"), KVLM_STAGE_TYPICAL_P);
    assert_int_equal(kvlm_sampler_stage_from_name("typical"), KVLM_STAGE_TYPICAL_P);
    assert_int_equal(kvlm_sampler_stage_from_name("temp"), KVLM_STAGE_TEMPERATURE);
    assert_int_equal(kvlm_sampler_stage_from_name("nucleus"), KVLM_STAGE_TOP_P);
    assert_int_equal(kvlm_sampler_stage_from_name("bogus"), 0);
    const char *chars = "edkypmxt";
    int want[] = {KVLM_STAGE_PENALTIES, KVLM_STAGE_DRY, KVLM_STAGE_TOP_K, KVLM_STAGE_TYPICAL_P, KVLM_STAGE_TOP_P,
                  KVLM_STAGE_MIN_P, KVLM_STAGE_XTC, KVLM_STAGE_TEMPERATURE};
    for (int i = 0; i < 8; i++) {
        assert_int_equal(kvlm_sampler_stage_from_char(chars[i]), want[i]);
        static const char *const names[] = {"penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"};
        assert_string_equal(kvlm_sampler_stage_name(want[i]), names[i]);
    }
    assert_int_equal(kvlm_sampler_stage_from_char('z'), 0);
    kvlm_sampler_params p = kvlm_sampler_default_params();
    kvlm_error err = {0};
    assert_int_equal(kvlm_sampler_params_check(&p, 512, NULL, &err), 0);
#define BAD(field, stmt)                                                        \
    do {                                                                        \
        kvlm_sampler_params q = p;                                              \
        stmt;                                                                   \
        int idx = 0;                                                            \
        assert_int_equal(kvlm_sampler_params_check(&q, 512, &idx, &err), field); \
    } while (0)
    BAD(KVLM_SAMPLER_REPETITION_PENALTY, q.repetition_penalty = -1);
    BAD(KVLM_SAMPLER_TYPICAL_P, q.typical_p = 1.5f);
    BAD(KVLM_SAMPLER_DRY_MULTIPLIER, q.dry_multiplier = -0.1f);
    BAD(KVLM_SAMPLER_DRY_BASE, q.dry_base = NAN);
    BAD(KVLM_SAMPLER_DRY_ALLOWED_LENGTH, q.dry_allowed_length = -1);
    BAD(KVLM_SAMPLER_DRY_PENALTY_LAST_N, q.dry_penalty_last_n = -2);
    BAD(KVLM_SAMPLER_XTC_PROBABILITY, q.xtc_probability = 2);
    BAD(KVLM_SAMPLER_XTC_THRESHOLD, q.xtc_threshold = -1);
    BAD(KVLM_SAMPLER_MIN_TOKENS, q.min_tokens = -1);
    BAD(KVLM_SAMPLER_STAGES, (q.stages[0] = 99, q.n_stages = 1));
    BAD(KVLM_SAMPLER_STAGES, q.n_stages = KVLM_MAX_STAGES + 1);
    static const int32_t stops[] = {3, 600};
    BAD(KVLM_SAMPLER_STOP_ID, (q.stop_ids = stops, q.n_stop_ids = 2));
    assert_string_equal(err.msg, "must be a token id below 512");
#undef BAD
}

/* Greedy picks never an end token under ignore_eos, nor a stop id before
 * min_tokens; kvlm_sampler_is_stop knows the stop ids. */
static void test_bans(void **state) {
    (void)state;
    if (!g_model) skip();
    int32_t eos = kvlm_token_eos(g_model);
    assert_true(eos >= 0);
    static const int32_t stops[] = {7};
    kvlm_sampler_params p = kvlm_sampler_default_params();
    p.temperature = 0;
    p.model = g_model;
    p.min_tokens = 3;
    p.stop_ids = stops;
    p.n_stop_ids = 1;
    kvlm_sampler *s = kvlm_sampler_create(&p, g_vocab);
    assert_non_null(s);
    assert_true(kvlm_sampler_is_stop(s, 7));
    assert_false(kvlm_sampler_is_stop(s, 8));
    float *l = calloc((size_t)g_vocab, sizeof *l);
    l[eos] = 10;
    l[7] = 9;
    l[8] = 8;
    assert_int_equal(kvlm_sampler_sample(s, l), 8);
    assert_int_equal(kvlm_sampler_sample(s, l), 8);
    assert_int_equal(kvlm_sampler_sample(s, l), 8);
    assert_int_equal(kvlm_sampler_sample(s, l), eos); /* 3 picked: free again */
    kvlm_sampler_free(s);
    p.min_tokens = 0;
    p.ignore_eos = true;
    s = kvlm_sampler_create(&p, g_vocab);
    for (int i = 0; i < 5; i++) assert_int_equal(kvlm_sampler_sample(s, l), 7);
    kvlm_sampler_free(s);
    free(l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_numpy),
        cmocka_unit_test(test_penalties_differ),
        cmocka_unit_test(test_stage_names_and_checks),
        cmocka_unit_test(test_bans),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
