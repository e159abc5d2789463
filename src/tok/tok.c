/* tok/tok: the tokenizer object: building it from a model_vocab, cutting
 * special tokens out of the text before the model-specific encoders run,
 * decoding single tokens, and end-of-generation tokens. */
#include "tok/tok.h"
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tok/tok_internal.h"
#include "util/utf8.h"
#include "util/error.h"

/* Longest text tok_encode accepts, so every count fits in an int: a byte
 * gives at most three tokens (an escaped space that is not a token falls
 * back to three byte tokens), plus a space prefix after each special token. */
#define TOK_MAX_TEXT ((size_t)INT32_MAX / 8)

static int32_t tok_type(const model_vocab *v, int32_t id) {
    return v->types ? v->types[id] : VOCAB_T_NORMAL;
}

static int cmp_spec(const void *a, const void *b) {
    const struct tok_special *x = a, *y = b;
    int c = memcmp(x->s, y->s, x->len < y->len ? x->len : y->len);
    if (c) return c;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* "<0xHH>" -> HH, else -1. */
static int parse_byte_token(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Writes token id's display bytes (non-special form) to out (capacity
 * >= its text length, enough for every form); returns the count. */
static size_t decode_token(const tok_tokenizer *t, int32_t id, char *out) {
    const model_vocab *v = t->v;
    const char *s = v->tokens[id];
    size_t n = v->lens[id], o = 0;
    int32_t type = tok_type(v, id);
    if (t->kind == TOK_KIND_WPM) { /* a word's start has U+2581 for its space; a continuation joins on */
        for (size_t i = 0; i < n;) {
            if (i + 3 <= n && memcmp(s + i, "\xE2\x96\x81", 3) == 0) { out[o++] = ' '; i += 3; }
            else out[o++] = s[i++];
        }
        return o;
    }
    if (t->kind == TOK_KIND_SPM) {
        int b;
        /* Byte tokens; llama2.c vocabularies may leave them typed normal. */
        if ((type == VOCAB_T_BYTE || type == VOCAB_T_NORMAL) && (b = parse_byte_token(s, n)) >= 0) {
            out[0] = (char)b;
            return 1;
        }
        for (size_t i = 0; i < n;) {
            if (i + 3 <= n && memcmp(s + i, "\xE2\x96\x81", 3) == 0) { out[o++] = ' '; i += 3; }
            else out[o++] = s[i++];
        }
        return o;
    }
    /* Byte-level BPE: added (user-defined) tokens are stored as plain text. */
    if (type == VOCAB_T_USER_DEFINED) {
        memcpy(out, s, n);
        return n;
    }
    if (t->raw) {
        /* Plain UTF-8 tokens: <0xHH> byte tokens, U+2581 for spaces. */
        int b;
        if (type == VOCAB_T_BYTE && (b = parse_byte_token(s, n)) >= 0) {
            out[0] = (char)b;
            return 1;
        }
        for (size_t i = 0; i < n;) {
            if (t->escape && i + 3 <= n && memcmp(s + i, "\xE2\x96\x81", 3) == 0) { out[o++] = ' '; i += 3; }
            else out[o++] = s[i++];
        }
        return o;
    }
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int l = util_utf8_decode((const uint8_t *)s + i, n - i, &cp);
        int b = l > 0 ? tok_bpe_cp_byte(cp) : -1;
        if (b >= 0) out[o++] = (char)b;
        else {
            /* Not one of GPT-2's byte characters: keep the text as it is. */
            if (l <= 0) l = 1;
            memcpy(out + o, s + i, (size_t)l);
            o += (size_t)l;
        }
        i += (size_t)l;
    }
    return o;
}

static bool is_eog_text(const char *s, size_t n) {
    static const char *const marks[] = {"<|eot_id|>", "<|im_end|>", "<|endoftext|>", "</s>", "<|end|>",
                                        "<end_of_turn>", "<|eom_id|>", "<|end_of_text|>"};
    for (size_t i = 0; i < sizeof marks / sizeof marks[0]; i++)
        if (strlen(marks[i]) == n && memcmp(marks[i], s, n) == 0) return true;
    return false;
}

void tok_free(tok_tokenizer *t) {
    if (!t) return;
    tok_strmap_free(&t->map);
    tok_bpe_free(t);
    tok_pretok_free(t->pre);
    free(t->flags);
    free(t->dec);
    free(t->dec_off);
    free(t->dec_len);
    free(t->spec);
    free(t);
}

tok_tokenizer *tok_create(const model_vocab *v, kvlm_error *err) {
    if (!v || v->n_tokens <= 0 || !v->tokens || !v->lens) {
        util_err_set(err, KVLM_EINVAL, "tokenizer: empty vocabulary");
        return NULL;
    }
    /* Merge ranks travel as floats in the pair queue: exact up to 2^24. */
    if (v->n_tokens > (1 << 28) || v->n_merges > (1 << 24)) {
        util_err_set(err, KVLM_EFORMAT, "tokenizer: %d tokens and %d merges is more than kvlm handles", v->n_tokens,
                     v->n_merges);
        return NULL;
    }
    int kind;
    if (!strcmp(v->model, "llama")) kind = TOK_KIND_SPM;
    else if (!strcmp(v->model, "gpt2")) kind = TOK_KIND_BPE;
    else if (!strcmp(v->model, "bert")) kind = TOK_KIND_WPM;
    else {
        util_err_set(err, KVLM_EUNSUPPORTED,
                     "tokenizer model \"%s\" (tokenizer.ggml.model) is not supported; supported: llama (SentencePiece), "
                     "gpt2 (byte-level BPE), bert (WordPiece)",
                     v->model);
        return NULL;
    }
    for (int i = 0; i < v->n_tokens; i++)
        if (!v->tokens[i]) {
            util_err_set(err, KVLM_EFORMAT, "tokenizer: token %d has no text", i);
            return NULL;
        }
    tok_tokenizer *t = calloc(1, sizeof *t);
    if (!t) goto nomem;
    t->v = v;
    t->kind = kind;
    if (tok_strmap_init(&t->map, v)) goto nomem;
    int n = v->n_tokens;
    t->flags = calloc((size_t)n, 1);
    t->dec_off = malloc((size_t)n * sizeof *t->dec_off);
    t->dec_len = malloc((size_t)n * sizeof *t->dec_len);
    size_t total = 0, n_spec = 0;
    for (int i = 0; i < n; i++) {
        total += v->lens[i];
        if (v->lens[i] > t->max_len) t->max_len = v->lens[i];
        int32_t type = tok_type(v, i);
        n_spec += type == VOCAB_T_CONTROL || type == VOCAB_T_UNKNOWN || type == VOCAB_T_USER_DEFINED;
    }
    t->spec = malloc((n_spec ? n_spec : 1) * sizeof *t->spec);
    if (total > UINT32_MAX) {
        util_err_set(err, KVLM_EFORMAT, "tokenizer: %zu bytes of token text is more than kvlm handles", total);
        tok_free(t);
        return NULL;
    }
    t->dec = malloc(total + 1);
    if (!t->flags || !t->dec_off || !t->dec_len || !t->spec || !t->dec) goto nomem;

    if (kind == TOK_KIND_BPE) {
        /* The pre-tokenizer first: it says how tokens are written. */
        t->pre = v->has_pre_regex ? tok_pretok_create_regex((const char *const *)v->pre_regex, v->n_pre_regex,
                                                            v->pre_ignore_merges, err)
                                  : tok_pretok_create(v->pre, err);
        if (!t->pre) {
            tok_free(t);
            return NULL;
        }
        t->ignore_merges = tok_pretok_ignore_merges(t->pre);
        t->raw = tok_pretok_raw(t->pre);
        t->escape = tok_pretok_escape_spaces(t->pre);
    }

    /* Display bytes of every token, once, so decoding is a copy. */
    size_t off = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t l = decode_token(t, i, t->dec + off);
        t->dec_off[i] = (uint32_t)off;
        t->dec_len[i] = (uint32_t)l;
        off += l;
    }

    for (int32_t i = 0; i < n; i++) {
        int32_t type = tok_type(v, i);
        if (type == VOCAB_T_CONTROL || type == VOCAB_T_UNKNOWN) t->flags[i] |= TOK_F_SPECIAL;
        if (type == VOCAB_T_CONTROL && is_eog_text(v->tokens[i], v->lens[i])) t->flags[i] |= TOK_F_EOG;
        /* Text that names these tokens is cut out before encoding. */
        if ((type == VOCAB_T_CONTROL || type == VOCAB_T_UNKNOWN || type == VOCAB_T_USER_DEFINED) && v->lens[i] > 0) {
            bool user = type == VOCAB_T_USER_DEFINED;
            t->spec[t->n_spec++] = (struct tok_special){v->tokens[i], v->lens[i], i, user};
            t->spec_first[(uint8_t)v->tokens[i][0]] |= user ? 3 : 1;
        }
    }
    if (v->eos >= 0 && v->eos < n) t->flags[v->eos] |= TOK_F_EOG;
    if (v->eot >= 0 && v->eot < n) t->flags[v->eot] |= TOK_F_EOG;
    /* gpt-oss's harmony format (llama.cpp's rules): where <|return|>, <|call|>
     * and <|end|> all exist, a turn ends at the first two; <|end|> closes a
     * message (the analysis before the final answer) and generation goes on;
     * the markers of a message's header and end are shown in the text, so
     * that the analysis and the final answer can be told apart */
    enum { H_RETURN, H_CALL, H_END, H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN, H_N };
    static const char *const hm[H_N] = {"<|return|>", "<|call|>",    "<|end|>",      "<|start|>",
                                        "<|channel|>", "<|message|>", "<|constrain|>"};
    int harmony[H_N];
    for (int k = 0; k < H_N; k++) harmony[k] = tok_strmap_get(&t->map, hm[k], strlen(hm[k]));
    if (harmony[H_RETURN] >= 0 && harmony[H_CALL] >= 0 && harmony[H_END] >= 0) {
        t->flags[harmony[H_RETURN]] |= TOK_F_EOG;
        t->flags[harmony[H_CALL]] |= TOK_F_EOG;
        t->flags[harmony[H_END]] &= (uint8_t)~TOK_F_EOG;
        for (int k = H_END; k < H_N; k++)
            if (harmony[k] >= 0) t->flags[harmony[k]] &= (uint8_t)~TOK_F_SPECIAL;
    }
    qsort(t->spec, (size_t)t->n_spec, sizeof *t->spec, cmp_spec);

    if (kind == TOK_KIND_SPM || t->raw) {
        /* A token holding "x▁" (U+2581 after something else) could span a
         * word boundary; SentencePiece vocabularies have none, but check. */
        t->spm_split = true;
        for (int32_t i = 0; i < n && t->spm_split; i++) {
            const char *s = v->tokens[i];
            for (size_t k = 1; k + 3 <= v->lens[i]; k++)
                if (memcmp(s + k, "\xE2\x96\x81", 3) == 0 && !(k >= 3 && memcmp(s + k - 3, "\xE2\x96\x81", 3) == 0)) {
                    t->spm_split = false;
                    break;
                }
        }
        for (int b = 0; b < 256; b++) {
            char buf[8];
            snprintf(buf, sizeof buf, "<0x%02X>", b);
            t->byte_tok[b] = tok_strmap_get(&t->map, buf, 6);
            if (t->byte_tok[b] < 0) {
                /* Some vocabularies hold single bytes as plain tokens. */
                buf[0] = (char)b;
                t->byte_tok[b] = tok_strmap_get(&t->map, buf, 1);
            }
        }
    }
    if (kind == TOK_KIND_BPE) {
        if (tok_bpe_init(t, err)) {
            tok_free(t);
            return NULL;
        }
    }
    return t;
nomem:
    util_err_set(err, KVLM_ENOMEM, "tokenizer: out of memory for %d tokens", v->n_tokens);
    tok_free(t);
    return NULL;
}

/* Length of the longest special token that text starts with (0 if none),
 * its id in *id. The sorted strings sharing the first k bytes with the text
 * form the range [lo, hi); each byte narrows it by binary search. Only
 * user-defined tokens count unless all. */
static size_t match_special(const tok_tokenizer *t, const char *text, size_t n, bool all, int32_t *id) {
    const struct tok_special *sp = t->spec;
    size_t lo = 0, hi = (size_t)t->n_spec, best = 0;
    for (size_t k = 0; k < n && lo < hi; k++) {
        uint8_t c = (uint8_t)text[k];
        while (lo < hi && sp[lo].len == k) lo++; /* ended before this byte */
        size_t a = lo, b = hi;
        while (a < b) {
            size_t m = a + (b - a) / 2;
            if ((uint8_t)sp[m].s[k] < c) a = m + 1;
            else b = m;
        }
        size_t first = a;
        b = hi;
        while (a < b) {
            size_t m = a + (b - a) / 2;
            if ((uint8_t)sp[m].s[k] <= c) a = m + 1;
            else b = m;
        }
        lo = first;
        hi = a;
        for (size_t j = lo; j < hi && sp[j].len == k + 1; j++)
            if (all || sp[j].user) {
                best = k + 1;
                *id = sp[j].id;
                break;
            }
    }
    return best;
}

typedef struct {
    const tok_tokenizer *t;
    tok_scratch *s;
    tok_out *o;
    kvlm_error *err;
} chunk_ctx;

static int bpe_chunk(void *ctx, const char *chunk, size_t n) {
    chunk_ctx *c = ctx;
    return tok_bpe_encode(c->t, chunk, n, c->s, c->o, c->err);
}

/* Ordinary text between special tokens. Every such stretch starts the text
 * or follows a special token, and llama.cpp gives each one the SentencePiece
 * space prefix; one that continues text already encoded (cont: the tokens of
 * a span before it, tok_encode_cont) gets none. */
static int encode_text(const tok_tokenizer *t, const char *text, size_t len, bool cont, tok_scratch *s, tok_out *o,
                       kvlm_error *err) {
    if (t->kind == TOK_KIND_SPM) return tok_spm_encode(t, text, len, t->v->add_space_prefix && !cont, s, o, err);
    if (t->kind == TOK_KIND_WPM) return tok_wpm_encode(t, text, len, s, o, err);
    chunk_ctx c = {t, s, o, err};
    return tok_pretok_split(t->pre, text, len, bpe_chunk, &c, err) ? -1 : 0;
}

int tok_encode(const tok_tokenizer *t, const char *text, size_t len, bool add_bos, bool parse_special,
               int32_t *out, int max, kvlm_error *err) {
    return tok_encode_cont(t, text, len, add_bos, parse_special, false, out, max, err);
}

int tok_encode_cont(const tok_tokenizer *t, const char *text, size_t len, bool add_bos, bool parse_special,
                    bool cont, int32_t *out, int max, kvlm_error *err) {
    if (!t || (!text && len)) return util_err_set(err, KVLM_EINVAL, "tok_encode: no tokenizer or text"), -1;
    if (len > TOK_MAX_TEXT)
        return util_err_set(err, KVLM_ERANGE, "tok_encode: text of %zu bytes is too long (limit %zu)", len,
                            TOK_MAX_TEXT), -1;
    tok_out o = {.out = out, .max = out && max > 0 ? max : 0, .n = 0};
    if (add_bos && t->v->bos >= 0 && t->v->bos < t->v->n_tokens) tok_out_push(&o, t->v->bos);
    tok_scratch s = {0};
    size_t raw = 0; /* start of the text not yet encoded */
    uint8_t need = parse_special ? 1 : 2;
    int rc = 0;
    for (size_t i = 0; i < len && t->n_spec > 0;) {
        int32_t id;
        size_t m = (t->spec_first[(uint8_t)text[i]] & need) ? match_special(t, text + i, len - i, parse_special, &id) : 0;
        if (!m) { i++; continue; }
        if (i > raw) {
            if ((rc = encode_text(t, text + raw, i - raw, cont && raw == 0, &s, &o, err))) goto done;
        }
        tok_out_push(&o, id);
        i += m;
        raw = i;
    }
    if (len > raw) rc = encode_text(t, text + raw, len - raw, cont && raw == 0, &s, &o, err);
    /* BERT's inputs end with [SEP] where they begin with [CLS] */
    if (!rc && add_bos && t->kind == TOK_KIND_WPM && t->v->sep >= 0 && t->v->sep < t->v->n_tokens)
        tok_out_push(&o, t->v->sep);
done:
    tok_scratch_free(&s);
    if (rc) return -1;
    return (int)o.n;
}

int tok_token_to_bytes(const tok_tokenizer *t, int32_t id, bool show_special, char *buf, size_t cap) {
    if (!t || id < 0 || id >= t->v->n_tokens) return -1;
    const char *s;
    size_t n;
    if (t->flags[id] & TOK_F_SPECIAL) {
        if (!show_special) return 0;
        s = t->v->tokens[id];
        n = t->v->lens[id];
    } else {
        s = t->dec + t->dec_off[id];
        n = t->dec_len[id];
    }
    if (n > cap) n = cap;
    if (n > INT_MAX) n = INT_MAX;
    if (n) memcpy(buf, s, n);
    return (int)n;
}

int tok_n_vocab(const tok_tokenizer *t) { return t ? t->v->n_tokens : 0; }

bool tok_is_eog(const tok_tokenizer *t, int32_t id) {
    return t && id >= 0 && id < t->v->n_tokens && (t->flags[id] & TOK_F_EOG);
}

bool tok_is_spm(const tok_tokenizer *t) { return t && t->kind == TOK_KIND_SPM; }

bool tok_default_add_bos(const tok_tokenizer *t) { return t && t->pre && tok_pretok_add_bos(t->pre); }

typedef struct {
    const char *text;
    tok_span *out;
    int64_t max, n;
} span_ctx;

static int span_chunk(void *ctx, const char *chunk, size_t n) {
    span_ctx *c = ctx;
    if (c->n < c->max) c->out[c->n] = (tok_span){(size_t)(chunk - c->text), n};
    c->n++;
    return 0;
}

int tok_pretokenize(const tok_tokenizer *t, const char *text, size_t len, tok_span *out, int max,
                    kvlm_error *err) {
    if (!t || (!text && len)) return util_err_set(err, KVLM_EINVAL, "tok_pretokenize: no tokenizer or text"), -1;
    if (len > TOK_MAX_TEXT) return util_err_set(err, KVLM_ERANGE, "tok_pretokenize: text too long"), -1;
    if (!t->pre) {
        /* SentencePiece has no pre-tokenizer: the whole text is one chunk. */
        if (len && out && max > 0) out[0] = (tok_span){0, len};
        return len ? 1 : 0;
    }
    span_ctx c = {.text = text, .out = out, .max = out && max > 0 ? max : 0, .n = 0};
    if (tok_pretok_split(t->pre, text, len, span_chunk, &c, err)) return -1;
    return (int)c.n;
}
