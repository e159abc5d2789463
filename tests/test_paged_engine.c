/* tests/test_paged_engine: the forward pass over the paged KV cache: paged
 * equals contiguous, interleaved batches of 8 sequences equal each sequence
 * alone, forks never disturb their parent, prefix reuse equals a cold run
 * while computing only the tokens after the shared blocks, a full pool fails
 * cleanly; batched steps give each sequence the bits it gets alone. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "kvlm.h"
#include "ops/ops_internal.h"

static kvlm_model *synth_ffn(kvlm_arch arch, int dim, int heads, int kv, int hidden, const char *type,
                             uint64_t seed) {
    kvlm_synth_params sp = {0};
    sp.arch = arch;
    sp.dim = dim;
    sp.hidden_dim = hidden;
    sp.n_layers = 2;
    sp.n_heads = heads;
    sp.n_kv_heads = kv;
    sp.vocab_size = 300;
    sp.n_ctx = 512;
    sp.type = kvlm_type_from_name(type);
    sp.seed = seed;
    const char *path = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, path, &err)) fail_msg("synth: %s", err.msg);
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("load: %s", err.msg);
    return m;
}

static kvlm_model *synth(kvlm_arch arch, int dim, int heads, int kv, const char *type, uint64_t seed) {
    return synth_ffn(arch, dim, heads, kv, 2 * dim + 32, type, seed);
}

static kvlm_ctx *make_ctx_typed(kvlm_model *m, int n_seq, int block_size, int n_ctx, int kv_blocks, int threads,
                                int k_type, int v_type) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_threads = threads;
    cp.cache_type_k = k_type;
    cp.cache_type_v = v_type;
    cp.n_ctx = n_ctx;
    cp.n_seq_max = n_seq;
    cp.block_size = block_size;
    cp.kv_blocks = kv_blocks;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) fail_msg("ctx: %s", err.msg);
    return ctx;
}

static kvlm_ctx *make_ctx(kvlm_model *m, int n_seq, int block_size, int n_ctx, int kv_blocks) {
    return make_ctx_typed(m, n_seq, block_size, n_ctx, kv_blocks, 2, KVLM_CACHE_F32, KVLM_CACHE_F32);
}

static void random_ids(int32_t *ids, int n, int vocab, uint64_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        ids[i] = 3 + (int32_t)((seed >> 33) % (uint64_t)(vocab - 3));
    }
    ids[0] = 1;
}

/* Logits after every token of ids, fed in pieces of `step` tokens. */
static float *run_seq(kvlm_ctx *ctx, int seq, const int32_t *ids, int n, int step) {
    int V = 300;
    float *out = malloc(sizeof(float) * (size_t)V * n);
    int8_t want[512];
    int32_t seqs[512];
    memset(want, 1, sizeof want);
    for (int i = 0; i < 512; i++) seqs[i] = seq;
    kvlm_error err = {0};
    for (int i = 0; i < n; i += step) {
        int T = n - i < step ? n - i : step;
        kvlm_batch b = {T, ids + i, NULL, want, seqs};
        if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
        for (int r = 0; r < T; r++) memcpy(out + (size_t)(i + r) * V, kvlm_get_logits(ctx, r), sizeof(float) * V);
    }
    return out;
}

static double max_err(const float *a, const float *b, int n_rows, int V) {
    double worst = 0;
    for (int t = 0; t < n_rows; t++) {
        double scale = 1e-3;
        for (int v = 0; v < V; v++) scale = fmax(scale, fabs(b[(size_t)t * V + v]));
        for (int v = 0; v < V; v++) {
            worst = tu_worse(worst, fabs(a[(size_t)t * V + v] - b[(size_t)t * V + v]) / scale);
        }
    }
    return worst;
}

static void test_paged_equals_contiguous(void **state) {
    (void)state;
    struct { kvlm_arch arch; int dim, heads, kv; const char *type; } shapes[] = {
        {KVLM_ARCH_LLAMA, 64, 8, 8, "f32"}, {KVLM_ARCH_LLAMA, 128, 8, 2, "f32"},
        {KVLM_ARCH_LLAMA, 256, 8, 1, "f32"}, {KVLM_ARCH_QWEN2, 128, 8, 2, "f32"},
        {KVLM_ARCH_LLAMA, 256, 8, 2, "q8_0"},
    };
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        kvlm_model *m = synth(shapes[s].arch, shapes[s].dim, shapes[s].heads, shapes[s].kv, shapes[s].type, 10 + s);
        int n = 70;
        int32_t ids[70];
        random_ids(ids, n, 300, 5 + s);
        kvlm_ctx *contig = make_ctx(m, 1, 256, 256, 0); /* one block per sequence: the contiguous layout */
        kvlm_ctx *paged = make_ctx(m, 1, 16, 256, 0);
        kvlm_ctx *tiny = make_ctx(m, 1, 3, 256, 0);     /* blocks smaller than a prefill chunk */
        float *a = run_seq(contig, 0, ids, n, 1), *b = run_seq(paged, 0, ids, n, 1);
        float *c = run_seq(tiny, 0, ids, n, 1);
        kvlm_ctx_reset(paged);
        float *e = run_seq(paged, 0, ids, n, 23); /* prefill chunks crossing blocks */
        printf("  shape %zu: paged vs contiguous %.2e, 3-token blocks %.2e, chunked prefill %.2e\n", s,
               max_err(b, a, n, 300), max_err(c, a, n, 300), max_err(e, a, n, 300));
        assert_true(max_err(b, a, n, 300) < 1e-5);
        assert_true(max_err(c, a, n, 300) < 1e-5);
        assert_true(max_err(e, a, n, 300) < 1e-4);
        free(a); free(b); free(c); free(e);
        kvlm_ctx_free(contig);
        kvlm_ctx_free(paged);
        kvlm_ctx_free(tiny);
        kvlm_model_free(m);
    }
}

/* Weights repacked at load (CPUs with AVX512-VNNI: every type but the floats, in
 * 16-row groups) give the logits of the same model loaded and run at the
 * AVX2 level, where nothing is packed (the kernels differ in rounding only). */
static void test_packed_weights(void **state) {
    (void)state;
    if (op_cpu_simd_level() < OP_SIMD_VNNI) {
        printf("  SKIP: this CPU has no AVX512-VNNI, nothing is packed\n");
        return;
    }
    const char *types[] = {"q8_0", "q4_0", "q5_0", "q4_1", "q5_1", "q4_K", "q5_K", "q6_K",
                           "q2_K", "q3_K", "iq4_nl", "iq4_xs"};
    enum { N = 40, V = 300 };
    for (int ti = 0; ti < 12; ti++) {
        int32_t ids[N];
        random_ids(ids, N, V, 70 + ti);
        float *logits[2];
        for (int packed = 0; packed < 2; packed++) {
            op_set_simd_level(packed ? -1 : OP_SIMD_AVX2);
            kvlm_model *m = synth_ffn(KVLM_ARCH_LLAMA, 256, 4, 2, 512, types[ti], 60 + ti);
            kvlm_ctx *ctx = make_ctx(m, 1, 16, 256, 0);
            logits[packed] = run_seq(ctx, 0, ids, N, 7); /* prefill pieces of 7 */
            kvlm_ctx_free(ctx);
            kvlm_model_free(m);
        }
        op_set_simd_level(-1);
        double e = max_err(logits[1], logits[0], N, V);
        printf("  %s: packed vs unpacked logits %.2e\n", types[ti], e);
        assert_true(e < 5e-2);
        free(logits[0]);
        free(logits[1]);
    }
}

/* 8 sequences fed in mixed batches (prefill chunks of some, decode tokens of
 * others, in shuffled order) give what each gives alone. */
static void test_interleaved(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_LLAMA, 128, 8, 2, "f32", 3);
    enum { S = 8, N = 40 };
    int32_t ids[S][N];
    float *alone[S];
    kvlm_ctx *solo = make_ctx(m, 1, 16, 256, 0);
    for (int s = 0; s < S; s++) {
        random_ids(ids[s], N, 300, 100 + s);
        kvlm_ctx_reset(solo);
        alone[s] = run_seq(solo, 0, ids[s], N, N);
    }
    kvlm_ctx_free(solo);
    kvlm_ctx *ctx = make_ctx(m, S, 16, 256, 0);
    int fed[S] = {0};
    uint64_t rng = 77;
    double worst = 0;
    kvlm_error err = {0};
    while (1) {
        int32_t toks[128], seqs[128], which[128], where[128];
        int8_t want[128];
        int n = 0;
        for (int s = 0; s < S; s++) {
            rng = rng * 6364136223846793005ULL + 1;
            int take = (int)((rng >> 33) % 6); /* 0..5 tokens of this sequence */
            if (take > N - fed[s]) take = N - fed[s];
            for (int k = 0; k < take; k++) {
                toks[n] = ids[s][fed[s] + k];
                seqs[n] = s;
                which[n] = s;
                where[n] = fed[s] + k;
                want[n] = 1;
                n++;
            }
            fed[s] += take;
        }
        if (n == 0) {
            int done = 1;
            for (int s = 0; s < S; s++) done &= fed[s] == N;
            if (done) break;
            continue;
        }
        kvlm_batch b = {n, toks, NULL, want, seqs};
        if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
        for (int i = 0; i < n; i++)
            worst = tu_worse(worst, max_err(kvlm_get_logits(ctx, i), alone[which[i]] + (size_t)where[i] * 300, 1, 300));
    }
    printf("  8 interleaved sequences vs alone: max error %.2e\n", worst);
    assert_true(worst < 1e-5);
    for (int s = 0; s < S; s++) free(alone[s]);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

/* Batched steps on 3 threads (sequences in shuffled order, prefill pieces of
 * up to 20 tokens next to decode tokens, the per-token work split over the
 * threads) give each sequence the very bits it gets alone on 1 thread, fed in
 * the same pieces: for quantized caches whose rows several tokens of a step
 * write into one block (q4_kc keys: one f16 staging per sequence, quantized
 * when the block fills), biases (Qwen2), GQA and a SwiGLU width that is not a
 * multiple of 8. */
static void test_batched_bits(void **state) {
    (void)state;
    struct { kvlm_arch arch; int dim, heads, kv, hidden; const char *wtype; int k, v, block; } cfg[] = {
        {KVLM_ARCH_LLAMA, 256, 4, 2, 544, "q8_0", KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0, 16},
        {KVLM_ARCH_QWEN2, 256, 4, 2, 544, "q8_0", KVLM_CACHE_Q4_KC, KVLM_CACHE_Q4_0, 8},
        {KVLM_ARCH_LLAMA, 128, 8, 8, 292, "f32", KVLM_CACHE_Q4_KC, KVLM_CACHE_F16, 16},
        {KVLM_ARCH_QWEN2, 128, 8, 2, 292, "f32", KVLM_CACHE_F32, KVLM_CACHE_Q8_0, 16},
        {KVLM_ARCH_LLAMA, 256, 4, 2, 512, "q4_K", KVLM_CACHE_F16, KVLM_CACHE_F16, 16}, /* packed on VNNI CPUs */
        {KVLM_ARCH_QWEN2, 128, 8, 2, 288, "q5_0", KVLM_CACHE_F16, KVLM_CACHE_Q8_0, 16},
    };
    enum { S = 6, N = 48, V = 300 };
    for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
        kvlm_model *m = synth_ffn(cfg[ci].arch, cfg[ci].dim, cfg[ci].heads, cfg[ci].kv, cfg[ci].hidden,
                                  cfg[ci].wtype, 40 + ci);
        int32_t ids[S][N];
        int pieces[S][N], n_pieces[S] = {0}, fed[S] = {0}, order[S];
        float *batched[S];
        for (int s = 0; s < S; s++) {
            random_ids(ids[s], N, V, 200 + 10 * ci + s);
            batched[s] = malloc(sizeof(float) * (size_t)N * V);
            order[s] = s;
        }
        kvlm_ctx *ctx = make_ctx_typed(m, S, cfg[ci].block, 256, 0, 3, cfg[ci].k, cfg[ci].v);
        uint64_t rng = 99 + ci;
        kvlm_error err = {0};
        int steps = 0, widest = 0;
        for (;;) {
            int32_t toks[S * 20], seqs[S * 20], which[S * 20];
            int8_t want[S * 20];
            int n = 0;
            for (int i = S - 1; i > 0; i--) { /* shuffle the sequences' order in the batch */
                rng = rng * 6364136223846793005ULL + 1;
                int k = (int)((rng >> 33) % (uint64_t)(i + 1)), tmp = order[i];
                order[i] = order[k];
                order[k] = tmp;
            }
            for (int i = 0; i < S; i++) {
                int s = order[i];
                rng = rng * 6364136223846793005ULL + 1;
                /* a prefill piece or a few decode tokens (0: idle this step) */
                int take = (int)((rng >> 33) % ((rng >> 62) ? 4 : 21));
                if (take > N - fed[s]) take = N - fed[s];
                if (!take) continue;
                for (int k = 0; k < take; k++) {
                    toks[n] = ids[s][fed[s] + k];
                    seqs[n] = s;
                    which[n] = s;
                    want[n++] = 1;
                }
                pieces[s][n_pieces[s]++] = take;
                fed[s] += take;
            }
            if (!n) {
                int done = 1;
                for (int s = 0; s < S; s++) done &= fed[s] == N;
                if (done) break;
                continue;
            }
            kvlm_batch b = {n, toks, NULL, want, seqs};
            if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
            int at[S];
            for (int s = 0; s < S; s++) at[s] = kvlm_seq_n_past(ctx, s);
            for (int i = n - 1; i >= 0; i--) /* the last token of s sits at n_past - 1 */
                memcpy(batched[which[i]] + (size_t)(--at[which[i]]) * V, kvlm_get_logits(ctx, i), sizeof(float) * V);
            steps++;
            widest = n > widest ? n : widest;
        }
        kvlm_ctx_free(ctx);
        kvlm_ctx *solo = make_ctx_typed(m, 1, cfg[ci].block, 256, 0, 1, cfg[ci].k, cfg[ci].v);
        int differ = 0;
        for (int s = 0; s < S; s++) {
            kvlm_ctx_reset(solo);
            for (int p = 0, at = 0; p < n_pieces[s]; at += pieces[s][p++]) {
                float *alone = run_seq(solo, 0, ids[s] + at, pieces[s][p], pieces[s][p]);
                differ += memcmp(alone, batched[s] + (size_t)at * V, sizeof(float) * V * pieces[s][p]) != 0;
                free(alone);
            }
            free(batched[s]);
        }
        printf("  config %zu: %d batched steps (up to %d tokens) vs each sequence alone: %d pieces differ\n", ci,
               steps, widest, differ);
        assert_int_equal(differ, 0);
        kvlm_ctx_free(solo);
        kvlm_model_free(m);
    }
}

/* A fork shares the parent's blocks; writing to the fork (into a shared,
 * partly filled block) never changes the parent's logits. */
static void test_fork_cow(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_LLAMA, 128, 8, 2, "f32", 4);
    int32_t ids[60], alt[60];
    random_ids(ids, 60, 300, 9);
    random_ids(alt, 60, 300, 10);
    kvlm_ctx *ref = make_ctx(m, 1, 16, 256, 0);
    float *want_parent = run_seq(ref, 0, ids, 60, 60);
    kvlm_ctx_reset(ref);
    memcpy(alt, ids, 37 * sizeof(int32_t));
    float *want_child = run_seq(ref, 0, alt, 60, 60);
    kvlm_ctx_free(ref);

    kvlm_ctx *ctx = make_ctx(m, 2, 16, 256, 0);
    float *p1 = run_seq(ctx, 0, ids, 37, 37); /* 37 tokens: last block partly filled */
    kvlm_error err = {0};
    assert_int_equal(kvlm_seq_fork(ctx, 0, 1, &err), KVLM_OK);
    kvlm_kv_stats st;
    kvlm_kv_stats_get(ctx, &st);
    assert_int_equal(st.shared, 3);
    float *c = run_seq(ctx, 1, alt + 37, 23, 1); /* child writes first */
    float *p2 = run_seq(ctx, 0, ids + 37, 23, 1);
    assert_true(max_err(p2, want_parent + 37 * 300, 23, 300) < 1e-5);
    assert_true(max_err(c, want_child + 37 * 300, 23, 300) < 1e-5);
    assert_true(max_err(p1, want_parent, 37, 300) < 1e-5);
    kvlm_kv_stats_get(ctx, &st);
    assert_int_equal(st.shared, 2); /* the two full blocks stay shared */
    kvlm_seq_free(ctx, 0);
    kvlm_seq_free(ctx, 1);
    kvlm_kv_stats_get(ctx, &st);
    assert_int_equal(st.used, 0);
    free(p1); free(p2); free(c); free(want_parent); free(want_child);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

/* A second request sharing a prefix: identical logits to a cold run, and only
 * the tokens after the shared blocks are computed. */
static void test_prefix_reuse(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_QWEN2, 128, 8, 2, "f32", 6);
    int32_t a[100], b[100];
    random_ids(a, 100, 300, 21);
    memcpy(b, a, sizeof b);
    for (int i = 70; i < 100; i++) b[i] = 3 + (b[i] + 7) % 290; /* shares 70 tokens */
    kvlm_ctx *cold = make_ctx(m, 1, 16, 256, 0);
    float *want = run_seq(cold, 0, b, 100, 100);
    kvlm_ctx_free(cold);

    kvlm_ctx *ctx = make_ctx(m, 2, 16, 256, 0);
    free(run_seq(ctx, 0, a, 100, 100));
    kvlm_seq_free(ctx, 0); /* finished: its full blocks stay cached */
    kvlm_kv_stats st0, st1;
    kvlm_kv_stats_get(ctx, &st0);
    int reused = kvlm_seq_reuse_prefix(ctx, 1, b, 100);
    assert_int_equal(reused, 64); /* 4 full blocks of 16 inside the 70 shared tokens */
    float *got = run_seq(ctx, 1, b + reused, 100 - reused, 100);
    kvlm_kv_stats_get(ctx, &st1);
    assert_int_equal(st1.tokens_computed - st0.tokens_computed, 100 - 64);
    assert_int_equal(st1.prefix_hits - st0.prefix_hits, 4);
    double e = max_err(got, want + (size_t)reused * 300, 100 - reused, 300);
    printf("  prefix reuse: %d of 100 tokens reused, %llu computed, error vs cold %.2e\n", reused,
           (unsigned long long)(st1.tokens_computed - st0.tokens_computed), e);
    assert_true(e == 0.0 || e < 1e-6);
    free(want);
    free(got);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

/* When the pool is full, decode fails with KVLM_EFULL and changes nothing. */
static void test_pool_full(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_LLAMA, 64, 8, 8, "f32", 8);
    kvlm_ctx *ctx = make_ctx(m, 2, 16, 256, 4); /* 4 blocks = 64 tokens in all */
    int32_t ids[80];
    random_ids(ids, 80, 300, 3);
    kvlm_error err = {0};
    int32_t seqs[80] = {0};
    kvlm_batch b = {40, ids, NULL, NULL, seqs};
    assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK); /* 3 blocks */
    int32_t mixed_seq[30];
    for (int i = 0; i < 30; i++) mixed_seq[i] = i < 5 ? 0 : 1;
    kvlm_batch b2 = {30, ids, NULL, NULL, mixed_seq}; /* seq 0 fits, seq 1 needs 2 blocks: only 1 left */
    assert_int_equal(kvlm_decode(ctx, &b2, &err), KVLM_EFULL);
    assert_int_equal(kvlm_seq_n_past(ctx, 0), 40);
    assert_int_equal(kvlm_seq_n_past(ctx, 1), 0);
    kvlm_kv_stats st;
    kvlm_kv_stats_get(ctx, &st);
    assert_int_equal(st.used, 3);
    /* The sequence still works afterwards. */
    kvlm_batch b3 = {5, ids + 40, NULL, NULL, seqs};
    assert_int_equal(kvlm_decode(ctx, &b3, &err), KVLM_OK);
    assert_int_equal(kvlm_seq_n_past(ctx, 0), 45);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_paged_equals_contiguous),
        cmocka_unit_test(test_interleaved),
        cmocka_unit_test(test_batched_bits),
        cmocka_unit_test(test_packed_weights),
        cmocka_unit_test(test_fork_cow),
        cmocka_unit_test(test_prefix_reuse),
        cmocka_unit_test(test_pool_full),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
