/* model/hf: Hugging Face model directories (config.json, safetensors with or
 * without an index, tokenizer.json, tokenizer_config.json) as a kvlm_model:
 * the families llama, mistral, qwen2, phi3 (gemma2: one row of the family
 * table, refused until its forward pass is in). */
#ifndef KVLM_MODEL_HF_H
#define KVLM_MODEL_HF_H
#include <stdbool.h>
#include "kvlm.h"
#include "model/safetensors.h"
#include "model/vocab.h"

struct kvlm_model;

/* What a directory holds beyond the config: its safetensors and the few
 * tensors made at load (norms and biases widened to f32). */
typedef struct model_hf {
    st_set *st;
    void **owned;
    int n_owned, cap_owned;
    char family[32];             /* config.json model_type */
    int sliding_window;          /* config.json sliding_window, recorded (0: none); see docs/hf-checkpoints.md */
    /* A multimodal directory's (gemma3, mistral3): the language model's
     * tensors are "language_model.model.*" and "language_model.lm_head.weight"
     * (as Google and Mistral ship them) or "model.language_model.*" and
     * "lm_head.weight" (newer Transformers); NULL for a text model's "model.*" */
    const char *lm_model, *lm_head;
} model_hf;

/* Whether path is a directory (then model_load reads it as a HF checkpoint). */
bool model_hf_is_dir(const char *path);
/* A file of a HF directory given instead of the directory (*.safetensors,
 * config.json, ...): fills err saying to give the directory; 0 otherwise. */
int model_hf_file_hint(const char *path, kvlm_error *err);
/* Loads m from directory dir: vocabulary (tokenizer.json), then unless
 * vocab_only the config and weights. m is zeroed by the caller. */
int model_hf_load(struct kvlm_model *m, const char *dir, bool vocab_only, kvlm_error *err);
void model_hf_free(struct kvlm_model *m);
/* The safetensors tensors of a loaded directory, for listing (kvlm inspect):
 * ne in GGUF order (innermost first), offset within its file. */
int model_hf_n_tensors(const struct kvlm_model *m);
bool model_hf_tensor(const struct kvlm_model *m, int i, kvlm_tensor_info *info);

/* tokenizer.json + tokenizer_config.json (+ config.json for ids) of dir
 * into v (overwritten): byte-level BPE as "gpt2" (the pre-tokenizer named
 * when kvlm knows its regexes, else its own regexes in v->pre_regex), BPE
 * with byte_fallback (SentencePiece converted) as "llama" with scores from
 * the merge ranks. Padded to n_rows tokens when n_rows > 0. */
int vocab_from_hf(const char *dir, int n_rows, model_vocab *v, kvlm_error *err);
#endif
