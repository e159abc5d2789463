/* engine/json_mask: the JSON recognizer and the token mask (json_mask.h). */
#include "engine/json_mask.h"
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "model/model.h"

enum {
    L_START,     /* whitespace, then the top-level '{' */
    L_VALUE,     /* a value (after ':' or ',' in an array) */
    L_ARR_FIRST, /* after '[': a value or ']' */
    L_OBJ_FIRST, /* after '{': a key or '}' */
    L_OBJ_KEY,   /* after ',' in an object: a key */
    L_COLON,     /* after a key */
    L_AFTER,     /* after a value: ',' or the container's end */
    L_STRING,    /* inside a string */
    L_ESCAPE,    /* after a backslash */
    L_HEX,       /* in \uXXXX: sub hex digits left */
    L_NUMBER,    /* in a number: sub is its part */
    L_LITERAL,   /* in true, false or null: sub bytes matched */
    L_DONE       /* the object is closed */
};
/* number parts: after '-', after a leading 0, in the integer digits, after
 * '.', in the fraction, after 'e', after its sign, in the exponent */
enum { N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP };

void jm_init(jm_state *s) {
    memset(s, 0, sizeof *s);
    s->lex = L_START;
}

bool jm_done(const jm_state *s) { return s->lex == L_DONE; }

static bool space(int c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* A blank between tokens: a newline (\r\n counts as one) and 20 spaces or tabs at most in a row. */
static bool blank(jm_state *s, int c) {
    if (c == '\n' || c == '\r') {
        if (c == '\n' && s->cr) { s->cr = 0; return true; } /* the \n of \r\n */
        if (s->nl++) return false;
        s->cr = c == '\r';
        return true;
    }
    s->cr = 0;
    return ++s->ws <= 20;
}
static bool digit(int c) { return c >= '0' && c <= '9'; }
static bool hex(int c) { return digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

/* A value ended: what may follow it. */
static void value_end(jm_state *s) { s->lex = s->depth ? L_AFTER : L_DONE; }

static bool push(jm_state *s, int c) {
    if (s->depth == JM_DEPTH) return false;
    s->stack[s->depth++] = (uint8_t)c;
    s->lex = c == '{' ? L_OBJ_FIRST : L_ARR_FIRST;
    return true;
}

static bool pop(jm_state *s, int c) {
    if (!s->depth || s->stack[s->depth - 1] != (c == '}' ? '{' : '[')) return false;
    s->depth--;
    value_end(s);
    return true;
}

/* The first byte of a value. */
static bool value_start(jm_state *s, int c) {
    if (c == '{' || c == '[') return push(s, c);
    if (c == '"') {
        s->lex = L_STRING;
        s->key = 0;
        return true;
    }
    if (c == '-' || digit(c)) {
        s->lex = L_NUMBER;
        s->sub = c == '-' ? N_MINUS : c == '0' ? N_ZERO : N_INT;
        return true;
    }
    static const char *const lits[] = {"true", "false", "null"};
    for (int i = 0; i < 3; i++)
        if (c == lits[i][0]) {
            s->lex = L_LITERAL;
            s->lit = lits[i];
            s->sub = 1;
            return true;
        }
    return false;
}

/* UTF-8 inside a string: a lead byte sets the continuation bytes due and the
 * first one's range (no overlong forms, no surrogates, nothing past U+10FFFF). */
static bool string_byte(jm_state *s, int c) {
    if (s->need) {
        if (c < s->lo || c > s->hi) return false;
        s->need--;
        s->lo = 0x80;
        s->hi = 0xbf;
        return true;
    }
    if (c == '"') {
        if (s->key) s->lex = L_COLON;
        else value_end(s);
        return true;
    }
    if (c == '\\') {
        s->lex = L_ESCAPE;
        return true;
    }
    if (c < 0x20) return false; /* control characters must be escaped */
    if (c < 0x80) return true;
    s->lo = 0x80;
    s->hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) s->need = 1;
    else if (c >= 0xe0 && c <= 0xef) {
        s->need = 2;
        if (c == 0xe0) s->lo = 0xa0;
        if (c == 0xed) s->hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        s->need = 3;
        if (c == 0xf0) s->lo = 0x90;
        if (c == 0xf4) s->hi = 0x8f;
    } else return false;
    return true;
}

static bool number_byte(jm_state *s, int c) {
    switch (s->sub) {
    case N_MINUS:
        if (!digit(c)) return false;
        s->sub = c == '0' ? N_ZERO : N_INT;
        return true;
    case N_ZERO:
    case N_INT:
        if (digit(c) && s->sub == N_INT) return true;
        if (c == '.') { s->sub = N_DOT; return true; }
        if (c == 'e' || c == 'E') { s->sub = N_E; return true; }
        break;
    case N_DOT:
    case N_FRAC:
        if (digit(c)) { s->sub = N_FRAC; return true; }
        if (s->sub == N_DOT) return false;
        if (c == 'e' || c == 'E') { s->sub = N_E; return true; }
        break;
    case N_E:
        if (c == '+' || c == '-') { s->sub = N_ESIGN; return true; }
        if (digit(c)) { s->sub = N_EXP; return true; }
        return false;
    case N_ESIGN:
        if (!digit(c)) return false;
        s->sub = N_EXP;
        return true;
    default: /* N_EXP */
        if (digit(c)) return true;
        break;
    }
    /* the number ended before c, at a part where it may: c follows the value */
    value_end(s);
    return true;
}

static bool feed_byte(jm_state *s, int c) {
    if (s->lex < L_STRING || s->lex == L_DONE) {
        if (space(c)) return s->lex != L_DONE && blank(s, c);
        s->ws = s->nl = s->cr = 0;
    }
    switch (s->lex) {
    case L_START:
        return c == '{' && push(s, c);
    case L_VALUE:
        return value_start(s, c);
    case L_ARR_FIRST:
        if (c == ']') return pop(s, c);
        return value_start(s, c);
    case L_OBJ_FIRST:
    case L_OBJ_KEY:
        if (c == '}' && s->lex == L_OBJ_FIRST) return pop(s, c);
        if (c != '"') return false;
        s->lex = L_STRING;
        s->key = 1;
        return true;
    case L_COLON:
        if (c != ':') return false;
        s->lex = L_VALUE;
        return true;
    case L_AFTER:
        if (c == ',') {
            s->lex = s->stack[s->depth - 1] == '{' ? L_OBJ_KEY : L_VALUE;
            return true;
        }
        return (c == '}' || c == ']') && pop(s, c);
    case L_STRING:
        return string_byte(s, c);
    case L_ESCAPE:
        if (c == 'u') {
            s->lex = L_HEX;
            s->sub = 4;
            return true;
        }
        if (!strchr("\"\\/bfnrt", c) || !c) return false;
        s->lex = L_STRING;
        return true;
    case L_HEX:
        if (!hex(c)) return false;
        if (--s->sub == 0) s->lex = L_STRING;
        return true;
    case L_NUMBER: {
        uint8_t before = s->lex;
        if (!number_byte(s, c)) return false;
        return s->lex == before ? true : feed_byte(s, c); /* ended: c is the next thing */
    }
    case L_LITERAL:
        if (c != s->lit[s->sub]) return false;
        if (!s->lit[++s->sub]) value_end(s);
        return true;
    default: /* L_DONE */
        return false;
    }
}

bool jm_feed(jm_state *s, const char *bytes, int n) {
    for (int i = 0; i < n; i++)
        if (!feed_byte(s, (unsigned char)bytes[i])) return false;
    return true;
}

/* ---- the vocabulary ---- */

struct json_vocab {
    int n;
    uint32_t *off;  /* token t's bytes: text[off[t], off[t + 1]) */
    char *text;
    bool *eog;
    bool *plain;    /* bytes a string may hold as they are, whole characters: no '"', '\\', control byte or cut UTF-8 */
};

/* Whether bytes [p, p + n) can stand inside a string as they are and leave it
 * where it was (between characters). */
static bool plain_bytes(const char *p, int n) {
    jm_state s;
    jm_init(&s);
    s.lex = L_STRING;
    for (int i = 0; i < n; i++)
        if (p[i] == '"' || p[i] == '\\' || !string_byte(&s, (unsigned char)p[i])) return false;
    return s.need == 0;
}

static pthread_mutex_t g_build = PTHREAD_MUTEX_INITIALIZER;

const json_vocab *jm_vocab(const kvlm_model *cm) {
    kvlm_model *m = (kvlm_model *)cm; /* the table is kept with the model, built once */
    pthread_mutex_lock(&g_build);
    if (!m->json_vocab) {
        int n = kvlm_vocab_size(cm);
        json_vocab *v = calloc(1, sizeof *v);
        size_t cap = (size_t)n * 8 + 64, len = 0;
        if (v) {
            v->n = n;
            v->off = malloc(((size_t)n + 1) * sizeof *v->off);
            v->text = malloc(cap);
            v->eog = malloc((size_t)n * sizeof *v->eog);
            v->plain = malloc((size_t)n * sizeof *v->plain);
        }
        bool ok = v && v->off && v->text && v->eog && v->plain;
        for (int t = 0; ok && t < n; t++) {
            char buf[256];
            int k = kvlm_token_to_text(cm, t, buf, sizeof buf);
            if (k < 0) k = 0;
            if (len + (size_t)k > cap) {
                char *p = realloc(v->text, cap = 2 * (len + (size_t)k));
                if (!p) { ok = false; break; }
                v->text = p;
            }
            v->off[t] = (uint32_t)len;
            memcpy(v->text + len, buf, (size_t)k);
            len += (size_t)k;
            v->eog[t] = kvlm_token_is_eog(cm, t);
            v->plain[t] = k > 0 && plain_bytes(buf, k);
        }
        if (ok) {
            v->off[n] = (uint32_t)len;
            m->json_vocab = v;
        } else jm_vocab_free(v);
    }
    pthread_mutex_unlock(&g_build);
    return m->json_vocab;
}

void jm_vocab_free(json_vocab *v) {
    if (!v) return;
    free(v->off);
    free(v->text);
    free(v->eog);
    free(v->plain);
    free(v);
}

bool jm_feed_token(const json_vocab *v, jm_state *s, int32_t t) {
    if (t < 0 || t >= v->n) return false;
    if (v->eog[t]) return jm_done(s);
    int k = (int)(v->off[t + 1] - v->off[t]);
    return k > 0 && jm_feed(s, v->text + v->off[t], k);
}

int jm_allowed(const json_vocab *v, const jm_state *s, bool *allowed) {
    /* Two shortcuts, each exact: a token whose first byte the state refuses
     * is refused; between a string's characters, a plain token is taken.
     * Every other token is fed to a copy of the state. */
    bool first[256], in_string = s->lex == L_STRING && !s->need, done = jm_done(s);
    for (int b = 0; b < 256; b++) {
        jm_state x = *s;
        first[b] = feed_byte(&x, b);
    }
    int n = 0;
    for (int t = 0; t < v->n; t++) {
        uint32_t o = v->off[t], k = v->off[t + 1] - o;
        bool ok;
        if (v->eog[t]) ok = done;
        else if (!k || !first[(unsigned char)v->text[o]]) ok = false;
        else if (k == 1 || (in_string && v->plain[t])) ok = true;
        else {
            jm_state x = *s;
            ok = jm_feed(&x, v->text + o, (int)k);
        }
        allowed[t] = ok;
        n += ok;
    }
    return n;
}
