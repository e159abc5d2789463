/* tok/jinja_value: the interpreter's values as Python sees them: truth,
 * equality and order, str() and repr(), json.dumps (transformers' tojson),
 * iteration, and the JSON variables turned into values. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tok/jinja_internal.h"

const jv jv_undef = {.t = JV_UNDEF};
const jv jv_none = {.t = JV_NONE};

jv jv_undef_named(const char *p, size_t n) {
    jv v = {.t = JV_UNDEF};
    v.u.s.p = p;
    v.u.s.n = n;
    return v;
}

jv jv_str_dup(jstate *st, const char *p, size_t n) {
    char *s = jr_alloc(st, n + 1);
    memcpy(s, p, n);
    s[n] = 0;
    return jv_strn(s, n);
}

jv jv_cstr(const char *s) { return jv_strn(s, strlen(s)); }

/* Lists and dicts always have room for one (never a NULL array: memcpy and
 * pointer arithmetic on an empty one stay defined). */
jlist *jl_new(jstate *st, size_t cap) {
    jlist *l = jr_alloc(st, sizeof *l);
    memset(l, 0, sizeof *l);
    if (!cap) cap = 1;
    if (cap > st->max_output) jr_fail(st, 0, "a list of %zu items is past the size limit", cap);
    l->v = jr_alloc(st, cap * sizeof *l->v);
    l->cap = cap;
    return l;
}

void jl_push(jstate *st, jlist *l, jv v) {
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 4;
        jv *nv = ja_grow(&st->arena, l->v, l->cap * sizeof *nv, nc * sizeof *nv);
        if (!nv) jr_oom(st);
        l->v = nv;
        l->cap = nc;
    }
    l->v[l->n++] = v;
}

jv jv_list(jlist *l) { jv v = {.t = JV_LIST}; v.u.l = l; return v; }
jv jv_tuple(jlist *l) { jv v = {.t = JV_TUPLE}; v.u.l = l; return v; }
jv jv_dict(jdict *d) { jv v = {.t = JV_DICT}; v.u.d = d; return v; }

jdict *jd_new(jstate *st, size_t cap) {
    jdict *d = jr_alloc(st, sizeof *d);
    memset(d, 0, sizeof *d);
    if (!cap) cap = 1;
    d->k = jr_alloc(st, cap * sizeof *d->k);
    d->v = jr_alloc(st, cap * sizeof *d->v);
    d->cap = cap;
    return d;
}

jv *jd_get_str(const jdict *d, const char *k, size_t n) {
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].t == JV_STR && d->k[i].u.s.n == n && !memcmp(d->k[i].u.s.p, k, n)) return &d->v[i];
    return NULL;
}

jv *jd_get(jstate *st, const jdict *d, jv k) {
    if (k.t == JV_STR) return jd_get_str(d, k.u.s.p, k.u.s.n);
    for (size_t i = 0; i < d->n; i++)
        if (jv_eq(st, &d->k[i], &k, 0)) return &d->v[i];
    return NULL;
}

void jd_set(jstate *st, jdict *d, jv k, jv v) {
    jv *old = jd_get(st, d, k);
    if (old) { *old = v; return; }
    if (d->n == d->cap) {
        size_t nc = d->cap ? d->cap * 2 : 4;
        jv *nk = ja_grow(&st->arena, d->k, d->cap * sizeof *nk, nc * sizeof *nk);
        jv *nv = nk ? ja_grow(&st->arena, d->v, d->cap * sizeof *nv, nc * sizeof *nv) : NULL;
        if (!nk || !nv) jr_oom(st);
        d->k = nk;
        d->v = nv;
        d->cap = nc;
    }
    d->k[d->n] = k;
    d->v[d->n] = v;
    d->n++;
}

jv jv_from_json(jstate *st, const json_t *j, int depth) {
    if (depth > JINJA_MAX_VALUE_NEST) jr_fail(st, 0, "the variables nest deeper than %d levels", JINJA_MAX_VALUE_NEST);
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        jdict *d = jd_new(st, json_object_size(j));
        for (void *it = json_object_iter((json_t *)j); it; it = json_object_iter_next((json_t *)j, it)) {
            d->k[d->n] = jv_strn(json_object_iter_key(it), json_object_iter_key_len(it));
            d->v[d->n] = jv_from_json(st, json_object_iter_value(it), depth + 1);
            d->n++;
        }
        return jv_dict(d);
    }
    case JSON_ARRAY: {
        size_t n = json_array_size(j);
        jlist *l = jl_new(st, n);
        for (size_t i = 0; i < n; i++) l->v[i] = jv_from_json(st, json_array_get(j, i), depth + 1);
        l->n = n;
        return jv_list(l);
    }
    case JSON_STRING: return jv_strn(json_string_value(j), json_string_length(j));
    case JSON_INTEGER: return jv_int((int64_t)json_integer_value(j));
    case JSON_REAL: return jv_float(json_real_value(j));
    case JSON_TRUE: return jv_bool(true);
    case JSON_FALSE: return jv_bool(false);
    default: return jv_none;
    }
}

int64_t jv_range_len(const jrange *r) {
    if (r->step > 0 && r->start < r->stop)
        return (int64_t)(((uint64_t)r->stop - (uint64_t)r->start - 1) / (uint64_t)r->step + 1);
    if (r->step < 0 && r->start > r->stop)
        return (int64_t)(((uint64_t)r->start - (uint64_t)r->stop - 1) / ((uint64_t)0 - (uint64_t)r->step) + 1);
    return 0;
}

bool jv_truthy(const jv *v) {
    switch (v->t) {
    case JV_UNDEF: case JV_NONE: case JV_MISSING: return false;
    case JV_BOOL: return v->u.b;
    case JV_INT: return v->u.i != 0;
    case JV_FLOAT: return v->u.f != 0;
    case JV_STR: return v->u.s.n != 0;
    case JV_LIST: case JV_TUPLE: return (v->fl & JVF_GEN) || v->u.l->n > v->u.l->pos;
    case JV_DICT: return v->u.d->n != 0;
    case JV_RANGE: return jv_range_len(v->u.r) != 0;
    default: return true;
    }
}

const char *jv_type_name(const jv *v) {
    switch (v->t) {
    case JV_UNDEF: return "Undefined";
    case JV_NONE: return "NoneType";
    case JV_BOOL: return "bool";
    case JV_INT: return "int";
    case JV_FLOAT: return "float";
    case JV_STR: return v->fl & JVF_MARKUP ? "Markup" : "str";
    case JV_LIST:
        if (v->fl & JVF_VIEW) return v->id == 0 ? "dict_items" : v->id == 1 ? "dict_keys" : "dict_values";
        return v->fl & JVF_GEN ? "generator" : "list";
    case JV_TUPLE: return "tuple";
    case JV_DICT: return "dict";
    case JV_NS: return "Namespace";
    case JV_RANGE: return "range";
    case JV_MACRO: return "Macro";
    case JV_FUNC: return "function";
    case JV_METHOD: return "builtin_function_or_method";
    case JV_LOOP: return "LoopContext";
    case JV_CYCLER: return "Cycler";
    case JV_JOINER: return "Joiner";
    default: return "object";
    }
}

static bool is_num(const jv *v) { return v->t == JV_INT || v->t == JV_FLOAT || v->t == JV_BOOL; }
static double num_f(const jv *v) { return v->t == JV_FLOAT ? v->u.f : v->t == JV_INT ? (double)v->u.i : (double)v->u.b; }
static int64_t num_i(const jv *v) { return v->t == JV_INT ? v->u.i : v->t == JV_BOOL ? (int64_t)v->u.b : 0; }

static void check_depth(jstate *st, int depth) {
    if (depth > JINJA_MAX_VALUE_NEST) jr_fail(st, 0, "a value nests deeper than %d levels", JINJA_MAX_VALUE_NEST);
}

bool jv_eq(jstate *st, const jv *a, const jv *b, int depth) {
    check_depth(st, depth);
    if (is_num(a) && is_num(b)) {
        if (a->t != JV_FLOAT && b->t != JV_FLOAT) return num_i(a) == num_i(b);
        return num_f(a) == num_f(b);
    }
    if (a->t != b->t) return false;
    switch (a->t) {
    case JV_UNDEF: case JV_NONE: return true;
    case JV_STR: return a->u.s.n == b->u.s.n && !memcmp(a->u.s.p, b->u.s.p, a->u.s.n);
    case JV_LIST: case JV_TUPLE:
        if ((a->fl & (JVF_GEN | JVF_VIEW)) || (b->fl & (JVF_GEN | JVF_VIEW))) return a->u.l == b->u.l;
        if (a->u.l->n != b->u.l->n) return false;
        for (size_t i = 0; i < a->u.l->n; i++)
            if (!jv_eq(st, &a->u.l->v[i], &b->u.l->v[i], depth + 1)) return false;
        return true;
    case JV_DICT:
        if (a->u.d->n != b->u.d->n) return false;
        for (size_t i = 0; i < a->u.d->n; i++) {
            jv *o = jd_get(st, b->u.d, a->u.d->k[i]);
            if (!o || !jv_eq(st, &a->u.d->v[i], o, depth + 1)) return false;
        }
        return true;
    case JV_RANGE: {
        int64_t la = jv_range_len(a->u.r), lb = jv_range_len(b->u.r);
        if (la != lb) return false;
        if (!la) return true;
        return a->u.r->start == b->u.r->start && (la == 1 || a->u.r->step == b->u.r->step);
    }
    case JV_FUNC: return a->id == b->id;
    case JV_METHOD: return a->u.me == b->u.me;
    default: return a->u.l == b->u.l; /* identity */
    }
}

int jv_cmp(jstate *st, int line, const jv *a, const jv *b, int depth) {
    check_depth(st, depth);
    if (is_num(a) && is_num(b)) {
        if (a->t != JV_FLOAT && b->t != JV_FLOAT) return num_i(a) < num_i(b) ? -1 : num_i(a) > num_i(b);
        double x = num_f(a), y = num_f(b);
        return x < y ? -1 : x > y; /* NaN: neither */
    }
    if (a->t == JV_STR && b->t == JV_STR) {
        size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        int c = memcmp(a->u.s.p, b->u.s.p, n); /* UTF-8 byte order is code point order */
        if (c) return c < 0 ? -1 : 1;
        return a->u.s.n < b->u.s.n ? -1 : a->u.s.n > b->u.s.n;
    }
    if (a->t == b->t && (a->t == JV_LIST || a->t == JV_TUPLE) && !((a->fl | b->fl) & (JVF_GEN | JVF_VIEW))) {
        size_t n = a->u.l->n < b->u.l->n ? a->u.l->n : b->u.l->n;
        for (size_t i = 0; i < n; i++)
            if (!jv_eq(st, &a->u.l->v[i], &b->u.l->v[i], depth + 1))
                return jv_cmp(st, line, &a->u.l->v[i], &b->u.l->v[i], depth + 1);
        return a->u.l->n < b->u.l->n ? -1 : a->u.l->n > b->u.l->n;
    }
    jr_fail(st, line, "'<' not supported between instances of '%s' and '%s'", jv_type_name(a), jv_type_name(b));
}

bool jv_hashable(const jv *v) {
    if (v->t == JV_LIST || v->t == JV_DICT) return v->fl & (JVF_GEN | JVF_VIEW) ? true : false;
    if (v->t == JV_TUPLE) {
        for (size_t i = 0; i < v->u.l->n; i++)
            if (!jv_hashable(&v->u.l->v[i])) return false;
    }
    return v->t != JV_NS;
}

/* ---- text ---- */

void jb_put(jstate *st, jbuf *b, const char *p, size_t n) {
    if (!n) return;
    if (n > st->max_output || b->n + n > st->max_output)
        jr_fail(st, 0, "the text grew past the output limit of %zu bytes", st->max_output);
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 64;
        while (nc < b->n + n + 1) nc *= 2;
        char *np = ja_grow(&st->arena, b->p, b->cap, nc);
        if (!np) jr_oom(st);
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
    b->p[b->n] = 0;
}

void py_float_repr(double x, char *buf, size_t cap) {
    if (isnan(x)) { snprintf(buf, cap, "nan"); return; }
    if (isinf(x)) { snprintf(buf, cap, x < 0 ? "-inf" : "inf"); return; }
    if (x == 0) { snprintf(buf, cap, signbit(x) ? "-0.0" : "0.0"); return; }
    char tmp[40];
    for (int p = 1; p <= 17; p++) { /* the shortest digits that read back as x */
        snprintf(tmp, sizeof tmp, "%.*e", p - 1, x);
        if (strtod(tmp, NULL) == x) break;
    }
    /* tmp: [-]d[.ddd]e[+-]XX */
    char digits[24];
    int nd = 0, neg = tmp[0] == '-';
    const char *q = tmp + neg;
    for (; *q && *q != 'e'; q++)
        if (*q != '.') digits[nd++] = *q;
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    int e = atoi(q + 1), decpt = e + 1;
    char *o = buf;
    size_t left = cap;
#define OUT(...) do { int w_ = snprintf(o, left, __VA_ARGS__); if (w_ < 0 || (size_t)w_ >= left) return; o += w_; left -= (size_t)w_; } while (0)
    if (neg) OUT("-");
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) OUT("0.%.*s%s", -decpt, "0000", digits);
        else if (decpt >= nd) OUT("%s%.*s.0", digits, decpt - nd, "0000000000000000");
        else OUT("%.*s.%s", decpt, digits, digits + decpt);
    } else {
        OUT("%c", digits[0]);
        if (nd > 1) OUT(".%s", digits + 1);
        OUT("e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    }
#undef OUT
}

static void put_int(jstate *st, jbuf *b, int64_t i) {
    char t[32];
    int n = snprintf(t, sizeof t, "%lld", (long long)i);
    jb_put(st, b, t, (size_t)n);
}

static void repr_str(jstate *st, jbuf *b, const char *p, size_t n) {
    bool sq = memchr(p, '\'', n) != NULL, dq = memchr(p, '"', n) != NULL;
    char quote = sq && !dq ? '"' : '\'';
    jb_put(st, b, &quote, 1);
    size_t last = 0;
    for (size_t i = 0; i < n;) {
        size_t at = i;
        unsigned char c = (unsigned char)p[i];
        char esc[16];
        int en = 0;
        if (c < 0x80) {
            i++;
            if (c == (unsigned char)quote || c == '\\') en = snprintf(esc, sizeof esc, "\\%c", c);
            else if (c == '\n') en = snprintf(esc, sizeof esc, "\\n");
            else if (c == '\r') en = snprintf(esc, sizeof esc, "\\r");
            else if (c == '\t') en = snprintf(esc, sizeof esc, "\\t");
            else if (c < 0x20 || c == 0x7f) en = snprintf(esc, sizeof esc, "\\x%02x", c);
        } else {
            uint32_t cp = u8_next(p, n, &i);
            if (!py_isprintable(cp))
                en = snprintf(esc, sizeof esc, cp <= 0xff ? "\\x%02x" : cp <= 0xffff ? "\\u%04x" : "\\U%08x", cp);
        }
        if (en) {
            jb_put(st, b, p + last, at - last);
            jb_put(st, b, esc, (size_t)en);
            last = i;
        }
    }
    jb_put(st, b, p + last, n - last);
    jb_put(st, b, &quote, 1);
}

void jb_repr(jstate *st, jbuf *b, const jv *v, int depth, int line) {
    check_depth(st, depth);
    char t[64];
    switch (v->t) {
    case JV_UNDEF: case JV_MISSING: jb_puts(st, b, "Undefined"); return;
    case JV_NONE: jb_puts(st, b, "None"); return;
    case JV_BOOL: jb_puts(st, b, v->u.b ? "True" : "False"); return;
    case JV_INT: put_int(st, b, v->u.i); return;
    case JV_FLOAT: py_float_repr(v->u.f, t, sizeof t); jb_puts(st, b, t); return;
    case JV_STR:
        if (v->fl & JVF_MARKUP) jb_puts(st, b, "Markup(");
        repr_str(st, b, v->u.s.p, v->u.s.n);
        if (v->fl & JVF_MARKUP) jb_puts(st, b, ")");
        return;
    case JV_LIST: case JV_TUPLE: {
        const jlist *l = v->u.l;
        if (v->fl & JVF_GEN) { jb_puts(st, b, "<generator object>"); return; }
        if (v->fl & JVF_VIEW) { jb_puts(st, b, jv_type_name(v)); jb_puts(st, b, "("); }
        jb_puts(st, b, v->t == JV_LIST ? "[" : "(");
        for (size_t i = 0; i < l->n; i++) {
            if (i) jb_puts(st, b, ", ");
            jb_repr(st, b, &l->v[i], depth + 1, line);
        }
        if (v->t == JV_TUPLE && l->n == 1) jb_puts(st, b, ",");
        jb_puts(st, b, v->t == JV_LIST ? "]" : ")");
        if (v->fl & JVF_VIEW) jb_puts(st, b, ")");
        return;
    }
    case JV_DICT: case JV_NS: {
        const jdict *d = v->u.d;
        if (v->t == JV_NS) jb_puts(st, b, "<Namespace ");
        jb_puts(st, b, "{");
        for (size_t i = 0; i < d->n; i++) {
            if (i) jb_puts(st, b, ", ");
            jb_repr(st, b, &d->k[i], depth + 1, line);
            jb_puts(st, b, ": ");
            jb_repr(st, b, &d->v[i], depth + 1, line);
        }
        jb_puts(st, b, "}");
        if (v->t == JV_NS) jb_puts(st, b, ">");
        return;
    }
    case JV_RANGE:
        if (v->u.r->step == 1) snprintf(t, sizeof t, "range(%lld, %lld)", (long long)v->u.r->start, (long long)v->u.r->stop);
        else snprintf(t, sizeof t, "range(%lld, %lld, %lld)", (long long)v->u.r->start, (long long)v->u.r->stop,
                      (long long)v->u.r->step);
        jb_puts(st, b, t);
        return;
    case JV_MACRO:
        jb_puts(st, b, "<Macro '");
        if (v->u.m->def->k == JN_MACRO) jb_put(st, b, v->u.m->def->name, v->u.m->def->name_n);
        else jb_puts(st, b, "caller");
        jb_puts(st, b, "'>");
        return;
    case JV_LOOP:
        snprintf(t, sizeof t, "<LoopContext %zu/%zu>", v->u.lp->i + 1, v->u.lp->n);
        jb_puts(st, b, t);
        return;
    case JV_METHOD:
        jb_puts(st, b, "<built-in method ");
        jb_puts(st, b, v->u.me->name);
        jb_puts(st, b, " of ");
        jb_puts(st, b, jv_type_name(&v->u.me->self));
        jb_puts(st, b, " object>");
        return;
    default:
        jb_puts(st, b, "<");
        jb_puts(st, b, jv_type_name(v));
        jb_puts(st, b, " object>");
        return;
    }
}

void jb_str(jstate *st, jbuf *b, const jv *v, int line) {
    if (v->t == JV_STR) jb_put(st, b, v->u.s.p, v->u.s.n);
    else if (v->t == JV_UNDEF) return;
    else jb_repr(st, b, v, 0, line);
}

jv jv_to_str(jstate *st, const jv *v, int line) {
    if (v->t == JV_STR) return *v;
    if (v->t == JV_UNDEF) return jv_strn("", 0);
    jbuf b = {0};
    jb_str(st, &b, v, line);
    return jv_strn(b.p ? b.p : "", b.n);
}

/* ---- json.dumps ---- */

static void json_str(jstate *st, jbuf *b, const char *p, size_t n, bool ascii) {
    jb_puts(st, b, "\"");
    size_t last = 0;
    for (size_t i = 0; i < n;) {
        size_t at = i;
        unsigned char c = (unsigned char)p[i];
        char esc[16];
        int en = 0;
        if (c < 0x80) {
            i++;
            switch (c) {
            case '"': en = snprintf(esc, sizeof esc, "\\\""); break;
            case '\\': en = snprintf(esc, sizeof esc, "\\\\"); break;
            case '\n': en = snprintf(esc, sizeof esc, "\\n"); break;
            case '\r': en = snprintf(esc, sizeof esc, "\\r"); break;
            case '\t': en = snprintf(esc, sizeof esc, "\\t"); break;
            case '\b': en = snprintf(esc, sizeof esc, "\\b"); break;
            case '\f': en = snprintf(esc, sizeof esc, "\\f"); break;
            default:
                if (c < 0x20) en = snprintf(esc, sizeof esc, "\\u%04x", c);
            }
        } else {
            uint32_t cp = u8_next(p, n, &i);
            if (ascii) {
                if (cp >= 0x10000) {
                    uint32_t v = cp - 0x10000;
                    en = snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
                } else {
                    en = snprintf(esc, sizeof esc, "\\u%04x", cp);
                }
            }
        }
        if (en) {
            jb_put(st, b, p + last, at - last);
            jb_put(st, b, esc, (size_t)en);
            last = i;
        }
    }
    jb_put(st, b, p + last, n - last);
    jb_puts(st, b, "\"");
}

static void json_float(jstate *st, jbuf *b, double f) {
    if (isnan(f)) { jb_puts(st, b, "NaN"); return; }
    if (isinf(f)) { jb_puts(st, b, f < 0 ? "-Infinity" : "Infinity"); return; }
    char t[40];
    py_float_repr(f, t, sizeof t);
    jb_puts(st, b, t);
}

static void json_newline(jstate *st, jbuf *b, const jjson_opts *o, int level) {
    jb_puts(st, b, "\n");
    for (int i = 0; i < level; i++) jb_put(st, b, o->indent, o->indent_n);
}

/* merge sort of indices by key (stable), for sort_keys */
static void sort_idx(jstate *st, int line, const jv *keys, size_t *idx, size_t *tmp, size_t n) {
    if (n < 2) return;
    size_t h = n / 2;
    sort_idx(st, line, keys, idx, tmp, h);
    sort_idx(st, line, keys, idx + h, tmp, n - h);
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) tmp[k++] = jv_cmp(st, line, &keys[idx[j]], &keys[idx[i]], 0) < 0 ? idx[j++] : idx[i++];
    while (i < h) tmp[k++] = idx[i++];
    while (j < n) tmp[k++] = idx[j++];
    memcpy(idx, tmp, n * sizeof *idx);
}

void jb_json(jstate *st, jbuf *b, const jv *v, const jjson_opts *o, int level, int line) {
    check_depth(st, level);
    switch (v->t) {
    case JV_NONE: jb_puts(st, b, "null"); return;
    case JV_BOOL: jb_puts(st, b, v->u.b ? "true" : "false"); return;
    case JV_INT: put_int(st, b, v->u.i); return;
    case JV_FLOAT: json_float(st, b, v->u.f); return;
    case JV_STR: json_str(st, b, v->u.s.p, v->u.s.n, o->ensure_ascii); return;
    case JV_LIST: case JV_TUPLE: {
        if (v->fl & (JVF_GEN | JVF_VIEW)) break;
        const jlist *l = v->u.l;
        if (!l->n) { jb_puts(st, b, "[]"); return; }
        jb_puts(st, b, "[");
        for (size_t i = 0; i < l->n; i++) {
            if (i) jb_put(st, b, o->item_sep, o->item_sep_n);
            if (o->has_indent) json_newline(st, b, o, level + 1);
            jb_json(st, b, &l->v[i], o, level + 1, line);
        }
        if (o->has_indent) json_newline(st, b, o, level);
        jb_puts(st, b, "]");
        return;
    }
    case JV_DICT: {
        const jdict *d = v->u.d;
        if (!d->n) { jb_puts(st, b, "{}"); return; }
        size_t *idx = jr_alloc(st, d->n * 2 * sizeof *idx);
        for (size_t i = 0; i < d->n; i++) idx[i] = i;
        if (o->sort_keys) sort_idx(st, line, d->k, idx, idx + d->n, d->n);
        jb_puts(st, b, "{");
        for (size_t i = 0; i < d->n; i++) {
            const jv *k = &d->k[idx[i]];
            if (i) jb_put(st, b, o->item_sep, o->item_sep_n);
            if (o->has_indent) json_newline(st, b, o, level + 1);
            char t[40];
            switch (k->t) {
            case JV_STR: json_str(st, b, k->u.s.p, k->u.s.n, o->ensure_ascii); break;
            case JV_INT: snprintf(t, sizeof t, "\"%lld\"", (long long)k->u.i); jb_puts(st, b, t); break;
            case JV_BOOL: jb_puts(st, b, k->u.b ? "\"true\"" : "\"false\""); break;
            case JV_NONE: jb_puts(st, b, "\"null\""); break;
            case JV_FLOAT: {
                jbuf kb = {0};
                json_float(st, &kb, k->u.f);
                json_str(st, b, kb.p, kb.n, false);
                break;
            }
            default:
                jr_fail(st, line, "keys must be str, int, float, bool or None, not %s", jv_type_name(k));
            }
            jb_put(st, b, o->key_sep, o->key_sep_n);
            jb_json(st, b, &d->v[idx[i]], o, level + 1, line);
        }
        if (o->has_indent) json_newline(st, b, o, level);
        jb_puts(st, b, "}");
        return;
    }
    default: break;
    }
    jr_fail(st, line, "Object of type %s is not JSON serializable", jv_type_name(v));
}

/* ---- iteration ---- */

jlist *jv_iter(jstate *st, jv *v, int line) {
    switch (v->t) {
    case JV_LIST: case JV_TUPLE: {
        jlist *l = v->u.l;
        if (!(v->fl & JVF_GEN)) return l;
        if (l->err) jr_fail(st, line, "%s", l->err);
        jlist *r = jl_new(st, 0); /* an iterator gives its items once */
        r->v = l->v + l->pos;
        r->n = r->cap = l->n - l->pos;
        l->pos = l->n;
        return r;
    }
    case JV_DICT: {
        jlist *r = jl_new(st, v->u.d->n);
        memcpy(r->v, v->u.d->k, v->u.d->n * sizeof *r->v);
        r->n = v->u.d->n;
        return r;
    }
    case JV_STR: {
        jlist *r = jl_new(st, v->u.s.n);
        for (size_t i = 0; i < v->u.s.n;) {
            size_t a = i;
            u8_next(v->u.s.p, v->u.s.n, &i);
            jv c = jv_strn(v->u.s.p + a, i - a);
            c.fl = v->fl & JVF_MARKUP;
            r->v[r->n++] = c;
        }
        return r;
    }
    case JV_RANGE: {
        int64_t n = jv_range_len(v->u.r);
        jlist *r = jl_new(st, (size_t)n);
        for (int64_t i = 0; i < n; i++) r->v[i] = jv_int(jv_range_at(v->u.r, (uint64_t)i));
        r->n = (size_t)n;
        return r;
    }
    case JV_UNDEF: return jl_new(st, 0);
    default: jr_fail(st, line, "'%s' object is not iterable", jv_type_name(v));
    }
}

int64_t jv_len(jstate *st, const jv *v, int line) {
    switch (v->t) {
    case JV_STR: return (int64_t)u8_count(v->u.s.p, v->u.s.n);
    case JV_LIST: case JV_TUPLE:
        if (v->fl & JVF_GEN) break;
        return (int64_t)v->u.l->n;
    case JV_DICT: return (int64_t)v->u.d->n;
    case JV_RANGE: return jv_range_len(v->u.r);
    case JV_UNDEF: return 0;
    default: break;
    }
    jr_fail(st, line, "object of type '%s' has no len()", jv_type_name(v));
}
