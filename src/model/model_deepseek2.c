/* model/model_deepseek2: the deepseek2 GGUF architecture (DeepSeek-V2/V3):
 * multi-head latent attention's hyper-parameters and tensors, and the
 * mixture-of-experts feed-forward (3-D expert tensors as stacked rows). */
#include <stdio.h>
#include <string.h>
#include "dtype/dtype.h"
#include "model/model.h"
#include "util/error.h"

/* An integer key of the architecture that must lie in [lo, hi]; *out keeps
 * its default when the key is absent and required is false. */
static int key_int(struct kvlm_model *m, const char *key, bool required, int lo, int hi, int *out, kvlm_error *err) {
    int64_t v;
    bool found;
    int rc = model_hp_int(m, key, &v, &found, err);
    if (rc) return rc;
    if (!found) {
        if (required) return util_err_set(err, KVLM_EFORMAT, "%s: missing key deepseek2.%s", m->path, key);
        return KVLM_OK;
    }
    if (v < lo || v > hi)
        return util_err_set(err, KVLM_EFORMAT, "%s: key deepseek2.%s = %lld is outside %d..%d", m->path, key,
                            (long long)v, lo, hi);
    *out = (int)v;
    return KVLM_OK;
}

static int read_hparams(struct kvlm_model *m, kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    const gguf_file *f = m->gguf;
    int rc;
    char s[64];
    /* Files of llama.cpp's MLA conversion describe the cached row as the
     * "head" (key_length = kv_lora + rope, value_length = kv_lora) and give
     * the real per-head lengths in *_mla keys. */
    bool mla_keys = gguf_find(f, "deepseek2.attention.key_length_mla") != NULL;
    if (gguf_get_str(f, "deepseek2.rope.scaling.type", s, sizeof s) && strcmp(s, "none")) {
        double factor = 1.0, log_mul = 0, fast = 32, slow = 1;
        if ((rc = model_hp_float(m, "rope.scaling.factor", 0, true, &factor, err))) return rc;
        if (strcmp(s, "yarn") && factor != 1.0)
            return util_err_set(err, KVLM_EUNSUPPORTED,
                                "%s: RoPE scaling '%s' (factor %g) is not supported for deepseek2 (yarn is)", m->path,
                                s, factor);
        if (!strcmp(s, "yarn") && factor != 1.0) {
            if ((rc = key_int(m, "rope.scaling.original_context_length", true, 1, 1 << 24, &c->yarn_orig_ctx, err)))
                return rc;
            if ((rc = model_hp_float(m, "rope.scaling.yarn_log_multiplier", 0, false, &log_mul, err))) return rc;
            if ((rc = model_hp_float(m, "rope.scaling.yarn_beta_fast", 0, true, &fast, err))) return rc;
            if ((rc = model_hp_float(m, "rope.scaling.yarn_beta_slow", 0, true, &slow, err))) return rc;
            c->yarn_factor = (float)factor;
            c->yarn_log_mul = (float)log_mul;
            c->yarn_beta_fast = (float)fast;
            c->yarn_beta_slow = (float)slow;
        }
    }
    c->n_kv_heads = 1; /* one latent row per token, shared by every query head */
    c->q_lora_rank = 0;
    if ((rc = key_int(m, "attention.q_lora_rank", false, 0, 1 << 16, &c->q_lora_rank, err))) return rc;
    if ((rc = key_int(m, "attention.kv_lora_rank", true, 2, 1 << 16, &c->kv_lora_rank, err))) return rc;
    c->v_head_dim = c->head_dim - c->rope_dim;
    if ((rc = key_int(m, "attention.value_length", false, 1, 1 << 16, &c->v_head_dim, err))) return rc;
    if (mla_keys) {
        if ((rc = key_int(m, "attention.key_length_mla", true, 2, 1024, &c->head_dim, err))) return rc;
        if ((rc = key_int(m, "attention.value_length_mla", true, 1, 1 << 16, &c->v_head_dim, err))) return rc;
    }
    if (c->rope_dim >= c->head_dim)
        return util_err_set(err, KVLM_EFORMAT, "%s: key length %d leaves no part without RoPE (rope dimension %d)",
                            m->path, c->head_dim, c->rope_dim);
    if (c->kv_lora_rank & 1)
        return util_err_set(err, KVLM_EFORMAT, "%s: kv_lora_rank %d must be even", m->path, c->kv_lora_rank);
    c->n_dense_lead = c->n_layers;
    if ((rc = key_int(m, "expert_count", false, 0, 1024, &c->n_expert, err))) return rc; /* engine/moe.h */
    if (c->n_expert > 0) {
        c->n_dense_lead = 0;
        if ((rc = key_int(m, "leading_dense_block_count", false, 0, c->n_layers, &c->n_dense_lead, err))) return rc;
        if ((rc = key_int(m, "expert_used_count", true, 1, c->n_expert, &c->n_expert_used, err))) return rc;
        if ((rc = key_int(m, "expert_shared_count", false, 0, 1 << 10, &c->n_expert_shared, err))) return rc;
        if ((rc = key_int(m, "expert_feed_forward_length", true, 1, 1 << 20, &c->expert_ff, err))) return rc;
        c->expert_gating = 1;
        if ((rc = key_int(m, "expert_gating_func", false, 1, 2, &c->expert_gating, err))) return rc;
        double d = 1.0;
        if ((rc = model_hp_float(m, "expert_weights_scale", 0, true, &d, err))) return rc;
        c->expert_weights_scale = (float)d;
        char key[96];
        snprintf(key, sizeof key, "deepseek2.expert_weights_norm");
        if (gguf_find(f, key) && !gguf_get_bool(f, key, &c->expert_weights_norm))
            return util_err_set(err, KVLM_EFORMAT, "%s: key %s must be a bool", m->path, key);
        /* V3's group-limited routing picks experts only from the best groups */
        int groups = 1, used_groups = 1;
        if ((rc = key_int(m, "expert_group_count", false, 1, 1 << 10, &groups, err))) return rc;
        if ((rc = key_int(m, "expert_group_used_count", false, 1, 1 << 10, &used_groups, err))) return rc;
        if (used_groups < groups)
            return util_err_set(err, KVLM_EUNSUPPORTED, "%s: group-limited expert routing (%d of %d groups) is not "
                                "supported", m->path, used_groups, groups);
    }
    return KVLM_OK;
}

int model_deepseek2_layers(struct kvlm_model *m, kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    int rc = read_hparams(m, err);
    if (rc) return rc;
    int64_t H = c->n_heads, nope = c->head_dim - c->rope_dim;
    int64_t q_dim = H * c->head_dim;
    for (int l = 0; l < c->n_layers; l++) {
        model_layer *L = &m->layers[l];
        char n[96];
#define TAKE(field, suffix, nin, nout, opt)                                          \
    snprintf(n, sizeof n, "blk.%d.%s", l, suffix);                                   \
    if ((rc = model_take_tensor(m, &L->field, n, nin, nout, opt, err))) return rc;
        TAKE(attn_norm, "attn_norm.weight", c->dim, 0, false);
        if (c->q_lora_rank) {
            TAKE(wq_a, "attn_q_a.weight", c->dim, c->q_lora_rank, false);
            TAKE(q_a_norm, "attn_q_a_norm.weight", c->q_lora_rank, 0, false);
            TAKE(wq_b, "attn_q_b.weight", c->q_lora_rank, q_dim, false);
        } else {
            TAKE(wq, "attn_q.weight", c->dim, q_dim, false);
        }
        TAKE(wkv_a, "attn_kv_a_mqa.weight", c->dim, c->kv_lora_rank + c->rope_dim, false);
        TAKE(kv_a_norm, "attn_kv_a_norm.weight", c->kv_lora_rank, 0, false);
        snprintf(n, sizeof n, "blk.%d.attn_kv_b.weight", l);
        if (gguf_find_tensor(m->gguf, n) || !(snprintf(n, sizeof n, "blk.%d.attn_k_b.weight", l), gguf_find_tensor(m->gguf, n))) {
            TAKE(wkv_b, "attn_kv_b.weight", c->kv_lora_rank, H * (nope + c->v_head_dim), false);
        } else { /* split per head (llama.cpp's MLA conversion) */
            snprintf(n, sizeof n, "blk.%d.attn_k_b.weight", l);
            if ((rc = model_take_experts(m, &L->wk_b, n, nope, c->kv_lora_rank, (int)H, err))) return rc;
            snprintf(n, sizeof n, "blk.%d.attn_v_b.weight", l);
            if ((rc = model_take_experts(m, &L->wv_b, n, c->kv_lora_rank, c->v_head_dim, (int)H, err))) return rc;
        }
        TAKE(wo, "attn_output.weight", H * c->v_head_dim, c->dim, false);
        TAKE(ffn_norm, "ffn_norm.weight", c->dim, 0, false);
        if (l < c->n_dense_lead) {
            TAKE(w_gate, "ffn_gate.weight", c->dim, c->hidden_dim, false);
            TAKE(w_up, "ffn_up.weight", c->dim, c->hidden_dim, false);
            TAKE(w_down, "ffn_down.weight", c->hidden_dim, c->dim, false);
        } else {
            TAKE(ffn_gate_inp, "ffn_gate_inp.weight", c->dim, c->n_expert, false);
            TAKE(exp_probs_b, "exp_probs_b.bias", c->n_expert, 0, true);
            snprintf(n, sizeof n, "blk.%d.ffn_gate_exps.weight", l);
            if ((rc = model_take_experts(m, &L->gate_exps, n, c->dim, c->expert_ff, c->n_expert, err))) return rc;
            snprintf(n, sizeof n, "blk.%d.ffn_up_exps.weight", l);
            if ((rc = model_take_experts(m, &L->up_exps, n, c->dim, c->expert_ff, c->n_expert, err))) return rc;
            snprintf(n, sizeof n, "blk.%d.ffn_down_exps.weight", l);
            if ((rc = model_take_experts(m, &L->down_exps, n, c->expert_ff, c->dim, c->n_expert, err))) return rc;
            if (c->n_expert_shared) {
                int64_t sf = (int64_t)c->expert_ff * c->n_expert_shared;
                TAKE(gate_shexp, "ffn_gate_shexp.weight", c->dim, sf, false);
                TAKE(up_shexp, "ffn_up_shexp.weight", c->dim, sf, false);
                TAKE(down_shexp, "ffn_down_shexp.weight", sf, c->dim, false);
            }
        }
#undef TAKE
        if (l == 0) c->weight_type = L->wkv_a.type;
    }
    for (uint64_t i = 0; i < m->gguf->n_tensors; i++) m->weight_bytes += m->gguf->tensors[i].nbytes;
    return KVLM_OK;
}
