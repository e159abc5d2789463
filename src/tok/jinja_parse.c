/* tok/jinja_parse: tokens into a syntax tree, by Jinja2's grammar (its
 * precedence, tuples without parentheses, tests and filters after postfix
 * expressions); recursion bounded before it recurses. */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tok/jinja_internal.h"
#include "util/error.h"

typedef struct parser {
    jarena *a;
    const jtok *t;
    size_t n, i;
    int depth;       /* nesting of expressions and blocks */
    bool soft;       /* inside an if or a conditional expression (no inner scope between) */
    int loops;       /* enclosing for loops in this function (break/continue) */
    uint16_t mflags; /* names a macro body reads (JNF_VARARGS, ...) */
    const jnode **pend; /* unknown filters and tests outside soft scopes: an error at the statement's end */
    int npend, cpend;
    char *msg;
    size_t mcap;
    jmp_buf jb;
} parser;

typedef struct vec { jnode **v; int n, cap; } vec;

static _Noreturn void pfail(parser *P, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static _Noreturn void pfail(parser *P, int line, const char *fmt, ...) {
    int k = snprintf(P->msg, P->mcap, "line %d: ", line);
    if (k < 0 || (size_t)k >= P->mcap) k = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(P->msg + k, P->mcap - (size_t)k, fmt, ap);
    va_end(ap);
    longjmp(P->jb, 1);
}

static void *palloc(parser *P, size_t n) {
    void *p = ja_alloc(P->a, n);
    if (!p) pfail(P, P->t[P->i].line, "template too large (out of memory)");
    return p;
}

static void vpush(parser *P, vec *v, jnode *x) {
    if (v->n == v->cap) {
        int nc = v->cap ? v->cap * 2 : 4;
        jnode **nv = ja_grow(P->a, v->v, (size_t)v->cap * sizeof *nv, (size_t)nc * sizeof *nv);
        if (!nv) pfail(P, P->t[P->i].line, "template too large (out of memory)");
        v->v = nv;
        v->cap = nc;
    }
    v->v[v->n++] = x;
}

static jnode *mk(parser *P, int kind, int line) {
    jnode *n = palloc(P, sizeof *n);
    memset(n, 0, sizeof *n);
    n->k = (uint8_t)kind;
    n->line = line;
    n->fid = -1;
    return n;
}

static const jtok *cur(parser *P) { return &P->t[P->i]; }
static const jtok *look(parser *P) { return &P->t[P->i + 1 < P->n ? P->i + 1 : P->i]; }
static const jtok *next(parser *P) {
    const jtok *t = &P->t[P->i];
    if (P->i + 1 < P->n) P->i++;
    return t;
}
static bool is_name(const jtok *t, const char *s) {
    return t->t == JT_NAME && t->n == strlen(s) && !memcmp(t->s, s, t->n);
}
static bool is_op(const jtok *t, int op) { return t->t == JT_OP && t->op == op; }
static bool skip_op(parser *P, int op) {
    if (!is_op(cur(P), op)) return false;
    next(P);
    return true;
}
static bool skip_name(parser *P, const char *s) {
    if (!is_name(cur(P), s)) return false;
    next(P);
    return true;
}

static const char *describe(const jtok *t, char *buf, size_t cap) {
    switch (t->t) {
    case JT_EOF: return "end of template";
    case JT_DATA: return "template data";
    case JT_VAR_BEGIN: return "begin of print statement";
    case JT_VAR_END: return "end of print statement";
    case JT_BLOCK_BEGIN: return "begin of statement block";
    case JT_BLOCK_END: return "end of statement block";
    case JT_STRING: return "string";
    case JT_INT: return "integer";
    case JT_FLOAT: return "float";
    default: snprintf(buf, cap, "%.*s", (int)(t->n > 40 ? 40 : t->n), t->s); return buf;
    }
}
static _Noreturn void unexpected(parser *P, const char *want) {
    char b[64];
    const jtok *t = cur(P);
    if (want) pfail(P, t->line, "expected %s, got '%s'", want, describe(t, b, sizeof b));
    pfail(P, t->line, "unexpected '%s'", describe(t, b, sizeof b));
}
static void expect_op(parser *P, int op, const char *what) {
    if (!skip_op(P, op)) unexpected(P, what);
}
static const jtok *expect_type(parser *P, int type, const char *what) {
    if (cur(P)->t != type) unexpected(P, what);
    return next(P);
}
static void expect_name(parser *P, const char *s) {
    if (!skip_name(P, s)) {
        char w[48];
        snprintf(w, sizeof w, "'%s'", s);
        unexpected(P, w);
    }
}

static void enter(parser *P) {
    if (++P->depth > JINJA_MAX_NEST)
        pfail(P, cur(P)->line, "nesting too deep (the parser's limit is %d levels)", JINJA_MAX_NEST);
}
static void leave(parser *P) { P->depth--; }

static void check_pending(parser *P) {
    if (!P->npend) return;
    const jnode *n = P->pend[0];
    pfail(P, n->line, "no %s named '%.*s'", n->k == JN_FILTER ? "filter" : "test", (int)n->name_n, n->name);
}
static void pend_unknown(parser *P, const jnode *n) {
    if (P->soft) return;
    if (P->npend == P->cpend) {
        int nc = P->cpend ? P->cpend * 2 : 4;
        const jnode **np = ja_grow(P->a, P->pend, (size_t)P->cpend * sizeof *np, (size_t)nc * sizeof *np);
        if (!np) pfail(P, n->line, "template too large (out of memory)");
        P->pend = np;
        P->cpend = nc;
    }
    P->pend[P->npend++] = n;
}

static jnode *parse_expression(parser *P, bool with_condexpr);
static jnode *parse_tuple(parser *P, bool simplified, bool with_condexpr, const char *const *extra_end, bool explicit_parens);
static jnode *parse_unary(parser *P, bool with_filter);
static jnode *parse_primary(parser *P);
static jnode *parse_postfix(parser *P, jnode *node);
static jnode *parse_filter(parser *P, jnode *node, bool start_inline);
static void subparse(parser *P, const char *const *end, vec *body);

static void set_list(jnode *n, vec *v) { n->v = v->v; n->nv = v->n; }
static void set_list2(jnode *n, vec *v) { n->w = v->v; n->nw = v->n; }

/* ---- expressions ---- */

static void parse_call_args(parser *P, jnode *n) {
    int line = cur(P)->line;
    expect_op(P, JO_LPAREN, "'('");
    vec args = {0}, kw = {0};
    bool comma = false;
    while (!is_op(cur(P), JO_RPAREN)) {
        if (comma) {
            expect_op(P, JO_COMMA, "','");
            if (is_op(cur(P), JO_RPAREN)) break;
        }
        if (is_op(cur(P), JO_MUL)) {
            if (n->b || n->c) pfail(P, line, "invalid syntax for function call expression");
            next(P);
            n->b = parse_expression(P, true);
        } else if (is_op(cur(P), JO_POW)) {
            if (n->c) pfail(P, line, "invalid syntax for function call expression");
            next(P);
            n->c = parse_expression(P, true);
        } else if (cur(P)->t == JT_NAME && is_op(look(P), JO_ASSIGN)) {
            if (n->c) pfail(P, line, "invalid syntax for function call expression");
            const jtok *k = next(P);
            next(P);
            jnode *kn = mk(P, JN_KEYWORD, k->line);
            kn->name = k->s;
            kn->name_n = k->n;
            kn->a = parse_expression(P, true);
            vpush(P, &kw, kn);
        } else {
            if (n->b || n->c || kw.n) pfail(P, line, "invalid syntax for function call expression");
            vpush(P, &args, parse_expression(P, true));
        }
        comma = true;
    }
    expect_op(P, JO_RPAREN, "')'");
    set_list(n, &args);
    set_list2(n, &kw);
}

static jnode *parse_call(parser *P, jnode *node) {
    jnode *n = mk(P, JN_CALL, cur(P)->line);
    n->a = node;
    parse_call_args(P, n);
    return n;
}

static void dotted_name(parser *P, jnode *n) {
    const jtok *t = expect_type(P, JT_NAME, "a name");
    n->name = t->s;
    n->name_n = t->n;
    while (is_op(cur(P), JO_DOT)) { /* dotted names: kept whole; no such filter exists */
        next(P);
        const jtok *u = expect_type(P, JT_NAME, "a name");
        n->name_n = (size_t)(u->s + u->n - n->name);
    }
}

static jnode *parse_filter(parser *P, jnode *node, bool start_inline) {
    while (is_op(cur(P), JO_PIPE) || start_inline) {
        if (!start_inline) next(P);
        jnode *n = mk(P, JN_FILTER, cur(P)->line);
        dotted_name(P, n);
        n->a = node;
        n->fid = jinja_filter_find(n->name, n->name_n);
        if (n->fid < 0) pend_unknown(P, n);
        if (is_op(cur(P), JO_LPAREN)) parse_call_args(P, n);
        node = n;
        start_inline = false;
    }
    return node;
}

static jnode *parse_test(parser *P, jnode *node) {
    int line = next(P)->line; /* is */
    bool neg = skip_name(P, "not");
    jnode *n = mk(P, JN_TEST, line);
    dotted_name(P, n);
    n->a = node;
    n->fid = jinja_test_find(n->name, n->name_n);
    if (n->fid < 0) pend_unknown(P, n);
    const jtok *t = cur(P);
    if (is_op(t, JO_LPAREN)) parse_call_args(P, n);
    else if ((t->t == JT_NAME || t->t == JT_STRING || t->t == JT_INT || t->t == JT_FLOAT || is_op(t, JO_LPAREN) ||
              is_op(t, JO_LBRACKET) || is_op(t, JO_LBRACE)) &&
             !is_name(t, "else") && !is_name(t, "or") && !is_name(t, "and")) {
        if (is_name(t, "is")) pfail(P, t->line, "you cannot chain multiple tests with is");
        enter(P);
        jnode *arg = parse_postfix(P, parse_primary(P));
        leave(P);
        n->v = palloc(P, sizeof *n->v);
        n->v[0] = arg;
        n->nv = 1;
    }
    if (neg) {
        jnode *x = mk(P, JN_NOT, line);
        x->a = n;
        return x;
    }
    return n;
}

static jnode *parse_subscribed(parser *P) {
    int line = cur(P)->line;
    jnode *args[3] = {0};
    if (is_op(cur(P), JO_COLON)) {
        next(P);
    } else {
        jnode *e = parse_expression(P, true);
        if (!is_op(cur(P), JO_COLON)) return e;
        next(P);
        args[0] = e;
    }
    if (!is_op(cur(P), JO_COLON) && !is_op(cur(P), JO_RBRACKET) && !is_op(cur(P), JO_COMMA))
        args[1] = parse_expression(P, true);
    if (is_op(cur(P), JO_COLON)) {
        next(P);
        if (!is_op(cur(P), JO_RBRACKET) && !is_op(cur(P), JO_COMMA)) args[2] = parse_expression(P, true);
    }
    jnode *s = mk(P, JN_SLICE, line);
    s->a = args[0];
    s->b = args[1];
    s->c = args[2];
    return s;
}

static jnode *parse_subscript(parser *P, jnode *node) {
    const jtok *t = next(P);
    if (t->op == JO_DOT) {
        const jtok *a = next(P);
        if (a->t == JT_NAME) {
            jnode *n = mk(P, JN_GETATTR, t->line);
            n->a = node;
            n->name = a->s;
            n->name_n = a->n;
            return n;
        }
        if (a->t != JT_INT) pfail(P, a->line, "expected name or number");
        jnode *n = mk(P, JN_GETITEM, t->line);
        n->a = node;
        n->b = mk(P, JN_CONST, a->line);
        n->b->cv = jv_int(a->i);
        return n;
    }
    vec args = {0};
    while (!is_op(cur(P), JO_RBRACKET)) {
        if (args.n) expect_op(P, JO_COMMA, "','");
        vpush(P, &args, parse_subscribed(P));
    }
    expect_op(P, JO_RBRACKET, "']'");
    jnode *n = mk(P, JN_GETITEM, t->line);
    n->a = node;
    if (args.n == 1) n->b = args.v[0];
    else {
        n->b = mk(P, JN_TUPLE, t->line);
        set_list(n->b, &args);
    }
    return n;
}

static jnode *parse_postfix(parser *P, jnode *node) {
    for (;;) {
        const jtok *t = cur(P);
        if (is_op(t, JO_DOT) || is_op(t, JO_LBRACKET)) node = parse_subscript(P, node);
        else if (is_op(t, JO_LPAREN)) node = parse_call(P, node);
        else return node;
    }
}

static jnode *parse_filter_expr(parser *P, jnode *node) {
    for (;;) {
        const jtok *t = cur(P);
        if (is_op(t, JO_PIPE)) node = parse_filter(P, node, false);
        else if (is_name(t, "is")) node = parse_test(P, node);
        else if (is_op(t, JO_LPAREN)) node = parse_call(P, node);
        else return node;
    }
}

static jnode *parse_list(parser *P) {
    int line = next(P)->line;
    vec items = {0};
    while (!is_op(cur(P), JO_RBRACKET)) {
        if (items.n) expect_op(P, JO_COMMA, "','");
        if (is_op(cur(P), JO_RBRACKET)) break;
        vpush(P, &items, parse_expression(P, true));
    }
    expect_op(P, JO_RBRACKET, "']'");
    jnode *n = mk(P, JN_LIST, line);
    set_list(n, &items);
    return n;
}

static jnode *parse_dict(parser *P) {
    int line = next(P)->line;
    vec keys = {0}, vals = {0};
    while (!is_op(cur(P), JO_RBRACE)) {
        if (keys.n) expect_op(P, JO_COMMA, "','");
        if (is_op(cur(P), JO_RBRACE)) break;
        vpush(P, &keys, parse_expression(P, true));
        expect_op(P, JO_COLON, "':'");
        vpush(P, &vals, parse_expression(P, true));
    }
    expect_op(P, JO_RBRACE, "'}'");
    jnode *n = mk(P, JN_DICT, line);
    set_list(n, &keys);
    set_list2(n, &vals);
    return n;
}

static jnode *parse_primary(parser *P) {
    const jtok *t = cur(P);
    jnode *n;
    switch (t->t) {
    case JT_NAME:
        next(P);
        n = mk(P, JN_CONST, t->line);
        if (is_name(t, "true") || is_name(t, "True")) n->cv = jv_bool(true);
        else if (is_name(t, "false") || is_name(t, "False")) n->cv = jv_bool(false);
        else if (is_name(t, "none") || is_name(t, "None")) n->cv = jv_none;
        else {
            n->k = JN_NAME;
            n->name = t->s;
            n->name_n = t->n;
            if (is_name(t, "varargs")) P->mflags |= JNF_VARARGS;
            else if (is_name(t, "kwargs")) P->mflags |= JNF_KWARGS;
            else if (is_name(t, "caller")) P->mflags |= JNF_CALLER;
        }
        return n;
    case JT_STRING: {
        next(P);
        size_t len = t->n, k = P->i;
        while (P->t[k].t == JT_STRING) len += P->t[k++].n;
        n = mk(P, JN_CONST, t->line);
        if (k == P->i) {
            n->cv = jv_strn(t->s, t->n);
            return n;
        }
        char *s = palloc(P, len + 1);
        memcpy(s, t->s, t->n);
        size_t o = t->n;
        while (cur(P)->t == JT_STRING) {
            const jtok *u = next(P);
            memcpy(s + o, u->s, u->n);
            o += u->n;
        }
        n->cv = jv_strn(s, o);
        return n;
    }
    case JT_INT:
    case JT_FLOAT:
        next(P);
        n = mk(P, JN_CONST, t->line);
        n->cv = t->t == JT_INT ? jv_int(t->i) : jv_float(t->f);
        return n;
    case JT_OP:
        if (t->op == JO_LPAREN) {
            next(P);
            n = parse_tuple(P, false, true, NULL, true);
            expect_op(P, JO_RPAREN, "')'");
            return n;
        }
        if (t->op == JO_LBRACKET) return parse_list(P);
        if (t->op == JO_LBRACE) return parse_dict(P);
        break;
    default: break;
    }
    unexpected(P, NULL);
}

static jnode *parse_unary(parser *P, bool with_filter) {
    const jtok *t = cur(P);
    jnode *n;
    if (is_op(t, JO_SUB) || is_op(t, JO_ADD)) {
        next(P);
        n = mk(P, t->op == JO_SUB ? JN_NEG : JN_POS, t->line);
        enter(P);
        n->a = parse_unary(P, false);
        leave(P);
    } else {
        n = parse_primary(P);
    }
    n = parse_postfix(P, n);
    if (with_filter) n = parse_filter_expr(P, n);
    return n;
}

static jnode *binop(parser *P, int op, jnode *l, jnode *r, int line) {
    jnode *n = mk(P, JN_BINOP, line);
    n->op = (uint8_t)op;
    n->a = l;
    n->b = r;
    return n;
}

static jnode *parse_pow(parser *P) {
    int line = cur(P)->line;
    jnode *l = parse_unary(P, true);
    while (is_op(cur(P), JO_POW)) {
        next(P);
        l = binop(P, JO_POW, l, parse_unary(P, true), line);
        line = cur(P)->line;
    }
    return l;
}

static jnode *parse_math2(parser *P) {
    int line = cur(P)->line;
    jnode *l = parse_pow(P);
    for (;;) {
        const jtok *t = cur(P);
        if (!(is_op(t, JO_MUL) || is_op(t, JO_DIV) || is_op(t, JO_FLOORDIV) || is_op(t, JO_MOD))) return l;
        next(P);
        l = binop(P, t->op, l, parse_pow(P), line);
        line = cur(P)->line;
    }
}

static jnode *parse_concat(parser *P) {
    int line = cur(P)->line;
    jnode *first = parse_math2(P);
    if (!is_op(cur(P), JO_TILDE)) return first;
    vec args = {0};
    vpush(P, &args, first);
    while (skip_op(P, JO_TILDE)) vpush(P, &args, parse_math2(P));
    jnode *n = mk(P, JN_CONCAT, line);
    set_list(n, &args);
    return n;
}

static jnode *parse_math1(parser *P) {
    int line = cur(P)->line;
    jnode *l = parse_concat(P);
    for (;;) {
        const jtok *t = cur(P);
        if (!is_op(t, JO_ADD) && !is_op(t, JO_SUB)) return l;
        next(P);
        l = binop(P, t->op, l, parse_concat(P), line);
        line = cur(P)->line;
    }
}

static jnode *parse_compare(parser *P) {
    int line = cur(P)->line;
    jnode *e = parse_math1(P);
    vec ops = {0};
    for (;;) {
        const jtok *t = cur(P);
        int op = 0;
        if (t->t == JT_OP && (t->op == JO_EQ || t->op == JO_NE || t->op == JO_LT || t->op == JO_LTEQ ||
                              t->op == JO_GT || t->op == JO_GTEQ)) {
            op = t->op;
            next(P);
        } else if (is_name(t, "in")) {
            op = JO_IN;
            next(P);
        } else if (is_name(t, "not") && is_name(look(P), "in")) {
            op = JO_NOTIN;
            next(P);
            next(P);
        } else {
            break;
        }
        jnode *o = mk(P, JN_KEYWORD, t->line);
        o->op = (uint8_t)op;
        o->a = parse_math1(P);
        vpush(P, &ops, o);
        line = cur(P)->line;
    }
    if (!ops.n) return e;
    jnode *n = mk(P, JN_COMPARE, line);
    n->a = e;
    set_list(n, &ops);
    return n;
}

static jnode *parse_not(parser *P) {
    if (is_name(cur(P), "not")) {
        int line = next(P)->line;
        enter(P);
        jnode *n = mk(P, JN_NOT, line);
        n->a = parse_not(P);
        leave(P);
        return n;
    }
    return parse_compare(P);
}

static jnode *parse_and(parser *P) {
    int line = cur(P)->line;
    jnode *l = parse_not(P);
    while (skip_name(P, "and")) {
        jnode *n = mk(P, JN_AND, line);
        n->a = l;
        n->b = parse_not(P);
        l = n;
        line = cur(P)->line;
    }
    return l;
}

static jnode *parse_or(parser *P) {
    int line = cur(P)->line;
    jnode *l = parse_and(P);
    while (skip_name(P, "or")) {
        jnode *n = mk(P, JN_OR, line);
        n->a = l;
        n->b = parse_and(P);
        l = n;
        line = cur(P)->line;
    }
    return l;
}

static jnode *parse_condexpr(parser *P) {
    int line = cur(P)->line;
    int mark = P->npend;
    jnode *e1 = parse_or(P);
    while (skip_name(P, "if")) {
        /* the whole conditional expression is soft: unknown filters in it fail only when reached */
        P->npend = mark;
        bool soft = P->soft;
        P->soft = true;
        jnode *n = mk(P, JN_CONDEXPR, line);
        n->a = parse_or(P);
        n->b = e1;
        if (skip_name(P, "else")) n->c = parse_condexpr(P);
        P->soft = soft;
        e1 = n;
        line = cur(P)->line;
    }
    return e1;
}

static jnode *parse_expression(parser *P, bool with_condexpr) {
    enter(P);
    jnode *n = with_condexpr ? parse_condexpr(P) : parse_or(P);
    leave(P);
    return n;
}

static bool tuple_end(parser *P, const char *const *extra) {
    const jtok *t = cur(P);
    if (t->t == JT_VAR_END || t->t == JT_BLOCK_END || is_op(t, JO_RPAREN)) return true;
    for (; extra && *extra; extra++)
        if (is_name(t, *extra)) return true;
    return false;
}

static jnode *parse_tuple(parser *P, bool simplified, bool with_condexpr, const char *const *extra_end,
                          bool explicit_parens) {
    int line = cur(P)->line;
    vec args = {0};
    bool is_tuple = false;
    for (;;) {
        if (args.n) expect_op(P, JO_COMMA, "','");
        if (tuple_end(P, extra_end)) break;
        jnode *e;
        if (simplified) {
            enter(P);
            e = parse_primary(P);
            leave(P);
        } else {
            e = parse_expression(P, with_condexpr);
        }
        vpush(P, &args, e);
        if (is_op(cur(P), JO_COMMA)) is_tuple = true;
        else break;
        line = cur(P)->line;
    }
    if (!is_tuple) {
        if (args.n) return args.v[0];
        if (!explicit_parens) unexpected(P, "an expression");
    }
    jnode *n = mk(P, JN_TUPLE, line);
    set_list(n, &args);
    return n;
}

/* ---- statements ---- */

static void check_target(parser *P, const jnode *t) {
    if (t->k == JN_NAME || t->k == JN_NSREF) return;
    if (t->k == JN_TUPLE) {
        for (int i = 0; i < t->nv; i++) check_target(P, t->v[i]);
        return;
    }
    pfail(P, t->line, "can't assign to %s", t->k == JN_CONST ? "a constant" : "an expression");
}

static jnode *parse_assign_target(parser *P, const char *const *extra_end, bool with_namespace) {
    if (with_namespace && cur(P)->t == JT_NAME && is_op(look(P), JO_DOT)) {
        const jtok *t = next(P);
        next(P);
        const jtok *a = expect_type(P, JT_NAME, "a name");
        jnode *n = mk(P, JN_NSREF, t->line);
        n->name = t->s;
        n->name_n = t->n;
        n->a = mk(P, JN_CONST, a->line);
        n->a->cv = jv_strn(a->s, a->n);
        return n;
    }
    jnode *t = parse_tuple(P, true, true, extra_end, false);
    check_target(P, t);
    return t;
}

static jnode *body_node(parser *P, vec *v, int line) {
    jnode *n = mk(P, JN_BODY, line);
    set_list(n, v);
    return n;
}

static const char *const k_end_for[] = {"endfor", "else", NULL};
static const char *const k_end_for2[] = {"endfor", NULL};
static const char *const k_end_if[] = {"elif", "else", "endif", NULL};
static const char *const k_end_if2[] = {"endif", NULL};

/* The statements up to one of end (after the tag's %}); the name stays current unless drop. */
static jnode *parse_statements(parser *P, const char *const *end, bool drop, const char *tag, int line) {
    skip_op(P, JO_COLON);
    expect_type(P, JT_BLOCK_END, "end of statement block");
    vec body = {0};
    subparse(P, end, &body);
    if (cur(P)->t == JT_EOF)
        pfail(P, cur(P)->line, "unexpected end of template: '%s' (line %d) needs 'end%s'", tag, line, tag);
    if (drop) next(P);
    return body_node(P, &body, line);
}

/* A body in a scope of its own (a loop's, a macro's): not soft, its own loops. */
static jnode *parse_inner(parser *P, const char *const *end, bool drop, const char *tag, int line, bool fn) {
    bool soft = P->soft;
    int loops = P->loops;
    P->soft = false;
    if (fn) P->loops = 0;
    jnode *b = parse_statements(P, end, drop, tag, line);
    P->soft = soft;
    P->loops = loops;
    return b;
}

static const char *const k_in[] = {"in", NULL};
static const char *const k_recursive[] = {"recursive", NULL};

static jnode *parse_for(parser *P) {
    int line = next(P)->line;
    jnode *n = mk(P, JN_FOR, line);
    n->a = parse_assign_target(P, k_in, false);
    expect_name(P, "in");
    n->b = parse_tuple(P, false, false, k_recursive, false);
    if (skip_name(P, "if")) {
        bool soft = P->soft;
        P->soft = false; /* the loop's filter runs in the loop's scope */
        n->c = parse_expression(P, true);
        P->soft = soft;
    }
    if (skip_name(P, "recursive")) n->fl |= JNF_RECURSIVE;
    P->loops++;
    n->d = parse_inner(P, k_end_for, false, "for", line, false);
    P->loops--;
    if (is_name(next(P), "else")) {
        n->v = palloc(P, sizeof *n->v);
        n->v[0] = parse_inner(P, k_end_for2, true, "for", line, false);
        n->nv = 1;
    }
    return n;
}

static jnode *parse_if(parser *P) {
    int line = next(P)->line;
    jnode *n = mk(P, JN_IF, line);
    vec tests = {0}, bodies = {0};
    bool soft = P->soft;
    P->soft = true;
    for (;;) {
        enter(P);
        vpush(P, &tests, parse_tuple(P, false, false, NULL, false));
        leave(P);
        vpush(P, &bodies, parse_statements(P, k_end_if, false, "if", line));
        const jtok *t = next(P);
        if (is_name(t, "elif")) continue;
        if (is_name(t, "else")) vpush(P, &bodies, parse_statements(P, k_end_if2, true, "if", line));
        break;
    }
    P->soft = soft;
    set_list(n, &tests);
    set_list2(n, &bodies);
    return n;
}

static const char *const k_end_set[] = {"endset", NULL};

static jnode *parse_set(parser *P) {
    int line = next(P)->line;
    jnode *target = parse_assign_target(P, NULL, true);
    if (skip_op(P, JO_ASSIGN)) {
        jnode *n = mk(P, JN_SET, line);
        n->a = target;
        n->b = parse_tuple(P, false, true, NULL, false);
        return n;
    }
    jnode *n = mk(P, JN_SETBLOCK, line);
    n->a = target;
    bool soft = P->soft;
    P->soft = false;
    n->b = parse_filter(P, NULL, false);
    P->soft = soft;
    n->d = parse_inner(P, k_end_set, true, "set", line, false);
    return n;
}

static void parse_signature(parser *P, jnode *n) {
    expect_op(P, JO_LPAREN, "'('");
    vec params = {0};
    bool defaults = false;
    bool soft = P->soft;
    P->soft = false;
    while (!is_op(cur(P), JO_RPAREN)) {
        if (params.n) expect_op(P, JO_COMMA, "','");
        const jtok *t = expect_type(P, JT_NAME, "a parameter name");
        jnode *p = mk(P, JN_NAME, t->line);
        p->name = t->s;
        p->name_n = t->n;
        if (skip_op(P, JO_ASSIGN)) {
            p->a = parse_expression(P, true);
            defaults = true;
        } else if (defaults) {
            pfail(P, t->line, "non-default argument follows default argument");
        }
        vpush(P, &params, p);
    }
    expect_op(P, JO_RPAREN, "')'");
    P->soft = soft;
    set_list(n, &params);
}

static const char *const k_end_macro[] = {"endmacro", NULL};
static const char *const k_end_call[] = {"endcall", NULL};
static const char *const k_end_filter[] = {"endfilter", NULL};
static const char *const k_end_with[] = {"endwith", NULL};
static const char *const k_end_gen[] = {"endgeneration", NULL};

static jnode *parse_macro(parser *P) {
    int line = next(P)->line;
    const jtok *t = expect_type(P, JT_NAME, "a macro name");
    jnode *n = mk(P, JN_MACRO, line);
    n->name = t->s;
    n->name_n = t->n;
    uint16_t outer = P->mflags;
    P->mflags = 0;
    parse_signature(P, n);
    n->d = parse_inner(P, k_end_macro, true, "macro", line, true);
    n->fl |= P->mflags;
    P->mflags |= outer;
    return n;
}

static jnode *parse_call_block(parser *P) {
    int line = next(P)->line;
    jnode *n = mk(P, JN_CALLBLOCK, line);
    uint16_t outer = P->mflags;
    P->mflags = 0;
    if (is_op(cur(P), JO_LPAREN)) parse_signature(P, n);
    uint16_t sig = P->mflags;
    P->mflags = outer;
    n->a = parse_expression(P, true);
    if (n->a->k != JN_CALL) pfail(P, line, "expected call");
    outer = P->mflags;
    P->mflags = sig;
    n->d = parse_inner(P, k_end_call, true, "call", line, true);
    n->fl |= P->mflags;
    P->mflags |= outer;
    return n;
}

static jnode *parse_filter_block(parser *P) {
    int line = next(P)->line;
    jnode *n = mk(P, JN_FILTERBLOCK, line);
    bool soft = P->soft;
    P->soft = false;
    n->b = parse_filter(P, NULL, true);
    P->soft = soft;
    n->d = parse_inner(P, k_end_filter, true, "filter", line, false);
    return n;
}

static jnode *parse_with(parser *P) {
    int line = next(P)->line;
    jnode *n = mk(P, JN_SCOPE, line);
    vec sets = {0};
    while (cur(P)->t != JT_BLOCK_END) {
        if (sets.n) expect_op(P, JO_COMMA, "','");
        jnode *s = mk(P, JN_SET, cur(P)->line);
        s->a = parse_assign_target(P, NULL, false);
        expect_op(P, JO_ASSIGN, "'='");
        s->b = parse_expression(P, true);
        vpush(P, &sets, s);
    }
    jnode *body = parse_inner(P, k_end_with, true, "with", line, false);
    /* the values are computed outside the scope, then the body runs in it */
    n->op = 1;
    set_list(n, &sets);
    n->d = body;
    return n;
}

static jnode *parse_block(parser *P) {
    int line = next(P)->line;
    const jtok *name = expect_type(P, JT_NAME, "a block name");
    skip_name(P, "scoped");
    skip_name(P, "required");
    static const char *const k_end_block[] = {"endblock", NULL};
    jnode *n = mk(P, JN_SCOPE, line);
    n->d = parse_inner(P, k_end_block, true, "block", line, true);
    if (cur(P)->t == JT_NAME && cur(P)->n == name->n && !memcmp(cur(P)->s, name->s, name->n)) next(P);
    return n;
}

static jnode *parse_statement(parser *P) {
    const jtok *t = cur(P);
    if (t->t != JT_NAME) pfail(P, t->line, "tag name expected");
    enter(P);
    jnode *n;
    if (is_name(t, "for")) n = parse_for(P);
    else if (is_name(t, "if")) n = parse_if(P);
    else if (is_name(t, "set")) n = parse_set(P);
    else if (is_name(t, "macro")) n = parse_macro(P);
    else if (is_name(t, "call")) n = parse_call_block(P);
    else if (is_name(t, "filter")) n = parse_filter_block(P);
    else if (is_name(t, "with")) n = parse_with(P);
    else if (is_name(t, "block")) n = parse_block(P);
    else if (is_name(t, "print")) {
        int line = next(P)->line;
        vec items = {0};
        while (cur(P)->t != JT_BLOCK_END) {
            if (items.n) expect_op(P, JO_COMMA, "','");
            vpush(P, &items, parse_expression(P, true));
        }
        n = mk(P, JN_OUTPUT, line);
        set_list(n, &items);
    } else if (is_name(t, "break") || is_name(t, "continue")) {
        next(P);
        if (!P->loops) pfail(P, t->line, "'%.*s' outside of a loop", (int)t->n, t->s);
        n = mk(P, is_name(t, "break") ? JN_BREAK : JN_CONTINUE, t->line);
    } else if (is_name(t, "generation")) {
        /* transformers' AssistantTracker tag: its body renders as it is */
        int line = next(P)->line;
        n = mk(P, JN_SCOPE, line);
        n->d = parse_inner(P, k_end_gen, true, "generation", line, true);
    } else if (is_name(t, "extends") || is_name(t, "include") || is_name(t, "import") || is_name(t, "from") ||
               is_name(t, "autoescape")) {
        pfail(P, t->line, "tag '%.*s' is not supported (a chat template is one file, not escaped)", (int)t->n, t->s);
    } else {
        pfail(P, t->line, "encountered unknown tag '%.*s'", (int)t->n, t->s);
    }
    leave(P);
    return n;
}

static bool is_end(const jtok *t, const char *const *end) {
    for (; end && *end; end++)
        if (is_name(t, *end)) return true;
    return false;
}

static void subparse(parser *P, const char *const *end, vec *body) {
    vec data = {0};
    for (;;) {
        const jtok *t = cur(P);
        if (t->t == JT_EOF) break;
        if (t->t == JT_DATA) {
            jnode *d = mk(P, JN_DATA, t->line);
            d->cv = jv_strn(t->s, t->n);
            vpush(P, &data, d);
            next(P);
        } else if (t->t == JT_VAR_BEGIN) {
            next(P);
            vpush(P, &data, parse_tuple(P, false, true, NULL, false));
            expect_type(P, JT_VAR_END, "end of print statement");
            check_pending(P);
        } else if (t->t == JT_BLOCK_BEGIN) {
            if (data.n) {
                jnode *o = mk(P, JN_OUTPUT, data.v[0]->line);
                set_list(o, &data);
                vpush(P, body, o);
                data = (vec){0};
            }
            next(P);
            if (end && is_end(cur(P), end)) return;
            vpush(P, body, parse_statement(P));
            expect_type(P, JT_BLOCK_END, "end of statement block");
            check_pending(P);
        } else {
            unexpected(P, NULL);
        }
    }
    if (data.n) {
        jnode *o = mk(P, JN_OUTPUT, data.v[0]->line);
        set_list(o, &data);
        vpush(P, body, o);
    }
}

jinja_template *jinja_parse(const char *src, size_t len, kvlm_error *err) {
    if (!src) { util_err_set(err, KVLM_EINVAL, "no template given"); return NULL; }
    if (len > JINJA_MAX_SOURCE) {
        util_err_set(err, KVLM_EINVAL, "template of %zu bytes: the most kvlm reads is %u", len, JINJA_MAX_SOURCE);
        return NULL;
    }
    size_t bad;
    if (!u8_valid(src, len, &bad)) {
        util_err_set(err, KVLM_EINVAL, "template is not valid UTF-8 (byte %zu)", bad);
        return NULL;
    }
    jinja_template *t = calloc(1, sizeof *t);
    if (!t) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    t->arena.limit = (size_t)64 << 20;
    /* Jinja2 reads \r\n, \r and \n as line ends, writes \n, and drops one trailing newline */
    char *s = ja_alloc(&t->arena, len + 1);
    if (!s) { free(t); util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (n && s[n - 1] == '\n') n--;
    s[n] = 0;
    t->src = s;
    char msg[sizeof err->msg];
    jtok *toks;
    size_t nt;
    if (jinja_lex(&t->arena, s, n, &toks, &nt, msg, sizeof msg)) {
        util_err_set(err, KVLM_EINVAL, "%s", msg);
        jinja_free(t);
        return NULL;
    }
    parser P = {.a = &t->arena, .t = toks, .n = nt, .msg = msg, .mcap = sizeof msg};
    if (setjmp(P.jb)) {
        util_err_set(err, KVLM_EINVAL, "%s", msg);
        jinja_free(t);
        return NULL;
    }
    vec body = {0};
    subparse(&P, NULL, &body);
    if (cur(&P)->t != JT_EOF) unexpected(&P, NULL);
    t->root = body_node(&P, &body, 1);
    return t;
}
