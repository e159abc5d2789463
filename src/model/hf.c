/* model/hf: a Hugging Face model directory as a kvlm_model: config.json per
 * family (one row of a table each), tensor views over the safetensors maps
 * (F32/F16/BF16 matrices are used in place; norms and biases are widened to
 * f32 copies), and the vocabulary from tokenizer.json (hf_tok.c). */
#include "model/hf.h"
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "dtype/dtype.h"
#include "model/model.h"
#include "util/error.h"
#include "util/log.h"

/* One family of config.json's model_type.
 *
 * RoPE layout: HF's Llama and Mistral checkpoints keep each head's query and
 * key rows in "rotate half" order (rotated pairs are (i, i + d/2)), where
 * Meta's original weights and GGUF's llama use interleaved pairs (2i, 2i+1):
 * HF's conversion script permuted the rows, and llama.cpp's converter undoes
 * that (row h*d + 2i + j of GGUF = row h*d + j*d/2 + i of HF). Rotating the
 * pairs (i, i + d/2) of the HF rows (NeoX RoPE) computes the same queries and
 * keys, only in that permuted order within each head, and attention scores
 * are sums over the head: so a directory loads with rope_neox and no copy,
 * and `convert` permutes the rows as llama.cpp does (writer.c). */
typedef struct {
    const char *model_type;
    int arch;              /* kvlm_arch */
    const char *act;       /* hidden_act (gemma2: hidden_activation) it must have */
    bool rotate_half;      /* llama, mistral: HF's q/k row order (see above) */
    bool qkv_bias;         /* qwen2: q, k, v projections have biases */
    bool fused;            /* phi3: qkv_proj and gate_up_proj */
    bool norm_plus_one;    /* gemma: RMSNorm scales by (1 + w); GGUF stores 1 + w (llama.cpp adds 1) */
    bool post_norms;       /* gemma2: post_attention_layernorm after attention, pre/post_feedforward_layernorm */
    bool tie_default;      /* tie_word_embeddings when config.json does not say */
    const char *ffn_norm;  /* the norm before the FFN; NULL: olmo2's norms after attention and FFN instead
                            * (post_attention_layernorm, post_feedforward_layernorm; none before) */
    bool qk_norm;          /* qwen3: self_attn.q_norm / k_norm, an RMSNorm over each head of q and k */
} hf_family;

static const hf_family k_families[] = {
    {"llama", KVLM_ARCH_LLAMA, "silu", true, false, false, false, false, false, "post_attention_layernorm", false},
    {"mistral", KVLM_ARCH_LLAMA, "silu", true, false, false, false, false, false, "post_attention_layernorm", false},
    {"qwen2", KVLM_ARCH_QWEN2, "silu", false, true, false, false, false, false, "post_attention_layernorm", false},
    {"phi3", KVLM_ARCH_PHI3, "silu", false, false, true, false, false, false, "post_attention_layernorm", false},
    {"qwen3", KVLM_ARCH_QWEN3, "silu", false, false, false, false, false, false, "post_attention_layernorm", true},
    /* Granite 3: llama's rows; embedding_multiplier, residual_multiplier,
     * attention_multiplier (q.k's whole scale, default 1), logits_scaling */
    {"granite", KVLM_ARCH_GRANITE, "silu", true, false, false, false, false, false, "post_attention_layernorm", false},
    /* Granite 3.0/3.1 MoE: granite's with experts in every layer, stored stacked
     * (block_sparse_moe.input_linear [experts, gate + up rows, hidden],
     * output_linear, router.layer); MoE Shared adds shared_mlp (hf_moe) */
    {"granitemoe", KVLM_ARCH_GRANITEMOE, "silu", true, false, false, false, false, false, "post_attention_layernorm", false},
    {"granitemoeshared", KVLM_ARCH_GRANITEMOE, "silu", true, false, false, false, false, false, "post_attention_layernorm",
     false},
    /* Mixtral: llama's rows, a mixture of experts in every layer (block_sparse_moe, hf_moe) */
    {"mixtral", KVLM_ARCH_LLAMA, "silu", true, false, false, false, false, false, "post_attention_layernorm", false},
    /* Qwen2-MoE: qwen2's attention (biases), experts plus a gated shared expert (hf_moe) */
    {"qwen2_moe", KVLM_ARCH_QWEN2MOE, "silu", false, true, false, false, false, false, "post_attention_layernorm", false},
    /* Qwen3-MoE: qwen3's attention, experts in every layer (mlp.experts, hf_moe) */
    {"qwen3_moe", KVLM_ARCH_QWEN3MOE, "silu", false, false, false, false, false, false, "post_attention_layernorm", true},
    /* OLMo 2: norms after attention and FFN, q_norm / k_norm across all heads; rows as stored (NeoX) */
    {"olmo2", KVLM_ARCH_OLMO2, "silu", false, false, false, false, false, false, NULL, true},
    /* OLMo 3: OLMo 2's layers, sliding_window on the layers layer_types calls
     * sliding_attention (three in four), rope_scaling (YaRN) on the others only */
    {"olmo3", KVLM_ARCH_OLMO2, "silu", false, false, false, false, false, false, NULL, true},
    /* SmolLM3: llama's rows, tied by default, no_rope_layers (see read_config) */
    {"smollm3", KVLM_ARCH_SMOLLM3, "silu", true, false, false, false, false, true, "post_attention_layernorm", false},
    /* Gemma 2: tensors model.layers.N.{input_layernorm, post_attention_layernorm,
     * pre_feedforward_layernorm, post_feedforward_layernorm} -> GGUF blk.N.{attn_norm,
     * post_attention_norm, ffn_norm, post_ffw_norm}, every norm + 1; tied embeddings
     * (scaled by sqrt(hidden_size) in the forward pass); config keys
     * attn_logit_softcapping, final_logit_softcapping, query_pre_attn_scalar,
     * sliding_window (every other layer local, from layer 0). */
    {"gemma2", KVLM_ARCH_GEMMA2, "gelu_pytorch_tanh", false, false, false, true, true, true, "pre_feedforward_layernorm", false},
    /* Gemma 3's text model (Gemma3ForCausalLM: the 1B; the larger ones ship as
     * multimodal "gemma3" directories, read through multimodal_text_config): gemma2's norms and
     * activation, q/k norms (+1 too), no soft-caps, five local layers to one
     * global (sliding_window_pattern 6, or layer_types), rope_local_base_freq
     * for the local layers, rope_scaling linear on the global ones. */
    {"gemma3_text", KVLM_ARCH_GEMMA3, "gelu_pytorch_tanh", false, false, false, true, true, true,
     "pre_feedforward_layernorm", true},
};

bool model_hf_is_dir(const char *path) {
    struct stat st;
    return path && stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int model_hf_file_hint(const char *path, kvlm_error *err) {
    static const char *const ends[] = {".safetensors", "/config.json", "/tokenizer.json", ".safetensors.index.json"};
    size_t n = strlen(path);
    for (size_t i = 0; i < sizeof ends / sizeof ends[0]; i++) {
        size_t k = strlen(ends[i]);
        if (n >= k && !strcmp(path + n - k, ends[i]))
            return util_err_set(err, KVLM_EINVAL, "%s is a file of a Hugging Face model directory: give the "
                                "directory that holds it (-m DIR)", path);
    }
    return KVLM_OK;
}

static void *own(model_hf *h, size_t bytes) {
    if (h->n_owned == h->cap_owned) {
        int cap = h->cap_owned ? 2 * h->cap_owned : 64;
        void **p = realloc(h->owned, (size_t)cap * sizeof *p);
        if (!p) return NULL;
        h->owned = p;
        h->cap_owned = cap;
    }
    void *b = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (b) h->owned[h->n_owned++] = b;
    return b;
}

void model_hf_free(struct kvlm_model *m) {
    model_hf *h = m->hf;
    if (!h) return;
    for (int i = 0; i < h->n_owned; i++) free(h->owned[i]);
    free(h->owned);
    st_set_close(h->st);
    free(h);
    m->hf = NULL;
}

/* ---- config.json ---------------------------------------------------------- */

/* An integer key (absent or null: def, or an error if required). */
static int cfg_int(json_t *cfg, const char *path, const char *key, bool required, int64_t def, int64_t lo,
                   int64_t hi, int *out, kvlm_error *err) {
    json_t *v = json_object_get(cfg, key);
    if (!v || json_is_null(v)) {
        if (required) return util_err_set(err, KVLM_EFORMAT, "%s: missing key \"%s\"", path, key);
        *out = (int)def;
        return KVLM_OK;
    }
    if (!json_is_integer(v))
        return util_err_set(err, KVLM_EFORMAT, "%s: \"%s\" is not an integer", path, key);
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return util_err_set(err, KVLM_EFORMAT, "%s: \"%s\" = %lld is out of range (%lld..%lld)", path, key,
                            (long long)x, (long long)lo, (long long)hi);
    *out = (int)x;
    return KVLM_OK;
}

static int cfg_float(json_t *cfg, const char *path, const char *key, double def, double *out, kvlm_error *err) {
    json_t *v = json_object_get(cfg, key);
    *out = def;
    if (!v || json_is_null(v)) return KVLM_OK;
    if (!json_is_number(v)) return util_err_set(err, KVLM_EFORMAT, "%s: \"%s\" is not a number", path, key);
    double d = json_number_value(v);
    if (!isfinite(d) || !(d > 0) || !isfinite((float)d))
        return util_err_set(err, KVLM_EFORMAT, "%s: \"%s\" = %g must be finite and above 0", path, key, d);
    *out = d;
    return KVLM_OK;
}

static int cfg_bool(json_t *cfg, const char *path, const char *key, bool def, bool *out, kvlm_error *err) {
    json_t *v = json_object_get(cfg, key);
    *out = def;
    if (!v || json_is_null(v)) return KVLM_OK;
    if (!json_is_boolean(v)) return util_err_set(err, KVLM_EFORMAT, "%s: \"%s\" is not true or false", path, key);
    *out = json_is_true(v);
    return KVLM_OK;
}

/* A soft-capping key: absent, the default; null, none (0). */
static int cfg_softcap(json_t *cfg, const char *path, const char *key, double def, float *out, kvlm_error *err) {
    json_t *v = json_object_get(cfg, key);
    double d = 0;
    int rc = v && json_is_null(v) ? KVLM_OK : cfg_float(cfg, path, key, def, &d, err);
    *out = (float)d;
    return rc;
}

/* Gemma 2's and 3's keys, over model_swa_defaults' values (the GGUF
 * loader's): the window (gemma2: every other layer local from layer 0,
 * swa_period 2, as Gemma2DecoderLayer's is_sliding = not layer_idx % 2;
 * gemma3: sliding_window_pattern, 6, layer l global when (l + 1) % 6 == 0,
 * and layer_types if given must say the same), the soft-caps (gemma3: none
 * unless given), the local layers' RoPE base (gemma3's
 * rope_local_base_freq) and the attention scale 1/sqrt(query_pre_attn_scalar). */
/* config.json's layer_types against kvlm's layers (the last of every
 * swa_period global, as llama.cpp takes them): with `derive`, the period is
 * the first full_attention layer's place (OLMo 3's; none: every layer
 * local), else swa_period as set (Gemma 3's sliding_window_pattern). */
static int check_layer_types(kvlm_config *c, json_t *cfg, const char *path, bool derive, kvlm_error *err) {
    json_t *lt = json_object_get(cfg, "layer_types");
    if (!lt || json_is_null(lt)) return KVLM_OK;
    if (!json_is_array(lt) || (int)json_array_size(lt) != c->n_layers)
        return util_err_set(err, KVLM_EFORMAT, "%s: layer_types is not a list of the %d layers' kinds", path,
                            c->n_layers);
    bool *local = malloc((size_t)c->n_layers * sizeof *local);
    if (!local) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    int bad = -1; /* the first entry that is neither kind */
    for (int l = 0; l < c->n_layers; l++) {
        const char *k = json_string_value(json_array_get(lt, (size_t)l));
        local[l] = !k || strcmp(k, "full_attention");
        if (bad < 0 && (!k || (local[l] && strcmp(k, "sliding_attention")))) bad = l;
    }
    int off = model_swa_from_layers(c, local, derive);
    free(local);
    if (bad < 0 || (off >= 0 && off < bad)) bad = off;
    if (bad < 0) return KVLM_OK;
    bool global = c->swa_period > 0 && (bad + 1) % c->swa_period == 0;
    return util_err_set(err, KVLM_EUNSUPPORTED, "%s: layer_types[%d] is not \"%s\": kvlm (as llama.cpp) takes one "
                        "global layer in every %d (the last)", path, bad, global ? "full_attention" : "sliding_attention",
                        c->swa_period);
}

static int gemma_config(kvlm_config *c, json_t *cfg, const char *path, int window, kvlm_error *err) {
    int rc;
    bool g3 = c->arch == KVLM_ARCH_GEMMA3;
    c->sliding_window = window;
    if ((rc = cfg_softcap(cfg, path, "attn_logit_softcapping", g3 ? 0 : 50.0, &c->attn_softcap, err)) ||
        (rc = cfg_softcap(cfg, path, "final_logit_softcapping", g3 ? 0 : 30.0, &c->final_softcap, err)))
        return rc;
    if (g3) {
        double base;
        if ((rc = cfg_int(cfg, path, "sliding_window_pattern", false, 6, 1, 1 << 20, &c->swa_period, err)) ||
            (rc = cfg_float(cfg, path, "rope_local_base_freq", 10000.0, &base, err)))
            return rc;
        c->rope_base_local = (float)base;
        if ((rc = check_layer_types(c, cfg, path, false, err))) return rc;
    }
    json_t *q = json_object_get(cfg, "query_pre_attn_scalar");
    if (q && !json_is_null(q)) {
        double d;
        if ((rc = cfg_float(cfg, path, "query_pre_attn_scalar", 0, &d, err))) return rc;
        c->attn_scale = 1.0f / sqrtf((float)d);
    }
    return KVLM_OK;
}

/* A rope_scaling's "factor": present, a number, finite and above 0. */
static int scaling_factor(json_t *rs, const char *path, const char *type, double *out, kvlm_error *err) {
    if (!json_is_number(json_object_get(rs, "factor")))
        return util_err_set(err, KVLM_EFORMAT, "%s: rope_scaling %s has no \"factor\" (a number)", path, type);
    return cfg_float(rs, path, "factor", 1, out, err);
}

/* rope_scaling {"rope_type": "llama3", factor, low_freq_factor,
 * high_freq_factor, original_max_position_embeddings} (Llama 3.1 and 3.2):
 * the factors llama.cpp's converter writes as rope_freqs.weight, computed
 * here into the model (so `kvlm convert` writes them too). */
static int llama3_rope(struct kvlm_model *m, json_t *rs, const char *path, kvlm_error *err) {
    double factor, low, high, orig;
    int rc;
    if ((rc = scaling_factor(rs, path, "llama3", &factor, err)) ||
        (rc = cfg_float(rs, path, "low_freq_factor", 1, &low, err)) ||
        (rc = cfg_float(rs, path, "high_freq_factor", 4, &high, err)) ||
        (rc = cfg_float(rs, path, "original_max_position_embeddings", 8192, &orig, err)))
        return rc;
    if (!(high > low) || orig < 1) /* cfg_float took care of finite and above 0 */
        return util_err_set(err, KVLM_EFORMAT, "%s: rope_scaling llama3: factor %g, low_freq_factor %g, "
                            "high_freq_factor %g, original_max_position_embeddings %g (want factor > 0, high > "
                            "low > 0, a context of 1 or more)", path, factor, low, high, orig);
    const kvlm_config *c = &m->cfg;
    free(m->rope_freqs_own);
    if (!(m->rope_freqs_own = malloc(sizeof(float) * (size_t)(c->rope_dim / 2))))
        return util_err_set(err, KVLM_ENOMEM, "out of memory");
    model_llama3_rope_freqs(m->rope_freqs_own, c->rope_dim, c->rope_base, factor, low, high, orig);
    m->rope_freqs = (model_tensor){.data = m->rope_freqs_own, .type = DT_F32, .n_in = c->rope_dim / 2, .n_out = 1,
                                   .name = "rope_freqs.weight"};
    return model_set_rope_freqs(m, err);
}

/* rope_scaling {"rope_type": "yarn", factor, original_max_position_embeddings
 * (default: max_position_embeddings), beta_fast (32), beta_slow (1)} on a
 * llama or qwen2 (Qwen2.5's 128k): the GGUF loader's YaRN (model.c); an
 * attention_factor other than YaRN's own, DeepSeek's mscale keys or
 * truncate: false are refused. */
static int hf_yarn(kvlm_config *c, json_t *rs, const char *path, kvlm_error *err) {
    double factor, fast, slow, orig;
    int rc;
    if ((rc = scaling_factor(rs, path, "yarn", &factor, err)) || (rc = cfg_float(rs, path, "beta_fast", 32, &fast, err)) ||
        (rc = cfg_float(rs, path, "beta_slow", 1, &slow, err)) ||
        (rc = cfg_float(rs, path, "original_max_position_embeddings", c->n_ctx_train, &orig, err)))
        return rc;
    json_t *af = json_object_get(rs, "attention_factor"), *tr = json_object_get(rs, "truncate");
    if ((af && !json_is_null(af) &&
         (!json_is_number(af) || fabs(json_number_value(af) - (1 + 0.1 * log(factor))) > 1e-6)) ||
        json_object_get(rs, "mscale") || json_object_get(rs, "mscale_all_dim") || (tr && json_is_false(tr)))
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: rope_scaling yarn with attention_factor, mscale or truncate "
                            "of its own is not supported (YaRN's defaults are)", path);
    if (factor <= 1) return KVLM_OK;
    if (orig > (1 << 24)) return util_err_set(err, KVLM_EFORMAT, "%s: rope_scaling yarn: original context %g", path, orig);
    c->yarn_factor = (float)factor;
    c->yarn_orig_ctx = (int)orig;
    c->yarn_beta_fast = (float)fast;
    c->yarn_beta_slow = (float)slow;
    return KVLM_OK;
}

/* rope_scaling {"type": "longrope" (Phi-3.5; the older "su"), long_factor,
 * short_factor (rope_dim/2 numbers each), attention_factor} on a phi3, with
 * the config's original_max_position_embeddings (absent: the trained
 * context, and the factor rope_scaling's "factor"): the GGUF loader's
 * LongRoPE (model.c). The attention factor, when not given, is Hugging
 * Face's and llama.cpp's converter's sqrt(1 + ln factor / ln original),
 * factor = max_position_embeddings / original. The short factors serve a
 * context of at most the original length, as in llama.cpp (Hugging Face
 * switches when a sequence grows past it). */
static int hf_longrope(struct kvlm_model *m, json_t *cfg, json_t *rs, const char *path, kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    const int n = c->rope_dim / 2;
    const char *names[2] = {"long_factor", "short_factor"};
    free(m->longrope_own);
    if (!(m->longrope_own = malloc(sizeof(float) * (size_t)(2 * n))))
        return util_err_set(err, KVLM_ENOMEM, "out of memory");
    for (int k = 0; k < 2; k++) {
        json_t *a = json_object_get(rs, names[k]);
        if (!json_is_array(a) || (int)json_array_size(a) != n)
            return util_err_set(err, KVLM_EFORMAT, "%s: rope_scaling longrope: \"%s\" must be an array of %d numbers "
                                "(rope dimension %d / 2)", path, names[k], n, c->rope_dim);
        for (int i = 0; i < n; i++) {
            json_t *v = json_array_get(a, (size_t)i);
            double d = json_is_number(v) ? json_number_value(v) : -1;
            if (!(d > 0) || !isfinite((float)d))
                return util_err_set(err, KVLM_EFORMAT, "%s: rope_scaling longrope: %s[%d] is not a finite number "
                                    "above 0", path, names[k], i);
            m->longrope_own[k * n + i] = (float)d;
        }
    }
    double orig, factor = 1, af;
    int rc;
    json_t *o = json_object_get(cfg, "original_max_position_embeddings");
    if (o && !json_is_null(o)) {
        if ((rc = cfg_float(cfg, path, "original_max_position_embeddings", c->n_ctx_train, &orig, err))) return rc;
        factor = c->n_ctx_train / orig;
    } else {
        orig = c->n_ctx_train;
        json_t *f = json_object_get(rs, "factor");
        if (f && !json_is_null(f) && (rc = scaling_factor(rs, path, "longrope", &factor, err))) return rc;
    }
    if (orig < 1 || orig > (1 << 24))
        return util_err_set(err, KVLM_EFORMAT, "%s: rope_scaling longrope: original context %g (1 to 2^24)", path, orig);
    json_t *a = json_object_get(rs, "attention_factor");
    if (a && !json_is_null(a)) {
        if ((rc = cfg_float(rs, path, "attention_factor", 1, &af, err))) return rc;
    } else af = model_longrope_attn_factor(factor, orig);
    c->longrope_orig_ctx = (int)orig;
    c->longrope_attn_factor = (float)af;
    m->rope_long = (model_tensor){.data = m->longrope_own, .type = DT_F32, .n_in = n, .n_out = 1,
                                  .name = "rope_factors_long.weight"};
    m->rope_short = (model_tensor){.data = m->longrope_own + n, .type = DT_F32, .n_in = n, .n_out = 1,
                                   .name = "rope_factors_short.weight"};
    return model_set_rope_freqs(m, err);
}

/* SmolLM3's layers without RoPE: no_rope_layers (1: the layer turns q and k)
 * must be every no_rope_layer_interval-th layer off, with an interval of 4
 * (what llama.cpp's smollm3 takes, with no key for it). */
static int smollm3_nope(kvlm_config *c, json_t *cfg, const char *path, kvlm_error *err) {
    int every, rc;
    if ((rc = cfg_int(cfg, path, "no_rope_layer_interval", false, 4, 1, 1 << 20, &every, err))) return rc;
    json_t *a = json_object_get(cfg, "no_rope_layers");
    bool ok = every == 4 && (!a || json_is_null(a) || (json_is_array(a) && (int)json_array_size(a) == c->n_layers));
    for (int l = 0; ok && a && json_is_array(a) && l < c->n_layers; l++) {
        json_t *v = json_array_get(a, (size_t)l);
        ok = json_is_integer(v) && json_integer_value(v) == ((l + 1) % every != 0);
    }
    if (!ok)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: no_rope_layers / no_rope_layer_interval %d: kvlm (as llama.cpp) "
                            "takes RoPE off every fourth layer only", path, every);
    c->no_rope_period = 4;
    return KVLM_OK;
}

/* The mixtures of experts: Mixtral (num_local_experts, num_experts_per_tok,
 * each expert intermediate_size wide) and Qwen3-MoE (num_experts,
 * num_experts_per_tok, moe_intermediate_size; experts in every layer:
 * decoder_sparse_step 1, no mlp_only_layers; norm_topk_prob true, as
 * llama.cpp's qwen3moe always renormalises); routing as the GGUF loader's. */
static bool hf_mixtral(const hf_family *f) { return !strcmp(f->model_type, "mixtral"); }
static bool hf_moe(const hf_family *f) {
    return hf_mixtral(f) || !strcmp(f->model_type, "qwen3_moe") || !strcmp(f->model_type, "qwen2_moe") ||
           f->arch == KVLM_ARCH_GRANITEMOE;
}

static int moe_config(kvlm_config *c, const hf_family *fam, json_t *cfg, const char *path, kvlm_error *err) {
    int rc, step;
    bool norm;
    bool gm = fam->arch == KVLM_ARCH_GRANITEMOE, mx = hf_mixtral(fam) || gm; /* Mixtral's keys and widths */
    if ((rc = cfg_int(cfg, path, mx ? "num_local_experts" : "num_experts", true, 0, 1, 1024, &c->n_expert, err)) ||
        (rc = cfg_int(cfg, path, "num_experts_per_tok", true, 0, 1, c->n_expert, &c->n_expert_used, err)))
        return rc;
    c->expert_ff = c->hidden_dim;
    bool q2 = fam->arch == KVLM_ARCH_QWEN2MOE;
    if (!mx) {
        json_t *mlp_only = json_object_get(cfg, "mlp_only_layers");
        if ((rc = cfg_int(cfg, path, "moe_intermediate_size", true, 0, 1, 1 << 20, &c->expert_ff, err)) ||
            (rc = cfg_int(cfg, path, "decoder_sparse_step", false, 1, 1, 1 << 20, &step, err)) ||
            (rc = cfg_bool(cfg, path, "norm_topk_prob", false, &norm, err)))
            return rc;
        bool dense = mlp_only && !json_is_null(mlp_only) && (!json_is_array(mlp_only) || json_array_size(mlp_only));
        if (step != 1 || dense || norm == q2)
            return util_err_set(err, KVLM_EUNSUPPORTED, "%s: %s with %s is not supported (experts in every layer, "
                                "their weights %srenormalised, as llama.cpp's %s)", path, fam->model_type,
                                step != 1 ? "decoder_sparse_step other than 1" : dense ? "mlp_only_layers"
                                : q2 ? "norm_topk_prob true" : "norm_topk_prob false", q2 ? "not " : "",
                                q2 ? "qwen2moe" : "qwen3moe");
        if (q2 && (rc = cfg_int(cfg, path, "shared_expert_intermediate_size", true, 0, 1, 1 << 20, &c->expert_shared_ff,
                                err)))
            return rc;
    }
    /* MoE Shared: a shared expert shared_intermediate_size wide (0: none) */
    if (gm && (rc = cfg_int(cfg, path, "shared_intermediate_size", false, 0, 0, 1 << 20, &c->expert_shared_ff, err)))
        return rc;
    model_moe_topk_routing(c);
    return KVLM_OK;
}

static int read_config(struct kvlm_model *m, json_t *cfg, const char *path, const hf_family **famp, bool *tied,
                       kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    json_t *mt = json_object_get(cfg, "model_type");
    if (!json_is_string(mt)) return util_err_set(err, KVLM_EFORMAT, "%s: no \"model_type\" string", path);
    const char *type = json_string_value(mt);
    const hf_family *fam = NULL;
    for (size_t i = 0; i < sizeof k_families / sizeof k_families[0]; i++)
        if (!strcmp(type, k_families[i].model_type)) fam = &k_families[i];
    if (!fam)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: model_type \"%.40s\" is not supported (supported: llama, "
                            "mistral, mixtral, smollm3, granite, granitemoe, granitemoeshared, olmo2, olmo3, qwen2, qwen2_moe, qwen3, qwen3_moe, "
                            "phi3, gemma2, "
                            "gemma3_text)", path, type);
    *famp = fam;
    snprintf(m->hf->family, sizeof m->hf->family, "%s", fam->model_type);
    if (json_object_get(cfg, "quantization_config"))
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: quantized checkpoints (quantization_config: GPTQ, AWQ, "
                            "bitsandbytes, ...) are not supported; F32, F16 and BF16 safetensors are", path);
    int rc;
    const int big = 1 << 20;
    if ((rc = cfg_int(cfg, path, "hidden_size", true, 0, 1, big, &c->dim, err)) ||
        (rc = cfg_int(cfg, path, "intermediate_size", true, 0, 1, big, &c->hidden_dim, err)) ||
        (rc = cfg_int(cfg, path, "num_hidden_layers", true, 0, 1, 4096, &c->n_layers, err)) ||
        (rc = cfg_int(cfg, path, "num_attention_heads", true, 0, 1, big, &c->n_heads, err)) ||
        (rc = cfg_int(cfg, path, "vocab_size", true, 0, 1, 1 << 24, &c->vocab_size, err)))
        return rc;
    if ((rc = cfg_int(cfg, path, "num_key_value_heads", false, c->n_heads, 1, big, &c->n_kv_heads, err))) return rc;
    if (c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads)
        return util_err_set(err, KVLM_EFORMAT, "%s: num_key_value_heads %d does not divide num_attention_heads %d",
                            path, c->n_kv_heads, c->n_heads);
    if ((rc = cfg_int(cfg, path, "head_dim", false, c->dim / c->n_heads, 1, 1024, &c->head_dim, err))) return rc;
    if (c->head_dim <= 0 || (c->head_dim & 1))
        return util_err_set(err, KVLM_EFORMAT, "%s: head dimension %d is not supported (hidden_size %d, %d heads)",
                            path, c->head_dim, c->dim, c->n_heads);
    if ((rc = cfg_int(cfg, path, "max_position_embeddings", false, 2048, 1, INT32_MAX, &c->n_ctx_train, err)))
        return rc;
    if (c->n_ctx_train > (1 << 24)) c->n_ctx_train = 1 << 24;
    double d;
    if ((rc = cfg_float(cfg, path, "rope_theta", 10000.0, &d, err))) return rc;
    c->rope_base = (float)d;
    if ((rc = cfg_float(cfg, path, "rms_norm_eps", 1e-6, &d, err))) return rc;
    c->norm_eps = (float)d;
    c->rope_dim = c->head_dim;
    json_t *prf = json_object_get(cfg, "partial_rotary_factor");
    if (prf && !json_is_null(prf) && (!json_is_number(prf) || json_number_value(prf) != 1.0)) {
        /* phi3 (Phi-4-mini: 0.75): the first head_dim x factor dimensions of
         * each head turn, NeoX-paired among themselves, as GGUF's
         * rope.dimension_count says; Hugging Face takes int(head_dim x factor) */
        double f = json_is_number(prf) ? json_number_value(prf) : -1;
        int rd = f > 0 && f < 1 ? (int)(c->head_dim * f) : 0;
        if (fam->arch != KVLM_ARCH_PHI3)
            return util_err_set(err, KVLM_EUNSUPPORTED, "%s: partial_rotary_factor other than 1 is supported for phi3 "
                                "only", path);
        if (rd < 2 || (rd & 1))
            return util_err_set(err, KVLM_EFORMAT, "%s: partial_rotary_factor %g of head dimension %d: want a factor "
                                "in (0, 1] that leaves an even number of rotated dimensions", path, f, c->head_dim);
        c->rope_dim = rd;
    }
    json_t *rs = json_object_get(cfg, "rope_scaling");
    if (rs && !json_is_null(rs)) {
        json_t *rt = json_object_get(rs, "rope_type");
        if (!rt) rt = json_object_get(rs, "type");
        const char *t = json_is_string(rt) ? json_string_value(rt) : "?";
        json_t *f = json_object_get(rs, "factor");
        if (!strcmp(t, "llama3")) {
            if ((rc = llama3_rope(m, rs, path, err))) return rc;
        } else if (!strcmp(t, "linear")) {
            double lf;
            if ((rc = scaling_factor(rs, path, "linear", &lf, err))) return rc;
            c->rope_linear = lf != 1 ? (float)lf : 0.0f;
            if ((rc = model_set_rope_freqs(m, err))) return rc;
        } else if (!strcmp(t, "yarn") && model_yarn_arch(fam->arch)) {
            if ((rc = hf_yarn(c, rs, path, err))) return rc;
        } else if ((!strcmp(t, "longrope") || !strcmp(t, "su")) && fam->arch == KVLM_ARCH_PHI3) {
            if ((rc = hf_longrope(m, cfg, rs, path, err))) return rc;
        } else if (strcmp(t, "default"))
            return util_err_set(err, KVLM_EUNSUPPORTED, "%s: rope_scaling of type \"%.32s\" (factor %g) is not "
                                "supported: kvlm applies plain RoPE (rope_theta only), linear, Llama 3.1's (llama3), yarn "
                                "(llama, qwen2, qwen3) or longrope (phi3)",
                                path, t, json_is_number(f) ? json_number_value(f) : 0.0);
    }
    const char *act_key = fam->post_norms ? "hidden_activation" : "hidden_act";
    json_t *act = json_object_get(cfg, act_key);
    if (!act && fam->post_norms) act = json_object_get(cfg, "hidden_act");
    if (act && !json_is_null(act) && (!json_is_string(act) || strcmp(json_string_value(act), fam->act)))
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: %s \"%.32s\" is not supported for %s (%s is)", path, act_key,
                            json_is_string(act) ? json_string_value(act) : "?", fam->model_type, fam->act);
    bool b;
    if ((rc = cfg_bool(cfg, path, "attention_bias", false, &b, err))) return rc;
    if (b && !fam->qkv_bias)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: attention_bias is not supported for %s", path, type);
    if ((rc = cfg_bool(cfg, path, "mlp_bias", false, &b, err))) return rc;
    if (b) return util_err_set(err, KVLM_EUNSUPPORTED, "%s: mlp_bias is not supported", path);
    if ((rc = cfg_bool(cfg, path, "tie_word_embeddings", fam->tie_default, tied, err))) return rc;
    c->arch = (kvlm_arch)fam->arch;
    c->rope_neox = fam->rotate_half || !model_llama_rows(fam->arch);
    c->qk_norm_full = fam->arch == KVLM_ARCH_OLMO2;
    if (hf_moe(fam) && (rc = moe_config(c, fam, cfg, path, err))) return rc;
    if (fam->arch == KVLM_ARCH_SMOLLM3 && (rc = smollm3_nope(c, cfg, path, err))) return rc;
    model_swa_defaults(c); /* as the GGUF loader: then config.json's keys override */
    if (model_granite_like(fam->arch)) {
        double d[4];
        if ((rc = cfg_float(cfg, path, "embedding_multiplier", 1, &d[0], err)) ||
            (rc = cfg_float(cfg, path, "residual_multiplier", 1, &d[1], err)) ||
            (rc = cfg_float(cfg, path, "attention_multiplier", 1, &d[2], err)) ||
            (rc = cfg_float(cfg, path, "logits_scaling", 1, &d[3], err)))
            return rc;
        c->embed_mult = (float)d[0], c->residual_mult = (float)d[1], c->attn_scale = (float)d[2];
        c->logit_div = (float)d[3];
    }
    if (c->yarn_factor > 0) { /* its factors and magnitude, once the arch and the attention scale are set */
        c->attn_scale *= model_yarn_mscale2(c);
        if ((rc = model_set_rope_freqs(m, err))) return rc;
    }
    /* Sliding-window attention is recorded, not applied (docs/hf-checkpoints.md),
     * except for gemma2, whose forward pass has local layers. */
    bool use_sw = true;
    if ((rc = cfg_bool(cfg, path, "use_sliding_window", true, &use_sw, err))) return rc;
    int sw = 0;
    if ((rc = cfg_int(cfg, path, "sliding_window", false, c->sliding_window, 0, 1 << 24, &sw, err))) return rc;
    m->hf->sliding_window = use_sw ? sw : 0;
    if (!strcmp(fam->model_type, "olmo3")) { /* OLMo 3: three local layers to one global, or as layer_types says */
        c->sliding_window = m->hf->sliding_window;
        c->swa_period = 4;
        if ((rc = check_layer_types(c, cfg, path, true, err))) return rc;
    } else if (fam->post_norms) {
        if ((rc = gemma_config(c, cfg, path, m->hf->sliding_window, err))) return rc;
    } else if (m->hf->sliding_window && m->hf->sliding_window < c->n_ctx_train)
        LOG_INFO("%s: sliding_window %d recorded, not applied: kvlm attends to the whole context (as llama.cpp "
                 "does for %s)", path, m->hf->sliding_window, type);
    model_swa_count(c);
    snprintf(m->arch_name, sizeof m->arch_name, "%s", model_arch_name(c->arch));
    return KVLM_OK;
}

/* ---- tensors --------------------------------------------------------------- */

static const char *shape_str(const st_tensor *t, char *buf, size_t cap) {
    size_t o = 0;
    buf[0] = 0;
    for (int i = 0; i < t->n_dims && o + 24 < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    return buf;
}

/* A text model's tensor name ("model.*", "lm_head.weight") as the
 * directory stores it (model_hf.lm_model, lm_head), in buf. */
static const char *lm_name(const model_hf *h, const char *name, char *buf, size_t cap) {
    if (!h->lm_model) return name;
    if (!strncmp(name, "model.", 6)) snprintf(buf, cap, "%s%s", h->lm_model, name + 6);
    else if (!strcmp(name, "lm_head.weight")) snprintf(buf, cap, "%s", h->lm_head);
    else return name;
    return buf;
}

/* Takes tensor `name` (lm_name) as t: a matrix of n_out rows of n_in (HF
 * shape [n_out, n_in]) used in place, or (n_out 0) a vector of n_in widened
 * to an f32 copy, plus `add` (gemma's + 1); or (n_stack > 0) a stack of
 * n_stack such matrices as one of n_stack * n_out rows. The shape is checked
 * against config.json's. */
static int take_any(struct kvlm_model *m, model_tensor *t, const char *name, int64_t n_stack, int64_t n_in,
                    int64_t n_out, bool optional, float add, kvlm_error *err) {
    memset(t, 0, sizeof *t);
    char full[256];
    name = lm_name(m->hf, name, full, sizeof full);
    const st_tensor *s = st_set_find(m->hf->st, name);
    if (!s) {
        if (optional) return KVLM_OK;
        return util_err_set(err, KVLM_EFORMAT, "%s: missing tensor %s (in none of the safetensors files)", m->path,
                            name);
    }
    bool vec = n_out == 0;
    bool ok = vec            ? s->n_dims == 1 && s->shape[0] == n_in
              : n_stack > 0 ? s->n_dims == 3 && s->shape[0] == n_stack && s->shape[1] == n_out && s->shape[2] == n_in
                            : s->n_dims == 2 && s->shape[0] == n_out && s->shape[1] == n_in;
    char sh[96];
    if (!ok) {
        if (vec)
            return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: shape [%s], expected [%lld] (config.json)", m->path,
                                name, shape_str(s, sh, sizeof sh), (long long)n_in);
        if (n_stack > 0)
            return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: shape [%s], expected [%lld, %lld, %lld] "
                                "(config.json)", m->path, name, shape_str(s, sh, sizeof sh), (long long)n_stack,
                                (long long)n_out, (long long)n_in);
        return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: shape [%s], expected [%lld, %lld] (config.json)",
                            m->path, name, shape_str(s, sh, sizeof sh), (long long)n_out, (long long)n_in);
    }
    if (n_stack > 0) n_out *= n_stack;
    int type = s->dtype == ST_F32 ? DT_F32 : s->dtype == ST_F16 ? DT_F16 : s->dtype == ST_BF16 ? DT_BF16 : -1;
    if (type < 0)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: tensor %s: dtype %s is not supported (F32, F16 and BF16 are)",
                            m->path, name, st_dtype_name(s->dtype));
    t->name = s->name;
    t->n_in = n_in;
    t->n_out = vec ? 1 : n_out;
    if (vec) {
        float *f = own(m->hf, (size_t)n_in * sizeof *f);
        if (!f) return util_err_set(err, KVLM_ENOMEM, "out of memory");
        const uint8_t *p = s->data;
        for (int64_t i = 0; i < n_in; i++) {
            if (type == DT_F32) memcpy(&f[i], p + 4 * i, 4);
            else {
                uint16_t hb;
                memcpy(&hb, p + 2 * i, 2);
                f[i] = type == DT_F16 ? dt_f16_to_f32(hb) : dt_bf16_to_f32(hb);
            }
            f[i] += add;
        }
        t->data = f;
        t->type = DT_F32;
        return KVLM_OK;
    }
    t->type = type;
    t->data = s->data;
    /* Headers are padded so data lands aligned; a file that is not gets a copy
     * (the kernels read whole elements). */
    if ((uintptr_t)s->data % st_dtype_size(s->dtype)) {
        void *b = own(m->hf, s->nbytes);
        if (!b) return util_err_set(err, KVLM_ENOMEM, "out of memory");
        memcpy(b, s->data, s->nbytes);
        t->data = b;
    }
    return KVLM_OK;
}

static int take(struct kvlm_model *m, model_tensor *t, const char *name, int64_t n_in, int64_t n_out, bool optional,
                float add, kvlm_error *err) {
    return take_any(m, t, name, 0, n_in, n_out, optional, add, err);
}

/* GraniteMoe's experts: [n_stack, n_out, n_in] */
static int take_stack(struct kvlm_model *m, model_tensor *t, const char *name, int64_t n_stack, int64_t n_in,
                      int64_t n_out, kvlm_error *err) {
    return take_any(m, t, name, n_stack, n_in, n_out, false, 0, err);
}

/* Tensors model.layers.N.* (the language model's) must have N < num_hidden_layers. */
static int check_layers(const struct kvlm_model *m, kvlm_error *err) {
    const st_set *s = m->hf->st;
    char pre[64];
    const char *p = lm_name(m->hf, "model.layers.", pre, sizeof pre);
    size_t pn = strlen(p);
    for (int i = 0; i < s->n_index; i++) {
        const char *n = s->index[i]->name;
        if (strncmp(n, p, pn)) continue;
        char *end;
        errno = 0;
        unsigned long long l = strtoull(n + pn, &end, 10);
        if (end != n + pn && *end == '.' && !errno && l >= (unsigned long long)m->cfg.n_layers)
            return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s belongs to layer %llu, but config.json has "
                                "num_hidden_layers %d", m->path, n, l, m->cfg.n_layers);
    }
    return KVLM_OK;
}

/* Layer l's experts, each its own rows x n_in tensor (name: fmt with l and
 * the expert), copied into one stack in model_take_experts' layout (expert
 * e: rows e x rows onwards), the dtype of the first. */
static int stack_experts(struct kvlm_model *m, model_tensor *t, const char *fmt, int l, int64_t n_in, int64_t rows,
                         kvlm_error *err) {
    int E = m->cfg.n_expert, rc;
    uint8_t *buf = NULL;
    size_t each = 0;
    char n[192];
    for (int e = 0; e < E; e++) {
        model_tensor x;
        snprintf(n, sizeof n, fmt, l, e);
        if ((rc = take(m, &x, n, n_in, rows, false, 0, err))) return rc;
        if (e == 0) {
            *t = (model_tensor){.type = x.type, .n_in = n_in, .n_out = rows * E, .name = x.name};
            each = dt_row_size(x.type, (int)n_in) * (size_t)rows;
            if (!(buf = own(m->hf, each * (size_t)E))) return util_err_set(err, KVLM_ENOMEM, "out of memory");
            t->data = buf;
        } else if (x.type != t->type)
            return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: %s, but expert 0 of its layer is %s", m->path, n,
                                dt_info(x.type)->name, dt_info(t->type)->name);
        memcpy(buf + (size_t)e * each, x.data, each);
    }
    return KVLM_OK;
}

/* GraniteMoe's layer l: the router, every expert's gate then up rows in one
 * [experts, 2 x width, hidden] input_linear (copied apart into the gate and
 * up stacks), their down rows in output_linear (the down stack as it is);
 * MoE Shared's shared_mlp: gate then up rows of one input_linear (row views)
 * and output_linear. */
static int granite_experts(struct kvlm_model *m, model_layer *L, int l, kvlm_error *err) {
    const kvlm_config *c = &m->cfg;
    const int64_t E = c->n_expert, F = c->expert_ff, D = c->dim;
    char n[160];
    model_tensor in;
    int rc;
    snprintf(n, sizeof n, "model.layers.%d.block_sparse_moe.router.layer.weight", l);
    if ((rc = take(m, &L->ffn_gate_inp, n, D, E, false, 0, err))) return rc;
    snprintf(n, sizeof n, "model.layers.%d.block_sparse_moe.input_linear.weight", l);
    if ((rc = take_stack(m, &in, n, E, D, 2 * F, err))) return rc;
    snprintf(n, sizeof n, "model.layers.%d.block_sparse_moe.output_linear.weight", l);
    if ((rc = take_stack(m, &L->down_exps, n, E, F, D, err))) return rc;
    size_t half = dt_row_size(in.type, (int)D) * (size_t)F;
    uint8_t *g = own(m->hf, half * (size_t)E), *u = own(m->hf, half * (size_t)E);
    if (!g || !u) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    for (int64_t e = 0; e < E; e++) {
        memcpy(g + (size_t)e * half, (const uint8_t *)in.data + (size_t)e * 2 * half, half);
        memcpy(u + (size_t)e * half, (const uint8_t *)in.data + (size_t)e * 2 * half + half, half);
    }
    L->gate_exps = L->up_exps = in;
    L->gate_exps.data = g;
    L->up_exps.data = u;
    L->gate_exps.n_out = L->up_exps.n_out = E * F;
    if (c->expert_shared_ff <= 0) return KVLM_OK;
    const int64_t S = c->expert_shared_ff;
    snprintf(n, sizeof n, "model.layers.%d.shared_mlp.input_linear.weight", l);
    if ((rc = take(m, &in, n, D, 2 * S, false, 0, err))) return rc;
    L->gate_shexp = model_tensor_rows(&in, 0, S);
    L->up_shexp = model_tensor_rows(&in, S, S);
    snprintf(n, sizeof n, "model.layers.%d.shared_mlp.output_linear.weight", l);
    return take(m, &L->down_shexp, n, S, D, false, 0, err);
}

static int load_weights(struct kvlm_model *m, const hf_family *fam, bool tied, kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    int rc;
    float add = fam->norm_plus_one ? 1.0f : 0.0f;
    if ((rc = check_layers(m, err))) return rc;
    if ((rc = take(m, &m->tok_embd, "model.embed_tokens.weight", c->dim, c->vocab_size, false, 0, err)) ||
        (rc = take(m, &m->output_norm, "model.norm.weight", c->dim, 0, false, add, err)))
        return rc;
    if (tied) m->output = m->tok_embd; /* a stored lm_head.weight is the same matrix */
    else if ((rc = take(m, &m->output, "lm_head.weight", c->dim, c->vocab_size, false, 0, err))) return rc;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    int64_t q_dim = (int64_t)c->n_heads * c->head_dim, kv_dim = (int64_t)c->n_kv_heads * c->head_dim;
    for (int l = 0; l < c->n_layers; l++) {
        model_layer *L = &m->layers[l];
        char n[160];
#define TAKE(field, suffix, nin, nout, opt, plus)                                   \
    snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);                         \
    if ((rc = take(m, &L->field, n, nin, nout, opt, plus, err))) return rc;
        if (fam->ffn_norm) { TAKE(attn_norm, "input_layernorm.weight", c->dim, 0, false, add); }
        if (fam->fused) {
            /* phi3: rows Q, K, V of one matrix; gate then up of another */
            model_tensor f;
            snprintf(n, sizeof n, "model.layers.%d.self_attn.qkv_proj.weight", l);
            if ((rc = take(m, &f, n, c->dim, q_dim + 2 * kv_dim, false, 0, err))) return rc;
            L->wq = model_tensor_rows(&f, 0, q_dim);
            L->wk = model_tensor_rows(&f, q_dim, kv_dim);
            L->wv = model_tensor_rows(&f, q_dim + kv_dim, kv_dim);
            snprintf(n, sizeof n, "model.layers.%d.mlp.gate_up_proj.weight", l);
            if ((rc = take(m, &f, n, c->dim, 2 * (int64_t)c->hidden_dim, false, 0, err))) return rc;
            L->w_gate = model_tensor_rows(&f, 0, c->hidden_dim);
            L->w_up = model_tensor_rows(&f, c->hidden_dim, c->hidden_dim);
        } else {
            TAKE(wq, "self_attn.q_proj.weight", c->dim, q_dim, false, 0);
            TAKE(wk, "self_attn.k_proj.weight", c->dim, kv_dim, false, 0);
            TAKE(wv, "self_attn.v_proj.weight", c->dim, kv_dim, false, 0);
            if (!hf_moe(fam)) {
                TAKE(w_gate, "mlp.gate_proj.weight", c->dim, c->hidden_dim, false, 0);
                TAKE(w_up, "mlp.up_proj.weight", c->dim, c->hidden_dim, false, 0);
            }
        }
        if (fam->arch == KVLM_ARCH_GRANITEMOE) {
            if ((rc = granite_experts(m, L, l, err))) return rc;
        } else if (hf_moe(fam)) { /* the router, then each expert's three matrices stacked */
            bool mx = hf_mixtral(fam);
            const char *p = mx ? "model.layers.%d.block_sparse_moe.experts.%d." : "model.layers.%d.mlp.experts.%d.";
            char g[160], u[160], d[160];
            snprintf(g, sizeof g, "%s%s", p, mx ? "w1.weight" : "gate_proj.weight");
            snprintf(u, sizeof u, "%s%s", p, mx ? "w3.weight" : "up_proj.weight");
            snprintf(d, sizeof d, "%s%s", p, mx ? "w2.weight" : "down_proj.weight");
            TAKE(ffn_gate_inp, mx ? "block_sparse_moe.gate.weight" : "mlp.gate.weight", c->dim, c->n_expert, false, 0);
            if ((rc = stack_experts(m, &L->gate_exps, g, l, c->dim, c->expert_ff, err)) ||
                (rc = stack_experts(m, &L->up_exps, u, l, c->dim, c->expert_ff, err)) ||
                (rc = stack_experts(m, &L->down_exps, d, l, c->expert_ff, c->dim, err)))
                return rc;
            if (fam->arch == KVLM_ARCH_QWEN2MOE) { /* the shared expert; its gate a 1 x dim matrix, read as dim weights */
                int64_t sf = c->expert_shared_ff;
                TAKE(gate_shexp, "mlp.shared_expert.gate_proj.weight", c->dim, sf, false, 0);
                TAKE(up_shexp, "mlp.shared_expert.up_proj.weight", c->dim, sf, false, 0);
                TAKE(down_shexp, "mlp.shared_expert.down_proj.weight", sf, c->dim, false, 0);
                TAKE(ffn_gate_inp_shexp, "mlp.shared_expert_gate.weight", c->dim, 1, false, 0);
                float *w = own(m->hf, sizeof(float) * (size_t)c->dim); /* the engine reads f32 weights, as GGUF's */
                if (!w) return util_err_set(err, KVLM_ENOMEM, "out of memory");
                dt_dequantize_row(L->ffn_gate_inp_shexp.type, L->ffn_gate_inp_shexp.data, w, c->dim);
                L->ffn_gate_inp_shexp.data = w;
                L->ffn_gate_inp_shexp.type = DT_F32;
            }
        }
        TAKE(wo, "self_attn.o_proj.weight", q_dim, c->dim, false, 0);
        TAKE(bq, "self_attn.q_proj.bias", q_dim, 0, !fam->qkv_bias, 0);
        TAKE(bk, "self_attn.k_proj.bias", kv_dim, 0, !fam->qkv_bias, 0);
        TAKE(bv, "self_attn.v_proj.bias", kv_dim, 0, !fam->qkv_bias, 0);
        if (fam->ffn_norm) {
            snprintf(n, sizeof n, "model.layers.%d.%s.weight", l, fam->ffn_norm);
            if ((rc = take(m, &L->ffn_norm, n, c->dim, 0, false, add, err))) return rc;
        }
        if (!hf_moe(fam)) { TAKE(w_down, "mlp.down_proj.weight", c->hidden_dim, c->dim, false, 0); }
        if (fam->post_norms || !fam->ffn_norm) {
            TAKE(post_attn_norm, "post_attention_layernorm.weight", c->dim, 0, false, add);
            TAKE(post_ffn_norm, "post_feedforward_layernorm.weight", c->dim, 0, false, add);
        }
        if (fam->qk_norm) { /* one head's (olmo2: all of q's, all of k's); gemma3's + 1 too */
            int64_t qn = c->qk_norm_full ? q_dim : c->head_dim, kn = c->qk_norm_full ? kv_dim : c->head_dim;
            TAKE(q_norm, "self_attn.q_norm.weight", qn, 0, false, add);
            TAKE(k_norm, "self_attn.k_norm.weight", kn, 0, false, add);
        }
        model_layer_swa(c, L, l);
#undef TAKE
        if (!fam->qkv_bias) {
            /* a bias the family does not use would be silently dropped */
            const char *b[] = {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                               "self_attn.o_proj.bias"};
            for (int i = 0; i < 4; i++) {
                char full[256];
                snprintf(n, sizeof n, "model.layers.%d.%s", l, b[i]);
                const char *fn = lm_name(m->hf, n, full, sizeof full);
                if (st_set_find(m->hf->st, fn))
                    return util_err_set(err, KVLM_EUNSUPPORTED, "%s: tensor %s: biases are not supported for %s",
                                        m->path, fn, fam->model_type);
            }
        }
    }
    c->weight_type = m->layers[0].wq.type;
    m->weight_bytes = m->hf->st->total_bytes;
    return KVLM_OK;
}

/* Multimodal directories whose language model is a family kvlm reads:
 * Gemma 3 4B, 12B and 27B (model_type "gemma3", Gemma3ForConditionalGeneration)
 * and Mistral Small 3.1 / 3.2 ("mistral3", Mistral3ForConditionalGeneration,
 * a mistral or llama text model). kvlm reads the language model and leaves
 * the vision tower and projector unread. Its keys are text_config's, which
 * the files give only where they differ from the text class's defaults
 * (Gemma 3 4B's lists no head counts), so *cfg becomes those defaults
 * updated with text_config; *mm set. Other configs pass. */
static json_t *text_defaults(const char *outer, const char *inner) {
    if (!strcmp(outer, "gemma3")) /* Gemma3TextConfig's; tied, as those models are */
        return json_pack("{s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:s, s:i, s:f, s:f, s:f, s:i, s:i, s:i, s:b}",
                         "vocab_size", 262208, "hidden_size", 2304, "intermediate_size", 9216, "num_hidden_layers", 26,
                         "num_attention_heads", 8, "num_key_value_heads", 4, "head_dim", 256, "hidden_activation",
                         "gelu_pytorch_tanh", "max_position_embeddings", 131072, "rms_norm_eps", 1e-6, "rope_theta", 1e6,
                         "rope_local_base_freq", 1e4, "query_pre_attn_scalar", 256, "sliding_window", 4096,
                         "sliding_window_pattern", 6, "tie_word_embeddings", 1);
    bool mistral = !strcmp(inner, "mistral"); /* MistralConfig's, else LlamaConfig's */
    return json_pack("{s:i, s:i, s:i, s:i, s:i, s:i, s:s, s:i, s:f, s:f, s:b}", "vocab_size", 32000, "hidden_size",
                     4096, "intermediate_size", mistral ? 14336 : 11008, "num_hidden_layers", 32, "num_attention_heads",
                     32, "num_key_value_heads", mistral ? 8 : 32, "hidden_act", "silu", "max_position_embeddings",
                     mistral ? 131072 : 2048, "rms_norm_eps", 1e-6, "rope_theta", 10000.0, "tie_word_embeddings", 0);
}

static int multimodal_text_config(json_t **cfg, const char *path, bool *mm, kvlm_error *err) {
    json_t *mt = json_object_get(*cfg, "model_type");
    const char *outer = json_string_value(mt);
    if (!outer || (strcmp(outer, "gemma3") && strcmp(outer, "mistral3"))) return KVLM_OK;
    json_t *text = json_object_get(*cfg, "text_config");
    if (!json_is_object(text))
        return util_err_set(err, KVLM_EFORMAT, "%s: model_type \"%s\" (multimodal) without a \"text_config\" "
                            "object", path, outer);
    const char *inner = json_string_value(json_object_get(text, "model_type"));
    bool g3 = !strcmp(outer, "gemma3");
    if (!g3 && (!inner || (strcmp(inner, "mistral") && strcmp(inner, "llama"))))
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: mistral3's text_config.model_type \"%.32s\" is not read "
                            "(mistral and llama are)", path, inner ? inner : "?");
    json_t *tc = text_defaults(outer, g3 ? "gemma3_text" : inner);
    if (!tc || json_object_update(tc, text) ||
        json_object_set_new(tc, "model_type", json_string(g3 ? "gemma3_text" : inner))) {
        json_decref(tc);
        return util_err_set(err, KVLM_ENOMEM, "out of memory");
    }
    /* what the top level says of the weights still applies */
    const char *top[] = {"quantization_config", "torch_dtype", "tie_word_embeddings"};
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        if (json_object_get(*cfg, top[i]) && !json_object_get(text, top[i]))
            json_object_set(tc, top[i], json_object_get(*cfg, top[i]));
    json_decref(*cfg);
    *cfg = tc;
    *mm = true;
    return KVLM_OK;
}

int model_hf_load(struct kvlm_model *m, const char *dir, bool vocab_only, kvlm_error *err) {
    if (!(m->hf = calloc(1, sizeof *m->hf))) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    size_t len = strlen(m->path);
    while (len > 1 && m->path[len - 1] == '/') m->path[--len] = 0; /* "dir/" names the model "dir" */
    dir = m->path;
    if (vocab_only) {
        int rc = vocab_from_hf(dir, 0, &m->vocab, err);
        m->cfg.vocab_size = m->vocab.n_tokens;
        return rc;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_error_t je;
    json_t *cfg = json_load_file(path, 0, &je);
    if (!cfg) {
        if (access(path, F_OK) != 0)
            return util_err_set(err, KVLM_EIO, "%s: no config.json: not a Hugging Face model directory", dir);
        return util_err_set(err, KVLM_EFORMAT, "%s: not valid JSON (line %d: %s)", path, je.line, je.text);
    }
    const hf_family *fam = NULL;
    bool tied = false, mm = false;
    char mm_type[32]; /* the directory's own model_type, before a multimodal one gives way to its text model's */
    const char *outer = json_is_object(cfg) ? json_string_value(json_object_get(cfg, "model_type")) : NULL;
    snprintf(mm_type, sizeof mm_type, "%s", outer ? outer : "");
    int rc = json_is_object(cfg) ? multimodal_text_config(&cfg, path, &mm, err)
                                 : util_err_set(err, KVLM_EFORMAT, "%s: not a JSON object", path);
    if (!rc) rc = read_config(m, cfg, path, &fam, &tied, err);
    json_decref(cfg);
    if (rc) return rc;
    if (mm) snprintf(m->hf->family, sizeof m->hf->family, "%s", mm_type);
    if (!(m->hf->st = st_set_open_dir(dir, m->map_flags, err))) return err ? err->code : KVLM_EFORMAT;
    if (mm) { /* where the language model's tensors are */
        if (st_set_find(m->hf->st, "language_model.model.embed_tokens.weight"))
            m->hf->lm_model = "language_model.model.", m->hf->lm_head = "language_model.lm_head.weight";
        else if (st_set_find(m->hf->st, "model.language_model.embed_tokens.weight"))
            m->hf->lm_model = "model.language_model.", m->hf->lm_head = "lm_head.weight";
        else
            return util_err_set(err, KVLM_EFORMAT, "%s: a multimodal directory without its language model's "
                                "embeddings (language_model.model.embed_tokens.weight or "
                                "model.language_model.embed_tokens.weight)", dir);
    }
    if ((rc = load_weights(m, fam, tied, err))) return rc;
    if ((rc = vocab_from_hf(dir, m->cfg.vocab_size, &m->vocab, err))) return rc;
    return KVLM_OK;
}

int model_hf_n_tensors(const struct kvlm_model *m) {
    return m->hf && m->hf->st ? m->hf->st->n_index : 0;
}

bool model_hf_tensor(const struct kvlm_model *m, int i, kvlm_tensor_info *info) {
    if (i < 0 || i >= model_hf_n_tensors(m)) return false;
    const st_set *s = m->hf->st;
    const st_tensor *t = s->index[i];
    memset(info, 0, sizeof *info);
    info->name = t->name;
    info->type = t->dtype == ST_F32 ? DT_F32 : t->dtype == ST_F16 ? DT_F16 : t->dtype == ST_BF16 ? DT_BF16 : -1;
    info->n_dims = t->n_dims > 4 ? 4 : t->n_dims;
    for (int d = 0; d < 4; d++) info->ne[d] = d < t->n_dims ? t->shape[t->n_dims - 1 - d] : 1;
    const st_file *f = s->files[t->file];
    info->offset = (uint64_t)((const uint8_t *)t->data - f->map);
    info->nbytes = t->nbytes;
    return true;
}
