/* tests/test_mla: deepseek2's multi-head latent attention and its cache: the
 * latent attention kernel against the reference (every cache type, SIMD
 * level and thread count), decode == prefill == recompute, paged ==
 * contiguous, prefix reuse and fork (copy-on-write) on the latent blocks,
 * quantized caches, bytes per token, sessions (stored blocks), several
 * sequences in one batch and through the scheduler, and bad files refused.
 * The NumPy reference agreement is tests/cli_reference.sh's. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "kvlm.h"
#include "model/gguf.h"
#include "ops/kvtype.h"
#include "ops/ops.h"
#include "ops/ops_internal.h"
#include "util/pool.h"

/* ---- the kernel ------------------------------------------------------------------ */

typedef struct { int H, hd, vd, T, q_pos0, bs; } kcase;

/* A paged latent cache of q_pos0 + T rows (type), queries, and both results. */
static void check_kernel(kcase k, int type, util_pool *p1, util_pool *p4) {
    int n = k.q_pos0 + k.T, nb = (n + k.bs - 1) / k.bs;
    size_t rb = op_kv_row_bytes(type, k.hd);
    uint8_t **blocks = calloc((size_t)nb, sizeof *blocks);
    float *row = malloc((size_t)k.hd * sizeof(float));
    float *q = malloc((size_t)k.T * k.H * k.hd * sizeof(float));
    size_t no = (size_t)k.T * k.H * k.vd;
    float *ref = malloc(no * sizeof(float)), *o1 = malloc(no * sizeof(float)), *o4 = malloc(no * sizeof(float));
    float *os = malloc(no * sizeof(float));
    uint64_t s = 11 + (uint64_t)type * 7 + (uint64_t)k.hd;
    for (int b = 0; b < nb; b++) blocks[b] = calloc((size_t)k.bs, rb);
    for (int p = 0; p < n; p++) {
        tu_fill_random(row, (size_t)k.hd, &s, 1.0f);
        op_kv_quantize_row_ref(type, row, blocks[p / k.bs] + (size_t)(p % k.bs) * rb, k.hd);
    }
    tu_fill_random(q, (size_t)k.T * k.H * k.hd, &s, 1.0f);
    op_attn_args a;
    memset(&a, 0, sizeof a);
    a.T = k.T, a.q_pos0 = k.q_pos0, a.n_heads = k.H, a.n_kv_heads = 1, a.head_dim = k.hd, a.v_dim = k.vd;
    a.scale = 1.0f / sqrtf((float)k.hd);
    a.blocks = (const float *const *)blocks;
    a.block_size = k.bs;
    a.k_type = a.v_type = type;
    a.head_bytes = (size_t)k.bs * rb;
    a.v_bytes = 0; /* values are the keys' first v_dim elements */
    op_attention_ref(ref, q, &a);
    size_t wb = op_attention_mla_work_size(4, k.H, k.hd, n);
    void *work = malloc(wb);
    op_attention_mla(p1, o1, q, &a, work);
    op_attention_mla(p4, o4, q, &a, work);
    /* the same bits on any thread count */
    assert_memory_equal(o1, o4, no * sizeof(float));
    double err = tu_max_rel_diff(o1, ref, (int)no, 0.05);
    /* each SIMD level against the scalar one */
    int best = op_cpu_simd_level();
    op_set_simd_level(OP_SIMD_SCALAR);
    op_attention_mla(p4, os, q, &a, work);
    op_set_simd_level(best);
    double err_s = tu_max_rel_diff(o1, os, (int)no, 0.05), err_sr = tu_max_rel_diff(os, ref, (int)no, 0.05);
    printf("  %-5s H %2d  key %3d value %3d  T %3d after %4d  block %2d: vs ref %.1e, scalar vs ref %.1e, "
           "SIMD vs scalar %.1e\n", kvlm_cache_type_name(type), k.H, k.hd, k.vd, k.T, k.q_pos0, k.bs, err, err_sr,
           err_s);
    assert_true(err < 2e-5);
    assert_true(err_sr < 2e-5);
    assert_true(err_s < 2e-5);
    for (int b = 0; b < nb; b++) free(blocks[b]);
    free(blocks); free(row); free(q); free(ref); free(o1); free(o4); free(os); free(work);
}

static void test_kernel(void **state) {
    (void)state;
    util_pool *p1 = util_pool_create(1), *p4 = util_pool_create(4);
    kcase cases[] = {
        {4, 40, 32, 1, 299, 16},    /* decode, 2 key chunks */
        {8, 80, 64, 1, 700, 16},    /* decode, 3 chunks */
        {4, 80, 64, 37, 250, 7},    /* prefill after a prefix, odd blocks */
        {3, 24, 16, 9, 0, 5},       /* prefill from the start */
        {16, 576, 512, 1, 1030, 16} /* DeepSeek-V2's shape */
    };
    int types[] = {KVLM_CACHE_F32, KVLM_CACHE_F16, KVLM_CACHE_BF16, KVLM_CACHE_Q8_0, KVLM_CACHE_Q4_0};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
            if (tu_quick() && cases[c].hd == 576 && t) continue;
            check_kernel(cases[c], types[t], p1, p4);
        }
    util_pool_free(p1);
    util_pool_free(p4);
}

/* ---- models ---------------------------------------------------------------------- */

typedef struct {
    int q_lora, type, gating, experts; /* experts -1: dense only */
    const char *name;
} dshape;

static const char *synth(dshape d, uint64_t seed) {
    kvlm_synth_params sp = {0};
    sp.arch = KVLM_ARCH_DEEPSEEK2;
    sp.dim = 64, sp.hidden_dim = 96, sp.n_layers = 3, sp.n_heads = 4, sp.head_dim = 24;
    sp.vocab_size = 300, sp.n_ctx = 512, sp.seed = seed;
    sp.type = d.type;
    sp.q_lora_rank = d.q_lora;
    sp.kv_lora_rank = 32, sp.rope_dim = 8;
    sp.n_expert = d.experts;
    sp.expert_gating = d.gating;
    const char *path = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, path, &err)) fail_msg("synth %s: %s", d.name, err.msg);
    return path;
}

static kvlm_model *load(const char *path) {
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("loading %s: %s", path, err.msg);
    return m;
}

typedef struct {
    int cache, block_size, threads, step; /* step: tokens per kvlm_decode call (0: all at once) */
    bool no_cache, naive;
} run_opts;

/* Logits after every token of ids, fed `step` at a time to sequence 0. */
static float *run(kvlm_model *m, const int32_t *ids, int n, run_opts o) {
    kvlm_error err = {0};
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.cache_type_k = cp.cache_type_v = o.cache;
    cp.block_size = o.block_size;
    cp.n_threads = o.threads ? o.threads : 2;
    cp.no_kv_cache = o.no_cache;
    cp.n_ctx = 512;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) fail_msg("ctx: %s", err.msg);
    int V = kvlm_model_config(m)->vocab_size, step = o.step > 0 ? o.step : n;
    float *out = malloc(sizeof(float) * (size_t)V * n);
    int8_t *want = malloc((size_t)n);
    memset(want, 1, (size_t)n);
    for (int i = 0; i < n; i += step) {
        kvlm_batch b = {i + step <= n ? step : n - i, ids + i, NULL, want, NULL};
        if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
        for (int r = 0; r < b.n_tokens; r++) memcpy(out + (size_t)(i + r) * V, kvlm_get_logits(ctx, r), sizeof(float) * V);
    }
    free(want);
    kvlm_ctx_free(ctx);
    return out;
}

/* Worst |a - b| over each row's largest |b| (logits cross zero). */
static double logit_err(const float *a, const float *b, int n, int V) {
    double worst = 0;
    for (int t = 0; t < n; t++) {
        double scale = 1e-3;
        for (int v = 0; v < V; v++) scale = fmax(scale, fabs(b[(size_t)t * V + v]));
        for (int v = 0; v < V; v++) worst = tu_worse(worst, fabs(a[(size_t)t * V + v] - b[(size_t)t * V + v]) / scale);
    }
    return worst;
}

static int argmax_agree(const float *a, const float *b, int n, int V) {
    int agree = 0;
    for (int t = 0; t < n; t++) {
        int ia = 0, ib = 0;
        for (int v = 1; v < V; v++) {
            if (a[(size_t)t * V + v] > a[(size_t)t * V + ia]) ia = v;
            if (b[(size_t)t * V + v] > b[(size_t)t * V + ib]) ib = v;
        }
        agree += ia == ib;
    }
    return agree;
}

static void make_ids(int32_t *ids, int n, uint64_t s) {
    for (int i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        ids[i] = 3 + (int32_t)((s >> 33) % 297);
    }
    ids[0] = 1;
}

static const dshape k_shapes[] = {
    {0, 0, 1, 0, "q_lora off, f32, softmax top-2 of 4 (+1 shared)"},
    {24, 0, 1, 0, "q_lora 24, f32"},
    {0, 8, 1, 0, "q_lora off, q8_0 weights"},
    {24, 8, 2, 6, "q_lora 24, q8_0, sigmoid + bias, 6 experts"},
    {0, 1, 1, -1, "dense only, f16 weights"},
};

/* decode (one token at a time) == prefill == full recompute, and the naive
 * attention (the reference kernel) == the latent kernel, f32 cache */
static void test_cache_equals_recompute(void **state) {
    (void)state;
    int n = 40;
    int32_t ids[40];
    make_ids(ids, n, 5);
    for (size_t i = 0; i < sizeof k_shapes / sizeof k_shapes[0]; i++) {
        kvlm_model *m = load(synth(k_shapes[i], 20 + i));
        int V = kvlm_model_config(m)->vocab_size;
        float *pre = run(m, ids, n, (run_opts){.cache = KVLM_CACHE_F32});
        float *dec = run(m, ids, n, (run_opts){.cache = KVLM_CACHE_F32, .step = 1});
        float *mix = run(m, ids, n, (run_opts){.cache = KVLM_CACHE_F32, .step = 7, .threads = 3});
        float *rec = run(m, ids, n, (run_opts){.cache = KVLM_CACHE_F32, .step = 1, .no_cache = true, .threads = 1});
        double e1 = logit_err(dec, rec, n, V), e2 = logit_err(pre, rec, n, V), e3 = logit_err(mix, rec, n, V);
        printf("  %-48s decode %.1e, prefill %.1e, chunks of 7 %.1e vs recompute\n", k_shapes[i].name, e1, e2, e3);
        assert_true(e1 < 1e-4 && e2 < 1e-4 && e3 < 1e-4);
        free(pre); free(dec); free(mix); free(rec);
        kvlm_model_free(m);
    }
}

/* The block size never changes results beyond float rounding: blocks of 1, 16
 * and one block of the whole context (the contiguous layout). */
static void test_paged_equals_contiguous(void **state) {
    (void)state;
    int n = 300;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    make_ids(ids, n, 9);
    kvlm_model *m = load(synth(k_shapes[1], 31));
    int V = kvlm_model_config(m)->vocab_size;
    float *contig = run(m, ids, n, (run_opts){.cache = KVLM_CACHE_F32, .block_size = 512, .step = 50});
    int sizes[] = {1, 16, 37};
    for (int i = 0; i < 3; i++) {
        float *paged = run(m, ids, n, (run_opts){.cache = KVLM_CACHE_F32, .block_size = sizes[i], .step = 50});
        double e = logit_err(paged, contig, n, V);
        printf("  blocks of %3d tokens vs contiguous: %.1e\n", sizes[i], e);
        assert_true(e < 1e-5);
        free(paged);
    }
    free(contig);
    free(ids);
    kvlm_model_free(m);
}

/* Quantized latent caches against the f32 one: bounded on a dense model; with
 * experts a rounding can flip a routing choice (then a row moves far), so
 * there the next-token choice must mostly agree. */
static void test_quantized_cache(void **state) {
    (void)state;
    int n = 120;
    int32_t ids[120];
    make_ids(ids, n, 13);
    struct { int type; double bound; } t[] = {{KVLM_CACHE_F16, 3e-3}, {KVLM_CACHE_BF16, 3e-2}, {KVLM_CACHE_Q8_0, 6e-2}};
    dshape dense = k_shapes[4], moe = k_shapes[0];
    dense.type = 0;
    kvlm_model *md = load(synth(dense, 41)), *mm = load(synth(moe, 42));
    int V = 300;
    float *fd = run(md, ids, n, (run_opts){.cache = KVLM_CACHE_F32, .step = 30});
    float *fm = run(mm, ids, n, (run_opts){.cache = KVLM_CACHE_F32, .step = 30});
    for (int i = 0; i < 3; i++) {
        float *qd = run(md, ids, n, (run_opts){.cache = t[i].type, .step = 30});
        float *qm = run(mm, ids, n, (run_opts){.cache = t[i].type, .step = 30});
        double e = logit_err(qd, fd, n, V);
        int agree = argmax_agree(qm, fm, n, V);
        printf("  %-5s cache: dense model %.1e (bound %.0e); MoE model next token agrees %d/%d\n",
               kvlm_cache_type_name(t[i].type), e, t[i].bound, agree, n);
        assert_true(e < t[i].bound);
        assert_true(agree >= n * 9 / 10);
        free(qd);
        free(qm);
    }
    free(fd);
    free(fm);
    kvlm_model_free(md);
    kvlm_model_free(mm);
}

/* The cache holds layers x one latent row per token: the pool, the stats and
 * the planner agree on it; MHA of the same model is layers x heads x (key +
 * value length). */
static void test_bytes_per_token(void **state) {
    (void)state;
    kvlm_model *m = load(synth(k_shapes[0], 51));
    const kvlm_config *c = kvlm_model_config(m);
    assert_int_equal(c->kv_lora_rank, 32);
    assert_int_equal(c->rope_dim, 8);
    assert_int_equal(c->head_dim, 24);
    assert_int_equal(c->v_head_dim, 16);
    int types[] = {KVLM_CACHE_F32, KVLM_CACHE_F16, KVLM_CACHE_Q8_0};
    for (int i = 0; i < 3; i++) {
        kvlm_error err = {0};
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.cache_type_k = types[i];
        cp.cache_type_v = KVLM_CACHE_F16; /* ignored: the values are the latent */
        cp.n_ctx = 256;
        kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
        assert_non_null(ctx);
        kvlm_kv_stats st;
        kvlm_kv_stats_get(ctx, &st);
        size_t want = (size_t)c->n_layers * op_kv_row_bytes(types[i], 40);
        kvlm_plan_params pp = {0};
        pp.n_ctx = 256;
        pp.elem_bytes = kvlm_cache_type_elem_bytes(types[i], 40, 16);
        kvlm_plan pl;
        kvlm_plan_memory(m, &pp, &pl);
        size_t mha = (size_t)(c->n_layers * c->n_heads * (24 + 16) * pp.elem_bytes + 0.5);
        printf("  %-5s %zu bytes per token (formula %zu, plan %zu); MHA of the model %zu\n",
               kvlm_cache_type_name(types[i]), st.bytes_per_token, want, pl.bytes_per_token, pl.mha_bytes_per_token);
        assert_int_equal(st.bytes_per_token, want);
        assert_int_equal(st.block_bytes, want * 16);
        assert_int_equal(pl.bytes_per_token, want);
        assert_int_equal(pl.mha_bytes_per_token, mha);
        kvlm_ctx_free(ctx);
    }
    kvlm_model_free(m);
}

/* Logits of `n` tokens continuing sequence seq (from whatever it holds). */
static void feed(kvlm_ctx *ctx, int seq, const int32_t *ids, int n, float *out, int V) {
    kvlm_error err = {0};
    int32_t *sq = malloc(sizeof(int32_t) * (size_t)n);
    int8_t *want = malloc((size_t)n);
    for (int i = 0; i < n; i++) sq[i] = seq, want[i] = 1;
    kvlm_batch b = {n, ids, NULL, want, sq};
    if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
    for (int r = 0; r < n; r++) memcpy(out + (size_t)r * V, kvlm_get_logits(ctx, r), sizeof(float) * V);
    free(sq);
    free(want);
}

/* A second request sharing a prefix attaches the first one's latent blocks
 * (no recompute) and gets the logits of a fresh computation; a fork shares
 * blocks and copies the partly filled one on write; sessions store the
 * latent blocks and load them back. */
static void test_prefix_fork_session(void **state) {
    (void)state;
    kvlm_model *m = load(synth(k_shapes[1], 61));
    int V = 300, n = 30;
    int32_t a[30], b[30];
    make_ids(a, n, 17);
    memcpy(b, a, sizeof b);
    for (int i = 20; i < n; i++) b[i] = 3 + (a[i] + 11) % 290; /* shares 20 tokens: 5 blocks of 4 */
    kvlm_error err = {0};
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.cache_type_k = cp.cache_type_v = KVLM_CACHE_F32;
    cp.n_ctx = 64, cp.n_seq_max = 3, cp.block_size = 4;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(ctx);
    float *la = malloc(sizeof(float) * V * n), *lb = malloc(sizeof(float) * V * n), *fresh = run(m, b, n,
        (run_opts){.cache = KVLM_CACHE_F32, .block_size = 4});
    feed(ctx, 0, a, n, la, V);
    kvlm_seq_free(ctx, 0);
    int got = kvlm_seq_reuse_prefix(ctx, 1, b, n);
    assert_int_equal(got, 20);
    feed(ctx, 1, b + got, n - got, lb, V);
    double e = logit_err(lb, fresh + (size_t)got * V, n - got, V);
    printf("  prefix reuse: %d tokens attached, the rest vs a fresh run %.1e\n", got, e);
    assert_true(e < 1e-5);
    /* fork at 22 tokens (a partly filled block), then the two continue apart */
    kvlm_seq_free(ctx, 1);
    kvlm_ctx_reset(ctx);
    feed(ctx, 0, a, 22, la, V);
    if (kvlm_seq_fork(ctx, 0, 2, &err)) fail_msg("fork: %s", err.msg);
    int nb = 0, shared = 0;
    kvlm_seq_kv_info(ctx, 2, &nb, &shared);
    assert_int_equal(nb, 6);
    assert_int_equal(shared, 6);
    float *x = malloc(sizeof(float) * V * 8), *y = malloc(sizeof(float) * V * 8);
    feed(ctx, 0, a + 22, 8, x, V);
    feed(ctx, 2, b + 22, 8, y, V);
    float *fa = run(m, a, n, (run_opts){.cache = KVLM_CACHE_F32, .block_size = 4});
    int32_t ab[30]; /* what the fork holds: a's first 22 tokens, then b's */
    memcpy(ab, a, sizeof(int32_t) * 22);
    memcpy(ab + 22, b + 22, sizeof(int32_t) * 8);
    float *fab = run(m, ab, n, (run_opts){.cache = KVLM_CACHE_F32, .block_size = 4});
    double ex = logit_err(x, fa + (size_t)22 * V, 8, V), ey = logit_err(y, fab + (size_t)22 * V, 8, V);
    kvlm_seq_kv_info(ctx, 2, &nb, &shared);
    printf("  fork at 22: after both continue, %d of %d blocks shared; vs fresh runs %.1e, %.1e\n", shared, nb, ex, ey);
    assert_int_equal(shared, 5); /* the partly filled sixth was copied on write */
    assert_true(ex < 1e-5 && ey < 1e-5);
    /* a session holds the latent blocks in the stored-block format */
    const char *path = tu_tmp_path(".session");
    if (kvlm_session_save(ctx, 0, path, &err)) fail_msg("session save: %s", err.msg);
    kvlm_ctx_reset(ctx);
    int loaded = kvlm_session_load(ctx, 1, a, n, path, &err);
    printf("  session: %d tokens loaded back\n", loaded);
    assert_int_equal(loaded, 28);
    feed(ctx, 1, a + loaded, n - loaded, lb, V);
    e = logit_err(lb, fa + (size_t)loaded * V, n - loaded, V);
    assert_true(e < 1e-5);
    kvlm_ctx_free(ctx);
    free(la); free(lb); free(fresh); free(x); free(y); free(fa); free(fab);
    kvlm_model_free(m);
}

/* Three sequences in one batch (a prefill chunk and two decodes) equal each
 * alone; then the scheduler runs four greedy requests together and each
 * completion equals greedy decoding of that prompt alone. */
static bool on_event(void *user, const kvlm_sched_event *ev) {
    int32_t *out = user;
    if (ev->finish == KVLM_FINISH_NONE) out[1 + out[0]++] = ev->token;
    return true;
}

static void test_batched_sequences(void **state) {
    (void)state;
    kvlm_model *m = load(synth(k_shapes[3], 71));
    int V = 300;
    kvlm_error err = {0};
    int32_t p[3][20];
    for (int s = 0; s < 3; s++) make_ids(p[s], 20, 100 + s);
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.cache_type_k = cp.cache_type_v = KVLM_CACHE_F32;
    cp.n_ctx = 128, cp.n_seq_max = 4;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(ctx);
    float *scratch = malloc(sizeof(float) * V * 20);
    feed(ctx, 1, p[1], 12, scratch, V);
    feed(ctx, 2, p[2], 15, scratch, V);
    /* seq 0: 10 tokens of prefill; seq 1 and 2: one token each */
    int32_t toks[12], seq[12];
    int8_t want[12];
    for (int i = 0; i < 10; i++) toks[i] = p[0][i], seq[i] = 0, want[i] = 1;
    toks[10] = p[1][12], seq[10] = 1, want[10] = 1;
    toks[11] = p[2][15], seq[11] = 2, want[11] = 1;
    kvlm_batch b = {12, toks, NULL, want, seq};
    if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
    float *f0 = run(m, p[0], 10, (run_opts){.cache = KVLM_CACHE_F32});
    float *f1 = run(m, p[1], 13, (run_opts){.cache = KVLM_CACHE_F32});
    float *f2 = run(m, p[2], 16, (run_opts){.cache = KVLM_CACHE_F32});
    double e = 0;
    for (int i = 0; i < 10; i++) e = fmax(e, logit_err(kvlm_get_logits(ctx, i), f0 + (size_t)i * V, 1, V));
    e = fmax(e, logit_err(kvlm_get_logits(ctx, 10), f1 + (size_t)12 * V, 1, V));
    e = fmax(e, logit_err(kvlm_get_logits(ctx, 11), f2 + (size_t)15 * V, 1, V));
    printf("  a prefill chunk and two decodes in one batch vs each alone: %.1e\n", e);
    assert_true(e < 1e-5);
    kvlm_ctx_reset(ctx);
    /* the scheduler */
    kvlm_sched *s = kvlm_sched_create(ctx, NULL, &err);
    assert_non_null(s);
    int32_t res[4][16] = {{0}};
    kvlm_request_params rp = {0};
    rp.max_tokens = 8;
    rp.logprobs = -1;
    for (int r = 0; r < 4; r++) assert_true(kvlm_sched_submit(s, p[r % 3], 10 + r, &rp, on_event, res[r], &err) > 0);
    int steps = 0;
    while (kvlm_sched_step(s) > 0) assert_true(++steps < 10000);
    kvlm_sched_free(s);
    for (int r = 0; r < 4; r++) {
        /* greedy alone */
        int32_t seqt[32];
        int n = 10 + r;
        memcpy(seqt, p[r % 3], sizeof(int32_t) * (size_t)n);
        for (int g = 0; g < 8; g++) {
            float *l = run(m, seqt, n, (run_opts){.cache = KVLM_CACHE_F32});
            int best = 0;
            for (int v = 1; v < V; v++)
                if (l[(size_t)(n - 1) * V + v] > l[(size_t)(n - 1) * V + best]) best = v;
            free(l);
            seqt[n++] = best;
            if (best == 2) break; /* end of generation */
        }
        int gen = n - 10 - r;
        printf("  scheduler request %d: %d tokens, alone: %d\n", r, res[r][0], gen);
        assert_int_equal(res[r][0], gen);
        assert_memory_equal(res[r] + 1, seqt + 10 + r, sizeof(int32_t) * (size_t)gen);
    }
    kvlm_ctx_free(ctx);
    free(scratch); free(f0); free(f1); free(f2);
    kvlm_model_free(m);
}

/* Eviction on latent rows (window, sinks): kept rows move, their RoPE part
 * turned to the new places. With one layer a token's row depends only on it
 * and its position, so the evicted cache must give what a fresh run over
 * the kept tokens gives. */
static void test_eviction(void **state) {
    (void)state;
    kvlm_synth_params sp = {0};
    sp.arch = KVLM_ARCH_DEEPSEEK2;
    sp.dim = 64, sp.hidden_dim = 96, sp.n_layers = 1, sp.n_heads = 4, sp.head_dim = 24;
    sp.vocab_size = 300, sp.n_ctx = 256, sp.seed = 5, sp.kv_lora_rank = 32, sp.rope_dim = 8;
    const char *path = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, path, &err)) fail_msg("synth: %s", err.msg);
    kvlm_model *m = load(path);
    int n = 150, V = 300;
    int32_t ids[150];
    make_ids(ids, n, 29);
    int types[] = {KVLM_CACHE_F32, KVLM_CACHE_Q8_0, KVLM_CACHE_F16};
    double tols[] = {1e-4, 3e-2, 1e-2};
    for (int t = 0; t < 3; t++)
        for (int pol = KVLM_EVICT_WINDOW; pol <= KVLM_EVICT_SINKS; pol++) {
            kvlm_ctx_params cp = kvlm_ctx_default_params();
            cp.n_threads = 2, cp.n_ctx = 256, cp.block_size = 8, cp.kv_budget = 40, cp.kv_evict = pol;
            cp.cache_type_k = cp.cache_type_v = types[t];
            kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
            if (!ctx) fail_msg("ctx: %s", err.msg);
            int step = pol == KVLM_EVICT_SINKS ? 3 : 1;
            for (int i = 0; i < n; i += step) {
                kvlm_batch b = {n - i < step ? n - i : step, ids + i, NULL, NULL, NULL};
                if (kvlm_decode(ctx, &b, &err)) fail_msg("decode at %d: %s", i, err.msg);
            }
            float got[300];
            memcpy(got, kvlm_get_logits(ctx, -1), sizeof got);
            int n_kept = kvlm_seq_n_past(ctx, 0);
            assert_true(n_kept <= 40 && n_kept >= 32);
            assert_int_equal(n_kept + kvlm_seq_n_evicted(ctx, 0), n);
            /* the kept tokens: the newest, after the first 4 (sinks) */
            int32_t kept[40];
            int sinks = pol == KVLM_EVICT_SINKS ? 4 : 0;
            memcpy(kept, ids, sizeof(int32_t) * (size_t)sinks);
            memcpy(kept + sinks, ids + n - (n_kept - sinks), sizeof(int32_t) * (size_t)(n_kept - sinks));
            float *fresh = run(m, kept, n_kept, (run_opts){.cache = types[t], .block_size = 8});
            double e = logit_err(got, fresh + (size_t)(n_kept - 1) * V, 1, V);
            printf("  %-5s cache, %-6s: %d kept, %ld evicted, vs a fresh run of the kept tokens %.1e\n",
                   kvlm_cache_type_name(types[t]), kvlm_evict_name(pol), n_kept, kvlm_seq_n_evicted(ctx, 0), e);
            assert_true(e < tols[t]);
            free(fresh);
            kvlm_ctx_free(ctx);
        }
    kvlm_model_free(m);
}

/* ---- bad files --------------------------------------------------------------------- */

/* src rewritten as dst: tensor `drop` left out, tensor `shrink` given `rows`
 * rows, a string key set (NULL: none). */
static void rewrite(const char *src, const char *dst, const char *drop, const char *shrink, int64_t rows,
                    const char *key, const char *val, const char *f32key) {
    kvlm_error err = {0};
    gguf_file *f = gguf_open(src, &err);
    if (!f) fail_msg("open %s: %s", src, err.msg);
    gguf_writer *w = gguf_writer_create();
    gguf_writer_copy_kv(w, f, "");
    if (key) gguf_writer_set_str(w, key, val);
    if (f32key) gguf_writer_set_f32(w, f32key, 40.0f);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (drop && !strcmp(t->cname, drop)) continue;
        int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        if (shrink && !strcmp(t->cname, shrink)) ne[t->n_dims - 1] = rows;
        assert_int_equal(gguf_writer_add_tensor(w, t->cname, t->type, t->n_dims, ne, t->data, &err), KVLM_OK);
    }
    if (gguf_writer_write(w, dst, &err)) fail_msg("write %s: %s", dst, err.msg);
    gguf_writer_free(w);
    gguf_close(f);
}

static void test_bad_files(void **state) {
    (void)state;
    char src[4096];
    snprintf(src, sizeof src, "%s", synth(k_shapes[1], 81));
    struct { const char *drop, *shrink; int64_t rows; const char *key, *val, *f32key, *needle; } bad[] = {
        {"blk.1.attn_kv_a_norm.weight", NULL, 0, NULL, NULL, NULL, "missing tensor blk.1.attn_kv_a_norm.weight"},
        {NULL, "blk.0.attn_kv_b.weight", 64, NULL, NULL, NULL, "tensor blk.0.attn_kv_b.weight: shape 32x64, expected 32x128"},
        {NULL, "blk.2.ffn_up_exps.weight", 3, NULL, NULL, NULL, "tensor blk.2.ffn_up_exps.weight: shape 64x48x3, expected 64x48x4"},
        {"blk.1.ffn_gate_inp.weight", NULL, 0, NULL, NULL, NULL, "missing tensor blk.1.ffn_gate_inp.weight"},
        {NULL, NULL, 0, "deepseek2.rope.scaling.type", "linear", "deepseek2.rope.scaling.factor", "RoPE scaling 'linear'"},
        /* yarn needs the original context */
        {NULL, NULL, 0, "deepseek2.rope.scaling.type", "yarn", "deepseek2.rope.scaling.factor",
         "missing key deepseek2.rope.scaling.original_context_length"},
        {NULL, NULL, 0, "deepseek2.attention.key_length_mla", "x", NULL, "key deepseek2.attention.key_length_mla has type"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *dst = tu_tmp_path(".gguf");
        rewrite(src, dst, bad[i].drop, bad[i].shrink, bad[i].rows, bad[i].key, bad[i].val, bad[i].f32key);
        kvlm_error e = {0};
        kvlm_model *m = kvlm_model_load(dst, NULL, &e);
        if (m) fail_msg("accepted a bad deepseek2 file (expected \"%s\")", bad[i].needle);
        printf("  refused: %s\n", e.msg);
        if (!strstr(e.msg, bad[i].needle)) fail_msg("error \"%s\" lacks \"%s\"", e.msg, bad[i].needle);
    }
    /* a context the latent cache cannot serve */
    kvlm_model *m = load(src);
    kvlm_error e = {0};
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 64;
    cp.kv_evict = KVLM_EVICT_H2O;
    cp.kv_budget = 32;
    assert_null(kvlm_ctx_create(m, &cp, &e));
    assert_non_null(strstr(e.msg, "deepseek2"));
    kvlm_model_free(m);
}

/* attn_kv_b split per head into attn_k_b (W_UK^T) and attn_v_b (W_UV), with
 * the keys of llama.cpp's MLA conversion (the row as the "head", the real
 * lengths in *_mla): the same logits; convert writes the split form back. */
static void test_split_kv_b(void **state) {
    (void)state;
    char src[4096], dst[4096];
    snprintf(src, sizeof src, "%s", synth(k_shapes[1], 91));
    snprintf(dst, sizeof dst, "%s", tu_tmp_path(".gguf"));
    int H = 4, nope = 16, V = 16, R = 32;
    kvlm_error err = {0};
    gguf_file *f = gguf_open(src, &err);
    assert_non_null(f);
    gguf_writer *w = gguf_writer_create();
    gguf_writer_copy_kv(w, f, "");
    gguf_writer_set_u32(w, "deepseek2.attention.key_length", 40);
    gguf_writer_set_u32(w, "deepseek2.attention.value_length", 32);
    gguf_writer_set_u32(w, "deepseek2.attention.key_length_mla", 24);
    gguf_writer_set_u32(w, "deepseek2.attention.value_length_mla", 16);
    gguf_writer_set_u32(w, "deepseek2.attention.head_count_kv", 1);
    float *kb[3], *vb[3];
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        int l;
        if (strstr(t->cname, ".attn_kv_b.weight") && sscanf(t->cname, "blk.%d.", &l) == 1) {
            const float *kv = t->data; /* H x (nope + V) rows of R */
            kb[l] = malloc(sizeof(float) * (size_t)H * R * nope);
            vb[l] = malloc(sizeof(float) * (size_t)H * V * R);
            for (int h = 0; h < H; h++)
                for (int r = 0; r < R; r++) {
                    for (int d = 0; d < nope; d++)
                        kb[l][((size_t)h * R + r) * nope + d] = kv[((size_t)h * (nope + V) + d) * R + r];
                    for (int d = 0; d < V; d++)
                        vb[l][((size_t)h * V + d) * R + r] = kv[((size_t)h * (nope + V) + nope + d) * R + r];
                }
            char name[64];
            snprintf(name, sizeof name, "blk.%d.attn_k_b.weight", l);
            if (gguf_writer_add_tensor(w, name, 0, 3, (const int64_t[]){nope, R, H}, kb[l], &err)) fail_msg("%s", err.msg);
            snprintf(name, sizeof name, "blk.%d.attn_v_b.weight", l);
            assert_int_equal(gguf_writer_add_tensor(w, name, 0, 3, (const int64_t[]){R, V, H}, vb[l], &err), 0);
            continue;
        }
        assert_int_equal(gguf_writer_add_tensor(w, t->cname, t->type, t->n_dims, t->ne, t->data, &err), 0);
    }
    if (gguf_writer_write(w, dst, &err)) fail_msg("write: %s", err.msg);
    gguf_writer_free(w);
    gguf_close(f);
    for (int l = 0; l < 3; l++) free(kb[l]), free(vb[l]);
    kvlm_model *a = load(src), *b = load(dst);
    assert_int_equal(kvlm_model_config(b)->head_dim, 24);
    assert_int_equal(kvlm_model_config(b)->v_head_dim, 16);
    int32_t ids[30];
    make_ids(ids, 30, 23);
    float *la = run(a, ids, 30, (run_opts){.cache = KVLM_CACHE_F32, .step = 10});
    float *lb = run(b, ids, 30, (run_opts){.cache = KVLM_CACHE_F32, .step = 10});
    printf("  attn_k_b / attn_v_b against attn_kv_b: %.1e\n", logit_err(lb, la, 30, 300));
    assert_memory_equal(la, lb, sizeof(float) * 30 * 300);
    const char *back = tu_tmp_path(".gguf");
    if (kvlm_model_save_gguf(b, back, -1, &err)) fail_msg("convert: %s", err.msg);
    kvlm_model *c = load(back);
    float *lc = run(c, ids, 30, (run_opts){.cache = KVLM_CACHE_F32, .step = 10});
    assert_memory_equal(la, lc, sizeof(float) * 30 * 300);
    free(la); free(lb); free(lc);
    kvlm_model_free(a); kvlm_model_free(b); kvlm_model_free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kernel),
        cmocka_unit_test(test_cache_equals_recompute),
        cmocka_unit_test(test_paged_equals_contiguous),
        cmocka_unit_test(test_quantized_cache),
        cmocka_unit_test(test_bytes_per_token),
        cmocka_unit_test(test_prefix_fork_session),
        cmocka_unit_test(test_batched_sequences),
        cmocka_unit_test(test_bad_files),
        cmocka_unit_test(test_split_kv_b),
        cmocka_unit_test(test_eviction),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
