/* tok/jinja_lex: a template's text into tokens, with Jinja2's whitespace
 * control as transformers configures it (trim_blocks, lstrip_blocks; the
 * "-" and "+" markers), comments dropped and raw blocks kept as text. */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tok/jinja_internal.h"

typedef struct lexer {
    jarena *a;
    const char *s;
    size_t n, pos;
    int line;
    jtok *t;
    size_t nt, cap;
    char *msg;
    size_t mcap;
    jmp_buf jb;
    char bal[JINJA_MAX_NEST]; /* open brackets in a tag: the closers expected */
    int nbal;
} lexer;

static _Noreturn void lfail(lexer *L, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static _Noreturn void lfail(lexer *L, int line, const char *fmt, ...) {
    int k = snprintf(L->msg, L->mcap, "line %d: ", line);
    if (k < 0 || (size_t)k >= L->mcap) k = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(L->msg + k, L->mcap - (size_t)k, fmt, ap);
    va_end(ap);
    longjmp(L->jb, 1);
}

static jtok *emit(lexer *L, int type, int line) {
    if (L->nt == L->cap) {
        size_t nc = L->cap ? L->cap * 2 : 256;
        jtok *t = ja_grow(L->a, L->t, L->cap * sizeof *t, nc * sizeof *t);
        if (!t) lfail(L, line, "template too large (out of memory)");
        L->t = t;
        L->cap = nc;
    }
    jtok *k = &L->t[L->nt++];
    memset(k, 0, sizeof *k);
    k->t = (uint8_t)type;
    k->line = line;
    return k;
}

static size_t count_nl(const char *p, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += p[i] == '\n';
    return c;
}

/* Python's \s (str.isspace) at s[i]: its length in bytes, 0 if none. */
static size_t ws_at(const char *s, size_t n, size_t i) {
    if (i >= n) return 0;
    unsigned char c = (unsigned char)s[i];
    if (c < 0x80) return py_isspace(c) ? 1 : 0;
    size_t j = i;
    uint32_t cp = u8_next(s, n, &j);
    return py_isspace(cp) ? j - i : 0;
}
static size_t skip_ws(const char *s, size_t n, size_t i) {
    size_t k;
    while ((k = ws_at(s, n, i))) i += k;
    return i;
}
/* Length of s[0..n) without its trailing whitespace (str.rstrip()). */
static size_t rstrip_len(const char *s, size_t n) {
    size_t i = 0, keep = 0;
    while (i < n) {
        size_t k = ws_at(s, n, i);
        if (k) i += k;
        else {
            size_t j = i;
            u8_next(s, n, &j);
            i = j;
            keep = i;
        }
    }
    return keep;
}
static bool all_ws(const char *s, size_t n) {
    if (!n) return false; /* \s+ needs one */
    for (size_t i = 0; i < n;) {
        size_t k = ws_at(s, n, i);
        if (!k) return false;
        i += k;
    }
    return true;
}

/* Text before a tag, stripped as Jinja2's OptionalLStrip does. */
static void emit_text(lexer *L, const char *p, size_t n, char sign, bool lstrip_ok, bool line_starting, int line) {
    if (sign == '-') n = rstrip_len(p, n);
    else if (sign != '+' && lstrip_ok) {
        size_t l = n;
        while (l > 0 && p[l - 1] != '\n') l--;
        if ((l > 0 || line_starting) && all_ws(p + l, n - l)) n = l;
    }
    if (n) {
        jtok *t = emit(L, JT_DATA, line);
        t->s = p;
        t->n = n;
    }
}

static int hexv(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A string literal's value: Python's unicode-escape decoding of the text
 * with non-ASCII characters first written as backslash escapes (what Jinja2
 * does), so "\é" keeps its backslash and reads as the text "\xe9". */
static void unescape(lexer *L, jtok *t, const char *p, size_t n) {
    char *o = ja_alloc(L->a, n * 3 + 16);
    if (!o) lfail(L, t->line, "template too large (out of memory)");
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        if (p[i] != '\\') { o[k++] = p[i++]; continue; }
        if (i + 1 >= n) { o[k++] = p[i++]; continue; }
        char c = p[i + 1];
        i += 2;
        uint32_t cp;
        int digits = 0;
        switch (c) {
        case '\n': continue;
        case '\\': o[k++] = '\\'; continue;
        case '\'': o[k++] = '\''; continue;
        case '"': o[k++] = '"'; continue;
        case 'a': o[k++] = '\a'; continue;
        case 'b': o[k++] = '\b'; continue;
        case 'f': o[k++] = '\f'; continue;
        case 'n': o[k++] = '\n'; continue;
        case 'r': o[k++] = '\r'; continue;
        case 't': o[k++] = '\t'; continue;
        case 'v': o[k++] = '\v'; continue;
        case 'x': digits = 2; break;
        case 'u': digits = 4; break;
        case 'U': digits = 8; break;
        case 'N': lfail(L, t->line, "\\N{...} escapes are not supported");
        default:
            if (c >= '0' && c <= '7') {
                cp = (uint32_t)(c - '0');
                for (int d = 0; d < 2 && i < n && p[i] >= '0' && p[i] <= '7'; d++) cp = cp * 8 + (uint32_t)(p[i++] - '0');
                k += (size_t)u8_put(cp, o + k);
                continue;
            }
            if ((unsigned char)c >= 0x80) {
                /* the character became \xNN, \uNNNN or \UNNNNNNNN before decoding: the backslash stays */
                size_t j = i - 1;
                uint32_t u = u8_next(p, n, &j);
                i = j;
                k += (size_t)sprintf(o + k, u <= 0xff ? "\\x%02x" : u <= 0xffff ? "\\u%04x" : "\\U%08x", u);
                continue;
            }
            o[k++] = '\\';
            o[k++] = c;
            continue;
        }
        cp = 0;
        for (int d = 0; d < digits; d++) {
            int h = i < n ? hexv(p[i]) : -1;
            if (h < 0) lfail(L, t->line, "truncated \\%c escape in a string", c);
            cp = cp * 16 + (uint32_t)h;
            i++;
        }
        if (cp > 0x10ffff) lfail(L, t->line, "illegal Unicode character in a string");
        if (cp >= 0xd800 && cp <= 0xdfff) lfail(L, t->line, "a lone surrogate (\\u%04x) in a string", cp);
        k += (size_t)u8_put(cp, o + k);
    }
    t->s = o;
    t->n = k;
}

static bool isdig(char c) { return c >= '0' && c <= '9'; }
/* (\d+_)*\d+ at i: the end, or i if none. */
static size_t digits_us(const char *s, size_t n, size_t i) {
    size_t j = i;
    if (j >= n || !isdig(s[j])) return i;
    for (;;) {
        while (j < n && isdig(s[j])) j++;
        if (j + 1 < n && s[j] == '_' && isdig(s[j + 1])) { j++; continue; }
        return j;
    }
}

static size_t lex_float(const char *s, size_t n, size_t i) {
    if (i > 0 && s[i - 1] == '.') return 0;
    size_t j = digits_us(s, n, i);
    if (j == i) return 0;
    size_t k = j;
    if (k < n && s[k] == '.') { /* fraction, then an optional exponent */
        size_t f = digits_us(s, n, k + 1);
        if (f > k + 1) {
            size_t e = f;
            if (e < n && (s[e] == 'e' || s[e] == 'E')) {
                size_t x = e + 1;
                if (x < n && (s[x] == '+' || s[x] == '-')) x++;
                size_t xe = digits_us(s, n, x);
                if (xe > x) return xe - i;
            }
            return f - i;
        }
    }
    if (k < n && (s[k] == 'e' || s[k] == 'E')) {
        size_t x = k + 1;
        if (x < n && (s[x] == '+' || s[x] == '-')) x++;
        size_t xe = digits_us(s, n, x);
        if (xe > x) return xe - i;
    }
    return 0;
}

static size_t lex_int(const char *s, size_t n, size_t i, int *base) {
    *base = 10;
    if (s[i] == '0' && i + 2 <= n) {
        char c = i + 1 < n ? (char)(s[i + 1] | 0x20) : 0;
        int b = c == 'b' ? 2 : c == 'o' ? 8 : c == 'x' ? 16 : 0;
        if (b) {
            size_t j = i + 2, last = 0;
            for (;;) {
                size_t q = j;
                if (q < n && s[q] == '_') q++;
                int h = q < n ? hexv(s[q]) : -1;
                if (h < 0 || h >= b) break;
                j = q + 1;
                last = j;
            }
            if (last) { *base = b; return last - i; }
        }
    }
    if (s[i] >= '1' && s[i] <= '9') {
        size_t j = i + 1;
        for (;;) {
            size_t q = j;
            if (q < n && s[q] == '_') q++;
            if (q < n && isdig(s[q])) j = q + 1;
            else break;
        }
        return j - i;
    }
    if (s[i] == '0') {
        size_t j = i + 1;
        for (;;) {
            size_t q = j;
            if (q < n && s[q] == '_') q++;
            if (q < n && s[q] == '0') j = q + 1;
            else break;
        }
        return j - i;
    }
    return 0;
}

static const struct { const char *s; uint8_t op; } k_ops[] = {
    {"//", JO_FLOORDIV}, {"**", JO_POW}, {"==", JO_EQ}, {"!=", JO_NE}, {">=", JO_GTEQ}, {"<=", JO_LTEQ},
    {"+", JO_ADD}, {"-", JO_SUB}, {"/", JO_DIV}, {"*", JO_MUL}, {"%", JO_MOD}, {"~", JO_TILDE},
    {"[", JO_LBRACKET}, {"]", JO_RBRACKET}, {"(", JO_LPAREN}, {")", JO_RPAREN}, {"{", JO_LBRACE},
    {"}", JO_RBRACE}, {">", JO_GT}, {"<", JO_LT}, {"=", JO_ASSIGN}, {".", JO_DOT}, {":", JO_COLON},
    {"|", JO_PIPE}, {",", JO_COMMA}, {";", JO_SEMICOLON},
};

/* The tokens inside {% %} (block) or {{ }} up to the closing marker. */
static void lex_tag(lexer *L, bool block, bool *line_starting) {
    const char *s = L->s;
    size_t n = L->n, i = L->pos;
    L->nbal = 0;
    for (;;) {
        if (i >= n) lfail(L, L->line, "unexpected end of template (an unclosed %s)", block ? "'{%'" : "'{{'");
        if (!L->nbal) {
            size_t end = 0;
            bool trim = false, strip = false;
            if (block) {
                if (!strncmp(s + i, "+%}", 3)) end = 3;
                else if (!strncmp(s + i, "-%}", 3)) end = 3, strip = true;
                else if (!strncmp(s + i, "%}", 2)) end = 2, trim = true;
            } else {
                if (!strncmp(s + i, "-}}", 3)) end = 3, strip = true;
                else if (!strncmp(s + i, "}}", 2)) end = 2;
            }
            if (end) {
                emit(L, block ? JT_BLOCK_END : JT_VAR_END, L->line);
                size_t j = i + end;
                if (strip) j = skip_ws(s, n, j);
                else if (trim && j < n && s[j] == '\n') j++;
                L->line += (int)count_nl(s + i, j - i);
                *line_starting = s[j - 1] == '\n';
                L->pos = j;
                return;
            }
        }
        size_t w = skip_ws(s, n, i);
        if (w > i) {
            L->line += (int)count_nl(s + i, w - i);
            i = w;
            continue;
        }
        char c = s[i];
        size_t len;
        int base;
        if (isdig(c) && (len = lex_float(s, n, i))) {
            jtok *t = emit(L, JT_FLOAT, L->line);
            char buf[128];
            size_t k = 0;
            for (size_t j = i; j < i + len && k + 1 < sizeof buf; j++)
                if (s[j] != '_') buf[k++] = s[j];
            buf[k] = 0;
            t->f = strtod(buf, NULL);
            i += len;
            continue;
        }
        if (isdig(c) && (len = lex_int(s, n, i, &base))) {
            jtok *t = emit(L, JT_INT, L->line);
            uint64_t v = 0;
            size_t j = i + (base != 10 ? 2 : 0);
            for (; j < i + len; j++) {
                if (s[j] == '_') continue;
                uint64_t d = (uint64_t)hexv(s[j]);
                if (v > (UINT64_MAX - d) / (uint64_t)base || v * (uint64_t)base + d > (uint64_t)INT64_MAX)
                    lfail(L, L->line, "integer literal too large (kvlm's integers are 64-bit)");
                v = v * (uint64_t)base + d;
            }
            t->i = (int64_t)v;
            i += len;
            continue;
        }
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') {
            size_t j = i + 1;
            while (j < n && ((s[j] >= 'a' && s[j] <= 'z') || (s[j] >= 'A' && s[j] <= 'Z') || s[j] == '_' || isdig(s[j])))
                j++;
            jtok *t = emit(L, JT_NAME, L->line);
            t->s = s + i;
            t->n = j - i;
            i = j;
            continue;
        }
        if (c == '\'' || c == '"') {
            size_t j = i + 1;
            while (j < n && s[j] != c) j += s[j] == '\\' && j + 1 < n ? 2 : 1;
            if (j >= n) lfail(L, L->line, "unexpected char %s (an unterminated string)", c == '"' ? "'\"'" : "\"'\"");
            jtok *t = emit(L, JT_STRING, L->line);
            unescape(L, t, s + i + 1, j - i - 1);
            L->line += (int)count_nl(s + i, j - i);
            i = j + 1;
            continue;
        }
        uint8_t op = 0;
        for (size_t k = 0; k < sizeof k_ops / sizeof k_ops[0]; k++) {
            size_t l = strlen(k_ops[k].s);
            if (i + l <= n && !memcmp(s + i, k_ops[k].s, l)) { op = k_ops[k].op; len = l; break; }
        }
        if (!op) {
            size_t j = i;
            uint32_t cp = u8_next(s, n, &j);
            if (cp >= 0x20 && cp < 0x7f) lfail(L, L->line, "unexpected char '%c'", (char)cp);
            lfail(L, L->line, "unexpected char U+%04X", cp);
        }
        if (op == JO_LBRACE || op == JO_LPAREN || op == JO_LBRACKET) {
            if (L->nbal >= JINJA_MAX_NEST) lfail(L, L->line, "brackets nested too deep (limit %d)", JINJA_MAX_NEST);
            L->bal[L->nbal++] = op == JO_LBRACE ? '}' : op == JO_LPAREN ? ')' : ']';
        } else if (op == JO_RBRACE || op == JO_RPAREN || op == JO_RBRACKET) {
            if (!L->nbal) lfail(L, L->line, "unexpected '%c'", c);
            char want = L->bal[--L->nbal];
            if (want != c) lfail(L, L->line, "unexpected '%c', expected '%c'", c, want);
        }
        jtok *t = emit(L, JT_OP, L->line);
        t->op = op;
        t->s = s + i;
        t->n = len;
        i += len;
    }
}

/* {%[-+]?\s*raw\s*(-%}\s*|%}) at i: the end of the match, or 0. */
static size_t raw_begin(const char *s, size_t n, size_t i) {
    size_t j = i + 2;
    if (j < n && (s[j] == '-' || s[j] == '+')) j++;
    j = skip_ws(s, n, j);
    if (j + 3 > n || memcmp(s + j, "raw", 3)) return 0;
    j = skip_ws(s, n, j + 3);
    if (j + 3 <= n && !memcmp(s + j, "-%}", 3)) return skip_ws(s, n, j + 3);
    if (j + 2 <= n && !memcmp(s + j, "%}", 2)) return j + 2;
    return 0;
}

/* {%[-+]?\s*endraw\s*(+%}|-%}\s*|%}\n?) at i: the end of the match, or 0. */
static size_t raw_end(const char *s, size_t n, size_t i) {
    size_t j = i + 2;
    if (j < n && (s[j] == '-' || s[j] == '+')) j++;
    j = skip_ws(s, n, j);
    if (j + 6 > n || memcmp(s + j, "endraw", 6)) return 0;
    j = skip_ws(s, n, j + 6);
    if (j + 3 <= n && !memcmp(s + j, "+%}", 3)) return j + 3;
    if (j + 3 <= n && !memcmp(s + j, "-%}", 3)) return skip_ws(s, n, j + 3);
    if (j + 2 <= n && !memcmp(s + j, "%}", 2)) return j + 2 + (j + 2 < n && s[j + 2] == '\n');
    return 0;
}

int jinja_lex(jarena *a, const char *src, size_t len, jtok **out, size_t *nout, char *msg, size_t cap) {
    lexer L = {.a = a, .s = src, .n = len, .line = 1, .msg = msg, .mcap = cap};
    if (setjmp(L.jb)) return -1;
    const char *s = src;
    size_t n = len;
    bool line_starting = true;
    while (L.pos < n) {
        size_t p = L.pos;
        const char *q = NULL;
        while (p + 1 < n) {
            q = memchr(s + p, '{', n - p - 1);
            if (!q) break;
            p = (size_t)(q - s);
            char c = s[p + 1];
            if (c == '{' || c == '%' || c == '#') break;
            p++;
            q = NULL;
        }
        if (!q) {
            emit_text(&L, s + L.pos, n - L.pos, 0, false, false, L.line);
            break;
        }
        char kind = s[p + 1];
        char sign = p + 2 < n && (s[p + 2] == '-' || s[p + 2] == '+') ? s[p + 2] : 0;
        size_t rb = kind == '%' ? raw_begin(s, n, p) : 0;
        emit_text(&L, s + L.pos, p - L.pos, sign, kind != '{', line_starting, L.line);
        L.line += (int)count_nl(s + L.pos, p - L.pos);
        if (rb) {
            int line0 = L.line;
            L.line += (int)count_nl(s + p, rb - p);
            bool ls = s[rb - 1] == '\n';
            size_t e = rb, end = 0;
            for (;;) {
                const char *f = e + 1 < n ? memchr(s + e, '{', n - e - 1) : NULL;
                if (!f) lfail(&L, line0, "missing end of raw directive");
                e = (size_t)(f - s);
                if (s[e + 1] == '%' && (end = raw_end(s, n, e))) break;
                e++;
            }
            char esign = e + 2 < n && (s[e + 2] == '-' || s[e + 2] == '+') ? s[e + 2] : 0;
            emit_text(&L, s + rb, e - rb, esign, true, ls, L.line);
            L.line += (int)count_nl(s + rb, end - rb);
            line_starting = s[end - 1] == '\n';
            L.pos = end;
            continue;
        }
        size_t body = p + 2 + (sign ? 1 : 0);
        if (kind == '#') {
            size_t e = body;
            const char *f = NULL;
            for (;;) {
                f = e + 1 < n ? memchr(s + e, '#', n - e - 1) : NULL;
                if (!f) lfail(&L, L.line, "missing end of comment tag");
                e = (size_t)(f - s);
                if (s[e + 1] == '}') break;
                e++;
            }
            size_t j = e + 2;
            char es = e > body && (s[e - 1] == '-' || s[e - 1] == '+') ? s[e - 1] : 0;
            if (es == '-') j = skip_ws(s, n, j);
            else if (!es && j < n && s[j] == '\n') j++;
            L.line += (int)count_nl(s + p, j - p);
            line_starting = s[j - 1] == '\n';
            L.pos = j;
            continue;
        }
        emit(&L, kind == '%' ? JT_BLOCK_BEGIN : JT_VAR_BEGIN, L.line);
        L.pos = body;
        lex_tag(&L, kind == '%', &line_starting);
    }
    emit(&L, JT_EOF, L.line);
    *out = L.t;
    *nout = L.nt;
    return 0;
}
