/* tests/helpers/testutil: shared helpers for the test binaries. */
#include "helpers/testutil.h"
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/mman.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *find_in(const char *env, const char *env_default, const char *name) {
    static char path[4096];
    const char *dir = getenv(env);
    if (!dir || !*dir) dir = getenv(env_default);
    if (!dir || !*dir) dir = "../shared/models";
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (access(path, R_OK) != 0) {
        fprintf(stderr, "SKIP: %s not found (set %s to the folder that holds it)\n", path, env);
        return NULL;
    }
    return path;
}

const char *tu_model_path(const char *name) { return find_in("KVLM_MODELS", "KVLM_MODELS_DEFAULT", name); }
const char *tu_corpus_path(const char *name) { return find_in("KVLM_CORPORA", "KVLM_CORPORA_DEFAULT", name); }

static char tmp_paths[64][256];
static int n_tmp;
static void tu_cleanup(void) {
    for (int i = 0; i < n_tmp; i++) unlink(tmp_paths[i]);
}

const char *tu_tmp_path(const char *suffix) {
    static int counter;
    if (n_tmp == 0) atexit(tu_cleanup);
    int slot = n_tmp < 64 ? n_tmp++ : 63;
    const char *tmpdir = getenv("TMPDIR");
    if (!tmpdir) tmpdir = "/tmp";
    snprintf(tmp_paths[slot], sizeof tmp_paths[slot], "%s/kvlm-test-%d-%d%s", tmpdir, (int)getpid(),
             counter++, suffix ? suffix : "");
    return tmp_paths[slot];
}

char *tu_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) { free(buf); buf = NULL; }
    fclose(f);
    if (buf) { buf[n] = 0; if (len) *len = (size_t)n; }
    return buf;
}

int tu_write_file(const char *path, const void *data, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, len, f);
    fclose(f);
    return w == len ? 0 : -1;
}

bool tu_quick(void) { return getenv("KVLM_TEST_QUICK") != NULL; }

double tu_max_rel_diff(const float *a, const float *b, int n, double floor) {
    double m = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        double s = fabs((double)b[i]);
        if (s < floor) s = floor;
        m = tu_worse(m, d / s);
    }
    return m;
}

void tu_fill_random(float *x, size_t n, uint64_t *state, float scale) {
    for (size_t i = 0; i < n; i++) {
        *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
        uint32_t r = (uint32_t)(*state >> 33);
        x[i] = scale * (2.0f * ((float)r / 2147483648.0f) - 1.0f);
    }
}

int tu_greedy_alone(kvlm_ctx *ctx, const int32_t *prompt, int n, int max_tokens, int32_t *out) {
    const kvlm_model *m = kvlm_ctx_model(ctx);
    kvlm_error err = {0};
    int piece = kvlm_ctx_kv_max_feed(ctx) > 0 ? kvlm_ctx_kv_max_feed(ctx) : n;
    for (int i = 0; i < n; i += piece) {
        kvlm_batch b = {n - i < piece ? n - i : piece, prompt + i, NULL, NULL, NULL};
        assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK);
    }
    int n_out = 0;
    while (n_out < max_tokens) {
        const float *l = kvlm_get_logits(ctx, -1);
        int32_t best = 0;
        for (int v = 1; v < kvlm_vocab_size(m); v++)
            if (l[v] > l[best]) best = v;
        if (kvlm_token_is_eog(m, best)) break;
        out[n_out++] = best;
        kvlm_batch one = {1, &best, NULL, NULL, NULL};
        assert_int_equal(kvlm_decode(ctx, &one, &err), KVLM_OK);
    }
    return n_out;
}

kvlm_request_params tu_greedy_params(int max_tokens) {
    kvlm_request_params p = {0};
    p.sampling = kvlm_sampler_default_params();
    p.sampling.temperature = 0;
    p.max_tokens = max_tokens;
    p.n = 1;
    p.logprobs = -1;
    return p;
}

bool tu_sched_collect(void *user, const kvlm_sched_event *ev) {
    tu_sched_result *r = user;
    if (ev->finish) {
        r->finish[ev->index] = ev->finish;
        r->n_final++;
        return true;
    }
    assert_true(r->n_out[ev->index] < TU_SCHED_MAXGEN);
    r->out[ev->index][r->n_out[ev->index]++] = ev->token;
    if (ev->n_top > 0) { /* greedy: the chosen token is the most likely one */
        bool ok = ev->top_tokens[0] == ev->token && fabsf(ev->top_logprobs[0] - ev->logprob) < 1e-6f &&
                  ev->logprob <= 0;
        for (int i = 1; i < ev->n_top; i++) ok &= ev->top_logprobs[i] <= ev->top_logprobs[i - 1];
        r->logprobs_ok &= ok;
    }
    return r->stop_after == 0 || r->n_out[ev->index] < r->stop_after;
}

void tu_sched_expect_alone(const tu_sched_result *r, int n, const int32_t *want, int n_want, int max_tokens) {
    assert_int_equal(r->n_final, n);
    for (int k = 0; k < n; k++) {
        assert_int_equal(r->finish[k], n_want < max_tokens ? KVLM_FINISH_STOP : KVLM_FINISH_LENGTH);
        assert_int_equal(r->n_out[k], n_want);
        assert_memory_equal(r->out[k], want, (size_t)n_want * sizeof(int32_t));
    }
}

typedef struct { void (*fn)(void *); void *arg; } tu_stack_job;
static void *tu_stack_main(void *p) {
    tu_stack_job *j = p;
    j->fn(j->arg);
    return NULL;
}

size_t tu_stack_peak(void (*fn)(void *), void *arg, size_t size) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size = (size + page - 1) / page * page;
    unsigned char *map = mmap(NULL, size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(map != MAP_FAILED);
    assert_int_equal(mprotect(map, page, PROT_NONE), 0); /* the guard: stacks grow down */
    unsigned char *base = map + page;
    memset(base, 0xa5, size);
    pthread_attr_t at;
    pthread_attr_init(&at);
    assert_int_equal(pthread_attr_setstack(&at, base, size), 0);
    tu_stack_job j = {fn, arg};
    pthread_t t;
    assert_int_equal(pthread_create(&t, &at, tu_stack_main, &j), 0);
    pthread_join(t, NULL);
    pthread_attr_destroy(&at);
    size_t untouched = 0;
    while (untouched < size && base[untouched] == 0xa5) untouched++;
    munmap(map, size + page);
    return size - untouched;
}
