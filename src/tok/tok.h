/* tok/tok: tokenizers over a model_vocab: SentencePiece-style BPE with scores
 * and byte fallback ("llama"), and byte-level BPE with merges ("gpt2") whose
 * pre-tokenizer regex (GPT-2, Llama 3, Qwen2, ...) runs through PCRE2. */
#ifndef KVLM_TOK_TOK_H
#define KVLM_TOK_TOK_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kvlm.h"
#include "model/vocab.h"

typedef struct tok_tokenizer tok_tokenizer;

/* Builds a tokenizer; v must outlive it. NULL with err on an unknown
 * tokenizer model or pre-tokenizer. */
tok_tokenizer *tok_create(const model_vocab *v, kvlm_error *err);
void tok_free(tok_tokenizer *t);

/* Encodes text (any bytes; invalid UTF-8 is tokenized byte by byte, never
 * read past len). Returns the token count (may exceed max: only the first max
 * are written) or -1 with err. add_bos: prepend BOS when the vocab has one.
 * parse_special: text matching a control/user-defined token's string becomes
 * that token; otherwise such text is tokenized as ordinary characters. */
int tok_encode(const tok_tokenizer *t, const char *text, size_t len, bool add_bos,
               bool parse_special, int32_t *out, int max, kvlm_error *err);
/* The same, for text that continues text already encoded (cont: it follows
 * tokens given by other means, kvlm_tokenize_spans): its first stretch gets
 * no SentencePiece space prefix, as it would get none inside the whole text. */
int tok_encode_cont(const tok_tokenizer *t, const char *text, size_t len, bool add_bos, bool parse_special,
                    bool cont, int32_t *out, int max, kvlm_error *err);
/* The bytes of one token as text: '▁' -> ' ' (SPM), "<0x0A>" -> byte 0x0A,
 * byte-level BPE symbols -> their bytes; control tokens -> "" (unless
 * show_special). Returns the byte count (truncated to cap), or -1 for a bad id.
 * Does not NUL-terminate. */
int tok_token_to_bytes(const tok_tokenizer *t, int32_t id, bool show_special, char *buf, size_t cap);

int tok_n_vocab(const tok_tokenizer *t);
bool tok_is_eog(const tok_tokenizer *t, int32_t id); /* EOS, EOT and other end-of-generation tokens */
bool tok_is_spm(const tok_tokenizer *t);
/* Whether the pre-tokenizer adds BOS when the vocabulary does not say (Llama 3, ...). */
bool tok_default_add_bos(const tok_tokenizer *t);

/* The pre-tokenizer's chunks of text (byte-level BPE; SentencePiece gives the
 * whole text as one chunk), for tests and tools. Returns the chunk count
 * (only the first max are written) or -1 with err. */
typedef struct { size_t off, len; } tok_span;
int tok_pretokenize(const tok_tokenizer *t, const char *text, size_t len, tok_span *out, int max,
                    kvlm_error *err);
#endif
