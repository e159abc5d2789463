/* model/model: builds a kvlm_model (config + tensor views) from a GGUF file
 * or a llama2.c version-0 checkpoint, checking every shape it relies on. */
#include "model/model.h"
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "dtype/dtype.h"
#include "model/hf.h"
#include "util/error.h"
#include "util/file.h"

/* ---- GGUF ---------------------------------------------------------------- */

/* A hyper-parameter of the wrong GGUF type is an error, not "absent": an
 * integer key must hold an integer; a float key a number (finite). *found
 * says whether the key is there. */
static int hp_int(const struct kvlm_model *m, const char *arch, const char *key, int64_t *out, bool *found,
                  kvlm_error *err) {
    char full[128];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    const gguf_kv *kv = gguf_find(m->gguf, full);
    *found = kv != NULL;
    if (kv && !gguf_get_int(m->gguf, full, out))
        return util_err_set(err, KVLM_EFORMAT, "%s: key %s has type %s, expected an integer", m->path, full,
                            gguf_vtype_name(kv->type));
    return KVLM_OK;
}

static int hp_float(const struct kvlm_model *m, const char *arch, const char *key, double lo, bool lo_open,
                    double *out, kvlm_error *err) {
    char full[128];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    const gguf_kv *kv = gguf_find(m->gguf, full);
    if (!kv) return KVLM_OK;
    double d;
    if (!gguf_get_float(m->gguf, full, &d))
        return util_err_set(err, KVLM_EFORMAT, "%s: key %s has type %s, expected a number", m->path, full,
                            gguf_vtype_name(kv->type));
    if (!isfinite(d) || !isfinite((float)d) || (lo_open ? !(d > lo) : !(d >= lo)))
        return util_err_set(err, KVLM_EFORMAT, "%s: key %s = %g: must be finite and %s %g", m->path, full, d,
                            lo_open ? "above" : "at least", lo);
    *out = d;
    return KVLM_OK;
}

/* The blocks the tensors name (blk.N.*) must be exactly 0..n_layers-1. */
static int check_blocks(const struct kvlm_model *m, const char *arch, int n_layers, kvlm_error *err) {
    const gguf_file *f = m->gguf;
    bool *seen = calloc((size_t)n_layers, sizeof *seen);
    if (!seen) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    int rc = KVLM_OK;
    for (uint64_t i = 0; i < f->n_tensors && !rc; i++) {
        const char *name = f->tensors[i].cname;
        if (strncmp(name, "blk.", 4)) continue;
        char *end;
        errno = 0;
        unsigned long long b = strtoull(name + 4, &end, 10);
        if (end == name + 4 || *end != '.' || errno) continue; /* not a block's tensor */
        if (b >= (unsigned long long)n_layers)
            rc = util_err_set(err, KVLM_EFORMAT, "%s: tensor %s belongs to block %llu, but %s.block_count is %d",
                              m->path, name, b, arch, n_layers);
        else seen[b] = true;
    }
    int have = 0;
    for (int l = 0; l < n_layers; l++) have += seen[l];
    if (!rc && have < n_layers) {
        int first = 0;
        while (seen[first]) first++;
        rc = util_err_set(err, KVLM_EFORMAT, "%s: %s.block_count is %d, but the file has tensors for %d blocks "
                          "(none for block %d)", m->path, arch, n_layers, have, first);
    }
    free(seen);
    return rc;
}

/* Finds a tensor and checks its shape (n_in x n_out; n_out 0 for 1-D). */
static int take_tensor(const struct kvlm_model *m, model_tensor *t, const char *name, int64_t n_in,
                       int64_t n_out, bool optional, kvlm_error *err) {
    const gguf_tensor *gt = gguf_find_tensor(m->gguf, name);
    memset(t, 0, sizeof *t);
    if (!gt) {
        if (optional) return KVLM_OK;
        return util_err_set(err, KVLM_EFORMAT, "%s: missing tensor %s", m->path, name);
    }
    bool is_1d = n_out == 0;
    int64_t got_in = gt->ne[0], got_out = gt->n_dims >= 2 ? gt->ne[1] : 1;
    bool ok = got_in == n_in && (is_1d ? gt->n_dims == 1 || got_out == 1 : got_out == n_out) &&
              (gt->n_dims <= 2 || (gt->ne[2] == 1 && gt->ne[3] == 1));
    if (!ok) {
        if (is_1d)
            return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: shape %lldx%lld, expected %lld", m->path,
                                name, (long long)got_in, (long long)got_out, (long long)n_in);
        return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: shape %lldx%lld, expected %lldx%lld", m->path,
                            name, (long long)got_in, (long long)got_out, (long long)n_in, (long long)n_out);
    }
    if (is_1d && gt->type != DT_F32)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: tensor %s: type %s, expected f32 for a norm or bias",
                            m->path, name, dt_info(gt->type) ? dt_info(gt->type)->name : "?");
    if (!is_1d) {
        const dt_traits *tr = dt_info(gt->type);
        if (!tr || gt->type == DT_Q8_K)
            return util_err_set(err, KVLM_EUNSUPPORTED, "%s: tensor %s: type id %d is not supported for weights",
                                m->path, name, gt->type);
    }
    t->data = gt->data;
    t->type = gt->type;
    t->n_in = n_in;
    t->n_out = is_1d ? 1 : n_out;
    t->name = gt->cname;
    return KVLM_OK;
}

/* Sliding windows, soft-capping, the query scale and the local RoPE base
 * (docs/sliding-window.md). What llama.cpp reads, with its defaults:
 *  - llama: llama.attention.sliding_window, if present, makes every layer
 *    local (Mistral's convention; kvlm's own choice: llama.cpp's llama graph
 *    reads no window for arch llama and attends to the whole context).
 *  - gemma2: every second layer local (layer 0 first), window
 *    gemma2.attention.sliding_window (default 4096), attention and final
 *    soft-capping gemma2.attn_logit_softcapping / final_logit_softcapping
 *    (defaults 50 and 30).
 *  - gemma3: five local layers then one global, window as above (default
 *    512), local layers' RoPE base 10000 (global: rope.freq_base), no
 *    soft-capping; linear RoPE scaling (the 4B and larger) is refused.
 *  - gemma: the queries are scaled by 1/sqrt(key_length), except the 27B
 *    models (46 layers for gemma2, 62 for gemma3) whose query_pre_attn_scalar
 *    is dim / heads: llama.cpp decides it by the model's size the same way,
 *    as no GGUF key carries it.
 *  - phi3's sliding_window is read and ignored, as llama.cpp does. */
int model_swa_from_layers(kvlm_config *c, const bool *local, bool derive) {
    if (derive) {
        c->swa_period = 0;
        for (int l = 0; l < c->n_layers && !c->swa_period; l++)
            if (!local[l]) c->swa_period = l + 1;
    }
    for (int l = 0; l < c->n_layers; l++)
        if (local[l] != (c->swa_period <= 0 || (l + 1) % c->swa_period != 0)) return l;
    return -1;
}

/* {arch}.attention.sliding_window_pattern as llama.cpp's OLMo 3 converter
 * writes it: one bool per layer, true where the layer is local, which must
 * follow a period (model_swa_from_layers). */
static int swa_pattern_array(struct kvlm_model *m, const char *key, const gguf_kv *kv, kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    if (kv->arr_type != GGUF_BOOL || kv->arr_n != (uint64_t)c->n_layers)
        return util_err_set(err, KVLM_EFORMAT, "%s: key %s: an array of %d bools (one per layer) is expected",
                            m->path, key, c->n_layers);
    bool *local = malloc((size_t)c->n_layers * sizeof *local);
    if (!local) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    for (int l = 0; l < c->n_layers; l++) local[l] = gguf_arr_int(kv, (uint64_t)l) != 0;
    int bad = model_swa_from_layers(c, local, true), rc = KVLM_OK;
    if (bad >= 0)
        rc = util_err_set(err, KVLM_EUNSUPPORTED, "%s: key %s: layer %d is %s, but kvlm (as llama.cpp) takes one global "
                          "layer in every %d (the last)", m->path, key, bad, local[bad] ? "local" : "global",
                          c->swa_period);
    free(local);
    return rc;
}

static int load_swa_hparams(struct kvlm_model *m, const char *arch, kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    bool g2 = c->arch == KVLM_ARCH_GEMMA2, g3 = c->arch == KVLM_ARCH_GEMMA3, olmo = c->arch == KVLM_ARCH_OLMO2;
    int64_t v;
    bool found;
    int hrc;
    model_swa_defaults(c);
    bool oss = c->arch == KVLM_ARCH_GPTOSS;
    if (c->arch == KVLM_ARCH_LLAMA || g2 || g3 || olmo || oss) {
        if ((hrc = hp_int(m, arch, "attention.sliding_window", &v, &found, err))) return hrc;
        if (found && (v < 0 || v > (1 << 24)))
            return util_err_set(err, KVLM_EFORMAT, "%s: key %s.attention.sliding_window = %lld is out of range", m->path,
                                arch, (long long)v);
        if (found) c->sliding_window = (int)v;
        /* OLMo 3 (olmo2 with a window): three local layers to one global, llama.cpp's default */
        if (olmo && c->sliding_window > 0) c->swa_period = 4;
        /* gpt-oss: even layers local, odd ones global (llama.cpp's swa pattern 2) */
        if (oss && c->sliding_window > 0) c->swa_period = 2;
        /* llama.cpp's optional per-architecture override of the period (OLMo 3: a bool per layer) */
        char key[128];
        snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", arch);
        const gguf_kv *pk = gguf_find(m->gguf, key);
        if (pk && pk->type == GGUF_ARRAY) {
            if ((hrc = swa_pattern_array(m, key, pk, err))) return hrc;
        } else {
            if ((hrc = hp_int(m, arch, "attention.sliding_window_pattern", &v, &found, err))) return hrc;
            if (found && (v < 0 || v > c->n_layers + 1))
                return util_err_set(err, KVLM_EFORMAT, "%s: key %s = %lld is out of range", m->path, key, (long long)v);
            if (found) c->swa_period = (int)v;
        }
        /* OLMo 3: the local layers' RoPE base (llama.cpp's key; default the global one) */
        double d = c->rope_base_local;
        if (olmo && (hrc = hp_float(m, arch, "rope.freq_base_swa", 0, true, &d, err))) return hrc;
        c->rope_base_local = (float)d;
    }
    if (g2) {
        double d = 50.0;
        if ((hrc = hp_float(m, arch, "attn_logit_softcapping", 0, false, &d, err))) return hrc;
        c->attn_softcap = (float)d;
        d = 30.0;
        if ((hrc = hp_float(m, arch, "final_logit_softcapping", 0, false, &d, err))) return hrc;
        c->final_softcap = (float)d;
    }
    model_swa_count(c);
    return KVLM_OK;
}

void model_swa_defaults(kvlm_config *c) {
    bool g2 = c->arch == KVLM_ARCH_GEMMA2, g3 = c->arch == KVLM_ARCH_GEMMA3;
    c->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    c->rope_base_local = c->rope_base;
    if (g2 || g3) {
        c->rope_neox = true;
        if ((g2 && c->n_layers == 46) || (g3 && c->n_layers == 62)) c->attn_scale = 1.0f / sqrtf((float)c->dim / c->n_heads);
        if (g3) c->rope_base_local = 10000.0f;
        c->swa_period = g2 ? 2 : 6;
        c->sliding_window = g2 ? 4096 : 512;
    }
}

void model_swa_count(kvlm_config *c) {
    c->n_local_layers = 0;
    for (int l = 0; l < c->n_layers; l++) c->n_local_layers += model_layer_window(c, l) > 0;
}

void model_layer_swa(const kvlm_config *c, model_layer *L, int l) {
    L->window = model_layer_window(c, l);
    L->rope_base = L->window ? c->rope_base_local : c->rope_base;
}

int model_layer_window(const kvlm_config *c, int l) {
    if (c->sliding_window <= 0) return 0;
    if (c->swa_period > 0 && (l + 1) % c->swa_period == 0) return 0;
    return c->sliding_window;
}

float model_embed_scale(const kvlm_config *c) {
    if (c->arch == KVLM_ARCH_GEMMA2 || c->arch == KVLM_ARCH_GEMMA3) return sqrtf((float)c->dim);
    return c->embed_mult > 0 ? c->embed_mult : 1.0f;
}

/* granite's multipliers, as llama.cpp reads them (each optional; 0: none):
 * {arch}.embedding_scale, residual_scale, logit_scale (the logits are divided
 * by it) and attention.scale (q.k's scale in place of 1/sqrt(head_dim)).
 * llama.cpp also takes rope.scaling.finetuned = false as "no RoPE at all"
 * for these: refused by name rather than rotated. */
static int granite_keys(struct kvlm_model *m, const char *arch, kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    const char *keys[4] = {"embedding_scale", "residual_scale", "logit_scale", "attention.scale"};
    float *dst[4] = {&c->embed_mult, &c->residual_mult, &c->logit_div, &c->attn_scale};
    for (int i = 0; i < 4; i++) {
        double d = 0;
        int rc = hp_float(m, arch, keys[i], 0, false, &d, err);
        if (rc) return rc;
        if (d > 0) *dst[i] = (float)d;
    }
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.finetuned", arch);
    bool tuned = true;
    if (gguf_get_bool(m->gguf, key, &tuned) && !tuned)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: key %s = false: a granite model without RoPE is not "
                            "supported", m->path, key);
    return KVLM_OK;
}

/* {arch}.rope.scaling.type "linear" (or the older rope.scale_linear key):
 * every angle divided by rope.scaling.factor (gemma3: its global layers,
 * Gemma 3 4B and larger). "yarn" (llama, qwen2: Qwen2.5's 128k context):
 * per-pair factors (model_set_rope_freqs) and the rotation's magnitude
 * 1 + 0.1 ln factor on q and k, which multiplies q.k by its square: taken
 * into the attention scale, so the cache holds plain rotations (eviction's
 * re-rotation stays exact). Other types are refused by name, never ignored. */
static int rope_scaling(struct kvlm_model *m, const char *arch, kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    char key[128], type[32] = "";
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    bool typed = gguf_get_str(m->gguf, key, type, sizeof type) && strcmp(type, "none");
    bool yarn = typed && !strcmp(type, "yarn") && model_yarn_arch(c->arch);
    double f = 1.0;
    int rc;
    if (typed && strcmp(type, "linear") && !yarn)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: key %s = \"%s\": RoPE scaling of this type is not supported "
                            "for %s (linear is, yarn for llama, qwen2 and qwen3, and Llama 3.1's rope_freqs.weight)", m->path,
                            key, type, arch);
    if ((rc = hp_float(m, arch, typed ? "rope.scaling.factor" : "rope.scale_linear", 0, true, &f, err))) return rc;
    if (!yarn || f == 1.0) {
        c->rope_linear = f != 1.0 && !yarn ? (float)f : 0.0f;
        return KVLM_OK;
    }
    int64_t orig = 0;
    bool found = false;
    double fast = 32, slow = 1;
    if ((rc = hp_int(m, arch, "rope.scaling.original_context_length", &orig, &found, err))) return rc;
    if (!found || orig < 1 || orig > (1 << 24))
        return util_err_set(err, KVLM_EFORMAT, "%s: YaRN RoPE scaling needs %s.rope.scaling.original_context_length "
                            "(1 to 2^24)", m->path, arch);
    if ((rc = hp_float(m, arch, "rope.scaling.yarn_beta_fast", 0, true, &fast, err)) ||
        (rc = hp_float(m, arch, "rope.scaling.yarn_beta_slow", 0, true, &slow, err)))
        return rc;
    if (c->rope_dim != c->head_dim)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: YaRN with a partial rotation (rope dimension %d of %d) is not "
                            "supported", m->path, c->rope_dim, c->head_dim);
    /* Hugging Face's attention_factor, as llama.cpp's OLMo 3 converter copies
     * it: kvlm applies YaRN's own magnitude, 1 + 0.1 ln factor; another is refused */
    double af = 0;
    if ((rc = hp_float(m, arch, "rope.scaling.attn_factor", 0, false, &af, err))) return rc;
    if (af > 0 && fabs(af - (1.0 + 0.1 * log(f))) > 1e-4 * af)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: key %s.rope.scaling.attn_factor = %g: YaRN with an attention "
                            "factor other than its own (1 + 0.1 ln %g = %g) is not supported", m->path, arch, af, f,
                            1.0 + 0.1 * log(f));
    c->yarn_factor = (float)f;
    c->yarn_orig_ctx = (int)orig;
    c->yarn_beta_fast = (float)fast;
    c->yarn_beta_slow = (float)slow;
    c->attn_scale = (c->attn_scale > 0 ? c->attn_scale : 1.0f / sqrtf((float)c->head_dim)) * model_yarn_mscale2(c);
    return KVLM_OK;
}

/* LongRoPE (the 128k-context Phi-3 and Phi-3.5, as llama.cpp's converter
 * writes them): the factor tensors rope_factors_long / rope_factors_short
 * (taken with the other tensors, model_set_rope_freqs), the original context
 * rope.scaling.original_context_length (default: the trained one, as
 * llama.cpp) and the rotation's magnitude rope.scaling.attn_factor (default
 * 1) on q's and k's rotated dimensions, which the forward pass puts on q's
 * alone, squared (with a partial rotation, Phi-4-mini's, the attention scale
 * could not take it: the dimensions that do not turn keep their size). */
static int longrope_keys(struct kvlm_model *m, const char *arch, kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    bool lg = gguf_find_tensor(m->gguf, "rope_factors_long.weight") != NULL,
         sh = gguf_find_tensor(m->gguf, "rope_factors_short.weight") != NULL;
    if (!lg && !sh) return KVLM_OK;
    if (lg != sh)
        return util_err_set(err, KVLM_EFORMAT, "%s: LongRoPE needs both rope_factors_long.weight and "
                            "rope_factors_short.weight (only %s is present)", m->path,
                            lg ? "rope_factors_long.weight" : "rope_factors_short.weight");
    int64_t orig = c->n_ctx_train;
    bool found = false;
    double af = 1.0;
    int rc;
    if ((rc = hp_int(m, arch, "rope.scaling.original_context_length", &orig, &found, err))) return rc;
    if (!found) orig = c->n_ctx_train;
    if (orig < 1 || orig > (1 << 24))
        return util_err_set(err, KVLM_EFORMAT, "%s: %s.rope.scaling.original_context_length %lld (1 to 2^24)",
                            m->path, arch, (long long)orig);
    if ((rc = hp_float(m, arch, "rope.scaling.attn_factor", 0, true, &af, err))) return rc;
    c->longrope_orig_ctx = (int)orig;
    c->longrope_attn_factor = (float)af;
    return KVLM_OK;
}

double model_longrope_attn_factor(double factor, double orig_ctx) {
    return factor > 1 && orig_ctx > 1 ? sqrt(1 + log(factor) / log(orig_ctx)) : 1.0;
}

float model_longrope_mscale2(const kvlm_config *c) {
    double af = c->longrope_orig_ctx > 0 && c->longrope_attn_factor > 0 ? c->longrope_attn_factor : 1.0;
    return (float)(af * af);
}

const float *model_rope_freqs(const kvlm_config *c, int n_ctx) {
    return c->rope_freqs_short && n_ctx <= c->longrope_orig_ctx ? c->rope_freqs_short : c->rope_freqs;
}

bool model_yarn_arch(int arch) {
    return arch == KVLM_ARCH_LLAMA || arch == KVLM_ARCH_SMOLLM3 || arch == KVLM_ARCH_QWEN2 || model_qwen3_like(arch) ||
           arch == KVLM_ARCH_OLMO2 || arch == KVLM_ARCH_GPTOSS;
}

bool model_scaling_global_only(const kvlm_config *c) {
    return c->arch == KVLM_ARCH_GEMMA3 || (c->arch == KVLM_ARCH_OLMO2 && c->sliding_window > 0);
}

bool model_layer_rope(const kvlm_config *c, int l) {
    return c->no_rope_period <= 0 || (l + 1) % c->no_rope_period != 0;
}

bool model_llama_rows(int arch) {
    return arch == KVLM_ARCH_LLAMA || arch == KVLM_ARCH_SMOLLM3 || model_granite_like(arch);
}

bool model_granite_like(int arch) { return arch == KVLM_ARCH_GRANITE || arch == KVLM_ARCH_GRANITEMOE; }

bool model_qwen3_like(int arch) { return arch == KVLM_ARCH_QWEN3 || arch == KVLM_ARCH_QWEN3MOE; }

/* A mixture of experts in every layer, in place of the FFN: Mixtral (llama
 * with llama.expert_count; each expert feed_forward_length wide),
 * granitemoe (the same) and qwen3moe (expert_feed_forward_length wide). All
 * route by a softmax over every expert, keep the top expert_used_count and
 * renormalise their weights (llama.cpp's build_moe_ffn; Hugging Face's
 * Mixtral, GraniteMoe's softmax over the top logits, Qwen3-MoE's
 * norm_topk_prob). Shared experts: qwen2moe's, gated (below), and Granite
 * MoE Shared's, added as they are (expert_shared_feed_forward_length, when
 * the file has the key). deepseek2 reads its own. */
static int moe_hparams(struct kvlm_model *m, const char *arch, kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    int64_t v;
    bool found;
    int rc;
    if ((rc = hp_int(m, arch, "expert_count", &v, &found, err))) return rc;
    bool q2 = c->arch == KVLM_ARCH_QWEN2MOE, gm = c->arch == KVLM_ARCH_GRANITEMOE, oss = c->arch == KVLM_ARCH_GPTOSS;
    if (!found || v == 0) {
        if (c->arch == KVLM_ARCH_QWEN3MOE || q2 || gm || oss)
            return util_err_set(err, KVLM_EFORMAT, "%s: %s needs %s.expert_count", m->path, arch, arch);
        return KVLM_OK;
    }
    if (c->arch != KVLM_ARCH_LLAMA && c->arch != KVLM_ARCH_QWEN3MOE && !q2 && !gm && !oss)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: %s.expert_count = %lld: experts are read for llama "
                            "(Mixtral), granitemoe, qwen2moe, qwen3moe, gpt-oss and deepseek2", m->path, arch,
                            (long long)v);
    if (v < 1 || v > 1024) /* engine/moe.h */
        return util_err_set(err, KVLM_EFORMAT, "%s: key %s.expert_count = %lld is outside 1..%d", m->path, arch,
                            (long long)v, 1024);
    c->n_expert = (int)v;
    if ((rc = hp_int(m, arch, "expert_used_count", &v, &found, err))) return rc;
    if (!found || v < 1 || v > c->n_expert)
        return util_err_set(err, KVLM_EFORMAT, "%s: key %s.expert_used_count %s (1 to the %d experts)", m->path,
                            arch, found ? "is out of range" : "is missing", c->n_expert);
    c->n_expert_used = (int)v;
    c->expert_ff = c->hidden_dim;
    if (c->arch == KVLM_ARCH_QWEN3MOE || q2 || oss) {
        /* qwen2moe: both optional, llama.cpp's defaults (feed_forward_length / used, and it) */
        if ((rc = hp_int(m, arch, "expert_feed_forward_length", &v, &found, err))) return rc;
        if (!found && q2) v = c->hidden_dim / c->n_expert_used, found = true;
        if (!found || v < 1 || v > (1 << 20))
            return util_err_set(err, KVLM_EFORMAT, "%s: key %s.expert_feed_forward_length %s", m->path, arch,
                                found ? "is out of range" : "is missing");
        c->expert_ff = (int)v;
    }
    model_moe_topk_routing(c);
    if (q2 || gm) { /* qwen2moe: a gated shared expert; granitemoe: one added as it is, if the key is there */
        if ((rc = hp_int(m, arch, "expert_shared_feed_forward_length", &v, &found, err))) return rc;
        if (found && (v < (gm ? 0 : 1) || v > (1 << 20)))
            return util_err_set(err, KVLM_EFORMAT, "%s: key %s.expert_shared_feed_forward_length is out of range",
                                m->path, arch);
        c->expert_shared_ff = found ? (int)v : q2 ? c->hidden_dim : 0;
    }
    return KVLM_OK;
}

void model_moe_topk_routing(kvlm_config *c) {
    c->n_expert_shared = 0;
    c->n_dense_lead = 0;
    c->expert_gating = 1;
    c->expert_weights_norm = c->arch != KVLM_ARCH_QWEN2MOE; /* qwen2moe: the probabilities as they are */
    c->expert_weights_scale = 1.0f;
}

float model_yarn_mscale2(const kvlm_config *c) {
    if (c->yarn_factor <= 0 || c->arch == KVLM_ARCH_DEEPSEEK2) return 1.0f;
    double ms = 1.0 + 0.1 * log(c->yarn_factor);
    return (float)(ms * ms);
}

static int load_gguf_weights(struct kvlm_model *m, kvlm_error *err) {
    const gguf_file *f = m->gguf;
    kvlm_config *c = &m->cfg;
    if (!gguf_get_str(f, "general.architecture", m->arch_name, sizeof m->arch_name))
        return util_err_set(err, KVLM_EFORMAT, "%s: no general.architecture key", m->path);
    const char *arch = m->arch_name;
    if (!strcmp(arch, "llama")) c->arch = KVLM_ARCH_LLAMA;
    else if (!strcmp(arch, "smollm3")) c->arch = KVLM_ARCH_SMOLLM3, c->no_rope_period = 4;
    else if (!strcmp(arch, "granite")) c->arch = KVLM_ARCH_GRANITE;
    else if (!strcmp(arch, "granitemoe")) c->arch = KVLM_ARCH_GRANITEMOE;
    else if (!strcmp(arch, "olmo2")) c->arch = KVLM_ARCH_OLMO2, c->qk_norm_full = true;
    else if (!strcmp(arch, "qwen2")) c->arch = KVLM_ARCH_QWEN2;
    else if (!strcmp(arch, "qwen3")) c->arch = KVLM_ARCH_QWEN3;
    else if (!strcmp(arch, "qwen3moe")) c->arch = KVLM_ARCH_QWEN3MOE;
    else if (!strcmp(arch, "qwen2moe")) c->arch = KVLM_ARCH_QWEN2MOE;
    else if (!strcmp(arch, "phi3")) c->arch = KVLM_ARCH_PHI3;
    else if (!strcmp(arch, "deepseek2")) c->arch = KVLM_ARCH_DEEPSEEK2;
    else if (!strcmp(arch, "gemma2")) c->arch = KVLM_ARCH_GEMMA2;
    else if (!strcmp(arch, "gemma3")) c->arch = KVLM_ARCH_GEMMA3;
    else if (!strcmp(arch, "gpt-oss")) c->arch = KVLM_ARCH_GPTOSS;
    else if (!strcmp(arch, "bert")) c->arch = KVLM_ARCH_BERT, c->encoder = true;
    else if (!strcmp(arch, "nomic-bert")) c->arch = KVLM_ARCH_NOMIC_BERT, c->encoder = true;
    else
        return util_err_set(err, KVLM_EUNSUPPORTED,
                            "%s: architecture '%s' is not supported (supported: llama, smollm3, granite, granitemoe, olmo2, qwen2, "
                            "qwen2moe, qwen3, qwen3moe, phi3, deepseek2, gemma2, gemma3, gpt-oss, bert, nomic-bert)",
                            m->path, arch);
    int64_t v;
    bool found;
    int hrc;
    struct { const char *key; int *dst; } req[] = {
        {"embedding_length", &c->dim}, {"block_count", &c->n_layers},
        {"feed_forward_length", &c->hidden_dim}, {"attention.head_count", &c->n_heads},
    };
    for (size_t i = 0; i < sizeof req / sizeof req[0]; i++) {
        if ((hrc = hp_int(m, arch, req[i].key, &v, &found, err))) return hrc;
        if (!found) return util_err_set(err, KVLM_EFORMAT, "%s: missing key %s.%s", m->path, arch, req[i].key);
        if (v <= 0 || v > (1 << 20))
            return util_err_set(err, KVLM_EFORMAT, "%s: key %s.%s = %lld is out of range", m->path, arch,
                                req[i].key, (long long)v);
        *req[i].dst = (int)v;
    }
    /* embedding models (llama.cpp's key): how hidden states pool into a vector */
    if ((hrc = hp_int(m, arch, "pooling_type", &v, &found, err))) return hrc;
    if (found && (v < KVLM_POOLING_NONE || v > KVLM_POOLING_RANK))
        return util_err_set(err, KVLM_EFORMAT, "%s: key %s.pooling_type = %lld is not a pooling type (0 none, 1 mean, "
                            "2 cls, 3 last, 4 rank)", m->path, arch, (long long)v);
    if (found) c->pooling = (int)v;
    if (c->encoder) return model_bert_load(m, err);
    c->n_kv_heads = c->n_heads;
    if ((hrc = hp_int(m, arch, "attention.head_count_kv", &v, &found, err))) return hrc;
    if (found) c->n_kv_heads = v < 0 || v > (1 << 20) ? -1 : (int)v;
    if (c->n_kv_heads <= 0 || c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads)
        return util_err_set(err, KVLM_EFORMAT, "%s: %d KV heads do not divide %d query heads", m->path,
                            c->n_kv_heads, c->n_heads);
    if (c->arch != KVLM_ARCH_DEEPSEEK2 && (hrc = moe_hparams(m, arch, err))) return hrc;
    c->head_dim = c->dim / c->n_heads;
    if ((hrc = hp_int(m, arch, "attention.key_length", &v, &found, err))) return hrc;
    if (found) c->head_dim = v < 0 || v > (1 << 20) ? -1 : (int)v;
    if (c->head_dim <= 0 || c->head_dim > 1024 || (c->head_dim & 1))
        return util_err_set(err, KVLM_EFORMAT, "%s: head dimension %d is not supported", m->path, c->head_dim);
    c->n_ctx_train = 2048;
    if ((hrc = hp_int(m, arch, "context_length", &v, &found, err))) return hrc;
    if (found && v <= 0)
        return util_err_set(err, KVLM_EFORMAT, "%s: key %s.context_length = %lld: must be at least 1", m->path, arch,
                            (long long)v);
    /* what a context allocates is capped by what is asked for (kvlm_ctx_params.n_ctx) */
    if (found) c->n_ctx_train = v > (1 << 24) ? (1 << 24) : (int)v;
    c->rope_dim = c->head_dim;
    if ((hrc = hp_int(m, arch, "rope.dimension_count", &v, &found, err))) return hrc;
    if (found) c->rope_dim = v < 0 || v > (1 << 20) ? -1 : (int)v;
    if (c->rope_dim <= 0 || c->rope_dim > c->head_dim || (c->rope_dim & 1))
        return util_err_set(err, KVLM_EFORMAT, "%s: rope dimension %d does not fit head dimension %d", m->path,
                            c->rope_dim, c->head_dim);
    double d = 10000.0;
    if ((hrc = hp_float(m, arch, "rope.freq_base", 0, true, &d, err))) return hrc;
    c->rope_base = (float)d;
    d = 1e-5;
    if ((hrc = hp_float(m, arch, "attention.layer_norm_rms_epsilon", 0, false, &d, err))) return hrc;
    c->norm_eps = (float)d;
    if ((hrc = check_blocks(m, arch, c->n_layers, err))) return hrc;
    c->rope_neox = c->arch == KVLM_ARCH_QWEN2 || c->arch == KVLM_ARCH_QWEN2MOE || model_qwen3_like(c->arch) ||
                   c->arch == KVLM_ARCH_PHI3 || c->arch == KVLM_ARCH_OLMO2 || c->arch == KVLM_ARCH_GPTOSS;
    if ((hrc = load_swa_hparams(m, arch, err))) return hrc;
    if (model_granite_like(c->arch) && (hrc = granite_keys(m, arch, err))) return hrc;
    /* after: YaRN's magnitude goes into the attention scale that sets */
    if (c->arch != KVLM_ARCH_DEEPSEEK2 && (hrc = rope_scaling(m, arch, err))) return hrc; /* deepseek2: YaRN, its own */
    if (c->arch == KVLM_ARCH_PHI3) {
        if ((hrc = longrope_keys(m, arch, err))) return hrc;
        /* phi3.attention.sliding_window (2047 in Phi-3-mini-4k) is read and
         * ignored, as llama.cpp does (its converters do not describe which
         * layers use it): attention is full-context. It must still be an integer. */
        if ((hrc = hp_int(m, arch, "attention.sliding_window", &v, &found, err))) return hrc;
    }

    const gguf_tensor *emb = gguf_find_tensor(f, "token_embd.weight");
    if (!emb) return util_err_set(err, KVLM_EFORMAT, "%s: missing tensor token_embd.weight", m->path);
    c->vocab_size = emb->n_dims >= 2 ? (int)emb->ne[1] : 0;
    if (c->vocab_size <= 0) return util_err_set(err, KVLM_EFORMAT, "%s: token_embd.weight has no rows", m->path);
    if (m->vocab.n_tokens && m->vocab.n_tokens != c->vocab_size)
        return util_err_set(err, KVLM_EFORMAT, "%s: tokenizer has %d tokens but token_embd.weight has %d rows",
                            m->path, m->vocab.n_tokens, c->vocab_size);

    int rc;
    int64_t q_dim = (int64_t)c->n_heads * c->head_dim, kv_dim = (int64_t)c->n_kv_heads * c->head_dim;
    if ((rc = take_tensor(m, &m->tok_embd, "token_embd.weight", c->dim, c->vocab_size, false, err))) return rc;
    if ((rc = take_tensor(m, &m->output_norm, "output_norm.weight", c->dim, 0, false, err))) return rc;
    if ((rc = take_tensor(m, &m->output, "output.weight", c->dim, c->vocab_size, true, err))) return rc;
    if (!m->output.data) m->output = m->tok_embd; /* tied classifier */
    if ((rc = take_tensor(m, &m->rope_freqs, "rope_freqs.weight", c->rope_dim / 2, 0, true, err))) return rc;
    if (c->longrope_orig_ctx && ((rc = take_tensor(m, &m->rope_long, "rope_factors_long.weight", c->rope_dim / 2, 0,
                                                   false, err)) ||
                                 (rc = take_tensor(m, &m->rope_short, "rope_factors_short.weight", c->rope_dim / 2, 0,
                                                   false, err))))
        return rc;
    if (m->rope_freqs.data && c->arch == KVLM_ARCH_DEEPSEEK2)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: tensor rope_freqs.weight: RoPE frequency factors are not "
                            "supported for deepseek2 (its scaling is YaRN)", m->path);
    if ((rc = model_set_rope_freqs(m, err))) return rc;
    c->weight_type = m->output.type;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    if (c->arch == KVLM_ARCH_DEEPSEEK2) return model_deepseek2_layers(m, err);
    bool oss = c->arch == KVLM_ARCH_GPTOSS;
    bool bias = c->arch == KVLM_ARCH_QWEN2 || c->arch == KVLM_ARCH_QWEN2MOE || oss, phi3 = c->arch == KVLM_ARCH_PHI3;
    bool gemma = c->arch == KVLM_ARCH_GEMMA2 || c->arch == KVLM_ARCH_GEMMA3, olmo2 = c->arch == KVLM_ARCH_OLMO2;
    for (int l = 0; l < c->n_layers; l++) {
        model_layer *L = &m->layers[l];
        char n[96];
#define TAKE(field, suffix, nin, nout, opt)                                         \
    snprintf(n, sizeof n, "blk.%d.%s", l, suffix);                                  \
    if ((rc = take_tensor(m, &L->field, n, nin, nout, opt, err))) return rc;
        if (!olmo2) { TAKE(attn_norm, "attn_norm.weight", c->dim, 0, false); } /* olmo2: no norm before */
        /* phi3 stores Q, K, V as one matrix (rows: Q, then K, then V) and the
         * gate and up projections as one (rows: gate, then up). They become
         * row views here, so everything past loading sees llama's layout. */
        model_tensor fused = {0};
        if (phi3) { TAKE(wq, "attn_qkv.weight", c->dim, q_dim + 2 * kv_dim, true); }
        if (phi3 && L->wq.data) {
            fused = L->wq;
            L->wq = model_tensor_rows(&fused, 0, q_dim);
            L->wk = model_tensor_rows(&fused, q_dim, kv_dim);
            L->wv = model_tensor_rows(&fused, q_dim + kv_dim, kv_dim);
        } else {
            /* separate projections are allowed for phi3 too, as llama.cpp does */
            snprintf(n, sizeof n, "blk.%d.attn_q.weight", l);
            if (phi3 && !gguf_find_tensor(f, n))
                return util_err_set(err, KVLM_EFORMAT, "%s: missing tensor blk.%d.attn_qkv.weight", m->path, l);
            TAKE(wq, "attn_q.weight", c->dim, q_dim, false);
            TAKE(wk, "attn_k.weight", c->dim, kv_dim, false);
            TAKE(wv, "attn_v.weight", c->dim, kv_dim, false);
        }
        TAKE(wo, "attn_output.weight", q_dim, c->dim, false);
        TAKE(bq, "attn_q.bias", q_dim, 0, !bias);
        TAKE(bk, "attn_k.bias", kv_dim, 0, !bias);
        TAKE(bv, "attn_v.bias", kv_dim, 0, !bias);
        if (oss) { /* gpt-oss: the output's bias, a sink per head, and the FFN's norm under another name */
            TAKE(bo, "attn_output.bias", c->dim, 0, false);
            TAKE(attn_sinks, "attn_sinks.weight", c->n_heads, 0, false);
            TAKE(ffn_norm, "post_attention_norm.weight", c->dim, 0, false);
        } else if (!olmo2) { TAKE(ffn_norm, "ffn_norm.weight", c->dim, 0, false); }
        if (phi3) {
            TAKE(w_up, "ffn_up.weight", c->dim, 2 * (int64_t)c->hidden_dim, false);
            fused = L->w_up;
            L->w_gate = model_tensor_rows(&fused, 0, c->hidden_dim);
            L->w_up = model_tensor_rows(&fused, c->hidden_dim, c->hidden_dim);
        } else if (c->n_expert > 0) {
            snprintf(n, sizeof n, "blk.%d.ffn_gate.0.weight", l);
            if (gguf_find_tensor(f, n))
                return util_err_set(err, KVLM_EUNSUPPORTED, "%s: tensor %s: experts stored one tensor each (an early "
                                    "Mixtral conversion) are not read; llama.cpp's converters since 2024 stack them "
                                    "(blk.N.ffn_gate_exps.weight): convert the model again", m->path, n);
            TAKE(ffn_gate_inp, "ffn_gate_inp.weight", c->dim, c->n_expert, false);
            const char *ex[3] = {"ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"};
            model_tensor *dst[3] = {&L->gate_exps, &L->up_exps, &L->down_exps};
            for (int i = 0; i < 3; i++) {
                snprintf(n, sizeof n, "blk.%d.%s", l, ex[i]);
                if ((rc = model_take_experts(m, dst[i], n, i < 2 ? c->dim : c->expert_ff, i < 2 ? c->expert_ff : c->dim,
                                             c->n_expert, err)))
                    return rc;
            }
            if (oss) { /* the router's and the experts' biases ([expert][row], f32) */
                TAKE(ffn_gate_inp_b, "ffn_gate_inp.bias", c->n_expert, 0, false);
                TAKE(gate_exps_b, "ffn_gate_exps.bias", c->expert_ff, c->n_expert, false);
                TAKE(up_exps_b, "ffn_up_exps.bias", c->expert_ff, c->n_expert, false);
                TAKE(down_exps_b, "ffn_down_exps.bias", c->dim, c->n_expert, false);
                const model_tensor *eb[3] = {&L->gate_exps_b, &L->up_exps_b, &L->down_exps_b};
                for (int i = 0; i < 3; i++)
                    if (eb[i]->type != DT_F32)
                        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: blk.%d: the experts' biases must be f32, "
                                            "not %s", m->path, l, dt_name(eb[i]->type));
            }
            if (c->expert_shared_ff > 0) { /* the shared expert, and qwen2moe's gate of it */
                int64_t sf = c->expert_shared_ff;
                if (c->arch == KVLM_ARCH_QWEN2MOE) { TAKE(ffn_gate_inp_shexp, "ffn_gate_inp_shexp.weight", c->dim, 0, false); }
                TAKE(gate_shexp, "ffn_gate_shexp.weight", c->dim, sf, false);
                TAKE(up_shexp, "ffn_up_shexp.weight", c->dim, sf, false);
                TAKE(down_shexp, "ffn_down_shexp.weight", sf, c->dim, false);
            }
        } else {
            TAKE(w_gate, "ffn_gate.weight", c->dim, c->hidden_dim, false);
            TAKE(w_up, "ffn_up.weight", c->dim, c->hidden_dim, false);
        }
        if (c->n_expert == 0) { TAKE(w_down, "ffn_down.weight", c->hidden_dim, c->dim, false); }
        if (gemma || olmo2) {
            TAKE(post_attn_norm, "post_attention_norm.weight", c->dim, 0, false);
            TAKE(post_ffn_norm, "post_ffw_norm.weight", c->dim, 0, false);
        }
        if (olmo2 || c->arch == KVLM_ARCH_GEMMA3 || model_qwen3_like(c->arch)) { /* one head's (olmo2: all heads') */
            TAKE(q_norm, "attn_q_norm.weight", c->qk_norm_full ? q_dim : c->head_dim, 0, false);
            TAKE(k_norm, "attn_k_norm.weight", c->qk_norm_full ? kv_dim : c->head_dim, 0, false);
        }
        model_layer_swa(c, L, l);
#undef TAKE
        if (l == 0) c->weight_type = L->wq.type;
    }
    for (uint64_t i = 0; i < f->n_tensors; i++) m->weight_bytes += f->tensors[i].nbytes;
    return KVLM_OK;
}

model_tensor model_tensor_rows(const model_tensor *t, int64_t row0, int64_t n) {
    model_tensor v = *t;
    v.data = (const char *)t->data + (size_t)row0 * dt_row_size(t->type, t->n_in);
    v.n_out = n;
    v.packed = NULL;
    return v;
}

const char *model_arch_name(kvlm_arch arch) {
    switch (arch) {
    case KVLM_ARCH_QWEN2: return "qwen2";
    case KVLM_ARCH_QWEN3: return "qwen3";
    case KVLM_ARCH_QWEN3MOE: return "qwen3moe";
    case KVLM_ARCH_QWEN2MOE: return "qwen2moe";
    case KVLM_ARCH_GPTOSS: return "gpt-oss";
    case KVLM_ARCH_SMOLLM3: return "smollm3";
    case KVLM_ARCH_GRANITE: return "granite";
    case KVLM_ARCH_GRANITEMOE: return "granitemoe";
    case KVLM_ARCH_OLMO2: return "olmo2";
    case KVLM_ARCH_PHI3: return "phi3";
    case KVLM_ARCH_GEMMA2: return "gemma2";
    case KVLM_ARCH_GEMMA3: return "gemma3";
    case KVLM_ARCH_DEEPSEEK2: return "deepseek2";
    case KVLM_ARCH_BERT: return "bert";
    case KVLM_ARCH_NOMIC_BERT: return "nomic-bert";
    default: return "llama";
    }
}

/* ---- llama2.c ------------------------------------------------------------ */

static void set_view(model_tensor *t, const float **p, int64_t n_in, int64_t n_out, const char *name) {
    t->data = *p;
    t->type = DT_F32;
    t->n_in = n_in;
    t->n_out = n_out;
    t->name = name;
    *p += n_in * n_out;
}

static int load_llama2c(struct kvlm_model *m, const char *tokenizer_path, bool vocab_only, kvlm_error *err) {
    int fd = open(m->path, O_RDONLY);
    if (fd < 0) return util_err_set(err, KVLM_EIO, "%s: %s", m->path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) { close(fd); return util_err_set(err, KVLM_EIO, "%s: %s", m->path, strerror(errno)); }
    size_t size = (size_t)st.st_size;
    if (size < 28) {
        close(fd);
        return util_err_set(err, KVLM_EFORMAT, "%s: %zu bytes is too short for a GGUF or llama2.c model", m->path, size);
    }
    void *map = util_map_file(fd, size, m->map_flags, m->path);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED)
        return util_err_set(err, KVLM_EIO, "%s: %s: %s", m->path, m->map_flags & UTIL_MAP_READ ? "read" : "mmap",
                            strerror(map_errno));
    m->map = map;
    m->map_size = size;
    int32_t h[7];
    memcpy(h, map, sizeof h);
    kvlm_config *c = &m->cfg;
    c->arch = KVLM_ARCH_LLAMA;
    snprintf(m->arch_name, sizeof m->arch_name, "llama");
    c->dim = h[0];
    c->hidden_dim = h[1];
    c->n_layers = h[2];
    c->n_heads = h[3];
    c->n_kv_heads = h[4];
    bool shared = h[5] > 0;
    /* a negative size means a separate output matrix; INT32_MIN has no
     * negation and reads as 0, refused below */
    c->vocab_size = h[5] == INT32_MIN ? 0 : h[5] < 0 ? -h[5] : h[5];
    c->n_ctx_train = h[6];
    if (c->dim <= 0 || c->dim > 65536 || c->hidden_dim <= 0 || c->hidden_dim > 1 << 20 || c->n_layers <= 0 ||
        c->n_layers > 1024 || c->n_heads <= 0 || c->n_heads > c->dim || c->dim % c->n_heads || c->n_kv_heads <= 0 ||
        c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads || c->vocab_size <= 0 ||
        c->vocab_size > 1 << 22 || c->n_ctx_train <= 0 || c->n_ctx_train > 1 << 22 || ((c->dim / c->n_heads) & 1))
        return util_err_set(err, KVLM_EFORMAT,
                            "%s: not a GGUF file, and its header is not a valid llama2.c checkpoint "
                            "(dim %d, hidden %d, layers %d, heads %d, kv heads %d, vocab %d, seq_len %d)",
                            m->path, h[0], h[1], h[2], h[3], h[4], h[5], h[6]);
    c->head_dim = c->dim / c->n_heads;
    c->rope_dim = c->head_dim;
    c->rope_base = 10000.0f;
    c->rope_neox = false;
    c->norm_eps = 1e-5f;
    c->weight_type = DT_F32;
    c->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    c->rope_base_local = c->rope_base;
    int64_t D = c->dim, F = c->hidden_dim, L = c->n_layers, V = c->vocab_size;
    int64_t KV = (int64_t)c->n_kv_heads * c->head_dim;
    int64_t n_floats = V * D + L * (D + D * D + 2 * KV * D + D * D + D + 3 * F * D) + D +
                       (int64_t)c->n_ctx_train * c->head_dim + (shared ? 0 : V * D);
    if ((size - 28) / 4 < (size_t)n_floats)
        return util_err_set(err, KVLM_EFORMAT, "%s: truncated llama2.c checkpoint: %zu bytes, the header needs %lld",
                            m->path, size, (long long)(28 + 4 * n_floats));
    if (!vocab_only) {
        m->layers = calloc((size_t)L, sizeof *m->layers);
        if (!m->layers) return util_err_set(err, KVLM_ENOMEM, "out of memory");
        const float *p = (const float *)((const char *)map + 28);
        set_view(&m->tok_embd, &p, D, V, "token_embedding");
        for (int l = 0; l < L; l++) set_view(&m->layers[l].attn_norm, &p, D, 1, "rms_att");
        for (int l = 0; l < L; l++) set_view(&m->layers[l].wq, &p, D, D, "wq");
        for (int l = 0; l < L; l++) set_view(&m->layers[l].wk, &p, D, KV, "wk");
        for (int l = 0; l < L; l++) set_view(&m->layers[l].wv, &p, D, KV, "wv");
        for (int l = 0; l < L; l++) set_view(&m->layers[l].wo, &p, D, D, "wo");
        for (int l = 0; l < L; l++) set_view(&m->layers[l].ffn_norm, &p, D, 1, "rms_ffn");
        for (int l = 0; l < L; l++) set_view(&m->layers[l].w_gate, &p, D, F, "w1");
        for (int l = 0; l < L; l++) set_view(&m->layers[l].w_down, &p, F, D, "w2");
        for (int l = 0; l < L; l++) set_view(&m->layers[l].w_up, &p, D, F, "w3");
        set_view(&m->output_norm, &p, D, 1, "rms_final");
        p += (int64_t)c->n_ctx_train * c->head_dim; /* legacy freq_cis_real + imag */
        if (shared) m->output = m->tok_embd;
        else set_view(&m->output, &p, D, V, "wcls");
        m->weight_bytes = (size_t)n_floats * 4;
    }
    char tpath[1100];
    if (!tokenizer_path) {
        const char *slash = strrchr(m->path, '/');
        int dirlen = slash ? (int)(slash - m->path + 1) : 0;
        snprintf(tpath, sizeof tpath, "%.*stokenizer.bin", dirlen, m->path);
        tokenizer_path = tpath;
    }
    int rc = vocab_from_llama2c(tokenizer_path, c->vocab_size, &m->vocab, err);
    if (rc) util_err_prefix(err, "tokenizer for %s (give it with --tokenizer FILE)", m->path);
    return rc;
}

/* ---- entry points -------------------------------------------------------- */

int model_load(struct kvlm_model *m, const char *path, const kvlm_model_params *params, kvlm_error *err) {
    kvlm_model_params defaults = {0};
    if (!params) params = &defaults;
    bool vocab_only = params->vocab_only;
    memset(m, 0, sizeof *m);
    m->cfg.pooling = -1; /* none in the file (kvlm_model_pooling) */
    m->map_flags = (params->no_mmap ? UTIL_MAP_READ : 0) | (params->mlock ? UTIL_MAP_LOCK : 0);
    m->vocab.bos = m->vocab.eos = m->vocab.unk = m->vocab.pad = m->vocab.eot = m->vocab.sep = -1;
    m->vocab.fim_pre = m->vocab.fim_suf = m->vocab.fim_mid = -1;
    snprintf(m->path, sizeof m->path, "%s", path);
    int rc;
    if (model_hf_is_dir(path)) {
        /* a Hugging Face directory: config.json, safetensors, tokenizer.json */
        if ((rc = model_hf_load(m, path, vocab_only, err))) goto fail;
        return KVLM_OK;
    }
    if ((rc = model_hf_file_hint(path, err))) goto fail;
    FILE *fp = fopen(path, "rb");
    if (!fp) return util_err_set(err, KVLM_EIO, "cannot open %s: %s", path, strerror(errno));
    char magic[4] = {0};
    size_t got = fread(magic, 1, 4, fp);
    fclose(fp);
    if (got == 4 && !memcmp(magic, "GGUF", 4)) {
        m->gguf = gguf_open_flags(path, m->map_flags, err);
        if (!m->gguf) return err ? err->code : KVLM_EFORMAT;
        if (params->metadata_only) return KVLM_OK;
        if (gguf_find(m->gguf, "tokenizer.ggml.model")) {
            if ((rc = vocab_from_gguf(m->gguf, &m->vocab, err))) { util_err_prefix(err, "%s", path); goto fail; }
        } else if (vocab_only) {
            rc = util_err_set(err, KVLM_EFORMAT, "%s: no tokenizer in this file", path);
            goto fail;
        }
        if (vocab_only) {
            m->cfg.vocab_size = m->vocab.n_tokens;
            return KVLM_OK;
        }
        if ((rc = load_gguf_weights(m, err))) goto fail;
        if (!m->vocab.n_tokens) {
            rc = util_err_set(err, KVLM_EFORMAT, "%s: no tokenizer in this file (tokenizer.ggml.model missing)", path);
            goto fail;
        }
        return KVLM_OK;
    }
    if ((rc = load_llama2c(m, params->tokenizer_path, vocab_only || params->metadata_only, err))) goto fail;
    return KVLM_OK;
fail:
    model_unload(m);
    return rc;
}

void model_unload(struct kvlm_model *m) {
    free(m->layers);
    m->layers = NULL;
    free(m->rope_freqs_own);
    free(m->rope_freqs_eff);
    free(m->longrope_own);
    m->rope_freqs_own = m->rope_freqs_eff = m->longrope_own = NULL;
    m->cfg.rope_freqs = m->cfg.rope_freqs_short = NULL;
    vocab_free(&m->vocab);
    model_hf_free(m);
    if (m->gguf) gguf_close(m->gguf);
    m->gguf = NULL;
    if (m->map) munmap(m->map, m->map_size);
    m->map = NULL;
}

void model_llama3_rope_freqs(float *out, int rope_dim, double base, double factor, double low, double high,
                             double orig_ctx) {
    const double lo_wave = orig_ctx / low, hi_wave = orig_ctx / high;
    for (int i = 0; i < rope_dim / 2; i++) {
        double wave = 6.283185307179586 * pow(base, 2.0 * i / rope_dim); /* 2 pi / the pair's frequency */
        if (wave < hi_wave) out[i] = 1.0f;
        else if (wave > lo_wave) out[i] = (float)factor;
        else { /* the frequency blends f / factor and f: its factor is the inverse */
            double smooth = (orig_ctx / wave - low) / (high - low);
            out[i] = (float)(1.0 / ((1 - smooth) / factor + smooth));
        }
    }
}

void model_yarn_rope_freqs(float *out, int rope_dim, double base, double factor, int orig_ctx, double beta_fast,
                           double beta_slow) {
    /* the pair index whose wavelength makes n_rot turns over the original context */
#define CORR(n_rot) (rope_dim * log(orig_ctx / ((n_rot) * 6.283185307179586)) / (2 * log(base)))
    double lo = floor(CORR(beta_fast)), hi = ceil(CORR(beta_slow));
#undef CORR
    lo = lo > 0 ? lo : 0;
    hi = hi < rope_dim - 1 ? hi : rope_dim - 1;
    for (int i = 0; i < rope_dim / 2; i++) {
        double y = (i - lo) / (hi - lo > 0.001 ? hi - lo : 0.001);
        double mix = 1 - (y < 0 ? 0 : y > 1 ? 1 : y); /* 1: extrapolated (kept), 0: interpolated (/ factor) */
        out[i] = (float)(1.0 / ((1 - mix) / factor + mix));
    }
}

/* Each of n RoPE factors finite and above 0. */
static int check_factors(const struct kvlm_model *m, const char *name, const float *f, int n, kvlm_error *err) {
    for (int i = 0; f && i < n; i++)
        if (!isfinite(f[i]) || f[i] <= 0)
            return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: factor %d is %g (RoPE frequency factors are "
                                "finite and above 0)", m->path, name, i, (double)f[i]);
    return KVLM_OK;
}

int model_set_rope_freqs(struct kvlm_model *m, kvlm_error *err) {
    const float *f = m->rope_freqs.data;
    const int n = m->cfg.rope_dim / 2;
    const kvlm_config *c = &m->cfg;
    const bool yarn = c->yarn_factor > 0 && c->arch != KVLM_ARCH_DEEPSEEK2;
    const float lin = c->rope_linear > 0 ? c->rope_linear : yarn ? 1.0f : 0.0f;
    int rc;
    m->cfg.rope_freqs = m->cfg.rope_freqs_short = NULL;
    if (m->rope_long.data) { /* LongRoPE: the two sets as they are, and nothing else */
        if (f || lin > 0)
            return util_err_set(err, KVLM_EUNSUPPORTED, "%s: LongRoPE factors beside %s RoPE scaling", m->path,
                                f ? "rope_freqs.weight" : yarn ? "YaRN" : "linear");
        if ((rc = check_factors(m, "rope_factors_long.weight", m->rope_long.data, n, err)) ||
            (rc = check_factors(m, "rope_factors_short.weight", m->rope_short.data, n, err)))
            return rc;
        m->cfg.rope_freqs = m->rope_long.data;
        m->cfg.rope_freqs_short = m->rope_short.data;
        return KVLM_OK;
    }
    if ((rc = check_factors(m, "rope_freqs.weight", f, n, err))) return rc;
    if (lin > 0) { /* the factors the forward pass divides by: the tensor's (or 1) times the linear one, times YaRN's */
        free(m->rope_freqs_eff);
        float *e = m->rope_freqs_eff = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
        if (!e) return util_err_set(err, KVLM_ENOMEM, "out of memory");
        if (yarn)
            model_yarn_rope_freqs(e, c->rope_dim, c->rope_base, c->yarn_factor, c->yarn_orig_ctx, c->yarn_beta_fast,
                                  c->yarn_beta_slow);
        for (int i = 0; i < n; i++) e[i] = (yarn ? e[i] : 1.0f) * ((f ? f[i] : 1.0f) * lin);
        f = e;
    }
    m->cfg.rope_freqs = f;
    return KVLM_OK;
}

/* ---- for the other architectures' loaders (model_deepseek2.c) -------------- */

int model_check_blocks(const struct kvlm_model *m, int n_layers, kvlm_error *err) {
    return check_blocks(m, m->arch_name, n_layers, err);
}
int model_hp_int(const struct kvlm_model *m, const char *key, int64_t *out, bool *found, kvlm_error *err) {
    return hp_int(m, m->arch_name, key, out, found, err);
}
int model_hp_float(const struct kvlm_model *m, const char *key, double lo, bool lo_open, double *out,
                   kvlm_error *err) {
    return hp_float(m, m->arch_name, key, lo, lo_open, out, err);
}
int model_take_experts(const struct kvlm_model *m, model_tensor *t, const char *name, int64_t n_in, int64_t n_out,
                       int n_expert, kvlm_error *err) {
    const gguf_tensor *gt = gguf_find_tensor(m->gguf, name);
    memset(t, 0, sizeof *t);
    if (!gt) return util_err_set(err, KVLM_EFORMAT, "%s: missing tensor %s", m->path, name);
    if (gt->n_dims != 3 || gt->ne[0] != n_in || gt->ne[1] != n_out || gt->ne[2] != n_expert)
        return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: shape %lldx%lldx%lld, expected %lldx%lldx%d", m->path,
                            name, (long long)gt->ne[0], (long long)gt->ne[1], (long long)gt->ne[2], (long long)n_in,
                            (long long)n_out, n_expert);
    const dt_traits *tr = dt_info(gt->type);
    if (!tr || gt->type == DT_Q8_K)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: tensor %s: type id %d is not supported for weights", m->path,
                            name, gt->type);
    t->data = gt->data;
    t->type = gt->type;
    t->n_in = n_in;
    t->n_out = n_out * n_expert;
    t->name = gt->cname;
    return KVLM_OK;
}

int model_take_tensor(const struct kvlm_model *m, model_tensor *t, const char *name, int64_t n_in, int64_t n_out,
                      bool optional, kvlm_error *err) {
    return take_tensor(m, t, name, n_in, n_out, optional, err);
}
