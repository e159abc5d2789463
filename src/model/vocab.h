/* model/vocab: a tokenizer's vocabulary as stored in a model file (GGUF
 * tokenizer.ggml.* keys, or llama2.c's tokenizer.bin), read and written here;
 * the algorithms that use it live in tok/. */
#ifndef KVLM_MODEL_VOCAB_H
#define KVLM_MODEL_VOCAB_H
#include <stdbool.h>
#include <stdint.h>
#include "kvlm.h"
#include "model/gguf.h"

/* GGUF token types (tokenizer.ggml.token_type). */
enum {
    VOCAB_T_NORMAL = 1, VOCAB_T_UNKNOWN = 2, VOCAB_T_CONTROL = 3,
    VOCAB_T_USER_DEFINED = 4, VOCAB_T_UNUSED = 5, VOCAB_T_BYTE = 6
};

typedef struct model_vocab {
    char model[32];      /* tokenizer.ggml.model: "llama" (SPM), "gpt2" (byte-level BPE), "bert" (WordPiece), "none" */
    char pre[32];        /* tokenizer.ggml.pre: "default", "llama-bpe", "qwen2", "gpt-2", ... ("" if absent) */
    int n_tokens;
    char **tokens;       /* NUL-terminated strings (SPM spaces as U+2581) */
    uint32_t *lens;      /* byte lengths */
    float *scores;       /* n_tokens; all 0 if absent */
    int32_t *types;      /* n_tokens; VOCAB_T_NORMAL if absent */
    int n_merges;
    char **merges;       /* "a b" pairs, rank = index */
    int32_t bos, eos, unk, pad, eot; /* -1 if none */
    int32_t fim_pre, fim_suf, fim_mid; /* fill-in-the-middle tokens (tokenizer.ggml.fim_*_token_id); -1 if none */
    /* WordPiece ("bert"): [SEP], added after the text where BOS ([CLS]) is
     * added first (-1: none); [CLS] is bos. The normalizer's flags:
     * lowercase (tokenizer.ggml.normalizer.lowercase, default true) and
     * accents stripped (tokenizer.ggml.normalizer.strip_accents, default:
     * as lowercase, BERT's rule) */
    int32_t sep;
    bool wpm_lower, wpm_strip_accents;
    bool add_bos, add_eos;
    bool add_space_prefix; /* SPM: prepend a space to the text (default true) */
    char *chat_template;   /* NULL if none */
    /* named templates besides it (GGUF tokenizer.chat_template.NAME, a
     * tokenizer_config.json list's other entries): Hermes' and Command R's
     * "tool_use", for example */
    int n_named_templates;
    char **named_template_names, **named_templates;
    bool add_bos_key;      /* tokenizer.ggml.add_bos_token was in the file (else add_bos is a default) */
    /* A byte-level pre-tokenizer given as its regexes (tokenizer.json, or
     * tokenizer.kvlm.pre_regex in a GGUF kvlm wrote): applied in order when
     * has_pre_regex, instead of the one `pre` names. The engine replaces a
     * list kvlm knows by its name (tok_pretok_find). */
    bool has_pre_regex;
    char **pre_regex;
    int n_pre_regex;
    bool pre_ignore_merges; /* with pre_regex: a chunk that is a token skips the merges */
} model_vocab;

/* Reads the tokenizer.ggml.* keys (and tokenizer.chat_template[.NAME]) of f into v
 * (v is overwritten). Error messages do not name the file: callers prefix it. */
int vocab_from_gguf(const gguf_file *f, model_vocab *v, kvlm_error *err);
/* Reads llama2.c's tokenizer.bin (int32 max token length, then per token:
 * float score, int32 length, bytes); n_vocab comes from the model header.
 * Tokens are turned back into SentencePiece form (' ' -> U+2581). */
int vocab_from_llama2c(const char *path, int n_vocab, model_vocab *v, kvlm_error *err);
/* Writes every key vocab_from_gguf reads, so a converted model keeps its tokenizer. */
void vocab_to_gguf(const model_vocab *v, gguf_writer *w);
/* Adds a named chat template (copies both strings). */
int vocab_add_named_template(model_vocab *v, const char *name, size_t name_len, const char *text, size_t text_len);
void vocab_free(model_vocab *v); /* frees the contents, not v; leaves v empty (ids -1) */
#endif
