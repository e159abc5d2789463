/* model/model: one kvlm_model (config, tensor views over the mapped file,
 * vocabulary) from a GGUF file or a llama2.c checkpoint. No compute here. */
#ifndef KVLM_MODEL_MODEL_H
#define KVLM_MODEL_MODEL_H
#include <stddef.h>
#include <stdint.h>
#include "kvlm.h"
#include "model/gguf.h"
#include "model/vocab.h"

/* A 2-D (or 1-D) weight: rows of n_in elements in `type`, n_out rows. */
typedef struct {
    const void *data;   /* NULL if absent (optional tensors) */
    int type;
    int64_t n_in, n_out;
    const char *name;
    /* The engine's copy in the CPU's packed layout (ops.h op_pack), or NULL;
     * matmul reads it instead of data. */
    const void *packed;
    int packed_type;
} model_tensor;

typedef struct {
    model_tensor attn_norm, wq, wk, wv, wo, bq, bk, bv;
    model_tensor ffn_norm, w_gate, w_down, w_up;
    /* deepseek2 (docs/mla.md): wq is attn_q when q_lora_rank is 0, else
     * wq_a, q_a_norm, wq_b; wkv_a gives the latent and the shared RoPE key
     * part, wkv_b the per-head no-RoPE keys and values (rows per head: nope
     * key rows, then value rows). MoE layers (past n_dense_lead): the
     * router, the experts stacked (expert e's rows [e x rows, (e+1) x rows):
     * model_tensor_rows), the shared experts, V3's selection bias. */
    model_tensor wq_a, q_a_norm, wq_b, wkv_a, kv_a_norm, wkv_b;
    model_tensor ffn_gate_inp, gate_exps, up_exps, down_exps, gate_shexp, up_shexp, down_shexp, exp_probs_b;
    model_tensor ffn_gate_inp_shexp; /* qwen2moe: dim weights; sigmoid(x . w) scales the shared expert */
    /* gpt-oss: the attention output's bias (dim), the sinks (one logit per
     * query head), the router's bias (n_expert) and the experts' biases
     * ([n_expert][expert_ff] for gate and up, [n_expert][dim] for down; f32) */
    model_tensor bo, attn_sinks, ffn_gate_inp_b, gate_exps_b, up_exps_b, down_exps_b;
    /* deepseek2 files of llama.cpp's MLA conversion: attn_kv_b split per
     * head into W_UK^T (kv_lora rows of nope) and W_UV (v rows of kv_lora),
     * stacked over the heads; used when wkv_b is absent */
    model_tensor wk_b, wv_b;
    /* gemma2/3: norms of the attention and FFN outputs (before the residual
     * add); gemma3: per-head norms of q and k (before RoPE). Absent: NULL data. */
    model_tensor post_attn_norm, post_ffn_norm, q_norm, k_norm;
    /* bert, nomic-bert (model_bert.c): the LayerNorms after attention
     * (attn_output_norm) and after the FFN (layer_output_norm), weights and
     * biases; bert's FFN biases (up: hidden_dim, down: dim) */
    model_tensor attn_out_norm, attn_out_norm_b, out_norm, out_norm_b, b_up, b_down;
    int window;         /* sliding window of this layer's attention, 0: global */
    float rope_base;    /* this layer's RoPE base */
} model_layer;

struct tok_tokenizer;

struct kvlm_model {
    kvlm_config cfg;
    model_tensor tok_embd, output_norm, output;
    /* bert, nomic-bert: token type embeddings (row 0 is added), bert's
     * absolute position embeddings (n_ctx_train rows), the LayerNorm of the
     * embeddings (weight, bias) */
    model_tensor type_embd, pos_embd, embd_norm, embd_norm_b;
    model_tensor rope_freqs;      /* Llama 3.1's RoPE factors (rope_dim/2, f32), or none; cfg.rope_freqs points at them */
    float *rope_freqs_own;        /* their storage when computed (a Hugging Face config), else NULL */
    float *rope_freqs_eff;        /* with cfg.rope_linear: those (or 1) times it, what cfg.rope_freqs points at */
    model_tensor rope_long, rope_short; /* LongRoPE's factors (phi3, rope_dim/2 f32 each), or none */
    float *longrope_own;          /* their storage when computed (a Hugging Face config: long, then short), else NULL */
    model_layer *layers;
    model_vocab vocab;
    struct tok_tokenizer *tok;   /* built by the engine layer from vocab */
    struct gm_vocab *grammar_vocab; /* engine/grammar's token bytes, sorted, built on first use (NULL: not yet) */
    char arch_name[32];
    char path[1024];
    /* Backing storage: a GGUF map, or a llama2.c checkpoint map. */
    gguf_file *gguf;
    void *map;
    size_t map_size;
    int map_flags;      /* util_map_file's: UTIL_MAP_READ (--no-mmap), UTIL_MAP_LOCK (--mlock) */
    size_t weight_bytes;
    void *packed_buf;   /* owned by the engine: every matmul tensor's copy, packed or its rows as they are */
    size_t packed_bytes;
    struct model_hf *hf; /* a Hugging Face directory's files (model/hf.h), or NULL */
};

/* A view of rows [row0, row0 + n) of a 2-D weight: a pointer offset, since
 * rows are stored whole (a quantized row is whole blocks). The fused phi3
 * tensors become separate Q, K, V and gate, up views this way, so the
 * forward pass and the per-matrix kernels see ordinary weights. */
model_tensor model_tensor_rows(const model_tensor *t, int64_t row0, int64_t n);

/* Llama 3.1's RoPE scaling (Hugging Face's rope_type "llama3", llama.cpp's
 * rope_freqs.weight): out[i], i < rope_dim/2, divides pair i's angle: 1 for
 * wavelengths under orig_ctx / high, factor over orig_ctx / low, and a smooth
 * blend between. */
void model_llama3_rope_freqs(float *out, int rope_dim, double base, double factor, double low, double high,
                             double orig_ctx);
/* YaRN's per-pair factors (llama.cpp's ramp between the pair indices where
 * beta_fast and beta_slow rotations fit the original context): 1 below it
 * (extrapolated), factor above (interpolated), blended between. */
void model_yarn_rope_freqs(float *out, int rope_dim, double base, double factor, int orig_ctx, double beta_fast,
                           double beta_slow);
/* YaRN's rotation magnitude (1 + 0.1 ln factor), squared: what it makes of
 * q.k, and what llama's and qwen2's attention scale takes (1: no YaRN, or
 * deepseek2's, which scales by its own rule). */
float model_yarn_mscale2(const kvlm_config *c);
/* Whether an architecture takes YaRN as per-pair factors (llama, qwen2, qwen3;
 * deepseek2 has its own). */
bool model_yarn_arch(int arch);
/* Mixtral's, qwen3moe's and qwen2moe's routing (c->arch set): a softmax over
 * every expert, the top n_expert_used renormalised (qwen2moe: not), no
 * shared experts counted, experts in every layer. */
void model_moe_topk_routing(kvlm_config *c);
/* qwen3 and qwen3moe: per-head q/k norms, NeoX RoPE, no biases. */
bool model_qwen3_like(int arch);
/* Whether layer l turns q and k by RoPE (smollm3: not every fourth layer). */
bool model_layer_rope(const kvlm_config *c, int l);
/* Architectures whose GGUF q/k rows are llama.cpp's permutation of Hugging
 * Face's (interleaved pairs): llama, smollm3, granite. */
bool model_llama_rows(int arch);
/* Whether RoPE scaling (rope_freqs: linear, YaRN) turns the global layers
 * only, the local (sliding-window) ones plain at rope_base_local: gemma3, and
 * olmo2 with windows (OLMo 3), as llama.cpp and Hugging Face run them. */
bool model_scaling_global_only(const kvlm_config *c);
/* Layers' kinds (local[l]: sliding-window) as kvlm takes them: the last of
 * every cfg.swa_period global. derive: swa_period set from the first global
 * layer's place (none global: 0, every layer local); else as set. Returns the
 * first layer whose kind does not follow it, or -1. */
int model_swa_from_layers(kvlm_config *c, const bool *local, bool derive);
/* granite and granitemoe: the four multipliers (granite_keys) */
bool model_granite_like(int arch);
/* Sets cfg.rope_freqs: the rope_freqs tensor (checked: rope_dim/2 finite
 * factors > 0), times cfg.rope_linear when that is set, times YaRN's factors
 * (not deepseek2's, which rotates its own); or LongRoPE's long and short
 * tensors (checked the same way; no other scaling beside them). */
int model_set_rope_freqs(struct kvlm_model *m, kvlm_error *err);
/* The RoPE factors a context of n_ctx tokens a sequence rotates by: LongRoPE's
 * short ones up to its original context, else cfg.rope_freqs (NULL: none). */
const float *model_rope_freqs(const kvlm_config *c, int n_ctx);
/* LongRoPE's attention factor when a file gives none (llama.cpp's converter,
 * Hugging Face): sqrt(1 + ln(factor) / ln(orig_ctx)) for a factor above 1, else 1. */
double model_longrope_attn_factor(double factor, double orig_ctx);
/* LongRoPE's rotation magnitude squared (1 without LongRoPE), from
 * cfg.longrope_attn_factor as stored: what multiplies q's rotated dimensions. */
float model_longrope_mscale2(const kvlm_config *c);

/* Whether layer l of c is a local (sliding-window) layer, and its window (0: global). */
int model_layer_window(const kvlm_config *c, int l);
/* Shared by the GGUF and HF loaders, so both derive the same config:
 * gemma's defaults before the file's keys are read (attention scale, local
 * RoPE base, window and period), then the count of local layers, then each
 * layer's window and RoPE base. */
void model_swa_defaults(kvlm_config *c);
void model_swa_count(kvlm_config *c);
void model_layer_swa(const kvlm_config *c, model_layer *L, int l);
/* Gemma's scale of the token embeddings (sqrt(dim)); 1 otherwise. */
float model_embed_scale(const kvlm_config *c);

/* The GGUF name of an architecture ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"). */
const char *model_arch_name(kvlm_arch arch);

/* Loads weights and vocabulary (params may be NULL: defaults). */
int model_load(struct kvlm_model *m, const char *path, const kvlm_model_params *params, kvlm_error *err);
void model_unload(struct kvlm_model *m);

/* deepseek2's hyper-parameters past the common ones and its layers
 * (model_deepseek2.c); called by model_load with m->layers allocated. */
int model_deepseek2_layers(struct kvlm_model *m, kvlm_error *err);
/* bert and nomic-bert (model_bert.c): hyper-parameters past the common ones
 * and every tensor, laid out as llama.cpp's converter writes them; called by
 * model_load once the architecture, width, layers, FFN width and heads are read. */
int model_bert_load(struct kvlm_model *m, kvlm_error *err);
/* The blocks the tensors name (blk.N.*) must be exactly 0..n_layers-1. */
int model_check_blocks(const struct kvlm_model *m, int n_layers, kvlm_error *err);
/* model.c's key and tensor readers, for the architecture loaders: a key of
 * the file's architecture ("attention.kv_lora_rank"), a tensor of n_in x
 * n_out (n_out 0: 1-D) checked against the file. */
int model_hp_int(const struct kvlm_model *m, const char *key, int64_t *out, bool *found, kvlm_error *err);
int model_hp_float(const struct kvlm_model *m, const char *key, double lo, bool lo_open, double *out,
                   kvlm_error *err);
/* A 3-D tensor {n_in, n_out, n_expert} (experts, or deepseek2's attn_k_b /
 * attn_v_b heads) as one 2-D view of n_out x n_expert rows (expert e:
 * model_tensor_rows(t, e * n_out, n_out)). */
int model_take_experts(const struct kvlm_model *m, model_tensor *t, const char *name, int64_t n_in, int64_t n_out,
                       int n_expert, kvlm_error *err);
int model_take_tensor(const struct kvlm_model *m, model_tensor *t, const char *name, int64_t n_in, int64_t n_out,
                      bool optional, kvlm_error *err);

/* Synthetic random-weight models (kvlm_synth_params in kvlm.h). */
int model_synth_write(const kvlm_synth_params *p, const char *path, kvlm_error *err);
/* Writes m as GGUF v3; type = -1 keeps each tensor's type. */
int model_save_gguf(const struct kvlm_model *m, const char *path, int type, kvlm_progress_callback cb, void *user,
                    kvlm_error *err);
#endif
