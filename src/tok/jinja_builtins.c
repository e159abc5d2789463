/* tok/jinja_builtins: what a template can call: Jinja2's filters and tests,
 * the sandbox's attribute rules and the Python methods it allows (none that
 * mutate), Python's operators on values, and the globals transformers gives
 * (raise_exception, strftime_now) beside Jinja2's (range, namespace, dict,
 * cycler, joiner). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tok/jinja_internal.h"

#define IS(s) (n == sizeof s - 1 && !memcmp(name, s, n))

/* ---- arguments ---- */

static bool kw_eq(const jargs *a, int i, const char *s) { return a->knl[i] == strlen(s) && !memcmp(a->kn[i], s, a->knl[i]); }

/* Positional then keyword arguments into out[0..np) by the parameter names; JV_MISSING where none. */
static void bind(jstate *st, int line, const char *what, const jargs *a, const char *const *names, int np, jv *out) {
    for (int i = 0; i < np; i++) out[i].t = JV_MISSING;
    if (a->npos > np) jr_fail(st, line, "%s takes at most %d argument(s) (%d given)", what, np, a->npos);
    for (int i = 0; i < a->npos; i++) out[i] = a->pos[i];
    for (int k = 0; k < a->nkw; k++) {
        int idx = -1;
        for (int i = 0; i < np; i++)
            if (kw_eq(a, k, names[i])) idx = i;
        if (idx < 0) jr_fail(st, line, "%s got an unexpected keyword argument '%.*s'", what, (int)a->knl[k], a->kn[k]);
        if (out[idx].t != JV_MISSING) jr_fail(st, line, "%s got multiple values for argument '%s'", what, names[idx]);
        out[idx] = a->kv[k];
    }
}
#define BIND(what, ...)                                                       \
    static const char *const names_[] = {__VA_ARGS__};                       \
    enum { NP_ = sizeof names_ / sizeof names_[0] };                          \
    jv p[NP_];                                                                \
    bind(st, line, what, a, names_, NP_, p)

static bool given(const jv *v) { return v->t != JV_MISSING; }

static int64_t as_int(jstate *st, int line, const jv *v, const char *what) {
    if (v->t == JV_INT) return v->u.i;
    if (v->t == JV_BOOL) return v->u.b;
    if (v->t == JV_UNDEF) jr_fail_undef(st, line, v);
    jr_fail(st, line, "%s: an integer is required, not '%s'", what, jv_type_name(v));
}
static const jv *as_str(jstate *st, int line, const jv *v, const char *what) {
    if (v->t == JV_STR) return v;
    if (v->t == JV_UNDEF) jr_fail_undef(st, line, v);
    jr_fail(st, line, "%s: a string is required, not '%s'", what, jv_type_name(v));
}
static jv soft_str(jstate *st, int line, const jv *v) { return jv_to_str(st, v, line); }

static jv mk_method(jstate *st, jv self, const char *name) {
    jmethod *m = jr_alloc(st, sizeof *m);
    m->self = self;
    m->name = name;
    jv v = {.t = JV_METHOD};
    v.u.me = m;
    return v;
}

static jv undef_attr(int objt, const char *name, size_t n, bool unsafe) {
    jv u = jv_undef_named(name, n);
    u.id = (uint16_t)(objt + 1);
    if (unsafe) u.fl |= JVF_UNSAFE;
    return u;
}

static jv markup_like(jv r, const jv *src) {
    if (r.t == JV_STR) r.fl = (uint8_t)((r.fl & ~JVF_MARKUP) | (src->fl & JVF_MARKUP));
    return r;
}

/* ---- attributes: the sandbox's getattr and getitem ---- */

static const char *const k_str_methods[] = {
    "capitalize", "casefold", "center", "count", "encode", "endswith", "expandtabs", "find", "format", "format_map",
    "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric",
    "isprintable", "isspace", "istitle", "isupper", "join", "ljust", "lower", "lstrip", "maketrans", "partition",
    "removeprefix", "removesuffix", "replace", "rfind", "rindex", "rjust", "rpartition", "rsplit", "rstrip", "split",
    "splitlines", "startswith", "strip", "swapcase", "title", "translate", "upper", "zfill", NULL};
static const char *const k_dict_methods[] = {"copy", "fromkeys", "get", "items", "keys", "values", NULL};
static const char *const k_dict_mutating[] = {"clear", "pop", "popitem", "setdefault", "update", NULL};
/* Jinja2's immutable sandbox refuses what mutates a list (since 3.1.5 pop and
 * clear too, as here; Debian's 3.1.2 still let those two through) */
static const char *const k_list_methods[] = {"copy", "count", "index", NULL};
static const char *const k_list_mutating[] = {"append", "clear", "extend", "insert", "pop", "remove", "reverse", "sort", NULL};
static const char *const k_tuple_methods[] = {"count", "index", NULL};

static const char *in_list(const char *const *l, const char *name, size_t n) {
    for (; *l; l++)
        if (strlen(*l) == n && !memcmp(*l, name, n)) return *l;
    return NULL;
}

/* obj.name: an attribute (the methods a value has) first, then obj[name]. */
/* the dunders every Python object has: the sandbox refuses them (an undefined) */
static const char *const k_object_dunders[] = {
    "__class__", "__doc__", "__dict__", "__module__", "__init__", "__new__", "__repr__", "__str__", "__hash__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__getattribute__", "__setattr__", "__delattr__",
    "__dir__", "__format__", "__reduce__", "__reduce_ex__", "__sizeof__", "__subclasshook__", "__init_subclass__",
    "__len__", "__iter__", "__getitem__", "__contains__", "__bool__", "__call__", "__getattr__", NULL};

jv jinja_getattr(jstate *st, int line, jv obj, const char *name, size_t n) {
    if (n >= 2 && name[0] == '_' && name[1] == '_') {
        /* a dunder: refused where the object has it; on an undefined, one it lacks is an error */
        if (obj.t != JV_UNDEF || in_list(k_object_dunders, name, n)) return undef_attr(obj.t, name, n, true);
    }
    if (obj.t == JV_UNDEF) jr_fail_undef(st, line, &obj);
    const char *m;
    switch (obj.t) {
    case JV_DICT: {
        if ((m = in_list(k_dict_methods, name, n))) return mk_method(st, obj, m);
        if (in_list(k_dict_mutating, name, n)) return undef_attr(obj.t, name, n, true);
        jv *v = jd_get_str(obj.u.d, name, n);
        return v ? *v : undef_attr(obj.t, name, n, false);
    }
    case JV_NS: {
        jv *v = jd_get_str(obj.u.d, name, n);
        return v ? *v : undef_attr(obj.t, name, n, false);
    }
    case JV_STR:
        if ((m = in_list(k_str_methods, name, n))) return mk_method(st, obj, m);
        break;
    case JV_LIST:
        if (obj.fl & (JVF_GEN | JVF_VIEW)) break;
        if ((m = in_list(k_list_methods, name, n))) return mk_method(st, obj, m);
        if (in_list(k_list_mutating, name, n)) return undef_attr(obj.t, name, n, true);
        break;
    case JV_TUPLE:
        if ((m = in_list(k_tuple_methods, name, n))) return mk_method(st, obj, m);
        break;
    case JV_LOOP: return jinja_loop_attr(st, line, obj.u.lp, name, n);
    case JV_CYCLER:
        if (IS("current")) return obj.u.cy->items.v[obj.u.cy->pos];
        if (IS("next")) return mk_method(st, obj, "next");
        if (IS("reset")) return mk_method(st, obj, "reset");
        if (IS("items")) return jv_list(&obj.u.cy->items);
        break;
    case JV_MACRO:
        if (IS("name")) {
            const jnode *d = obj.u.m->def;
            return d->k == JN_MACRO ? jv_strn(d->name, d->name_n) : jv_cstr("caller");
        }
        break;
    case JV_RANGE:
        if (IS("start")) return jv_int(obj.u.r->start);
        if (IS("stop")) return jv_int(obj.u.r->stop);
        if (IS("step")) return jv_int(obj.u.r->step);
        if (IS("count") || IS("index")) return mk_method(st, obj, IS("count") ? "count" : "index");
        break;
    default: break;
    }
    return undef_attr(obj.t, name, n, false);
}

/* obj[key]: the item first, then (for a string key) the attribute. */
jv jinja_getitem(jstate *st, int line, jv obj, jv key) {
    if (obj.t == JV_UNDEF) jr_fail_undef(st, line, &obj);
    switch (obj.t) {
    case JV_DICT: {
        if (!jv_hashable(&key)) return jv_undef; /* TypeError: Jinja2 gives undefined */
        jv *v = jd_get(st, obj.u.d, key);
        if (v) return *v;
        break;
    }
    case JV_LIST: case JV_TUPLE: case JV_STR: case JV_RANGE: {
        if ((obj.fl & (JVF_GEN | JVF_VIEW)) || (key.t != JV_INT && key.t != JV_BOOL)) break;
        int64_t i = key.t == JV_INT ? key.u.i : key.u.b;
        int64_t len = obj.t == JV_STR ? (int64_t)u8_count(obj.u.s.p, obj.u.s.n)
                    : obj.t == JV_RANGE ? jv_range_len(obj.u.r) : (int64_t)obj.u.l->n;
        if (i < 0) i += len;
        if (i < 0 || i >= len) return jv_undef;
        if (obj.t == JV_RANGE) return jv_int(jv_range_at(obj.u.r, (uint64_t)i));
        if (obj.t != JV_STR) return obj.u.l->v[i];
        size_t a = u8_offset(obj.u.s.p, obj.u.s.n, (size_t)i), b = a;
        u8_next(obj.u.s.p, obj.u.s.n, &b);
        return markup_like(jv_strn(obj.u.s.p + a, b - a), &obj);
    }
    default: break;
    }
    if (key.t == JV_STR) return jinja_getattr(st, line, obj, key.u.s.p, key.u.s.n);
    return jv_undef;
}

/* ---- operators ---- */

static bool is_num(const jv *v) { return v->t == JV_INT || v->t == JV_FLOAT || v->t == JV_BOOL; }
static double num_f(const jv *v) { return v->t == JV_FLOAT ? v->u.f : v->t == JV_INT ? (double)v->u.i : (double)v->u.b; }
static int64_t num_i(const jv *v) { return v->t == JV_INT ? v->u.i : v->t == JV_BOOL ? (int64_t)v->u.b : 0; }

static jv concat_str(jstate *st, jv a, jv b) {
    /* Markup + str escapes the str, and the result is Markup */
    bool ma = a.fl & JVF_MARKUP, mb = b.fl & JVF_MARKUP;
    if (ma != mb) {
        if (ma) b = py_escape(st, b);
        else a = py_escape(st, a);
    }
    char *p = jr_alloc(st, a.u.s.n + b.u.s.n + 1);
    if (a.u.s.n + b.u.s.n > st->max_output) jr_fail(st, 0, "a string grew past the output limit of %zu bytes", st->max_output);
    memcpy(p, a.u.s.p, a.u.s.n);
    memcpy(p + a.u.s.n, b.u.s.p, b.u.s.n);
    jv r = jv_strn(p, a.u.s.n + b.u.s.n);
    if (ma || mb) r.fl = JVF_MARKUP;
    return r;
}

static jv repeat(jstate *st, int line, jv s, int64_t k) {
    if (k <= 0) {
        if (s.t == JV_STR) return markup_like(jv_strn("", 0), &s);
        return s.t == JV_LIST ? jv_list(jl_new(st, 0)) : jv_tuple(jl_new(st, 0));
    }
    if (s.t == JV_STR) {
        if (s.u.s.n && (uint64_t)k > st->max_output / s.u.s.n)
            jr_fail(st, line, "a string grew past the output limit of %zu bytes", st->max_output);
        char *p = jr_alloc(st, s.u.s.n * (size_t)k + 1);
        for (int64_t i = 0; i < k; i++) memcpy(p + (size_t)i * s.u.s.n, s.u.s.p, s.u.s.n);
        return markup_like(jv_strn(p, s.u.s.n * (size_t)k), &s);
    }
    size_t n = s.u.l->n;
    if (n && (uint64_t)k > (st->max_output / 8) / n) jr_fail(st, line, "a list grew past the size limit");
    jr_steps(st, line, (long)(n * (size_t)k / 16));
    jlist *l = jl_new(st, n * (size_t)k);
    for (int64_t i = 0; i < k; i++) memcpy(l->v + (size_t)i * n, s.u.l->v, n * sizeof *l->v);
    l->n = n * (size_t)k;
    return s.t == JV_LIST ? jv_list(l) : jv_tuple(l);
}

static jv printf_format(jstate *st, int line, jv fmt, jv args);

static double py_fmod(double x, double y, double *div_out) {
    double mod = fmod(x, y);
    double div = (x - mod) / y;
    if (mod != 0) {
        if ((y < 0) != (mod < 0)) { mod += y; div -= 1.0; }
    } else {
        mod = copysign(0.0, y);
    }
    double fd;
    if (div != 0) {
        fd = floor(div);
        if (div - fd > 0.5) fd += 1.0;
    } else {
        fd = copysign(0.0, x / y);
    }
    if (div_out) *div_out = fd;
    return mod;
}

jv jinja_binop(jstate *st, int line, int op, jv a, jv b) {
    if (a.t == JV_UNDEF) jr_fail_undef(st, line, &a);
    if (b.t == JV_UNDEF) jr_fail_undef(st, line, &b);
    static const char *const sym[] = {[JO_ADD] = "+", [JO_SUB] = "-", [JO_MUL] = "*", [JO_DIV] = "/",
                                      [JO_FLOORDIV] = "//", [JO_MOD] = "%", [JO_POW] = "**"};
    if (is_num(&a) && is_num(&b)) {
        bool fl = a.t == JV_FLOAT || b.t == JV_FLOAT;
        int64_t x = num_i(&a), y = num_i(&b), r;
        double fx = num_f(&a), fy = num_f(&b);
        switch (op) {
        case JO_ADD:
            if (fl) return jv_float(fx + fy);
            if (__builtin_add_overflow(x, y, &r)) break;
            return jv_int(r);
        case JO_SUB:
            if (fl) return jv_float(fx - fy);
            if (__builtin_sub_overflow(x, y, &r)) break;
            return jv_int(r);
        case JO_MUL:
            if (fl) return jv_float(fx * fy);
            if (__builtin_mul_overflow(x, y, &r)) break;
            return jv_int(r);
        case JO_DIV:
            if (fy == 0) jr_fail(st, line, "division by zero");
            return jv_float(fx / fy);
        case JO_FLOORDIV:
        case JO_MOD:
            if (fl) {
                if (fy == 0) jr_fail(st, line, "float division by zero");
                double d, m = py_fmod(fx, fy, &d);
                return jv_float(op == JO_MOD ? m : d);
            }
            if (!y) jr_fail(st, line, "integer division or modulo by zero");
            if (x == INT64_MIN && y == -1) break;
            {
                int64_t q = x / y, m = x % y;
                if (m && ((m < 0) != (y < 0))) { m += y; q--; }
                return jv_int(op == JO_MOD ? m : q);
            }
        case JO_POW:
            if (!fl && y >= 0) {
                int64_t acc = 1, base = x;
                for (int64_t e = y; e; e >>= 1) {
                    if ((e & 1) && __builtin_mul_overflow(acc, base, &acc)) goto overflow;
                    if (e > 1 && __builtin_mul_overflow(base, base, &base)) goto overflow;
                }
                return jv_int(acc);
            }
            if (fx == 0 && fy < 0) jr_fail(st, line, "0.0 cannot be raised to a negative power");
            if (fx < 0 && fy != floor(fy)) jr_fail(st, line, "a negative number to a fractional power is complex");
            return jv_float(pow(fx, fy));
        default: break;
        }
    overflow:
        jr_fail(st, line, "integer overflow (kvlm's integers are 64-bit)");
    }
    if (op == JO_ADD) {
        if (a.t == JV_STR && b.t == JV_STR) return concat_str(st, a, b);
        if (a.t == b.t && (a.t == JV_LIST || a.t == JV_TUPLE) && !((a.fl | b.fl) & (JVF_GEN | JVF_VIEW))) {
            jlist *l = jl_new(st, a.u.l->n + b.u.l->n);
            if (a.u.l->n) memcpy(l->v, a.u.l->v, a.u.l->n * sizeof *l->v); /* (an empty list's array may be NULL) */
            if (b.u.l->n) memcpy(l->v + a.u.l->n, b.u.l->v, b.u.l->n * sizeof *l->v);
            l->n = a.u.l->n + b.u.l->n;
            return a.t == JV_LIST ? jv_list(l) : jv_tuple(l);
        }
    }
    if (op == JO_MUL) {
        bool seq_a = a.t == JV_STR || ((a.t == JV_LIST || a.t == JV_TUPLE) && !(a.fl & (JVF_GEN | JVF_VIEW)));
        bool seq_b = b.t == JV_STR || ((b.t == JV_LIST || b.t == JV_TUPLE) && !(b.fl & (JVF_GEN | JVF_VIEW)));
        if (seq_a && (b.t == JV_INT || b.t == JV_BOOL)) return repeat(st, line, a, num_i(&b));
        if (seq_b && (a.t == JV_INT || a.t == JV_BOOL)) return repeat(st, line, b, num_i(&a));
    }
    if (op == JO_MOD && a.t == JV_STR) return printf_format(st, line, a, b);
    jr_fail(st, line, "unsupported operand type(s) for %s: '%s' and '%s'", sym[op] ? sym[op] : "?", jv_type_name(&a),
            jv_type_name(&b));
}

bool jinja_in(jstate *st, int line, jv x, jv seq) {
    switch (seq.t) {
    case JV_STR:
        if (x.t != JV_STR)
            jr_fail(st, line, "'in <string>' requires string as left operand, not %s", jv_type_name(&x));
        return !x.u.s.n || (x.u.s.n <= seq.u.s.n && memmem(seq.u.s.p, seq.u.s.n, x.u.s.p, x.u.s.n));
    case JV_DICT:
        if (!jv_hashable(&x)) jr_fail(st, line, "unhashable type: '%s'", jv_type_name(&x));
        return jd_get(st, seq.u.d, x) != NULL;
    case JV_RANGE: {
        if (x.t != JV_INT && x.t != JV_BOOL && x.t != JV_FLOAT) return false;
        const jrange *r = seq.u.r;
        int64_t n = jv_range_len(r);
        jr_steps(st, line, (long)(n / 64));
        for (int64_t i = 0; i < n; i++) {
            jv y = jv_int(jv_range_at(r, (uint64_t)i));
            if (jv_eq(st, &x, &y, 0)) return true;
        }
        return false;
    }
    case JV_LIST: case JV_TUPLE: case JV_UNDEF: {
        jlist *l = jv_iter(st, &seq, line);
        jr_steps(st, line, (long)(l->n / 64));
        for (size_t i = 0; i < l->n; i++)
            if (jv_eq(st, &x, &l->v[i], 0)) {
                if (seq.fl & JVF_GEN) seq.u.l->pos = (size_t)(&l->v[i] - seq.u.l->v) + 1;
                return true;
            }
        return false;
    }
    default: jr_fail(st, line, "argument of type '%s' is not iterable", jv_type_name(&seq));
    }
}

/* ---- printf-style formatting (str % args) ---- */

/* a width's or precision's digits, saturating (past 10^9 is refused anyway) */
static int64_t digit_acc(int64_t v, char c) { return v > 1000000000 ? v : v * 10 + (c - '0'); }

static void pad(jstate *st, jbuf *b, const char *p, size_t n, int64_t width, bool left, char fill) {
    size_t cps = u8_count(p, n);
    int64_t padn = width > (int64_t)cps ? width - (int64_t)cps : 0;
    if (padn > (int64_t)st->max_output) jr_fail(st, 0, "a field width past the output limit");
    if (!left) for (int64_t i = 0; i < padn; i++) jb_put(st, b, &fill, 1);
    jb_put(st, b, p, n);
    if (left) for (int64_t i = 0; i < padn; i++) jb_put(st, b, " ", 1);
}

static jv printf_format(jstate *st, int line, jv fmt, jv args) {
    const char *p = fmt.u.s.p;
    size_t n = fmt.u.s.n;
    bool markup = fmt.fl & JVF_MARKUP;
    jlist single = {0};
    jv one = args;
    const jlist *pos;
    if (args.t == JV_TUPLE) pos = args.u.l;
    else { single.v = &one; single.n = 1; pos = &single; }
    size_t next = 0;
    bool used_map = false;
    jbuf b = {0};
    for (size_t i = 0; i < n;) {
        const char *pc = memchr(p + i, '%', n - i);
        if (!pc) { jb_put(st, &b, p + i, n - i); break; }
        size_t at = (size_t)(pc - p);
        jb_put(st, &b, p + i, at - i);
        i = at + 1;
        if (i >= n) jr_fail(st, line, "incomplete format");
        jv val = {.t = JV_MISSING};
        if (p[i] == '(') {
            size_t e = i + 1;
            int depth = 1;
            while (e < n && depth) { depth += p[e] == '(' ? 1 : p[e] == ')' ? -1 : 0; e++; }
            if (depth) jr_fail(st, line, "incomplete format key");
            if (args.t != JV_DICT) jr_fail(st, line, "format requires a mapping");
            jv *v = jd_get_str(args.u.d, p + i + 1, e - i - 2);
            if (!v) jr_fail(st, line, "KeyError: '%.*s'", (int)(e - i - 2), p + i + 1);
            val = *v;
            used_map = true;
            i = e;
        }
        bool left = false, plus = false, space = false, alt = false, zero = false;
        for (; i < n && strchr("-+ #0", p[i]); i++) {
            if (p[i] == '-') left = true;
            else if (p[i] == '+') plus = true;
            else if (p[i] == ' ') space = true;
            else if (p[i] == '#') alt = true;
            else zero = true;
        }
        int64_t width = -1, prec = -1;
        if (i < n && p[i] == '*') {
            if (next >= pos->n) jr_fail(st, line, "not enough arguments for format string");
            width = as_int(st, line, &pos->v[next++], "* width");
            if (width < 0) { left = true; width = -width; }
            i++;
        } else {
            for (; i < n && p[i] >= '0' && p[i] <= '9'; i++) width = digit_acc(width < 0 ? 0 : width, p[i]);
        }
        if (i < n && p[i] == '.') {
            i++;
            prec = 0;
            if (i < n && p[i] == '*') {
                if (next >= pos->n) jr_fail(st, line, "not enough arguments for format string");
                prec = as_int(st, line, &pos->v[next++], "* precision");
                i++;
            } else {
                for (; i < n && p[i] >= '0' && p[i] <= '9'; i++) prec = digit_acc(prec, p[i]);
            }
        }
        if (width > 100000 || prec > 100000) jr_fail(st, line, "format width or precision too large");
        while (i < n && (p[i] == 'h' || p[i] == 'l' || p[i] == 'L')) i++;
        if (i >= n) jr_fail(st, line, "incomplete format");
        char c = p[i++];
        if (c == '%') { jb_put(st, &b, "%", 1); continue; }
        if (val.t == JV_MISSING) {
            if (next >= pos->n) jr_fail(st, line, "not enough arguments for format string");
            val = pos->v[next++];
        }
        char spec[32], out[512];
        int k = 0;
        spec[k++] = '%';
        if (left) spec[k++] = '-';
        if (plus) spec[k++] = '+';
        if (space) spec[k++] = ' ';
        if (alt) spec[k++] = '#';
        if (zero) spec[k++] = '0';
        switch (c) {
        case 's': case 'r': case 'a': {
            jv s;
            if (c == 's') s = soft_str(st, line, &val);
            else { jbuf rb = {0}; jb_repr(st, &rb, &val, 0, line); s = jv_strn(rb.p ? rb.p : "", rb.n); }
            if (markup && !(s.fl & JVF_MARKUP)) s = py_escape(st, s);
            size_t len = s.u.s.n;
            if (prec >= 0) len = u8_offset(s.u.s.p, s.u.s.n, (size_t)prec);
            pad(st, &b, s.u.s.p, len, width, left, ' ');
            continue;
        }
        case 'd': case 'i': case 'u': case 'x': case 'X': case 'o': case 'c': {
            int64_t iv;
            if (val.t == JV_FLOAT && (c == 'd' || c == 'i' || c == 'u')) {
                if (!isfinite(val.u.f) || fabs(val.u.f) >= 9.2e18) jr_fail(st, line, "integer overflow");
                iv = (int64_t)val.u.f;
            } else if (c == 'c' && val.t == JV_STR) {
                if (u8_count(val.u.s.p, val.u.s.n) != 1) jr_fail(st, line, "%%c requires an int or a char");
                pad(st, &b, val.u.s.p, val.u.s.n, width, left, ' ');
                continue;
            } else {
                if (!(val.t == JV_INT || val.t == JV_BOOL))
                    jr_fail(st, line, "%%%c format: a real number is required, not %s", c, jv_type_name(&val));
                iv = num_i(&val);
            }
            if (c == 'c') {
                if (iv < 0 || iv > 0x10ffff) jr_fail(st, line, "%%c arg not in range(0x110000)");
                char u[4];
                int l = u8_put((uint32_t)iv, u);
                pad(st, &b, u, (size_t)l, width, left, ' ');
                continue;
            }
            if (width >= 0) k += snprintf(spec + k, sizeof spec - (size_t)k, "%lld", (long long)width);
            if (prec >= 0) k += snprintf(spec + k, sizeof spec - (size_t)k, ".%lld", (long long)prec);
            char conv = c == 'i' || c == 'u' ? 'd' : c;
            if (conv == 'o' && alt) { /* Python writes 0o */
                int l = snprintf(out, sizeof out, "%s0o%llo", iv < 0 ? "-" : "", (unsigned long long)(iv < 0 ? -(uint64_t)iv : (uint64_t)iv));
                pad(st, &b, out, (size_t)l, width, left, ' ');
                continue;
            }
            if (conv == 'x' || conv == 'X') { /* Python: sign and magnitude */
                snprintf(spec + k, sizeof spec - (size_t)k, "ll%c", conv);
                char mag[64];
                uint64_t m = iv < 0 ? (uint64_t)0 - (uint64_t)iv : (uint64_t)iv;
                snprintf(mag, sizeof mag, spec, (unsigned long long)m);
                int l = snprintf(out, sizeof out, "%s%s", iv < 0 ? "-" : "", mag);
                pad(st, &b, out, (size_t)l, 0, left, ' ');
                continue;
            }
            snprintf(spec + k, sizeof spec - (size_t)k, "ll%c", conv);
            int l = snprintf(out, sizeof out, spec, (long long)iv);
            jb_put(st, &b, out, (size_t)(l < (int)sizeof out ? l : (int)sizeof out - 1));
            continue;
        }
        case 'f': case 'F': case 'e': case 'E': case 'g': case 'G': {
            if (!is_num(&val)) jr_fail(st, line, "must be real number, not %s", jv_type_name(&val));
            if (width >= 0) k += snprintf(spec + k, sizeof spec - (size_t)k, "%lld", (long long)width);
            if (prec >= 0) k += snprintf(spec + k, sizeof spec - (size_t)k, ".%lld", (long long)prec);
            snprintf(spec + k, sizeof spec - (size_t)k, "%c", c);
            char *big = jr_alloc(st, 400 + (size_t)(prec > 0 ? prec : 0) + (size_t)(width > 0 ? width : 0));
            int l = snprintf(big, 400 + (size_t)(prec > 0 ? prec : 0) + (size_t)(width > 0 ? width : 0), spec, num_f(&val));
            jb_put(st, &b, big, (size_t)l);
            continue;
        }
        default: jr_fail(st, line, "unsupported format character '%c'", c);
        }
    }
    if (next < pos->n && !used_map && !(args.t == JV_DICT && pos == &single))
        jr_fail(st, line, "not all arguments converted during string formatting");
    jv r = jv_strn(b.p ? b.p : "", b.n);
    if (markup) r.fl = JVF_MARKUP;
    return r;
}

/* ---- str.format ---- */

static jv format_value(jstate *st, int line, jv v, const char *spec, size_t sn) {
    if (!sn) return soft_str(st, line, &v);
    /* [[fill]align][sign][#][0][width][,|_][.precision][type] */
    size_t i = 0;
    char fill = ' ', align = 0, sign = '-', type = 0, group = 0;
    bool alt = false, zero = false;
    int64_t width = -1, prec = -1;
    if (sn >= 2 && strchr("<>=^", spec[1])) { fill = spec[0]; align = spec[1]; i = 2; }
    else if (strchr("<>=^", spec[0])) { align = spec[0]; i = 1; }
    if (i < sn && strchr("+- ", spec[i])) sign = spec[i++];
    if (i < sn && spec[i] == '#') { alt = true; i++; }
    if (i < sn && spec[i] == '0') { zero = true; i++; }
    for (; i < sn && spec[i] >= '0' && spec[i] <= '9'; i++) width = digit_acc(width < 0 ? 0 : width, spec[i]);
    if (i < sn && (spec[i] == ',' || spec[i] == '_')) group = spec[i++];
    if (i < sn && spec[i] == '.') {
        prec = 0;
        for (i++; i < sn && spec[i] >= '0' && spec[i] <= '9'; i++) prec = digit_acc(prec, spec[i]);
    }
    if (i < sn) type = spec[i++];
    if (i != sn || width > 100000 || prec > 100000 || group || alt)
        jr_fail(st, line, "format spec '%.*s' is not supported", (int)sn, spec);
    char out[512];
    jv s;
    if (v.t == JV_STR || (!is_num(&v))) {
        if (v.t != JV_STR) jr_fail(st, line, "unsupported format string passed to %s.__format__", jv_type_name(&v));
        if (type && type != 's') jr_fail(st, line, "unknown format code '%c' for object of type 'str'", type);
        s = v;
        if (prec >= 0) s = jv_strn(v.u.s.p, u8_offset(v.u.s.p, v.u.s.n, (size_t)prec));
        if (!align) align = '<';
    } else {
        if (!align) align = zero ? '=' : '>';
        if (zero && fill == ' ' && align == '=') fill = '0';
        char cs[32];
        int k = 0;
        cs[k++] = '%';
        if (sign == '+' || sign == ' ') cs[k++] = sign;
        bool isint = (v.t == JV_INT || v.t == JV_BOOL) && (!type || strchr("dxXobc", type));
        if (isint) {
            if (type == 'b' || type == 'c') jr_fail(st, line, "format code '%c' is not supported", type);
            snprintf(cs + k, sizeof cs - (size_t)k, "ll%c", type && type != 'd' ? type : 'd');
            snprintf(out, sizeof out, cs, (long long)num_i(&v));
        } else {
            double d = num_f(&v);
            if (!type && prec < 0) {
                char t[40];
                py_float_repr(d, t, sizeof t);
                snprintf(out, sizeof out, "%s%s", (sign == '+' && d >= 0) ? "+" : (sign == ' ' && d >= 0) ? " " : "", t);
            } else {
                char ty = type ? type : 'g';
                if (!strchr("eEfFgG%", ty)) jr_fail(st, line, "unknown format code '%c' for a number", ty);
                if (ty == '%') d *= 100;
                snprintf(cs + k, sizeof cs - (size_t)k, ".%lld%c", (long long)(prec < 0 ? 6 : prec), ty == '%' ? 'f' : ty);
                int l = snprintf(out, sizeof out - 1, cs, d);
                if (ty == '%' && l > 0) { out[l] = '%'; out[l + 1] = 0; }
            }
        }
        s = jv_strn(out, strlen(out));
        s = jv_str_dup(st, s.u.s.p, s.u.s.n);
    }
    size_t cps = u8_count(s.u.s.p, s.u.s.n);
    if (width <= (int64_t)cps) return s;
    size_t padn = (size_t)width - cps, l = 0, r = 0;
    if (align == '<') r = padn;
    else if (align == '>') l = padn;
    else if (align == '^') { l = padn / 2; r = padn - l; }
    jbuf b = {0};
    if (align == '=' && s.u.s.n && strchr("+- ", s.u.s.p[0])) { jb_put(st, &b, s.u.s.p, 1); s.u.s.p++; s.u.s.n--; l = padn; }
    else if (align == '=') l = padn;
    for (size_t k = 0; k < l; k++) jb_put(st, &b, &fill, 1);
    jb_put(st, &b, s.u.s.p, s.u.s.n);
    for (size_t k = 0; k < r; k++) jb_put(st, &b, &fill, 1);
    return jv_strn(b.p, b.n);
}

static jv str_format(jstate *st, int line, jv fmt, const jargs *a) {
    const char *p = fmt.u.s.p;
    size_t n = fmt.u.s.n;
    jbuf b = {0};
    int auto_idx = 0;
    for (size_t i = 0; i < n;) {
        char c = p[i];
        if (c == '}') {
            if (i + 1 < n && p[i + 1] == '}') { jb_put(st, &b, "}", 1); i += 2; continue; }
            jr_fail(st, line, "single '}' encountered in format string");
        }
        if (c != '{') {
            size_t j = i;
            while (j < n && p[j] != '{' && p[j] != '}') j++;
            jb_put(st, &b, p + i, j - i);
            i = j;
            continue;
        }
        if (i + 1 < n && p[i + 1] == '{') { jb_put(st, &b, "{", 1); i += 2; continue; }
        size_t e = i + 1;
        int depth = 1;
        while (e < n && depth) {
            if (p[e] == '{') depth++;
            else if (p[e] == '}') depth--;
            if (depth) e++;
        }
        if (e >= n) jr_fail(st, line, "expected '}' before end of string");
        const char *f = p + i + 1;
        size_t fl = e - i - 1;
        i = e + 1;
        size_t nameend = 0;
        while (nameend < fl && !strchr(".[!:", f[nameend])) nameend++;
        jv v;
        if (!nameend) {
            if (auto_idx >= a->npos) jr_fail(st, line, "Replacement index %d out of range for positional args tuple", auto_idx);
            v = a->pos[auto_idx++];
        } else if (f[0] >= '0' && f[0] <= '9') {
            int64_t idx = 0;
            for (size_t k = 0; k < nameend; k++) {
                if (f[k] < '0' || f[k] > '9' || idx > 1000000) jr_fail(st, line, "bad format field '%.*s'", (int)fl, f);
                idx = idx * 10 + (f[k] - '0');
            }
            if (idx >= a->npos) jr_fail(st, line, "Replacement index %lld out of range for positional args tuple", (long long)idx);
            v = a->pos[idx];
        } else {
            int k = 0;
            for (; k < a->nkw; k++)
                if (a->knl[k] == nameend && !memcmp(a->kn[k], f, nameend)) break;
            if (k == a->nkw) jr_fail(st, line, "KeyError: '%.*s'", (int)nameend, f);
            v = a->kv[k];
        }
        size_t q = nameend;
        while (q < fl && (f[q] == '.' || f[q] == '[')) {
            if (f[q] == '.') {
                size_t s0 = ++q;
                while (q < fl && !strchr(".[!:", f[q])) q++;
                if (q - s0 >= 1 && f[s0] == '_') jr_fail(st, line, "access to attribute '%.*s' is unsafe", (int)(q - s0), f + s0);
                v = jinja_getattr(st, line, v, f + s0, q - s0);
            } else {
                size_t s0 = ++q;
                while (q < fl && f[q] != ']') q++;
                if (q >= fl) jr_fail(st, line, "missing ']' in format string");
                bool digits = q > s0;
                int64_t idx = 0;
                for (size_t k = s0; k < q; k++) {
                    if (f[k] < '0' || f[k] > '9' || idx > 1000000000) { digits = false; break; }
                    idx = idx * 10 + (f[k] - '0');
                }
                v = jinja_getitem(st, line, v, digits ? jv_int(idx) : jv_strn(f + s0, q - s0));
                q++;
            }
            if (v.t == JV_UNDEF) jr_fail(st, line, "format field '%.*s' not found", (int)fl, f);
        }
        if (q < fl && f[q] == '!') {
            if (q + 1 >= fl) jr_fail(st, line, "end of string while looking for conversion specifier");
            char conv = f[q + 1];
            if (conv == 'r' || conv == 'a') { jbuf rb = {0}; jb_repr(st, &rb, &v, 0, line); v = jv_strn(rb.p, rb.n); }
            else if (conv == 's') v = soft_str(st, line, &v);
            else jr_fail(st, line, "unknown conversion specifier %c", conv);
            q += 2;
        }
        const char *spec = "";
        size_t sn = 0;
        if (q < fl && f[q] == ':') { spec = f + q + 1; sn = fl - q - 1; q = fl; }
        if (q != fl) jr_fail(st, line, "bad format field '%.*s'", (int)fl, f);
        if (memchr(spec, '{', sn)) jr_fail(st, line, "nested format fields are not supported");
        jv s = format_value(st, line, v, spec, sn);
        jb_put(st, &b, s.u.s.p, s.u.s.n);
    }
    return markup_like(jv_strn(b.p ? b.p : "", b.n), &fmt);
}

/* ---- methods ---- */

static int64_t cp_index(const jv *s, const char *at) { return (int64_t)u8_count(s->u.s.p, (size_t)(at - s->u.s.p)); }

/* start/end arguments (code points) of find, count, startswith... as byte offsets */
static void str_range(jstate *st, int line, const jv *s, const jv *start, const jv *end, size_t *a, size_t *b, bool *empty) {
    int64_t len = (int64_t)u8_count(s->u.s.p, s->u.s.n);
    int64_t x = given(start) && start->t != JV_NONE ? as_int(st, line, start, "start") : 0;
    int64_t y = given(end) && end->t != JV_NONE ? as_int(st, line, end, "end") : len;
    if (x < 0) { x += len; if (x < 0) x = 0; }
    if (y < 0) { y += len; if (y < 0) y = 0; }
    if (y > len) y = len;
    *empty = x > len || x > y;
    if (x > len) x = len;
    if (y < x) y = x;
    *a = u8_offset(s->u.s.p, s->u.s.n, (size_t)x);
    *b = u8_offset(s->u.s.p, s->u.s.n, (size_t)y);
}

static jv str_method(jstate *st, int line, jv s, const char *name, const jargs *a) {
    size_t n = strlen(name);
    char what[64];
    snprintf(what, sizeof what, "str.%s()", name);
    if (IS("startswith") || IS("endswith")) {
        BIND(what, "prefix", "start", "end");
        if (!given(&p[0])) jr_fail(st, line, "%s takes at least 1 argument", what);
        size_t x, y;
        bool empty;
        str_range(st, line, &s, &p[1], &p[2], &x, &y, &empty);
        if (empty) return jv_bool(false);
        const jlist *opts;
        jlist one = {.v = &p[0], .n = 1};
        opts = p[0].t == JV_TUPLE ? p[0].u.l : &one;
        for (size_t i = 0; i < opts->n; i++) {
            const jv *o = as_str(st, line, &opts->v[i], what);
            if (o->u.s.n > y - x) continue;
            const char *at = IS("startswith") ? s.u.s.p + x : s.u.s.p + y - o->u.s.n;
            if (!memcmp(at, o->u.s.p, o->u.s.n)) return jv_bool(true);
        }
        return jv_bool(false);
    }
    if (IS("strip") || IS("lstrip") || IS("rstrip")) {
        BIND(what, "chars");
        bool has = given(&p[0]) && p[0].t != JV_NONE;
        if (has) as_str(st, line, &p[0], what);
        return py_str_strip(st, s, has ? &p[0] : NULL, IS("strip") ? 3 : IS("lstrip") ? 1 : 2);
    }
    if (IS("split") || IS("rsplit")) {
        BIND(what, "sep", "maxsplit");
        bool has = given(&p[0]) && p[0].t != JV_NONE;
        if (has) as_str(st, line, &p[0], what);
        int64_t maxs = given(&p[1]) ? as_int(st, line, &p[1], what) : -1;
        return jv_list(py_str_split(st, s, has ? &p[0] : NULL, maxs, IS("rsplit"), line));
    }
    if (IS("splitlines")) {
        BIND(what, "keepends");
        bool keep = given(&p[0]) && jv_truthy(&p[0]);
        jlist *l = jl_new(st, 4);
        size_t i = 0, start = 0;
        while (i < s.u.s.n) {
            size_t k = py_linebreak(s.u.s.p, s.u.s.n, i);
            if (!k) { size_t j = i; u8_next(s.u.s.p, s.u.s.n, &j); i = j; continue; }
            jl_push(st, l, markup_like(jv_strn(s.u.s.p + start, (keep ? i + k : i) - start), &s));
            i += k;
            start = i;
        }
        if (start < s.u.s.n) jl_push(st, l, markup_like(jv_strn(s.u.s.p + start, s.u.s.n - start), &s));
        return jv_list(l);
    }
    if (IS("replace")) {
        BIND(what, "old", "new", "count");
        if (!given(&p[1])) jr_fail(st, line, "%s takes at least 2 arguments", what);
        jv o = *as_str(st, line, &p[0], what), w = *as_str(st, line, &p[1], what);
        if (s.fl & JVF_MARKUP) { o = py_escape(st, o); w = py_escape(st, w); }
        return py_str_replace(st, s, o, w, given(&p[2]) ? as_int(st, line, &p[2], what) : -1);
    }
    if (IS("upper")) return py_str_upper(st, s);
    if (IS("lower") || IS("casefold")) return py_str_lower(st, s);
    if (IS("title")) return py_str_title(st, s);
    if (IS("capitalize")) return py_str_capitalize(st, s);
    if (IS("swapcase")) {
        jbuf b = {0};
        for (size_t i = 0; i < s.u.s.n;) {
            uint32_t c = u8_next(s.u.s.p, s.u.s.n, &i);
            char u[4];
            int l = u8_put(py_isupper_c(c) ? py_lower(c) : py_islower_c(c) ? py_upper(c) : c, u);
            jb_put(st, &b, u, (size_t)l);
        }
        return markup_like(jv_strn(b.p ? b.p : "", b.n), &s);
    }
    if (IS("find") || IS("rfind") || IS("index") || IS("rindex") || IS("count")) {
        BIND(what, "sub", "start", "end");
        const jv *sub = as_str(st, line, &p[0], what);
        size_t x, y;
        bool empty;
        str_range(st, line, &s, &p[1], &p[2], &x, &y, &empty);
        bool rev = name[0] == 'r';
        if (IS("count")) {
            if (empty) return jv_int(0);
            if (!sub->u.s.n) return jv_int((int64_t)u8_count(s.u.s.p + x, y - x) + 1);
            int64_t c = 0;
            for (size_t i = x; i + sub->u.s.n <= y;) {
                const char *f = memmem(s.u.s.p + i, y - i, sub->u.s.p, sub->u.s.n);
                if (!f) break;
                c++;
                i = (size_t)(f - s.u.s.p) + sub->u.s.n;
            }
            return jv_int(c);
        }
        const char *found = NULL;
        if (!empty && sub->u.s.n <= y - x) {
            if (!rev) found = sub->u.s.n ? memmem(s.u.s.p + x, y - x, sub->u.s.p, sub->u.s.n) : s.u.s.p + x;
            else
                for (size_t j = y - sub->u.s.n + 1; j-- > x;)
                    if (!memcmp(s.u.s.p + j, sub->u.s.p, sub->u.s.n)) { found = s.u.s.p + j; break; }
        }
        if (!found) {
            if (IS("index") || IS("rindex")) jr_fail(st, line, "substring not found");
            return jv_int(-1);
        }
        return jv_int(cp_index(&s, found));
    }
    if (IS("format")) return str_format(st, line, s, a);
    if (IS("join")) {
        BIND(what, "iterable");
        if (!given(&p[0])) jr_fail(st, line, "%s takes exactly one argument", what);
        jlist *items = jv_iter(st, &p[0], line);
        jbuf b = {0};
        bool markup = s.fl & JVF_MARKUP;
        for (size_t i = 0; i < items->n; i++) {
            jv x = items->v[i];
            if (x.t != JV_STR)
                jr_fail(st, line, "sequence item %zu: expected str instance, %s found", i, jv_type_name(&x));
            if (markup) x = py_escape(st, x);
            if (i) jb_put(st, &b, s.u.s.p, s.u.s.n);
            jb_put(st, &b, x.u.s.p, x.u.s.n);
        }
        return markup_like(jv_strn(b.p ? b.p : "", b.n), &s);
    }
    if (IS("isdigit") || IS("isalpha") || IS("isalnum") || IS("isspace") || IS("isnumeric") || IS("isdecimal")) {
        int w = IS("isdigit") ? 0 : IS("isalpha") ? 1 : IS("isalnum") ? 2 : IS("isspace") ? 3 : IS("isnumeric") ? 4 : 5;
        return jv_bool(py_str_class_test(s, w));
    }
    if (IS("islower")) return jv_bool(py_str_cased_test(s, false));
    if (IS("isupper")) return jv_bool(py_str_cased_test(s, true));
    if (IS("isascii")) {
        for (size_t i = 0; i < s.u.s.n; i++)
            if ((unsigned char)s.u.s.p[i] >= 0x80) return jv_bool(false);
        return jv_bool(true);
    }
    if (IS("isidentifier")) {
        if (!s.u.s.n || (s.u.s.p[0] >= '0' && s.u.s.p[0] <= '9')) return jv_bool(false);
        for (size_t i = 0; i < s.u.s.n;) {
            uint32_t c = u8_next(s.u.s.p, s.u.s.n, &i);
            if (!(c == '_' || py_isalnum(c))) return jv_bool(false);
        }
        return jv_bool(true);
    }
    if (IS("istitle")) {
        bool prev = false, any = false;
        for (size_t i = 0; i < s.u.s.n;) {
            uint32_t c = u8_next(s.u.s.p, s.u.s.n, &i);
            if (py_isupper_c(c)) { if (prev) return jv_bool(false); prev = any = true; }
            else if (py_islower_c(c)) { if (!prev) return jv_bool(false); prev = any = true; }
            else prev = false;
        }
        return jv_bool(any);
    }
    if (IS("isprintable")) {
        for (size_t i = 0; i < s.u.s.n;)
            if (!py_isprintable(u8_next(s.u.s.p, s.u.s.n, &i))) return jv_bool(false);
        return jv_bool(true);
    }
    if (IS("center") || IS("ljust") || IS("rjust")) {
        BIND(what, "width", "fillchar");
        int64_t w = as_int(st, line, &p[0], what);
        const char *fill = " ";
        size_t fn = 1;
        if (given(&p[1])) {
            const jv *f = as_str(st, line, &p[1], what);
            if (u8_count(f->u.s.p, f->u.s.n) != 1) jr_fail(st, line, "the fill character must be exactly one character long");
            fill = f->u.s.p;
            fn = f->u.s.n;
        }
        int64_t len = (int64_t)u8_count(s.u.s.p, s.u.s.n);
        if (w <= len) return s;
        if (w > (int64_t)st->max_output) jr_fail(st, line, "width past the output limit");
        int64_t marg = w - len, left = IS("ljust") ? 0 : IS("rjust") ? marg : marg / 2 + (marg & w & 1);
        jbuf b = {0};
        for (int64_t i = 0; i < left; i++) jb_put(st, &b, fill, fn);
        jb_put(st, &b, s.u.s.p, s.u.s.n);
        for (int64_t i = 0; i < marg - left; i++) jb_put(st, &b, fill, fn);
        return markup_like(jv_strn(b.p, b.n), &s);
    }
    if (IS("zfill")) {
        BIND(what, "width");
        int64_t w = as_int(st, line, &p[0], what), len = (int64_t)u8_count(s.u.s.p, s.u.s.n);
        if (w <= len) return s;
        if (w > (int64_t)st->max_output) jr_fail(st, line, "width past the output limit");
        jbuf b = {0};
        size_t skip = s.u.s.n && (s.u.s.p[0] == '+' || s.u.s.p[0] == '-');
        jb_put(st, &b, s.u.s.p, skip);
        for (int64_t i = 0; i < w - len; i++) jb_put(st, &b, "0", 1);
        jb_put(st, &b, s.u.s.p + skip, s.u.s.n - skip);
        return markup_like(jv_strn(b.p, b.n), &s);
    }
    if (IS("partition") || IS("rpartition")) {
        BIND(what, "sep");
        const jv *sep = as_str(st, line, &p[0], what);
        if (!sep->u.s.n) jr_fail(st, line, "empty separator");
        const char *f = NULL;
        if (IS("partition")) f = memmem(s.u.s.p, s.u.s.n, sep->u.s.p, sep->u.s.n);
        else if (sep->u.s.n <= s.u.s.n)
            for (size_t j = s.u.s.n - sep->u.s.n + 1; j-- > 0;)
                if (!memcmp(s.u.s.p + j, sep->u.s.p, sep->u.s.n)) { f = s.u.s.p + j; break; }
        jlist *l = jl_new(st, 3);
        jv e = markup_like(jv_strn("", 0), &s);
        if (!f) {
            if (IS("partition")) { l->v[0] = s; l->v[1] = e; l->v[2] = e; }
            else { l->v[0] = e; l->v[1] = e; l->v[2] = s; }
        } else {
            size_t at = (size_t)(f - s.u.s.p);
            l->v[0] = markup_like(jv_strn(s.u.s.p, at), &s);
            l->v[1] = markup_like(*sep, &s);
            l->v[2] = markup_like(jv_strn(f + sep->u.s.n, s.u.s.n - at - sep->u.s.n), &s);
        }
        l->n = 3;
        return jv_tuple(l);
    }
    if (IS("removeprefix") || IS("removesuffix")) {
        BIND(what, "affix");
        const jv *x = as_str(st, line, &p[0], what);
        if (x->u.s.n > s.u.s.n) return s;
        if (IS("removeprefix") && !memcmp(s.u.s.p, x->u.s.p, x->u.s.n))
            return markup_like(jv_strn(s.u.s.p + x->u.s.n, s.u.s.n - x->u.s.n), &s);
        if (IS("removesuffix") && x->u.s.n && !memcmp(s.u.s.p + s.u.s.n - x->u.s.n, x->u.s.p, x->u.s.n))
            return markup_like(jv_strn(s.u.s.p, s.u.s.n - x->u.s.n), &s);
        return s;
    }
    jr_fail(st, line, "string method '%s' is not supported", name);
}

static jv seq_index_count(jstate *st, int line, jv self, const char *name, const jargs *a) {
    size_t n = strlen(name);
    if (a->npos < 1 || a->nkw) jr_fail(st, line, "%s() takes one argument", name);
    jlist *l = jv_iter(st, &self, line);
    int64_t c = 0;
    for (size_t i = 0; i < l->n; i++)
        if (jv_eq(st, &l->v[i], &a->pos[0], 0)) {
            if (IS("index")) return jv_int((int64_t)i);
            c++;
        }
    if (IS("index")) jr_fail(st, line, "value is not in the %s", jv_type_name(&self));
    return jv_int(c);
}

static jlist *dict_view(jstate *st, const jdict *d, int which) {
    jlist *l = jl_new(st, d->n);
    for (size_t i = 0; i < d->n; i++) {
        if (which == 0) {
            jlist *t = jl_new(st, 2);
            t->v[0] = d->k[i];
            t->v[1] = d->v[i];
            t->n = 2;
            l->v[i] = jv_tuple(t);
        } else {
            l->v[i] = which == 1 ? d->k[i] : d->v[i];
        }
    }
    l->n = d->n;
    return l;
}

jv jinja_call_method(jstate *st, int line, const jmethod *m, const jargs *a) {
    jv self = m->self;
    const char *name = m->name;
    size_t n = strlen(name);
    switch (self.t) {
    case JV_STR: return str_method(st, line, self, name, a);
    case JV_DICT: {
        if (IS("get")) {
            BIND("dict.get()", "key", "default");
            if (!given(&p[0]) || a->nkw) jr_fail(st, line, "get() takes 1 or 2 positional arguments");
            if (!jv_hashable(&p[0])) jr_fail(st, line, "unhashable type: '%s'", jv_type_name(&p[0]));
            jv *v = jd_get(st, self.u.d, p[0]);
            return v ? *v : given(&p[1]) ? p[1] : jv_none;
        }
        if (a->npos || a->nkw) jr_fail(st, line, "dict.%s() takes no arguments", name);
        if (IS("items") || IS("keys") || IS("values")) {
            jv v = jv_list(dict_view(st, self.u.d, IS("items") ? 0 : IS("keys") ? 1 : 2));
            v.fl = JVF_VIEW;
            v.id = IS("items") ? 0 : IS("keys") ? 1 : 2;
            return v;
        }
        if (IS("copy")) {
            jdict *d = jd_new(st, self.u.d->n);
            memcpy(d->k, self.u.d->k, self.u.d->n * sizeof *d->k);
            memcpy(d->v, self.u.d->v, self.u.d->n * sizeof *d->v);
            d->n = self.u.d->n;
            return jv_dict(d);
        }
        break;
    }
    case JV_LIST: case JV_TUPLE: case JV_RANGE:
        if (IS("copy")) {
            if (a->npos || a->nkw) jr_fail(st, line, "list.copy() takes no arguments");
            jlist *l = jl_new(st, self.u.l->n);
            memcpy(l->v, self.u.l->v, self.u.l->n * sizeof *l->v);
            l->n = self.u.l->n;
            return jv_list(l);
        }
        return seq_index_count(st, line, self, name, a);
    case JV_LOOP: {
        jloop *lp = self.u.lp;
        if (IS("cycle")) {
            if (!a->npos) jr_fail(st, line, "no items for cycling given");
            return a->pos[lp->i % (size_t)a->npos];
        }
        /* changed(*values): true when they differ from the last call's */
        jlist *vals = jl_new(st, (size_t)a->npos);
        for (int i = 0; i < a->npos; i++) vals->v[vals->n++] = a->pos[i];
        jv now = jv_list(vals);
        bool changed = lp->changed_last.t == JV_MISSING || !jv_eq(st, &lp->changed_last, &now, 0);
        lp->changed_last = now;
        return jv_bool(changed);
    }
    case JV_CYCLER: {
        jcycler *c = self.u.cy;
        if (IS("reset")) { c->pos = 0; return jv_none; }
        jv r = c->items.v[c->pos];
        c->pos = (c->pos + 1) % c->items.n;
        return r;
    }
    default: break;
    }
    jr_fail(st, line, "method '%s' of '%s' is not supported", name, jv_type_name(&self));
}

/* ---- globals ---- */

enum { JF_RANGE = 1, JF_DICT, JF_NAMESPACE, JF_CYCLER, JF_JOINER, JF_RAISE, JF_STRFTIME, JF_LIPSUM };
static const struct { const char *name; int id; } k_globals[] = {
    {"range", JF_RANGE}, {"dict", JF_DICT}, {"namespace", JF_NAMESPACE}, {"cycler", JF_CYCLER},
    {"joiner", JF_JOINER}, {"raise_exception", JF_RAISE}, {"strftime_now", JF_STRFTIME}, {"lipsum", JF_LIPSUM},
};

jv jinja_global(const char *name, size_t n) {
    for (size_t i = 0; i < sizeof k_globals / sizeof k_globals[0]; i++)
        if (strlen(k_globals[i].name) == n && !memcmp(k_globals[i].name, name, n)) {
            jv v = {.t = JV_FUNC};
            v.id = (uint16_t)k_globals[i].id;
            return v;
        }
    return (jv){.t = JV_MISSING};
}

static void dict_update(jstate *st, int line, jdict *d, const jv *src) {
    if (src->t == JV_DICT || src->t == JV_NS) {
        for (size_t i = 0; i < src->u.d->n; i++) jd_set(st, d, src->u.d->k[i], src->u.d->v[i]);
        return;
    }
    jlist *items = jv_iter(st, (jv *)src, line);
    for (size_t i = 0; i < items->n; i++) {
        jv it = items->v[i];
        jlist *kv = jv_iter(st, &it, line);
        if (kv->n != 2) jr_fail(st, line, "dictionary update sequence element #%zu has length %zu; 2 is required", i, kv->n);
        if (!jv_hashable(&kv->v[0])) jr_fail(st, line, "unhashable type: '%s'", jv_type_name(&kv->v[0]));
        jd_set(st, d, kv->v[0], kv->v[1]);
    }
}

jv jinja_call_func(jstate *st, int line, int id, const jargs *a) {
    switch (id) {
    case JF_RANGE: {
        if (a->nkw) jr_fail(st, line, "range() takes no keyword arguments");
        if (a->npos < 1 || a->npos > 3) jr_fail(st, line, "range expected 1 to 3 arguments, got %d", a->npos);
        int64_t v[3];
        for (int i = 0; i < a->npos; i++) v[i] = as_int(st, line, &a->pos[i], "range()");
        jrange *r = jr_alloc(st, sizeof *r);
        r->start = a->npos == 1 ? 0 : v[0];
        r->stop = a->npos == 1 ? v[0] : v[1];
        r->step = a->npos == 3 ? v[2] : 1;
        if (!r->step) jr_fail(st, line, "range() arg 3 must not be zero");
        if (jv_range_len(r) > JINJA_MAX_RANGE)
            jr_fail(st, line, "range too big: the sandbox allows at most %d items", JINJA_MAX_RANGE);
        jv x = {.t = JV_RANGE};
        x.u.r = r;
        return x;
    }
    case JF_DICT:
    case JF_NAMESPACE: {
        if (a->npos > 1) jr_fail(st, line, "%s expected at most 1 argument, got %d", id == JF_DICT ? "dict" : "namespace", a->npos);
        jdict *d = jd_new(st, 0);
        if (a->npos) dict_update(st, line, d, &a->pos[0]);
        for (int k = 0; k < a->nkw; k++) jd_set(st, d, jv_strn(a->kn[k], a->knl[k]), a->kv[k]);
        jv v = {.t = id == JF_DICT ? JV_DICT : JV_NS};
        v.u.d = d;
        return v;
    }
    case JF_CYCLER: {
        if (!a->npos) jr_fail(st, line, "cycler() needs at least one item");
        jcycler *c = jr_alloc(st, sizeof *c);
        memset(c, 0, sizeof *c);
        c->items.v = jr_alloc(st, (size_t)a->npos * sizeof *c->items.v);
        memcpy(c->items.v, a->pos, (size_t)a->npos * sizeof *a->pos);
        c->items.n = (size_t)a->npos;
        jv v = {.t = JV_CYCLER};
        v.u.cy = c;
        return v;
    }
    case JF_JOINER: {
        BIND("joiner()", "sep");
        jcycler *c = jr_alloc(st, sizeof *c);
        memset(c, 0, sizeof *c);
        jv sep = given(&p[0]) ? soft_str(st, line, &p[0]) : jv_cstr(", ");
        c->sep = sep.u.s.p;
        c->sep_n = sep.u.s.n;
        jv v = {.t = JV_JOINER};
        v.u.cy = c;
        return v;
    }
    case JF_RAISE: {
        BIND("raise_exception()", "message");
        if (!given(&p[0])) jr_fail(st, line, "raise_exception() missing 1 required positional argument: 'message'");
        jv msg = soft_str(st, line, &p[0]);
        if (!msg.u.s.n) jr_fail(st, line, "the template raised an exception without a message");
        jr_fail_raw(st, KVLM_EINVAL, msg.u.s.p, msg.u.s.n);
    }
    case JF_STRFTIME: {
        BIND("strftime_now()", "format");
        const jv *f = as_str(st, line, &p[0], "strftime_now()");
        /* datetime.now() is naive: Python writes %z and %Z as nothing and %f as its microseconds */
        char *fmt = jr_alloc(st, f->u.s.n * 3 + 2);
        size_t k = 0;
        for (size_t i = 0; i < f->u.s.n; i++) {
            char c = f->u.s.p[i];
            if (!c) jr_fail(st, line, "embedded null character");
            if (c == '%' && i + 1 < f->u.s.n) {
                char d = f->u.s.p[i + 1];
                if (d == 'z' || d == 'Z') { i++; continue; }
                if (d == 'f') { memcpy(fmt + k, "000000", 6); k += 6; i++; continue; }
                fmt[k++] = c;
                fmt[k++] = d;
                i++;
                continue;
            }
            fmt[k++] = c;
        }
        fmt[k] = 0;
        struct tm tm;
        time_t t = st->now;
        if (!localtime_r(&t, &tm)) jr_fail(st, line, "strftime_now: the time is out of range");
        size_t cap = k * 16 + 64;
        char *out = jr_alloc(st, cap);
        size_t len = fmt[0] ? strftime(out, cap, fmt, &tm) : 0;
        return jv_strn(out, len);
    }
    case JF_LIPSUM: jr_fail(st, line, "lipsum() is not supported");
    default: jr_fail(st, line, "internal error: function %d", id);
    }
}

/* ---- filters ---- */

typedef jv (*filter_fn)(jstate *st, int line, jv in, const jargs *a);

/* attribute="a.b.0": each part an item (or attribute), digits an index */
static jv attr_path(jstate *st, int line, jv item, const jv *attr, const jv *dflt) {
    if (attr->t == JV_INT) return jinja_getitem(st, line, item, *attr);
    if (attr->t != JV_STR) jr_fail(st, line, "attribute must be a string or an integer");
    const char *p = attr->u.s.p;
    size_t n = attr->u.s.n;
    for (size_t i = 0; i <= n;) {
        size_t j = i;
        while (j < n && p[j] != '.') j++;
        bool digits = j > i;
        int64_t idx = 0;
        for (size_t k = i; k < j; k++) {
            if (p[k] < '0' || p[k] > '9' || idx > 100000000000LL) { digits = false; break; }
            idx = idx * 10 + (p[k] - '0');
        }
        item = jinja_getitem(st, line, item, digits ? jv_int(idx) : jv_strn(p + i, j - i));
        if (dflt && given(dflt) && dflt->t != JV_NONE && item.t == JV_UNDEF) item = *dflt;
        i = j + 1;
    }
    return item;
}

static jv ignore_case(jstate *st, jv v, bool cs) { return !cs && v.t == JV_STR ? py_str_lower(st, v) : v; }

static jv gen(jlist *l) {
    jv v = jv_list(l);
    v.fl = JVF_GEN;
    return v;
}

static bool iterable(const jv *v) {
    return v->t == JV_STR || v->t == JV_LIST || v->t == JV_TUPLE || v->t == JV_DICT || v->t == JV_RANGE ||
           v->t == JV_UNDEF;
}

/* A filter that is a generator in Jinja2 fails only when iterated: over a
 * value that is not iterable it gives an iterator that fails then. */
static bool lazy_fail(jstate *st, const jv *in, jv *out) {
    if (iterable(in)) return false;
    jlist *l = jl_new(st, 0);
    char *m = jr_alloc(st, 96);
    snprintf(m, 96, "'%s' object is not iterable", jv_type_name(in));
    l->err = m;
    *out = gen(l);
    return true;
}

static jv f_abs(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    if (in.t == JV_INT) {
        if (in.u.i == INT64_MIN) jr_fail(st, line, "integer overflow");
        return jv_int(in.u.i < 0 ? -in.u.i : in.u.i);
    }
    if (in.t == JV_BOOL) return jv_int(in.u.b);
    if (in.t == JV_FLOAT) return jv_float(fabs(in.u.f));
    jr_fail(st, line, "bad operand type for abs(): '%s'", jv_type_name(&in));
}

static jv f_attr(jstate *st, int line, jv in, const jargs *a) {
    BIND("attr", "name");
    const jv *nm = as_str(st, line, &p[0], "attr");
    if (in.t == JV_DICT) { /* attributes only: a dict's keys are not */
        jv r = jinja_getattr(st, line, in, nm->u.s.p, nm->u.s.n);
        return r.t == JV_METHOD ? r : undef_attr(in.t, nm->u.s.p, nm->u.s.n, r.fl & JVF_UNSAFE);
    }
    return jinja_getattr(st, line, in, nm->u.s.p, nm->u.s.n);
}

static jv f_batch(jstate *st, int line, jv in, const jargs *a) {
    BIND("batch", "linecount", "fill_with");
    int64_t c = as_int(st, line, &p[0], "batch");
    if (c <= 0) jr_fail(st, line, "batch: linecount must be positive");
    jv lazy;
    if (lazy_fail(st, &in, &lazy)) return lazy;
    jlist *items = jv_iter(st, &in, line), *out = jl_new(st, 0);
    for (size_t i = 0; i < items->n; i += (size_t)c) {
        jlist *row = jl_new(st, (size_t)c);
        for (size_t k = i; k < items->n && k < i + (size_t)c; k++) row->v[row->n++] = items->v[k];
        if (row->n < (size_t)c && given(&p[1]) && p[1].t != JV_NONE)
            while (row->n < (size_t)c) row->v[row->n++] = p[1];
        jl_push(st, out, jv_list(row));
    }
    return gen(out);
}

static jv f_capitalize(jstate *st, int line, jv in, const jargs *a) { (void)a; return py_str_capitalize(st, soft_str(st, line, &in)); }

static jv f_center(jstate *st, int line, jv in, const jargs *a) {
    BIND("center", "width");
    jargs b = {.pos = (jv[]){given(&p[0]) ? p[0] : jv_int(80)}, .npos = 1};
    return str_method(st, line, soft_str(st, line, &in), "center", &b);
}

static jv f_default(jstate *st, int line, jv in, const jargs *a) {
    BIND("default", "default_value", "boolean");
    bool boolean = given(&p[1]) && jv_truthy(&p[1]);
    if (in.t == JV_UNDEF || (boolean && !jv_truthy(&in))) return given(&p[0]) ? p[0] : jv_strn("", 0);
    return in;
}

/* stable merge sort by keys */
static void msort(jstate *st, int line, jv *keys, size_t *idx, size_t *tmp, size_t n, bool rev) {
    if (n < 2) return;
    size_t h = n / 2;
    msort(st, line, keys, idx, tmp, h, rev);
    msort(st, line, keys, idx + h, tmp, n - h, rev);
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        int c = jv_cmp(st, line, &keys[idx[j]], &keys[idx[i]], 0);
        tmp[k++] = (rev ? c > 0 : c < 0) ? idx[j++] : idx[i++];
    }
    while (i < h) tmp[k++] = idx[i++];
    while (j < n) tmp[k++] = idx[j++];
    memcpy(idx, tmp, n * sizeof *idx);
}

static jlist *sorted(jstate *st, int line, jlist *items, jv *keys, bool rev) {
    size_t n = items->n;
    size_t *idx = jr_alloc(st, 2 * (n + 1) * sizeof *idx);
    for (size_t i = 0; i < n; i++) idx[i] = i;
    jr_steps(st, line, (long)(n / 16));
    msort(st, line, keys, idx, idx + n + 1, n, rev);
    jlist *out = jl_new(st, n);
    for (size_t i = 0; i < n; i++) out->v[i] = items->v[idx[i]];
    out->n = n;
    return out;
}

static jv f_dictsort(jstate *st, int line, jv in, const jargs *a) {
    BIND("dictsort", "case_sensitive", "by", "reverse");
    if (in.t == JV_UNDEF) jr_fail_undef(st, line, &in);
    if (in.t != JV_DICT) jr_fail(st, line, "dictsort: '%s' object has no attribute 'items'", jv_type_name(&in));
    bool cs = given(&p[0]) && jv_truthy(&p[0]);
    int pos = 0;
    if (given(&p[1])) {
        const jv *by = as_str(st, line, &p[1], "dictsort");
        if (by->u.s.n == 5 && !memcmp(by->u.s.p, "value", 5)) pos = 1;
        else if (!(by->u.s.n == 3 && !memcmp(by->u.s.p, "key", 3)))
            jr_fail(st, line, "You can only sort by either \"key\" or \"value\"");
    }
    jlist *items = dict_view(st, in.u.d, 0);
    jv *keys = jr_alloc(st, (items->n + 1) * sizeof *keys);
    for (size_t i = 0; i < items->n; i++) keys[i] = ignore_case(st, items->v[i].u.l->v[pos], cs);
    return jv_list(sorted(st, line, items, keys, given(&p[2]) && jv_truthy(&p[2])));
}

static jv f_escape(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    if (in.t == JV_STR) return py_escape(st, in);
    return py_escape(st, soft_str(st, line, &in));
}

static jv f_forceescape(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    jv s = soft_str(st, line, &in);
    s.fl &= (uint8_t)~JVF_MARKUP;
    return py_escape(st, s);
}

static jv f_first(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    if (in.t == JV_LIST && (in.fl & JVF_GEN)) {
        jlist *l = in.u.l;
        if (l->err) jr_fail(st, line, "%s", l->err);
        if (l->pos >= l->n) return jv_undef;
        return l->v[l->pos++];
    }
    jlist *items = jv_iter(st, &in, line);
    return items->n ? items->v[0] : jv_undef;
}

static jv f_last(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    if (in.t == JV_LIST && (in.fl & (JVF_GEN | JVF_VIEW)) && !(in.fl & JVF_VIEW))
        jr_fail(st, line, "'generator' object is not reversible");
    jlist *items = jv_iter(st, &in, line);
    return items->n ? items->v[items->n - 1] : jv_undef;
}

static bool parse_float(const char *p, size_t n, double *out) {
    char buf[128];
    size_t a = 0, b = n;
    while (a < b && py_isspace((unsigned char)p[a])) a++;
    while (b > a && py_isspace((unsigned char)p[b - 1])) b--;
    if (b - a == 0 || b - a >= sizeof buf) return false;
    size_t k = 0;
    for (size_t i = a; i < b; i++) {
        if (p[i] == '_') {
            if (i == a || i + 1 >= b || !(p[i - 1] >= '0' && p[i - 1] <= '9') || !(p[i + 1] >= '0' && p[i + 1] <= '9'))
                return false;
            continue;
        }
        buf[k++] = p[i];
    }
    buf[k] = 0;
    char *end;
    const char *s = buf;
    bool hex = (s[0] == '0' || ((s[0] == '+' || s[0] == '-') && s[1] == '0')) && strpbrk(s, "xX");
    if (hex) return false; /* float() reads no hex */
    double v = strtod(s, &end);
    if (*end) return false;
    /* strtod also reads "infinity"/"nan" spellings Python accepts */
    *out = v;
    return true;
}

static bool parse_int(const char *p, size_t n, int64_t base, int64_t *out) {
    size_t a = 0, b = n;
    while (a < b && py_isspace((unsigned char)p[a])) a++;
    while (b > a && py_isspace((unsigned char)p[b - 1])) b--;
    if (a == b) return false;
    bool neg = false;
    if (p[a] == '+' || p[a] == '-') neg = p[a++] == '-';
    if (base == 0 || base == 16 || base == 8 || base == 2) {
        if (b - a > 2 && p[a] == '0') {
            char c = (char)(p[a + 1] | 0x20);
            int pb = c == 'x' ? 16 : c == 'o' ? 8 : c == 'b' ? 2 : 0;
            if (pb && (base == 0 || base == pb)) { base = pb; a += 2; if (a < b && p[a] == '_') a++; }
        }
        if (base == 0) base = 10;
    }
    if (base < 2 || base > 36 || a == b) return false;
    uint64_t v = 0;
    for (size_t i = a; i < b; i++) {
        char c = p[i];
        if (c == '_' && i > a && i + 1 < b && p[i + 1] != '_') continue;
        int d = c >= '0' && c <= '9' ? c - '0' : (c | 0x20) >= 'a' && (c | 0x20) <= 'z' ? (c | 0x20) - 'a' + 10 : 99;
        if (d >= base) return false;
        if (v > (UINT64_MAX - (uint64_t)d) / (uint64_t)base) return false;
        v = v * (uint64_t)base + (uint64_t)d;
    }
    if (v > (uint64_t)INT64_MAX + neg) return false;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return true;
}

static jv f_float(jstate *st, int line, jv in, const jargs *a) {
    BIND("float", "default");
    jv dflt = given(&p[0]) ? p[0] : jv_float(0.0);
    switch (in.t) {
    case JV_FLOAT: return in;
    case JV_INT: return jv_float((double)in.u.i);
    case JV_BOOL: return jv_float(in.u.b);
    case JV_STR: {
        double d;
        return parse_float(in.u.s.p, in.u.s.n, &d) ? jv_float(d) : dflt;
    }
    default: return dflt;
    }
}

static jv f_int(jstate *st, int line, jv in, const jargs *a) {
    BIND("int", "default", "base");
    jv dflt = given(&p[0]) ? p[0] : jv_int(0);
    int64_t base = given(&p[1]) ? as_int(st, line, &p[1], "int") : 10;
    switch (in.t) {
    case JV_INT: return in;
    case JV_BOOL: return jv_int(in.u.b);
    case JV_FLOAT:
        if (!isfinite(in.u.f)) return dflt;
        if (fabs(in.u.f) >= 9.2233720368547758e18) jr_fail(st, line, "integer overflow (kvlm's integers are 64-bit)");
        return jv_int((int64_t)in.u.f);
    case JV_STR: {
        int64_t v;
        if (parse_int(in.u.s.p, in.u.s.n, base, &v)) return jv_int(v);
        double d; /* "42.23"|int is 42 */
        if (parse_float(in.u.s.p, in.u.s.n, &d) && isfinite(d)) {
            if (fabs(d) >= 9.2233720368547758e18) jr_fail(st, line, "integer overflow (kvlm's integers are 64-bit)");
            return jv_int((int64_t)d);
        }
        return dflt;
    }
    default: return dflt;
    }
}

static jv f_indent(jstate *st, int line, jv in, const jargs *a) {
    BIND("indent", "width", "first", "blank");
    if (in.t == JV_UNDEF) jr_fail_undef(st, line, &in);
    if (in.t != JV_STR) jr_fail(st, line, "indent: unsupported operand type(s) for +=: '%s' and 'str'", jv_type_name(&in));
    jv ind;
    if (given(&p[0]) && p[0].t == JV_STR) ind = p[0];
    else {
        int64_t w = given(&p[0]) ? as_int(st, line, &p[0], "indent") : 4;
        if (w > 10000) jr_fail(st, line, "indent width too large");
        char *s = jr_alloc(st, (size_t)(w > 0 ? w : 0) + 1);
        for (int64_t i = 0; i < w; i++) s[i] = ' ';
        ind = jv_strn(s, (size_t)(w > 0 ? w : 0));
    }
    bool first = given(&p[1]) && jv_truthy(&p[1]), blank = given(&p[2]) && jv_truthy(&p[2]);
    /* s + "\n", split into lines as str.splitlines() does */
    jlist *lines = jl_new(st, 8);
    const char *s = in.u.s.p;
    size_t n = in.u.s.n, i = 0, start = 0;
    while (i < n) {
        size_t k = py_linebreak(s, n, i);
        if (!k) { size_t j = i; u8_next(s, n, &j); i = j; continue; }
        jl_push(st, lines, jv_strn(s + start, i - start));
        i += k;
        start = i;
    }
    jl_push(st, lines, jv_strn(s + start, n - start)); /* the line the added "\n" ends */
    jbuf b = {0};
    if (first) jb_put(st, &b, ind.u.s.p, ind.u.s.n);
    for (size_t k = 0; k < lines->n; k++) {
        const jv *l = &lines->v[k];
        if (k) {
            jb_put(st, &b, "\n", 1);
            if (blank || l->u.s.n) jb_put(st, &b, ind.u.s.p, ind.u.s.n);
        }
        jb_put(st, &b, l->u.s.p, l->u.s.n);
    }
    return markup_like(jv_strn(b.p ? b.p : "", b.n), &in);
}

static jv f_items(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    (void)line;
    if (in.t == JV_UNDEF) return gen(jl_new(st, 0));
    if (in.t != JV_DICT) { /* raised when iterated */
        jlist *l = jl_new(st, 0);
        l->err = "Can only get item pairs from a mapping.";
        return gen(l);
    }
    return gen(dict_view(st, in.u.d, 0));
}

static jv f_join(jstate *st, int line, jv in, const jargs *a) {
    BIND("join", "d", "attribute");
    jv sep = given(&p[0]) ? soft_str(st, line, &p[0]) : jv_strn("", 0);
    jlist *items = jv_iter(st, &in, line);
    jbuf b = {0};
    for (size_t i = 0; i < items->n; i++) {
        jv x = items->v[i];
        if (given(&p[1]) && p[1].t != JV_NONE) x = attr_path(st, line, x, &p[1], NULL);
        if (i) jb_put(st, &b, sep.u.s.p, sep.u.s.n);
        jb_str(st, &b, &x, line);
    }
    return jv_strn(b.p ? b.p : "", b.n);
}

static jv f_length(jstate *st, int line, jv in, const jargs *a) { (void)a; return jv_int(jv_len(st, &in, line)); }

static jv f_list(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    jlist *items = jv_iter(st, &in, line);
    jlist *l = jl_new(st, items->n);
    memcpy(l->v, items->v, items->n * sizeof *l->v);
    l->n = items->n;
    return jv_list(l);
}

static jv f_lower(jstate *st, int line, jv in, const jargs *a) { (void)a; return py_str_lower(st, soft_str(st, line, &in)); }
static jv f_upper(jstate *st, int line, jv in, const jargs *a) { (void)a; return py_str_upper(st, soft_str(st, line, &in)); }

static jv f_map(jstate *st, int line, jv in, const jargs *a) {
    jv lazy;
    if (lazy_fail(st, &in, &lazy)) return lazy;
    jlist *items = jv_iter(st, &in, line), *out = jl_new(st, items->n);
    int attr = -1, dflt = -1;
    for (int k = 0; k < a->nkw; k++) {
        if (kw_eq(a, k, "attribute")) attr = k;
        else if (kw_eq(a, k, "default")) dflt = k;
    }
    if (!a->npos && attr >= 0) {
        for (int k = 0; k < a->nkw; k++)
            if (k != attr && k != dflt) jr_fail(st, line, "Unexpected keyword argument '%.*s'", (int)a->knl[k], a->kn[k]);
        for (size_t i = 0; i < items->n; i++)
            out->v[out->n++] = attr_path(st, line, items->v[i], &a->kv[attr], dflt >= 0 ? &a->kv[dflt] : NULL);
        return gen(out);
    }
    if (!a->npos) jr_fail(st, line, "map requires a filter argument");
    const jv *fname = as_str(st, line, &a->pos[0], "map");
    int fid = jinja_filter_find(fname->u.s.p, fname->u.s.n);
    jargs rest = *a;
    rest.pos++;
    rest.npos--;
    for (size_t i = 0; i < items->n; i++) {
        jr_step(st, line);
        out->v[out->n++] = jinja_call_filter(st, line, fid, fname->u.s.p, fname->u.s.n, items->v[i], &rest);
    }
    return gen(out);
}

static jv min_max(jstate *st, int line, jv in, const jargs *a, bool max) {
    BIND(max ? "max" : "min", "case_sensitive", "attribute");
    bool cs = given(&p[0]) && jv_truthy(&p[0]);
    jlist *items = jv_iter(st, &in, line);
    if (!items->n) return jv_undef;
    jv best = items->v[0], bk = {0};
    for (size_t i = 0; i < items->n; i++) {
        jv k = items->v[i];
        if (given(&p[1]) && p[1].t != JV_NONE) k = attr_path(st, line, k, &p[1], NULL);
        k = ignore_case(st, k, cs);
        if (!i) { bk = k; continue; }
        int c = jv_cmp(st, line, &k, &bk, 0);
        if (max ? c > 0 : c < 0) { best = items->v[i]; bk = k; }
    }
    return best;
}
static jv f_min(jstate *st, int line, jv in, const jargs *a) { return min_max(st, line, in, a, false); }
static jv f_max(jstate *st, int line, jv in, const jargs *a) { return min_max(st, line, in, a, true); }

static jv select_reject(jstate *st, int line, jv in, const jargs *a, bool attr, bool keep) {
    jlist *out = jl_new(st, 0);
    if (!jv_truthy(&in)) return gen(out);
    jv lazy;
    if (lazy_fail(st, &in, &lazy)) return lazy;
    jlist *items = jv_iter(st, &in, line);
    int off = attr ? 1 : 0;
    if (attr && a->npos < 1) jr_fail(st, line, "Missing parameter for attribute name");
    const jv *tname = a->npos > off ? as_str(st, line, &a->pos[off], "select") : NULL;
    int tid = tname ? jinja_test_find(tname->u.s.p, tname->u.s.n) : -1;
    jargs rest = *a; /* the test's own arguments: those after its name */
    rest.pos = a->npos > off + 1 ? a->pos + off + 1 : NULL;
    rest.npos = a->npos > off + 1 ? a->npos - off - 1 : 0;
    for (size_t i = 0; i < items->n; i++) {
        jv x = attr ? attr_path(st, line, items->v[i], &a->pos[0], NULL) : items->v[i];
        jr_step(st, line);
        bool t = tname ? jinja_call_test(st, line, tid, tname->u.s.p, tname->u.s.n, x, &rest) : jv_truthy(&x);
        if (t == keep) jl_push(st, out, items->v[i]);
    }
    return gen(out);
}
static jv f_select(jstate *st, int line, jv in, const jargs *a) { return select_reject(st, line, in, a, false, true); }
static jv f_reject(jstate *st, int line, jv in, const jargs *a) { return select_reject(st, line, in, a, false, false); }
static jv f_selectattr(jstate *st, int line, jv in, const jargs *a) { return select_reject(st, line, in, a, true, true); }
static jv f_rejectattr(jstate *st, int line, jv in, const jargs *a) { return select_reject(st, line, in, a, true, false); }

static jv f_replace(jstate *st, int line, jv in, const jargs *a) {
    BIND("replace", "old", "new", "count");
    if (!given(&p[1])) jr_fail(st, line, "replace takes at least 2 arguments");
    jv s = soft_str(st, line, &in);
    s.fl = 0; /* no autoescape: str(s).replace(str(old), str(new)) */
    jv o = soft_str(st, line, &p[0]), w = soft_str(st, line, &p[1]);
    int64_t c = given(&p[2]) && p[2].t != JV_NONE ? as_int(st, line, &p[2], "replace") : -1;
    jv r = py_str_replace(st, s, o, w, c);
    r.fl = 0;
    return r;
}

static jv f_reverse(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    if (in.t == JV_STR) return py_str_slice(st, in, (int64_t)u8_count(in.u.s.p, in.u.s.n) - 1, -1, -1);
    if (in.t == JV_LIST && (in.fl & JVF_GEN)) { /* reversed() refuses; list(value).reverse() */
        jlist *items = jv_iter(st, &in, line), *l = jl_new(st, items->n);
        for (size_t i = items->n; i-- > 0;) l->v[l->n++] = items->v[i];
        return jv_list(l);
    }
    jlist *items = jv_iter(st, &in, line), *l = jl_new(st, items->n);
    for (size_t i = items->n; i-- > 0;) l->v[l->n++] = items->v[i];
    return gen(l);
}

static jv f_round(jstate *st, int line, jv in, const jargs *a) {
    BIND("round", "precision", "method");
    int64_t prec = given(&p[0]) ? as_int(st, line, &p[0], "round") : 0;
    const char *m = "common";
    if (given(&p[1])) {
        const jv *ms = as_str(st, line, &p[1], "round");
        if (ms->u.s.n == 4 && !memcmp(ms->u.s.p, "ceil", 4)) m = "ceil";
        else if (ms->u.s.n == 5 && !memcmp(ms->u.s.p, "floor", 5)) m = "floor";
        else if (!(ms->u.s.n == 6 && !memcmp(ms->u.s.p, "common", 6))) jr_fail(st, line, "method must be common, ceil or floor");
    }
    if (in.t == JV_UNDEF) jr_fail_undef(st, line, &in);
    if (!is_num(&in)) jr_fail(st, line, "type %s doesn't define __round__ method", jv_type_name(&in));
    if (prec > 300 || prec < -300) jr_fail(st, line, "round: precision out of range");
    if (m[0] == 'c' && m[1] == 'o') {
        if (in.t != JV_FLOAT) {
            if (prec >= 0) return jv_int(num_i(&in));
            jr_fail(st, line, "round: a negative precision on an integer is not supported");
        }
        double x = in.u.f;
        if (!isfinite(x)) return in;
        if (prec < 0) jr_fail(st, line, "round: a negative precision is not supported");
        char buf[400];
        snprintf(buf, sizeof buf, "%.*f", (int)prec, x); /* correctly rounded, ties to even: Python's round */
        return jv_float(strtod(buf, NULL));
    }
    double scale = pow(10.0, (double)prec), x = num_f(&in) * scale;
    return jv_float((m[0] == 'c' ? ceil(x) : floor(x)) / scale);
}

static jv f_safe(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    jv s = soft_str(st, line, &in);
    s.fl = JVF_MARKUP;
    return s;
}

static jv f_slice(jstate *st, int line, jv in, const jargs *a) {
    BIND("slice", "slices", "fill_with");
    int64_t slices = as_int(st, line, &p[0], "slice");
    if (slices <= 0 || slices > 100000) jr_fail(st, line, "slice: slices out of range");
    jlist *items = jv_iter(st, &in, line), *out = jl_new(st, (size_t)slices);
    size_t len = items->n, per = len / (size_t)slices, extra = len % (size_t)slices, off = 0;
    for (size_t s = 0; s < (size_t)slices; s++) {
        size_t start = off + s * per;
        if (s < extra) off++;
        size_t end = off + (s + 1) * per;
        jlist *t = jl_new(st, end - start + 1);
        for (size_t k = start; k < end; k++) t->v[t->n++] = items->v[k];
        if (given(&p[1]) && p[1].t != JV_NONE && s >= extra) t->v[t->n++] = p[1];
        out->v[out->n++] = jv_list(t);
    }
    return gen(out);
}

static jv f_sort(jstate *st, int line, jv in, const jargs *a) {
    BIND("sort", "reverse", "case_sensitive", "attribute");
    bool rev = given(&p[0]) && jv_truthy(&p[0]), cs = given(&p[1]) && jv_truthy(&p[1]);
    jlist *items = jv_iter(st, &in, line);
    jv *keys = jr_alloc(st, (items->n + 1) * sizeof *keys);
    bool attr = given(&p[2]) && p[2].t != JV_NONE;
    /* attribute="a,b": a list of keys */
    jlist *parts = NULL;
    if (attr && p[2].t == JV_STR && memchr(p[2].u.s.p, ',', p[2].u.s.n)) {
        jv comma = jv_cstr(",");
        parts = py_str_split(st, p[2], &comma, -1, false, line);
    }
    for (size_t i = 0; i < items->n; i++) {
        jv x = items->v[i];
        if (parts) {
            jlist *k = jl_new(st, parts->n);
            for (size_t j = 0; j < parts->n; j++) k->v[k->n++] = ignore_case(st, attr_path(st, line, x, &parts->v[j], NULL), cs);
            keys[i] = jv_list(k);
        } else {
            keys[i] = ignore_case(st, attr ? attr_path(st, line, x, &p[2], NULL) : x, cs);
        }
    }
    return jv_list(sorted(st, line, items, keys, rev));
}

static jv f_string(jstate *st, int line, jv in, const jargs *a) { (void)a; return soft_str(st, line, &in); }

static jv f_sum(jstate *st, int line, jv in, const jargs *a) {
    BIND("sum", "attribute", "start");
    jv acc = given(&p[1]) ? p[1] : jv_int(0);
    jlist *items = jv_iter(st, &in, line);
    for (size_t i = 0; i < items->n; i++) {
        jv x = items->v[i];
        if (given(&p[0]) && p[0].t != JV_NONE) x = attr_path(st, line, x, &p[0], NULL);
        if (acc.t == JV_STR) jr_fail(st, line, "sum() can't sum strings [use ''.join(seq) instead]");
        acc = jinja_binop(st, line, JO_ADD, acc, x);
    }
    return acc;
}

static jv f_title(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    /* Jinja2's: words split at runs of [-\s({[<], each capitalised */
    jv s = soft_str(st, line, &in);
    jbuf b = {0};
    size_t i = 0, n = s.u.s.n;
    while (i < n) {
        size_t j = i;
        bool sepr = false;
        { size_t k = j; uint32_t c = u8_next(s.u.s.p, n, &k); sepr = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c); }
        while (j < n) {
            size_t k = j;
            uint32_t c = u8_next(s.u.s.p, n, &k);
            bool isep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c);
            if (isep != sepr) break;
            j = k;
        }
        jv piece = jv_strn(s.u.s.p + i, j - i);
        if (sepr) jb_put(st, &b, piece.u.s.p, piece.u.s.n);
        else {
            size_t k = 0;
            uint32_t c = u8_next(piece.u.s.p, piece.u.s.n, &k);
            jv head = jv_strn(piece.u.s.p, k), rest = jv_strn(piece.u.s.p + k, piece.u.s.n - k);
            (void)c;
            jv hu = py_str_upper(st, head), rl = py_str_lower(st, rest);
            jb_put(st, &b, hu.u.s.p, hu.u.s.n);
            jb_put(st, &b, rl.u.s.p, rl.u.s.n);
        }
        i = j;
    }
    return markup_like(jv_strn(b.p ? b.p : "", b.n), &s);
}

static jv f_tojson(jstate *st, int line, jv in, const jargs *a) {
    /* transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) */
    BIND("tojson", "ensure_ascii", "indent", "separators", "sort_keys");
    jjson_opts o = {0};
    o.ensure_ascii = given(&p[0]) && jv_truthy(&p[0]);
    o.sort_keys = given(&p[3]) && jv_truthy(&p[3]);
    if (given(&p[1]) && p[1].t != JV_NONE) {
        o.has_indent = true;
        if (p[1].t == JV_STR) { o.indent = p[1].u.s.p; o.indent_n = p[1].u.s.n; }
        else {
            int64_t w = as_int(st, line, &p[1], "tojson indent");
            if (w > 1000) jr_fail(st, line, "tojson: indent too large");
            char *s = jr_alloc(st, (size_t)(w > 0 ? w : 0) + 1);
            for (int64_t i = 0; i < w; i++) s[i] = ' ';
            o.indent = s;
            o.indent_n = (size_t)(w > 0 ? w : 0);
        }
    }
    o.item_sep = o.has_indent ? "," : ", ";
    o.item_sep_n = o.has_indent ? 1 : 2;
    o.key_sep = ": ";
    o.key_sep_n = 2;
    if (given(&p[2]) && p[2].t != JV_NONE) {
        jlist *sp = jv_iter(st, &p[2], line);
        if (sp->n != 2) jr_fail(st, line, "tojson: separators must be a pair of strings");
        const jv *i0 = as_str(st, line, &sp->v[0], "tojson separators"), *k0 = as_str(st, line, &sp->v[1], "tojson separators");
        o.item_sep = i0->u.s.p;
        o.item_sep_n = i0->u.s.n;
        o.key_sep = k0->u.s.p;
        o.key_sep_n = k0->u.s.n;
    }
    jbuf b = {0};
    jb_json(st, &b, &in, &o, 0, line);
    return jv_strn(b.p, b.n);
}

static jv f_trim(jstate *st, int line, jv in, const jargs *a) {
    BIND("trim", "chars");
    jv s = soft_str(st, line, &in);
    bool has = given(&p[0]) && p[0].t != JV_NONE;
    if (has) as_str(st, line, &p[0], "trim");
    return py_str_strip(st, s, has ? &p[0] : NULL, 3);
}

static jv f_truncate(jstate *st, int line, jv in, const jargs *a) {
    BIND("truncate", "length", "killwords", "end", "leeway");
    int64_t length = given(&p[0]) ? as_int(st, line, &p[0], "truncate") : 255;
    bool kill = given(&p[1]) && jv_truthy(&p[1]);
    jv end = given(&p[2]) ? *as_str(st, line, &p[2], "truncate") : jv_cstr("...");
    int64_t leeway = given(&p[3]) && p[3].t != JV_NONE ? as_int(st, line, &p[3], "truncate") : 5;
    int64_t endlen = (int64_t)u8_count(end.u.s.p, end.u.s.n);
    if (length < endlen) jr_fail(st, line, "expected length >= %lld, got %lld", (long long)endlen, (long long)length);
    if (leeway < 0) jr_fail(st, line, "expected leeway >= 0, got %lld", (long long)leeway);
    int64_t len = jv_len(st, &in, line);
    if (len <= length + leeway) return in;
    jv s = *as_str(st, line, &in, "truncate");
    jv head = py_str_slice(st, s, 0, length - endlen, 1);
    if (!kill) {
        jv sp = jv_cstr(" ");
        jlist *parts = py_str_split(st, head, &sp, 1, true, line);
        head = parts->v[0];
    }
    return concat_str(st, head, end);
}

static jv f_unique(jstate *st, int line, jv in, const jargs *a) {
    BIND("unique", "case_sensitive", "attribute");
    bool cs = given(&p[0]) && jv_truthy(&p[0]);
    jv lazy;
    if (lazy_fail(st, &in, &lazy)) return lazy;
    jlist *items = jv_iter(st, &in, line), *out = jl_new(st, 0), *seen = jl_new(st, 0);
    for (size_t i = 0; i < items->n; i++) {
        jv k = items->v[i];
        if (given(&p[1]) && p[1].t != JV_NONE) k = attr_path(st, line, k, &p[1], NULL);
        k = ignore_case(st, k, cs);
        if (!jv_hashable(&k)) jr_fail(st, line, "unhashable type: '%s'", jv_type_name(&k));
        jr_steps(st, line, (long)(seen->n / 64));
        bool dup = false;
        for (size_t j = 0; j < seen->n && !dup; j++) dup = jv_eq(st, &seen->v[j], &k, 0);
        if (dup) continue;
        jl_push(st, seen, k);
        jl_push(st, out, items->v[i]);
    }
    return gen(out);
}

static jv f_wordcount(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    jv s = soft_str(st, line, &in);
    return jv_int((int64_t)py_wordcount(s.u.s.p, s.u.s.n));
}

static jv f_format(jstate *st, int line, jv in, const jargs *a) {
    if (a->npos && a->nkw) jr_fail(st, line, "can't handle positional and keyword arguments at the same time");
    jv s = soft_str(st, line, &in);
    if (a->nkw) {
        jdict *d = jd_new(st, (size_t)a->nkw);
        for (int k = 0; k < a->nkw; k++) jd_set(st, d, jv_strn(a->kn[k], a->knl[k]), a->kv[k]);
        return printf_format(st, line, s, jv_dict(d));
    }
    jlist *l = jl_new(st, (size_t)a->npos);
    for (int i = 0; i < a->npos; i++) l->v[l->n++] = a->pos[i];
    return printf_format(st, line, s, jv_tuple(l));
}

static jv f_groupby(jstate *st, int line, jv in, const jargs *a) {
    BIND("groupby", "attribute", "default", "case_sensitive");
    bool cs = given(&p[2]) && jv_truthy(&p[2]);
    jlist *items = jv_iter(st, &in, line);
    jv *keys = jr_alloc(st, (items->n + 1) * sizeof *keys);
    for (size_t i = 0; i < items->n; i++) keys[i] = ignore_case(st, attr_path(st, line, items->v[i], &p[0], &p[1]), cs);
    jlist *s = sorted(st, line, items, keys, false);
    for (size_t i = 0; i < s->n; i++) keys[i] = ignore_case(st, attr_path(st, line, s->v[i], &p[0], &p[1]), cs);
    jlist *out = jl_new(st, 0);
    for (size_t i = 0; i < s->n;) {
        size_t j = i;
        jlist *grp = jl_new(st, 0);
        while (j < s->n && jv_eq(st, &keys[j], &keys[i], 0)) jl_push(st, grp, s->v[j++]);
        jlist *t = jl_new(st, 2);
        t->v[0] = cs ? keys[i] : attr_path(st, line, s->v[i], &p[0], &p[1]);
        t->v[1] = jv_list(grp);
        t->n = 2;
        jl_push(st, out, jv_tuple(t));
        i = j;
    }
    return jv_list(out);
}

static const struct { const char *name; filter_fn fn; } k_filters[] = {
    {"abs", f_abs}, {"attr", f_attr}, {"batch", f_batch}, {"capitalize", f_capitalize}, {"center", f_center},
    {"count", f_length}, {"d", f_default}, {"default", f_default}, {"dictsort", f_dictsort}, {"e", f_escape},
    {"escape", f_escape}, {"filesizeformat", NULL}, {"first", f_first}, {"float", f_float},
    {"forceescape", f_forceescape}, {"format", f_format}, {"groupby", f_groupby}, {"indent", f_indent},
    {"int", f_int}, {"join", f_join}, {"last", f_last}, {"length", f_length}, {"list", f_list}, {"lower", f_lower},
    {"items", f_items}, {"map", f_map}, {"min", f_min}, {"max", f_max}, {"pprint", NULL}, {"random", NULL},
    {"reject", f_reject}, {"rejectattr", f_rejectattr}, {"replace", f_replace}, {"reverse", f_reverse},
    {"round", f_round}, {"safe", f_safe}, {"select", f_select}, {"selectattr", f_selectattr}, {"slice", f_slice},
    {"sort", f_sort}, {"string", f_string}, {"striptags", NULL}, {"sum", f_sum}, {"title", f_title},
    {"trim", f_trim}, {"truncate", f_truncate}, {"unique", f_unique}, {"upper", f_upper}, {"urlencode", NULL},
    {"urlize", NULL}, {"wordcount", f_wordcount}, {"wordwrap", NULL}, {"xmlattr", NULL}, {"tojson", f_tojson},
};

int jinja_filter_find(const char *name, size_t n) {
    for (size_t i = 0; i < sizeof k_filters / sizeof k_filters[0]; i++)
        if (strlen(k_filters[i].name) == n && !memcmp(k_filters[i].name, name, n)) return (int)i;
    return -1;
}

jv jinja_call_filter(jstate *st, int line, int fid, const char *name, size_t n, jv in, const jargs *a) {
    if (fid < 0) jr_fail(st, line, "no filter named '%.*s'", (int)n, name);
    if (!k_filters[fid].fn) jr_fail(st, line, "filter '%s' is not supported", k_filters[fid].name);
    return k_filters[fid].fn(st, line, in, a);
}

/* ---- tests ---- */

typedef bool (*test_fn)(jstate *st, int line, jv in, const jargs *a);

static const jv *arg1(jstate *st, int line, const jargs *a, const char *what) {
    if (a->npos + a->nkw != 1) jr_fail(st, line, "test '%s' takes one argument", what);
    return a->npos ? &a->pos[0] : &a->kv[0];
}

static bool t_defined(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return in.t != JV_UNDEF; }
static bool t_undefined(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return in.t == JV_UNDEF; }
static bool t_none(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return in.t == JV_NONE; }
static bool t_boolean(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return in.t == JV_BOOL; }
static bool t_true(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return in.t == JV_BOOL && in.u.b; }
static bool t_false(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return in.t == JV_BOOL && !in.u.b; }
static bool t_integer(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return in.t == JV_INT; }
static bool t_float(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return in.t == JV_FLOAT; }
static bool t_number(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return is_num(&in); }
static bool t_string(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return in.t == JV_STR; }
static bool t_mapping(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return in.t == JV_DICT; }
static bool t_escaped(jstate *st, int line, jv in, const jargs *a) { (void)st; (void)line; (void)a; return in.t == JV_STR && (in.fl & JVF_MARKUP); }
static bool t_iterable(jstate *st, int line, jv in, const jargs *a) {
    (void)st; (void)line; (void)a;
    return in.t == JV_STR || in.t == JV_LIST || in.t == JV_TUPLE || in.t == JV_DICT || in.t == JV_RANGE || in.t == JV_UNDEF;
}
static bool t_sequence(jstate *st, int line, jv in, const jargs *a) {
    (void)st; (void)line; (void)a;
    if (in.t == JV_LIST) return !(in.fl & (JVF_GEN | JVF_VIEW));
    return in.t == JV_STR || in.t == JV_TUPLE || in.t == JV_DICT || in.t == JV_RANGE || in.t == JV_UNDEF;
}
static bool t_callable(jstate *st, int line, jv in, const jargs *a) {
    (void)st; (void)line; (void)a;
    return in.t == JV_MACRO || in.t == JV_FUNC || in.t == JV_METHOD || in.t == JV_LOOP || in.t == JV_JOINER ||
           in.t == JV_UNDEF;
}
static bool t_sameas(jstate *st, int line, jv in, const jargs *a) {
    const jv *o = arg1(st, line, a, "sameas");
    if (in.t != o->t) return false;
    switch (in.t) {
    case JV_NONE: case JV_UNDEF: return in.t == JV_NONE || in.u.s.p == o->u.s.p;
    case JV_BOOL: return in.u.b == o->u.b;
    case JV_INT: return in.u.i == o->u.i && in.u.i >= -5 && in.u.i <= 256; /* CPython's small ints */
    case JV_STR: return in.u.s.p == o->u.s.p && in.u.s.n == o->u.s.n;
    case JV_FUNC: return in.id == o->id;
    default: return in.u.l == o->u.l;
    }
}
static bool t_in(jstate *st, int line, jv in, const jargs *a) { return jinja_in(st, line, in, *arg1(st, line, a, "in")); }
static bool t_eq(jstate *st, int line, jv in, const jargs *a) { return jv_eq(st, &in, arg1(st, line, a, "eq"), 0); }
static bool t_ne(jstate *st, int line, jv in, const jargs *a) { return !jv_eq(st, &in, arg1(st, line, a, "ne"), 0); }
static int cmp_arg(jstate *st, int line, jv in, const jargs *a) {
    const jv *o = arg1(st, line, a, "comparison");
    if (in.t == JV_UNDEF) jr_fail_undef(st, line, &in);
    return jv_cmp(st, line, &in, o, 0);
}
static bool t_lt(jstate *st, int line, jv in, const jargs *a) { return cmp_arg(st, line, in, a) < 0; }
static bool t_le(jstate *st, int line, jv in, const jargs *a) { return cmp_arg(st, line, in, a) <= 0; }
static bool t_gt(jstate *st, int line, jv in, const jargs *a) { return cmp_arg(st, line, in, a) > 0; }
static bool t_ge(jstate *st, int line, jv in, const jargs *a) { return cmp_arg(st, line, in, a) >= 0; }
static bool t_odd_even(jstate *st, int line, jv in, bool odd) {
    jv m = jinja_binop(st, line, JO_MOD, in, jv_int(2));
    jv one = jv_int(1);
    return jv_eq(st, &m, &one, 0) == odd;
}
static bool t_odd(jstate *st, int line, jv in, const jargs *a) { (void)a; return t_odd_even(st, line, in, true); }
static bool t_even(jstate *st, int line, jv in, const jargs *a) { (void)a; return t_odd_even(st, line, in, false); }
static bool t_divisibleby(jstate *st, int line, jv in, const jargs *a) {
    jv m = jinja_binop(st, line, JO_MOD, in, *arg1(st, line, a, "divisibleby"));
    jv zero = jv_int(0);
    return jv_eq(st, &m, &zero, 0);
}
static bool t_lower(jstate *st, int line, jv in, const jargs *a) { (void)a; return py_str_cased_test(soft_str(st, line, &in), false); }
static bool t_upper(jstate *st, int line, jv in, const jargs *a) { (void)a; return py_str_cased_test(soft_str(st, line, &in), true); }
static bool t_filter(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    if (in.t != JV_STR) return false;
    (void)st; (void)line;
    return jinja_filter_find(in.u.s.p, in.u.s.n) >= 0;
}
static bool t_test(jstate *st, int line, jv in, const jargs *a) {
    (void)a;
    (void)st; (void)line;
    return in.t == JV_STR && jinja_test_find(in.u.s.p, in.u.s.n) >= 0;
}

static const struct { const char *name; test_fn fn; } k_tests[] = {
    {"odd", t_odd}, {"even", t_even}, {"divisibleby", t_divisibleby}, {"defined", t_defined},
    {"undefined", t_undefined}, {"filter", t_filter}, {"test", t_test}, {"none", t_none}, {"boolean", t_boolean},
    {"false", t_false}, {"true", t_true}, {"integer", t_integer}, {"float", t_float}, {"lower", t_lower},
    {"upper", t_upper}, {"string", t_string}, {"mapping", t_mapping}, {"number", t_number},
    {"sequence", t_sequence}, {"iterable", t_iterable}, {"callable", t_callable}, {"sameas", t_sameas},
    {"escaped", t_escaped}, {"in", t_in}, {"==", t_eq}, {"eq", t_eq}, {"equalto", t_eq}, {"!=", t_ne},
    {"ne", t_ne}, {">", t_gt}, {"gt", t_gt}, {"greaterthan", t_gt}, {"ge", t_ge}, {">=", t_ge}, {"<", t_lt},
    {"lt", t_lt}, {"lessthan", t_lt}, {"<=", t_le}, {"le", t_le},
};

int jinja_test_find(const char *name, size_t n) {
    for (size_t i = 0; i < sizeof k_tests / sizeof k_tests[0]; i++)
        if (strlen(k_tests[i].name) == n && !memcmp(k_tests[i].name, name, n)) return (int)i;
    return -1;
}

bool jinja_call_test(jstate *st, int line, int tid, const char *name, size_t n, jv in, const jargs *a) {
    if (tid < 0) jr_fail(st, line, "no test named '%.*s'", (int)n, name);
    return k_tests[tid].fn(st, line, in, a);
}
