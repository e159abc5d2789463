/* tok/jinja_eval: rendering a parsed template: scopes as Jinja2 keeps them
 * (a loop iteration, a macro call, a with or filter block each its own;
 * namespaces shared), statements, expressions, macros and call blocks,
 * under the render's limits (steps, output, recursion, memory). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tok/jinja_internal.h"
#include "util/error.h"

enum { FLOW_NEXT = 0, FLOW_BREAK = 1, FLOW_CONTINUE = 2 };

static jv eval(jstate *st, jframe *f, const jnode *n);
static int exec_body(jstate *st, jframe *f, const jnode *body);

/* ---- failing, steps, memory ---- */

_Noreturn void jr_fail(jstate *st, int line, const char *fmt, ...) {
    if (!line) line = st->line;
    int k = line > 0 ? snprintf(st->msg, sizeof st->msg, "line %d: ", line) : 0;
    if (k < 0 || (size_t)k >= sizeof st->msg) k = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->msg + k, sizeof st->msg - (size_t)k, fmt, ap);
    va_end(ap);
    st->err_code = KVLM_EINVAL;
    longjmp(st->jb, 1);
}

_Noreturn void jr_fail_raw(jstate *st, int code, const char *msg, size_t n) {
    if (n >= sizeof st->msg) n = sizeof st->msg - 1;
    memcpy(st->msg, msg, n);
    st->msg[n] = 0;
    st->err_code = code;
    longjmp(st->jb, 1);
}

static const char *type_name_t(int t) {
    jv v = {.t = (uint8_t)t};
    return jv_type_name(&v);
}

_Noreturn void jr_fail_undef(jstate *st, int line, const jv *u) {
    int n = (int)(u->u.s.n > 200 ? 200 : u->u.s.n);
    if (u->fl & JVF_UNSAFE)
        jr_fail(st, line, "access to attribute '%.*s' of '%s' object is unsafe", n, u->u.s.p, type_name_t(u->id - 1));
    if (u->id) jr_fail(st, line, "'%s object' has no attribute '%.*s'", type_name_t(u->id - 1), n, u->u.s.p);
    if (u->u.s.p) jr_fail(st, line, "'%.*s' is undefined", n, u->u.s.p);
    jr_fail(st, line, "an undefined value (a missing item, or an if expression without else) was used");
}

_Noreturn void jr_oom(jstate *st) {
    if (!st->arena.over) { /* malloc itself said no */
        st->err_code = KVLM_ENOMEM;
        snprintf(st->msg, sizeof st->msg, "out of memory");
        longjmp(st->jb, 1);
    }
    jr_fail(st, 0, "memory limit reached (%zu MiB)", st->arena.limit >> 20);
}

void *jr_alloc(jstate *st, size_t n) {
    void *p = ja_alloc(&st->arena, n ? n : 1);
    if (!p) jr_oom(st);
    return p;
}

void jr_steps(jstate *st, int line, long k) {
    st->steps += k;
    if (st->steps > st->max_steps) jr_fail(st, line, "step limit reached (%ld statements, loop iterations and calls)", st->max_steps);
}

static void enter(jstate *st, int line) {
    if (++st->depth > st->max_depth) jr_fail(st, line, "nesting too deep (the evaluator's limit is %d levels)", st->max_depth);
}

/* ---- scopes ---- */

static jframe *frame_new(jstate *st, jframe *parent) {
    jframe *f = jr_alloc(st, sizeof *f);
    memset(f, 0, sizeof *f);
    f->parent = parent;
    return f;
}

static void frame_set(jstate *st, jframe *f, const char *name, size_t n, jv v) {
    for (int i = 0; i < f->n; i++)
        if (f->name_n[i] == n && !memcmp(f->names[i], name, n)) { f->vals[i] = v; return; }
    if (f->n == f->cap) {
        int nc = f->cap ? f->cap * 2 : 4;
        const char **nn = ja_grow(&st->arena, f->names, (size_t)f->cap * sizeof *nn, (size_t)nc * sizeof *nn);
        size_t *nl = nn ? ja_grow(&st->arena, f->name_n, (size_t)f->cap * sizeof *nl, (size_t)nc * sizeof *nl) : NULL;
        jv *nv = nl ? ja_grow(&st->arena, f->vals, (size_t)f->cap * sizeof *nv, (size_t)nc * sizeof *nv) : NULL;
        if (!nv) jr_oom(st);
        f->names = nn;
        f->name_n = nl;
        f->vals = nv;
        f->cap = nc;
    }
    f->names[f->n] = name;
    f->name_n[f->n] = n;
    f->vals[f->n] = v;
    f->n++;
}

static jv lookup(jstate *st, jframe *f, const char *name, size_t n) {
    for (; f; f = f->parent)
        for (int i = f->n; i-- > 0;)
            if (f->name_n[i] == n && !memcmp(f->names[i], name, n)) return f->vals[i];
    jv *v = jd_get_str(st->vars, name, n);
    if (v) return *v;
    jv g = jinja_global(name, n);
    if (g.t != JV_MISSING) return g;
    return jv_undef_named(name, n);
}

/* ---- arguments ---- */

static void eval_args(jstate *st, jframe *f, const jnode *n, jargs *a, int extra_kw) {
    if (!n->nv && !n->nw && !n->b && !n->c && !extra_kw) { /* the common x|trim, s.strip(): nothing to allocate */
        *a = (jargs){0};
        return;
    }
    int npos = n->nv, nkw = n->nw;
    jv dyn = {.t = JV_MISSING}, dynk = {.t = JV_MISSING};
    jlist *dl = NULL;
    if (n->b) {
        dyn = eval(st, f, n->b);
        dl = jv_iter(st, &dyn, n->line);
        npos += (int)dl->n;
    }
    if (n->c) {
        dynk = eval(st, f, n->c);
        if (dynk.t != JV_DICT) jr_fail(st, n->line, "argument after ** must be a mapping, not %s", jv_type_name(&dynk));
        nkw += (int)dynk.u.d->n;
    }
    a->pos = jr_alloc(st, (size_t)(npos + 1) * sizeof *a->pos);
    a->kn = jr_alloc(st, (size_t)(nkw + extra_kw + 1) * sizeof *a->kn);
    a->knl = jr_alloc(st, (size_t)(nkw + extra_kw + 1) * sizeof *a->knl);
    a->kv = jr_alloc(st, (size_t)(nkw + extra_kw + 1) * sizeof *a->kv);
    a->npos = 0;
    a->nkw = 0;
    for (int i = 0; i < n->nv; i++) a->pos[a->npos++] = eval(st, f, n->v[i]);
    if (dl)
        for (size_t i = 0; i < dl->n; i++) a->pos[a->npos++] = dl->v[i];
    for (int i = 0; i < n->nw; i++) {
        a->kn[a->nkw] = n->w[i]->name;
        a->knl[a->nkw] = n->w[i]->name_n;
        a->kv[a->nkw++] = eval(st, f, n->w[i]->a);
    }
    if (dynk.t == JV_DICT)
        for (size_t i = 0; i < dynk.u.d->n; i++) {
            const jv *k = &dynk.u.d->k[i];
            if (k->t != JV_STR) jr_fail(st, n->line, "keywords must be strings");
            a->kn[a->nkw] = k->u.s.p;
            a->knl[a->nkw] = k->u.s.n;
            a->kv[a->nkw++] = dynk.u.d->v[i];
        }
}

/* ---- assignment ---- */

static void assign(jstate *st, jframe *f, const jnode *t, jv v) {
    if (t->k == JN_NAME) { frame_set(st, f, t->name, t->name_n, v); return; }
    if (t->k == JN_NSREF) {
        jv ns = lookup(st, f, t->name, t->name_n);
        if (ns.t != JV_NS) jr_fail(st, t->line, "cannot assign attribute on non-namespace object");
        jd_set(st, ns.u.d, t->a->cv, v);
        return;
    }
    /* a tuple: unpack */
    jlist *items = jv_iter(st, &v, t->line);
    if ((int)items->n < t->nv)
        jr_fail(st, t->line, "not enough values to unpack (expected %d, got %zu)", t->nv, items->n);
    if ((int)items->n > t->nv) jr_fail(st, t->line, "too many values to unpack (expected %d)", t->nv);
    for (int i = 0; i < t->nv; i++) assign(st, f, t->v[i], items->v[i]);
}

/* ---- macros ---- */

static jv capture(jstate *st, jframe *f, const jnode *body, int *flow) {
    jbuf b = {0};
    jbuf *save = st->out;
    st->out = &b;
    int fl = exec_body(st, f, body);
    if (flow) *flow = fl;
    st->out = save;
    return jv_strn(b.p ? b.p : "", b.n);
}

static bool kw_is(const jargs *a, int i, const char *s) { return a->knl[i] == strlen(s) && !memcmp(a->kn[i], s, a->knl[i]); }

static jv call_macro(jstate *st, int line, const jmacro *m, const jargs *a) {
    const jnode *def = m->def;
    const char *mname = def->k == JN_MACRO ? def->name : "caller";
    int mlen = def->k == JN_MACRO ? (int)def->name_n : 6;
    jr_step(st, line);
    enter(st, line);
    jframe *g = frame_new(st, m->closure);
    bool *used = jr_alloc(st, (size_t)(a->nkw + 1) * sizeof *used);
    memset(used, 0, (size_t)(a->nkw + 1) * sizeof *used);
    jv caller = {.t = JV_MISSING};
    for (int k = 0; k < a->nkw; k++)
        if ((def->fl & JNF_CALLER) && kw_is(a, k, "caller")) { caller = a->kv[k]; used[k] = true; }
    for (int i = 0; i < def->nv; i++) {
        const jnode *p = def->v[i];
        jv val = {.t = JV_MISSING};
        if (i < a->npos) val = a->pos[i];
        for (int k = 0; k < a->nkw; k++)
            if (!used[k] && a->knl[k] == p->name_n && !memcmp(a->kn[k], p->name, p->name_n)) {
                if (val.t != JV_MISSING)
                    jr_fail(st, line, "macro '%.*s' got multiple values for argument '%.*s'", mlen, mname,
                            (int)p->name_n, p->name);
                val = a->kv[k];
                used[k] = true;
            }
        if (val.t == JV_MISSING) val = p->a ? eval(st, g, p->a) : jv_undef_named(p->name, p->name_n);
        frame_set(st, g, p->name, p->name_n, val);
    }
    if (a->npos > def->nv && !(def->fl & JNF_VARARGS))
        jr_fail(st, line, "macro '%.*s' takes not more than %d argument(s)", mlen, mname, def->nv);
    if (def->fl & JNF_VARARGS) {
        jlist *va = jl_new(st, 0);
        for (int i = def->nv; i < a->npos; i++) jl_push(st, va, a->pos[i]);
        frame_set(st, g, "varargs", 7, jv_tuple(va));
    }
    jdict *kw = jd_new(st, 0);
    for (int k = 0; k < a->nkw; k++) {
        if (used[k]) continue;
        if (!(def->fl & JNF_KWARGS)) {
            if (kw_is(a, k, "caller"))
                jr_fail(st, line, "macro '%.*s' was invoked with two values for the special caller argument", mlen, mname);
            jr_fail(st, line, "macro '%.*s' takes no keyword argument '%.*s'", mlen, mname, (int)a->knl[k], a->kn[k]);
        }
        jd_set(st, kw, jv_strn(a->kn[k], a->knl[k]), a->kv[k]);
    }
    if (def->fl & JNF_KWARGS) frame_set(st, g, "kwargs", 6, jv_dict(kw));
    if (def->fl & JNF_CALLER)
        frame_set(st, g, "caller", 6, caller.t == JV_MISSING ? jv_undef_named("caller", 6) : caller);
    jv r = capture(st, g, def->d, NULL);
    st->depth--;
    return r;
}

/* ---- loops ---- */

static jv loop_item(const jloop *lp, size_t i) {
    if (lp->items) return lp->items->v[i];
    return jv_int(jv_range_at(lp->r, i));
}

jv jinja_loop_attr(jstate *st, int line, jloop *lp, const char *name, size_t n) {
    (void)st;
    (void)line;
#define IS(s) (n == sizeof s - 1 && !memcmp(name, s, n))
    if (IS("index")) return jv_int((int64_t)lp->i + 1);
    if (IS("index0")) return jv_int((int64_t)lp->i);
    if (IS("revindex")) return jv_int((int64_t)(lp->n - lp->i));
    if (IS("revindex0")) return jv_int((int64_t)(lp->n - lp->i - 1));
    if (IS("first")) return jv_bool(lp->i == 0);
    if (IS("last")) return jv_bool(lp->i + 1 == lp->n);
    if (IS("length")) return jv_int((int64_t)lp->n);
    if (IS("depth")) return jv_int(lp->depth0 + 1);
    if (IS("depth0")) return jv_int(lp->depth0);
    if (IS("previtem")) return lp->i ? loop_item(lp, lp->i - 1) : jv_undef_named("previtem", 8);
    if (IS("nextitem")) return lp->i + 1 < lp->n ? loop_item(lp, lp->i + 1) : jv_undef_named("nextitem", 8);
    if (IS("cycle") || IS("changed")) {
        jmethod *m = jr_alloc(st, sizeof *m);
        m->self.t = JV_LOOP;
        m->self.u.lp = lp;
        m->name = IS("cycle") ? "cycle" : "changed";
        jv v = {.t = JV_METHOD};
        v.u.me = m;
        return v;
    }
#undef IS
    jv u = jv_undef_named(name, n);
    u.id = JV_LOOP + 1;
    return u;
}

static int run_loop(jstate *st, jframe *f, const jnode *n, jv it, int depth0) {
    jloop *lp = jr_alloc(st, sizeof *lp);
    memset(lp, 0, sizeof *lp);
    lp->node = n;
    lp->frame = f;
    lp->depth0 = depth0;
    lp->changed_last.t = JV_MISSING;
    if (it.t == JV_RANGE && !n->c) {
        lp->r = it.u.r;
        lp->n = (size_t)jv_range_len(it.u.r);
    } else {
        jlist *items = jv_iter(st, &it, n->line);
        if (n->c) { /* for x in xs if cond: the loop sees only what passes */
            jlist *kept = jl_new(st, items->n);
            jframe *g = frame_new(st, f);
            for (size_t i = 0; i < items->n; i++) {
                jr_step(st, n->line);
                g->n = 0;
                assign(st, g, n->a, items->v[i]);
                if (jv_truthy((jv[]){eval(st, g, n->c)})) kept->v[kept->n++] = items->v[i];
            }
            items = kept;
        }
        lp->items = items;
        lp->n = items->n;
    }
    if (!lp->n) {
        if (n->nv) exec_body(st, frame_new(st, f), n->v[0]);
        return FLOW_NEXT;
    }
    jv lv = {.t = JV_LOOP};
    lv.u.lp = lp;
    /* one scope for every iteration, emptied at each: what one sets does not
     * reach the next (as in Jinja2), and a long loop takes no memory per turn */
    jframe *g = frame_new(st, f);
    for (lp->i = 0; lp->i < lp->n; lp->i++) {
        jr_step(st, n->line);
        g->n = 0;
        assign(st, g, n->a, loop_item(lp, lp->i));
        frame_set(st, g, "loop", 4, lv);
        if (exec_body(st, g, n->d) == FLOW_BREAK) break;
    }
    return FLOW_NEXT;
}

/* ---- calls ---- */

jv jinja_call_value(jstate *st, int line, jv fn, const jargs *a) {
    switch (fn.t) {
    case JV_MACRO: return call_macro(st, line, fn.u.m, a);
    case JV_FUNC: jr_step(st, line); return jinja_call_func(st, line, fn.id, a);
    case JV_METHOD: jr_step(st, line); return jinja_call_method(st, line, fn.u.me, a);
    case JV_LOOP: {
        jloop *lp = fn.u.lp;
        if (!(lp->node->fl & JNF_RECURSIVE)) jr_fail(st, line, "the loop must be recursive to be called");
        if (a->npos != 1 || a->nkw) jr_fail(st, line, "loop() takes one argument (what to iterate)");
        enter(st, line);
        jbuf b = {0};
        jbuf *save = st->out;
        st->out = &b;
        run_loop(st, lp->frame, lp->node, a->pos[0], lp->depth0 + 1);
        st->out = save;
        st->depth--;
        return jv_strn(b.p ? b.p : "", b.n);
    }
    case JV_JOINER: {
        jcycler *c = fn.u.cy;
        if (a->npos || a->nkw) jr_fail(st, line, "a joiner takes no arguments");
        if (!c->used) { c->used = true; return jv_strn("", 0); }
        return jv_strn(c->sep, c->sep_n);
    }
    case JV_UNDEF: jr_fail_undef(st, line, &fn);
    default: jr_fail(st, line, "'%s' object is not callable", jv_type_name(&fn));
    }
}

/* ---- expressions ---- */

static int64_t slice_idx(jstate *st, int line, const jv *v, int64_t dflt, bool *ok) {
    if (v->t == JV_MISSING || v->t == JV_NONE) return dflt;
    if (v->t == JV_INT) return v->u.i;
    if (v->t == JV_BOOL) return v->u.b;
    (void)st;
    (void)line;
    *ok = false;
    return 0;
}

/* Python's slice.indices for a sequence of len items */
static void slice_adjust(int64_t len, int64_t step, int64_t *start, int64_t *stop, bool has_start, bool has_stop) {
    if (!has_start) *start = step < 0 ? len - 1 : 0;
    else {
        if (*start < 0) { *start += len; if (*start < 0) *start = step < 0 ? -1 : 0; }
        else if (*start >= len) *start = step < 0 ? len - 1 : len;
    }
    if (!has_stop) *stop = step < 0 ? -1 : len;
    else {
        if (*stop < 0) { *stop += len; if (*stop < 0) *stop = step < 0 ? -1 : 0; }
        else if (*stop >= len) *stop = step < 0 ? len - 1 : len;
    }
}

static jv do_slice(jstate *st, jframe *f, const jnode *n, jv obj) {
    const jnode *s = n->b;
    jv a = s->a ? eval(st, f, s->a) : (jv){.t = JV_MISSING};
    jv b = s->b ? eval(st, f, s->b) : (jv){.t = JV_MISSING};
    jv c = s->c ? eval(st, f, s->c) : (jv){.t = JV_MISSING};
    if (obj.t == JV_UNDEF) jr_fail_undef(st, n->line, &obj);
    bool ok = true;
    int64_t step = slice_idx(st, n->line, &c, 1, &ok);
    int64_t start = slice_idx(st, n->line, &a, 0, &ok), stop = slice_idx(st, n->line, &b, 0, &ok);
    bool has_start = a.t != JV_MISSING && a.t != JV_NONE, has_stop = b.t != JV_MISSING && b.t != JV_NONE;
    /* a slice is Python's own subscript (Jinja2 does not route it through getitem): errors are errors */
    if (!ok) jr_fail(st, n->line, "slice indices must be integers or None");
    if (!step) jr_fail(st, n->line, "slice step cannot be zero");
    if (step == INT64_MIN) step = -INT64_MAX;
    int64_t len;
    if (obj.t == JV_STR) len = (int64_t)u8_count(obj.u.s.p, obj.u.s.n);
    else if ((obj.t == JV_LIST || obj.t == JV_TUPLE) && !(obj.fl & (JVF_GEN | JVF_VIEW))) len = (int64_t)obj.u.l->n;
    else if (obj.t == JV_RANGE) len = jv_range_len(obj.u.r);
    else if (obj.t == JV_DICT) jr_fail(st, n->line, "unhashable type: 'slice'");
    else jr_fail(st, n->line, "'%s' object is not subscriptable", jv_type_name(&obj));
    slice_adjust(len, step, &start, &stop, has_start, has_stop);
    if (obj.t == JV_STR) return py_str_slice(st, obj, start, stop, step);
    if (obj.t == JV_RANGE) {
        jrange *r = jr_alloc(st, sizeof *r);
        r->start = jv_range_at(obj.u.r, (uint64_t)start);
        r->stop = jv_range_at(obj.u.r, (uint64_t)stop);
        if (__builtin_mul_overflow(obj.u.r->step, step, &r->step)) jr_fail(st, n->line, "integer overflow");
        jv v = {.t = JV_RANGE};
        v.u.r = r;
        return v;
    }
    jlist *l = jl_new(st, 0);
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        jl_push(st, l, obj.u.l->v[i]);
        if ((step > 0 && i > INT64_MAX - step) || (step < 0 && i < INT64_MIN - step)) break;
    }
    return obj.t == JV_LIST ? jv_list(l) : jv_tuple(l);
}

static bool compare(jstate *st, int line, int op, jv a, jv b) {
    switch (op) {
    case JO_EQ: return jv_eq(st, &a, &b, 0);
    case JO_NE: return !jv_eq(st, &a, &b, 0);
    case JO_IN: return jinja_in(st, line, a, b);
    case JO_NOTIN: return !jinja_in(st, line, a, b);
    default: break;
    }
    if (a.t == JV_UNDEF) jr_fail_undef(st, line, &a);
    if (b.t == JV_UNDEF) jr_fail_undef(st, line, &b);
    int c = jv_cmp(st, line, &a, &b, 0);
    bool nan = (a.t == JV_FLOAT && a.u.f != a.u.f) || (b.t == JV_FLOAT && b.u.f != b.u.f);
    if (nan) return false;
    switch (op) {
    case JO_LT: return c < 0;
    case JO_LTEQ: return c <= 0;
    case JO_GT: return c > 0;
    default: return c >= 0;
    }
}

static jv eval_filter(jstate *st, jframe *f, const jnode *n, jv in) {
    jargs a;
    eval_args(st, f, n, &a, 0);
    jr_step(st, n->line);
    return jinja_call_filter(st, n->line, n->fid, n->name, n->name_n, in, &a);
}

/* A filter chain whose innermost input is in (filter blocks, set blocks). */
static jv apply_chain(jstate *st, jframe *f, const jnode *n, jv in) {
    if (!n) return in;
    jv x = n->a ? apply_chain(st, f, n->a, in) : in;
    return eval_filter(st, f, n, x);
}

/* The cases of eval with locals of their own, kept out of its frame: a
 * chain of nested expressions recurses through eval, whose frame stays small. */
#define COLD __attribute__((noinline))

static COLD jv eval_getitem(jstate *st, jframe *f, const jnode *n) {
    jv obj = eval(st, f, n->a);
    if (n->b->k == JN_SLICE) return do_slice(st, f, n, obj);
    return jinja_getitem(st, n->line, obj, eval(st, f, n->b));
}

static COLD jv eval_call(jstate *st, jframe *f, const jnode *n) {
    jv fn = eval(st, f, n->a);
    jargs a;
    eval_args(st, f, n, &a, 0);
    return jinja_call_value(st, n->line, fn, &a);
}

static COLD jv eval_test(jstate *st, jframe *f, const jnode *n) {
    jv in = eval(st, f, n->a);
    jargs a;
    eval_args(st, f, n, &a, 0);
    jr_step(st, n->line);
    return jv_bool(jinja_call_test(st, n->line, n->fid, n->name, n->name_n, in, &a));
}

static COLD jv eval_unary(jstate *st, jframe *f, const jnode *n) {
    jv x = eval(st, f, n->a);
    if (x.t == JV_BOOL) x = jv_int(x.u.b);
    if (x.t == JV_INT) {
        if (n->k == JN_NEG && x.u.i == INT64_MIN) jr_fail(st, n->line, "integer overflow");
        return n->k == JN_NEG ? jv_int(-x.u.i) : x;
    }
    if (x.t == JV_FLOAT) return n->k == JN_NEG ? jv_float(-x.u.f) : x;
    if (x.t == JV_UNDEF) jr_fail_undef(st, n->line, &x);
    jr_fail(st, n->line, "bad operand type for unary %c: '%s'", n->k == JN_NEG ? '-' : '+', jv_type_name(&x));
}

static COLD jv eval_binop(jstate *st, jframe *f, const jnode *n) {
    jv a = eval(st, f, n->a);
    jv b = eval(st, f, n->b);
    return jinja_binop(st, n->line, n->op, a, b);
}

static COLD jv eval_concat(jstate *st, jframe *f, const jnode *n) {
    jbuf b = {0};
    for (int i = 0; i < n->nv; i++) {
        jv x = eval(st, f, n->v[i]);
        jb_str(st, &b, &x, n->line);
    }
    return jv_strn(b.p ? b.p : "", b.n);
}

static COLD jv eval_compare(jstate *st, jframe *f, const jnode *n) {
    jv left = eval(st, f, n->a);
    for (int i = 0; i < n->nv; i++) {
        jv right = eval(st, f, n->v[i]->a);
        if (!compare(st, n->v[i]->line, n->v[i]->op, left, right)) return jv_bool(false);
        left = right;
    }
    return jv_bool(true);
}

static COLD jv eval_collection(jstate *st, jframe *f, const jnode *n) {
    if (n->k != JN_DICT) {
        jlist *l = jl_new(st, (size_t)n->nv);
        for (int i = 0; i < n->nv; i++) l->v[l->n++] = eval(st, f, n->v[i]);
        return n->k == JN_LIST ? jv_list(l) : jv_tuple(l);
    }
    jdict *d = jd_new(st, (size_t)n->nv);
    for (int i = 0; i < n->nv; i++) {
        jv k = eval(st, f, n->v[i]);
        jv v = eval(st, f, n->w[i]);
        if (!jv_hashable(&k)) jr_fail(st, n->v[i]->line, "unhashable type: '%s'", jv_type_name(&k));
        jd_set(st, d, k, v);
    }
    return jv_dict(d);
}

static COLD jv eval_getattr(jstate *st, jframe *f, const jnode *n) {
    return jinja_getattr(st, n->line, eval(st, f, n->a), n->name, n->name_n);
}

static COLD jv eval_filter_node(jstate *st, jframe *f, const jnode *n) { return eval_filter(st, f, n, eval(st, f, n->a)); }

static COLD jv eval_logic(jstate *st, jframe *f, const jnode *n) {
    jv a = eval(st, f, n->a);
    switch (n->k) {
    case JN_NOT: return jv_bool(!jv_truthy(&a));
    case JN_AND: return jv_truthy(&a) ? eval(st, f, n->b) : a;
    case JN_OR: return jv_truthy(&a) ? a : eval(st, f, n->b);
    default: /* JN_CONDEXPR: a is the condition */
        if (jv_truthy(&a)) return eval(st, f, n->b);
        return n->c ? eval(st, f, n->c) : jv_undef;
    }
}

static jv eval(jstate *st, jframe *f, const jnode *n) {
    enter(st, n->line);
    jv r;
    switch (n->k) {
    case JN_CONST: r = n->cv; break;
    case JN_NAME: r = lookup(st, f, n->name, n->name_n); break;
    case JN_GETATTR: r = eval_getattr(st, f, n); break;
    case JN_GETITEM: r = eval_getitem(st, f, n); break;
    case JN_CALL: r = eval_call(st, f, n); break;
    case JN_FILTER: r = eval_filter_node(st, f, n); break;
    case JN_TEST: r = eval_test(st, f, n); break;
    case JN_NEG: case JN_POS: r = eval_unary(st, f, n); break;
    case JN_BINOP: r = eval_binop(st, f, n); break;
    case JN_CONCAT: r = eval_concat(st, f, n); break;
    case JN_COMPARE: r = eval_compare(st, f, n); break;
    case JN_NOT: case JN_AND: case JN_OR: case JN_CONDEXPR: r = eval_logic(st, f, n); break;
    case JN_LIST: case JN_TUPLE: case JN_DICT: r = eval_collection(st, f, n); break;
    default: jr_fail(st, n->line, "internal error: node %d is not an expression", n->k);
    }
    st->depth--;
    return r;
}

/* ---- statements ---- */

static int exec_stmt(jstate *st, jframe *f, const jnode *n) {
    st->line = n->line;
    switch (n->k) {
    case JN_OUTPUT:
        for (int i = 0; i < n->nv; i++) {
            const jnode *x = n->v[i];
            if (x->k == JN_DATA) jb_put(st, st->out, x->cv.u.s.p, x->cv.u.s.n);
            else {
                jv v = eval(st, f, x);
                if (v.t == JV_LIST && (v.fl & JVF_GEN))
                    jr_fail(st, x->line, "printing a generator (add |list or |join)");
                jb_str(st, st->out, &v, x->line);
            }
        }
        return FLOW_NEXT;
    case JN_IF:
        for (int i = 0; i < n->nv; i++)
            if (jv_truthy((jv[]){eval(st, f, n->v[i])})) return exec_body(st, f, n->w[i]);
        if (n->nw > n->nv) return exec_body(st, f, n->w[n->nv]);
        return FLOW_NEXT;
    case JN_FOR: return run_loop(st, f, n, eval(st, f, n->b), 0);
    case JN_SET: assign(st, f, n->a, eval(st, f, n->b)); return FLOW_NEXT;
    case JN_SETBLOCK: {
        int flow;
        jv body = capture(st, frame_new(st, f), n->d, &flow);
        assign(st, f, n->a, apply_chain(st, f, n->b, body));
        return flow;
    }
    case JN_MACRO: {
        jmacro *m = jr_alloc(st, sizeof *m);
        m->def = n;
        m->closure = f;
        m->caller.t = JV_MISSING;
        jv v = {.t = JV_MACRO};
        v.u.m = m;
        frame_set(st, f, n->name, n->name_n, v);
        return FLOW_NEXT;
    }
    case JN_CALLBLOCK: {
        jmacro *m = jr_alloc(st, sizeof *m);
        m->def = n;
        m->closure = f;
        m->caller.t = JV_MISSING;
        jv caller = {.t = JV_MACRO};
        caller.u.m = m;
        const jnode *call = n->a;
        jv fn = eval(st, f, call->a);
        jargs a;
        eval_args(st, f, call, &a, 1);
        a.kn[a.nkw] = "caller";
        a.knl[a.nkw] = 6;
        a.kv[a.nkw++] = caller;
        jv r = jinja_call_value(st, n->line, fn, &a);
        jb_str(st, st->out, &r, n->line);
        return FLOW_NEXT;
    }
    case JN_FILTERBLOCK: {
        int flow;
        jv body = capture(st, frame_new(st, f), n->d, &flow);
        jv r = apply_chain(st, f, n->b, body);
        jb_str(st, st->out, &r, n->line);
        return flow;
    }
    case JN_BREAK: return FLOW_BREAK;
    case JN_CONTINUE: return FLOW_CONTINUE;
    case JN_SCOPE: {
        jframe *g = frame_new(st, f);
        if (n->op == 1) { /* with: values from outside, names inside */
            jv *vals = jr_alloc(st, (size_t)(n->nv + 1) * sizeof *vals);
            for (int i = 0; i < n->nv; i++) vals[i] = eval(st, f, n->v[i]->b);
            for (int i = 0; i < n->nv; i++) assign(st, g, n->v[i]->a, vals[i]);
        }
        return exec_body(st, g, n->d);
    }
    case JN_BODY: return exec_body(st, f, n);
    default: jr_fail(st, n->line, "internal error: node %d is not a statement", n->k);
    }
}

static int exec_body(jstate *st, jframe *f, const jnode *body) {
    enter(st, body->line);
    for (int i = 0; i < body->nv; i++) {
        jr_step(st, body->v[i]->line);
        int flow = exec_stmt(st, f, body->v[i]);
        if (flow != FLOW_NEXT) { st->depth--; return flow; }
    }
    st->depth--;
    return FLOW_NEXT;
}

/* ---- the entry point ---- */

char *jinja_render(const jinja_template *t, const json_t *vars, const jinja_opts *o, size_t *len, kvlm_error *err) {
    if (!t) { util_err_set(err, KVLM_EINVAL, "no template"); return NULL; }
    if (vars && !json_is_object(vars)) {
        util_err_set(err, KVLM_EINVAL, "the variables must be a JSON object");
        return NULL;
    }
    jstate *st = calloc(1, sizeof *st);
    if (!st) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    st->t = t;
    st->max_output = o && o->max_output ? o->max_output : (size_t)32 << 20;
    st->max_steps = o && o->max_steps > 0 ? o->max_steps : 5000000;
    st->max_depth = o && o->max_depth > 0 ? o->max_depth : 1000;
    st->now = o && o->now ? (time_t)o->now : time(NULL);
    st->arena.limit = ((size_t)64 << 20) + (st->max_output > ((size_t)1 << 40) ? ((size_t)1 << 43) : st->max_output * 8);
    char *volatile result = NULL;
    if (setjmp(st->jb)) {
        util_err_set(err, st->err_code ? st->err_code : KVLM_EINVAL, "%s", st->msg);
        goto done;
    }
    {
        jdict *empty = jd_new(st, 0);
        jv vv = vars ? jv_from_json(st, vars, 0) : jv_dict(empty);
        st->vars = vv.u.d;
        jbuf out = {0};
        st->out = &out;
        jframe *root = frame_new(st, NULL);
        exec_body(st, root, t->root);
        result = malloc(out.n + 1);
        if (!result) { util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
        if (out.n) memcpy(result, out.p, out.n);
        result[out.n] = 0;
        if (len) *len = out.n;
    }
done:
    ja_free(&st->arena);
    free(st);
    return result;
}
