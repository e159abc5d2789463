/* tok/jinja_str: UTF-8 and Python's str semantics for the Jinja
 * interpreter: code-point indexing, Unicode classes (from PCRE2's tables),
 * case mapping (glibc's C.UTF-8), and the str operations templates use. */
#include <locale.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <wctype.h>
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include "tok/jinja_internal.h"
#include "util/utf8.h"

/* ---- UTF-8 ---- */

uint32_t u8_next(const char *p, size_t n, size_t *i) {
    const unsigned char *s = (const unsigned char *)p;
    size_t k = *i;
    uint32_t c = s[k];
    if (c < 0x80 || k + 1 >= n) { *i = k + 1; return c; }
    if (c < 0xe0) { *i = k + 2; return ((c & 0x1f) << 6) | (s[k + 1] & 0x3f); }
    if (c < 0xf0 || k + 3 > n) {
        if (k + 2 >= n) { *i = n; return 0xfffd; }
        *i = k + 3;
        return ((c & 0x0f) << 12) | ((uint32_t)(s[k + 1] & 0x3f) << 6) | (s[k + 2] & 0x3f);
    }
    if (k + 3 >= n) { *i = n; return 0xfffd; }
    *i = k + 4;
    return ((c & 0x07) << 18) | ((uint32_t)(s[k + 1] & 0x3f) << 12) | ((uint32_t)(s[k + 2] & 0x3f) << 6) |
           (s[k + 3] & 0x3f);
}

int u8_put(uint32_t c, char *o) { return util_utf8_encode(c, o); }

bool u8_valid(const char *p, size_t n, size_t *bad) {
    uint32_t cp;
    for (size_t i = 0, k; i < n; i += k)
        if (!(k = (size_t)util_utf8_decode((const uint8_t *)p + i, n - i, &cp))) { *bad = i; return false; }
    return true;
}

size_t u8_count(const char *p, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)p[i] & 0xc0) != 0x80;
    return c;
}

size_t u8_offset(const char *p, size_t n, size_t cp) {
    size_t i = 0;
    while (i < n && cp) {
        i++;
        while (i < n && ((unsigned char)p[i] & 0xc0) == 0x80) i++;
        cp--;
    }
    return i;
}

/* ---- Unicode classes: a table over the BMP built once from PCRE2's properties ---- */

enum { UP_NONPRINT = 1, UP_ALPHA = 2, UP_DECIMAL = 4, UP_NUMERIC = 8, UP_LOWER = 16, UP_UPPER = 32 };
static uint8_t g_uprop[0x10000];
static pcre2_code *g_uprop_re[6];
static pthread_once_t g_uprop_once = PTHREAD_ONCE_INIT;
static locale_t g_utf8_locale;
static const char *const k_uprop_pat[6] = {
    "[\\p{Cc}\\p{Cf}\\p{Cs}\\p{Co}\\p{Cn}\\p{Zl}\\p{Zp}\\p{Zs}]", "\\p{L}", "\\p{Nd}", "\\p{N}", "\\p{Ll}",
    "[\\p{Lu}\\p{Lt}]"};

static void uprop_init(void) {
    g_utf8_locale = newlocale(LC_CTYPE_MASK, "C.UTF-8", (locale_t)0);
    /* every BMP code point but the surrogates, in one subject, scanned once per class */
    size_t cap = 0x10000 * 3;
    char *all = malloc(cap);
    uint32_t *at = malloc(sizeof(uint32_t) * cap);
    if (!all || !at) { free(all); free(at); return; }
    size_t n = 0;
    for (uint32_t c = 0x80; c < 0x10000; c++) {
        if (c >= 0xd800 && c <= 0xdfff) continue;
        int k = u8_put(c, all + n);
        for (int j = 0; j < k; j++) at[n + (size_t)j] = c;
        n += (size_t)k;
    }
    for (int p = 0; p < 6; p++) {
        int ec;
        PCRE2_SIZE eo;
        g_uprop_re[p] = pcre2_compile((PCRE2_SPTR)k_uprop_pat[p], PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &ec,
                                      &eo, NULL);
        if (!g_uprop_re[p]) continue;
        pcre2_match_data *md = pcre2_match_data_create(1, NULL);
        if (!md) continue;
        size_t off = 0;
        while (off < n && pcre2_match(g_uprop_re[p], (PCRE2_SPTR)all, n, off, PCRE2_NO_UTF_CHECK, md, NULL) >= 0) {
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            g_uprop[at[ov[0]]] |= (uint8_t)(1u << p);
            off = ov[1] > ov[0] ? ov[1] : ov[0] + 1;
        }
        pcre2_match_data_free(md);
    }
    free(all);
    free(at);
    for (uint32_t c = 0xd800; c <= 0xdfff; c++) g_uprop[c] |= UP_NONPRINT;
}

static bool uprop(uint32_t c, int bit) {
    pthread_once(&g_uprop_once, uprop_init);
    if (c < 0x10000) return g_uprop[c] & bit;
    int p = 0;
    while ((1 << p) != bit) p++;
    if (!g_uprop_re[p]) return false;
    char b[4];
    int k = u8_put(c, b);
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md) return false;
    bool r = pcre2_match(g_uprop_re[p], (PCRE2_SPTR)b, (size_t)k, 0, PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED, md, NULL) >= 0;
    pcre2_match_data_free(md);
    return r;
}

bool py_isspace(uint32_t c) {
    if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f);
    return c == 0x85 || c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}
bool py_isprintable(uint32_t c) {
    if (c < 0x80) return c >= 0x20 && c < 0x7f;
    return !uprop(c, UP_NONPRINT);
}
bool py_isalpha(uint32_t c) {
    if (c < 0x80) return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
    return uprop(c, UP_ALPHA);
}
bool py_isdigit(uint32_t c) {
    if (c < 0x80) return c >= '0' && c <= '9';
    return uprop(c, UP_DECIMAL);
}
static bool py_isnumeric(uint32_t c) {
    if (c < 0x80) return c >= '0' && c <= '9';
    return uprop(c, UP_NUMERIC);
}
bool py_isalnum(uint32_t c) { return py_isalpha(c) || py_isnumeric(c); }
bool py_islower_c(uint32_t c) {
    if (c < 0x80) return c >= 'a' && c <= 'z';
    return uprop(c, UP_LOWER);
}
bool py_isupper_c(uint32_t c) {
    if (c < 0x80) return c >= 'A' && c <= 'Z';
    return uprop(c, UP_UPPER);
}
uint32_t py_lower(uint32_t c) {
    if (c < 0x80) return c >= 'A' && c <= 'Z' ? c + 32 : c;
    pthread_once(&g_uprop_once, uprop_init);
    return g_utf8_locale ? (uint32_t)towlower_l((wint_t)c, g_utf8_locale) : c;
}
uint32_t py_upper(uint32_t c) {
    if (c < 0x80) return c >= 'a' && c <= 'z' ? c - 32 : c;
    pthread_once(&g_uprop_once, uprop_init);
    return g_utf8_locale ? (uint32_t)towupper_l((wint_t)c, g_utf8_locale) : c;
}
static bool py_cased(uint32_t c) { return py_islower_c(c) || py_isupper_c(c) || py_lower(c) != py_upper(c); }

size_t py_wordcount(const char *p, size_t n) {
    size_t words = 0;
    bool in = false;
    for (size_t i = 0; i < n;) {
        uint32_t c = u8_next(p, n, &i);
        bool w = c == '_' || py_isalnum(c);
        if (w && !in) words++;
        in = w;
    }
    return words;
}

/* ---- str operations ---- */

static jv mk_str(jstate *st, char *p, size_t n, const jv *like) {
    jv v = jv_strn(p, n);
    if (like && like->t == JV_STR) v.fl = like->fl & JVF_MARKUP;
    (void)st;
    return v;
}

/* Case mapping of every character (Python's full mapping for ß and İ). */
static jv map_case(jstate *st, jv s, bool upper) {
    bool ascii = true;
    for (size_t i = 0; i < s.u.s.n; i++)
        if ((unsigned char)s.u.s.p[i] >= 0x80) { ascii = false; break; }
    char *o = jr_alloc(st, s.u.s.n * 3 + 1);
    size_t k = 0;
    if (ascii) {
        for (size_t i = 0; i < s.u.s.n; i++) {
            char c = s.u.s.p[i];
            o[k++] = upper ? (c >= 'a' && c <= 'z' ? (char)(c - 32) : c) : (c >= 'A' && c <= 'Z' ? (char)(c + 32) : c);
        }
        return mk_str(st, o, k, &s);
    }
    for (size_t i = 0; i < s.u.s.n;) {
        uint32_t c = u8_next(s.u.s.p, s.u.s.n, &i);
        if (upper && c == 0xdf) { o[k++] = 'S'; o[k++] = 'S'; continue; }
        if (!upper && c == 0x130) { o[k++] = 'i'; k += (size_t)u8_put(0x307, o + k); continue; }
        k += (size_t)u8_put(upper ? py_upper(c) : py_lower(c), o + k);
    }
    return mk_str(st, o, k, &s);
}
jv py_str_lower(jstate *st, jv s) { return map_case(st, s, false); }
jv py_str_upper(jstate *st, jv s) { return map_case(st, s, true); }

static bool in_chars(uint32_t c, const jv *chars) {
    if (!chars) return py_isspace(c);
    for (size_t i = 0; i < chars->u.s.n;)
        if (u8_next(chars->u.s.p, chars->u.s.n, &i) == c) return true;
    return false;
}

jv py_str_strip(jstate *st, jv s, const jv *chars, int which) {
    (void)st;
    const char *p = s.u.s.p;
    size_t a = 0, b = s.u.s.n;
    if (which & 1)
        while (a < b) {
            size_t j = a;
            if (!in_chars(u8_next(p, b, &j), chars)) break;
            a = j;
        }
    if (which & 2)
        while (b > a) {
            size_t j = b - 1;
            while (j > a && ((unsigned char)p[j] & 0xc0) == 0x80) j--;
            size_t k = j;
            if (!in_chars(u8_next(p, b, &k), chars)) break;
            b = j;
        }
    jv r = jv_strn(p + a, b - a);
    r.fl = s.fl & JVF_MARKUP;
    return r;
}

static const char *find_bytes(const char *h, size_t hn, const char *nd, size_t nn) {
    if (!nn) return h;
    if (nn > hn) return NULL;
    return memmem(h, hn, nd, nn);
}

jv py_str_replace(jstate *st, jv s, jv old, jv nw, int64_t count) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, on = old.u.s.n, nn = nw.u.s.n;
    if (count < 0) count = INT64_MAX;
    jbuf b = {0};
    if (!on) { /* Python inserts new before every character and at the end */
        size_t i = 0;
        int64_t done = 0;
        while (done < count && i <= n) {
            jb_put(st, &b, nw.u.s.p, nn);
            done++;
            if (i == n) { i++; break; }
            size_t j = i;
            u8_next(p, n, &j);
            jb_put(st, &b, p + i, j - i);
            i = j;
        }
        if (i <= n) jb_put(st, &b, p + i, n - i);
        return mk_str(st, b.p ? b.p : (char *)"", b.n, &s);
    }
    size_t i = 0;
    int64_t done = 0;
    while (done < count) {
        const char *f = find_bytes(p + i, n - i, old.u.s.p, on);
        if (!f) break;
        size_t at = (size_t)(f - p);
        jb_put(st, &b, p + i, at - i);
        jb_put(st, &b, nw.u.s.p, nn);
        i = at + on;
        done++;
    }
    if (!done) return s;
    jb_put(st, &b, p + i, n - i);
    return mk_str(st, b.p, b.n, &s);
}

jlist *py_str_split(jstate *st, jv s, const jv *sep, int64_t maxsplit, bool right, int line) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n;
    jlist *l = jl_new(st, 4);
    if (maxsplit < 0) maxsplit = INT64_MAX;
    if (sep && !sep->u.s.n) jr_fail(st, line, "empty separator");
    if (!right) {
        if (!sep) {
            size_t i = 0;
            int64_t splits = 0;
            for (;;) {
                while (i < n) { size_t j = i; if (!py_isspace(u8_next(p, n, &j))) break; i = j; }
                if (i >= n) break;
                if (splits >= maxsplit) { /* the rest, its trailing space kept */
                    jl_push(st, l, mk_str(st, (char *)p + i, n - i, &s));
                    break;
                }
                size_t a = i;
                while (i < n) { size_t j = i; if (py_isspace(u8_next(p, n, &j))) break; i = j; }
                jl_push(st, l, mk_str(st, (char *)p + a, i - a, &s));
                splits++;
            }
            return l;
        }
        size_t i = 0;
        int64_t splits = 0;
        while (splits < maxsplit) {
            const char *f = find_bytes(p + i, n - i, sep->u.s.p, sep->u.s.n);
            if (!f) break;
            size_t at = (size_t)(f - p);
            jl_push(st, l, mk_str(st, (char *)p + i, at - i, &s));
            i = at + sep->u.s.n;
            splits++;
        }
        jl_push(st, l, mk_str(st, (char *)p + i, n - i, &s));
        return l;
    }
    /* rsplit: pieces found from the right, returned left to right */
    jlist *rev = jl_new(st, 4);
    if (!sep) {
        size_t i = n;
        int64_t splits = 0;
        for (;;) {
            while (i > 0) {
                size_t j = i - 1;
                while (j > 0 && ((unsigned char)p[j] & 0xc0) == 0x80) j--;
                size_t k = j;
                if (!py_isspace(u8_next(p, n, &k))) break;
                i = j;
            }
            if (!i) break;
            if (splits >= maxsplit) { jl_push(st, rev, mk_str(st, (char *)p, i, &s)); break; }
            size_t b = i;
            while (i > 0) {
                size_t j = i - 1;
                while (j > 0 && ((unsigned char)p[j] & 0xc0) == 0x80) j--;
                size_t k = j;
                if (py_isspace(u8_next(p, n, &k))) break;
                i = j;
            }
            jl_push(st, rev, mk_str(st, (char *)p + i, b - i, &s));
            splits++;
        }
    } else {
        size_t end = n, sn = sep->u.s.n;
        int64_t splits = 0;
        while (splits < maxsplit && end >= sn) {
            size_t at = SIZE_MAX;
            for (size_t j = end - sn + 1; j-- > 0;)
                if (!memcmp(p + j, sep->u.s.p, sn)) { at = j; break; }
            if (at == SIZE_MAX) break;
            jl_push(st, rev, mk_str(st, (char *)p + at + sn, end - at - sn, &s));
            end = at;
            splits++;
        }
        jl_push(st, rev, mk_str(st, (char *)p, end, &s));
    }
    for (size_t i = rev->n; i-- > 0;) jl_push(st, l, rev->v[i]);
    return l;
}

jv py_str_slice(jstate *st, jv s, int64_t start, int64_t stop, int64_t step) {
    /* indices already adjusted to the string's code points (Python's slice rules) */
    const char *p = s.u.s.p;
    size_t n = s.u.s.n;
    bool ascii = true;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)p[i] >= 0x80) { ascii = false; break; }
    if (step == 1) {
        if (stop <= start) return jv_strn("", 0);
        size_t a = ascii ? (size_t)start : u8_offset(p, n, (size_t)start);
        size_t b = ascii ? (size_t)stop : a + u8_offset(p + a, n - a, (size_t)(stop - start));
        jv r = jv_strn(p + a, b - a);
        r.fl = s.fl & JVF_MARKUP;
        return r;
    }
    /* offsets of every code point, then pick */
    size_t ncp = ascii ? n : u8_count(p, n);
    size_t *off = jr_alloc(st, (ncp + 1) * sizeof *off);
    for (size_t i = 0, c = 0; c <= ncp; c++) {
        off[c] = i;
        if (i < n) { size_t j = i; u8_next(p, n, &j); i = j; }
    }
    char *o = jr_alloc(st, n + 1);
    size_t k = 0;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        size_t a = off[i], b = off[i + 1];
        memcpy(o + k, p + a, b - a);
        k += b - a;
        if ((step > 0 && i > INT64_MAX - step) || (step < 0 && i < INT64_MIN - step)) break;
    }
    return mk_str(st, o, k, &s);
}

jv py_escape(jstate *st, jv s) {
    if (s.fl & JVF_MARKUP) return s;
    jbuf b = {0};
    size_t last = 0;
    for (size_t i = 0; i < s.u.s.n; i++) {
        const char *r = NULL;
        switch (s.u.s.p[i]) {
        case '&': r = "&amp;"; break;
        case '<': r = "&lt;"; break;
        case '>': r = "&gt;"; break;
        case '"': r = "&#34;"; break;
        case '\'': r = "&#39;"; break;
        default: continue;
        }
        jb_put(st, &b, s.u.s.p + last, i - last);
        jb_puts(st, &b, r);
        last = i + 1;
    }
    jv v;
    if (!b.p) v = s;
    else {
        jb_put(st, &b, s.u.s.p + last, s.u.s.n - last);
        v = jv_strn(b.p, b.n);
    }
    v.fl = JVF_MARKUP;
    return v;
}

/* str.title(): a cased character after a cased one is lowered, others uppered */
jv py_str_title(jstate *st, jv s) {
    char *o = jr_alloc(st, s.u.s.n * 3 + 1);
    size_t k = 0;
    bool prev_cased = false;
    for (size_t i = 0; i < s.u.s.n;) {
        uint32_t c = u8_next(s.u.s.p, s.u.s.n, &i);
        uint32_t m = prev_cased ? py_lower(c) : py_upper(c);
        if (!prev_cased && c == 0xdf) { o[k++] = 'S'; o[k++] = 's'; prev_cased = true; continue; }
        k += (size_t)u8_put(m, o + k);
        prev_cased = py_cased(c);
    }
    return mk_str(st, o, k, &s);
}

/* str.capitalize(): the first character upper (title), the rest lower */
jv py_str_capitalize(jstate *st, jv s) {
    char *o = jr_alloc(st, s.u.s.n * 3 + 1);
    size_t k = 0;
    for (size_t i = 0, c0 = 1; i < s.u.s.n; c0 = 0) {
        uint32_t c = u8_next(s.u.s.p, s.u.s.n, &i);
        if (c0 && c == 0xdf) { o[k++] = 'S'; o[k++] = 's'; continue; }
        if (!c0 && c == 0x130) { o[k++] = 'i'; k += (size_t)u8_put(0x307, o + k); continue; }
        k += (size_t)u8_put(c0 ? py_upper(c) : py_lower(c), o + k);
    }
    return mk_str(st, o, k, &s);
}

bool py_str_cased_test(jv s, bool upper) { /* islower() / isupper() */
    bool any = false;
    for (size_t i = 0; i < s.u.s.n;) {
        uint32_t c = u8_next(s.u.s.p, s.u.s.n, &i);
        if (upper ? py_islower_c(c) : py_isupper_c(c)) return false;
        if (upper ? py_isupper_c(c) : py_islower_c(c)) any = true;
    }
    return any;
}

bool py_str_class_test(jv s, int which) { /* 0 isdigit 1 isalpha 2 isalnum 3 isspace 4 isnumeric 5 isdecimal */
    if (!s.u.s.n) return false;
    for (size_t i = 0; i < s.u.s.n;) {
        uint32_t c = u8_next(s.u.s.p, s.u.s.n, &i);
        bool ok = which == 0 ? py_isdigit(c) : which == 1 ? py_isalpha(c) : which == 2 ? py_isalnum(c)
                : which == 3 ? py_isspace(c) : which == 4 ? py_isnumeric(c) : py_isdigit(c);
        if (!ok) return false;
    }
    return true;
}

/* str.splitlines() boundaries */
size_t py_linebreak(const char *p, size_t n, size_t i) {
    unsigned char c = (unsigned char)p[i];
    if (c == '\r') return i + 1 < n && p[i + 1] == '\n' ? 2 : 1;
    if (c == '\n' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e) return 1;
    if (c >= 0x80) {
        size_t j = i;
        uint32_t cp = u8_next(p, n, &j);
        if (cp == 0x85 || cp == 0x2028 || cp == 0x2029) return j - i;
    }
    return 0;
}
