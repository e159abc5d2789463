/* tests/test_progress: the progress callbacks of long work (kvlm_model_params'
 * for a load, kvlm_synth_params', kvlm_model_save_gguf_progress): 0 first,
 * never decreasing, 1 last; false cancels cleanly at every point (NULL or
 * KVLM_ECANCELED, no file left, nothing leaked under ASan); --no-mmap and
 * --mlock load the same model; kvlm_version's form. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "helpers/testutil.h"
#include "kvlm.h"

/* What a callback saw; cancel_at > 0: false at that call (1-based). */
typedef struct {
    float seen[4096];
    int n, cancel_at;
} rec;

static bool record(float p, void *user) {
    rec *r = user;
    if (r->n < (int)(sizeof r->seen / sizeof r->seen[0])) r->seen[r->n] = p;
    r->n++;
    return !(r->cancel_at > 0 && r->n == r->cancel_at);
}

/* 0 first, 1 last, never decreasing, all within 0..1. */
static void check_monotonic(const rec *r, const char *what) {
    int n = r->n < 4096 ? r->n : 4096;
    if (n < 2) fail_msg("%s: %d calls", what, r->n);
    if (r->seen[0] != 0.0f) fail_msg("%s: first call %g, not 0", what, (double)r->seen[0]);
    if (r->seen[n - 1] != 1.0f) fail_msg("%s: last call %g, not 1", what, (double)r->seen[n - 1]);
    for (int i = 1; i < n; i++)
        if (!(r->seen[i] >= r->seen[i - 1]) || r->seen[i] > 1.0f)
            fail_msg("%s: call %d went from %g to %g", what, i, (double)r->seen[i - 1], (double)r->seen[i]);
}

/* Files in dir whose name starts with prefix (a writer's temporary left behind). */
static int count_prefixed(const char *path) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    const char *base = slash ? slash + 1 : path;
    if (slash) *slash = 0;
    else snprintf(dir, sizeof dir, ".");
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, base, strlen(base))) n++;
    closedir(d);
    return n;
}

static void load_calls(const char *path, const char *tok) {
    rec r = {.n = 0};
    kvlm_model_params mp = {0};
    mp.tokenizer_path = tok;
    mp.progress_callback = record;
    mp.progress_callback_user_data = &r;
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, &mp, &err);
    if (!m) fail_msg("%s: %s", path, err.msg);
    check_monotonic(&r, path);
    print_message("  %s: %d calls, 0 .. 1\n", path, r.n);
    kvlm_model_free(m);
    /* false at each call in turn: NULL with KVLM_ECANCELED, nothing kept */
    int calls = r.n;
    for (int k = 1; k <= calls; k++) {
        rec c = {.n = 0, .cancel_at = k};
        mp.progress_callback_user_data = &c;
        kvlm_error e2 = {0};
        kvlm_model *x = kvlm_model_load(path, &mp, &e2);
        if (x) fail_msg("%s: canceled at call %d of %d, still loaded", path, k, calls);
        assert_int_equal(e2.code, KVLM_ECANCELED);
        assert_int_equal(c.n, k); /* no call after the "no" */
        assert_non_null(strstr(e2.msg, "canceled"));
    }
}

static void test_load(void **state) {
    (void)state;
    const char *g = tu_model_path("stories260K.gguf");
    TU_REQUIRE(g);
    char gguf[1024];
    snprintf(gguf, sizeof gguf, "%s", g);
    load_calls(gguf, NULL);
    const char *b = tu_model_path("stories260K.bin"), *t = b ? tu_model_path("tok512.bin") : NULL;
    if (b && t) {
        char bin[1024], tok[1024];
        snprintf(bin, sizeof bin, "%s", tu_model_path("stories260K.bin"));
        snprintf(tok, sizeof tok, "%s", tu_model_path("tok512.bin"));
        load_calls(bin, tok);
    }
    assert_string_equal(kvlm_status_name(KVLM_ECANCELED), "canceled");
}

/* The logits after a prompt: read into memory (--no-mmap) and locked
 * (--mlock) give exactly what the mapped file gives. */
static float *logits_of(const char *path, bool no_mmap, bool mlock, int *vocab) {
    kvlm_model_params mp = {0};
    mp.no_mmap = no_mmap;
    mp.mlock = mlock;
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, &mp, &err);
    if (!m) fail_msg("%s (no_mmap %d, mlock %d): %s", path, no_mmap, mlock, err.msg);
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_threads = 1;
    cp.n_ctx = 64;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(ctx);
    int32_t toks[32];
    int n = kvlm_tokenize(m, "Once upon a time", 16, true, false, toks, 32, &err);
    assert_true(n > 1);
    kvlm_batch b = {n, toks, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK);
    *vocab = kvlm_vocab_size(m);
    float *out = malloc((size_t)*vocab * sizeof *out);
    memcpy(out, kvlm_get_logits(ctx, -1), (size_t)*vocab * sizeof *out);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
    return out;
}

static void test_no_mmap_mlock(void **state) {
    (void)state;
    const char *g = tu_model_path("stories260K.gguf");
    TU_REQUIRE(g);
    char path[1024];
    snprintf(path, sizeof path, "%s", g);
    int v0, v1, v2;
    float *a = logits_of(path, false, false, &v0), *b = logits_of(path, true, false, &v1),
          *c = logits_of(path, true, true, &v2);
    assert_int_equal(v0, v1);
    assert_int_equal(v0, v2);
    assert_memory_equal(a, b, (size_t)v0 * sizeof *a);
    assert_memory_equal(a, c, (size_t)v0 * sizeof *a);
    free(a);
    free(b);
    free(c);
}

static kvlm_synth_params small_synth(void) {
    kvlm_synth_params p = {0};
    p.arch = KVLM_ARCH_LLAMA;
    p.dim = 64, p.hidden_dim = 128, p.n_layers = 4, p.n_heads = 4, p.vocab_size = 300, p.n_ctx = 256;
    p.type = kvlm_type_from_name("q8_0");
    p.seed = 7;
    return p;
}

static void test_synth_and_convert(void **state) {
    (void)state;
    const char *out = tu_tmp_path(".gguf");
    char path[1024], conv[1024];
    snprintf(path, sizeof path, "%s", out);
    snprintf(conv, sizeof conv, "%s", tu_tmp_path(".gguf"));
    kvlm_synth_params p = small_synth();
    rec r = {.n = 0};
    p.progress_callback = record;
    p.progress_callback_user_data = &r;
    kvlm_error err = {0};
    assert_int_equal(kvlm_model_synth(&p, path, &err), KVLM_OK);
    check_monotonic(&r, "synth");
    int calls = r.n;
    print_message("  synth: %d calls, 0 .. 1\n", calls);
    /* canceled anywhere: no file, no temporary left beside it */
    for (int k = 1; k <= calls; k += tu_quick() ? 3 : 1) {
        char c_path[1100];
        snprintf(c_path, sizeof c_path, "%s.cancel%d", path, k);
        rec c = {.n = 0, .cancel_at = k};
        p.progress_callback_user_data = &c;
        kvlm_error e2 = {0};
        assert_int_equal(kvlm_model_synth(&p, c_path, &e2), KVLM_ECANCELED);
        assert_int_equal(c.n, k);
        if (access(c_path, F_OK) == 0) fail_msg("synth canceled at call %d left %s", k, c_path);
        assert_int_equal(count_prefixed(c_path), 0);
    }
    /* the file converts, with the same kind of calls */
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    assert_non_null(m);
    rec w = {.n = 0};
    assert_int_equal(kvlm_model_save_gguf_progress(m, conv, kvlm_type_from_name("q4_0"), record, &w, &err), KVLM_OK);
    check_monotonic(&w, "convert to q4_0");
    print_message("  convert: %d calls, 0 .. 1\n", w.n);
    /* keeping the types: the writing alone */
    rec w2 = {.n = 0};
    assert_int_equal(kvlm_model_save_gguf_progress(m, conv, -1, record, &w2, &err), KVLM_OK);
    check_monotonic(&w2, "convert keeping the types");
    for (int k = 1; k <= w.n; k++) {
        char c_path[1100];
        snprintf(c_path, sizeof c_path, "%s.cancel%d", conv, k);
        rec c = {.n = 0, .cancel_at = k};
        kvlm_error e2 = {0};
        assert_int_equal(kvlm_model_save_gguf_progress(m, c_path, kvlm_type_from_name("q4_0"), record, &c, &e2),
                         KVLM_ECANCELED);
        if (access(c_path, F_OK) == 0) fail_msg("convert canceled at call %d left %s", k, c_path);
        assert_int_equal(count_prefixed(c_path), 0);
    }
    kvlm_model_free(m);
    remove(path);
    remove(conv);
}

static void test_version(void **state) {
    (void)state;
    const char *v = kvlm_version();
    assert_non_null(v);
    int a, b, c, n = 0;
    /* "MAJOR.MINOR.PATCH (git REV)" or "(unknown revision)" */
    assert_int_equal(sscanf(v, "%d.%d.%d (%n", &a, &b, &c, &n), 3);
    assert_true(n > 0);
    assert_true(!strncmp(v + n, "git ", 4) || !strncmp(v + n, "unknown revision", 16));
    assert_int_equal(v[strlen(v) - 1], ')');
    print_message("  kvlm_version(): %s\n", v);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_load),
        cmocka_unit_test(test_no_mmap_mlock),
        cmocka_unit_test(test_synth_and_convert),
        cmocka_unit_test(test_version),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
