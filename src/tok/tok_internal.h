/* tok/tok_internal: the tokenizer object and the pieces the SentencePiece and
 * byte-level BPE encoders share (hash tables, the pair queue, scratch space). */
#ifndef KVLM_TOK_INTERNAL_H
#define KVLM_TOK_INTERNAL_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kvlm.h"
#include "model/vocab.h"
#include "tok/pretok.h"

/* Token text -> id, open addressing over the vocabulary's own strings. */
typedef struct { uint32_t hash; int32_t id; } tok_strslot;
typedef struct {
    tok_strslot *slots; /* id -1: empty */
    uint32_t mask;
    const model_vocab *v;
} tok_strmap;
int tok_strmap_init(tok_strmap *m, const model_vocab *v);
void tok_strmap_free(tok_strmap *m);
int32_t tok_strmap_get(const tok_strmap *m, const char *s, size_t n); /* -1 if absent */

/* BPE merge (left id, right id) -> (rank, merged id). */
typedef struct { uint64_t key; int32_t rank, merged; } tok_pairslot;
typedef struct {
    tok_pairslot *slots; /* key UINT64_MAX: empty */
    uint32_t mask;
} tok_pairmap;
bool tok_pairmap_get(const tok_pairmap *m, int32_t a, int32_t b, int32_t *rank, int32_t *merged);
void tok_pairmap_put(tok_pairmap *m, int32_t a, int32_t b, int32_t rank, int32_t merged);

/* One symbol of the text being merged: a span [start, start+n) of the
 * working buffer in a doubly linked list; n == 0 once absorbed. */
typedef struct { uint32_t start, n; int32_t prev, next, id; } tok_sym;
/* A candidate merge of sym[left] and sym[right]; prio: smaller merges first
 * (SPM: -score, BPE: rank). size (= both lengths when queued) tells whether
 * the pair is still the one queued, since symbols only ever grow. */
typedef struct { float prio; int32_t left, right; uint32_t size; int32_t id; } tok_pair;

typedef struct {
    tok_sym *sym; size_t sym_cap;
    tok_pair *heap; size_t heap_n, heap_cap;
    char *buf; size_t buf_cap;
} tok_scratch;
void tok_scratch_free(tok_scratch *s);
bool tok_scratch_syms(tok_scratch *s, size_t n);
bool tok_scratch_buf(tok_scratch *s, size_t n);
bool tok_heap_push(tok_scratch *s, tok_pair p);
tok_pair tok_heap_pop(tok_scratch *s); /* heap_n must be > 0 */

/* Output: every token is counted, only the first max are stored. */
typedef struct { int32_t *out; int64_t max, n; } tok_out;
static inline void tok_out_push(tok_out *o, int32_t id) {
    if (o->n < o->max) o->out[o->n] = id;
    o->n++;
}

enum { TOK_KIND_SPM, TOK_KIND_BPE, TOK_KIND_WPM };
enum { TOK_F_EOG = 1, TOK_F_SPECIAL = 2 /* control/unknown: hidden unless asked */ };

struct tok_tokenizer {
    const model_vocab *v;
    int kind;
    tok_strmap map;
    uint8_t *flags;            /* per token, TOK_F_* */
    /* Display bytes of each token (spaces and byte tokens decoded). */
    char *dec;
    uint32_t *dec_off, *dec_len;
    /* Special tokens matched in text, sorted by their strings. */
    struct tok_special { const char *s; uint32_t len; int32_t id; bool user; } *spec;
    int n_spec;
    uint32_t max_len;          /* longest token, in bytes */
    uint8_t spec_first[256];   /* bit 1: some special starts with this byte; bit 2: some user-defined one */
    /* SPM */
    int32_t byte_tok[256];     /* <0xHH> token per byte, -1 if none */
    bool spm_split;            /* no token has U+2581 right after another character, so
                                  text splits before each such U+2581 for merging */
    /* BPE */
    tok_pretok *pre;
    tok_pairmap merges;
    int32_t byte_sym[256];     /* token of each byte's GPT-2 character, -1 if none */
    char byte_utf8[256][2];    /* that character as UTF-8 */
    uint8_t byte_utf8_len[256];
    bool ignore_merges;        /* Llama 3: a chunk that is a whole token skips the merges */
    /* BPE over plain UTF-8 tokens (Gemma 4, whitespace): symbols start as
     * characters, leftovers fall back to <0xHH> tokens (byte_tok). */
    bool raw;
    bool escape;               /* raw: spaces are U+2581 in the tokens */
};

/* Encoders for one stretch of ordinary text. Return 0, or -1 with err. */
int tok_spm_encode(const struct tok_tokenizer *t, const char *text, size_t len, bool space_prefix,
                   tok_scratch *s, tok_out *o, kvlm_error *err);
int tok_bpe_encode(const struct tok_tokenizer *t, const char *text, size_t len, tok_scratch *s,
                   tok_out *o, kvlm_error *err);
/* WordPiece (tok/wpm.c): normalised, split into words, each into pieces. */
int tok_wpm_encode(const struct tok_tokenizer *t, const char *text, size_t len, tok_scratch *s, tok_out *o,
                   kvlm_error *err);
/* Builds the BPE tables (merges, byte characters); 0 or -1 with err. */
int tok_bpe_init(struct tok_tokenizer *t, kvlm_error *err);
void tok_bpe_free(struct tok_tokenizer *t);
/* The GPT-2 byte <-> character table: byte b is shown as code point
 * tok_bpe_byte_cp(b); tok_bpe_cp_byte inverts it (-1 if cp is not one). */
uint32_t tok_bpe_byte_cp(uint8_t b);
int tok_bpe_cp_byte(uint32_t cp);
#endif
