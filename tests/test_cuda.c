/* tests/test_cuda: the CUDA backend against the CPU path: logits on
 * stories260K and on random-weight shapes (MHA, GQA, MQA, qwen2 biases, head
 * dims 32 to 256, every weight type the GPU reads and one it converts, every
 * cache type), greedy text identical, the paged cache's prefix reuse and
 * copy-on-write on the GPU, 32 concurrent greedy requests through the
 * scheduler equal to each alone, perplexity within 0.1%. Skips (77) without
 * a GPU or a CUDA build. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "kvlm.h"
#ifdef KVLM_HAVE_CUDA
#include "ops/cuda/cuda.h"
#endif

#define V_SYNTH 300

static double worst_seen;

/* ||a - b|| / ||b|| over n floats (NaN: infinite). */
static double rel_l2(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    double r = sqrt(num / (den > 0 ? den : 1));
    return r == r ? r : INFINITY;
}

static void check_close(const char *what, const float *gpu, const float *cpu, size_t n, double tol) {
    double e = rel_l2(gpu, cpu, n);
    worst_seen = tu_worse(worst_seen, e);
    printf("    %-58s rel err %.2e (tol %.0e)\n", what, e, tol);
    if (!(e <= tol)) fail_msg("%s: GPU logits differ from the CPU's by %.3e (tolerance %.1e)", what, e, tol);
}

static kvlm_ctx *make_ctx(const kvlm_model *m, int device, int n_seq, int n_ctx, int k_type, int v_type) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.device = device;
    cp.n_seq_max = n_seq;
    cp.n_ctx = n_ctx;
    cp.n_threads = 2;
    cp.cache_type_k = k_type;
    cp.cache_type_v = v_type;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) fail_msg("%s context: %s", kvlm_device_name(device), err.msg);
    return ctx;
}

static kvlm_model *synth(kvlm_arch arch, int dim, int heads, int kv, int hidden, const char *type, uint64_t seed) {
    kvlm_synth_params sp = {0};
    sp.arch = arch;
    sp.dim = dim;
    sp.hidden_dim = hidden;
    sp.n_layers = 2;
    sp.n_heads = heads;
    sp.n_kv_heads = kv;
    sp.vocab_size = V_SYNTH;
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

static void random_ids(int32_t *ids, int n, int vocab, uint64_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        ids[i] = 3 + (int32_t)((seed >> 33) % (uint64_t)(vocab - 3));
    }
    ids[0] = 1;
}

/* One batch of n tokens (seq[i], logits for every token) on ctx; copies the
 * n x V logits out. */
static void step(kvlm_ctx *ctx, const int32_t *tok, const int32_t *seq, int n, float *out, int V) {
    int8_t want[128];
    memset(want, 1, sizeof want);
    kvlm_batch b = {n, tok, NULL, want, seq};
    kvlm_error err = {0};
    if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
    for (int i = 0; i < n; i++) memcpy(out + (size_t)i * V, kvlm_get_logits(ctx, i), sizeof(float) * V);
}

/* The same script of batches on both contexts: a 37-token prefill of
 * sequence 0 (the GEMM path), a 5-token one of sequence 1 (the
 * matrix-vector path at T = 5), then mixed steps: one decode token of 0 and
 * 1 beside a prefill chunk of sequence 2, then decode steps of all three. */
static void same_script(const char *what, kvlm_ctx *cpu, kvlm_ctx *gpu, double tol, double tol_mv) {
    int32_t ids[64], seq[64];
    float *a = malloc(sizeof(float) * 64 * V_SYNTH), *b = malloc(sizeof(float) * 64 * V_SYNTH);
    char label[160];
    random_ids(ids, 37, V_SYNTH, 11);
    for (int i = 0; i < 37; i++) seq[i] = 0;
    step(cpu, ids, seq, 37, a, V_SYNTH);
    step(gpu, ids, seq, 37, b, V_SYNTH);
    snprintf(label, sizeof label, "%s: prefill 37", what);
    check_close(label, b, a, (size_t)37 * V_SYNTH, tol);
    random_ids(ids, 5, V_SYNTH, 12);
    for (int i = 0; i < 5; i++) seq[i] = 1;
    step(cpu, ids, seq, 5, a, V_SYNTH);
    step(gpu, ids, seq, 5, b, V_SYNTH);
    snprintf(label, sizeof label, "%s: prefill 5", what);
    check_close(label, b, a, (size_t)5 * V_SYNTH, tol_mv);
    for (int s = 0; s < 4; s++) {
        int n = 0;
        random_ids(ids, 16, V_SYNTH, 100 + s);
        ids[0] = 7;
        seq[n++] = 0;
        seq[n++] = 1;
        for (int k = 0; k < (s == 0 ? 12 : 1); k++) seq[n++] = 2;
        step(cpu, ids, seq, n, a, V_SYNTH);
        step(gpu, ids, seq, n, b, V_SYNTH);
        snprintf(label, sizeof label, "%s: mixed step %d (%d tokens)", what, s, n);
        check_close(label, b, a, (size_t)n * V_SYNTH, tol);
    }
    free(a);
    free(b);
}

typedef struct {
    kvlm_arch arch;
    int dim, heads, kv, hidden;
    const char *type;
    double tol;
    const char *what;
} shape;

static void test_shapes(void **state) {
    (void)state;
    /* the CPU quantizes activations to 8 bits for quantized weights; the GPU
     * does too in its Q8_0 and Q4_0 matrix-vector kernels (dp4a), so the 5
     * tokens of a fresh sequence (T = 5: matrix-vector) agree to float
     * rounding there; elsewhere it keeps them in f32 (matrix-vector of the
     * K-quants) or f16 (GEMM: the 37- and 14-token steps, whose cache the
     * later steps read), which differ by more */
    const shape shapes[] = {
        {KVLM_ARCH_LLAMA, 128, 2, 2, 288, "f32", 1e-4, "MHA hd 64 f32"},
        {KVLM_ARCH_LLAMA, 128, 2, 2, 288, "f16", 5e-3, "MHA hd 64 f16"},
        {KVLM_ARCH_LLAMA, 128, 2, 2, 288, "bf16", 5e-3, "MHA hd 64 bf16"},
        {KVLM_ARCH_LLAMA, 256, 8, 2, 544, "q8_0", 3e-2, "GQA 8/2 hd 32 q8_0"},
        {KVLM_ARCH_LLAMA, 256, 4, 1, 544, "q4_0", 4e-2, "MQA 4/1 hd 64 q4_0"},
        {KVLM_ARCH_LLAMA, 256, 2, 2, 512, "q4_k", 4e-2, "MHA hd 128 q4_K"},
        {KVLM_ARCH_LLAMA, 256, 8, 4, 512, "q6_k", 4e-2, "GQA 8/4 hd 32 q6_K"},
        {KVLM_ARCH_LLAMA, 512, 2, 1, 768, "q8_0", 3e-2, "MQA hd 256 q8_0"},
        {KVLM_ARCH_QWEN2, 256, 4, 2, 544, "f16", 5e-3, "qwen2 biases GQA 4/2 hd 64 f16"},
        {KVLM_ARCH_LLAMA, 256, 16, 1, 544, "f32", 1e-4, "16 query heads per KV head f32"},
        {KVLM_ARCH_LLAMA, 256, 4, 2, 544, "q5_0", 4e-2, "q5_0 (converted to f16 on the GPU)"},
        /* fused QKV and gate-up tensors, loaded as row views of one matrix */
        {KVLM_ARCH_PHI3, 256, 8, 2, 544, "f16", 5e-3, "phi3 GQA 8/2 hd 32 f16"},
        {KVLM_ARCH_PHI3, 256, 4, 2, 544, "q8_0", 3e-2, "phi3 GQA 4/2 hd 64 q8_0"},
    };
    int n = sizeof shapes / sizeof shapes[0];
    if (tu_quick()) n = 4;
    for (int i = 0; i < n; i++) {
        const shape *s = &shapes[i];
        kvlm_model *m = synth(s->arch, s->dim, s->heads, s->kv, s->hidden, s->type, 1000 + (uint64_t)i);
        kvlm_ctx *cpu = make_ctx(m, KVLM_DEVICE_CPU, 4, 256, KVLM_CACHE_F32, KVLM_CACHE_F32);
        kvlm_ctx *gpu = make_ctx(m, KVLM_DEVICE_CUDA, 4, 256, KVLM_CACHE_F32, KVLM_CACHE_F32);
        bool dp4a = !strcmp(s->type, "q8_0") || !strcmp(s->type, "q4_0");
        same_script(s->what, cpu, gpu, s->tol, dp4a ? 1e-4 : s->tol);
        kvlm_ctx_free(cpu);
        kvlm_ctx_free(gpu);
        kvlm_model_free(m);
    }
}

static void test_cache_types(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_LLAMA, 256, 8, 2, 544, "f32", 77);
    const int types[][2] = {{KVLM_CACHE_F16, KVLM_CACHE_F16}, {KVLM_CACHE_BF16, KVLM_CACHE_BF16},
                            {KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0}, {KVLM_CACHE_Q4_0, KVLM_CACHE_Q4_0},
                            {KVLM_CACHE_Q8_0, KVLM_CACHE_F16}};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        kvlm_ctx *cpu = make_ctx(m, KVLM_DEVICE_CPU, 4, 256, types[i][0], types[i][1]);
        kvlm_ctx *gpu = make_ctx(m, KVLM_DEVICE_CUDA, 4, 256, types[i][0], types[i][1]);
        char what[64];
        snprintf(what, sizeof what, "cache K %s V %s", kvlm_cache_type_name(types[i][0]),
                 kvlm_cache_type_name(types[i][1]));
        /* the CPU's q8_0/q4_0 keys meet an int8-rounded query; the GPU's a float one */
        { double t = types[i][0] == KVLM_CACHE_Q4_0 ? 3e-2 : 1e-2; same_script(what, cpu, gpu, t, t); }
        kvlm_ctx_free(cpu);
        kvlm_ctx_free(gpu);
    }
    kvlm_model_free(m);
}

/* Prefix reuse and copy-on-write with the blocks in GPU memory: a reused
 * prefix and a forked sequence give the CPU's logits for the same history. */
static void test_prefix_and_fork(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_LLAMA, 256, 8, 2, 544, "f32", 5);
    kvlm_ctx *cpu = make_ctx(m, KVLM_DEVICE_CPU, 4, 256, KVLM_CACHE_F16, KVLM_CACHE_F16);
    kvlm_ctx *gpu = make_ctx(m, KVLM_DEVICE_CUDA, 4, 256, KVLM_CACHE_F16, KVLM_CACHE_F16);
    int32_t ids[60], seq[60];
    float *a = malloc(sizeof(float) * 60 * V_SYNTH), *b = malloc(sizeof(float) * 60 * V_SYNTH);
    random_ids(ids, 60, V_SYNTH, 3);
    for (int i = 0; i < 60; i++) seq[i] = 0;
    step(gpu, ids, seq, 40, b, V_SYNTH);
    kvlm_seq_free(gpu, 0);
    /* the prompt again on sequence 1: its first 32 tokens come from the index */
    int got = kvlm_seq_reuse_prefix(gpu, 1, ids, 40);
    assert_int_equal(got, 32);
    for (int i = 0; i < 60; i++) seq[i] = 1;
    step(gpu, ids + 32, seq, 8, b, V_SYNTH);
    for (int i = 0; i < 60; i++) seq[i] = 0;
    step(cpu, ids, seq, 40, a, V_SYNTH);
    check_close("prefix reuse: tokens 32..39 after 32 reused", b, a + (size_t)32 * V_SYNTH, (size_t)8 * V_SYNTH, 1e-2);
    /* fork mid-block (40 tokens: block 2 half full), then different tokens */
    kvlm_error err = {0};
    if (kvlm_seq_fork(gpu, 1, 2, &err) || kvlm_seq_fork(cpu, 0, 2, &err)) fail_msg("fork: %s", err.msg);
    int32_t t1[2] = {50, 60}, s1[2] = {1, 2};
    int32_t t0[2] = {50, 60}, s0[2] = {0, 2};
    step(gpu, t1, s1, 2, b, V_SYNTH);
    step(cpu, t0, s0, 2, a, V_SYNTH);
    check_close("fork: parent and child after copy-on-write", b, a, (size_t)2 * V_SYNTH, 1e-2);
    int nb, shared;
    kvlm_seq_kv_info(gpu, 2, &nb, &shared);
    assert_int_equal(nb, 3);
    assert_int_equal(shared, 2); /* the two full blocks; the third was copied */
    free(a);
    free(b);
    kvlm_ctx_free(cpu);
    kvlm_ctx_free(gpu);
    kvlm_model_free(m);
}

static kvlm_model *load_real(const char *name) {
    const char *path = tu_model_path(name);
    if (!path) return NULL;
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("%s: %s", name, err.msg);
    return m;
}

/* Greedy decoding of stories260K: the same text, logits close at every step. */
static void test_stories_greedy(void **state) {
    (void)state;
    kvlm_model *m = load_real("stories260K.gguf");
    TU_REQUIRE(m);
    int V = kvlm_vocab_size(m);
    kvlm_ctx *cpu = make_ctx(m, KVLM_DEVICE_CPU, 1, 512, KVLM_CACHE_F16, KVLM_CACHE_F16);
    kvlm_ctx *gpu = make_ctx(m, KVLM_DEVICE_CUDA, 1, 512, KVLM_CACHE_F16, KVLM_CACHE_F16);
    int32_t toks[512];
    kvlm_error err = {0};
    const char *prompt = "Once upon a time";
    int n = kvlm_tokenize(m, prompt, strlen(prompt), true, false, toks, 512, &err);
    assert_true(n > 0);
    kvlm_batch b = {n, toks, NULL, NULL, NULL};
    if (kvlm_decode(cpu, &b, &err) || kvlm_decode(gpu, &b, &err)) fail_msg("prefill: %s", err.msg);
    char text[4096] = "";
    size_t tl = 0;
    double worst = 0;
    for (int i = 0; i < 120; i++) {
        const float *lc = kvlm_get_logits(cpu, -1), *lg = kvlm_get_logits(gpu, -1);
        worst = tu_worse(worst, rel_l2(lg, lc, (size_t)V));
        int32_t tc = 0, tg = 0;
        for (int v = 1; v < V; v++) {
            if (lc[v] > lc[tc]) tc = v;
            if (lg[v] > lg[tg]) tg = v;
        }
        if (tc != tg) fail_msg("greedy step %d: CPU picks %d, GPU %d", i, tc, tg);
        tl += (size_t)kvlm_token_to_text(m, tc, text + tl, sizeof text - tl - 1);
        text[tl] = 0;
        kvlm_batch one = {1, &tc, NULL, NULL, NULL};
        if (kvlm_decode(cpu, &one, &err) || kvlm_decode(gpu, &one, &err)) fail_msg("decode: %s", err.msg);
    }
    printf("    stories260K greedy, 120 tokens identical, worst step rel err %.2e:\n    %s%.120s...\n", worst,
           prompt, text);
    assert_true(worst < 1e-3);
    assert_non_null(strstr(text, "there was a little girl named Lily"));
    kvlm_ctx_free(cpu);
    kvlm_ctx_free(gpu);
    kvlm_model_free(m);
}

typedef struct {
    int32_t toks[64];
    int n;
    bool done;
} answer;

static bool collect(void *user, const kvlm_sched_event *ev) {
    answer *a = user;
    if (ev->finish != KVLM_FINISH_NONE) a->done = true;
    else if (a->n < 64) a->toks[a->n++] = ev->token;
    return true;
}

/* 32 concurrent greedy requests through the scheduler on the GPU, each equal
 * to the same request alone. */
static void test_sched_32(void **state) {
    (void)state;
    kvlm_model *m = load_real("stories4M_hd64.gguf");
    TU_REQUIRE(m);
    kvlm_ctx *gpu = make_ctx(m, KVLM_DEVICE_CUDA, 32, 512, KVLM_CACHE_F16, KVLM_CACHE_F16);
    kvlm_error err = {0};
    kvlm_sched *s = kvlm_sched_create(gpu, NULL, &err);
    if (!s) fail_msg("sched: %s", err.msg);
    enum { N = 32, GEN = 40 };
    static answer together[N], alone[N];
    int32_t prompts[N][48];
    int lens[N];
    kvlm_request_params rp = {0};
    rp.sampling = kvlm_sampler_default_params();
    rp.sampling.temperature = 0;
    rp.max_tokens = GEN;
    rp.logprobs = -1;
    for (int i = 0; i < N; i++) {
        lens[i] = 8 + (i * 7) % 40;
        random_ids(prompts[i], lens[i], kvlm_vocab_size(m), 900 + (uint64_t)i);
        memset(&together[i], 0, sizeof together[i]);
        if (!kvlm_sched_submit(s, prompts[i], lens[i], &rp, collect, &together[i], &err)) fail_msg("%s", err.msg);
    }
    while (kvlm_sched_step(s) > 0) {}
    for (int i = 0; i < N; i++) {
        memset(&alone[i], 0, sizeof alone[i]);
        if (!kvlm_sched_submit(s, prompts[i], lens[i], &rp, collect, &alone[i], &err)) fail_msg("%s", err.msg);
        while (kvlm_sched_step(s) > 0) {}
        assert_true(together[i].done && alone[i].done);
        assert_int_equal(together[i].n, alone[i].n);
        if (memcmp(together[i].toks, alone[i].toks, sizeof(int32_t) * (size_t)alone[i].n))
            fail_msg("request %d: batched answer differs from the answer alone", i);
    }
    printf("    32 concurrent greedy requests on the GPU equal each alone (%d tokens each)\n", GEN);
    kvlm_sched_free(s);
    kvlm_ctx_free(gpu);
    kvlm_model_free(m);
}

#ifdef KVLM_HAVE_CUDA
/* The attention kernel alone against a plain reference in double: one to
 * three sequences of many lengths (one tile, exactly a tile, several tiles,
 * split across thread blocks), f16 cache in scattered blocks. */
static void attn_case(cu_dev *d, int n_keys, int B, int H, int KVH, int HD, bool one_seq) {
    const int BS = 16, nb = (n_keys + BS - 1) / BS + 1;
    size_t row = (size_t)HD * 2, region = (size_t)BS * row, head = 2 * region, block = (size_t)KVH * head;
    size_t pool_bytes = (size_t)nb * (one_seq ? 1 : B) * block;
    uint16_t *pool = malloc(pool_bytes);
    float *q = malloc(sizeof(float) * (size_t)B * H * HD), *out = malloc(sizeof(float) * (size_t)B * H * HD);
    int32_t *meta = malloc(sizeof(int32_t) * (2 * (size_t)B + (size_t)nb * B));
    uint64_t st = 42 + (uint64_t)n_keys;
    for (size_t i = 0; i < pool_bytes / 2; i++) {
        st = st * 6364136223846793005ULL + 1442695040888963407ULL;
        float f = (float)((st >> 40) & 0xffff) / 32768.0f - 1.0f;
        uint32_t u;
        memcpy(&u, &f, 4);
        pool[i] = (uint16_t)(((u >> 16) & 0x8000) | ((((u >> 23) & 0xff) - 112) << 10) | ((u >> 13) & 0x3ff));
        if (f == 0 || fabsf(f) < 1e-4f) pool[i] = 0;
    }
    tu_fill_random(q, (size_t)B * H * HD, &st, 1.0f);
    int32_t *pos = meta, *at = meta + B, *tab = meta + 2 * B;
    for (int s = 0; s < B; s++) {
        if (one_seq) /* a prompt's chunk: B tokens of one sequence, the last at n_keys - 1 */
            pos[s] = n_keys - B + s > 0 ? n_keys - B + s : 0;
        else
            pos[s] = n_keys - 1 - s * 7 > 0 ? n_keys - 1 - s * 7 : 0;
        at[s] = one_seq ? 0 : s * nb;
        for (int i = 0; i < nb; i++) tab[s * nb + i] = s * nb + (i * 5 + 3) % nb;
    }
    void *dpool = cu_alloc(d, pool_bytes), *dq = cu_alloc(d, sizeof(float) * (size_t)B * H * HD),
         *dout = cu_alloc(d, sizeof(float) * (size_t)B * H * HD), *dm = cu_alloc(d, sizeof(int32_t) * (2 * (size_t)B + (size_t)nb * B)),
         *work = cu_alloc(d, cu_attention_work_bytes(B, H, KVH, HD));
    assert_true(dpool && dq && dout && dm && work);
    cu_h2d(d, dpool, pool, pool_bytes);
    cu_h2d(d, dq, q, sizeof(float) * (size_t)B * H * HD);
    cu_h2d(d, dm, meta, sizeof(int32_t) * (2 * (size_t)B + (size_t)nb * B));
    cu_kv kv = {dpool, block, head, region, KVLM_CACHE_F16, KVLM_CACHE_F16, BS, HD, KVH};
    int max_pos = 0;
    for (int s = 0; s < B; s++) max_pos = pos[s] > max_pos ? pos[s] : max_pos;
    cu_kv_batch b = {(int32_t *)dm, (int32_t *)dm + B, (int32_t *)dm + 2 * B, B, max_pos, one_seq ? 64 : 1};
    cu_attention(d, dout, dq, &kv, 0, &b, H, 1.0f / sqrtf((float)HD), work);
    kvlm_error err = {0};
    if (cu_sync(d, &err)) fail_msg("%s", err.msg);
    cu_d2h(d, out, dout, sizeof(float) * (size_t)B * H * HD);
    double worst = 0;
    double *sc = malloc(sizeof(double) * (size_t)n_keys), *o = malloc(sizeof(double) * (size_t)HD);
    for (int s = 0; s < B; s++)
        for (int h = 0; h < H; h++) {
            int kh = h / (H / KVH);
            const float *qq = q + ((size_t)s * H + h) * HD;
            double mx = -1e300, sum = 0;
            for (int k = 0; k <= pos[s]; k++) {
                const uint16_t *kr = pool + ((size_t)tab[at[s] + k / BS] * block + (size_t)kh * head + (size_t)(k % BS) * row) / 2;
                double dot = 0;
                for (int i = 0; i < HD; i++) {
                    uint16_t hb = kr[i];
                    uint32_t u = hb ? ((uint32_t)(hb & 0x8000) << 16) | ((((hb >> 10) & 31) + 112u) << 23) | ((uint32_t)(hb & 0x3ff) << 13) : 0;
                    float kf;
                    memcpy(&kf, &u, 4);
                    dot += (double)qq[i] * kf;
                }
                sc[k] = dot / sqrt((double)HD);
                if (sc[k] > mx) mx = sc[k];
            }
            for (int i = 0; i < HD; i++) o[i] = 0;
            for (int k = 0; k <= pos[s]; k++) {
                double p = exp(sc[k] - mx);
                sum += p;
                const uint16_t *vr = pool + ((size_t)tab[at[s] + k / BS] * block + (size_t)kh * head + region + (size_t)(k % BS) * row) / 2;
                for (int i = 0; i < HD; i++) {
                    uint16_t hb = vr[i];
                    uint32_t u = hb ? ((uint32_t)(hb & 0x8000) << 16) | ((((hb >> 10) & 31) + 112u) << 23) | ((uint32_t)(hb & 0x3ff) << 13) : 0;
                    float vf;
                    memcpy(&vf, &u, 4);
                    o[i] += p * vf;
                }
            }
            for (int i = 0; i < HD; i++) {
                double ref = o[i] / sum, e = fabs(out[((size_t)s * H + h) * HD + i] - ref);
                worst = tu_worse(worst, e);
            }
        }
    printf("    attention kernel: %5d keys, %2d %s, %2d/%d heads, hd %3d: max abs err %.2e\n", n_keys, B,
           one_seq ? "tokens of one seq" : "seqs", H, KVH, HD, worst);
    if (!(worst < 1e-4)) fail_msg("attention kernel: %d keys: error %.3e", n_keys, worst);
    cu_free(d, dpool), cu_free(d, dq), cu_free(d, dout), cu_free(d, dm), cu_free(d, work);
    free(pool), free(q), free(out), free(meta), free(sc), free(o);
}

static void test_attention_kernel(void **state) {
    (void)state;
    kvlm_error err = {0};
    cu_dev *d = cu_open(0, &err);
    if (!d) fail_msg("%s", err.msg);
    const int lens[] = {1, 37, 128, 129, 300, 1000, 5000};
    /* the tensor-core kernel (f16, head_dim 64 and 128), then the vector one */
    for (int mma = 1; mma >= 0; mma--) {
        cu_set_attention_mma(d, mma);
        printf("    %s kernel:\n", mma ? "tensor-core" : "vector");
        for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
            attn_case(d, lens[i], 1, 32, 4, 64, false);
            attn_case(d, lens[i], 3, 4, 2, 64, false);
            attn_case(d, lens[i], 2, 8, 8, 128, false);
        }
        /* runs of one sequence: R tokens a block (16 / G), partial last blocks */
        attn_case(d, 300, 37, 32, 4, 64, true);
        attn_case(d, 1000, 130, 8, 8, 128, true);
        attn_case(d, 200, 64, 4, 4, 64, true);
        attn_case(d, 129, 20, 16, 1, 64, true);
        attn_case(d, 600, 9, 12, 4, 128, true);
        attn_case(d, 77, 5, 4, 2, 64, true);
    }
    attn_case(d, 700, 2, 4, 1, 256, false);
    attn_case(d, 300, 2, 8, 4, 8, false);
    cu_close(d);
}
#endif

/* A 300-token prompt in one batch (GEMM products, attention over several
 * tiles of keys), then decode steps: GPU logits equal the CPU's. */
static void test_long_prompt(void **state) {
    (void)state;
    kvlm_model *m = load_real("stories4M_hd64.gguf");
    TU_REQUIRE(m);
    int V = kvlm_vocab_size(m);
    kvlm_ctx *cpu = make_ctx(m, KVLM_DEVICE_CPU, 1, 512, KVLM_CACHE_F16, KVLM_CACHE_F16);
    kvlm_ctx *gpu = make_ctx(m, KVLM_DEVICE_CUDA, 1, 512, KVLM_CACHE_F16, KVLM_CACHE_F16);
    int32_t ids[320], seq[320];
    int8_t want[320];
    random_ids(ids, 320, V, 17);
    memset(seq, 0, sizeof seq);
    memset(want, 1, sizeof want);
    float *a = malloc(sizeof(float) * 300 * (size_t)V), *b = malloc(sizeof(float) * 300 * (size_t)V);
    kvlm_error err = {0};
    kvlm_batch bt = {300, ids, NULL, want, seq};
    if (kvlm_decode(cpu, &bt, &err)) fail_msg("%s", err.msg);
    for (int i = 0; i < 300; i++) memcpy(a + (size_t)i * V, kvlm_get_logits(cpu, i), sizeof(float) * V);
    if (kvlm_decode(gpu, &bt, &err)) fail_msg("%s", err.msg);
    for (int i = 0; i < 300; i++) memcpy(b + (size_t)i * V, kvlm_get_logits(gpu, i), sizeof(float) * V);
    check_close("300-token prompt, tokens 0..127", b, a, (size_t)128 * V, 1e-3);
    check_close("300-token prompt, tokens 128..299", b + (size_t)128 * V, a + (size_t)128 * V, (size_t)172 * V, 1e-3);
    for (int i = 0; i < 20; i++) {
        kvlm_batch one = {1, ids + 300 + i, NULL, NULL, NULL};
        if (kvlm_decode(cpu, &one, &err) || kvlm_decode(gpu, &one, &err)) fail_msg("%s", err.msg);
        if (rel_l2(kvlm_get_logits(gpu, -1), kvlm_get_logits(cpu, -1), (size_t)V) > 1e-3)
            fail_msg("decode step %d after 300 tokens: GPU logits differ", i);
    }
    printf("    20 decode steps after 300 tokens: logits close\n");
    free(a);
    free(b);
    kvlm_ctx_free(cpu);
    kvlm_ctx_free(gpu);
    kvlm_model_free(m);
}

/* Preemption by swap with the blocks in GPU memory: 8 requests in a pool of
 * 12 blocks force preemptions; the victims' blocks go to host memory and come
 * back, and every answer equals the same request alone. */
static void test_swap_gpu(void **state) {
    (void)state;
    kvlm_model *m = load_real("stories4M_hd64.gguf");
    TU_REQUIRE(m);
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.device = KVLM_DEVICE_CUDA;
    cp.n_ctx = 256;
    cp.n_seq_max = 8;
    cp.kv_blocks = 12;
    kvlm_error err = {0};
    kvlm_ctx *gpu = kvlm_ctx_create(m, &cp, &err);
    if (!gpu) fail_msg("%s", err.msg);
    kvlm_sched *s = kvlm_sched_create(gpu, NULL, &err);
    if (!s) fail_msg("%s", err.msg);
    enum { N = 8, GEN = 48 };
    static answer together[N], alone[N];
    int32_t prompts[N][24];
    kvlm_request_params rp = {0};
    rp.sampling = kvlm_sampler_default_params();
    rp.sampling.temperature = 0;
    rp.max_tokens = GEN;
    rp.logprobs = -1;
    for (int i = 0; i < N; i++) {
        random_ids(prompts[i], 20, kvlm_vocab_size(m), 700 + (uint64_t)i);
        memset(&together[i], 0, sizeof together[i]);
        if (!kvlm_sched_submit(s, prompts[i], 20, &rp, collect, &together[i], &err)) fail_msg("%s", err.msg);
    }
    while (kvlm_sched_step(s) > 0) {}
    kvlm_sched_stats st;
    kvlm_sched_stats_get(s, &st);
    for (int i = 0; i < N; i++) {
        memset(&alone[i], 0, sizeof alone[i]);
        if (!kvlm_sched_submit(s, prompts[i], 20, &rp, collect, &alone[i], &err)) fail_msg("%s", err.msg);
        while (kvlm_sched_step(s) > 0) {}
        assert_int_equal(together[i].n, alone[i].n);
        if (memcmp(together[i].toks, alone[i].toks, sizeof(int32_t) * (size_t)alone[i].n))
            fail_msg("request %d: answer after preemption differs from the answer alone", i);
    }
    printf("    swap on the GPU: %llu preemptions, %llu swapped out, %llu in, %llu recomputed, %llu bytes; answers equal\n",
           (unsigned long long)st.preemptions, (unsigned long long)st.swaps_out, (unsigned long long)st.swaps_in,
           (unsigned long long)st.recomputes, (unsigned long long)st.swap_bytes);
    assert_true(st.swaps_out > 0 && st.swaps_in > 0);
    kvlm_sched_free(s);
    kvlm_ctx_free(gpu);
    kvlm_model_free(m);
}

/* The host tier under the GPU: a pool of 8 blocks in GPU memory; prompt B
 * pushes prompt A's cached blocks out of it into host memory (read back from
 * the device), and A again finds them there (written back to the device):
 * 96 of its 100 tokens are cached again (the first block may still be in the
 * pool) and the logits equal a cold CPU run. */
static void test_host_tier(void **state) {
    (void)state;
    kvlm_model *m = load_real("stories4M_hd64.gguf");
    TU_REQUIRE(m);
    int V = kvlm_vocab_size(m);
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.device = KVLM_DEVICE_CUDA;
    cp.n_ctx = 128;
    cp.kv_blocks = 8;
    cp.kv_host_size = 64u << 20;
    kvlm_error err = {0};
    kvlm_ctx *gpu = kvlm_ctx_create(m, &cp, &err);
    if (!gpu) fail_msg("%s", err.msg);
    kvlm_ctx *cpu = make_ctx(m, KVLM_DEVICE_CPU, 1, 128, KVLM_CACHE_F16, KVLM_CACHE_F16);
    int32_t a[100], b[100];
    random_ids(a, 100, V, 31);
    random_ids(b, 100, V, 32);
    kvlm_batch ba = {100, a, NULL, NULL, NULL}, bb = {100, b, NULL, NULL, NULL};
    if (kvlm_decode(gpu, &ba, &err)) fail_msg("%s", err.msg);
    kvlm_seq_free(gpu, 0);
    if (kvlm_decode(gpu, &bb, &err)) fail_msg("%s", err.msg);
    kvlm_seq_free(gpu, 0);
    int got = kvlm_seq_reuse_prefix(gpu, 0, a, 100);
    assert_int_equal(got, 96);
    kvlm_batch rest = {4, a + 96, NULL, NULL, NULL};
    if (kvlm_decode(gpu, &rest, &err) || kvlm_decode(cpu, &ba, &err)) fail_msg("%s", err.msg);
    check_close("host tier: prompt A after its blocks came back from host memory", kvlm_get_logits(gpu, -1),
                kvlm_get_logits(cpu, -1), (size_t)V, 1e-3);
    kvlm_kv_tier_stats ts[KVLM_MAX_KV_TIERS];
    int nt = kvlm_kv_tier_stats_get(gpu, ts, KVLM_MAX_KV_TIERS);
    assert_true(nt >= 1);
    printf("    host tier under the GPU: %llu blocks demoted, %llu promoted\n", (unsigned long long)ts[0].demoted,
           (unsigned long long)ts[0].promoted);
    assert_true(ts[0].demoted >= 5 && ts[0].promoted >= 5);
    kvlm_ctx_free(gpu);
    kvlm_ctx_free(cpu);
    kvlm_model_free(m);
}

/* Perplexity on the shared corpora within 0.1% of the CPU's. */
static void test_perplexity(void **state) {
    (void)state;
    kvlm_model *m = load_real("stories4M_hd64.gguf");
    TU_REQUIRE(m);
    const char *corpora[] = {"tinystories-valid-head.txt", "wiki.test.raw"};
    for (int c = 0; c < 2; c++) {
        const char *path = tu_corpus_path(corpora[c]);
        if (!path) continue;
        size_t len;
        char *text = tu_read_file(path, &len);
        if (len > 60000) len = 60000;
        text[len] = 0;
        kvlm_error err = {0};
        int32_t *toks = malloc(sizeof(int32_t) * len);
        int n = kvlm_tokenize(m, text, len, true, false, toks, (int)len, &err);
        assert_true(n > 1024);
        double ppl[2];
        for (int dev = 0; dev < 2; dev++) {
            kvlm_ctx *ctx = make_ctx(m, dev, 1, 256, KVLM_CACHE_F16, KVLM_CACHE_F16);
            kvlm_ppl_result r;
            if (kvlm_perplexity(ctx, toks, n, tu_quick() ? 2 : 8, NULL, NULL, &r, &err)) fail_msg("%s", err.msg);
            ppl[dev] = r.ppl;
            kvlm_ctx_free(ctx);
        }
        double rel = fabs(ppl[1] - ppl[0]) / ppl[0];
        printf("    perplexity %s: cpu %.4f cuda %.4f (rel diff %.2e)\n", corpora[c], ppl[0], ppl[1], rel);
        assert_true(rel < 1e-3);
        free(toks);
        free(text);
    }
    kvlm_model_free(m);
}

static void test_refusals(void **state) {
    (void)state;
    kvlm_model *m = synth(KVLM_ARCH_LLAMA, 64, 2, 2, 160, "f32", 9);
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.device = KVLM_DEVICE_CUDA;
    cp.n_ctx = 128;
    cp.cache_type_k = KVLM_CACHE_Q4_KC;
    kvlm_error err = {0};
    assert_null(kvlm_ctx_create(m, &cp, &err));
    assert_int_equal(err.code, KVLM_EUNSUPPORTED);
    cp.cache_type_k = KVLM_CACHE_F16;
    cp.kv_evict = KVLM_EVICT_SINKS;
    cp.kv_budget = 64;
    assert_null(kvlm_ctx_create(m, &cp, &err));
    assert_int_equal(err.code, KVLM_EUNSUPPORTED);
    cp.device = 7;
    cp.kv_evict = 0;
    cp.kv_budget = 0;
    assert_null(kvlm_ctx_create(m, &cp, &err));
    assert_int_equal(err.code, KVLM_EINVAL);
    kvlm_model_free(m);
}

int main(void) {
    if (kvlm_cuda_device_count() <= 0) {
        printf("SKIP test_cuda: no CUDA GPU here (or kvlm was built without -DKVLM_CUDA); "
               "the CUDA backend is tested on a machine with one\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refusals),
#ifdef KVLM_HAVE_CUDA
        cmocka_unit_test(test_attention_kernel),
#endif
        cmocka_unit_test(test_long_prompt),    cmocka_unit_test(test_stories_greedy),
        cmocka_unit_test(test_shapes),         cmocka_unit_test(test_cache_types),
        cmocka_unit_test(test_prefix_and_fork), cmocka_unit_test(test_sched_32), cmocka_unit_test(test_host_tier),
        cmocka_unit_test(test_swap_gpu),
        cmocka_unit_test(test_perplexity),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    printf("worst relative error seen: %.3e\n", worst_seen);
    return rc;
}
