/* model/model_bert: the encoders bert and nomic-bert (nomic-embed-text) as
 * llama.cpp's converter writes them: hyper-parameters and every tensor. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "model/model.h"
#include "util/error.h"

int model_bert_load(struct kvlm_model *m, kvlm_error *err) {
    kvlm_config *c = &m->cfg;
    const char *arch = m->arch_name;
    bool nomic = c->arch == KVLM_ARCH_NOMIC_BERT;
    int64_t v;
    bool found;
    int rc;
    char key[128];
    /* bert.attention.causal: false in every file the converter writes; a causal one is not an encoder */
    snprintf(key, sizeof key, "%s.attention.causal", arch);
    bool causal = false;
    const gguf_kv *ck = gguf_find(m->gguf, key);
    if (ck && !gguf_get_bool(m->gguf, key, &causal))
        return util_err_set(err, KVLM_EFORMAT, "%s: key %s must be a bool", m->path, key);
    if (causal)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: key %s = true: a causal %s is not supported (kvlm runs %s "
                            "as an encoder)", m->path, key, arch, arch);
    c->n_kv_heads = c->n_heads;
    if ((rc = model_hp_int(m, "attention.head_count_kv", &v, &found, err))) return rc;
    if (found && v != c->n_heads)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: %s with %lld KV heads for %d query heads is not supported",
                            m->path, arch, (long long)v, c->n_heads);
    if (c->dim % c->n_heads || (c->dim / c->n_heads) & 1 || c->dim / c->n_heads > 1024)
        return util_err_set(err, KVLM_EFORMAT, "%s: %d heads do not divide the width %d into even heads", m->path,
                            c->n_heads, c->dim);
    c->head_dim = c->rope_dim = c->dim / c->n_heads;
    c->n_ctx_train = 512; /* BERT's */
    if ((rc = model_hp_int(m, "context_length", &v, &found, err))) return rc;
    if (found && (v < 1 || v > (1 << 20)))
        return util_err_set(err, KVLM_EFORMAT, "%s: key %s.context_length = %lld is out of range", m->path, arch,
                            (long long)v);
    if (found) c->n_ctx_train = (int)v;
    double d = 1e-12; /* BERT's layer_norm_eps */
    if ((rc = model_hp_float(m, "attention.layer_norm_epsilon", 0, false, &d, err))) return rc;
    c->norm_eps = (float)d;
    d = 10000.0;
    if ((rc = model_hp_float(m, "rope.freq_base", 0, true, &d, err))) return rc;
    c->rope_base = c->rope_base_local = (float)d;
    c->rope_neox = true; /* nomic-bert: llama.cpp's rope type for it; bert turns nothing */
    c->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    if ((rc = model_check_blocks(m, c->n_layers, err))) return rc;

    const gguf_tensor *emb = gguf_find_tensor(m->gguf, "token_embd.weight");
    if (!emb || emb->n_dims < 2 || emb->ne[1] <= 0 || emb->ne[1] > (1 << 28))
        return util_err_set(err, KVLM_EFORMAT, "%s: missing tensor token_embd.weight", m->path);
    c->vocab_size = (int)emb->ne[1];
    if (m->vocab.n_tokens && m->vocab.n_tokens != c->vocab_size)
        return util_err_set(err, KVLM_EFORMAT, "%s: tokenizer has %d tokens but token_embd.weight has %d rows",
                            m->path, m->vocab.n_tokens, c->vocab_size);
    const gguf_tensor *types = gguf_find_tensor(m->gguf, "token_types.weight");
    int64_t n_types = types && types->n_dims >= 2 ? types->ne[1] : 1;
    if (n_types < 1 || n_types > 1024)
        return util_err_set(err, KVLM_EFORMAT, "%s: token_types.weight has %lld rows", m->path, (long long)n_types);
    int D = c->dim, F = c->hidden_dim;
    if ((rc = model_take_tensor(m, &m->tok_embd, "token_embd.weight", D, c->vocab_size, false, err)) ||
        (rc = model_take_tensor(m, &m->type_embd, "token_types.weight", D, n_types, false, err)) ||
        (!nomic && (rc = model_take_tensor(m, &m->pos_embd, "position_embd.weight", D, c->n_ctx_train, false, err))) ||
        (rc = model_take_tensor(m, &m->embd_norm, "token_embd_norm.weight", D, 0, false, err)) ||
        (rc = model_take_tensor(m, &m->embd_norm_b, "token_embd_norm.bias", D, 0, false, err)))
        return rc;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    for (int l = 0; l < c->n_layers; l++) {
        model_layer *L = &m->layers[l];
        char n[96];
#define TAKE(field, suffix, nin, nout)                                      \
    snprintf(n, sizeof n, "blk.%d.%s", l, suffix);                          \
    if ((rc = model_take_tensor(m, &L->field, n, nin, nout, false, err))) return rc;
        if (nomic) { /* one matrix: rows of Q, then K, then V */
            model_tensor fused;
            snprintf(n, sizeof n, "blk.%d.attn_qkv.weight", l);
            if ((rc = model_take_tensor(m, &fused, n, D, 3 * (int64_t)D, false, err))) return rc;
            L->wq = model_tensor_rows(&fused, 0, D);
            L->wk = model_tensor_rows(&fused, D, D);
            L->wv = model_tensor_rows(&fused, 2 * (int64_t)D, D);
            TAKE(w_gate, "ffn_gate.weight", D, F);
        } else {
            TAKE(wq, "attn_q.weight", D, D);
            TAKE(wk, "attn_k.weight", D, D);
            TAKE(wv, "attn_v.weight", D, D);
            TAKE(bq, "attn_q.bias", D, 0);
            TAKE(bk, "attn_k.bias", D, 0);
            TAKE(bv, "attn_v.bias", D, 0);
            TAKE(bo, "attn_output.bias", D, 0);
            TAKE(b_up, "ffn_up.bias", F, 0);
            TAKE(b_down, "ffn_down.bias", D, 0);
        }
        TAKE(wo, "attn_output.weight", D, D);
        TAKE(attn_out_norm, "attn_output_norm.weight", D, 0);
        TAKE(attn_out_norm_b, "attn_output_norm.bias", D, 0);
        TAKE(w_up, "ffn_up.weight", D, F);
        TAKE(w_down, "ffn_down.weight", F, D);
        TAKE(out_norm, "layer_output_norm.weight", D, 0);
        TAKE(out_norm_b, "layer_output_norm.bias", D, 0);
#undef TAKE
        if (l == 0) c->weight_type = L->wq.type;
    }
    for (uint64_t i = 0; i < m->gguf->n_tensors; i++) m->weight_bytes += m->gguf->tensors[i].nbytes;
    return KVLM_OK;
}
