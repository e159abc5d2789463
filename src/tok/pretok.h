/* tok/pretok: byte-level BPE pre-tokenizers: the regexes (GPT-2, Llama 3,
 * Qwen2, DeepSeek, GPT-4o, ... every name llama.cpp knows) chosen by
 * tokenizer.ggml.pre, run through PCRE2, and the flags that go with them. */
#ifndef KVLM_TOK_PRETOK_H
#define KVLM_TOK_PRETOK_H
#include <stdbool.h>
#include <stddef.h>
#include "kvlm.h"

typedef struct tok_pretok tok_pretok;

/* pre: the vocab's pre value ("" means "default", as in llama.cpp). NULL
 * with err (listing the supported names) when unknown. */
tok_pretok *tok_pretok_create(const char *pre, kvlm_error *err);
void tok_pretok_free(tok_pretok *p);
/* Whether whole chunks that are tokens skip the merges (Llama 3). */
bool tok_pretok_ignore_merges(const tok_pretok *p);
/* Whether the vocabulary adds BOS when tokenizer.ggml.add_bos_token is
 * absent (Llama 3, Tekken, Chameleon). */
bool tok_pretok_add_bos(const tok_pretok *p);
/* Whether tokens are plain UTF-8 text with <0xHH> byte tokens rather than
 * GPT-2's byte characters (Gemma 4, whitespace). */
bool tok_pretok_raw(const tok_pretok *p);
/* Whether spaces become U+2581 before the split (Gemma 4). */
bool tok_pretok_escape_spaces(const tok_pretok *p);
/* The table's rows, for tests: how many, and row i's '|'-separated names. */
int tok_pretok_n_defs(void);
const char *tok_pretok_def_names(int i);
/* Writes the names tok_pretok_create accepts, comma-separated, into buf
 * (with aliases: all of them; else the first of each kind); returns buf. */
const char *tok_pretok_names(char *buf, size_t cap, bool aliases);

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
