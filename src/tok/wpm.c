/* tok/wpm: WordPiece ("bert" vocabularies), as BERT's tokenizers do it
 * (Hugging Face's BertNormalizer, BertPreTokenizer and WordPiece): control
 * characters dropped, whitespace made spaces, CJK characters split apart,
 * accents stripped (NFD, marks dropped) and lowercase as the vocabulary's
 * flags say, words split at whitespace and punctuation, then each word the
 * longest vocabulary pieces first (a word start, then continuations), or
 * [UNK] for the whole word when that fails or it is over 100 characters.
 * The vocabulary is stored as llama.cpp's converter writes it: a word-start
 * piece with U+2581 before it, a continuation ("##x") as "x". Unicode's
 * tables (normalisation, case, categories) are libunistring's. */
#include <stdlib.h>
#include <string.h>
#include <unicase.h>
#include <unictype.h>
#include <uninorm.h>
#include "tok/tok_internal.h"
#include "util/utf8.h"
#include "util/error.h"

/* Hugging Face's max_input_chars_per_word */
#define WPM_MAX_WORD 100

/* Unicode's White_Space (Hugging Face's fast tokenizer; the control characters among them are dropped first) */
static bool is_ws(uint32_t c) { return uc_is_property_white_space(c); }

/* BERT's control: category C*, but tab, newline and carriage return are whitespace */
static bool is_control(uint32_t c) {
    if (c == '\t' || c == '\n' || c == '\r') return false;
    return uc_is_general_category(c, UC_CATEGORY_C);
}

/* ASCII punctuation and symbols, and every Unicode punctuation category */
static bool is_punct(uint32_t c) {
    if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126)) return true;
    return uc_is_general_category(c, UC_CATEGORY_P);
}

/* The CJK ideograph blocks BERT splits apart (its list, not Unicode's Han script) */
static bool is_cjk(uint32_t c) {
    return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
           (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B820 && c <= 0x2CEAF) ||
           (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

/* Appends cp to a growable array of code points. */
static bool push(uint32_t **a, size_t *n, size_t *cap, uint32_t cp) {
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 64;
        uint32_t *b = realloc(*a, c * sizeof *b);
        if (!b) return false;
        *a = b;
        *cap = c;
    }
    (*a)[(*n)++] = cp;
    return true;
}

/* One word (code points w[0, n)) as pieces; false if out of memory. */
static bool word_pieces(const struct tok_tokenizer *t, const uint32_t *w, size_t n, tok_scratch *s, tok_out *o) {
    int32_t unk = t->v->unk;
    if (n > WPM_MAX_WORD) {
        if (unk >= 0) tok_out_push(o, unk);
        return true;
    }
    /* the word as UTF-8 after a U+2581, with each character's byte offset */
    if (!tok_scratch_buf(s, 3 + 4 * n + 1)) return false;
    uint32_t off[WPM_MAX_WORD + 1];
    char *b = s->buf;
    memcpy(b, "\xE2\x96\x81", 3);
    size_t len = 3;
    for (size_t i = 0; i < n; i++) {
        off[i] = (uint32_t)len;
        len += (size_t)util_utf8_encode(w[i], b + len);
    }
    off[n] = (uint32_t)len;
    int64_t mark = o->n;
    for (size_t start = 0; start < n;) {
        int32_t id = -1;
        size_t end = n;
        for (; end > start; end--) {
            /* a word's first piece carries the U+2581; a continuation is bare */
            size_t from = start ? off[start] : 0, bytes = off[end] - from;
            if (bytes > t->max_len) continue;
            if ((id = tok_strmap_get(&t->map, b + from, bytes)) >= 0) break;
        }
        if (id < 0) { /* no piece fits: the whole word is unknown */
            o->n = mark;
            if (unk >= 0) tok_out_push(o, unk);
            return true;
        }
        tok_out_push(o, id);
        start = end;
    }
    return true;
}

int tok_wpm_encode(const struct tok_tokenizer *t, const char *text, size_t len, tok_scratch *s, tok_out *o,
                   kvlm_error *err) {
    uint32_t *cps = NULL, *norm = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    /* clean the text (invalid UTF-8 is U+FFFD, which is dropped) and split CJK apart */
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        int k = util_utf8_decode((const uint8_t *)text + i, len - i, &cp);
        if (k <= 0) { cp = 0xFFFD; k = 1; }
        i += (size_t)k;
        if (cp == 0 || cp == 0xFFFD || is_control(cp)) continue;
        bool ok = is_ws(cp) ? push(&cps, &n, &cap, ' ')
                  : is_cjk(cp) ? push(&cps, &n, &cap, ' ') && push(&cps, &n, &cap, cp) && push(&cps, &n, &cap, ' ')
                               : push(&cps, &n, &cap, cp);
        if (!ok) goto nomem;
    }
    const uint32_t *u = cps;
    size_t nu = n;
    if (n && t->v->wpm_strip_accents) { /* NFD, then the combining marks dropped */
        size_t nn = 0;
        if (!(norm = u32_normalize(UNINORM_NFD, cps, n, NULL, &nn))) goto nomem;
        size_t k = 0;
        for (size_t i = 0; i < nn; i++)
            if (!uc_is_general_category(norm[i], UC_CATEGORY_Mn)) norm[k++] = norm[i];
        free(cps);
        cps = norm;
        norm = NULL;
        u = cps;
        nu = k;
    }
    if (nu && t->v->wpm_lower) {
        /* each character's full lowercase mapping (one may become two: U+0130), with no
         * context (a final sigma stays sigma), as the fast tokenizer's char::to_lowercase */
        uint32_t *low = NULL;
        size_t nl = 0, lcap = 0;
        for (size_t i = 0; i < nu; i++) {
            if (u[i] < 0x80) {
                if (!push(&low, &nl, &lcap, u[i] >= 'A' && u[i] <= 'Z' ? u[i] + 32 : u[i])) { free(low); goto nomem; }
                continue;
            }
            uint32_t one[8];
            size_t k = sizeof one / sizeof one[0];
            uint32_t *r = u32_tolower(u + i, 1, NULL, NULL, one, &k);
            bool ok = r != NULL;
            for (size_t x = 0; ok && x < k; x++) ok = push(&low, &nl, &lcap, r[x]);
            if (r && r != one) free(r);
            if (!ok) { free(low); goto nomem; }
        }
        norm = low;
        u = norm;
        nu = nl;
    }
    /* words: runs between whitespace, each punctuation character alone */
    for (size_t i = 0; i < nu;) {
        if (is_ws(u[i])) { i++; continue; }
        size_t j = i + 1;
        if (!is_punct(u[i]))
            while (j < nu && !is_ws(u[j]) && !is_punct(u[j])) j++;
        if (!word_pieces(t, u + i, j - i, s, o)) goto nomem;
        i = j;
    }
done:
    free(cps);
    free(norm);
    return rc;
nomem:
    rc = -1;
    util_err_set(err, KVLM_ENOMEM, "tokenizer: out of memory");
    goto done;
}
