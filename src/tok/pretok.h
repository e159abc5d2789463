/* tok/pretok: byte-level BPE pre-tokenizers: the regexes (GPT-2, Llama 3,
 * Qwen2, StarCoder, ...) chosen by tokenizer.ggml.pre, run through PCRE2. */
#ifndef KVLM_TOK_PRETOK_H
#define KVLM_TOK_PRETOK_H
#include <stdbool.h>
#include <stddef.h>
#include "kvlm.h"

typedef struct tok_pretok tok_pretok;

/* pre: the vocab's pre value ("" and "default" mean GPT-2's). NULL with err
 * (listing the supported names) when unknown. */
tok_pretok *tok_pretok_create(const char *pre, kvlm_error *err);
void tok_pretok_free(tok_pretok *p);
/* Whether whole chunks that are tokens skip the merges (Llama 3). */
bool tok_pretok_ignore_merges(const tok_pretok *p);
/* Writes the names tok_pretok_create accepts, comma-separated, into buf;
 * returns buf. */
const char *tok_pretok_names(char *buf, size_t cap);

/* Splits text into chunks, calling fn(ctx, chunk, n) for each in order; the
 * chunks cover every byte exactly once (bytes no regex matches, such as
 * invalid UTF-8, become chunks of their own). fn returns 0 to go on, or
 * non-zero to stop. Returns 0, fn's non-zero value, or -1 with err. */
typedef int (*tok_chunk_fn)(void *ctx, const char *chunk, size_t n);
int tok_pretok_split(const tok_pretok *p, const char *text, size_t len, tok_chunk_fn fn, void *ctx,
                     kvlm_error *err);

/* Pre-tokenizers given as regexes (tokenizer.json's Split patterns):
 * tok_pretok_find names the known pre-tokenizer with exactly these regexes
 * (Hugging Face's case-insensitive contractions group counts as the
 * spelled-out one), writing its first name into name; false if none.
 * tok_pretok_create_regex builds one from the list itself. */
bool tok_pretok_find(const char *const *re, int n_re, char *name, size_t cap);
tok_pretok *tok_pretok_create_regex(const char *const *re, int n_re, bool ignore_merges, kvlm_error *err);
#endif
