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
    /* gemma2/3: norms of the attention and FFN outputs (before the residual
     * add); gemma3: per-head norms of q and k (before RoPE). Absent: NULL data. */
    model_tensor post_attn_norm, post_ffn_norm, q_norm, k_norm;
    int window;         /* sliding window of this layer's attention, 0: global */
    float rope_base;    /* this layer's RoPE base */
} model_layer;

struct tok_tokenizer;

struct kvlm_model {
    kvlm_config cfg;
    model_tensor tok_embd, output_norm, output;
    model_layer *layers;
    model_vocab vocab;
    struct tok_tokenizer *tok;   /* built by the engine layer from vocab */
    char arch_name[32];
    char path[1024];
    /* Backing storage: a GGUF map, or a llama2.c checkpoint map. */
    gguf_file *gguf;
    void *map;
    size_t map_size;
    size_t weight_bytes;
    void *packed_buf;   /* owned by the engine: every tensor's packed copy */
    size_t packed_bytes;
};

/* A view of rows [row0, row0 + n) of a 2-D weight: a pointer offset, since
 * rows are stored whole (a quantized row is whole blocks). The fused phi3
 * tensors become separate Q, K, V and gate, up views this way, so the
 * forward pass and the per-matrix kernels see ordinary weights. */
model_tensor model_tensor_rows(const model_tensor *t, int64_t row0, int64_t n);

/* Whether layer l of c is a local (sliding-window) layer, and its window (0: global). */
int model_layer_window(const kvlm_config *c, int l);
/* Gemma's scale of the token embeddings (sqrt(dim)); 1 otherwise. */
float model_embed_scale(const kvlm_config *c);

/* The GGUF name of an architecture ("llama", "qwen2", "phi3", "gemma2", "gemma3"). */
const char *model_arch_name(kvlm_arch arch);

/* Loads weights and vocabulary (params may be NULL: defaults). */
int model_load(struct kvlm_model *m, const char *path, const kvlm_model_params *params, kvlm_error *err);
void model_unload(struct kvlm_model *m);

/* Synthetic random-weight models (kvlm_synth_params in kvlm.h). */
int model_synth_write(const kvlm_synth_params *p, const char *path, kvlm_error *err);
/* Writes m as GGUF v3; type = -1 keeps each tensor's type. */
int model_save_gguf(const struct kvlm_model *m, const char *path, int type, kvlm_error *err);
#endif
