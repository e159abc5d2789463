/* tests/test_hf: Hugging Face model directories. The safetensors reader on
 * bad input; directories that scripts/hf_export.py writes from random-weight
 * GGUF models give the GGUF's logits (llama, mistral, smollm3, granite, olmo2, qwen2, qwen3, phi3, gemma2; f32, f16,
 * bf16; shards with an index; unaligned data); clear errors for a missing
 * shard, a shape mismatch, a truncated file and refused configs; `convert`
 * gives back the GGUF's very tensors; tokenizer.json (byte-level and
 * byte-fallback, from the real vocabularies) encodes as the GGUF does. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "helpers/testutil.h"
#include "kvlm.h"
#include "model/gguf.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "tok/chat.h"
#include "tok/tok.h"

#ifndef KVLM_SOURCE_DIR
#define KVLM_SOURCE_DIR "."
#endif
#define PY "/usr/bin/python3"

static char g_tmp[256];
static bool g_have_py;

static void cleanup(void) {
    if (!g_tmp[0]) return;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_tmp);
}

static const char *tmp(const char *name) {
    static char buf[8][512];
    static int k;
    char *p = buf[k++ & 7];
    snprintf(p, 512, "%s/%s", g_tmp, name);
    return p;
}

static void need_py(void) {
    if (!g_have_py) {
        fprintf(stderr, "SKIP: %s with numpy is needed to write Hugging Face directories (apt-get install "
                        "python3-numpy)\n", PY);
        skip();
    }
}

/* scripts/hf_export.py GGUF DIR ARGS */
static void export_hf(const char *gguf, const char *dir, const char *args) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && %s '%s/scripts/hf_export.py' '%s' '%s' %s", dir, PY, KVLM_SOURCE_DIR,
             gguf, dir, args ? args : "");
    if (system(cmd) != 0) fail_msg("exporter failed: %s", cmd);
}

static void synth(const char *path, kvlm_arch arch, int type, bool tied, const char *tmpl, uint64_t seed) {
    kvlm_synth_params p = {0};
    p.arch = arch;
    p.dim = 64;
    p.hidden_dim = 96;
    p.n_layers = 2;
    p.n_heads = 4;
    p.n_kv_heads = 2;
    p.vocab_size = 700; /* byte tokens and two-letter pieces: merges to list */
    p.n_ctx = 256;
    p.type = type;
    p.tied_output = tied;
    p.seed = seed;
    p.chat_template = tmpl;
    if (arch == KVLM_ARCH_GEMMA2) p.sliding_window = 8; /* IDS is longer: local layers drop keys */
    kvlm_error err = {0};
    if (kvlm_model_synth(&p, path, &err)) fail_msg("synth: %s", err.msg);
}

static kvlm_model *load(const char *path) {
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("loading %s: %s", path, err.msg);
    return m;
}

/* Loading must fail with a message holding every one of the strings. */
static void load_fails(const char *path, const char *want1, const char *want2) {
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (m) fail_msg("%s loaded, expected an error naming '%s'", path, want1);
    if (!strstr(err.msg, want1) || (want2 && !strstr(err.msg, want2)))
        fail_msg("error '%s' does not name '%s'%s%s", err.msg, want1, want2 ? " and " : "", want2 ? want2 : "");
    printf("  error as expected: %s\n", err.msg);
}

#define N_IDS 12
static const int32_t IDS[N_IDS] = {1, 300, 17, 402, 599, 3, 88, 650, 260, 261, 45, 699};

/* Logits after every token: one prefill (decode = false) or token by token. */
static float *logits(const kvlm_model *m, bool decode) {
    kvlm_error err = {0};
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 64;
    cp.n_threads = 2;
    cp.cache_type_k = cp.cache_type_v = KVLM_CACHE_F32;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) fail_msg("ctx: %s", err.msg);
    int nv = kvlm_vocab_size(m);
    float *out = malloc(sizeof(float) * (size_t)nv * N_IDS);
    int8_t want[N_IDS];
    memset(want, 1, sizeof want);
    for (int i = 0; i < N_IDS; i += decode ? 1 : N_IDS) {
        int n = decode ? 1 : N_IDS;
        kvlm_batch b = {.n_tokens = n, .tokens = IDS + i, .logits = want};
        if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
        for (int k = 0; k < n; k++) memcpy(out + (size_t)(i + k) * nv, kvlm_get_logits(ctx, k), sizeof(float) * nv);
    }
    kvlm_ctx_free(ctx);
    return out;
}

/* max |a - b| / max |b| over every row */
static double rel_err(const float *a, const float *b, size_t n) {
    double worst = 0, scale = 1e-6;
    for (size_t i = 0; i < n; i++) {
        worst = tu_worse(worst, fabs((double)a[i] - b[i]));
        if (fabs(b[i]) > scale) scale = fabs(b[i]);
    }
    return worst / scale;
}

/* Every field of the configs, and each layer's window and RoPE base, the
 * same: config.json gives what the GGUF's keys give. */
static void same_config(const char *a_path, const char *b_path) {
    kvlm_model *ma = load(a_path), *mb = load(b_path);
    const kvlm_config *a = &ma->cfg, *b = &mb->cfg;
#define EQ(f) if (a->f != b->f) fail_msg("config field " #f ": %s has %g, %s %g", a_path, (double)a->f, b_path, (double)b->f)
    EQ(arch); EQ(dim); EQ(hidden_dim); EQ(n_layers); EQ(n_heads); EQ(n_kv_heads); EQ(head_dim); EQ(vocab_size);
    EQ(n_ctx_train); EQ(rope_dim); EQ(rope_base); EQ(rope_neox); EQ(norm_eps); EQ(weight_type); EQ(q_lora_rank);
    EQ(kv_lora_rank); EQ(v_head_dim); EQ(n_expert); EQ(n_expert_used); EQ(n_expert_shared); EQ(n_dense_lead);
    EQ(expert_ff); EQ(expert_weights_scale); EQ(expert_weights_norm); EQ(expert_gating); EQ(yarn_factor);
    EQ(yarn_log_mul); EQ(yarn_beta_fast); EQ(yarn_beta_slow); EQ(yarn_orig_ctx); EQ(sliding_window); EQ(swa_period);
    EQ(n_local_layers); EQ(rope_base_local); EQ(attn_softcap); EQ(final_softcap); EQ(attn_scale);
#undef EQ
    for (int l = 0; l < a->n_layers; l++) {
        assert_int_equal(ma->layers[l].window, mb->layers[l].window);
        assert_true(ma->layers[l].rope_base == mb->layers[l].rope_base);
        assert_true(!ma->layers[l].post_attn_norm.data == !mb->layers[l].post_attn_norm.data);
        assert_true(!ma->layers[l].post_ffn_norm.data == !mb->layers[l].post_ffn_norm.data);
    }
    printf("  config fields and per-layer windows equal (sliding window %d on %d of %d layers, softcaps %g/%g, "
           "attn scale %g)\n", a->sliding_window, a->n_local_layers, a->n_layers, a->attn_softcap, a->final_softcap,
           a->attn_scale);
    kvlm_model_free(ma);
    kvlm_model_free(mb);
}

/* The directory's logits against the GGUF's, prefill and decode. */
static double compare_models(const char *a_path, const char *b_path, double bound, const char *label) {
    kvlm_model *a = load(a_path), *b = load(b_path);
    assert_int_equal(kvlm_vocab_size(a), kvlm_vocab_size(b));
    size_t n = (size_t)kvlm_vocab_size(a) * N_IDS;
    double worst = 0;
    for (int d = 0; d < 2; d++) {
        float *la = logits(a, d), *lb = logits(b, d);
        worst = tu_worse(worst, rel_err(la, lb, n));
        free(la);
        free(lb);
    }
    printf("  %-34s max |dir - gguf| / max |gguf| = %.3g (bound %.0e)\n", label, worst, bound);
    if (!(worst <= bound)) fail_msg("%s: logits differ by %g (bound %g)", label, worst, bound);
    /* the tokenizers agree too */
    static const char *texts[] = {"hello world", " ab  cd\n\tz", "élan ∑ 🙂", "<s>x</s>"};
    for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) {
        int32_t ia[64], ib[64];
        kvlm_error err = {0};
        int na = kvlm_tokenize(a, texts[t], strlen(texts[t]), true, true, ia, 64, &err);
        int nb = kvlm_tokenize(b, texts[t], strlen(texts[t]), true, true, ib, 64, &err);
        assert_int_equal(na, nb);
        assert_true(na > 0 && na <= 64);
        assert_memory_equal(ia, ib, sizeof(int32_t) * (size_t)na);
    }
    kvlm_model_free(a);
    kvlm_model_free(b);
    return worst;
}

/* ---- safetensors on bad input ------------------------------------------------ */

static size_t make_st(uint8_t *buf, const char *header, size_t data_bytes) {
    size_t hl = strlen(header);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, header, hl);
    for (size_t i = 0; i < data_bytes; i++) buf[8 + hl + i] = (uint8_t)i;
    return 8 + hl + data_bytes;
}

static void st_bad(const char *header, size_t data, const char *want) {
    uint8_t buf[4096];
    size_t n = make_st(buf, header, data);
    /* exact-size copy, so reading past it is caught by the sanitizers */
    uint8_t *copy = malloc(n);
    memcpy(copy, buf, n);
    kvlm_error err = {0};
    st_file *f = st_open_buffer(copy, n, "t.safetensors", &err);
    if (f) fail_msg("accepted %s", header);
    if (!strstr(err.msg, want)) fail_msg("error '%s' does not say '%s'", err.msg, want);
    printf("  %s\n", err.msg);
    free(copy);
}

static void test_safetensors_bad_input(void **state) {
    (void)state;
    const char *good = "{\"__metadata__\":{\"format\":\"pt\"},\"b\":{\"dtype\":\"BF16\",\"shape\":[4],"
                       "\"data_offsets\":[24,32]},\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}";
    uint8_t buf[4096];
    size_t n = make_st(buf, good, 32);
    kvlm_error err = {0};
    st_file *f = st_open_buffer(buf, n, "good", &err);
    if (!f) fail_msg("%s", err.msg);
    const st_tensor *a = st_find(f, "a"), *b = st_find(f, "b");
    assert_non_null(a);
    assert_non_null(b);
    assert_null(st_find(f, "c"));
    assert_int_equal(a->dtype, ST_F32);
    assert_int_equal(a->n_dims, 2);
    assert_int_equal(a->shape[0], 2);
    assert_int_equal(a->shape[1], 3);
    assert_ptr_equal(a->data, buf + 8 + strlen(good)); /* a view, not a copy */
    assert_int_equal(b->nbytes, 8);
    assert_non_null(f->metadata);
    assert_non_null(strstr(f->metadata, "\"format\""));
    st_close(f);
    /* every shorter prefix of the file is refused, never read past */
    for (size_t k = 0; k < n; k++) {
        uint8_t *p = malloc(k ? k : 1);
        memcpy(p, buf, k);
        f = st_open_buffer(p, k, "prefix", &err);
        if (f) fail_msg("a %zu-byte prefix of %zu was accepted", k, n);
        free(p);
    }
    printf("  every prefix refused; last: %s\n", err.msg);
    st_bad("x", 0, "not plausible");
    uint8_t tiny[5] = {1, 0, 0, 0, 0};
    assert_null(st_open_buffer(tiny, sizeof tiny, "tiny", &err));
    assert_non_null(strstr(err.msg, "too short"));
    uint8_t past[16] = {200, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    assert_null(st_open_buffer(past, sizeof past, "past", &err));
    assert_non_null(strstr(err.msg, "runs past the end"));
    printf("  %s\n", err.msg);
    st_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8, "truncated");
    st_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
           "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 20, "overlap");
    st_bad("{\"a\":{\"dtype\":\"F12\",\"shape\":[4],\"data_offsets\":[0,16]}}", 16, "unknown dtype");
    st_bad("{\"a\":{\"dtype\":\"F16\",\"shape\":[4,3],\"data_offsets\":[0,16]}}", 16, "needs other bytes");
    st_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,8],\"data_offsets\":[0,16]}}", 16, "too many");
    st_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[16,0]}}", 16, "begin <= end");
    st_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[-4],\"data_offsets\":[0,16]}}", 16, "non-negative");
    st_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[4]}}", 16, "data_offsets");
    st_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
           "\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 16, "not valid JSON");
    st_bad("[1,2,3]", 0, "not a JSON object");
    st_bad("{\"a\":{\"dtype\":\"F32\",\"sha", 0, "not valid JSON");
    /* random damage to a good header: refused or accepted, never a crash */
    uint64_t s = 12345;
    int accepted = 0;
    for (int it = 0; it < 3000; it++) {
        uint8_t *p = malloc(n);
        memcpy(p, buf, n);
        for (int k = 0; k < 3; k++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            p[(s >> 33) % (8 + strlen(good))] = (uint8_t)(s >> 20);
        }
        f = st_open_buffer(p, n, "damaged", &err);
        if (f) {
            accepted++;
            for (int i = 0; i < f->n_tensors; i++) {
                const st_tensor *t = &f->tensors[i];
                assert_true((const uint8_t *)t->data >= p && (const uint8_t *)t->data + t->nbytes <= p + n);
            }
            st_close(f);
        }
        free(p);
    }
    printf("  3000 damaged headers: %d still valid, the rest refused\n", accepted);
}

/* ---- directories against GGUF ------------------------------------------------ */

static void test_families(void **state) {
    (void)state;
    need_py();
    static const struct { const char *family; kvlm_arch arch; bool tied; } fams[] = {
        {"llama", KVLM_ARCH_LLAMA, false}, {"llama", KVLM_ARCH_LLAMA, true}, {"mistral", KVLM_ARCH_LLAMA, false},
        {"smollm3", KVLM_ARCH_SMOLLM3, true}, {"granite", KVLM_ARCH_GRANITE, true}, {"qwen2", KVLM_ARCH_QWEN2, false},
        {"qwen3", KVLM_ARCH_QWEN3, true}, {"granitemoe", KVLM_ARCH_GRANITEMOE, true},
        {"phi3", KVLM_ARCH_PHI3, false},
        {"gemma2", KVLM_ARCH_GEMMA2, true}, {"gemma3_text", KVLM_ARCH_GEMMA3, true}, {"olmo2", KVLM_ARCH_OLMO2, false},
        /* Gemma 3 4B and larger: the text model inside a multimodal directory
         * (language_model.model.*, text_config of the keys off the defaults) */
        {"gemma3", KVLM_ARCH_GEMMA3, true},
        /* Mistral Small 3.1: a mistral text model inside Mistral3ForConditionalGeneration */
        {"mistral3", KVLM_ARCH_LLAMA, false},
    };
    static const struct { int type; const char *name; } types[] = {{0, "f32"}, {1, "f16"}, {30, "bf16"}};
    for (size_t f = 0; f < sizeof fams / sizeof fams[0]; f++)
        for (size_t t = 0; t < 3; t++) {
            const char *gguf = tmp("fam.gguf"), *dir = tmp("fam_dir");
            synth(gguf, fams[f].arch, types[t].type, fams[f].tied, NULL, 7 + f);
            char args[64], label[96];
            snprintf(args, sizeof args, "--family %s", fams[f].family);
            export_hf(gguf, dir, args);
            snprintf(label, sizeof label, "%s%s %s:", fams[f].family, fams[f].tied ? " (tied)" : "", types[t].name);
            /* Only the order of the terms of q.k within a head differs for
             * llama/mistral (HF's rotate-half rows, NeoX RoPE): float
             * rounding, ~1e-7 of the largest logit; 0 for the others. */
            bool llama_rows = fams[f].arch == KVLM_ARCH_LLAMA || fams[f].arch == KVLM_ARCH_SMOLLM3 ||
                              fams[f].arch == KVLM_ARCH_GRANITE || fams[f].arch == KVLM_ARCH_GRANITEMOE;
            compare_models(dir, gguf, llama_rows ? 2e-6 : 0, label);
            /* llama/mistral/smollm3 differ in rope_neox only (HF's rows), by design */
            if (!llama_rows) same_config(dir, gguf);
        }
}

/* Gemma 2's config keys: null soft-caps are none (against a GGUF without
 * them), query_pre_attn_scalar sets the attention scale, bad values are
 * named. */
static void test_gemma2_config(void **state) {
    (void)state;
    need_py();
    const char *gguf = tmp("g2.gguf"), *dir = tmp("g2_dir");
    kvlm_synth_params p = {.arch = KVLM_ARCH_GEMMA2, .dim = 64, .hidden_dim = 96, .n_layers = 3, .n_heads = 4,
                           .n_kv_heads = 2, .vocab_size = 700, .n_ctx = 256, .tied_output = true, .seed = 21,
                           .sliding_window = 5, .attn_softcap = -1, .final_softcap = -1};
    kvlm_error err = {0};
    assert_int_equal(kvlm_model_synth(&p, gguf, &err), KVLM_OK);
    export_hf(gguf, dir, "--family gemma2");
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t len;
    char *cfg = tu_read_file(path, &len);
    assert_non_null(strstr(cfg, "\"attn_logit_softcapping\": null"));
    assert_non_null(strstr(cfg, "\"final_logit_softcapping\": null"));
    compare_models(dir, gguf, 0, "gemma2 without soft-caps:");
    same_config(dir, gguf);
    kvlm_model *m = load(dir);
    assert_true(m->cfg.attn_softcap == 0 && m->cfg.final_softcap == 0);
    assert_int_equal(m->cfg.n_local_layers, 2); /* layers 0 and 2 */
    assert_int_equal(m->layers[0].window, 5);
    assert_int_equal(m->layers[1].window, 0);
    kvlm_model_free(m);
    static const struct { const char *from, *to, *want; } edits[] = {
        {"\"query_pre_attn_scalar\": 16", "\"query_pre_attn_scalar\": 64", NULL},
        {"\"final_logit_softcapping\": null", "\"final_logit_softcapping\": -3", "\"final_logit_softcapping\" = -3"},
        {"\"sliding_window\": 5", "\"sliding_window\": \"x\"", "\"sliding_window\" is not an integer"},
        {"\"hidden_activation\": \"gelu_pytorch_tanh\"", "\"hidden_activation\": \"gelu\"",
         "hidden_activation \"gelu\" is not supported for gemma2"},
    };
    for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
        char *at = strstr(cfg, edits[i].from);
        if (!at) fail_msg("config.json lacks %s", edits[i].from);
        size_t fl = strlen(edits[i].from), tl = strlen(edits[i].to), pre = (size_t)(at - cfg);
        char *nc = malloc(len + tl + 1);
        memcpy(nc, cfg, pre);
        memcpy(nc + pre, edits[i].to, tl);
        memcpy(nc + pre + tl, at + fl, len - pre - fl + 1);
        assert_int_equal(tu_write_file(path, nc, strlen(nc)), 0);
        free(nc);
        if (edits[i].want) {
            load_fails(dir, edits[i].want, NULL);
            continue;
        }
        m = load(dir);
        assert_true(m->cfg.attn_scale == 1.0f / 8.0f);
        /* no GGUF key could carry it: convert refuses rather than change the model */
        assert_int_equal(kvlm_model_save_gguf(m, tmp("g2_out.gguf"), -1, &err), KVLM_EUNSUPPORTED);
        if (!strstr(err.msg, "query_pre_attn_scalar 64")) fail_msg("convert error: %s", err.msg);
        kvlm_model_free(m);
        printf("  query_pre_attn_scalar 64: attention scale 1/8; convert refuses: %s\n", err.msg);
    }
    assert_int_equal(tu_write_file(path, cfg, len), 0);
    free(cfg);
    kvlm_model_free(load(dir));
    /* Gemma's Split(" ", MergedWithPrevious) splits nothing (compare_models
     * tokenized through it above); an Isolated split could not be applied by
     * the SentencePiece path, so it is refused rather than dropped */
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    char *tj = tu_read_file(path, &len);
    char *at = strstr(tj, "\"MergedWithPrevious\"");
    assert_non_null(at);
    memcpy(at, "\"Isolated\"          ", 20);
    assert_int_equal(tu_write_file(path, tj, len), 0);
    free(tj);
    load_fails(dir, "with a byte_fallback (SentencePiece) BPE are not supported", NULL);
}

static void test_shards_and_errors(void **state) {
    (void)state;
    need_py();
    const char *gguf = tmp("sh.gguf"), *one = tmp("sh_one"), *three = tmp("sh_three");
    synth(gguf, KVLM_ARCH_QWEN2, 30, false, NULL, 3);
    export_hf(gguf, one, NULL);
    export_hf(gguf, three, "--shards 3");
    char p[600];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", three);
    assert_int_equal(access(p, R_OK), 0);
    kvlm_model *a = load(one), *b = load(three);
    for (int d = 0; d < 2; d++) {
        float *la = logits(a, d), *lb = logits(b, d);
        assert_memory_equal(la, lb, sizeof(float) * (size_t)kvlm_vocab_size(a) * N_IDS); /* the same bytes */
        free(la);
        free(lb);
    }
    assert_int_equal(kvlm_model_weight_bytes(a), kvlm_model_weight_bytes(b));
    kvlm_model_free(a);
    kvlm_model_free(b);
    printf("  3 shards + index: logits identical to one file\n");
    /* unaligned data (an odd header length): the loader copies, same logits */
    const char *odd = tmp("sh_odd");
    export_hf(gguf, odd, "--no-pad");
    compare_models(odd, one, 0, "unpadded header (copies):");

    /* a missing shard */
    snprintf(p, sizeof p, "%s/model-00002-of-00003.safetensors", three);
    char moved[620];
    snprintf(moved, sizeof moved, "%s.away", p);
    assert_int_equal(rename(p, moved), 0);
    load_fails(three, "model-00002-of-00003.safetensors", "missing");
    assert_int_equal(rename(moved, p), 0);
    /* a truncated shard */
    assert_int_equal(truncate(p, 4000), 0);
    load_fails(three, "model-00002-of-00003.safetensors", "truncated");
    /* a tensor the index places in a shard that lacks it */
    export_hf(gguf, three, "--shards 3");
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", three);
    size_t len;
    char *idx = tu_read_file(p, &len);
    char *hit = strstr(idx, "00001-of");
    assert_non_null(hit);
    hit[4] = '3'; /* the first tensor filed under shard 1 now "is" in shard 3 */
    assert_int_equal(tu_write_file(p, idx, len), 0);
    free(idx);
    load_fails(three, "does not hold it", NULL);

    /* a shape mismatch, then configurations kvlm refuses: each edit of
     * config.json names what is wrong */
    snprintf(p, sizeof p, "%s/config.json", one);
    char *orig = tu_read_file(p, &len);
    static const struct { const char *from, *to, *want1, *want2; } bad[] = {
        {"\"intermediate_size\": 96", "\"intermediate_size\": 80", "model.layers.0.mlp.gate_proj.weight",
         "shape [96, 64], expected [80, 64]"},
        {"\"rope_scaling\": null", "\"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 8.0}",
         "rope_scaling of type \"dynamic\"", NULL},
        {"\"rope_scaling\": null", "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, \"attention_factor\": 2}",
         "rope_scaling yarn with attention_factor", NULL},
        {"\"rope_scaling\": null",
         "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 4, \"high_freq_factor\": 1}",
         "rope_scaling llama3: factor 8, low_freq_factor 4, high_freq_factor 1", "high > low > 0"},
        {"\"rope_scaling\": null", "\"rope_scaling\": {\"rope_type\": \"llama3\"}", "rope_scaling llama3 has no \"factor\"", NULL},
        {"\"rope_scaling\": null", "\"rope_scaling\": {\"type\": \"longrope\", \"long_factor\": [1], \"short_factor\": [1]}",
         "rope_scaling of type \"longrope\"", "longrope (phi3)"},
        {"\"model_type\": \"qwen2\"", "\"model_type\": \"gemma2\"", "\"silu\" is not supported for gemma2", NULL},
        {"\"model_type\": \"qwen2\"", "\"model_type\": \"bert\"", "model_type \"bert\" is not supported", NULL},
        {"\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act \"gelu\"", NULL},
        {"\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1", "belongs to layer 1", NULL},
        {"\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3", "does not divide", NULL},
        {"\"vocab_size\": 700", "\"vocab_size\": 600", "model.embed_tokens.weight", "expected [600, 64]"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *at = strstr(orig, bad[i].from);
        if (!at) fail_msg("config.json lacks %s", bad[i].from);
        size_t fl = strlen(bad[i].from), tl = strlen(bad[i].to), pre = (size_t)(at - orig);
        char *nc = malloc(len + tl + 1);
        memcpy(nc, orig, pre);
        memcpy(nc + pre, bad[i].to, tl);
        memcpy(nc + pre + tl, at + fl, len - pre - fl + 1);
        assert_int_equal(tu_write_file(p, nc, strlen(nc)), 0);
        load_fails(one, bad[i].want1, bad[i].want2);
        free(nc);
    }
    assert_int_equal(tu_write_file(p, orig, len), 0);
    free(orig);
    kvlm_model_free(load(one));
    snprintf(p, sizeof p, "%s/tokenizer.json", one);
    assert_int_equal(unlink(p), 0);
    load_fails(one, "no tokenizer.json", NULL);
    load_fails(g_tmp, "no config.json", NULL);
    snprintf(p, sizeof p, "%s/model.safetensors", one);
    load_fails(p, "give the directory", NULL);
}

/* convert: the GGUF written from a directory holds the original GGUF's
 * tensors byte for byte (HF's q/k rows interleaved back), and quantizing
 * either gives the same file contents. */
static void same_tensors(const char *pa, const char *pb) {
    kvlm_error err = {0};
    gguf_file *a = gguf_open(pa, &err), *b = gguf_open(pb, &err);
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(a->n_tensors, b->n_tensors);
    for (uint64_t i = 0; i < a->n_tensors; i++) {
        const gguf_tensor *x = &a->tensors[i], *y = gguf_find_tensor(b, x->cname);
        if (!y) fail_msg("%s: no tensor %s", pb, x->cname);
        assert_int_equal(x->type, y->type);
        assert_int_equal(x->nbytes, y->nbytes);
        if (memcmp(x->data, y->data, x->nbytes)) fail_msg("tensor %s differs", x->cname);
    }
    gguf_close(a);
    gguf_close(b);
}

static void test_convert_round_trip(void **state) {
    (void)state;
    need_py();
    static const struct { const char *family; kvlm_arch arch; int type; } cases[] = {
        {"llama", KVLM_ARCH_LLAMA, 0}, {"mistral", KVLM_ARCH_LLAMA, 30}, {"qwen2", KVLM_ARCH_QWEN2, 1},
        {"qwen3", KVLM_ARCH_QWEN3, 30}, {"smollm3", KVLM_ARCH_SMOLLM3, 1}, {"granite", KVLM_ARCH_GRANITE, 0},
        {"granitemoe", KVLM_ARCH_GRANITEMOE, 1}, {"phi3", KVLM_ARCH_PHI3, 0},
        {"gemma2", KVLM_ARCH_GEMMA2, 30}, {"gemma3_text", KVLM_ARCH_GEMMA3, 30}, {"olmo2", KVLM_ARCH_OLMO2, 1},
        {"gemma3", KVLM_ARCH_GEMMA3, 30}, {"mistral3", KVLM_ARCH_LLAMA, 30},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const char *gguf = tmp("rt.gguf"), *dir = tmp("rt_dir"), *out = tmp("rt_out.gguf");
        const char *q_a = tmp("rt_qa.gguf"), *q_b = tmp("rt_qb.gguf");
        synth(gguf, cases[c].arch, cases[c].type, false, "{% for m in messages %}<|im_start|>...", 11 + c);
        char args[64];
        snprintf(args, sizeof args, "--family %s", cases[c].family);
        export_hf(gguf, dir, args);
        kvlm_model *m = load(dir), *g = load(gguf);
        kvlm_error err = {0};
        assert_int_equal(kvlm_model_save_gguf(m, out, -1, &err), KVLM_OK);
        same_tensors(gguf, out);
        assert_int_equal(kvlm_model_save_gguf(m, q_a, 8, &err), KVLM_OK);
        assert_int_equal(kvlm_model_save_gguf(g, q_b, 8, &err), KVLM_OK);
        same_tensors(q_b, q_a);
        kvlm_model *back = load(out);
        float *lg = logits(g, false), *lb = logits(back, false);
        assert_memory_equal(lg, lb, sizeof(float) * (size_t)kvlm_vocab_size(g) * N_IDS);
        /* the vocabulary and template travel too */
        assert_string_equal(back->vocab.chat_template, g->vocab.chat_template);
        assert_string_equal(tok_chat_family(back->vocab.chat_template), "chatml");
        assert_int_equal(back->vocab.bos, g->vocab.bos);
        assert_int_equal(back->vocab.eos, g->vocab.eos);
        assert_int_equal(back->vocab.add_bos, g->vocab.add_bos);
        free(lg);
        free(lb);
        kvlm_model_free(back);
        kvlm_model_free(m);
        kvlm_model_free(g);
        printf("  %s: directory -> GGUF holds the original tensors; q8_0 of either is the same; logits equal\n",
               cases[c].family);
    }
    /* norms in bf16 (as real bf16 checkpoints store them): rounded, so only
     * close to the f32-norm GGUF; its conversion is exact against itself */
    const char *gguf = tmp("rt.gguf"), *dir = tmp("rt_dir"), *out = tmp("rt_out.gguf");
    synth(gguf, KVLM_ARCH_LLAMA, 30, false, NULL, 5);
    export_hf(gguf, dir, "--norm-dtype bf16");
    compare_models(dir, gguf, 2e-2, "llama bf16 with bf16 norms:");
    kvlm_model *m = load(dir);
    kvlm_error err = {0};
    assert_int_equal(kvlm_model_save_gguf(m, out, -1, &err), KVLM_OK);
    kvlm_model_free(m);
    compare_models(dir, out, 2e-6, "bf16 norms: directory vs convert:");
}

/* ---- tokenizer.json ------------------------------------------------------------ */

static int encode(const kvlm_model *m, const char *s, int32_t *ids, int cap) {
    kvlm_error err = {0};
    int n = kvlm_tokenize(m, s, strlen(s), false, false, ids, cap, &err);
    if (n < 0 || n > cap) fail_msg("tokenize: %s", err.msg);
    return n;
}

static void round_trip(const kvlm_model *m, const char *s) {
    int32_t ids[4096];
    int n = encode(m, s, ids, 4096);
    char *out = malloc(strlen(s) * 4 + 64);
    size_t o = 0;
    kvlm_detok d;
    kvlm_detok_init(&d, m);
    for (int i = 0; i < n; i++) o += (size_t)kvlm_detok_push(&d, ids[i], out + o, strlen(s) * 4 + 64 - o);
    o += (size_t)kvlm_detok_flush(&d, out + o, strlen(s) * 4 + 64 - o);
    out[o] = 0;
    if (strcmp(out, s)) fail_msg("decode(encode(\"%s\")) = \"%s\"", s, out);
    free(out);
}

static const char *EXTRA[] = {
    "Hello world", " leading space", "trailing space ", "tabs\tand\nnewlines\n\n", "ALL CAPS and MiXeD",
    "numbers 1234567 and 3.14159", "I've they're we'll it's", "ünïcödé façade naïve", "日本語のテキスト",
    "emoji 🙂🚀 and ∑∫", "    many     spaces   ", "code: for (int i = 0; i < n; i++) { x += y; }", "a",
};

/* Every string of a vocabulary's .inp file, plus EXTRA: the directory
 * encodes as the GGUF does (and as the .out file says), and decodes back. */
static int compare_vocab(const char *gguf, const char *dir, bool check_out) {
    kvlm_error err = {0};
    kvlm_model_params mp = {.vocab_only = true};
    kvlm_model *g = kvlm_model_load(gguf, &mp, &err), *h = kvlm_model_load(dir, &mp, &err);
    if (!g || !h) fail_msg("vocab load: %s", err.msg);
    char inp[600];
    snprintf(inp, sizeof inp, "%s.inp", gguf);
    size_t len;
    char *raw = tu_read_file(inp, &len), *outs = NULL;
    snprintf(inp, sizeof inp, "%s.out", gguf);
    if (check_out) outs = tu_read_file(inp, NULL);
    int n_str = 0;
    char *p = raw, *line = outs;
    int32_t a[4096], b[4096];
    while (p && *p) {
        char *sep = strstr(p, "\n__ggml_vocab_test__\n");
        if (sep) *sep = 0;
        int na = encode(g, p, a, 4096), nb = encode(h, p, b, 4096);
        if (na != nb || memcmp(a, b, sizeof(int32_t) * (size_t)na)) fail_msg("\"%s\": ids differ", p);
        if (line) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            char buf[16384];
            size_t o = 0;
            buf[0] = 0;
            for (int i = 0; i < nb && o < sizeof buf - 16; i++) o += (size_t)snprintf(buf + o, sizeof buf - o, "%s%d", i ? " " : "", b[i]);
            char *want = line;
            while (*want == ' ') want++;
            size_t wl = strlen(want);
            while (wl && want[wl - 1] == ' ') want[--wl] = 0;
            if (strcmp(buf, want)) fail_msg("\"%s\": got %s, want %s", p, buf, want);
            line = nl ? nl + 1 : NULL;
        }
        round_trip(h, p);
        n_str++;
        p = sep ? sep + strlen("\n__ggml_vocab_test__\n") : NULL;
    }
    for (size_t i = 0; i < sizeof EXTRA / sizeof EXTRA[0]; i++) {
        int na = encode(g, EXTRA[i], a, 4096), nb = encode(h, EXTRA[i], b, 4096);
        if (na != nb || memcmp(a, b, sizeof(int32_t) * (size_t)na)) fail_msg("\"%s\": ids differ", EXTRA[i]);
        round_trip(h, EXTRA[i]);
        n_str++;
    }
    assert_int_equal(g->vocab.bos, h->vocab.bos);
    assert_int_equal(g->vocab.eos, h->vocab.eos);
    free(raw);
    free(outs);
    kvlm_model_free(g);
    kvlm_model_free(h);
    return n_str;
}

static void test_tokenizer_json(void **state) {
    (void)state;
    need_py();
    const char *spm = tu_model_path("vocab/ggml-vocab-llama-spm.gguf");
    TU_REQUIRE(spm);
    char spm_path[600];
    snprintf(spm_path, sizeof spm_path, "%s", spm);
    const char *g2 = tu_model_path("vocab/ggml-vocab-gpt-2.gguf");
    TU_REQUIRE(g2);
    char g2_path[600];
    snprintf(g2_path, sizeof g2_path, "%s", g2);
    const char *dir = tmp("tok_spm");
    export_hf(spm_path, dir, "--vocab-only");
    int n = compare_vocab(spm_path, dir, true);
    printf("  Llama 2 SentencePiece as byte-fallback BPE (scores from merge ranks): %d strings, ids as the GGUF's "
           "and the .out file's, decode(encode(x)) == x\n", n);
    static const struct { const char *args, *pre; bool own; } forms[] = {
        {"--vocab-only", "gpt-2", false},
        {"--vocab-only --merges list", "gpt-2", false},
        {"--vocab-only --pre llama3", "llama-bpe", false},
        {"--vocab-only --pre qwen2", "qwen2", false},
        {"--vocab-only --pre custom", "kvlm-regex", true},
    };
    for (size_t f = 0; f < sizeof forms / sizeof forms[0]; f++) {
        dir = tmp("tok_g2");
        export_hf(g2_path, dir, forms[f].args);
        kvlm_error err = {0};
        kvlm_model_params mp = {.vocab_only = true};
        kvlm_model *h = kvlm_model_load(dir, &mp, &err);
        if (!h) fail_msg("%s", err.msg);
        /* named as kvlm's table names it ("default" is llama.cpp's four-regex default) */
        const char *want = forms[f].pre;
        if (strcmp(h->vocab.pre, want)) fail_msg("%s: pre \"%s\", want \"%s\"", forms[f].args, h->vocab.pre, want);
        assert_int_equal(h->vocab.has_pre_regex, forms[f].own);
        if (f < 2) {
            n = compare_vocab(g2_path, dir, true);
            printf("  GPT-2 byte-level BPE (%s merges): %d strings as the GGUF's and the .out file's\n",
                   f ? "[a, b]" : "\"a b\"", n);
        } else {
            /* the same vocabulary under another regex: chunks as that regex cuts them */
            tok_span sp[16];
            const char *s = "Hello 12345 world's";
            int k = tok_pretokenize(h->tok, s, strlen(s), sp, 16, &err);
            char got[256];
            size_t o = 0;
            for (int i = 0; i < k && i < 16; i++) o += (size_t)snprintf(got + o, sizeof got - o, "[%.*s]", (int)sp[i].len, s + sp[i].off);
            static const char *want_chunks[] = {"[Hello][ ][123][45][ world]['s]", "[Hello][ ][1][2][3][4][5][ world]['s]",
                                                "[Hello][ ][1][2][3][4][5][ world]['][s]"};
            if (strcmp(got, want_chunks[f - 2])) fail_msg("%s: chunks %s, want %s", forms[f].args, got, want_chunks[f - 2]);
            for (size_t i = 0; i < sizeof EXTRA / sizeof EXTRA[0]; i++) round_trip(h, EXTRA[i]);
            printf("  GPT-2 vocabulary under %s: pre \"%s\"%s, chunks %s\n", forms[f].args + 13, h->vocab.pre,
                   forms[f].own ? " (its own regexes)" : "", got);
        }
        kvlm_model_free(h);
    }
}

/* A model directory whose byte-level tokenizer uses a regex kvlm has no
 * name for keeps it through convert (tokenizer.kvlm.pre_regex). */
static void test_custom_pre_convert(void **state) {
    (void)state;
    need_py();
    const char *g2 = tu_model_path("vocab/ggml-vocab-gpt-2.gguf");
    TU_REQUIRE(g2);
    char g2_path[600];
    snprintf(g2_path, sizeof g2_path, "%s", g2);
    /* the weights of a synthetic model, the tokenizer of GPT-2 */
    const char *gguf = tmp("cp.gguf"), *dir = tmp("cp_dir"), *tokdir = tmp("cp_tok"), *out = tmp("cp_out.gguf");
    kvlm_synth_params p = {.arch = KVLM_ARCH_QWEN2, .dim = 32, .hidden_dim = 64, .n_layers = 1, .n_heads = 2,
                           .vocab_size = 50257, .n_ctx = 64, .type = 1, .seed = 9};
    kvlm_error err = {0};
    assert_int_equal(kvlm_model_synth(&p, gguf, &err), KVLM_OK);
    export_hf(gguf, dir, NULL);
    export_hf(g2_path, tokdir, "--vocab-only --pre custom");
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "cp '%s/tokenizer.json' '%s/tokenizer_config.json' '%s/'", tokdir, tokdir, dir);
    assert_int_equal(system(cmd), 0);
    kvlm_model *m = load(dir);
    assert_true(m->vocab.has_pre_regex);
    assert_int_equal(kvlm_model_save_gguf(m, out, -1, &err), KVLM_OK);
    kvlm_model *back = load(out);
    assert_true(back->vocab.has_pre_regex);
    assert_int_equal(back->vocab.n_pre_regex, m->vocab.n_pre_regex);
    for (size_t i = 0; i < sizeof EXTRA / sizeof EXTRA[0]; i++) {
        int32_t a[512], b[512];
        int na = encode(m, EXTRA[i], a, 512), nb = encode(back, EXTRA[i], b, 512);
        assert_int_equal(na, nb);
        assert_memory_equal(a, b, sizeof(int32_t) * (size_t)na);
    }
    kvlm_model_free(back);
    kvlm_model_free(m);
    printf("  custom pre-tokenizer regexes survive convert (tokenizer.kvlm.pre_regex)\n");
}

int main(void) {
    snprintf(g_tmp, sizeof g_tmp, "%s/kvlm-test-hf-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(g_tmp)) { perror("mkdtemp"); return 1; }
    atexit(cleanup);
    g_have_py = system(PY " -c 'import numpy' 2>/dev/null") == 0;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_safetensors_bad_input),
        cmocka_unit_test(test_families),
        cmocka_unit_test(test_gemma2_config),
        cmocka_unit_test(test_shards_and_errors),
        cmocka_unit_test(test_convert_round_trip),
        cmocka_unit_test(test_tokenizer_json),
        cmocka_unit_test(test_custom_pre_convert),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
