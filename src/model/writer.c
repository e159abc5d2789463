/* model/writer: writing models as GGUF v3 — conversion of a loaded model
 * (`kvlm convert`) and synthetic random-weight models for tests/benchmarks. */
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "dtype/dtype.h"
#include "dtype/iq.h"
#include "dtype/tq.h"
#include "model/model.h"
#include "util/pool.h"
#include "util/error.h"

typedef struct {
    char name[64];
    model_tensor t;
    void *own; /* a fused tensor's data, when its parts were not adjacent */
    int n_expert; /* > 0: stacked experts, written 3-D {n_in, n_out / n_expert, n_expert} */
} named_tensor;

/* One matrix of the rows of parts[0], parts[1], ... (phi3's attn_qkv and
 * gate+up ffn_up). Views of one fused tensor (a loaded phi3 file, or synth)
 * are adjacent already; other parts are copied, through f32 if their types
 * differ. Returns false if out of memory. */
static bool fuse_rows(named_tensor *out, const model_tensor *const *parts, int n_parts) {
    model_tensor t = *parts[0];
    bool adjacent = true, same_type = true;
    size_t row = dt_row_size(t.type, t.n_in);
    for (int i = 1; i < n_parts; i++) {
        same_type &= parts[i]->type == t.type;
        adjacent &= same_type && parts[i]->data == (const char *)t.data + (size_t)t.n_out * row;
        t.n_out += parts[i]->n_out;
    }
    out->own = NULL;
    if (!adjacent) {
        int type = same_type ? t.type : DT_F32;
        size_t out_row = dt_row_size(type, t.n_in);
        char *buf = malloc(out_row * (size_t)t.n_out), *p = buf;
        if (!buf) return false;
        for (int i = 0; i < n_parts; i++) {
            const model_tensor *s = parts[i];
            if (same_type) memcpy(p, s->data, out_row * (size_t)s->n_out);
            else
                for (int64_t r = 0; r < s->n_out; r++)
                    dt_dequantize_row(s->type, (const char *)s->data + (size_t)r * dt_row_size(s->type, s->n_in),
                                      (float *)(p + (size_t)r * out_row), s->n_in);
            p += out_row * (size_t)s->n_out;
        }
        t.data = out->own = buf;
        t.type = type;
    }
    t.packed = NULL;
    out->t = t;
    return true;
}

/* A Hugging Face Llama's query or key rows (rotate-half order within each
 * head, loaded with NeoX RoPE: model/hf.c) in GGUF's interleaved order, as
 * llama.cpp's converter permutes them: GGUF row h*d + 2i + j is row
 * h*d + j*d/2 + i. Returns false if out of memory. */
static bool interleave_rows(named_tensor *out, const model_tensor *t, int head_dim) {
    size_t row = dt_row_size(t->type, t->n_in);
    int64_t half = head_dim / 2, n_head = t->n_out / head_dim;
    char *buf = malloc(row * (size_t)t->n_out);
    if (!buf) return false;
    const char *src = t->data;
    for (int64_t h = 0; h < n_head; h++)
        for (int64_t i = 0; i < half; i++)
            for (int64_t j = 0; j < 2; j++)
                memcpy(buf + (size_t)(h * head_dim + 2 * i + j) * row, src + (size_t)(h * head_dim + j * half + i) * row,
                       row);
    out->t = *t;
    out->t.data = out->own = buf;
    out->t.packed = NULL;
    return true;
}

/* Every tensor of m under its GGUF name; returns the count (n <= cap), or -1
 * if out of memory. */
static int list_tensors(const struct kvlm_model *m, named_tensor *out, int cap) {
    int n = 0;
    bool phi3 = m->cfg.arch == KVLM_ARCH_PHI3, nomic = m->cfg.arch == KVLM_ARCH_NOMIC_BERT;
    /* a llama with NeoX RoPE is a Hugging Face directory's: GGUF's llama is interleaved */
    bool interleave = model_llama_rows(m->cfg.arch) && m->cfg.rope_neox;
#define ADD(fmt, l, tensor)                                                  \
    if ((tensor).data && n < cap) {                                          \
        snprintf(out[n].name, sizeof out[n].name, fmt, l);                   \
        out[n++].t = (tensor);                                               \
    }
#define ADD_FUSED(fmt, l, ...)                                                                  \
    if (n < cap) {                                                                              \
        const model_tensor *parts[] = {__VA_ARGS__};                                            \
        snprintf(out[n].name, sizeof out[n].name, fmt, l);                                      \
        if (!fuse_rows(&out[n++], parts, (int)(sizeof parts / sizeof parts[0]))) return -1;     \
    }
    ADD("token_embd.weight%.0d", 0, m->tok_embd);
    ADD("token_types.weight%.0d", 0, m->type_embd);     /* bert, nomic-bert */
    ADD("position_embd.weight%.0d", 0, m->pos_embd);
    ADD("token_embd_norm.weight%.0d", 0, m->embd_norm);
    ADD("token_embd_norm.bias%.0d", 0, m->embd_norm_b);
    ADD("output_norm.weight%.0d", 0, m->output_norm);
    ADD("rope_freqs.weight%.0d", 0, m->rope_freqs);
    ADD("rope_factors_long.weight%.0d", 0, m->rope_long);
    ADD("rope_factors_short.weight%.0d", 0, m->rope_short);
    if (m->output.data != m->tok_embd.data) ADD("output.weight%.0d", 0, m->output);
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const model_layer *L = &m->layers[l];
        ADD("blk.%d.attn_norm.weight", l, L->attn_norm);
        if (phi3 || nomic) {
            ADD_FUSED("blk.%d.attn_qkv.weight", l, &L->wq, &L->wk, &L->wv);
        } else if (interleave) {
            const model_tensor *qk[2] = {&L->wq, &L->wk};
            for (int i = 0; i < 2 && n < cap; i++) {
                snprintf(out[n].name, sizeof out[n].name, "blk.%d.attn_%c.weight", l, i ? 'k' : 'q');
                if (!interleave_rows(&out[n++], qk[i], m->cfg.head_dim)) return -1;
            }
            ADD("blk.%d.attn_v.weight", l, L->wv);
        } else {
            ADD("blk.%d.attn_q.weight", l, L->wq);
            ADD("blk.%d.attn_k.weight", l, L->wk);
            ADD("blk.%d.attn_v.weight", l, L->wv);
        }
        ADD("blk.%d.attn_output.weight", l, L->wo);
        ADD("blk.%d.attn_q.bias", l, L->bq);
        ADD("blk.%d.attn_k.bias", l, L->bk);
        ADD("blk.%d.attn_v.bias", l, L->bv);
        ADD("blk.%d.attn_output.bias", l, L->bo);       /* gpt-oss */
        ADD("blk.%d.attn_sinks.weight", l, L->attn_sinks);
        if (m->cfg.arch == KVLM_ARCH_GPTOSS) { /* its FFN norm's name */
            ADD("blk.%d.post_attention_norm.weight", l, L->ffn_norm);
        } else {
            ADD("blk.%d.ffn_norm.weight", l, L->ffn_norm);
        }
        if (phi3) {
            ADD_FUSED("blk.%d.ffn_up.weight", l, &L->w_gate, &L->w_up); /* gate rows first */
        } else {
            ADD("blk.%d.ffn_gate.weight", l, L->w_gate);
            ADD("blk.%d.ffn_up.weight", l, L->w_up);
        }
        ADD("blk.%d.ffn_down.weight", l, L->w_down);
        /* deepseek2 (absent elsewhere): attention, then the MoE tensors */
        ADD("blk.%d.attn_q_a.weight", l, L->wq_a);
        ADD("blk.%d.attn_q_a_norm.weight", l, L->q_a_norm);
        ADD("blk.%d.attn_q_b.weight", l, L->wq_b);
        ADD("blk.%d.attn_kv_a_mqa.weight", l, L->wkv_a);
        ADD("blk.%d.attn_kv_a_norm.weight", l, L->kv_a_norm);
        ADD("blk.%d.attn_kv_b.weight", l, L->wkv_b);
        int heads_at = n;
        ADD("blk.%d.attn_k_b.weight", l, L->wk_b);
        ADD("blk.%d.attn_v_b.weight", l, L->wv_b);
        for (int i = heads_at; i < n; i++) out[i].n_expert = m->cfg.n_heads; /* stacked per head */
        ADD("blk.%d.ffn_gate_inp.weight", l, L->ffn_gate_inp);
        ADD("blk.%d.exp_probs_b.bias", l, L->exp_probs_b);
        int first = n;
        ADD("blk.%d.ffn_gate_exps.weight", l, L->gate_exps);
        ADD("blk.%d.ffn_up_exps.weight", l, L->up_exps);
        ADD("blk.%d.ffn_down_exps.weight", l, L->down_exps);
        for (int i = first; i < n; i++) out[i].n_expert = m->cfg.n_expert;
        ADD("blk.%d.ffn_gate_inp.bias", l, L->ffn_gate_inp_b); /* gpt-oss; the experts' as [expert][row] */
        ADD("blk.%d.ffn_gate_exps.bias", l, L->gate_exps_b);
        ADD("blk.%d.ffn_up_exps.bias", l, L->up_exps_b);
        ADD("blk.%d.ffn_down_exps.bias", l, L->down_exps_b);
        ADD("blk.%d.ffn_gate_inp_shexp.weight", l, L->ffn_gate_inp_shexp);
        ADD("blk.%d.ffn_gate_shexp.weight", l, L->gate_shexp);
        ADD("blk.%d.ffn_up_shexp.weight", l, L->up_shexp);
        ADD("blk.%d.ffn_down_shexp.weight", l, L->down_shexp);
        ADD("blk.%d.post_attention_norm.weight", l, L->post_attn_norm);
        ADD("blk.%d.post_ffw_norm.weight", l, L->post_ffn_norm);
        ADD("blk.%d.attn_q_norm.weight", l, L->q_norm);
        ADD("blk.%d.attn_k_norm.weight", l, L->k_norm);
        ADD("blk.%d.attn_output_norm.weight", l, L->attn_out_norm); /* bert, nomic-bert */
        ADD("blk.%d.attn_output_norm.bias", l, L->attn_out_norm_b);
        ADD("blk.%d.layer_output_norm.weight", l, L->out_norm);
        ADD("blk.%d.layer_output_norm.bias", l, L->out_norm_b);
        ADD("blk.%d.ffn_up.bias", l, L->b_up);
        ADD("blk.%d.ffn_down.bias", l, L->b_down);
    }
#undef ADD
#undef ADD_FUSED
    return n;
}

/* mla_split: deepseek2 with attn_k_b / attn_v_b (llama.cpp's MLA form: the
 * cached row is the "head", the real lengths in *_mla keys) */
static void write_hparams(gguf_writer *w, const kvlm_config *c, const char *name, bool mla_split) {
    const char *arch = model_arch_name(c->arch);
    char k[128];
    gguf_writer_set_str(w, "general.architecture", arch);
    gguf_writer_set_str(w, "general.name", name);
    gguf_writer_set_u32(w, "general.alignment", 32);
#define KEY(s) (snprintf(k, sizeof k, "%s.%s", arch, s), k)
    gguf_writer_set_u32(w, KEY("context_length"), (uint32_t)c->n_ctx_train);
    gguf_writer_set_u32(w, KEY("embedding_length"), (uint32_t)c->dim);
    gguf_writer_set_u32(w, KEY("block_count"), (uint32_t)c->n_layers);
    gguf_writer_set_u32(w, KEY("feed_forward_length"), (uint32_t)c->hidden_dim);
    if (c->rope_linear > 0) {
        gguf_writer_set_str(w, KEY("rope.scaling.type"), "linear");
        gguf_writer_set_f32(w, KEY("rope.scaling.factor"), c->rope_linear);
    } else if (c->yarn_factor > 0 && c->arch != KVLM_ARCH_DEEPSEEK2) { /* deepseek2 writes its own below */
        gguf_writer_set_str(w, KEY("rope.scaling.type"), "yarn");
        gguf_writer_set_f32(w, KEY("rope.scaling.factor"), c->yarn_factor);
        gguf_writer_set_u32(w, KEY("rope.scaling.original_context_length"), (uint32_t)c->yarn_orig_ctx);
        gguf_writer_set_f32(w, KEY("rope.scaling.yarn_beta_fast"), c->yarn_beta_fast);
        gguf_writer_set_f32(w, KEY("rope.scaling.yarn_beta_slow"), c->yarn_beta_slow);
    } else if (c->rope_freqs_short) { /* LongRoPE: as llama.cpp's converter, no type key; the factors are tensors */
        gguf_writer_set_u32(w, KEY("rope.scaling.original_context_length"), (uint32_t)c->longrope_orig_ctx);
        gguf_writer_set_f32(w, KEY("rope.scaling.attn_factor"), c->longrope_attn_factor);
    }
    gguf_writer_set_u32(w, KEY("attention.head_count"), (uint32_t)c->n_heads);
    /* deepseek2 files give every query head a "KV head" (kvlm reads one latent) */
    gguf_writer_set_u32(w, KEY("attention.head_count_kv"),
                        (uint32_t)(c->arch == KVLM_ARCH_DEEPSEEK2 ? c->n_heads : c->n_kv_heads));
    if (c->arch == KVLM_ARCH_DEEPSEEK2) {
        if (mla_split) {
            gguf_writer_set_u32(w, KEY("attention.key_length"), (uint32_t)(c->kv_lora_rank + c->rope_dim));
            gguf_writer_set_u32(w, KEY("attention.value_length"), (uint32_t)c->kv_lora_rank);
            gguf_writer_set_u32(w, KEY("attention.key_length_mla"), (uint32_t)c->head_dim);
            gguf_writer_set_u32(w, KEY("attention.value_length_mla"), (uint32_t)c->v_head_dim);
        } else {
            gguf_writer_set_u32(w, KEY("attention.key_length"), (uint32_t)c->head_dim);
            gguf_writer_set_u32(w, KEY("attention.value_length"), (uint32_t)c->v_head_dim);
        }
        if (c->q_lora_rank) gguf_writer_set_u32(w, KEY("attention.q_lora_rank"), (uint32_t)c->q_lora_rank);
        if (c->yarn_factor > 0) {
            gguf_writer_set_str(w, KEY("rope.scaling.type"), "yarn");
            gguf_writer_set_f32(w, KEY("rope.scaling.factor"), c->yarn_factor);
            gguf_writer_set_u32(w, KEY("rope.scaling.original_context_length"), (uint32_t)c->yarn_orig_ctx);
            gguf_writer_set_f32(w, KEY("rope.scaling.yarn_log_multiplier"), c->yarn_log_mul);
            gguf_writer_set_f32(w, KEY("rope.scaling.yarn_beta_fast"), c->yarn_beta_fast);
            gguf_writer_set_f32(w, KEY("rope.scaling.yarn_beta_slow"), c->yarn_beta_slow);
        }
        gguf_writer_set_u32(w, KEY("attention.kv_lora_rank"), (uint32_t)c->kv_lora_rank);
        if (c->n_expert) {
            gguf_writer_set_u32(w, KEY("leading_dense_block_count"), (uint32_t)c->n_dense_lead);
            gguf_writer_set_u32(w, KEY("expert_count"), (uint32_t)c->n_expert);
            gguf_writer_set_u32(w, KEY("expert_used_count"), (uint32_t)c->n_expert_used);
            gguf_writer_set_u32(w, KEY("expert_shared_count"), (uint32_t)c->n_expert_shared);
            gguf_writer_set_u32(w, KEY("expert_feed_forward_length"), (uint32_t)c->expert_ff);
            gguf_writer_set_f32(w, KEY("expert_weights_scale"), c->expert_weights_scale);
            gguf_writer_set_bool(w, KEY("expert_weights_norm"), c->expert_weights_norm);
            gguf_writer_set_u32(w, KEY("expert_gating_func"), (uint32_t)c->expert_gating);
        }
    } else if (c->head_dim != c->dim / c->n_heads) {
        gguf_writer_set_u32(w, KEY("attention.key_length"), (uint32_t)c->head_dim);
        gguf_writer_set_u32(w, KEY("attention.value_length"), (uint32_t)c->head_dim);
    }
    if (model_granite_like(c->arch)) { /* llama.cpp's names for the four multipliers */
        if (c->embed_mult > 0) gguf_writer_set_f32(w, KEY("embedding_scale"), c->embed_mult);
        if (c->residual_mult > 0) gguf_writer_set_f32(w, KEY("residual_scale"), c->residual_mult);
        if (c->logit_div > 0) gguf_writer_set_f32(w, KEY("logit_scale"), c->logit_div);
        gguf_writer_set_f32(w, KEY("attention.scale"), c->attn_scale);
    }
    if (c->n_expert && c->arch != KVLM_ARCH_DEEPSEEK2) { /* Mixtral's (llama) and qwen3moe's keys */
        gguf_writer_set_u32(w, KEY("expert_count"), (uint32_t)c->n_expert);
        gguf_writer_set_u32(w, KEY("expert_used_count"), (uint32_t)c->n_expert_used);
        if (c->arch == KVLM_ARCH_QWEN3MOE || c->arch == KVLM_ARCH_QWEN2MOE || c->arch == KVLM_ARCH_GPTOSS)
            gguf_writer_set_u32(w, KEY("expert_feed_forward_length"), (uint32_t)c->expert_ff);
        if (c->expert_shared_ff > 0)
            gguf_writer_set_u32(w, KEY("expert_shared_feed_forward_length"), (uint32_t)c->expert_shared_ff);
    }
    if (c->pooling >= 0) gguf_writer_set_u32(w, KEY("pooling_type"), (uint32_t)c->pooling);
    if (c->encoder) { /* llama.cpp's converter's keys: a LayerNorm's epsilon, not causal */
        gguf_writer_set_f32(w, KEY("attention.layer_norm_epsilon"), c->norm_eps);
        gguf_writer_set_bool(w, KEY("attention.causal"), false);
    } else
        gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), c->norm_eps);
    gguf_writer_set_f32(w, KEY("rope.freq_base"), c->rope_base);
    gguf_writer_set_u32(w, KEY("rope.dimension_count"), (uint32_t)c->rope_dim);
    /* llama.cpp's keys; gemma's defaults hold when absent, so write them always */
    bool gemma = c->arch == KVLM_ARCH_GEMMA2 || c->arch == KVLM_ARCH_GEMMA3;
    if (c->sliding_window > 0 || gemma) gguf_writer_set_u32(w, KEY("attention.sliding_window"), (uint32_t)c->sliding_window);
    int period = c->arch == KVLM_ARCH_GEMMA2 || c->arch == KVLM_ARCH_GPTOSS ? 2 : c->arch == KVLM_ARCH_GEMMA3 ? 6 : 0;
    if (c->arch == KVLM_ARCH_OLMO2 && c->sliding_window > 0) {
        /* OLMo 3: a bool per layer (local), as llama.cpp's converter writes it; the local layers' RoPE base */
        uint8_t *local = malloc((size_t)c->n_layers);
        for (int l = 0; local && l < c->n_layers; l++) local[l] = model_layer_window(c, l) > 0;
        if (local) gguf_writer_set_arr(w, KEY("attention.sliding_window_pattern"), GGUF_BOOL, local, (uint64_t)c->n_layers);
        free(local);
        if (c->rope_base_local != c->rope_base) gguf_writer_set_f32(w, KEY("rope.freq_base_swa"), c->rope_base_local);
    } else if (c->sliding_window > 0 && c->swa_period != period)
        gguf_writer_set_u32(w, KEY("attention.sliding_window_pattern"), (uint32_t)c->swa_period);
    if (c->arch == KVLM_ARCH_GEMMA2) {
        gguf_writer_set_f32(w, KEY("attn_logit_softcapping"), c->attn_softcap);
        gguf_writer_set_f32(w, KEY("final_logit_softcapping"), c->final_softcap);
    }
#undef KEY
}

/* The type a 2-D weight of row length n_in gets when `want` is asked for:
 * block sizes must divide the row, so fall back as llama.cpp's quantizer does. */
static int fit_type(int want, int64_t n_in) {
    const dt_traits *tr = dt_info(want);
    if (tr && n_in % tr->block_size == 0) return want;
    if ((want == DT_Q4_K || want == DT_Q5_K || want == DT_Q6_K) && n_in % 32 == 0)
        return want == DT_Q4_K ? DT_Q4_0 : DT_Q8_0;
    /* the 1- to 4.25-bit super-block types fall back to IQ4_NL (llama.cpp's choice) */
    if ((want == DT_Q2_K || want == DT_Q3_K || want == DT_IQ4_XS || dt_is_iq(want)) && n_in % 32 == 0) return DT_IQ4_NL;
    if (dt_is_tq(want) && n_in % 32 == 0) return DT_Q4_0; /* the ternary types: llama.cpp's choice too */
    return DT_F16;
}

/* Converting rows on the pool's threads. */
typedef struct {
    const model_tensor *src;
    int dst_type;
    bool random_codes;
    char *out;
    atomic_int failed;
} convert_job;

/* A block of random codes (every index, sign and scale drawn) whose d makes
 * its RMS that of the n floats x it stands for. */
static void random_block(int type, uint64_t *s, const float *x, int n, uint8_t *blk, float *tmp) {
    const size_t bs = dt_layout(type)->type_size;
    for (size_t i = 0; i < bs; i++) {
        *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
        blk[i] = (uint8_t)(*s >> 32);
    }
    dt_iq_set_d(type, blk, 0x3c00); /* d = 1, then the d that gives x's RMS */
    dt_dequantize_row(type, blk, tmp, n);
    double a = 0, b = 0;
    for (int i = 0; i < n; i++) a += (double)x[i] * x[i], b += (double)tmp[i] * tmp[i];
    dt_iq_set_d(type, blk, dt_f32_to_f16(b > 0 ? (float)sqrt(a / b) : 0.0f));
}

static void convert_part(void *ctx, int ith, int nth) {
    convert_job *j = ctx;
    const model_tensor *src = j->src;
    size_t out_row = dt_row_size(j->dst_type, src->n_in), in_row = dt_row_size(src->type, src->n_in);
    float *tmp = malloc(sizeof(float) * (size_t)(src->n_in + QK_K));
    if (!tmp) { atomic_store(&j->failed, 1); return; }
    long lo, hi;
    util_split((long)src->n_out, ith, nth, &lo, &hi);
    for (long r = lo; r < hi; r++) {
        char *o = j->out + (size_t)r * out_row;
        dt_dequantize_row(src->type, (const char *)src->data + (size_t)r * in_row, tmp, src->n_in);
        if (j->random_codes) {
            const int bsz = dt_layout(j->dst_type)->block_size;
            uint64_t s = 0x9e3779b97f4a7c15ull ^ ((uint64_t)r * 0xbf58476d1ce4e5b9ull) ^ (uint64_t)src->n_in;
            for (int b = 0; b < src->n_in / bsz; b++)
                random_block(j->dst_type, &s, tmp + (size_t)b * bsz, bsz,
                             (uint8_t *)o + (size_t)b * dt_layout(j->dst_type)->type_size, tmp + src->n_in);
        } else
            dt_quantize_row(j->dst_type, tmp, o, src->n_in);
    }
    free(tmp);
}

/* Converts rows of `src` to type `dst_type` on the pool's threads (the
 * codebook types' quantizers take microseconds per weight); returns
 * malloc'd data or NULL. random_codes (synthetic models of the codebook
 * types): random codes at the rows' scale instead of quantizing them. */
static void *convert_rows(util_pool *pool, const model_tensor *src, int dst_type, bool random_codes) {
    convert_job j = {src, dst_type, random_codes, malloc(dt_row_size(dst_type, src->n_in) * (size_t)src->n_out), 0};
    if (!j.out) return NULL;
    util_pool_run(pool, convert_part, &j);
    if (atomic_load(&j.failed)) { free(j.out); return NULL; }
    return j.out;
}

/* Where a long write is, for a kvlm_progress_callback: fractions of one
 * part of the work (lo..hi of the whole). */
typedef struct {
    kvlm_progress_callback cb;
    void *user;
    float lo, hi;
} wprogress;

/* false: the callback said stop */
static bool wprogress_at(const wprogress *p, double frac) {
    return !p || !p->cb || p->cb(p->lo + (p->hi - p->lo) * (float)frac, p->user);
}

/* The type tensor i is written as. */
static int dst_type(const named_tensor *nt, int type) {
    const model_tensor *t = &nt->t;
    bool is_1d = t->n_out == 1; /* norms and biases stay f32 (gpt-oss's experts' biases are 2-D) */
    size_t nl = strlen(nt->name);
    bool keep = is_1d || type < 0 || (nl > 5 && !strcmp(nt->name + nl - 5, ".bias"));
    return keep ? t->type : fit_type(type, t->n_in);
}

/* Adds every tensor, converting 2-D weights to `type` (-1: keep). Converted
 * data is malloc'd into owned[i]; the writer reads it at write time. The
 * conversion is reported to prog by weights converted. */
static int write_tensors(gguf_writer *w, named_tensor *ts, int n, int type, bool random_codes, void **owned,
                         const wprogress *prog, kvlm_error *err) {
    double all = 0, done = 0;
    for (int i = 0; i < n; i++)
        if (dst_type(&ts[i], type) != ts[i].t.type) all += (double)ts[i].t.n_in * (double)ts[i].t.n_out;
    util_pool *pool = util_pool_create(0); /* NULL: converted on this thread */
    for (int i = 0; i < n; i++) {
        model_tensor *t = &ts[i].t;
        bool is_1d = t->n_out == 1;
        int dst = dst_type(&ts[i], type);
        const void *data = t->data;
        if (dst != t->type) {
            if (!wprogress_at(prog, all > 0 ? done / all : 0)) {
                util_pool_free(pool);
                return util_err_set(err, KVLM_ECANCELED, "converting canceled by the progress callback");
            }
            done += (double)t->n_in * (double)t->n_out;
            data = owned[i] = convert_rows(pool, t, dst, random_codes && dt_is_iq(dst));
            if (!data) {
                util_pool_free(pool);
                return util_err_set(err, KVLM_ENOMEM, "out of memory converting %s", ts[i].name);
            }
        }
        int64_t ne[3] = {t->n_in, t->n_out, 1};
        int n_dims = is_1d ? 1 : 2;
        if (ts[i].n_expert > 0) {
            ne[1] = t->n_out / ts[i].n_expert;
            ne[2] = ts[i].n_expert;
            n_dims = 3;
        }
        int rc = gguf_writer_add_tensor(w, ts[i].name, dst, n_dims, ne, data, err);
        if (rc) { util_pool_free(pool); return rc; }
    }
    util_pool_free(pool);
    return KVLM_OK;
}

/* random_codes: synth's codebook-type weights are random codes (convert_rows).
 * prog: its part of the work (NULL: no progress); of it, converting takes
 * 80% when any tensor changes type (quantizing is most of the time), writing
 * the rest. */
static int save_gguf(const struct kvlm_model *m, const char *path, int type, bool random_codes, const wprogress *prog,
                     kvlm_error *err) {
    if (type >= 0 && (!dt_info(type) || type == DT_Q8_K))
        return util_err_set(err, KVLM_EINVAL, "cannot convert to type id %d", type);
    /* No GGUF key holds the attention scale: a reader derives it (llama.cpp's
     * rule, model_swa_defaults), so a scale it would not derive (an HF
     * directory's query_pre_attn_scalar) cannot be written. */
    kvlm_config d = m->cfg;
    model_swa_defaults(&d);
    d.attn_scale *= model_yarn_mscale2(&d); /* YaRN's keys carry it */
    if (model_granite_like(d.arch)) d.attn_scale = m->cfg.attn_scale; /* granite's key does */
    if (m->hf && d.attn_scale != m->cfg.attn_scale)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: attention scale %g (query_pre_attn_scalar %g) has no GGUF "
                            "key, and a GGUF reader would use %g (1/sqrt of the head dimension, or hidden/heads for "
                            "the 46- and 62-layer gemmas)", m->path, m->cfg.attn_scale,
                            1.0 / ((double)m->cfg.attn_scale * m->cfg.attn_scale), d.attn_scale);
    int cap = 6 + 30 * m->cfg.n_layers;
    named_tensor *ts = calloc((size_t)cap, sizeof *ts);
    void **owned = calloc((size_t)cap, sizeof *owned);
    gguf_writer *w = gguf_writer_create();
    int rc;
    if (!ts || !owned || !w) {
        rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
        goto done;
    }
    const char *base = strrchr(m->path, '/');
    write_hparams(w, &m->cfg, base ? base + 1 : m->path,
                  m->cfg.arch == KVLM_ARCH_DEEPSEEK2 && m->cfg.n_layers > 0 && m->layers[0].wk_b.data);
    vocab_to_gguf(&m->vocab, w);
    if (m->type_embd.data) /* the converter's: token_types.weight's rows */
        gguf_writer_set_u32(w, "tokenizer.ggml.token_type_count", (uint32_t)m->type_embd.n_out);
    int n = list_tensors(m, ts, cap);
    wprogress conv = {0}, wr = {0};
    if (prog && n > 0) {
        bool converts = false;
        for (int i = 0; i < n && !converts; i++) converts = dst_type(&ts[i], type) != ts[i].t.type;
        float mid = converts ? prog->lo + 0.8f * (prog->hi - prog->lo) : prog->lo;
        conv = (wprogress){prog->cb, prog->user, prog->lo, mid};
        wr = (wprogress){prog->cb, prog->user, mid, prog->hi};
    }
    rc = n < 0 ? util_err_set(err, KVLM_ENOMEM, "out of memory")
               : write_tensors(w, ts, n, type, random_codes, owned, prog ? &conv : NULL, err);
    if (!rc) rc = gguf_writer_write_progress(w, path, wr.cb, wr.user, wr.lo, wr.hi, err);
done:
    if (owned)
        for (int i = 0; i < cap; i++) free(owned[i]);
    if (ts)
        for (int i = 0; i < cap; i++) free(ts[i].own);
    free(owned);
    gguf_writer_free(w);
    free(ts);
    return rc;
}

int model_save_gguf(const struct kvlm_model *m, const char *path, int type, kvlm_progress_callback cb, void *user,
                    kvlm_error *err) {
    wprogress p = {cb, user, 0, 1};
    if (!wprogress_at(&p, 0)) return util_err_set(err, KVLM_ECANCELED, "%s: canceled by the progress callback", path);
    int rc = save_gguf(m, path, type, false, cb ? &p : NULL, err);
    if (!rc && !wprogress_at(&p, 1)) { /* written: a late "no" leaves no file either */
        remove(path);
        rc = util_err_set(err, KVLM_ECANCELED, "%s: canceled by the progress callback", path);
    }
    return rc;
}

/* ---- synthetic models ---------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}
static float rng_uniform(uint64_t *s) { return (float)((rng_next(s) >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }

/* A SentencePiece-style vocabulary: <unk> <s> </s>, byte tokens when there
 * is room, then distinct letter pieces with and without a leading space. */
static int synth_vocab(model_vocab *v, int n) {
    memset(v, 0, sizeof *v);
    snprintf(v->model, sizeof v->model, "llama");
    snprintf(v->pre, sizeof v->pre, "default");
    v->n_tokens = n;
    v->tokens = calloc((size_t)n, sizeof *v->tokens);
    v->lens = calloc((size_t)n, sizeof *v->lens);
    v->scores = calloc((size_t)n, sizeof *v->scores);
    v->types = calloc((size_t)n, sizeof *v->types);
    if (!v->tokens || !v->lens || !v->scores || !v->types) return -1;
    v->unk = 0; v->bos = 1; v->eos = 2; v->pad = v->eot = v->sep = -1;
    v->fim_pre = v->fim_suf = v->fim_mid = -1;
    v->add_bos = true; v->add_space_prefix = true;
    int nbytes = n >= 3 + 256 + 16 ? 256 : 0;
    for (int i = 0; i < n; i++) {
        char buf[64];
        int type = VOCAB_T_NORMAL;
        if (i < 3) {
            snprintf(buf, sizeof buf, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
            type = i == 0 ? VOCAB_T_UNKNOWN : VOCAB_T_CONTROL;
        } else if (i < 3 + nbytes) {
            snprintf(buf, sizeof buf, "<0x%02X>", i - 3);
            type = VOCAB_T_BYTE;
        } else {
            int k = i - 3 - nbytes, pos = 0;
            if (k & 1) pos += snprintf(buf, sizeof buf, "\xe2\x96\x81");
            for (int x = k / 2 + 1; x > 0 && pos < 60; x = (x - 1) / 26) buf[pos++] = (char)('a' + (x - 1) % 26);
            buf[pos] = 0;
        }
        v->tokens[i] = strdup(buf);
        if (!v->tokens[i]) return -1;
        v->lens[i] = (uint32_t)strlen(buf);
        v->types[i] = type;
        v->scores[i] = type == VOCAB_T_NORMAL ? -(float)i : 0.0f;
    }
    return 0;
}

/* A WordPiece vocabulary as llama.cpp's converter writes BERT's: [PAD] 0,
 * [unusedK] 1..99, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103, then each
 * letter and digit as a word's start ("\u2581a") and as a continuation ("a",
 * BERT's "##a"), punctuation and two CJK characters as words, then letter
 * pieces of two and more letters in both forms, until n (at least 128). */
static int synth_wpm_vocab(model_vocab *v, int n) {
    memset(v, 0, sizeof *v);
    snprintf(v->model, sizeof v->model, "bert");
    snprintf(v->pre, sizeof v->pre, "default");
    v->n_tokens = n;
    v->tokens = calloc((size_t)n, sizeof *v->tokens);
    v->lens = calloc((size_t)n, sizeof *v->lens);
    v->scores = calloc((size_t)n, sizeof *v->scores);
    v->types = calloc((size_t)n, sizeof *v->types);
    if (!v->tokens || !v->lens || !v->scores || !v->types) return -1;
    v->pad = 0; v->unk = 100; v->bos = 101; v->sep = 102; v->eos = v->eot = -1;
    v->add_bos = true;
    v->wpm_lower = v->wpm_strip_accents = true;
    static const char *const singles = "abcdefghijklmnopqrstuvwxyz0123456789";
    static const char *const puncts[] = {".", ",", "!", "?", ";", ":", "'", "\"", "(", ")", "-", "$", "/",
                                         "\xe4\xb8\xad", "\xe6\x96\x87"}; /* the last two: CJK */
    int n_single = (int)strlen(singles), n_punct = (int)(sizeof puncts / sizeof puncts[0]);
    for (int i = 0; i < n; i++) {
        char buf[64];
        int type = VOCAB_T_NORMAL, k = i - 104;
        if (i == 0) snprintf(buf, sizeof buf, "[PAD]");
        else if (i < 100) snprintf(buf, sizeof buf, "[unused%d]", i - 1);
        else if (i < 104) snprintf(buf, sizeof buf, "%s", i == 100 ? "[UNK]" : i == 101 ? "[CLS]" : i == 102 ? "[SEP]" : "[MASK]");
        else if (k < 2 * n_single)
            snprintf(buf, sizeof buf, "%s%c", k & 1 ? "" : "\xe2\x96\x81", singles[k / 2]);
        else if (k < 2 * n_single + n_punct)
            snprintf(buf, sizeof buf, "\xe2\x96\x81%s", puncts[k - 2 * n_single]);
        else {
            int x = (k - 2 * n_single - n_punct) / 2 + 27, pos = 0; /* 27: "aa" first */
            if (!((k - 2 * n_single - n_punct) & 1)) pos = snprintf(buf, sizeof buf, "\xe2\x96\x81");
            for (; x > 0 && pos < 60; x = (x - 1) / 26) buf[pos++] = (char)('a' + (x - 1) % 26);
            buf[pos] = 0;
        }
        if (i == 0 || (i >= 100 && i < 104)) type = VOCAB_T_CONTROL;
        v->tokens[i] = strdup(buf);
        if (!v->tokens[i]) return -1;
        v->lens[i] = (uint32_t)strlen(buf);
        v->types[i] = type;
    }
    return 0;
}

int model_synth_write(const kvlm_synth_params *p, const char *path, kvlm_error *err) {
    kvlm_config c = {0};
    c.arch = p->arch;
    c.dim = p->dim;
    c.hidden_dim = p->hidden_dim;
    c.n_layers = p->n_layers;
    c.n_heads = p->n_heads;
    c.n_kv_heads = p->n_kv_heads > 0 ? p->n_kv_heads : p->n_heads;
    c.head_dim = p->head_dim > 0 ? p->head_dim : (p->n_heads > 0 ? p->dim / p->n_heads : 0);
    c.vocab_size = p->vocab_size;
    c.n_ctx_train = p->n_ctx > 0 ? p->n_ctx : 2048;
    c.rope_dim = c.head_dim;
    c.rope_base = p->rope_base > 0 ? p->rope_base : 10000.0f;
    c.no_rope_period = c.arch == KVLM_ARCH_SMOLLM3 ? 4 : 0;
    if (model_granite_like(c.arch)) /* Granite 3's kind: q.k by 1/head_dim, not its square root */
        c.embed_mult = 12.0f, c.residual_mult = 0.22f, c.logit_div = 8.0f,
        c.attn_scale = c.head_dim > 0 ? 1.0f / (float)c.head_dim : 1.0f;
    c.norm_eps = 1e-5f;
    c.pooling = p->pooling_plus1 > 0 ? p->pooling_plus1 - 1 : -1;
    bool enc = c.arch == KVLM_ARCH_BERT || c.arch == KVLM_ARCH_NOMIC_BERT;
    if (enc) { /* BERT's LayerNorm epsilon; mean pooling unless asked otherwise (nomic-embed-text's) */
        c.encoder = true;
        c.norm_eps = 1e-12f;
        if (c.pooling < 0) c.pooling = KVLM_POOLING_MEAN;
        c.rope_neox = true;
        if (c.n_kv_heads != c.n_heads || c.head_dim * c.n_heads != c.dim || c.vocab_size < 128 ||
            p->n_expert > 0 || p->sliding_window > 0 || p->tied_output)
            return util_err_set(err, KVLM_EINVAL, "%s: heads of dim / heads each (no other head dimension, no "
                                "KV heads of their own), a vocabulary of at least 128, no experts, window or tied "
                                "output", model_arch_name(c.arch));
    }
    if (c.pooling > KVLM_POOLING_RANK) return util_err_set(err, KVLM_EINVAL, "unknown pooling %d", c.pooling);
    bool gemma = c.arch == KVLM_ARCH_GEMMA2 || c.arch == KVLM_ARCH_GEMMA3;
    c.sliding_window = p->sliding_window > 0 ? p->sliding_window : gemma ? 16 : 0;
    if (c.arch == KVLM_ARCH_GPTOSS && !p->sliding_window) c.sliding_window = 16;
    c.swa_period = c.arch == KVLM_ARCH_GEMMA2 || c.arch == KVLM_ARCH_GPTOSS ? 2 : c.arch == KVLM_ARCH_GEMMA3 ? 6
                   : c.arch == KVLM_ARCH_OLMO2 ? 4 : 0;
    c.rope_base_local = c.rope_base;
    if (c.arch == KVLM_ARCH_GEMMA2) {
        c.attn_softcap = p->attn_softcap > 0 ? p->attn_softcap : p->attn_softcap < 0 ? 0 : 50.0f;
        c.final_softcap = p->final_softcap > 0 ? p->final_softcap : p->final_softcap < 0 ? 0 : 30.0f;
    }
    if (p->rope_dim > 0 && c.arch != KVLM_ARCH_DEEPSEEK2) { /* a partial rotation (Phi-4-mini: 3/4 of a head) */
        if (c.arch != KVLM_ARCH_PHI3 || (p->rope_dim & 1) || p->rope_dim > c.head_dim)
            return util_err_set(err, KVLM_EINVAL, "--rope-dim %d: a partial rotation is for phi3 and deepseek2, even "
                                "and at most the head dimension (%d)", p->rope_dim, c.head_dim);
        c.rope_dim = p->rope_dim;
    }
    bool gm = c.arch == KVLM_ARCH_GRANITEMOE;
    if (c.arch == KVLM_ARCH_QWEN3MOE || c.arch == KVLM_ARCH_QWEN2MOE || gm || c.arch == KVLM_ARCH_GPTOSS ||
        (c.arch == KVLM_ARCH_LLAMA && p->n_expert > 0)) {
        /* experts in every layer (model.c moe_hparams): Mixtral's and granitemoe's are the FFN's width,
         * qwen3moe's their own */
        c.n_expert = p->n_expert > 0 ? p->n_expert : 4;
        c.n_expert_used = p->n_expert_used > 0 ? p->n_expert_used : 2;
        c.expert_ff = c.arch == KVLM_ARCH_LLAMA || gm ? c.hidden_dim
                      : p->expert_ff > 0 ? p->expert_ff : (c.hidden_dim / 2 > 0 ? c.hidden_dim / 2 : 1);
        model_moe_topk_routing(&c);
        if (c.arch == KVLM_ARCH_QWEN2MOE) c.expert_shared_ff = c.hidden_dim; /* a shared expert as wide as the FFN */
        if (gm && p->n_expert_shared > 0) /* Granite MoE Shared: S experts' width, added ungated */
            c.expert_shared_ff = c.hidden_dim * p->n_expert_shared;
        if (c.n_expert_used > c.n_expert || c.n_expert > 1024)
            return util_err_set(err, KVLM_EINVAL, "bad experts: %d of %d", c.n_expert_used, c.n_expert);
    }
    if (p->sliding_window < 0 || (p->sliding_window > 0 && c.arch != KVLM_ARCH_LLAMA && c.arch != KVLM_ARCH_OLMO2 &&
                                  c.arch != KVLM_ARCH_GPTOSS && !gemma))
        return util_err_set(err, KVLM_EINVAL, "a sliding window is for llama (every layer local), gemma2, gemma3, "
                            "gpt-oss and olmo2 (OLMo 3: three local layers to one global)");
    if (c.dim <= 0 || c.hidden_dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.head_dim <= 0 ||
        (c.head_dim & 1) || c.n_heads % c.n_kv_heads || c.vocab_size < 3)
        return util_err_set(err, KVLM_EINVAL,
                            "bad synthetic shape: dim %d, hidden %d, layers %d, heads %d, kv heads %d, head dim %d, vocab %d",
                            c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size);
    const dt_traits *tr = dt_info(p->type);
    if (!tr || p->type == DT_Q8_K) return util_err_set(err, KVLM_EINVAL, "bad weight type id %d", p->type);
    if (c.arch == KVLM_ARCH_DEEPSEEK2) {
        /* defaults: a small model of DeepSeek-V2's layout (docs/mla.md);
         * -1 asks for 0 where 0 means "default" */
        c.n_kv_heads = 1;
        c.rope_dim = p->rope_dim > 0 ? p->rope_dim : 16;
        c.q_lora_rank = p->q_lora_rank > 0 ? p->q_lora_rank : 0;
        c.kv_lora_rank = p->kv_lora_rank > 0 ? p->kv_lora_rank : 32;
        c.v_head_dim = p->v_head_dim > 0 ? p->v_head_dim : c.head_dim - c.rope_dim;
        c.n_expert = p->n_expert > 0 ? p->n_expert : p->n_expert < 0 ? 0 : 4;
        c.n_expert_used = p->n_expert_used > 0 ? p->n_expert_used : 2;
        c.n_expert_shared = p->n_expert_shared > 0 ? p->n_expert_shared : p->n_expert_shared < 0 ? 0 : 1;
        c.n_dense_lead = p->n_dense_lead > 0 ? p->n_dense_lead : p->n_dense_lead < 0 ? 0 : 1;
        if (c.n_expert == 0 || c.n_dense_lead > c.n_layers) c.n_dense_lead = c.n_layers;
        c.expert_ff = p->expert_ff > 0 ? p->expert_ff : (c.hidden_dim / 2 > 0 ? c.hidden_dim / 2 : 1);
        c.expert_gating = p->expert_gating == 2 ? 2 : 1;
        c.expert_weights_scale = c.expert_gating == 2 ? 2.5f : 1.0f;
        c.expert_weights_norm = c.expert_gating == 2;
        if (p->yarn_factor > 1) { /* DeepSeek-V2's multiplier; the context stretched by the factor */
            c.yarn_factor = p->yarn_factor;
            c.yarn_orig_ctx = (int)(c.n_ctx_train / p->yarn_factor) > 0 ? (int)(c.n_ctx_train / p->yarn_factor) : 1;
            c.yarn_log_mul = 0.0707f;
            c.yarn_beta_fast = 32, c.yarn_beta_slow = 1;
        }
        if (c.rope_dim & 1 || c.rope_dim >= c.head_dim || c.v_head_dim <= 0 || (c.kv_lora_rank & 1) ||
            (c.n_expert && (c.n_expert_used > c.n_expert || c.n_expert > 1024)))
            return util_err_set(err, KVLM_EINVAL,
                                "bad deepseek2 shape: key length %d, rope dim %d, value length %d, kv_lora_rank %d, "
                                "%d of %d experts", c.head_dim, c.rope_dim, c.v_head_dim, c.kv_lora_rank,
                                c.n_expert_used, c.n_expert);
    }

    struct kvlm_model m;
    memset(&m, 0, sizeof m);
    m.cfg = c;
    snprintf(m.path, sizeof m.path, "synthetic-%s-d%d-l%d", model_arch_name(c.arch), c.dim, c.n_layers);
    int rc = KVLM_OK;
    /* progress: the random weights 0..0.3, converting and writing them the rest */
    const wprogress prog_all = {p->progress_callback, p->progress_callback_user_data, 0, 1},
                    gen = {p->progress_callback, p->progress_callback_user_data, 0, 0.3f},
                    prog = {p->progress_callback, p->progress_callback_user_data, 0.3f, 1};
    if (!wprogress_at(&prog_all, 0)) return util_err_set(err, KVLM_ECANCELED, "%s: canceled by the progress callback", path);
    if ((enc ? synth_wpm_vocab(&m.vocab, c.vocab_size) : synth_vocab(&m.vocab, c.vocab_size))) {
        vocab_free(&m.vocab);
        return util_err_set(err, KVLM_ENOMEM, "out of memory");
    }
    m.layers = calloc((size_t)c.n_layers, sizeof *m.layers);
    int64_t q_dim = (int64_t)c.n_heads * c.head_dim, kv_dim = (int64_t)c.n_kv_heads * c.head_dim;
    /* Every tensor gets f32 random data here; model_save_gguf quantizes. */
    int max_tensors = 6 + 30 * c.n_layers, n_alloc = 0;
    float **bufs = calloc((size_t)max_tensors, sizeof *bufs);
    uint64_t s = p->seed * 2654435761u + 0x9e3779b97f4a7c15ull;
    if (!m.layers || !bufs) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
#define MAKE(t, nin, nout, kind)                                                                 \
    do {                                                                                         \
        size_t cnt = (size_t)(nin) * (size_t)(nout);                                             \
        float *b = malloc(cnt * sizeof(float));                                                  \
        if (!b) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }             \
        bufs[n_alloc++] = b;                                                                     \
        float a = (kind) == 0 ? 1.0f / sqrtf((float)(nin)) : 0.2f;                               \
        for (size_t i = 0; i < cnt; i++)                                                         \
            b[i] = (kind) == 1 ? 1.0f + 0.1f * rng_uniform(&s) : a * 1.7f * rng_uniform(&s);     \
        (t).data = b; (t).type = DT_F32; (t).n_in = (nin); (t).n_out = (nout);                   \
    } while (0)
    MAKE(m.tok_embd, c.dim, c.vocab_size, 2);
    if (enc) { /* no output norm or classifier: type and (bert) position embeddings, their LayerNorm */
        MAKE(m.type_embd, c.dim, 2, 2);
        if (c.arch == KVLM_ARCH_BERT) MAKE(m.pos_embd, c.dim, c.n_ctx_train, 2);
        MAKE(m.embd_norm, c.dim, 1, 1);
        MAKE(m.embd_norm_b, c.dim, 1, 2);
    } else {
        MAKE(m.output_norm, c.dim, 1, 1);
        if (p->tied_output) m.output = m.tok_embd;
        else MAKE(m.output, c.dim, c.vocab_size, 0);
    }
    for (int l = 0; l < c.n_layers && enc; l++) {
        model_layer *L = &m.layers[l];
        if (c.arch == KVLM_ARCH_NOMIC_BERT) { /* one buffer, as the file stores it */
            model_tensor fused = {0};
            MAKE(fused, c.dim, 3 * (int64_t)c.dim, 0);
            L->wq = model_tensor_rows(&fused, 0, c.dim);
            L->wk = model_tensor_rows(&fused, c.dim, c.dim);
            L->wv = model_tensor_rows(&fused, 2 * (int64_t)c.dim, c.dim);
        } else {
            MAKE(L->wq, c.dim, c.dim, 0);
            MAKE(L->wk, c.dim, c.dim, 0);
            MAKE(L->wv, c.dim, c.dim, 0);
            MAKE(L->bq, c.dim, 1, 2);
            MAKE(L->bk, c.dim, 1, 2);
            MAKE(L->bv, c.dim, 1, 2);
            MAKE(L->bo, c.dim, 1, 2);
        }
        MAKE(L->wo, c.dim, c.dim, 0);
        MAKE(L->attn_out_norm, c.dim, 1, 1);
        MAKE(L->attn_out_norm_b, c.dim, 1, 2);
        if (c.arch == KVLM_ARCH_NOMIC_BERT) MAKE(L->w_gate, c.dim, c.hidden_dim, 0);
        else {
            MAKE(L->b_up, c.hidden_dim, 1, 2);
            MAKE(L->b_down, c.dim, 1, 2);
        }
        MAKE(L->w_up, c.dim, c.hidden_dim, 0);
        MAKE(L->w_down, c.hidden_dim, c.dim, 0);
        MAKE(L->out_norm, c.dim, 1, 1);
        MAKE(L->out_norm_b, c.dim, 1, 2);
    }
    if (p->yarn_factor > 1 && c.arch != KVLM_ARCH_DEEPSEEK2) { /* Qwen2.5's kind: the context stretched by the factor */
        if (!model_yarn_arch(c.arch)) {
            rc = util_err_set(err, KVLM_EINVAL, "YaRN is for llama, smollm3, qwen2, qwen3, olmo2 and deepseek2");
            goto done;
        }
        m.cfg.yarn_factor = p->yarn_factor;
        m.cfg.yarn_orig_ctx = (int)(c.n_ctx_train / p->yarn_factor) > 0 ? (int)(c.n_ctx_train / p->yarn_factor) : 1;
        m.cfg.yarn_beta_fast = 32, m.cfg.yarn_beta_slow = 1;
    }
    if (p->rope_linear > 0) {
        if (c.arch == KVLM_ARCH_DEEPSEEK2) {
            rc = util_err_set(err, KVLM_EINVAL, "linear RoPE scaling is not for deepseek2 (--yarn is)");
            goto done;
        }
        m.cfg.rope_linear = p->rope_linear != 1 ? p->rope_linear : 0;
    }
    if (p->longrope > 1) {
        if (c.arch != KVLM_ARCH_PHI3) {
            rc = util_err_set(err, KVLM_EINVAL, "LongRoPE is for phi3");
            goto done;
        }
        /* no random draws (the weights are those of the same model without
         * it): long factors rising from 1 to the factor, short ones from 1 to
         * 1.5, each with a ripple so that no two pairs share a factor */
        int n = c.rope_dim / 2;
        float *f = malloc(sizeof(float) * (size_t)(2 * n));
        if (!f) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
        bufs[n_alloc++] = f;
        for (int i = 0; i < n; i++) {
            double x = n > 1 ? (double)i / (n - 1) : 0, ripple = 1 + 0.05 * sin(3.0 * i);
            f[i] = (float)((1 + (p->longrope - 1) * x * x) * ripple);
            f[n + i] = (float)((1 + 0.5 * x) * ripple);
        }
        m.rope_long = (model_tensor){.data = f, .type = DT_F32, .n_in = n, .n_out = 1};
        m.rope_short = (model_tensor){.data = f + n, .type = DT_F32, .n_in = n, .n_out = 1};
        m.cfg.rope_freqs = f;
        m.cfg.rope_freqs_short = f + n;
        m.cfg.longrope_orig_ctx = (int)(c.n_ctx_train / p->longrope) > 0 ? (int)(c.n_ctx_train / p->longrope) : 1;
        m.cfg.longrope_attn_factor = (float)model_longrope_attn_factor(p->longrope, m.cfg.longrope_orig_ctx);
    }
    if (p->rope_llama3 > 1) {
        if (c.arch == KVLM_ARCH_DEEPSEEK2) {
            rc = util_err_set(err, KVLM_EINVAL, "Llama 3.1's RoPE scaling is not for deepseek2 (--yarn is)");
            goto done;
        }
        /* no random draws: the weights are those of the same model without it */
        float *f = malloc(sizeof(float) * (size_t)(c.rope_dim / 2));
        if (!f) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
        bufs[n_alloc++] = f;
        model_llama3_rope_freqs(f, c.rope_dim, c.rope_base, p->rope_llama3, 1, 4, c.n_ctx_train / p->rope_llama3);
        m.rope_freqs = (model_tensor){.data = f, .type = DT_F32, .n_in = c.rope_dim / 2, .n_out = 1};
    }
    for (int l = 0; l < c.n_layers && c.arch == KVLM_ARCH_DEEPSEEK2; l++) {
        if (!wprogress_at(&gen, (double)l / c.n_layers)) {
            rc = util_err_set(err, KVLM_ECANCELED, "%s: canceled by the progress callback", path);
            goto done;
        }
        model_layer *L = &m.layers[l];
        int64_t nope = c.head_dim - c.rope_dim, H = c.n_heads;
        MAKE(L->attn_norm, c.dim, 1, 1);
        if (c.q_lora_rank) {
            MAKE(L->wq_a, c.dim, c.q_lora_rank, 0);
            MAKE(L->q_a_norm, c.q_lora_rank, 1, 1);
            MAKE(L->wq_b, c.q_lora_rank, q_dim, 0);
        } else MAKE(L->wq, c.dim, q_dim, 0);
        MAKE(L->wkv_a, c.dim, c.kv_lora_rank + c.rope_dim, 0);
        MAKE(L->kv_a_norm, c.kv_lora_rank, 1, 1);
        MAKE(L->wkv_b, c.kv_lora_rank, H * (nope + c.v_head_dim), 0);
        MAKE(L->wo, H * c.v_head_dim, c.dim, 0);
        MAKE(L->ffn_norm, c.dim, 1, 1);
        if (l < c.n_dense_lead) {
            MAKE(L->w_gate, c.dim, c.hidden_dim, 0);
            MAKE(L->w_down, c.hidden_dim, c.dim, 0);
            MAKE(L->w_up, c.dim, c.hidden_dim, 0);
            continue;
        }
        MAKE(L->ffn_gate_inp, c.dim, c.n_expert, 0);
        if (c.expert_gating == 2) MAKE(L->exp_probs_b, c.n_expert, 1, 2);
        MAKE(L->gate_exps, c.dim, (int64_t)c.expert_ff * c.n_expert, 0);
        MAKE(L->up_exps, c.dim, (int64_t)c.expert_ff * c.n_expert, 0);
        MAKE(L->down_exps, c.expert_ff, (int64_t)c.dim * c.n_expert, 0);
        if (c.n_expert_shared) {
            int64_t sf = (int64_t)c.expert_ff * c.n_expert_shared;
            MAKE(L->gate_shexp, c.dim, sf, 0);
            MAKE(L->up_shexp, c.dim, sf, 0);
            MAKE(L->down_shexp, sf, c.dim, 0);
        }
    }
    const bool olmo2 = c.arch == KVLM_ARCH_OLMO2;
    for (int l = 0; l < c.n_layers && c.arch != KVLM_ARCH_DEEPSEEK2 && !enc; l++) {
        if (!wprogress_at(&gen, (double)l / c.n_layers)) {
            rc = util_err_set(err, KVLM_ECANCELED, "%s: canceled by the progress callback", path);
            goto done;
        }
        model_layer *L = &m.layers[l];
        if (!olmo2) MAKE(L->attn_norm, c.dim, 1, 1); /* olmo2: no norm before attention or FFN */
        if (c.arch == KVLM_ARCH_PHI3) {
            /* one buffer, as the file stores it (written back fused) */
            model_tensor fused = {0};
            MAKE(fused, c.dim, q_dim + 2 * kv_dim, 0);
            L->wq = model_tensor_rows(&fused, 0, q_dim);
            L->wk = model_tensor_rows(&fused, q_dim, kv_dim);
            L->wv = model_tensor_rows(&fused, q_dim + kv_dim, kv_dim);
        } else {
            MAKE(L->wq, c.dim, q_dim, 0);
            MAKE(L->wk, c.dim, kv_dim, 0);
            MAKE(L->wv, c.dim, kv_dim, 0);
        }
        MAKE(L->wo, q_dim, c.dim, 0);
        if (c.arch == KVLM_ARCH_QWEN2 || c.arch == KVLM_ARCH_QWEN2MOE || c.arch == KVLM_ARCH_GPTOSS) {
            MAKE(L->bq, q_dim, 1, 2);
            MAKE(L->bk, kv_dim, 1, 2);
            MAKE(L->bv, kv_dim, 1, 2);
        }
        if (c.arch == KVLM_ARCH_GPTOSS) { /* the output's bias; sinks spread over a few units of a score */
            MAKE(L->bo, c.dim, 1, 2);
            MAKE(L->attn_sinks, c.n_heads, 1, 2);
            for (int h = 0; h < c.n_heads; h++) ((float *)L->attn_sinks.data)[h] *= 8.0f;
        }
        if (!olmo2) MAKE(L->ffn_norm, c.dim, 1, 1);
        if (c.arch == KVLM_ARCH_PHI3) {
            model_tensor fused = {0};
            MAKE(fused, c.dim, 2 * c.hidden_dim, 0);
            L->w_gate = model_tensor_rows(&fused, 0, c.hidden_dim);
            L->w_up = model_tensor_rows(&fused, c.hidden_dim, c.hidden_dim);
            MAKE(L->w_down, c.hidden_dim, c.dim, 0);
        } else if (c.n_expert > 0) {
            MAKE(L->ffn_gate_inp, c.dim, c.n_expert, 0);
            MAKE(L->gate_exps, c.dim, (int64_t)c.expert_ff * c.n_expert, 0);
            MAKE(L->up_exps, c.dim, (int64_t)c.expert_ff * c.n_expert, 0);
            MAKE(L->down_exps, c.expert_ff, (int64_t)c.dim * c.n_expert, 0);
            if (c.arch == KVLM_ARCH_GPTOSS) {
                MAKE(L->ffn_gate_inp_b, c.n_expert, 1, 2);
                MAKE(L->gate_exps_b, c.expert_ff, c.n_expert, 2);
                MAKE(L->up_exps_b, c.expert_ff, c.n_expert, 2);
                /* biases of up to about 10: the clamps at 7 (op_swiglu_oai) take some of each */
                for (int64_t i = 0; i < (int64_t)c.expert_ff * c.n_expert; i++)
                    ((float *)L->gate_exps_b.data)[i] *= 30.0f, ((float *)L->up_exps_b.data)[i] *= 30.0f;
                MAKE(L->down_exps_b, c.dim, c.n_expert, 2);
            }
            if (c.expert_shared_ff > 0) {
                if (c.arch == KVLM_ARCH_QWEN2MOE) MAKE(L->ffn_gate_inp_shexp, c.dim, 1, 0);
                MAKE(L->gate_shexp, c.dim, c.expert_shared_ff, 0);
                MAKE(L->up_shexp, c.dim, c.expert_shared_ff, 0);
                MAKE(L->down_shexp, c.expert_shared_ff, c.dim, 0);
            }
        } else { /* this order keeps the random stream of earlier versions */
            MAKE(L->w_gate, c.dim, c.hidden_dim, 0);
            MAKE(L->w_down, c.hidden_dim, c.dim, 0);
            MAKE(L->w_up, c.dim, c.hidden_dim, 0);
        }
        if (gemma || olmo2) {
            MAKE(L->post_attn_norm, c.dim, 1, 1);
            MAKE(L->post_ffn_norm, c.dim, 1, 1);
        }
        if (olmo2) { /* across all heads */
            MAKE(L->q_norm, q_dim, 1, 1);
            MAKE(L->k_norm, kv_dim, 1, 1);
        }
        if (c.arch == KVLM_ARCH_GEMMA3 || model_qwen3_like(c.arch)) {
            MAKE(L->q_norm, c.head_dim, 1, 1);
            MAKE(L->k_norm, c.head_dim, 1, 1);
        }
    }
#undef MAKE
    if (p->chat_template && !(m.vocab.chat_template = strdup(p->chat_template))) {
        rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
        goto done;
    }
    /* the codebook types get random codes: quantizing a billion random
     * weights to them would take hours, and the codes cost what real ones do */
    rc = save_gguf(&m, path, p->type, true, &prog, err);
    if (!rc && !wprogress_at(&prog_all, 1)) {
        remove(path);
        rc = util_err_set(err, KVLM_ECANCELED, "%s: canceled by the progress callback", path);
    }
done:
    for (int i = 0; i < n_alloc; i++) free(bufs[i]);
    free(bufs);
    free(m.layers);
    vocab_free(&m.vocab);
    return rc;
}
