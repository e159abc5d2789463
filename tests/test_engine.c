/* tests/test_engine: the whole pipeline on real and synthetic models: the
 * published golden text, GGUF == llama2.c, KV-cache decode == full recompute
 * for many shapes, conversion round trips, sampling and bad input. */
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "helpers/testutil.h"
#include "kvlm.h"
#include "dtype/dtype.h"
#include "model/gguf.h"

static const char *GOLDEN =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high.";

static kvlm_model *load(const char *path, const char *tok) {
    kvlm_error err = {0};
    kvlm_model_params mp = {0};
    mp.tokenizer_path = tok;
    kvlm_model *m = kvlm_model_load(path, &mp, &err);
    if (!m) fail_msg("loading %s: %s", path, err.msg);
    return m;
}

/* Greedy generation of n tokens after the prompt; returns the text (malloc). */
static char *generate(kvlm_model *m, const char *prompt, int n, bool no_cache) {
    kvlm_error err = {0};
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.no_kv_cache = no_cache;
    cp.n_threads = 2;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(ctx);
    int32_t toks[512];
    int np = kvlm_tokenize(m, prompt, strlen(prompt), true, false, toks, 512, &err);
    assert_true(np > 0 && np < 512);
    char *out = calloc(1, 1 << 16);
    size_t len = 0;
    kvlm_detok d;
    kvlm_detok_init(&d, m);
    for (int i = 0; i < np; i++) len += (size_t)kvlm_detok_push(&d, toks[i], out + len, (1 << 16) - len);
    kvlm_batch b = {np, toks, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK);
    kvlm_sampler_params sp = kvlm_sampler_default_params();
    sp.temperature = 0;
    kvlm_sampler *s = kvlm_sampler_create(&sp, kvlm_vocab_size(m));
    for (int i = 0; i < n; i++) {
        int32_t t = kvlm_sampler_sample(s, kvlm_get_logits(ctx, -1));
        if (kvlm_token_is_eog(m, t)) break;
        len += (size_t)kvlm_detok_push(&d, t, out + len, (1 << 16) - len);
        kvlm_batch one = {1, &t, NULL, NULL, NULL};
        assert_int_equal(kvlm_decode(ctx, &one, &err), KVLM_OK);
    }
    kvlm_sampler_free(s);
    kvlm_ctx_free(ctx);
    return out;
}

static void test_golden_gguf(void **state) {
    (void)state;
    const char *p = tu_model_path("stories260K.gguf");
    TU_REQUIRE(p);
    kvlm_model *m = load(p, NULL);
    char *text = generate(m, "Once upon a time", 60, false);
    if (strncmp(text, GOLDEN, strlen(GOLDEN)) != 0) fail_msg("got: %s", text);
    free(text);
    kvlm_model_free(m);
}

static void test_golden_llama2c(void **state) {
    (void)state;
    const char *p = tu_model_path("stories260K.bin");
    TU_REQUIRE(p);
    char bin[4096];
    snprintf(bin, sizeof bin, "%s", p);
    const char *t = tu_model_path("tok512.bin");
    TU_REQUIRE(t);
    kvlm_model *m = load(bin, t);
    char *text = generate(m, "Once upon a time", 60, false);
    if (strncmp(text, GOLDEN, strlen(GOLDEN)) != 0) fail_msg("got: %s", text);
    free(text);
    kvlm_model_free(m);
}

/* All-position logits of ids: one prefill, or one token per call. */
static float *logits_of(kvlm_model *m, const int32_t *ids, int n, bool one_by_one, bool no_cache, int threads) {
    kvlm_error err = {0};
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.no_kv_cache = no_cache;
    cp.n_threads = threads;
    cp.n_ctx = 256;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(ctx);
    int V = kvlm_model_config(m)->vocab_size;
    float *out = malloc(sizeof(float) * (size_t)V * n);
    int8_t want[256];
    memset(want, 1, sizeof want);
    for (int i = 0; i < n; i += one_by_one ? 1 : n) {
        kvlm_batch b = {one_by_one ? 1 : n, ids + i, NULL, want, NULL};
        if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
        for (int r = 0; r < b.n_tokens; r++) memcpy(out + (size_t)(i + r) * V, kvlm_get_logits(ctx, r), sizeof(float) * V);
    }
    kvlm_ctx_free(ctx);
    return out;
}

static void check_cache_equals_recompute(kvlm_model *m, const char *what) {
    int V = kvlm_model_config(m)->vocab_size, n = 24;
    int32_t ids[24];
    uint64_t s = 7;
    for (int i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1;
        ids[i] = (int32_t)((s >> 33) % (uint64_t)V);
    }
    ids[0] = 1;
    float *prefill = logits_of(m, ids, n, false, false, 2);
    float *decode = logits_of(m, ids, n, true, false, 2);
    float *naive = logits_of(m, ids, n, true, true, 1);
    /* Relative to the row's largest logit: elementwise relative error is
     * meaningless for logits that cross zero. */
    double worst_dec = 0, worst_naive = 0;
    for (int t = 0; t < n; t++) {
        double scale = 1e-3;
        for (int v = 0; v < V; v++) scale = fmax(scale, fabs(naive[(size_t)t * V + v]));
        for (int v = 0; v < V; v++) {
            size_t i = (size_t)t * V + v;
            worst_dec = tu_worse(worst_dec, fabs(decode[i] - naive[i]) / scale);
            worst_naive = tu_worse(worst_naive, fabs(prefill[i] - naive[i]) / scale);
        }
    }
    printf("  %-40s decode vs recompute %.2e, prefill vs recompute %.2e\n", what, worst_dec, worst_naive);
    assert_true(worst_dec < 1e-4);
    assert_true(worst_naive < 1e-4);
    free(prefill);
    free(decode);
    free(naive);
}

static void test_cache_equals_recompute_stories(void **state) {
    (void)state;
    const char *p = tu_model_path("stories260K.gguf");
    TU_REQUIRE(p);
    kvlm_model *m = load(p, NULL);
    check_cache_equals_recompute(m, "stories260K.gguf");
    kvlm_model_free(m);
}

static void test_cache_equals_recompute_shapes(void **state) {
    (void)state;
    struct { kvlm_arch arch; int dim, heads, kv, head_dim; const char *type; const char *name; } shapes[] = {
        {KVLM_ARCH_LLAMA, 64, 8, 8, 0, "f32", "multi-head 8:8, head dim 8"},
        {KVLM_ARCH_LLAMA, 128, 8, 2, 0, "f32", "grouped 8:2, head dim 16"},
        {KVLM_ARCH_LLAMA, 256, 8, 1, 0, "f32", "multi-query 8:1, head dim 32"},
        {KVLM_ARCH_QWEN2, 128, 8, 2, 0, "f32", "qwen2 8:2 with biases, head dim 16"},
        {KVLM_ARCH_LLAMA, 256, 4, 2, 0, "f32", "grouped 4:2, head dim 64"},
        {KVLM_ARCH_LLAMA, 128, 4, 4, 64, "f32", "head dim 64 != dim/heads"},
        {KVLM_ARCH_LLAMA, 256, 8, 2, 0, "q8_0", "q8_0 weights 8:2"},
        {KVLM_ARCH_QWEN2, 256, 8, 4, 0, "q4_k", "qwen2 q4_k weights 8:4"},
        {KVLM_ARCH_LLAMA, 256, 8, 8, 0, "f16", "f16 weights"},
        {KVLM_ARCH_PHI3, 128, 4, 2, 0, "f32", "phi3 fused qkv/gate-up 4:2"},
        {KVLM_ARCH_PHI3, 256, 8, 2, 0, "q8_0", "phi3 q8_0 weights 8:2"},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        kvlm_synth_params sp = {0};
        sp.arch = shapes[i].arch;
        sp.dim = shapes[i].dim;
        sp.hidden_dim = 2 * shapes[i].dim + 32;
        sp.n_layers = 2;
        sp.n_heads = shapes[i].heads;
        sp.n_kv_heads = shapes[i].kv;
        sp.head_dim = shapes[i].head_dim;
        sp.vocab_size = 300;
        sp.n_ctx = 256;
        sp.type = kvlm_type_from_name(shapes[i].type);
        sp.seed = 100 + i;
        const char *path = tu_tmp_path(".gguf");
        kvlm_error err = {0};
        if (kvlm_model_synth(&sp, path, &err)) fail_msg("synth %s: %s", shapes[i].name, err.msg);
        kvlm_model *m = load(path, NULL);
        check_cache_equals_recompute(m, shapes[i].name);
        kvlm_model_free(m);
    }
}

/* Rewrites the phi3 file src as dst with one change: tensor `drop` left out,
 * tensor `shrink` given `rows` rows (its first ones), an f32 tensor `add` of
 * 16 values added (each NULL: no such change), or, with q_rows > 0, each f32
 * attn_qkv split into separate attn_q (q_rows rows), attn_k and attn_v. */
static void rewrite_gguf(const char *src, const char *dst, const char *drop, const char *shrink, int64_t rows,
                         const char *add, int64_t q_rows) {
    kvlm_error err = {0};
    gguf_file *f = gguf_open(src, &err);
    if (!f) fail_msg("open %s: %s", src, err.msg);
    gguf_writer *w = gguf_writer_create();
    gguf_writer_copy_kv(w, f, "");
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (drop && !strcmp(t->cname, drop)) continue;
        int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        if (shrink && !strcmp(t->cname, shrink)) ne[1] = rows;
        const char *qkv = strstr(t->cname, "attn_qkv.weight");
        if (q_rows > 0 && qkv) {
            int64_t kv_rows = (t->ne[1] - q_rows) / 2, r0 = 0;
            const char *parts[3] = {"attn_q", "attn_k", "attn_v"};
            for (int p = 0; p < 3; p++) {
                char name[128];
                snprintf(name, sizeof name, "%.*s%s.weight", (int)(qkv - t->cname), t->cname, parts[p]);
                int64_t pne[2] = {t->ne[0], p ? kv_rows : q_rows};
                const float *data = (const float *)t->data + r0 * t->ne[0];
                assert_int_equal(gguf_writer_add_tensor(w, name, t->type, 2, pne, data, &err), KVLM_OK);
                r0 += pne[1];
            }
            continue;
        }
        assert_int_equal(gguf_writer_add_tensor(w, t->cname, t->type, t->n_dims, ne, t->data, &err), KVLM_OK);
    }
    static const float factors[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    if (add) assert_int_equal(gguf_writer_add_tensor(w, add, 0, 1, (const int64_t[]){16}, factors, &err), KVLM_OK);
    if (gguf_writer_write(w, dst, &err)) fail_msg("write %s: %s", dst, err.msg);
    gguf_writer_free(w);
    gguf_close(f);
}

/* phi3: the fused tensors' shapes are checked, a LongRoPE file with one of
 * its two factor tensors is refused with a message that says so, and convert writes the tensors fused again
 * (same logits after a round trip). */
static void test_phi3(void **state) {
    (void)state;
    kvlm_synth_params sp = {0};
    sp.arch = KVLM_ARCH_PHI3;
    sp.dim = 64, sp.hidden_dim = 96, sp.n_layers = 2, sp.n_heads = 4, sp.n_kv_heads = 2;
    sp.vocab_size = 300, sp.n_ctx = 64, sp.type = kvlm_type_from_name("f32"), sp.seed = 3;
    char src[4096];
    snprintf(src, sizeof src, "%s", tu_tmp_path(".gguf"));
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, src, &err)) fail_msg("synth phi3: %s", err.msg);
    /* q rows 64 + k, v rows 32 each = 128; gate + up rows 2 x 96 = 192 */
    struct { const char *drop, *shrink; int64_t rows; const char *add, *needle; } bad[] = {
        {NULL, "blk.1.attn_qkv.weight", 127, NULL, "tensor blk.1.attn_qkv.weight: shape 64x127, expected 64x128"},
        {NULL, "blk.0.ffn_up.weight", 96, NULL, "tensor blk.0.ffn_up.weight: shape 64x96, expected 64x192"},
        {"blk.0.attn_qkv.weight", NULL, 0, NULL, "missing tensor blk.0.attn_qkv.weight"},
        {NULL, NULL, 0, "rope_factors_long.weight", "LongRoPE needs both rope_factors_long.weight and rope_factors_short"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *dst = tu_tmp_path(".gguf");
        rewrite_gguf(src, dst, bad[i].drop, bad[i].shrink, bad[i].rows, bad[i].add, 0);
        kvlm_error e = {0};
        kvlm_model *m = kvlm_model_load(dst, NULL, &e);
        if (m) fail_msg("accepted a bad phi3 file (expected \"%s\")", bad[i].needle);
        if (!strstr(e.msg, bad[i].needle)) fail_msg("error \"%s\" lacks \"%s\"", e.msg, bad[i].needle);
    }
    kvlm_model *a = load(src, NULL);
    char desc[512];
    kvlm_model_describe(a, desc, sizeof desc);
    assert_non_null(strstr(desc, "phi3"));
    const char *out = tu_tmp_path(".gguf");
    if (kvlm_model_save_gguf(a, out, -1, &err)) fail_msg("convert phi3: %s", err.msg);
    kvlm_model *b = load(out, NULL);
    int32_t ids[10] = {1, 50, 99, 7, 250, 3, 18, 200, 77, 5};
    float *la = logits_of(a, ids, 10, false, false, 1), *lb = logits_of(b, ids, 10, false, false, 1);
    assert_memory_equal(la, lb, sizeof(float) * 10 * 300);
    /* Separate attn_q/k/v in a phi3 file are accepted (as llama.cpp does):
     * same logits; convert fuses them again (copying: not adjacent now). */
    char sep[4096];
    snprintf(sep, sizeof sep, "%s", tu_tmp_path(".gguf"));
    rewrite_gguf(src, sep, NULL, NULL, 0, NULL, 64);
    kvlm_model *c = load(sep, NULL);
    float *lc = logits_of(c, ids, 10, false, false, 1);
    assert_memory_equal(la, lc, sizeof(float) * 10 * 300);
    const char *fused_again = tu_tmp_path(".gguf");
    if (kvlm_model_save_gguf(c, fused_again, -1, &err)) fail_msg("convert separate phi3: %s", err.msg);
    gguf_file *f = gguf_open(fused_again, &err);
    assert_non_null(f);
    assert_non_null(gguf_find_tensor(f, "blk.1.attn_qkv.weight"));
    assert_null(gguf_find_tensor(f, "blk.1.attn_q.weight"));
    gguf_close(f);
    kvlm_model *d = load(fused_again, NULL);
    float *ld = logits_of(d, ids, 10, false, false, 1);
    assert_memory_equal(la, ld, sizeof(float) * 10 * 300);
    free(la);
    free(lb);
    free(lc);
    free(ld);
    kvlm_model_free(a);
    kvlm_model_free(b);
    kvlm_model_free(c);
    kvlm_model_free(d);
}

/* The two files of stories260K hold the same weights: same logits. */
static void test_gguf_equals_llama2c(void **state) {
    (void)state;
    const char *p = tu_model_path("stories260K.gguf");
    TU_REQUIRE(p);
    char gguf[4096], bin[4096];
    snprintf(gguf, sizeof gguf, "%s", p);
    p = tu_model_path("stories260K.bin");
    TU_REQUIRE(p);
    snprintf(bin, sizeof bin, "%s", p);
    const char *t = tu_model_path("tok512.bin");
    TU_REQUIRE(t);
    kvlm_model *a = load(gguf, NULL), *b = load(bin, t);
    int32_t ids[16] = {1, 403, 407, 261, 378, 273, 400, 333, 260, 270, 280, 300, 310, 320, 330, 340};
    float *la = logits_of(a, ids, 16, false, false, 2), *lb = logits_of(b, ids, 16, false, false, 2);
    assert_true(tu_max_rel_diff(la, lb, 16 * 512, 1e-2) < 1e-5);
    free(la);
    free(lb);
    kvlm_model_free(a);
    kvlm_model_free(b);
}

/* convert: llama2.c -> GGUF f32 gives identical logits; quantized types stay
 * within their tolerance of f32. */
static void test_convert(void **state) {
    (void)state;
    const char *p = tu_model_path("stories260K.bin");
    TU_REQUIRE(p);
    char bin[4096];
    snprintf(bin, sizeof bin, "%s", p);
    const char *t = tu_model_path("tok512.bin");
    TU_REQUIRE(t);
    kvlm_model *src = load(bin, t);
    int32_t ids[12] = {1, 403, 407, 261, 378, 273, 400, 333, 260, 270, 280, 300};
    float *ref = logits_of(src, ids, 12, false, false, 1);
    struct { const char *type; double tol; } types[] = {
        {"f32", 1e-6}, {"f16", 2e-2}, {"bf16", 6e-2}, {"q8_0", 5e-2}, {"q4_0", 0.35},
    };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        const char *out = tu_tmp_path(".gguf");
        kvlm_error err = {0};
        if (kvlm_model_save_gguf(src, out, kvlm_type_from_name(types[i].type), &err))
            fail_msg("convert to %s: %s", types[i].type, err.msg);
        kvlm_model *m = load(out, NULL);
        float *got = logits_of(m, ids, 12, false, false, 1);
        /* Error relative to the largest logit of the whole set. */
        double scale = 0, worst = 0;
        for (int k = 0; k < 12 * 512; k++) scale = fmax(scale, fabs(ref[k]));
        for (int k = 0; k < 12 * 512; k++) worst = tu_worse(worst, fabs(got[k] - ref[k]) / scale);
        printf("  convert to %-5s max error %.2e of the largest logit\n", types[i].type, worst);
        assert_true(worst <= types[i].tol);
        char *text = generate(m, "Once upon a time", 30, false);
        assert_true(strncmp(text, "Once upon a time", 16) == 0);
        if (!strcmp(types[i].type, "f32")) assert_true(strncmp(text, GOLDEN, 60) == 0);
        free(text);
        free(got);
        kvlm_model_free(m);
    }
    free(ref);
    kvlm_model_free(src);
}

/* Greedy ids after ids[0..np): with the cache, or recomputing everything per token. */
static void greedy_ids(kvlm_model *m, const int32_t *ids, int np, int n, bool no_cache, int32_t *out) {
    kvlm_error err = {0};
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.no_kv_cache = no_cache;
    cp.n_threads = 2;
    cp.n_ctx = 256;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(ctx);
    kvlm_batch b = {np, ids, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK);
    kvlm_sampler_params sp = kvlm_sampler_default_params();
    sp.temperature = 0;
    kvlm_sampler *s = kvlm_sampler_create(&sp, kvlm_vocab_size(m));
    for (int i = 0; i < n; i++) {
        out[i] = kvlm_sampler_sample(s, kvlm_get_logits(ctx, -1));
        kvlm_batch one = {1, &out[i], NULL, NULL, NULL};
        assert_int_equal(kvlm_decode(ctx, &one, &err), KVLM_OK);
    }
    kvlm_sampler_free(s);
    kvlm_ctx_free(ctx);
}

/* The random llama of the low-bit weight tests (rows of 256 and 512 columns), f32. */
static kvlm_synth_params low_bit_shape(void) {
    kvlm_synth_params sp = {0};
    sp.arch = KVLM_ARCH_LLAMA;
    sp.dim = 256;
    sp.hidden_dim = 512;
    sp.n_layers = 2;
    sp.n_heads = 8;
    sp.n_kv_heads = 2;
    sp.vocab_size = 300;
    sp.n_ctx = 256;
    sp.seed = 77;
    sp.type = DT_F32;
    return sp;
}

/* A low-bit model's KV cache equals a recompute, and greedy decode with the
 * cache picks the tokens a full recompute picks. */
static void check_cached_runs(kvlm_model *m, const char *type, const int32_t *ids) {
    char what[64];
    snprintf(what, sizeof what, "%s weights 8:2", type);
    check_cache_equals_recompute(m, what);
    int32_t a[12], b[12];
    greedy_ids(m, ids, 4, 12, false, a);
    greedy_ids(m, ids, 4, 12, true, b);
    assert_memory_equal(a, b, sizeof a);
}

/* Q2_K, Q3_K, IQ4_NL and IQ4_XS models (every 2-D weight in the type: rows
 * of 256 and 512 columns) of the same random weights as an f32 one: the
 * cache equals a recompute, greedy decode with the cache picks the tokens a
 * full recompute picks, and the logits stay near the f32 model's. The
 * logits' relative RMS error came out at 3.0 to 3.6 times each type's weight
 * error on this uniform data (test_dtype: q4_K 0.055, iq4_nl 0.062, iq4_xs
 * 0.062, q3_K 0.118, q2_K 0.223; measured 0.18, 0.22, 0.23, 0.39, 0.67):
 * errors of ~15 quantized products in a row of a random net, nothing from
 * the kernels. The bounds are about 1.3x those (rms) and the max error over
 * the largest logit likewise; and fewer bits must cost more. */
static void test_low_bit_weights(void **state) {
    (void)state;
    struct { const char *type; int id; double tol, tol_rms; } types[] = {
        {"q4_k", DT_Q4_K, 0.28, 0.24},   {"iq4_nl", DT_IQ4_NL, 0.32, 0.29}, {"iq4_xs", DT_IQ4_XS, 0.32, 0.29},
        {"q3_k", DT_Q3_K, 0.62, 0.51},   {"q2_k", DT_Q2_K, 0.93, 0.87},
    };
    double rms[5];
    kvlm_synth_params sp = low_bit_shape();
    const char *fpath = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, fpath, &err)) fail_msg("synth f32: %s", err.msg);
    kvlm_model *mf = load(fpath, NULL);
    enum { N = 16 };
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (int32_t)(1 + (i * 97) % 299);
    float *ref = logits_of(mf, ids, N, false, false, 2);
    const int V = 300;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        sp.type = kvlm_type_from_name(types[i].type);
        assert_int_equal(sp.type, types[i].id);
        const char *path = tu_tmp_path(".gguf");
        if (kvlm_model_synth(&sp, path, &err)) fail_msg("synth %s: %s", types[i].type, err.msg);
        kvlm_model *m = load(path, NULL);
        int n2d = 0;
        for (int t = 0; t < kvlm_model_n_tensors(m); t++) {
            kvlm_tensor_info ti;
            kvlm_model_tensor(m, t, &ti);
            if (ti.n_dims == 2) {
                assert_int_equal(ti.type, types[i].id); /* no fallback: every row is whole blocks */
                n2d++;
            }
        }
        assert_true(n2d >= 9);
        check_cached_runs(m, types[i].type, ids);
        float *got = logits_of(m, ids, N, false, false, 2);
        double scale = 0, worst = 0, se = 0, sr = 0;
        for (int k = 0; k < N * V; k++) scale = fmax(scale, fabs(ref[k]));
        for (int k = 0; k < N * V; k++) {
            worst = tu_worse(worst, fabs(got[k] - ref[k]) / scale);
            se += (got[k] - ref[k]) * (got[k] - ref[k]);
            sr += ref[k] * ref[k];
        }
        printf("  %-6s logits vs f32: max error %.3f of the largest logit, relative RMS %.3f\n", types[i].type, worst,
               sqrt(se / sr));
        rms[i] = sqrt(se / sr);
        assert_true(worst <= types[i].tol);
        assert_true(rms[i] <= types[i].tol_rms);
        free(got);
        kvlm_model_free(m);
    }
    assert_true(rms[0] < rms[3] && rms[1] < rms[3] && rms[2] < rms[3] && rms[3] < rms[4]);
    free(ref);
    kvlm_model_free(mf);
}

/* The 16 tokens the converted-weight tests run; V: the vocabulary of low_bit_shape. */
enum { CONV_N = 16, CONV_V = 300 };
static void conv_ids(int32_t *ids) {
    for (int i = 0; i < CONV_N; i++) ids[i] = (int32_t)(1 + (i * 97) % 299);
}

/* low_bit_shape's f32 model, the ids the converted-weight tests run and its logits over them in *ref. */
static kvlm_model *low_bit_f32(int32_t *ids, float **ref) {
    kvlm_synth_params sp = low_bit_shape();
    const char *fpath = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, fpath, &err)) fail_msg("synth f32: %s", err.msg);
    kvlm_model *mf = load(fpath, NULL);
    conv_ids(ids);
    *ref = logits_of(mf, ids, CONV_N, false, false, 2);
    return mf;
}

/* mf (f32) converted to `type`: every 2-D weight in it, the cache against a
 * recompute. Returns its logits over ids; *rms_deq: their relative RMS error
 * against the f32 model of its own dequantized weights (whose file goes to
 * *deq_path when asked), *rms_orig: against ref, mf's logits. Only the
 * activations' 8-bit rounding separates the first pair, so rms_deq must be
 * far below rms_orig: that error is the kernels' alone. */
static float *converted_logits(kvlm_model *mf, const char *type, int id, const int32_t *ids, const float *ref,
                               double *rms_deq, double *rms_orig, const char **deq_path) {
    kvlm_error err = {0};
    const char *path = tu_tmp_path(".gguf"), *dpath = tu_tmp_path(".gguf");
    assert_int_equal(kvlm_type_from_name(type), id);
    if (kvlm_model_save_gguf(mf, path, id, &err)) fail_msg("convert %s: %s", type, err.msg);
    kvlm_model *m = load(path, NULL);
    for (int t = 0; t < kvlm_model_n_tensors(m); t++) {
        kvlm_tensor_info ti;
        kvlm_model_tensor(m, t, &ti);
        if (ti.n_dims == 2) assert_int_equal(ti.type, id);
    }
    if (kvlm_model_save_gguf(m, dpath, DT_F32, &err)) fail_msg("dequantize %s: %s", type, err.msg);
    kvlm_model *md = load(dpath, NULL);
    check_cached_runs(m, type, ids);
    float *got = logits_of(m, ids, CONV_N, false, false, 2), *deq = logits_of(md, ids, CONV_N, false, false, 2);
    double se_d = 0, sr_d = 0, se_o = 0, sr_o = 0;
    for (int k = 0; k < CONV_N * CONV_V; k++) {
        se_d += (got[k] - deq[k]) * (got[k] - deq[k]);
        sr_d += deq[k] * deq[k];
        se_o += (got[k] - ref[k]) * (got[k] - ref[k]);
        sr_o += ref[k] * ref[k];
    }
    *rms_deq = sqrt(se_d / sr_d);
    *rms_orig = sqrt(se_o / sr_o);
    printf("  %-8s logits: relative RMS %.4f against its dequantized weights in f32, %.3f against the original\n",
           type, *rms_deq, *rms_orig);
    assert_true(*rms_deq < 0.05); /* measured 0.016-0.023 */
    assert_true(*rms_deq < 0.25 * *rms_orig);
    if (deq_path) *deq_path = dpath;
    free(deq);
    kvlm_model_free(md);
    kvlm_model_free(m);
    return got;
}

/* The codebook types (IQ2_*, IQ3_*, IQ1_*): the f32 model of
 * test_low_bit_weights converted to each (every 2-D weight; rows of 256 and
 * 512 columns), run against the f32 model of its own dequantized weights
 * (converted_logits); and against the original weights fewer bits cost more. */
static void test_codebook_weights(void **state) {
    (void)state;
    struct { const char *type; int id; } types[] = {
        {"iq3_s", DT_IQ3_S}, {"iq2_xxs", DT_IQ2_XXS}, {"iq1_m", DT_IQ1_M}, /* the quick set: one of each kind */
        {"iq3_xxs", DT_IQ3_XXS}, {"iq2_s", DT_IQ2_S}, {"iq2_xs", DT_IQ2_XS}, {"iq1_s", DT_IQ1_S},
    };
    const int n_types = tu_quick() ? 3 : 7;
    int32_t ids[CONV_N];
    float *ref;
    kvlm_model *mf = low_bit_f32(ids, &ref);
    double rms_orig[7], rms_deq;
    for (int i = 0; i < n_types; i++)
        free(converted_logits(mf, types[i].type, types[i].id, ids, ref, &rms_deq, &rms_orig[i], NULL));
    /* 3.44 bits against 2.06 and 1.75 (those two both leave the logits of this
     * random net mostly noise: 0.87 each) */
    assert_true(rms_orig[0] < 0.6 * rms_orig[1] && rms_orig[0] < 0.6 * rms_orig[2]);
    free(ref);
    kvlm_model_free(mf);
}

/* MXFP4, TQ2_0 and TQ1_0 models of the same f32 llama against the f32 models
 * of their own dequantized weights (converted_logits); and ternary weights
 * convert exactly: TQ2_0's dequantized model converted to TQ1_0 gives TQ2_0's
 * logits bit for bit (the same codes and d, the same sums). */
static void test_small_block_weights(void **state) {
    (void)state;
    const char *tq2_deq = NULL;
    kvlm_error err = {0};
    int32_t ids[CONV_N];
    float *ref;
    kvlm_model *mf = low_bit_f32(ids, &ref);
    double rd, ro;
    free(converted_logits(mf, "mxfp4", DT_MXFP4, ids, ref, &rd, &ro, NULL));
    float *tq2 = converted_logits(mf, "tq2_0", DT_TQ2_0, ids, ref, &rd, &ro, &tq2_deq);
    free(converted_logits(mf, "tq1_0", DT_TQ1_0, ids, ref, &rd, &ro, NULL));
    /* the ternary weights of TQ2_0's model, through f32 into TQ1_0 */
    kvlm_model *mt = load(tq2_deq, NULL);
    const char *p1 = tu_tmp_path(".gguf");
    if (kvlm_model_save_gguf(mt, p1, DT_TQ1_0, &err)) fail_msg("ternary to tq1_0: %s", err.msg);
    kvlm_model *m1 = load(p1, NULL);
    float *again = logits_of(m1, ids, CONV_N, false, false, 2);
    assert_memory_equal(again, tq2, sizeof(float) * CONV_N * CONV_V);
    free(again);
    kvlm_model_free(m1);
    kvlm_model_free(mt);
    free(tq2);
    free(ref);
    kvlm_model_free(mf);
}

/* OpenAI's penalties, over the tokens picked: logit -= frequency * count +
 * presence * (count > 0). The greedy sequences are worked out by hand. */
static void test_sampler_penalties(void **state) {
    (void)state;
    float logits[10] = {1.0f, 0.9f, 0.45f, -1, -1, -1, -1, -1, -1, -1};
    kvlm_sampler_params p = kvlm_sampler_default_params();
    p.temperature = 0;
    p.frequency_penalty = 0.3f; /* 0: 1.0, 0.7, 0.4, 0.1; 1: 0.9, 0.6, 0.3; 2: 0.45, 0.15 */
    kvlm_sampler *a = kvlm_sampler_create(&p, 10);
    const int32_t freq_want[] = {0, 1, 0, 1, 2, 0, 1, 2};
    for (int i = 0; i < 8; i++) assert_int_equal(kvlm_sampler_sample(a, logits), freq_want[i]);
    kvlm_sampler_free(a);
    p.frequency_penalty = 0;
    p.presence_penalty = 0.5f; /* once per token, however often: 0 drops to 0.5 and stays */
    a = kvlm_sampler_create(&p, 10);
    const int32_t pres_want[] = {0, 1, 0, 0, 0};
    for (int i = 0; i < 5; i++) assert_int_equal(kvlm_sampler_sample(a, logits), pres_want[i]);
    kvlm_sampler_free(a);
    /* negative values encourage repeats: the first pick comes back every time */
    p.presence_penalty = -0.5f;
    a = kvlm_sampler_create(&p, 10);
    float flat[10] = {0.3f, 0.5f, 0.4f, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < 5; i++) assert_int_equal(kvlm_sampler_sample(a, flat), 1);
    kvlm_sampler_free(a);
    /* sampled, a huge frequency penalty never repeats a token: 10 draws, 10 tokens */
    p = kvlm_sampler_default_params();
    p.temperature = 1; p.top_k = 0; p.top_p = 1; p.min_p = 0; p.seed = 7;
    p.frequency_penalty = 100;
    a = kvlm_sampler_create(&p, 10);
    bool seen[10] = {0};
    for (int i = 0; i < 10; i++) {
        int32_t t = kvlm_sampler_sample(a, flat);
        assert_false(seen[t]);
        seen[t] = true;
    }
    kvlm_sampler_free(a);
    /* the prompt (accept) does not count: OpenAI's penalties look at what was generated */
    p.temperature = 0;
    p.frequency_penalty = 0.3f;
    a = kvlm_sampler_create(&p, 10);
    for (int i = 0; i < 5; i++) kvlm_sampler_accept(a, 0);
    assert_int_equal(kvlm_sampler_sample(a, logits), 0);
    kvlm_sampler_free(a);
}

/* Logit biases: added before anything else, copied at create, ids outside
 * the vocabulary ignored; a banned token is never drawn, a biased one moves
 * the draw as exp(bias) predicts. */
static void test_sampler_logit_bias(void **state) {
    (void)state;
    float logits[100];
    for (int i = 0; i < 100; i++) logits[i] = (float)((i * 37) % 100) / 10.0f; /* the top is 27 (9.9), then 54 (9.8) */
    kvlm_sampler_params p = kvlm_sampler_default_params();
    p.temperature = 0;
    int32_t ids[3] = {27, 5, 1000};
    float bias[3] = {-INFINITY, 100, 3};
    p.bias_ids = ids;
    p.bias = bias;
    p.n_bias = 1;
    kvlm_sampler *a = kvlm_sampler_create(&p, 100);
    ids[0] = 54; /* the sampler kept its own copy */
    assert_int_equal(kvlm_sampler_sample(a, logits), 54); /* 27 banned: the next best */
    kvlm_sampler_free(a);
    p.n_bias = 3; /* 5 forced (logit 8.5 + 100), 1000 outside the vocabulary: ignored */
    a = kvlm_sampler_create(&p, 100);
    assert_int_equal(kvlm_sampler_sample(a, logits), 5);
    kvlm_sampler_free(a);
    /* sampling at temperature 1 over 27 (9.9) and 54 (9.8) only, 54 raised by ln 4:
     * p(54) = 4 e^9.8 / (4 e^9.8 + e^9.9) = 0.783 */
    p.temperature = 1;
    p.top_k = 2;
    p.top_p = 1;
    p.min_p = 0;
    p.seed = 7;
    ids[0] = 54;
    bias[0] = logf(4);
    p.n_bias = 1;
    a = kvlm_sampler_create(&p, 100);
    int n54 = 0;
    for (int i = 0; i < 4000; i++) {
        int32_t x = kvlm_sampler_sample(a, logits);
        assert_true(x == 27 || x == 54);
        n54 += x == 54;
    }
    assert_true(n54 > 0.76 * 4000 && n54 < 0.81 * 4000);
    kvlm_sampler_free(a);
    /* banned at temperature 1, whatever top-k lets through */
    p.top_k = 0;
    ids[0] = 27;
    bias[0] = -100;
    a = kvlm_sampler_create(&p, 100);
    for (int i = 0; i < 2000; i++) assert_int_not_equal(kvlm_sampler_sample(a, logits), 27);
    kvlm_sampler_free(a);
}

static void test_sampler(void **state) {
    (void)state;
    float logits[100];
    for (int i = 0; i < 100; i++) logits[i] = (float)((i * 37) % 100) / 10.0f;
    kvlm_sampler_params p = kvlm_sampler_default_params();
    p.seed = 42;
    p.temperature = 0.2f;
    p.top_k = 0; p.top_p = 1.0f; p.min_p = 0;
    kvlm_sampler *a = kvlm_sampler_create(&p, 100), *b = kvlm_sampler_create(&p, 100);
    int hist[100] = {0};
    for (int i = 0; i < 2000; i++) {
        int32_t x = kvlm_sampler_sample(a, logits), y = kvlm_sampler_sample(b, logits);
        assert_int_equal(x, y); /* same seed, same draws */
        hist[x]++;
    }
    /* The most likely token (logit 9.9 at i where 37i%100 == 99 -> i = 27) is drawn most. */
    int best = 0;
    for (int i = 1; i < 100; i++) if (hist[i] > hist[best]) best = i;
    assert_int_equal(best, 27);
    /* softmax(logits / 0.2): logits step by 0.1, so p(top) = 1 - e^-0.5 = 0.393. */
    assert_true(hist[27] > 0.33 * 2000 && hist[27] < 0.45 * 2000);
    kvlm_sampler_free(a);
    kvlm_sampler_free(b);
    /* top_k = 1 is greedy; min_p = 1 keeps only the top token too. */
    p.top_k = 1;
    a = kvlm_sampler_create(&p, 100);
    for (int i = 0; i < 50; i++) assert_int_equal(kvlm_sampler_sample(a, logits), 27);
    kvlm_sampler_free(a);
    p.top_k = 0; p.min_p = 1.0f;
    a = kvlm_sampler_create(&p, 100);
    for (int i = 0; i < 50; i++) assert_int_equal(kvlm_sampler_sample(a, logits), 27);
    kvlm_sampler_free(a);
    /* top_p small: only the top few tokens appear. */
    p.min_p = 0; p.top_p = 0.5f; p.temperature = 1.0f;
    a = kvlm_sampler_create(&p, 100);
    for (int i = 0; i < 500; i++) assert_true(logits[kvlm_sampler_sample(a, logits)] >= 9.0f);
    kvlm_sampler_free(a);
    /* A strong repetition penalty moves greedy off a repeated token. */
    p.temperature = 0; p.repeat_penalty = 100.0f; p.repeat_last_n = 8;
    a = kvlm_sampler_create(&p, 100);
    assert_int_equal(kvlm_sampler_sample(a, logits), 27);
    assert_true(kvlm_sampler_sample(a, logits) != 27);
    kvlm_sampler_free(a);
}

/* What the CUDA forward pass does not compute is refused by name on
 * --device cuda before any GPU is touched (so this runs on every machine):
 * never a model run there with a piece silently missing. */
static void test_cuda_refusals(void **state) {
    (void)state;
    struct { kvlm_arch arch; int experts; float longrope; const char *needle; } cases[] = {
        {KVLM_ARCH_QWEN3, 0, 0, "qwen3's q and k norms"},
        {KVLM_ARCH_OLMO2, 0, 0, "olmo2's q and k norms"},
        {KVLM_ARCH_SMOLLM3, 0, 0, "smollm3's layers without RoPE"},
        {KVLM_ARCH_GRANITE, 0, 0, "granite's multipliers"},
        {KVLM_ARCH_QWEN3MOE, 4, 0, "a mixture of experts (qwen3moe)"},
        {KVLM_ARCH_LLAMA, 4, 0, "a mixture of experts (llama)"},
        {KVLM_ARCH_QWEN2MOE, 4, 0, "a mixture of experts (qwen2moe)"},
        {KVLM_ARCH_GRANITEMOE, 4, 0, "granitemoe's multipliers"},
        {KVLM_ARCH_PHI3, 0, 2, "scaled RoPE"},
        {KVLM_ARCH_GPTOSS, 4, 0, "gpt-oss"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvlm_synth_params sp = {0};
        sp.arch = cases[i].arch;
        sp.dim = 32, sp.hidden_dim = 64, sp.n_layers = 4, sp.n_heads = 4, sp.n_kv_heads = 2;
        sp.vocab_size = 64, sp.n_ctx = 64, sp.type = kvlm_type_from_name("f32"), sp.seed = 5;
        sp.n_expert = cases[i].experts, sp.n_expert_used = cases[i].experts ? 2 : 0, sp.longrope = cases[i].longrope;
        const char *path = tu_tmp_path(".gguf");
        kvlm_error err = {0};
        if (kvlm_model_synth(&sp, path, &err)) fail_msg("synth: %s", err.msg);
        kvlm_model *m = load(path, NULL);
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.n_ctx = 64;
        cp.device = KVLM_DEVICE_CUDA;
        kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
        if (ctx) fail_msg("case %zu: a CUDA context was made", i);
        printf("  %s\n", err.msg);
        assert_int_equal(err.code, KVLM_EUNSUPPORTED);
        if (!strstr(err.msg, cases[i].needle)) fail_msg("case %zu: \"%s\" lacks \"%s\"", i, err.msg, cases[i].needle);
        cp.device = KVLM_DEVICE_CPU; /* and the CPU runs it */
        if (!(ctx = kvlm_ctx_create(m, &cp, &err))) fail_msg("case %zu on the CPU: %s", i, err.msg);
        kvlm_ctx_free(ctx);
        kvlm_model_free(m);
    }
}

static void test_bad_input(void **state) {
    (void)state;
    kvlm_error err = {0};
    assert_null(kvlm_model_load("/nonexistent/model.gguf", NULL, &err));
    assert_int_equal(err.code, KVLM_EIO);
    assert_non_null(strstr(err.msg, "/nonexistent/model.gguf"));
    /* A truncated llama2.c checkpoint. */
    const char *p = tu_model_path("stories260K.bin");
    TU_REQUIRE(p);
    size_t len;
    char *data = tu_read_file(p, &len);
    assert_non_null(data);
    const char *trunc = tu_tmp_path(".bin");
    assert_int_equal(tu_write_file(trunc, data, len / 2), 0);
    free(data);
    err.code = 0;
    assert_null(kvlm_model_load(trunc, NULL, &err));
    assert_int_equal(err.code, KVLM_EFORMAT);
    assert_non_null(strstr(err.msg, "truncated"));
    /* Context overflow and bad token ids are refused without side effects. */
    const char *g = tu_model_path("stories260K.gguf");
    TU_REQUIRE(g);
    kvlm_model *m = load(g, NULL);
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 8;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    int32_t ids[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    kvlm_batch b = {9, ids, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_ERANGE);
    assert_int_equal(kvlm_ctx_n_past(ctx), 0);
    int32_t bad = 512;
    kvlm_batch b2 = {1, &bad, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(ctx, &b2, &err), KVLM_EINVAL);
    kvlm_batch b3 = {8, ids, NULL, NULL, NULL};
    assert_int_equal(kvlm_decode(ctx, &b3, &err), KVLM_OK);
    assert_int_equal(kvlm_ctx_n_past(ctx), 8);
    /* 2 x layers x KV heads x head dim x 2 bytes (f16, the default) x tokens */
    assert_int_equal(kvlm_ctx_kv_bytes(ctx), (size_t)2 * 5 * 4 * 8 * 2 * 8);
    kvlm_ctx_reset(ctx);
    assert_int_equal(kvlm_ctx_kv_bytes(ctx), 0);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

static void test_detok_utf8(void **state) {
    (void)state;
    const char *p = tu_model_path("stories260K.gguf");
    TU_REQUIRE(p);
    kvlm_model *m = load(p, NULL);
    /* An emoji is not in the 512-token vocabulary: it becomes four byte
     * tokens. The first three emit nothing; the fourth completes it. */
    int32_t ids[16];
    kvlm_error err = {0};
    int n = kvlm_tokenize(m, "\xf0\x9f\x98\x80", 4, false, false, ids, 16, &err);
    assert_true(n >= 4);
    kvlm_detok d;
    kvlm_detok_init(&d, m);
    char out[64], all[64] = "";
    for (int i = 0; i < n; i++) {
        kvlm_detok_push(&d, ids[i], out, sizeof out);
        if (i >= n - 4 && i < n - 1) assert_int_equal(strlen(out), 0);
        strcat(all, out);
    }
    assert_non_null(strstr(all, "\xf0\x9f\x98\x80"));
    kvlm_model_free(m);
}

/* One llama2.c header through load and, where it loads, a decode step. The
 * sanitizer build stops at the first undefined behaviour (-fno-sanitize-
 * recover); a refusal must be one clear error. Returns 1 if it loaded. */
static int try_llama2c_header(int fd, const char *path, const char *tok, const int32_t h[7]) {
    if (pwrite(fd, h, 28, 0) != 28) fail_msg("cannot write the header");
    kvlm_error err = {0};
    kvlm_model_params mp = {.tokenizer_path = tok};
    kvlm_model *m = kvlm_model_load(path, &mp, &err);
    if (!m) {
        if ((err.code != KVLM_EFORMAT && err.code != KVLM_EINVAL && err.code != KVLM_ENOMEM) || !err.msg[0])
            fail_msg("header {%d %d %d %d %d %d %d}: code %d, '%s'", h[0], h[1], h[2], h[3], h[4], h[5], h[6], err.code,
                     err.msg);
        return 0;
    }
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 8;
    cp.n_threads = 1;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (ctx) {
        int32_t ids[2] = {1, 300};
        kvlm_batch b = {2, ids, NULL, NULL, NULL};
        if (kvlm_decode(ctx, &b, &err) && !err.msg[0]) fail_msg("decode failed without a message");
        kvlm_ctx_free(ctx);
    } else if (!err.msg[0]) fail_msg("a context was refused without a message");
    kvlm_model_free(m);
    return 1;
}

/* Every field of the llama2.c header through edge values, one at a time and
 * in random combinations, on the real stories260K.bin's weights: each loads
 * (and decodes) or is refused with one clear error, with no undefined
 * behaviour under UBSan for any value. */
static void test_llama2c_header_sweep(void **state) {
    (void)state;
    const char *p = tu_model_path("stories260K.bin");
    TU_REQUIRE(p);
    size_t len;
    char *orig = tu_read_file(p, &len);
    assert_non_null(orig);
    const char *t = tu_model_path("tok512.bin");
    TU_REQUIRE(t);
    char tok[4096];
    snprintf(tok, sizeof tok, "%s", t);
    const char *path = tu_tmp_path(".bin");
    assert_int_equal(tu_write_file(path, orig, len), 0);
    int fd = open(path, O_WRONLY);
    assert_true(fd >= 0);
    int32_t base[7];
    memcpy(base, orig, sizeof base);
    static const int32_t edge[] = {INT32_MIN, INT32_MIN + 1, -65537, -512, -64, -2, -1, 0, 1, 2, 3, 4, 5, 7, 8,
                                   16, 63, 64, 65, 128, 172, 256, 511, 512, 513, 1024, 65535, 65536, 65537,
                                   1 << 20, (1 << 20) + 1, 1 << 22, (1 << 22) + 1, 1 << 30, INT32_MAX - 1, INT32_MAX};
    enum { N_EDGE = sizeof edge / sizeof edge[0] };
    int tried = 0, loaded = 0;
    for (int f = 0; f < 7; f++)
        for (int i = 0; i < N_EDGE; i++) {
            int32_t h[7];
            memcpy(h, base, sizeof h);
            h[f] = edge[i];
            loaded += try_llama2c_header(fd, path, tok, h);
            tried++;
        }
    uint64_t r = 0x9e3779b97f4a7c15ULL;
    int n_random = tu_quick() ? 400 : 3000;
    for (int k = 0; k < n_random; k++) {
        int32_t h[7];
        for (int f = 0; f < 7; f++) {
            r ^= r << 13, r ^= r >> 7, r ^= r << 17;
            /* half the fields keep the real value, so some combinations load */
            h[f] = (r >> 8) & 1 ? base[f] : (r >> 9) & 3 ? edge[(r >> 16) % N_EDGE] : (int32_t)(uint32_t)(r >> 32);
        }
        loaded += try_llama2c_header(fd, path, tok, h);
        tried++;
    }
    close(fd);
    free(orig);
    print_message("    %d llama2.c headers: %d loaded and decoded, %d refused with an error\n", tried, loaded,
                  tried - loaded);
    assert_true(loaded > 0 && loaded < tried);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_gguf),
        cmocka_unit_test(test_golden_llama2c),
        cmocka_unit_test(test_llama2c_header_sweep),
        cmocka_unit_test(test_gguf_equals_llama2c),
        cmocka_unit_test(test_cache_equals_recompute_stories),
        cmocka_unit_test(test_cache_equals_recompute_shapes),
        cmocka_unit_test(test_phi3),
        cmocka_unit_test(test_convert),
        cmocka_unit_test(test_low_bit_weights),
        cmocka_unit_test(test_codebook_weights),
        cmocka_unit_test(test_small_block_weights),
        cmocka_unit_test(test_sampler), cmocka_unit_test(test_sampler_logit_bias),
        cmocka_unit_test(test_sampler_penalties),
        cmocka_unit_test(test_cuda_refusals),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_detok_utf8),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
