/* tests/test_swa: sliding-window attention and gemma2/gemma3 on random-weight
 * models: logits against the NumPy reference (scripts/ref/swa_ref.py) for
 * prefill and token-by-token decode over several windows, cache == recompute,
 * paged == contiguous, the local layers' old blocks going back to the pool,
 * prefix reuse, fork / copy-on-write, swap and the scheduler over SWA
 * sequences; kvlm plan's local cap against the pool the context reserves. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "engine/engine.h"
#include "helpers/testutil.h"
#include "kv/blockfmt.h"
#include "kv/paged.h"
#include "kv/store.h"
#include "kvlm.h"

#define WINDOW 8
#define BS 4
#define N_LONG 96 /* twelve windows */

typedef struct {
    const char *name;
    kvlm_arch arch;
    int layers;
    float attn_cap, final_cap;
} shape;

static const shape SHAPES[] = {
    {"gemma2", KVLM_ARCH_GEMMA2, 4, 2.0f, 3.0f}, /* small caps so that they bite */
    {"gemma3", KVLM_ARCH_GEMMA3, 6, 0, 0},       /* five local, one global */
    {"mistral", KVLM_ARCH_LLAMA, 2, 0, 0},        /* llama with every layer local */
    {"gpt-oss", KVLM_ARCH_GPTOSS, 4, 0, 0},       /* even layers local; sinks, biases, experts */
};
#define N_SHAPES (int)(sizeof SHAPES / sizeof SHAPES[0])

static char paths[N_SHAPES][4096];

static int setup(void **state) {
    (void)state;
    for (int i = 0; i < N_SHAPES; i++) {
        kvlm_synth_params p = {0};
        p.arch = SHAPES[i].arch;
        p.dim = 64;
        p.hidden_dim = 128;
        p.n_layers = SHAPES[i].layers;
        p.n_heads = 4;
        p.n_kv_heads = 2;
        p.vocab_size = 300;
        p.n_ctx = 256;
        p.type = kvlm_type_from_name("f32");
        p.tied_output = SHAPES[i].arch != KVLM_ARCH_LLAMA;
        p.seed = 7 + (uint64_t)i;
        p.sliding_window = WINDOW;
        p.attn_softcap = SHAPES[i].attn_cap;
        p.final_softcap = SHAPES[i].final_cap;
        if (p.arch == KVLM_ARCH_GEMMA3) p.rope_base = 1e6f;
        snprintf(paths[i], sizeof paths[i], "%s", tu_tmp_path(".gguf"));
        kvlm_error err = {0};
        if (kvlm_model_synth(&p, paths[i], &err)) { fprintf(stderr, "synth %s: %s\n", SHAPES[i].name, err.msg); return 1; }
    }
    return 0;
}

static kvlm_model *load(int i) {
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(paths[i], NULL, &err);
    if (!m) fail_msg("load %s: %s", SHAPES[i].name, err.msg);
    return m;
}

static kvlm_ctx *make_ctx(kvlm_model *m, int block_size, int n_seq, int kv_blocks, bool f32) {
    kvlm_error err = {0};
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 256;
    cp.block_size = block_size;
    cp.n_seq_max = n_seq;
    cp.n_batch = 8;
    cp.n_threads = 2;
    cp.kv_blocks = kv_blocks;
    if (f32) cp.cache_type_k = cp.cache_type_v = KVLM_CACHE_F32;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) fail_msg("context: %s", err.msg);
    return ctx;
}

static void tokens(int32_t *t, int n, int seed) {
    for (int i = 0; i < n; i++) t[i] = 3 + (int32_t)(((unsigned)(i + 1) * 2654435761u + (unsigned)seed * 40503u) % 290u);
}

/* Logits of every position: one prefill batch (decode false) or token by token. */
static float *run(kvlm_ctx *ctx, int seq, const int32_t *t, int n, bool one_by_one) {
    int V = kvlm_model_config(kvlm_ctx_model(ctx))->vocab_size;
    float *out = malloc((size_t)n * V * sizeof(float));
    kvlm_error err = {0};
    if (!one_by_one) {
        int8_t *want = malloc((size_t)n);
        int32_t *seqs = malloc((size_t)n * sizeof(int32_t));
        for (int i = 0; i < n; i++) { want[i] = 1; seqs[i] = seq; }
        kvlm_batch b = {n, t, NULL, want, seqs};
        if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
        for (int i = 0; i < n; i++) memcpy(out + (size_t)i * V, kvlm_get_logits(ctx, i), V * sizeof(float));
        free(want);
        free(seqs);
    } else
        for (int i = 0; i < n; i++) {
            kvlm_batch b = {1, t + i, NULL, NULL, &seq};
            if (kvlm_decode(ctx, &b, &err)) fail_msg("decode token %d: %s", i, err.msg);
            memcpy(out + (size_t)i * V, kvlm_get_logits(ctx, -1), V * sizeof(float));
        }
    return out;
}

static void check_pools(kvlm_ctx *ctx) {
    kv_store *s = engine_kv_store(ctx);
    const char *bad = kv_check(kv_store_pool(s));
    if (bad) fail_msg("kv_check: %s", bad);
    if (kv_store_local(s) && (bad = kv_check(kv_store_pool(kv_store_local(s))))) fail_msg("kv_check (local): %s", bad);
}

/* The reference's error of a row: max |a - b| / max(max |b|, 1e-2), worst row. */
static double row_err(const float *a, const float *b, int n_rows, int V) {
    double worst = 0;
    for (int r = 0; r < n_rows; r++) {
        double d = 0, mx = 1e-2;
        for (int v = 0; v < V; v++) {
            double x = fabs((double)a[(size_t)r * V + v] - b[(size_t)r * V + v]);
            d = x > d || x != x ? x : d;
            mx = fabs(b[(size_t)r * V + v]) > mx ? fabs(b[(size_t)r * V + v]) : mx;
        }
        worst = tu_worse(worst, d / mx);
    }
    return worst;
}

static bool have_numpy(void) {
    return system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") == 0;
}

static void write_logits(const char *path, const float *l, int n, int V) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < n; i++)
        for (int v = 0; v < V; v++) fprintf(f, "%.9g%c", l[(size_t)i * V + v], v == V - 1 ? '\n' : ' ');
    fclose(f);
}

/* Prefill and token-by-token decode of twelve windows against the NumPy
 * reference; the reference without the window disagrees (the window matters). */
static void test_reference(void **state) {
    (void)state;
    if (!have_numpy()) {
        printf("SKIP: /usr/bin/python3 with numpy not found (the reference needs it)\n");
        skip();
    }
    char ref[4096];
    snprintf(ref, sizeof ref, "%s", __FILE__);
    char *slash = strrchr(ref, '/');
    size_t dir = slash ? (size_t)(slash + 1 - ref) : 0;
    int32_t t[N_LONG];
    tokens(t, N_LONG, 1);
    char ids[N_LONG * 8] = "";
    for (int i = 0; i < N_LONG; i++) snprintf(ids + strlen(ids), sizeof ids - strlen(ids), "%d ", t[i]);
    for (int i = 0; i < N_SHAPES; i++) {
        /* gpt-oss: llama_ref.py's (it has gpt-oss's experts) */
        snprintf(ref + dir, sizeof ref - dir, "../scripts/ref/%s",
                 SHAPES[i].arch == KVLM_ARCH_GPTOSS ? "llama_ref.py" : "swa_ref.py");
        kvlm_model *m = load(i);
        int V = kvlm_model_config(m)->vocab_size;
        kvlm_ctx *a = make_ctx(m, BS, 1, 0, true), *b = make_ctx(m, BS, 1, 0, true);
        float *pre = run(a, 0, t, N_LONG, false), *dec = run(b, 0, t, N_LONG, true);
        char fp[4096], fd[4096], cmd[32768];
        snprintf(fp, sizeof fp, "%s", tu_tmp_path(".pre"));
        snprintf(fd, sizeof fd, "%s", tu_tmp_path(".dec"));
        write_logits(fp, pre, N_LONG, V);
        write_logits(fd, dec, N_LONG, V);
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s %s --ids '%s' --compare %s %s --tol 1e-4", ref, paths[i], ids, fp, fd);
        printf("  %s:\n", SHAPES[i].name);
        fflush(stdout);
        if (system(cmd) != 0) fail_msg("%s: kvlm's logits differ from the reference", SHAPES[i].name);
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s %s --ids '%s' --no-window --compare %s --tol 1e-4 >/dev/null", ref,
                 paths[i], ids, fp);
        if (system(cmd) == 0) fail_msg("%s: the reference without the window agrees too: the test shows nothing", SHAPES[i].name);
        free(pre);
        free(dec);
        kvlm_ctx_free(a);
        kvlm_ctx_free(b);
        kvlm_model_free(m);
    }
}

/* Token-by-token decode with the cache == one prefill == recompute without a
 * cache; paged (blocks of 4, old ones freed) == contiguous (one block of the
 * whole context, nothing freed); the fast kernels == the reference attention. */
static void test_cache_equals_recompute(void **state) {
    (void)state;
    int32_t t[N_LONG];
    tokens(t, N_LONG, 2);
    for (int i = 0; i < N_SHAPES; i++) {
        kvlm_model *m = load(i);
        int V = kvlm_model_config(m)->vocab_size;
        kvlm_ctx *paged = make_ctx(m, BS, 1, 0, true), *contig = make_ctx(m, 256, 1, 0, true);
        kvlm_ctx *naive = make_ctx(m, BS, 1, 0, true);
        engine_set_naive_attention(naive, true);
        kvlm_error err = {0};
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.n_ctx = 256;
        cp.no_kv_cache = true;
        cp.cache_type_k = cp.cache_type_v = KVLM_CACHE_F32;
        kvlm_ctx *nokv = kvlm_ctx_create(m, &cp, &err);
        assert_non_null(nokv);
        float *a = run(paged, 0, t, N_LONG, true), *b = run(contig, 0, t, N_LONG, false);
        float *c = run(naive, 0, t, N_LONG, true), *d = run(nokv, 0, t, N_LONG, true);
        double e1 = row_err(a, b, N_LONG, V), e2 = row_err(a, c, N_LONG, V),
               e3 = row_err(a, d, N_LONG, V);
        printf("  %s: decode vs contiguous prefill %.2g, vs reference attention %.2g, vs recompute %.2g\n",
               SHAPES[i].name, e1, e2, e3);
        assert_true(e1 < 1e-4 && e2 < 1e-4 && e3 < 1e-4);
        check_pools(paged);
        /* an f16 cache (typed tiles over blocks with null entries) == its reference attention */
        kvlm_ctx *h = make_ctx(m, BS, 1, 0, false), *hn = make_ctx(m, BS, 1, 0, false);
        engine_set_naive_attention(hn, true);
        float *f = run(h, 0, t, N_LONG, true), *fn = run(hn, 0, t, N_LONG, true);
        double e4 = row_err(f, fn, N_LONG, V);
        printf("    f16 cache: decode vs reference attention %.2g\n", e4);
        /* each context rounds its own keys to f16: a float-level difference
         * that lands on an f16 rounding edge moves a key by 2^-11 of itself */
        assert_true(e4 < 1e-3);
        free(f); free(fn);
        kvlm_ctx_free(h); kvlm_ctx_free(hn);
        free(a); free(b); free(c); free(d);
        kvlm_ctx_free(paged); kvlm_ctx_free(contig); kvlm_ctx_free(naive); kvlm_ctx_free(nokv);
        kvlm_model_free(m);
    }
}

/* A sequence twelve windows long: the local layers hold a bounded number of
 * blocks (the rest went back to their pool), the global layers all of theirs. */
static void test_blocks_freed(void **state) {
    (void)state;
    int32_t t[N_LONG];
    tokens(t, N_LONG, 3);
    for (int i = 0; i < N_SHAPES; i++) {
        kvlm_model *m = load(i);
        kvlm_ctx *ctx = make_ctx(m, BS, 1, 0, false);
        kv_store *s = engine_kv_store(ctx);
        kv_store *loc = kv_store_local(s) ? kv_store_local(s) : s;
        kv_stats before, after;
        kv_get_stats(kv_store_pool(loc), &before);
        float *l = run(ctx, 0, t, N_LONG, true);
        free(l);
        kv_get_stats(kv_store_pool(loc), &after);
        int n_blocks = 0;
        kv_seq_blocks(kv_store_pool(loc), 0, &n_blocks);
        int dropped = kv_seq_dropped(kv_store_pool(loc), 0);
        /* the window (8), one step (8) and the partial blocks around them */
        int bound = (WINDOW + 8 + 2 * BS - 3) / BS + 1;
        printf("  %s: %d tokens in %d blocks of %d: %d released, %d held by the local layers (bound %d), pool %d blocks\n",
               SHAPES[i].name, N_LONG, n_blocks, BS, dropped, n_blocks - dropped, bound, after.n_blocks);
        assert_int_equal(n_blocks, N_LONG / BS);
        assert_true(n_blocks - dropped <= (WINDOW + BS - 1) / BS + 1);
        assert_int_equal(after.used, n_blocks - dropped);
        assert_true(after.used <= bound);
        if (loc != s) { /* the global layers keep everything */
            int ng = 0;
            kv_seq_blocks(kv_store_pool(s), 0, &ng);
            assert_int_equal(ng, N_LONG / BS);
            assert_int_equal(kv_seq_dropped(kv_store_pool(s), 0), 0);
        }
        /* the public figures: bytes held below what the tokens would take whole */
        kvlm_kv_stats st;
        kvlm_kv_stats_get(ctx, &st);
        size_t held = kvlm_ctx_kv_bytes(ctx), whole = (size_t)N_LONG * st.bytes_per_token;
        printf("    KV bytes held %zu of %zu without the window (%.2f)\n", held, whole, (double)held / whole);
        assert_true(held < whole);
        check_pools(ctx);
        kvlm_seq_free(ctx, 0);
        kv_get_stats(kv_store_pool(loc), &after);
        assert_int_equal(after.used, 0);
        check_pools(ctx);
        kvlm_ctx_free(ctx);
        kvlm_model_free(m);
    }
}

/* Taking a sequence back (kvlm_seq_trim) past the blocks its window gave
 * back is refused with a message and changes nothing; back to within the
 * window, or to nothing, it goes on as a context that was fed only the kept
 * tokens. (A trim past dropped blocks used to unreference their sentinel:
 * a heap overflow, found by `kvlm chat` on a gemma2.) */
static void test_trim_past_window(void **state) {
    (void)state;
    int32_t t[N_LONG];
    tokens(t, N_LONG, 5);
    int V = 300;
    for (int i = 0; i < N_SHAPES; i++) {
        kvlm_model *m = load(i);
        kvlm_ctx *ctx = make_ctx(m, BS, 1, 0, true), *ref = make_ctx(m, BS, 1, 0, true);
        free(run(ctx, 0, t, N_LONG, false));
        kvlm_error err = {0};
        assert_int_equal(kvlm_seq_trim(ctx, 0, 20, &err), KVLM_EINVAL);
        assert_non_null(strstr(err.msg, "sliding window"));
        assert_int_equal(kvlm_seq_n_past(ctx, 0), N_LONG);
        check_pools(ctx);
        /* two back: the query at 94 would see key 87, in a block already given
         * back; one back is within what the window kept */
        assert_int_equal(kvlm_seq_trim(ctx, 0, N_LONG - 2, &err), KVLM_EINVAL);
        int keep = N_LONG - 1;
        assert_int_equal(kvlm_seq_trim(ctx, 0, keep, &err), KVLM_OK);
        float *a = run(ctx, 0, t + keep, 1, true), *b = run(ref, 0, t, N_LONG, false);
        double e = row_err(a, b + (size_t)keep * V, 1, V);
        assert_true(e < 1e-5);
        /* to nothing: starts over, the same as a fresh context */
        assert_int_equal(kvlm_seq_trim(ctx, 0, 0, &err), KVLM_OK);
        check_pools(ctx);
        float *c = run(ctx, 0, t, 20, false);
        assert_true(row_err(c, b, 20, V) < 1e-5);
        printf("  %s: refused past the window (%s); kept %d: error %.1e; from nothing: the same logits\n",
               SHAPES[i].name, err.msg[0] ? "message" : "?", keep, e);
        free(a);
        free(b);
        free(c);
        check_pools(ctx);
        kvlm_ctx_free(ctx);
        kvlm_ctx_free(ref);
        kvlm_model_free(m);
    }
}

/* Prefix reuse across requests: a second request sharing a long prefix gets
 * a hit (the local layers' early blocks need not be there: vLLM's rule) and
 * the same logits as a context without a prefix cache. */
static void test_prefix_reuse(void **state) {
    (void)state;
    enum { N = 64, TAIL = 6 };
    int32_t a[N + TAIL], b[N + TAIL];
    tokens(a, N + TAIL, 4);
    memcpy(b, a, N * sizeof(int32_t));
    tokens(b + N, TAIL, 5);
    for (int i = 0; i < N_SHAPES; i++) {
        kvlm_model *m = load(i);
        int V = kvlm_model_config(m)->vocab_size;
        kvlm_ctx *ctx = make_ctx(m, BS, 2, 0, true);
        float *la = run(ctx, 0, a, N + TAIL, false);
        free(la);
        kvlm_seq_free(ctx, 0); /* its full blocks stay cached */
        int hit = kvlm_seq_reuse_prefix(ctx, 1, b, N + TAIL);
        check_pools(ctx);
        int past = kvlm_seq_n_past(ctx, 1);
        float *lb = run(ctx, 1, b + past, N + TAIL - past, false);
        kvlm_error err = {0};
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.n_ctx = 256;
        cp.block_size = BS;
        cp.no_prefix_cache = true;
        cp.cache_type_k = cp.cache_type_v = KVLM_CACHE_F32;
        kvlm_ctx *fresh = kvlm_ctx_create(m, &cp, &err);
        assert_non_null(fresh);
        float *lf = run(fresh, 0, b, N + TAIL, false);
        int n_cmp = N + TAIL - past;
        double e = row_err(lb, lf + (size_t)past * V, n_cmp, V);
        printf("  %s: prefix hit %d of %d tokens; logits after it vs no reuse: %.2g\n", SHAPES[i].name, hit, N, e);
        assert_true(hit >= N - BS && hit <= N);
        assert_true(e < 1e-4);
        free(lb);
        free(lf);
        kvlm_ctx_free(fresh);
        kvlm_ctx_free(ctx);
        kvlm_model_free(m);
    }
}

/* Early local blocks evicted from a small local pool: the hit still covers
 * the prefix (its window is what counts) and the logits stay right. */
static void test_prefix_reuse_evicted(void **state) {
    (void)state;
    enum { N = 160, TAIL = 5 };
    int32_t a[N + TAIL], b[N + TAIL];
    tokens(a, N + TAIL, 6);
    memcpy(b, a, N * sizeof(int32_t));
    tokens(b + N, TAIL, 7);
    for (int i = 0; i < N_SHAPES; i++) {
        kvlm_model *m = load(i);
        int V = kvlm_model_config(m)->vocab_size;
        kvlm_ctx *ctx = make_ctx(m, BS, 2, 0, true);
        kv_store *s = engine_kv_store(ctx);
        kv_cache *lp = kv_store_pool(kv_store_local(s) ? kv_store_local(s) : s);
        float *l = run(ctx, 0, a, N + TAIL, false);
        free(l);
        kvlm_seq_free(ctx, 0);
        /* a's own run cycled its early local blocks out of the small local pool */
        kv_stats st;
        kv_get_stats(lp, &st);
        kvlm_prefix_probe pr; /* admission's view, without side effects, agrees */
        kvlm_seq_probe_prefix(ctx, b, N + TAIL, N + TAIL, &pr);
        int hit = kvlm_seq_reuse_prefix(ctx, 1, b, N + TAIL), past = kvlm_seq_n_past(ctx, 1);
        printf("  %s: the probe finds %d tokens and needs %d blocks (%d available)\n", SHAPES[i].name, pr.cached_tokens,
               pr.blocks_needed, pr.blocks_available);
        assert_int_equal(pr.cached_tokens, hit);
        int nb = 0;
        kv_seq_blocks(lp, 1, &nb);
        printf("  %s: local pool of %d blocks, %llu evictions; hit %d tokens, %d of its local blocks are the null block\n",
               SHAPES[i].name, st.n_blocks, (unsigned long long)st.evictions, hit, kv_seq_dropped(lp, 1));
        check_pools(ctx);
        float *lb = run(ctx, 1, b + past, N + TAIL - past, false);
        kvlm_error err = {0};
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.n_ctx = 256;
        cp.no_prefix_cache = true;
        cp.cache_type_k = cp.cache_type_v = KVLM_CACHE_F32;
        kvlm_ctx *fresh = kvlm_ctx_create(m, &cp, &err);
        float *lf = run(fresh, 0, b, N + TAIL, false);
        double e = row_err(lb, lf + (size_t)past * V, (N + TAIL - past), V);
        printf("    logits after the hit vs no reuse: %.2g\n", e);
        assert_true(st.evictions > 0);
        assert_true(hit >= N - BS);
        assert_true(kv_seq_dropped(lp, 1) > 0);
        assert_true(e < 1e-4);
        free(lb);
        free(lf);
        kvlm_ctx_free(fresh);
        kvlm_ctx_free(ctx);
        kvlm_model_free(m);
    }
}

/* Fork mid-block after many windows: both continuations equal their own
 * recomputation (copy-on-write of the shared partial block, in both stores),
 * and swapping one out and back in changes nothing. */
static void test_fork_swap(void **state) {
    (void)state;
    enum { N = 50, K = 9 };
    int32_t p[N + K], q[N + K];
    tokens(p, N + K, 9);
    memcpy(q, p, N * sizeof(int32_t));
    tokens(q + N, K, 10);
    for (int i = 0; i < N_SHAPES; i++) {
        kvlm_model *m = load(i);
        int V = kvlm_model_config(m)->vocab_size;
        kvlm_ctx *ctx = make_ctx(m, BS, 2, 0, true);
        kvlm_error err = {0};
        float *l = run(ctx, 0, p, N, false);
        free(l);
        assert_int_equal(kvlm_seq_fork(ctx, 0, 1, &err), KVLM_OK);
        check_pools(ctx);
        kvlm_swap *h = NULL;
        assert_int_equal(kvlm_seq_swap_out(ctx, 1, &h, &err), KVLM_OK);
        check_pools(ctx);
        float *l0 = run(ctx, 0, p + N, K, true);
        assert_int_equal(kvlm_seq_swap_in(ctx, 1, h, &err), KVLM_OK);
        check_pools(ctx);
        float *l1 = run(ctx, 1, q + N, K, true);
        check_pools(ctx);
        kvlm_ctx *ref = make_ctx(m, BS, 2, 0, true);
        float *r0 = run(ref, 0, p, N + K, false), *r1 = run(ref, 1, q, N + K, false);
        double e0 = row_err(l0, r0 + (size_t)N * V, K, V);
        double e1 = row_err(l1, r1 + (size_t)N * V, K, V);
        printf("  %s: fork at %d, swap out and in: %.2g and %.2g from recomputation\n", SHAPES[i].name, N, e0, e1);
        assert_true(e0 < 1e-4 && e1 < 1e-4);
        free(l0); free(l1); free(r0); free(r1);
        kvlm_ctx_free(ref);
        kvlm_ctx_free(ctx);
        kvlm_model_free(m);
    }
}

/* The host tier: blocks pushed out of small pools are demoted (each store's
 * to its own tier: the global layers' blocks and the local layers' blocks
 * apart), promoted back for a later request, and its logits equal a fresh
 * context's. */
static void test_tiers(void **state) {
    (void)state;
    enum { N = 48, TAIL = 5 };
    int32_t a[N + TAIL], b[N + TAIL], c[N];
    tokens(a, N + TAIL, 40);
    memcpy(b, a, N * sizeof(int32_t));
    tokens(b + N, TAIL, 41);
    tokens(c, N, 42);
    for (int i = 0; i < N_SHAPES; i++) {
        kvlm_model *m = load(i);
        int V = kvlm_model_config(m)->vocab_size;
        kvlm_error err = {0};
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.n_ctx = 256;
        cp.block_size = BS;
        cp.n_seq_max = 1;
        cp.n_batch = 8;
        cp.n_threads = 2;
        cp.kv_blocks = SHAPES[i].arch == KVLM_ARCH_LLAMA ? 8 : N / BS + 4; /* a's blocks go when c runs */
        cp.kv_host_size = 8 << 20;
        cp.cache_type_k = cp.cache_type_v = KVLM_CACHE_F32;
        kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
        if (!ctx) fail_msg("context: %s", err.msg);
        free(run(ctx, 0, a, N + TAIL, false));
        kvlm_seq_free(ctx, 0);
        free(run(ctx, 0, c, N, false));
        kvlm_seq_free(ctx, 0);
        int hit = kvlm_seq_reuse_prefix(ctx, 0, b, N + TAIL), past = kvlm_seq_n_past(ctx, 0);
        check_pools(ctx);
        float *lb = run(ctx, 0, b + past, N + TAIL - past, false);
        kvlm_kv_tier_stats ts[4];
        int nt = kvlm_kv_tier_stats_get(ctx, ts, 4);
        kvlm_ctx_params fp = cp;
        fp.kv_host_size = 0;
        fp.kv_blocks = 0;
        fp.no_prefix_cache = true;
        kvlm_ctx *fresh = kvlm_ctx_create(m, &fp, &err);
        float *lf = run(fresh, 0, b, N + TAIL, false);
        double e = row_err(lb, lf + (size_t)past * V, N + TAIL - past, V);
        printf("  %s: host tier demoted %llu, promoted %llu blocks (global layers' store); hit %d of %d; logits vs "
               "fresh %.2g\n", SHAPES[i].name, nt ? (unsigned long long)ts[0].demoted : 0ULL,
               nt ? (unsigned long long)ts[0].promoted : 0ULL, hit, N, e);
        assert_int_equal(nt, 1);
        assert_true(ts[0].demoted > 0 && ts[0].promoted > 0);
        assert_true(hit >= N - BS);
        assert_true(e < 1e-4);
        free(lb);
        free(lf);
        kvlm_ctx_free(fresh);
        kvlm_ctx_free(ctx);
        kvlm_model_free(m);
    }
}

typedef struct {
    int n;
    int32_t out[64];
    int finish;
} result;

static bool on_event(void *user, const kvlm_sched_event *ev) {
    result *r = user;
    if (ev->finish) r->finish = ev->finish;
    else if (r->n < 64) r->out[r->n++] = ev->token;
    return true;
}

/* The scheduler runs several SWA sequences at once (all-local: in a pool
 * that could not hold them without the window); each greedy continuation
 * equals the one a context alone computes. */
static void test_sched(void **state) {
    (void)state;
    enum { R = 6, NP = 40, GEN = 24 };
    for (int i = 0; i < N_SHAPES; i++) {
        kvlm_model *m = load(i);
        kvlm_ctx *ctx = make_ctx(m, BS, R, 0, false);
        kvlm_error err = {0};
        kvlm_sched_params sp = {.batch_tokens = 32, .max_seqs = R};
        kvlm_sched *s = kvlm_sched_create(ctx, &sp, &err);
        assert_non_null(s);
        int32_t prompts[R][NP];
        result res[R];
        memset(res, 0, sizeof res);
        for (int r = 0; r < R; r++) {
            tokens(prompts[r], NP, 20 + r);
            kvlm_request_params p = {0};
            p.sampling = kvlm_sampler_default_params();
            p.sampling.temperature = 0;
            p.max_tokens = GEN;
            p.logprobs = -1;
            assert_true(kvlm_sched_submit(s, prompts[r], NP, &p, on_event, &res[r], &err) > 0);
        }
        int steps = 0;
        while (kvlm_sched_step(s) > 0) assert_true(++steps < 100000);
        kvlm_kv_stats st;
        kvlm_kv_stats_get(ctx, &st);
        printf("  %s: %d requests of %d + %d tokens in %d steps, pool of %d blocks\n", SHAPES[i].name, R, NP, GEN, steps,
               st.n_blocks);
        assert_int_equal(st.used, 0);
        /* all-local: six sequences of 16 blocks each ran in a pool of fewer */
        if (SHAPES[i].arch == KVLM_ARCH_LLAMA) assert_true(st.n_blocks < R * (NP + GEN) / BS);
        check_pools(ctx);
        kvlm_sched_free(s);
        /* each alone, greedy */
        kvlm_sampler_params gp = kvlm_sampler_default_params();
        gp.temperature = 0;
        for (int r = 0; r < R; r++) {
            kvlm_ctx *one = make_ctx(m, BS, 1, 0, false);
            kvlm_sampler *smp = kvlm_sampler_create(&gp, kvlm_vocab_size(m));
            kvlm_batch b = {NP, prompts[r], NULL, NULL, NULL};
            assert_int_equal(kvlm_decode(one, &b, &err), KVLM_OK);
            assert_int_equal(res[r].n, GEN);
            for (int g = 0; g < GEN; g++) {
                int32_t t = kvlm_sampler_sample(smp, kvlm_get_logits(one, -1));
                if (t != res[r].out[g]) fail_msg("%s request %d token %d: %d alone, %d scheduled", SHAPES[i].name, r, g, t, res[r].out[g]);
                kvlm_batch o = {1, &t, NULL, NULL, NULL};
                assert_int_equal(kvlm_decode(one, &o, &err), KVLM_OK);
            }
            kvlm_sampler_free(smp);
            kvlm_ctx_free(one);
        }
        kvlm_ctx_free(ctx);
        kvlm_model_free(m);
    }
}

/* What is refused, clearly. */
static void test_refused(void **state) {
    (void)state;
    kvlm_model *m = load(0);
    kvlm_error err = {0};
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 256;
    cp.kv_evict = KVLM_EVICT_WINDOW;
    cp.kv_budget = 64;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_null(ctx);
    assert_non_null(strstr(err.msg, "sliding-window"));
    /* sessions: the saved blocks would not be the whole cache */
    ctx = make_ctx(m, BS, 1, 0, false);
    int32_t t[20];
    tokens(t, 20, 30);
    float *l = run(ctx, 0, t, 20, false);
    free(l);
    assert_int_equal(kvlm_session_save(ctx, 0, tu_tmp_path(".kvs"), &err), KVLM_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "sliding-window"));
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
    /* h2o's scores leave out gpt-oss's sinks */
    for (int i = 0; i < N_SHAPES; i++)
        if (SHAPES[i].arch == KVLM_ARCH_GPTOSS) {
            m = load(i);
            cp.kv_evict = KVLM_EVICT_H2O;
            assert_null(kvlm_ctx_create(m, &cp, &err));
            assert_non_null(strstr(err.msg, "attention sinks are not in h2o's scores"));
            kvlm_model_free(m);
        }
    /* a window for an architecture that has none */
    kvlm_synth_params p = {0};
    p.arch = KVLM_ARCH_QWEN2;
    p.dim = 64; p.hidden_dim = 64; p.n_layers = 1; p.n_heads = 4; p.vocab_size = 300;
    p.sliding_window = 8;
    assert_int_not_equal(kvlm_model_synth(&p, tu_tmp_path(".gguf"), &err), KVLM_OK);
    assert_non_null(strstr(err.msg, "sliding window"));
}

/* kvlm plan's cap of the local layers is the engine's pool: for each shape
 * and step, the blocks the created context's windowed store reserves per
 * sequence are the planner's local_cap_tokens in blocks plus the one spare
 * for a copy-on-write (twice over for a second, local store: live and
 * cached; an all-local store takes no more than a full context). */
static void test_plan_matches_pool(void **state) {
    (void)state;
    static const struct { int bs, n_batch, n_ctx, n_seq; } cfg[] = {
        {BS, 8, 256, 1}, {16, 1, 256, 3}, {BS, 64, 64, 2}, {16, 0, 100, 1}, {8, 0, 1024, 2},
    };
    for (int i = 0; i < N_SHAPES; i++) {
        kvlm_model *m = load(i);
        const kvlm_config *c = kvlm_model_config(m);
        for (size_t k = 0; k < sizeof cfg / sizeof cfg[0]; k++) {
            kvlm_error err = {0};
            kvlm_ctx_params cp = kvlm_ctx_default_params();
            cp.n_ctx = cfg[k].n_ctx;
            cp.block_size = cfg[k].bs;
            cp.n_seq_max = cfg[k].n_seq;
            cp.n_batch = cfg[k].n_batch;
            cp.n_threads = 1;
            kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
            if (!ctx) fail_msg("%s: context: %s", SHAPES[i].name, err.msg);
            kvlm_plan_params pp = {.n_ctx = cfg[k].n_ctx, .n_seq = cfg[k].n_seq, .block_size = cfg[k].bs,
                                   .n_batch = cfg[k].n_batch};
            kvlm_plan pl;
            kvlm_plan_memory(m, &pp, &pl);
            assert_int_equal(pl.window, WINDOW);
            assert_int_equal(pl.n_batch, engine_ctx_n_batch(ctx));
            int bs = cfg[k].bs, all = (cfg[k].n_ctx + bs - 1) / bs;
            int per_seq = (pl.local_cap_tokens + bs - 1) / bs + 1;
            kv_store *s = engine_kv_store(ctx), *l = kv_store_local(s);
            if (c->n_local_layers < c->n_layers) {
                assert_non_null(l);
                assert_int_equal(kv_store_params_of(l)->n_blocks, 2 * per_seq * cfg[k].n_seq);
            } else {
                assert_null(l);
                assert_int_equal(kv_store_params_of(s)->n_blocks, (per_seq < all ? per_seq : all) * cfg[k].n_seq);
            }
            kvlm_ctx_free(ctx);
        }
        kvlm_model_free(m);
    }
}

/* The local layers' pool names its blocks by the model's fingerprint and
 * layer group 1: its keys of a sequence's tokens are not the global pool's,
 * and the global pool's are a plain (group 0) pool's of the same model. */
static void test_layer_group_keys(void **state) {
    (void)state;
    for (int i = 0; i < N_SHAPES; i++) {
        kvlm_model *m = load(i);
        kvlm_ctx *ctx = make_ctx(m, BS, 1, 0, false);
        kv_store *s = engine_kv_store(ctx), *l = kv_store_local(s);
        if (l) {
            const kv_blockfmt *g = kv_get_blockfmt(kv_store_pool(s)), *lf = kv_get_blockfmt(kv_store_pool(l));
            assert_int_equal(g->layer_group, KV_LAYER_GROUP_ALL);
            assert_int_equal(lf->layer_group, KV_LAYER_GROUP_LOCAL);
            assert_memory_equal(g->model.b, lf->model.b, 16);
            int32_t t[BS];
            tokens(t, BS, 40);
            kv_key kg, kl;
            kv_block_key(g, NULL, t, &kg);
            kv_block_key(lf, NULL, t, &kl);
            assert_memory_not_equal(kg.b, kl.b, 16);
            kv_blockfmt plain = *lf; /* group 0 with the local pool's types: the global key */
            plain.layer_group = KV_LAYER_GROUP_ALL;
            kv_block_key(&plain, NULL, t, &kl);
            assert_memory_equal(kg.b, kl.b, 16);
        }
        kvlm_ctx_free(ctx);
        kvlm_model_free(m);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reference),
        cmocka_unit_test(test_cache_equals_recompute),
        cmocka_unit_test(test_blocks_freed),
        cmocka_unit_test(test_trim_past_window),
        cmocka_unit_test(test_prefix_reuse),
        cmocka_unit_test(test_prefix_reuse_evicted),
        cmocka_unit_test(test_fork_swap),
        cmocka_unit_test(test_tiers),
        cmocka_unit_test(test_sched),
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_plan_matches_pool),
        cmocka_unit_test(test_layer_group_keys),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
