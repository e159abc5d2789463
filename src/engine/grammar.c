/* engine/grammar: GBNF parsed and compiled, the matcher (a lazily built DFA
 * over stack sets) and the token mask (grammar.h). */
#include "engine/grammar.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "model/model.h"
#include "tok/tok.h"
#include "tok/tool_grammar.h"
#include "tok/chat.h"
#include "util/utf8.h"
#include "util/error.h"

/* ---- the compiled grammar ---- */

enum { G_END, G_CHARS, G_REF };
typedef struct {
    uint8_t type;
    uint32_t a, b; /* G_CHARS: ranges [a, a + b) of rng (pairs lo, hi); G_REF: rule a */
} gel;

struct kvlm_grammar {
    int refs;
    const kvlm_model *model;
    gel *el;
    uint32_t *rng;      /* code point ranges, pairs */
    int32_t *alt;       /* each alternative's first element */
    int32_t *rule_alt;  /* rule r: alternatives [rule_alt[r], rule_alt[r + 1]) */
    int n_rules, root;
    char *gbnf;         /* the text it was compiled from */
    bool special;       /* special tokens' texts (<tool_call>, [TOOL_CALLS]) may be written */
    /* lazy: the text is free until one of these words appears in it */
    int n_trig, trig_max;
    char **trig;
    bool *trig_start;   /* counts only at the text's start (blanks before it) */
    int32_t **trig_fail; /* each word's KMP failure table */
};

const kvlm_model *gm_model(const kvlm_grammar *g) { return g->model; }

void kvlm_grammar_free(kvlm_grammar *g) {
    if (!g || __atomic_sub_fetch(&g->refs, 1, __ATOMIC_ACQ_REL) > 0) return;
    free(g->el);
    free(g->rng);
    free(g->alt);
    free(g->rule_alt);
    free(g->gbnf);
    for (int i = 0; i < g->n_trig; i++) free(g->trig[i]), free(g->trig_fail[i]);
    free(g->trig);
    free(g->trig_start);
    free(g->trig_fail);
    free(g);
}

const char *kvlm_grammar_gbnf(const kvlm_grammar *g) { return g ? g->gbnf : NULL; }

/* ---- the parser: GBNF into rules of alternatives of element sequences ---- */

enum {
    MAX_ELEMENTS = 1 << 20, /* a grammar compiling to more (elements and alternatives) is refused */
    MAX_REPEAT = 1 << 16,   /* x{m,n}: m and n at most this */
    MAX_NESTING = KVLM_GRAMMAR_MAX_NESTING, /* groups within groups: the parser recurses once per level */
};

typedef struct { gel *e; int n, cap; } seq;
typedef struct { char *name; seq *alts; int n, cap; bool defined; int used_at; } brule;
typedef struct {
    brule *r;
    int n, cap;
    int32_t *names;     /* a hash table of the named rules' indices (-1: empty) */
    int names_cap, n_named;
    uint32_t *rng;
    size_t n_rng, cap_rng;
    const char *src, *p;
    long total;
    int generated;
    int depth;          /* groups open around the parser's position */
    kvlm_error *err;
    bool failed;
} parser;

static bool grow(void **a, int *cap, int need, size_t size) {
    if (need <= *cap) return true;
    int c = *cap ? *cap * 2 : 8;
    while (c < need) c *= 2;
    void *p = realloc(*a, (size_t)c * size);
    if (!p) return false;
    *a = p;
    *cap = c;
    return true;
}

static bool perr(parser *ps, const char *at, const char *fmt, const char *arg) {
    if (ps->failed) return false;
    ps->failed = true;
    int line = 1, col = 1;
    for (const char *q = ps->src; at && q < at && *q; q++) {
        if (*q == '\n') { line++; col = 1; }
        else col++;
    }
    char msg[200];
    snprintf(msg, sizeof msg, fmt, arg ? arg : "");
    util_err_set(ps->err, KVLM_EINVAL, "grammar: line %d, column %d: %s", line, col, msg);
    return false;
}

static bool oom(parser *ps) {
    if (!ps->failed) util_err_set(ps->err, KVLM_ENOMEM, "grammar: out of memory");
    ps->failed = true;
    return false;
}

static uint32_t name_hash(const char *p, size_t n) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 16777619u;
    return h;
}

static int add_rule(parser *ps, const char *name, size_t len) {
    if (!grow((void **)&ps->r, &ps->cap, ps->n + 1, sizeof *ps->r)) return oom(ps), -1;
    brule *r = &ps->r[ps->n];
    memset(r, 0, sizeof *r);
    if (!(r->name = strndup(name, len))) return oom(ps), -1;
    r->used_at = -1;
    return ps->n++;
}

/* The rule of this name, added if new (names found through a hash table). */
static int rule_index(parser *ps, const char *name, size_t len) {
    if (ps->n_named * 2 >= ps->names_cap) {
        int c = ps->names_cap ? ps->names_cap * 2 : 64;
        int32_t *t = malloc((size_t)c * sizeof *t);
        if (!t) return oom(ps), -1;
        for (int i = 0; i < c; i++) t[i] = -1;
        for (int i = 0; i < ps->names_cap; i++)
            if (ps->names[i] >= 0) {
                const char *nm = ps->r[ps->names[i]].name;
                uint32_t h = name_hash(nm, strlen(nm)) & (uint32_t)(c - 1);
                while (t[h] >= 0) h = (h + 1) & (uint32_t)(c - 1);
                t[h] = ps->names[i];
            }
        free(ps->names);
        ps->names = t;
        ps->names_cap = c;
    }
    uint32_t h = name_hash(name, len) & (uint32_t)(ps->names_cap - 1);
    for (; ps->names[h] >= 0; h = (h + 1) & (uint32_t)(ps->names_cap - 1)) {
        const char *nm = ps->r[ps->names[h]].name;
        if (strlen(nm) == len && !memcmp(nm, name, len)) return ps->names[h];
    }
    int i = add_rule(ps, name, len);
    if (i >= 0) {
        ps->names[h] = i;
        ps->n_named++;
    }
    return i;
}

/* A rule of its own for a group or a repetition ("parent#k": no GBNF name has '#'). */
static int new_rule(parser *ps, int parent) {
    char name[96];
    snprintf(name, sizeof name, "%.64s#%d", parent >= 0 ? ps->r[parent].name : "", ++ps->generated);
    int i = add_rule(ps, name, strlen(name));
    if (i >= 0) ps->r[i].defined = true;
    return i;
}

static seq *new_alt(parser *ps, int rule) {
    brule *r = &ps->r[rule];
    if (++ps->total > MAX_ELEMENTS) return perr(ps, ps->p, "the grammar is too large (over %s elements)", "1048576"), NULL;
    if (!grow((void **)&r->alts, &r->cap, r->n + 1, sizeof *r->alts)) return oom(ps), NULL;
    seq *s = &r->alts[r->n++];
    memset(s, 0, sizeof *s);
    return s;
}

static bool push_el(parser *ps, seq *s, gel e) {
    if (++ps->total > MAX_ELEMENTS) return perr(ps, ps->p, "the grammar is too large (over %s elements)", "1048576");
    if (!grow((void **)&s->e, &s->cap, s->n + 1, sizeof *s->e)) return oom(ps);
    s->e[s->n++] = e;
    return true;
}

static bool push_ref(parser *ps, seq *s, int rule) { return rule >= 0 && push_el(ps, s, (gel){G_REF, (uint32_t)rule, 0}); }

/* Adds sorted, merged ranges (optionally their complement) to the pool; an element for them. */
static int cmp_range(const void *a, const void *b) {
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : 0;
}

static bool push_class(parser *ps, seq *s, uint32_t *r, int n, bool negate) {
    qsort(r, (size_t)n, 2 * sizeof *r, cmp_range);
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (m && r[2 * i] <= r[2 * (m - 1) + 1] + 1) {
            if (r[2 * i + 1] > r[2 * (m - 1) + 1]) r[2 * (m - 1) + 1] = r[2 * i + 1];
        } else {
            r[2 * m] = r[2 * i];
            r[2 * m + 1] = r[2 * i + 1];
            m++;
        }
    }
    uint32_t out[2 * 260];
    int k = 0;
    if (negate) {
        uint32_t lo = 0;
        for (int i = 0; i < m; i++) {
            if (r[2 * i] > lo) { out[2 * k] = lo; out[2 * k + 1] = r[2 * i] - 1; k++; }
            lo = r[2 * i + 1] + 1;
        }
        if (lo <= 0x10ffff) { out[2 * k] = lo; out[2 * k + 1] = 0x10ffff; k++; }
    } else {
        memcpy(out, r, (size_t)m * 2 * sizeof *r);
        k = m;
    }
    if (ps->n_rng + 2 * (size_t)k > ps->cap_rng) {
        size_t c = ps->cap_rng ? ps->cap_rng * 2 : 256;
        while (c < ps->n_rng + 2 * (size_t)k) c *= 2;
        uint32_t *p = realloc(ps->rng, c * sizeof *p);
        if (!p) return oom(ps);
        ps->rng = p;
        ps->cap_rng = c;
    }
    if (k) memcpy(ps->rng + ps->n_rng, out, (size_t)k * 2 * sizeof *out);
    gel e = {G_CHARS, (uint32_t)(ps->n_rng / 2), (uint32_t)k};
    ps->n_rng += 2 * (size_t)k;
    return push_el(ps, s, e);
}

/* One UTF-8 code point from *pp (advanced); -1 if malformed. */
static long utf8_next(const char **pp) {
    uint32_t cp;
    int n = util_utf8_decode((const uint8_t *)*pp, strnlen(*pp, 4), &cp);
    if (!n) return -1;
    *pp += n;
    return cp;
}

static int hexval(int c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* A character of a literal or a class, escapes decoded; -1 on error. */
static long parse_char(parser *ps) {
    const char *at = ps->p;
    if (*ps->p == '\\') {
        ps->p++;
        int c = *ps->p++, digits = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
        if (digits) {
            long v = 0;
            for (int i = 0; i < digits; i++) {
                int h = hexval(*ps->p);
                if (h < 0) return perr(ps, ps->p, "expected %s hex digits", digits == 2 ? "2" : digits == 4 ? "4" : "8"), -1;
                v = v * 16 + h;
                ps->p++;
            }
            if (v > 0x10ffff) return perr(ps, at, "escape past U+10FFFF", NULL), -1;
            return v;
        }
        switch (c) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case '\\': case '"': case '[': case ']': case '-': case '^': case '/': return c;
        default: return perr(ps, at, "unknown escape", NULL), -1;
        }
    }
    if (!*ps->p) return perr(ps, at, "unexpected end of the grammar", NULL), -1;
    long c = utf8_next(&ps->p);
    if (c < 0) return perr(ps, at, "invalid UTF-8", NULL), -1;
    return c;
}

static bool name_char(int c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_'; }

/* Blanks and comments; newlines too when nl. */
static void skip_space(parser *ps, bool nl) {
    for (;;) {
        char c = *ps->p;
        if (c == ' ' || c == '\t' || (nl && (c == '\n' || c == '\r'))) ps->p++;
        else if (c == '#') while (*ps->p && *ps->p != '\n') ps->p++;
        else return;
    }
}

static bool parse_alternates(parser *ps, int rule, bool nested);

/* Wraps elements [from, s->n) of s, the last item, in a rule (one reference kept as it is). */
static int item_rule(parser *ps, int parent, seq *s, int from) {
    if (s->n - from == 1 && s->e[from].type == G_REF) {
        int r = (int)s->e[from].a;
        s->n = from;
        return r;
    }
    int r = new_rule(ps, parent);
    if (r < 0) return -1;
    seq *a = new_alt(ps, r);
    if (!a) return -1;
    for (int i = from; i < s->n; i++)
        if (!push_el(ps, a, s->e[i])) return -1;
    s->n = from;
    return r;
}

/* x*: R ::= x R | (empty) */
static int star_rule(parser *ps, int parent, int x) {
    int r = new_rule(ps, parent);
    seq *a;
    if (r < 0 || !(a = new_alt(ps, r)) || !push_ref(ps, a, x) || !push_ref(ps, a, r) || !new_alt(ps, r)) return -1;
    return r;
}

/* The postfix operator after an item: *, +, ?, {m}, {m,}, {m,n}. */
static bool parse_repeat(parser *ps, int rule, seq *s, int from) {
    long lo, hi;
    const char *at = ps->p;
    char c = *ps->p;
    if (c == '*') lo = 0, hi = -1;
    else if (c == '+') lo = 1, hi = -1;
    else if (c == '?') lo = 0, hi = 1;
    else if (c == '{') {
        ps->p++;
        skip_space(ps, true);
        char *end;
        lo = strtol(ps->p, &end, 10);
        if (end == ps->p || lo < 0) return perr(ps, ps->p, "expected a count after '{'", NULL);
        ps->p = end;
        skip_space(ps, true);
        hi = lo;
        if (*ps->p == ',') {
            ps->p++;
            skip_space(ps, true);
            hi = -1;
            if (*ps->p != '}') {
                hi = strtol(ps->p, &end, 10);
                if (end == ps->p || hi < lo) return perr(ps, ps->p, "expected a count of at least the minimum", NULL);
                ps->p = end;
                skip_space(ps, true);
            }
        }
        if (*ps->p != '}') return perr(ps, ps->p, "expected '}'", NULL);
        if (lo > MAX_REPEAT || hi > MAX_REPEAT) return perr(ps, at, "a repetition count over %s", "65536");
    } else return true;
    ps->p++;
    if (from == s->n) return perr(ps, at, "a repetition with nothing before it", NULL);
    int x = item_rule(ps, rule, s, from);
    if (x < 0) return false;
    for (long i = 0; i < lo; i++)
        if (!push_ref(ps, s, x)) return false;
    if (hi < 0) return push_ref(ps, s, star_rule(ps, rule, x));
    /* hi - lo optional copies, nested: O1 ::= x | ; Ok ::= x O(k-1) | */
    int opt = -1;
    for (long k = 0; k < hi - lo; k++) {
        int r = new_rule(ps, rule);
        seq *a;
        if (r < 0 || !(a = new_alt(ps, r)) || !push_ref(ps, a, x) || (opt >= 0 && !push_ref(ps, a, opt)) || !new_alt(ps, r))
            return false;
        opt = r;
    }
    return opt < 0 || push_ref(ps, s, opt);
}

/* A character class, [...] or [^...], at ps->p: one element of s. (Not
 * inlined: its 2 KiB of ranges stay out of the recursion's frames.) */
static __attribute__((noinline)) bool parse_class(parser *ps, seq *s) {
    const char *at = ps->p;
    ps->p++;
    bool neg = *ps->p == '^';
    if (neg) ps->p++;
    uint32_t r[2 * 256];
    int n = 0;
    while (*ps->p != ']') {
        if (!*ps->p) return perr(ps, at, "unterminated character class", NULL);
        if (n == 256) return perr(ps, at, "a character class of over %s ranges", "256");
        long lo = parse_char(ps), hi = lo;
        if (lo < 0) return false;
        if (ps->p[0] == '-' && ps->p[1] != ']' && ps->p[1]) {
            ps->p++;
            if ((hi = parse_char(ps)) < 0) return false;
            if (hi < lo) return perr(ps, at, "a range whose end is before its start", NULL);
        }
        r[2 * n] = (uint32_t)lo;
        r[2 * n + 1] = (uint32_t)hi;
        n++;
    }
    ps->p++;
    return push_class(ps, s, r, n, neg);
}

static bool parse_sequence(parser *ps, int rule, seq *s, bool nested) {
    for (;;) {
        int from = s->n;
        const char *at = ps->p;
        char c = *ps->p;
        if (c == '"') {
            ps->p++;
            while (*ps->p != '"') {
                if (!*ps->p) return perr(ps, at, "unterminated string", NULL);
                long ch = parse_char(ps);
                if (ch < 0) return false;
                uint32_t r[2] = {(uint32_t)ch, (uint32_t)ch};
                if (!push_class(ps, s, r, 1, false)) return false;
            }
            ps->p++;
        } else if (c == '[') {
            if (!parse_class(ps, s)) return false;
        } else if (c == '.') {
            ps->p++;
            uint32_t r[2] = {0, 0x10ffff};
            if (!push_class(ps, s, r, 1, false)) return false;
        } else if (name_char(c)) {
            const char *b = ps->p;
            while (name_char(*ps->p)) ps->p++;
            int r = rule_index(ps, b, (size_t)(ps->p - b));
            if (r < 0) return false;
            if (ps->r[r].used_at < 0) ps->r[r].used_at = (int)(b - ps->src);
            if (!push_ref(ps, s, r)) return false;
        } else if (c == '(') {
            /* checked before going in: each level is a frame of parse_sequence and parse_alternates */
            if (ps->depth == MAX_NESTING) {
                char lim[16];
                snprintf(lim, sizeof lim, "%d", MAX_NESTING);
                return perr(ps, at, "groups nested deeper than %s levels", lim);
            }
            ps->p++;
            skip_space(ps, true);
            int r = new_rule(ps, rule);
            ps->depth++;
            if (r < 0 || !parse_alternates(ps, r, true)) return false;
            ps->depth--;
            if (*ps->p != ')') return perr(ps, ps->p, "expected ')'", NULL);
            ps->p++;
            if (!push_ref(ps, s, r)) return false;
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            return perr(ps, at, "a repetition with nothing before it", NULL);
        } else return true; /* the sequence ends: '|', ')', a newline, the end */
        if (!parse_repeat(ps, rule, s, from)) return false;
        skip_space(ps, nested);
    }
}

static bool parse_alternates(parser *ps, int rule, bool nested) {
    for (;;) {
        seq *s = new_alt(ps, rule);
        if (!s || !parse_sequence(ps, rule, s, nested)) return false;
        if (!nested) { /* an alternative may start a line of its own with '|' */
            const char *save = ps->p;
            skip_space(ps, true);
            if (*ps->p != '|') ps->p = save;
        }
        if (*ps->p != '|') return true;
        ps->p++;
        skip_space(ps, true);
    }
}

static bool parse_rules(parser *ps) {
    skip_space(ps, true);
    while (*ps->p) {
        const char *b = ps->p;
        while (name_char(*ps->p)) ps->p++;
        if (ps->p == b) return perr(ps, b, "expected a rule name", NULL);
        int r = rule_index(ps, b, (size_t)(ps->p - b));
        if (r < 0) return false;
        if (ps->r[r].defined) return perr(ps, b, "rule '%s' is defined twice", ps->r[r].name);
        ps->r[r].defined = true;
        skip_space(ps, false);
        if (strncmp(ps->p, "::=", 3)) return perr(ps, ps->p, "expected '::='", NULL);
        ps->p += 3;
        skip_space(ps, true);
        if (!parse_alternates(ps, r, false)) return false;
        if (*ps->p && *ps->p != '\n' && *ps->p != '\r') return perr(ps, ps->p, "unexpected character", NULL);
        skip_space(ps, true);
    }
    return true;
}

/* ---- compiling: flat arrays, checks ---- */

/* A rule's name as a person wrote it: a group or repetition has a generated
 * name ("root#3"), named here by the rule it is in. */
static void rule_desc(const char *name, char *out, size_t cap) {
    const char *h = strchr(name, '#');
    if (h) snprintf(out, cap, "a group or repetition in rule '%.*s'", (int)(h - name), name);
    else snprintf(out, cap, "rule '%s'", name);
}

/* Left recursion, which would make the matcher's expansion grow stacks without
 * end: a rule that can reach itself before reading a character, through a
 * reference with more of its alternative after it. Edges r -> s: s may come
 * first in an alternative of r (after rules that can match nothing). A
 * reference that ends its alternative ("tail") continues the stack below it
 * unchanged, so a cycle of tail references only comes back to stacks already
 * expanded (hash-consed): x* over an x that can be empty ("("a"*)*",
 * ECMA-262's "(a*)*") is R ::= x R | (empty), a tail cycle, and is fine. A
 * cycle is refused when one of its edges is not a tail: an edge whose two
 * rules are in one strongly connected component (Tarjan's, iterative). */
static bool check_left_recursion(parser *ps, kvlm_grammar *g) {
    int n = g->n_rules;
    bool *nullable = calloc((size_t)n, 1);
    int n_edges = 0;
    for (int a = 0; a < g->rule_alt[n]; a++)
        for (const gel *e = &g->el[g->alt[a]]; e->type == G_REF; e++) n_edges++;
    int *first = malloc(((size_t)n + 1) * sizeof *first), *to = malloc(((size_t)n_edges + 1) * sizeof *to);
    bool *tail = malloc((size_t)n_edges + 1);
    int *index = malloc((size_t)n * sizeof *index), *low = malloc((size_t)n * sizeof *low),
        *comp = malloc((size_t)n * sizeof *comp), *stack = malloc((size_t)n * sizeof *stack),
        *call = malloc((size_t)n * 2 * sizeof *call);
    bool allocated = nullable && first && to && tail && index && low && comp && stack && call, ok = allocated;
    for (bool changed = true; ok && changed;) {
        changed = false;
        for (int r = 0; r < n; r++) {
            if (nullable[r]) continue;
            for (int a = g->rule_alt[r]; a < g->rule_alt[r + 1] && !nullable[r]; a++) {
                const gel *e = &g->el[g->alt[a]];
                while (e->type == G_REF && nullable[e->a]) e++;
                if (e->type == G_END) nullable[r] = changed = true;
            }
        }
    }
    /* the edges, by rule */
    for (int r = 0, k = 0; ok && r <= n; r++) {
        first[r] = k;
        if (r == n) break;
        for (int a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++)
            for (const gel *e = &g->el[g->alt[a]]; e->type == G_REF; e++) {
                to[k] = (int)e->a;
                tail[k++] = e[1].type == G_END;
                if (!nullable[e->a]) break;
            }
    }
    /* Tarjan: call holds (rule, its next edge) */
    int counter = 0, sp = 0, n_comp = 0;
    for (int r = 0; ok && r < n; r++) index[r] = -1;
    for (int root = 0; ok && root < n; root++) {
        if (index[root] >= 0) continue;
        int cp = 0;
        call[cp++] = root;
        call[cp++] = first[root];
        index[root] = low[root] = counter++;
        stack[sp++] = root;
        comp[root] = -1;
        while (cp) {
            int r = call[cp - 2], k = call[cp - 1];
            if (k < first[r + 1]) {
                call[cp - 1]++;
                int s = to[k];
                if (index[s] < 0) {
                    index[s] = low[s] = counter++;
                    stack[sp++] = s;
                    comp[s] = -1;
                    call[cp++] = s;
                    call[cp++] = first[s];
                } else if (comp[s] < 0 && index[s] < low[r]) low[r] = index[s]; /* on the stack */
                continue;
            }
            cp -= 2;
            if (low[r] == index[r]) {
                int s;
                do comp[s = stack[--sp]] = n_comp;
                while (s != r);
                n_comp++;
            }
            if (cp && low[r] < low[call[cp - 2]]) low[call[cp - 2]] = low[r];
        }
    }
    for (int r = 0; ok && r < n; r++)
        for (int k = first[r]; k < first[r + 1]; k++)
            if (!tail[k] && comp[to[k]] == comp[r]) {
                char d[120];
                rule_desc(ps->r[to[k]].name, d, sizeof d);
                util_err_set(ps->err, KVLM_EINVAL, "grammar: %s is left-recursive (it can reach itself before "
                             "reading a character, with more to read after it)", d);
                ok = false;
                break;
            }
    /* A tail cycle is fine where its rules can match some text: "a ::= a | "x""
     * is "x". One whose rules match none ("a ::= a", "a ::= b", "b ::= a") is
     * refused as before (a rule that can match no text at all but reads a
     * character first, "a ::= "x" a", is an endless text, and is taken). */
    bool *productive = ok ? calloc((size_t)n, 1) : NULL;
    int *size = ok ? calloc((size_t)n_comp + 1, sizeof *size) : NULL;
    if (ok && (!productive || !size)) ok = allocated = false;
    for (bool changed = true; ok && changed;) {
        changed = false;
        for (int r = 0; r < n; r++) {
            if (productive[r]) continue;
            for (int a = g->rule_alt[r]; a < g->rule_alt[r + 1] && !productive[r]; a++) {
                const gel *e = &g->el[g->alt[a]];
                while (e->type == G_CHARS || (e->type == G_REF && productive[e->a])) e++;
                if (e->type == G_END) productive[r] = changed = true;
            }
        }
    }
    for (int r = 0; ok && r < n; r++) size[comp[r]]++;
    for (int r = 0; ok && r < n; r++) {
        bool cyclic = size[comp[r]] > 1;
        for (int k = first[r]; k < first[r + 1] && !cyclic; k++) cyclic = to[k] == r;
        if (cyclic && !productive[r]) {
            char d[120];
            rule_desc(ps->r[r].name, d, sizeof d);
            util_err_set(ps->err, KVLM_EINVAL, "grammar: %s matches no text (every way through it comes back to a "
                         "rule before reading a character)", d);
            ok = false;
        }
    }
    free(productive);
    free(size);
    free(nullable);
    free(first);
    free(to);
    free(tail);
    free(index);
    free(low);
    free(comp);
    free(stack);
    free(call);
    if (!allocated) return util_err_set(ps->err, KVLM_ENOMEM, "grammar: out of memory"), false;
    return ok;
}

static kvlm_grammar *compile(parser *ps, const char *root) {
    int rr = -1;
    for (int i = 0; i < ps->n; i++) {
        if (!ps->r[i].defined)
            return perr(ps, ps->src + ps->r[i].used_at, "rule '%s' is used but not defined", ps->r[i].name), NULL;
        if (!strcmp(ps->r[i].name, root)) rr = i;
    }
    if (rr < 0) {
        char m[120];
        snprintf(m, sizeof m, "grammar: no rule '%.80s' to start from", root);
        util_err_set(ps->err, KVLM_EINVAL, "%s", m);
        return NULL;
    }
    kvlm_grammar *g = calloc(1, sizeof *g);
    int n_alt = 0, n_el = 0;
    for (int i = 0; i < ps->n; i++) {
        n_alt += ps->r[i].n;
        for (int a = 0; a < ps->r[i].n; a++) n_el += ps->r[i].alts[a].n + 1;
    }
    if (g) {
        g->refs = 1;
        g->n_rules = ps->n;
        g->root = rr;
        g->el = malloc(((size_t)n_el + 1) * sizeof *g->el);
        g->alt = malloc(((size_t)n_alt + 1) * sizeof *g->alt);
        g->rule_alt = malloc(((size_t)ps->n + 1) * sizeof *g->rule_alt);
        g->rng = malloc((ps->n_rng + 2) * sizeof *g->rng);
    }
    if (!g || !g->el || !g->alt || !g->rule_alt || !g->rng) {
        kvlm_grammar_free(g);
        util_err_set(ps->err, KVLM_ENOMEM, "grammar: out of memory");
        return NULL;
    }
    if (ps->n_rng) memcpy(g->rng, ps->rng, ps->n_rng * sizeof *g->rng);
    int ka = 0, ke = 0;
    for (int i = 0; i < ps->n; i++) {
        g->rule_alt[i] = ka;
        for (int a = 0; a < ps->r[i].n; a++) {
            g->alt[ka++] = ke;
            if (ps->r[i].alts[a].n) memcpy(g->el + ke, ps->r[i].alts[a].e, (size_t)ps->r[i].alts[a].n * sizeof *g->el);
            ke += ps->r[i].alts[a].n;
            g->el[ke++] = (gel){G_END, 0, 0};
        }
    }
    g->rule_alt[ps->n] = ka;
    if (!check_left_recursion(ps, g)) {
        kvlm_grammar_free(g);
        return NULL;
    }
    return g;
}

static gm *matcher_new(const kvlm_grammar *cg, const char *root, kvlm_error *why);

kvlm_grammar *kvlm_grammar_from_gbnf(const kvlm_model *model, const char *gbnf, const char *root, kvlm_error *err) {
    if (!gbnf) {
        util_err_set(err, KVLM_EINVAL, "grammar: no text");
        return NULL;
    }
    parser ps = {.src = gbnf, .p = gbnf, .err = err};
    kvlm_grammar *g = NULL;
    if (parse_rules(&ps)) g = compile(&ps, root && *root ? root : "root");
    gm *m = g ? matcher_new(g, root && *root ? root : "root", err) : NULL; /* to refuse a grammar no text can begin */
    if (g && !m) {
        kvlm_grammar_free(g);
        g = NULL;
    }
    gm_free(m);
    for (int i = 0; i < ps.n; i++) {
        for (int a = 0; a < ps.r[i].n; a++) free(ps.r[i].alts[a].e);
        free(ps.r[i].alts);
        free(ps.r[i].name);
    }
    free(ps.r);
    free(ps.rng);
    free(ps.names);
    if (g && !(g->gbnf = strdup(gbnf))) {
        util_err_set(err, KVLM_ENOMEM, "grammar: out of memory");
        kvlm_grammar_free(g);
        g = NULL;
    }
    if (g) g->model = model;
    return g;
}

kvlm_grammar *kvlm_grammar_compile(const kvlm_model *model, const char *gbnf, const kvlm_grammar_opts *o,
                                   kvlm_error *err) {
    kvlm_grammar_opts none = {0};
    if (!o) o = &none;
    if (o->n_triggers < 0 || o->n_triggers > KVLM_GRAMMAR_MAX_TRIGGERS || (o->n_triggers && !o->triggers)) {
        util_err_set(err, KVLM_EINVAL, "grammar: %d triggers (0 to %d)", o->n_triggers, KVLM_GRAMMAR_MAX_TRIGGERS);
        return NULL;
    }
    kvlm_grammar *g = kvlm_grammar_from_gbnf(model, gbnf, o->root, err);
    if (!g) return NULL;
    g->special = o->special;
    if (!o->n_triggers) return g;
    g->trig = calloc((size_t)o->n_triggers, sizeof *g->trig);
    g->trig_start = calloc((size_t)o->n_triggers, sizeof *g->trig_start);
    g->trig_fail = calloc((size_t)o->n_triggers, sizeof *g->trig_fail);
    if (!g->trig || !g->trig_start || !g->trig_fail) goto oom;
    for (int i = 0; i < o->n_triggers; i++) {
        const char *w = o->triggers[i].word;
        size_t n = w ? strlen(w) : 0;
        if (!n || n > KVLM_GRAMMAR_MAX_TRIGGER_LEN) {
            util_err_set(err, KVLM_EINVAL, "grammar: trigger %d has %zu bytes (1 to %d)", i, n, KVLM_GRAMMAR_MAX_TRIGGER_LEN);
            kvlm_grammar_free(g);
            return NULL;
        }
        g->n_trig = i + 1;
        if (!(g->trig[i] = strdup(w)) || !(g->trig_fail[i] = malloc((n + 1) * sizeof(int32_t)))) goto oom;
        g->trig_start[i] = o->triggers[i].at_start;
        if ((int)n > g->trig_max) g->trig_max = (int)n;
        int32_t *f = g->trig_fail[i]; /* f[k]: the longest proper border of w[0, k) */
        f[0] = -1;
        if (n) f[1] = 0;
        for (size_t k = 1; k < n; k++) {
            int32_t b = f[k];
            while (b >= 0 && w[b] != w[k]) b = f[b];
            f[k + 1] = b + 1;
        }
        /* the grammar starts with its words: a word it cannot take would end every text it starts */
        gm *m = matcher_new(g, o->root && *o->root ? o->root : "root", NULL);
        bool ok = m && gm_feed(m, w, (int)n);
        gm_free(m);
        if (!ok) {
            util_err_set(err, KVLM_EINVAL, "grammar: the trigger '%.80s' is not how its text can begin", w);
            kvlm_grammar_free(g);
            return NULL;
        }
    }
    return g;
oom:
    util_err_set(err, KVLM_ENOMEM, "grammar: out of memory");
    kvlm_grammar_free(g);
    return NULL;
}

bool kvlm_grammar_is_lazy(const kvlm_grammar *g) { return g && g->n_trig > 0; }

kvlm_grammar *kvlm_grammar_build(const kvlm_model *model, int kind, const char *text, kvlm_error *err) {
    if (kind == KVLM_GRAMMAR_GBNF) return kvlm_grammar_from_gbnf(model, text, "root", err);
    if (kind != KVLM_GRAMMAR_JSON_SCHEMA && kind != KVLM_GRAMMAR_JSON_OBJECT) {
        util_err_set(err, KVLM_EINVAL, "grammar: unknown kind %d", kind);
        return NULL;
    }
    char *gbnf = kvlm_json_schema_to_gbnf(kind == KVLM_GRAMMAR_JSON_OBJECT ? "{\"type\": \"object\"}" : text, err);
    if (!gbnf) return NULL;
    kvlm_grammar *g = kvlm_grammar_from_gbnf(model, gbnf, "root", err);
    free(gbnf);
    return g;
}

kvlm_grammar *eng_tool_grammar_compile(const kvlm_model *model, const tok_tool_gbnf *t, kvlm_error *err) {
    kvlm_grammar_opts o = {.triggers = t->triggers, .n_triggers = t->n_triggers, .special = true};
    kvlm_grammar *g = kvlm_grammar_compile(model, t->gbnf, &o, err);
    if (!g) util_err_prefix(err, "the %s tool-call grammar", t->syntax);
    return g;
}

int kvlm_chat_tool_grammar(const kvlm_chat *chat, const char *prompt, size_t prompt_len, const char *tools_json,
                           const char *tool_choice_json, bool parallel, kvlm_grammar **grammar, kvlm_error *err) {
    *grammar = NULL;
    tok_tool_gbnf t;
    int rc = tok_chat_tool_gbnf(chat, prompt, prompt_len, tools_json, tool_choice_json, parallel, &t, err);
    if (!rc && t.gbnf && !(*grammar = eng_tool_grammar_compile(tok_chat_model(chat), &t, err)))
        rc = err && err->code ? err->code : KVLM_EINVAL;
    tok_tool_gbnf_free(&t);
    return rc;
}

/* ---- the matcher ---- */

/* MAX_STACKS: stacks one step may reach; MAX_VISITS: stacks one step's
 * expansion may go through (rules that read nothing can multiply them while
 * reaching few: r1 ::= r2 r2, r2 ::= r3 r3, ..., r40 ::= ""). Past either the
 * step is refused. MAX_NODES: the stacks one matcher may hold; MASK_WORK:
 * the stacks one token mask's steps may go through and step (a grammar of many
 * stacks per state, (([a-z]{0,60}){0,60}){0,60}, took 13 s for a mask over
 * 32,000 tokens, stalling every request; JSON mode's masks over those
 * tokens take at most 13,534). Past either the grammar ends there. */
enum {
    DEAD = -1, UNKNOWN = -2, NONE = -1, MASK_CACHE = 16, MAX_STACKS = 1 << 16, MAX_VISITS = 1 << 18,
    MAX_NODES = 1 << 22, MASK_WORK = 1 << 20
};

typedef struct { int32_t pos, next, chain; } gnode; /* a stack: element pos on top of stack next */
typedef struct {
    uint32_t off, n;       /* its stacks: ids[off, off + n), sorted */
    uint32_t acc;          /* a code point begun (UTF-8): its bits so far */
    uint8_t need, lead;    /* continuation bytes still due; the sequence's first byte */
    int32_t chain;
    int32_t *tr;           /* the state after each byte (UNKNOWN, DEAD), or NULL */
} gstate;

struct gm {
    kvlm_grammar *g;
    gnode *nd;
    int n_nd, cap_nd;
    int32_t *nd_head;
    uint32_t *mark, gen;
    int nd_mask;
    uint32_t *ids;
    size_t n_ids, cap_ids;
    gstate *st;
    int n_st, cap_st;
    int32_t *st_head;
    int st_mask;
    size_t tr_bytes;       /* the step caches' memory: dropped past a bound, rebuilt on use */
    int32_t *work, *out;   /* expansion's work list and result */
    int cap_work, cap_out, n_work, n_out;
    int32_t cur;
    bool failed;           /* out of memory: every step refuses */
    bool too_many;         /* this step's expansion passed MAX_STACKS or MAX_VISITS: the step is refused */
    bool too_many_visits;  /* (which: for the message when the start state is refused) */
    bool too_large;        /* the matcher passed MAX_NODES: every step is refused */
    int n_visits;          /* this step's expansion's stacks so far */
    long mask_work;        /* this mask's stacks gone through and stepped, so far */
    /* the last masks made, by state (a mask depends on the state alone, and
     * text inside a string, say, comes back to one state token after token) */
    struct { int32_t state; int n; uint64_t *bits; } mc[MASK_CACHE];
    int mc_next;
    const struct gm_vocab *v; /* the model's token texts, once looked up */
    int32_t root;          /* the start state */
    /* lazy: waiting for a trigger word; the text's last bytes (less than the
     * longest word), whether a non-blank came before them */
    bool waiting, nonblank;
    char pend[KVLM_GRAMMAR_MAX_TRIGGER_LEN];
    int n_pend;
    /* the tokens that complete word w from its KMP state q: hits[w][q] */
    struct { int32_t *tok; int n; bool made; } *hits;
};

static uint32_t hash2(uint32_t a, uint32_t b) {
    uint64_t h = ((uint64_t)a << 32 | b) * 0x9e3779b97f4a7c15ull;
    return (uint32_t)(h >> 29);
}

static bool rehash_nodes(gm *m) {
    int nb = (m->nd_mask + 1) * 2;
    int32_t *h = malloc((size_t)nb * sizeof *h);
    if (!h) return false;
    for (int i = 0; i < nb; i++) h[i] = NONE;
    for (int i = 1; i < m->n_nd; i++) {
        uint32_t b = hash2((uint32_t)m->nd[i].pos, (uint32_t)m->nd[i].next) & (uint32_t)(nb - 1);
        m->nd[i].chain = h[b];
        h[b] = i;
    }
    free(m->nd_head);
    m->nd_head = h;
    m->nd_mask = nb - 1;
    return true;
}

/* The stack "pos on top of next", one id for equal stacks. */
static int32_t node(gm *m, int32_t pos, int32_t next) {
    uint32_t b = hash2((uint32_t)pos, (uint32_t)next) & (uint32_t)m->nd_mask;
    for (int32_t i = m->nd_head[b]; i != NONE; i = m->nd[i].chain)
        if (m->nd[i].pos == pos && m->nd[i].next == next) return i;
    if (m->n_nd == MAX_NODES) {
        m->too_large = m->failed = true;
        return NONE;
    }
    if (m->n_nd == m->cap_nd) {
        int c = m->cap_nd * 2;
        gnode *p = realloc(m->nd, (size_t)c * sizeof *p);
        if (p) m->nd = p;
        uint32_t *k = p ? realloc(m->mark, (size_t)c * sizeof *k) : NULL;
        if (!k) {
            m->failed = true;
            return NONE;
        }
        m->mark = k;
        memset(m->mark + m->cap_nd, 0, (size_t)(c - m->cap_nd) * sizeof *m->mark);
        m->cap_nd = c;
    }
    int32_t i = m->n_nd++;
    m->nd[i] = (gnode){pos, next, m->nd_head[b]};
    m->nd_head[b] = i;
    if (m->n_nd > m->nd_mask && !rehash_nodes(m)) m->failed = true;
    return i;
}

static bool push_work(gm *m, int32_t id) {
    if (id == NONE) return false;
    if (m->n_work == m->cap_work && !grow((void **)&m->work, &m->cap_work, m->n_work + 1, sizeof *m->work)) {
        m->failed = true;
        return false;
    }
    m->work[m->n_work++] = id;
    return true;
}

/* Continue at element pos of an alternative over stack next (an alternative
 * that has ended goes on with next). */
static void contin(gm *m, int32_t pos, int32_t next) {
    if (m->g->el[pos].type == G_END) push_work(m, next);
    else push_work(m, node(m, pos, next));
}

/* Expands the work list to stacks with a character class on top (or the
 * empty stack: the grammar may end), each once, into out. */
static void expand(gm *m) {
    const kvlm_grammar *g = m->g;
    while (m->n_work && !m->failed) {
        int32_t s = m->work[--m->n_work];
        if (m->mark[s] == m->gen) continue;
        m->mark[s] = m->gen;
        m->mask_work++;
        if (++m->n_visits > MAX_VISITS) {
            m->too_many = m->too_many_visits = true;
            return;
        }
        const gel *e = s ? &g->el[m->nd[s].pos] : NULL;
        if (!e || e->type == G_CHARS) {
            if (m->n_out == MAX_STACKS) { /* a grammar this ambiguous would make every step slow: refused here */
                m->too_many = true;
                return;
            }
            if (m->n_out == m->cap_out && !grow((void **)&m->out, &m->cap_out, m->n_out + 1, sizeof *m->out)) {
                m->failed = true;
                return;
            }
            m->out[m->n_out++] = s;
            continue;
        }
        /* a rule reference: each of its alternatives over what follows it */
        int32_t pos = m->nd[s].pos, next = m->nd[s].next;
        int32_t base = g->el[pos + 1].type == G_END ? next : node(m, pos + 1, next);
        if (base == NONE) return;
        for (int a = g->rule_alt[e->a]; a < g->rule_alt[e->a + 1]; a++) contin(m, g->alt[a], base);
    }
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static bool rehash_states(gm *m) {
    int nb = (m->st_mask + 1) * 2;
    int32_t *h = malloc((size_t)nb * sizeof *h);
    if (!h) return false;
    for (int i = 0; i < nb; i++) h[i] = NONE;
    for (int i = 0; i < m->n_st; i++) {
        gstate *s = &m->st[i];
        uint32_t b = hash2(s->acc * 8u + s->need, s->n) & (uint32_t)(nb - 1);
        for (uint32_t k = 0; k < s->n; k++) b = hash2(b, m->ids[s->off + k]) & (uint32_t)(nb - 1);
        s->chain = h[b];
        h[b] = i;
    }
    free(m->st_head);
    m->st_head = h;
    m->st_mask = nb - 1;
    return true;
}

/* The state of stacks out[0, n_out) with a code point begun (acc, need, lead); DEAD if none. */
static int32_t state(gm *m, uint32_t acc, int need, int lead) {
    bool too_many = m->too_many;
    m->too_many = false;
    if (m->failed || too_many || !m->n_out) return DEAD;
    qsort(m->out, (size_t)m->n_out, sizeof *m->out, cmp_i32);
    uint32_t b = hash2(acc * 8u + (uint32_t)need, (uint32_t)m->n_out) & (uint32_t)m->st_mask;
    for (int k = 0; k < m->n_out; k++) b = hash2(b, (uint32_t)m->out[k]) & (uint32_t)m->st_mask;
    for (int32_t i = m->st_head[b]; i != NONE; i = m->st[i].chain) {
        gstate *s = &m->st[i];
        if (s->acc == acc && s->need == need && s->lead == lead && s->n == (uint32_t)m->n_out &&
            !memcmp(m->ids + s->off, m->out, (size_t)m->n_out * sizeof *m->out))
            return i;
    }
    if (m->n_ids + (size_t)m->n_out > m->cap_ids) {
        size_t c = m->cap_ids * 2;
        while (c < m->n_ids + (size_t)m->n_out) c *= 2;
        uint32_t *p = realloc(m->ids, c * sizeof *p);
        if (!p) { m->failed = true; return DEAD; }
        m->ids = p;
        m->cap_ids = c;
    }
    if (m->n_st == m->cap_st && !grow((void **)&m->st, &m->cap_st, m->n_st + 1, sizeof *m->st)) {
        m->failed = true;
        return DEAD;
    }
    int32_t i = m->n_st++;
    m->st[i] = (gstate){(uint32_t)m->n_ids, (uint32_t)m->n_out, acc, (uint8_t)need, (uint8_t)lead, m->st_head[b], NULL};
    memcpy(m->ids + m->n_ids, m->out, (size_t)m->n_out * sizeof *m->out);
    m->n_ids += (size_t)m->n_out;
    m->st_head[b] = i;
    if (m->n_st > m->st_mask && !rehash_states(m)) m->failed = true;
    return i;
}

static bool class_has(const kvlm_grammar *g, const gel *e, uint32_t lo, uint32_t hi) {
    const uint32_t *r = g->rng + 2 * (size_t)e->a;
    for (uint32_t k = 0; k < e->b; k++)
        if (r[2 * k] <= hi && r[2 * k + 1] >= lo) return true;
    return false;
}

/* The stacks of state s that take code point cp, moved past it. */
static int32_t advance(gm *m, int32_t sid, uint32_t cp) {
    const kvlm_grammar *g = m->g;
    m->gen++;
    m->n_work = m->n_out = m->n_visits = 0;
    gstate s = m->st[sid];
    m->mask_work += s.n;
    for (uint32_t k = 0; k < s.n; k++) {
        int32_t id = (int32_t)m->ids[s.off + k];
        if (!id) continue;
        const gel *e = &g->el[m->nd[id].pos];
        if (!class_has(g, e, cp, cp)) continue;
        contin(m, m->nd[id].pos + 1, m->nd[id].next);
    }
    expand(m);
    return state(m, 0, 0, 0);
}

/* The state after byte c (cached). */
static int32_t step(gm *m, int32_t sid, unsigned c) {
    if (sid < 0 || m->failed) return DEAD;
    if (m->st[sid].tr && m->st[sid].tr[c] != UNKNOWN) return m->st[sid].tr[c];
    gstate s = m->st[sid];
    int32_t to = DEAD;
    uint32_t acc = 0;
    int need = 0, lead = s.lead;
    if (!s.need) {
        if (c < 0x80) to = advance(m, sid, c);
        else if (c >= 0xc2 && c <= 0xdf) need = 1, acc = c & 0x1f;
        else if (c >= 0xe0 && c <= 0xef) need = 2, acc = c & 0x0f;
        else if (c >= 0xf0 && c <= 0xf4) need = 3, acc = c & 0x07;
        lead = (int)c;
    } else {
        /* the second byte's range depends on the first (no overlong forms, surrogates, past U+10FFFF) */
        bool second = s.lead < 0xe0 || (s.lead < 0xf0 && s.need == 2) || s.need == 3;
        unsigned lo = 0x80, hi = 0xbf;
        if (second && s.lead == 0xe0) lo = 0xa0;
        if (second && s.lead == 0xed) hi = 0x9f;
        if (second && s.lead == 0xf0) lo = 0x90;
        if (second && s.lead == 0xf4) hi = 0x8f;
        if (c >= lo && c <= hi) {
            acc = s.acc << 6 | (c & 0x3f);
            need = s.need - 1;
            if (!need) to = advance(m, sid, acc);
        }
    }
    if (need) { /* a code point begun: alive while some stack can take one it may become */
        uint32_t lo = acc << (6 * need), hi = lo | ((1u << (6 * need)) - 1);
        /* and within what a sequence of its length can encode */
        uint32_t least = lead >= 0xf0 ? 0x10000 : lead >= 0xe0 ? 0x800 : 0x80, most = lead >= 0xf0 ? 0x10ffff : 0xffff;
        if (lo < least) lo = least;
        if (hi > most) hi = most;
        if (lead == 0xed && hi > 0xd7ff) hi = 0xd7ff; /* no surrogates */
        m->n_out = 0;
        m->mask_work += s.n;
        for (uint32_t k = 0; k < s.n && lo <= hi; k++) {
            int32_t id = (int32_t)m->ids[s.off + k];
            if (id && class_has(m->g, &m->g->el[m->nd[id].pos], lo, hi)) {
                if (m->n_out == m->cap_out && !grow((void **)&m->out, &m->cap_out, m->n_out + 1, sizeof *m->out)) {
                    m->failed = true;
                    return DEAD;
                }
                m->out[m->n_out++] = id;
            }
        }
        to = state(m, acc, need, lead);
    }
    if (m->failed) return DEAD;
    gstate *sp = &m->st[sid];
    if (!sp->tr) {
        enum { TR_BOUND = 64 << 20 };
        if (m->tr_bytes > TR_BOUND) { /* drop every cache; rebuilt as the text goes on */
            for (int i = 0; i < m->n_st; i++) {
                free(m->st[i].tr);
                m->st[i].tr = NULL;
            }
            m->tr_bytes = 0;
        }
        if ((sp->tr = malloc(256 * sizeof *sp->tr))) {
            for (int i = 0; i < 256; i++) sp->tr[i] = UNKNOWN;
            m->tr_bytes += 256 * sizeof *sp->tr;
        }
    }
    if (sp->tr) sp->tr[c] = to;
    return to;
}

/* A matcher at the grammar's start; NULL with why filled (if given) when no
 * text can begin: no stack reaches a character (nor the end), the start is
 * too ambiguous, or out of memory. */
static gm *matcher_new(const kvlm_grammar *cg, const char *root, kvlm_error *why) {
    kvlm_grammar *g = (kvlm_grammar *)cg;
    gm *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->g = g;
    __atomic_add_fetch(&g->refs, 1, __ATOMIC_RELAXED);
    m->cap_nd = 256;
    m->nd = malloc((size_t)m->cap_nd * sizeof *m->nd);
    m->mark = calloc((size_t)m->cap_nd, sizeof *m->mark);
    m->nd_mask = 255;
    m->nd_head = malloc(256 * sizeof *m->nd_head);
    m->st_mask = 255;
    m->st_head = malloc(256 * sizeof *m->st_head);
    m->cap_ids = 1024;
    m->ids = malloc(m->cap_ids * sizeof *m->ids);
    if (!m->nd || !m->mark || !m->nd_head || !m->st_head || !m->ids) {
        gm_free(m);
        if (why) util_err_set(why, KVLM_ENOMEM, "grammar: out of memory");
        return NULL;
    }
    for (int i = 0; i < 256; i++) m->nd_head[i] = m->st_head[i] = NONE;
    for (int i = 0; i < MASK_CACHE; i++) m->mc[i].state = DEAD;
    m->nd[0] = (gnode){-1, -1, NONE}; /* the empty stack */
    m->n_nd = 1;
    m->gen = 1;
    for (int a = g->rule_alt[g->root]; a < g->rule_alt[g->root + 1]; a++) contin(m, g->alt[a], 0);
    expand(m);
    bool many = m->too_many, visits = m->too_many_visits, empty = !m->n_out;
    m->cur = m->root = state(m, 0, 0, 0);
    m->waiting = g->n_trig > 0;
    if (m->cur < 0) { /* a grammar that matches nothing at all */
        if (!why) {}
        else if (m->too_large)
            util_err_set(why, KVLM_EINVAL, "grammar: its start holds over %d parse stacks (too ambiguous)", MAX_NODES);
        else if (visits)
            util_err_set(why, KVLM_EINVAL, "grammar: its start goes through over %d parse stacks (too ambiguous)",
                         MAX_VISITS);
        else if (many)
            util_err_set(why, KVLM_EINVAL, "grammar: its start opens over %d parse stacks (too ambiguous)", MAX_STACKS);
        else if (m->failed) util_err_set(why, KVLM_ENOMEM, "grammar: out of memory");
        else if (empty)
            util_err_set(why, KVLM_EINVAL, "grammar: rule '%.80s' matches no text (every way through it comes back "
                         "to a rule before reading a character)", root);
        gm_free(m);
        return NULL;
    }
    return m;
}

gm *gm_new(const kvlm_grammar *g) { return matcher_new(g, "root", NULL); }



void gm_free(gm *m) {
    if (!m) return;
    for (int i = 0; i < m->n_st; i++) free(m->st[i].tr);
    free(m->st);
    free(m->st_head);
    free(m->ids);
    free(m->nd);
    free(m->nd_head);
    free(m->mark);
    free(m->work);
    free(m->out);
    for (int i = 0; i < MASK_CACHE; i++) free(m->mc[i].bits);
    if (m->hits)
        for (int w = 0; w < m->g->n_trig; w++)
            for (int q = 0; q < m->g->trig_max; q++) free(m->hits[w * m->g->trig_max + q].tok);
    free(m->hits);
    kvlm_grammar_free(m->g);
    free(m);
}

bool gm_done(const gm *m) {
    if (m->waiting) return true; /* free text may end anywhere */
    const gstate *s = &m->st[m->cur];
    return !s->need && s->n && m->ids[s->off] == 0; /* sorted: the empty stack, id 0, comes first */
}

/* ---- lazy grammars: free text until a trigger word ---- */

static bool blank(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

/* The KMP state of word w after text b[0, n): how much of w its end holds. */
static int kmp_state(const kvlm_grammar *g, int w, const char *b, int n) {
    const char *t = g->trig[w];
    const int32_t *f = g->trig_fail[w];
    int q = 0, len = (int)strlen(t);
    for (int i = 0; i < n; i++) {
        while (q >= 0 && (q == len || t[q] != b[i])) q = f[q];
        q++;
    }
    return q == len ? f[q] : q;
}

/* Where the first trigger in b[0, n) that ends past b[from - 1] starts (its
 * word in *which), or -1. A word at_start counts only after blanks alone. */
static int first_trigger(const gm *m, const char *b, int n, int from, int *which) {
    const kvlm_grammar *g = m->g;
    int best = -1;
    for (int w = 0; w < g->n_trig; w++) {
        int len = (int)strlen(g->trig[w]);
        for (int p = from - len + 1 < 0 ? 0 : from - len + 1; p + len <= n; p++) {
            if (best >= 0 && p >= best) break;
            if (memcmp(b + p, g->trig[w], (size_t)len)) continue;
            if (g->trig_start[w]) {
                bool ok = !m->nonblank;
                for (int k = 0; k < p && ok; k++) ok = blank(b[k]);
                if (!ok) continue;
            }
            best = p;
            *which = w;
            break;
        }
    }
    return best;
}

/* Free text goes on (bytes b): a trigger in it starts the grammar there,
 * with its word; false when the grammar cannot take what follows it. */
static bool lazy_feed(gm *m, const char *bytes, int n) {
    char buf[KVLM_GRAMMAR_MAX_TRIGGER_LEN + 4096];
    int have = m->n_pend;
    memcpy(buf, m->pend, (size_t)have);
    for (int i = 0; i < n;) { /* in pieces: a long text only keeps its tail */
        int k = n - i < 4096 ? n - i : 4096, which = -1;
        memcpy(buf + have, bytes + i, (size_t)k);
        int at = first_trigger(m, buf, have + k, have, &which);
        if (at >= 0) {
            m->waiting = false;
            int32_t s = m->root;
            for (int j = at; j < have + k && s >= 0; j++) s = step(m, s, (unsigned char)buf[j]);
            for (int j = i + k; j < n && s >= 0; j++) s = step(m, s, (unsigned char)bytes[j]);
            if (s < 0) {
                m->failed = true; /* nothing is allowed after (only an end) */
                return false;
            }
            m->cur = s;
            return true;
        }
        int keep = m->g->trig_max - 1, all = have + k;
        if (keep > all) keep = all;
        for (int j = 0; j < all - keep; j++) m->nonblank |= !blank(buf[j]);
        memmove(buf, buf + all - keep, (size_t)keep);
        have = keep;
        i += k;
    }
    memcpy(m->pend, buf, (size_t)have);
    m->n_pend = have;
    return true;
}

bool gm_feed(gm *m, const char *bytes, int n) {
    if (m->waiting) return lazy_feed(m, bytes, n);
    int32_t s = m->cur;
    for (int i = 0; i < n && s >= 0; i++) s = step(m, s, (unsigned char)bytes[i]);
    if (s < 0) return false;
    m->cur = s;
    return true;
}

/* ---- the vocabulary and the mask ---- */

enum { TOKEN_MAX = 256 }; /* a longer token text is never allowed */

struct gm_vocab {
    int n;
    uint32_t *off;   /* token t's bytes: text[off[t], off[t + 1]) */
    char *text;
    bool *eog;
    bool *special;   /* a special token (its text written only by grammars that allow them) */
    /* in the tokens' byte order (what the mask walks, read in sequence): */
    int32_t *order;  /* token ids */
    uint16_t *lcp;   /* bytes order[k] shares with order[k - 1] */
    uint16_t *len;   /* its length (0: never allowed), or UINT16_MAX: an end-of-generation token */
    uint32_t *soff;  /* its bytes in text */
    int32_t *next1;  /* the first k' > k whose first byte differs */
};

static pthread_mutex_t g_build = PTHREAD_MUTEX_INITIALIZER;
static const gm_vocab *g_sorting;

static int by_bytes(const void *a, const void *b) {
    const gm_vocab *v = g_sorting;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t nx = v->off[x + 1] - v->off[x], ny = v->off[y + 1] - v->off[y];
    int c = memcmp(v->text + v->off[x], v->text + v->off[y], nx < ny ? nx : ny);
    if (c) return c;
    return nx != ny ? (nx < ny ? -1 : 1) : (x > y) - (x < y);
}

void gm_vocab_free(gm_vocab *v) {
    if (!v) return;
    free(v->off);
    free(v->text);
    free(v->eog);
    free(v->special);
    free(v->order);
    free(v->lcp);
    free(v->len);
    free(v->soff);
    free(v->next1);
    free(v);
}

static const gm_vocab *vocab_of(const kvlm_model *cm) {
    kvlm_model *m = (kvlm_model *)cm; /* the table is kept with the model, built once */
    pthread_mutex_lock(&g_build);
    if (!m->grammar_vocab) {
        int n = kvlm_vocab_size(cm);
        gm_vocab *v = calloc(1, sizeof *v);
        size_t cap = (size_t)n * 8 + 64, len = 0;
        if (v) {
            v->n = n;
            v->off = malloc(((size_t)n + 1) * sizeof *v->off);
            v->text = malloc(cap);
            v->eog = malloc((size_t)n * sizeof *v->eog);
            v->special = malloc((size_t)n * sizeof *v->special);
            v->order = malloc((size_t)n * sizeof *v->order);
            v->lcp = malloc((size_t)n * sizeof *v->lcp);
            v->len = malloc((size_t)n * sizeof *v->len);
            v->soff = malloc((size_t)n * sizeof *v->soff);
            v->next1 = malloc((size_t)n * sizeof *v->next1);
        }
        bool ok = v && v->off && v->text && v->eog && v->special && v->order && v->lcp && v->len && v->soff && v->next1;
        for (int t = 0; ok && t < n; t++) {
            char buf[TOKEN_MAX + 1];
            int k = kvlm_token_to_text(cm, t, buf, sizeof buf);
            v->special[t] = false;
            if (!k && !kvlm_token_is_eog(cm, t) && cm->tok) { /* a special token: its text, for the grammars that write it */
                k = tok_token_to_bytes(cm->tok, t, true, buf, sizeof buf);
                v->special[t] = k > 0;
            }
            if (k < 0 || k > TOKEN_MAX) k = 0; /* (never allowed: not eog, no bytes) */
            if (len + (size_t)k > cap) {
                char *p = realloc(v->text, cap = 2 * (len + (size_t)k));
                if (!p) { ok = false; break; }
                v->text = p;
            }
            v->off[t] = (uint32_t)len;
            memcpy(v->text + len, buf, (size_t)k);
            len += (size_t)k;
            v->eog[t] = kvlm_token_is_eog(cm, t);
            v->order[t] = t;
        }
        if (ok) {
            v->off[n] = (uint32_t)len;
            g_sorting = v;
            qsort(v->order, (size_t)n, sizeof *v->order, by_bytes);
            for (int k = 0; k < n; k++) {
                int l = 0;
                if (k) {
                    int32_t a = v->order[k - 1], b = v->order[k];
                    uint32_t na = v->off[a + 1] - v->off[a], nb = v->off[b + 1] - v->off[b];
                    while ((uint32_t)l < na && (uint32_t)l < nb && v->text[v->off[a] + l] == v->text[v->off[b] + l]) l++;
                }
                v->lcp[k] = (uint16_t)l;
                int32_t t = v->order[k];
                v->len[k] = v->eog[t] ? UINT16_MAX : (uint16_t)(v->off[t + 1] - v->off[t]);
                v->soff[k] = v->off[t];
            }
            for (int k = n - 1; k >= 0; k--) v->next1[k] = k + 1 < n && v->lcp[k + 1] ? v->next1[k + 1] : k + 1;
            m->grammar_vocab = v;
        } else gm_vocab_free(v);
    }
    pthread_mutex_unlock(&g_build);
    return m->grammar_vocab;
}

static const gm_vocab *vocab(gm *m) {
    if (!m->v && m->g->model) m->v = vocab_of(m->g->model);
    return m->v;
}

bool gm_feed_token(gm *m, int32_t t) {
    const gm_vocab *v = vocab(m);
    if (!v || t < 0 || t >= v->n) return false;
    if (v->eog[t]) return gm_done(m);
    if (v->special[t] && !m->g->special && !m->waiting) return false;
    int k = (int)(v->off[t + 1] - v->off[t]);
    if (m->waiting && !k) return true;
    return k > 0 && gm_feed(m, v->text + v->off[t], k);
}

/* The tokens that complete word w from its KMP state q, and where: scanned
 * once per (w, q) a matcher meets (the state after most texts is 0). */
static bool hits_of(gm *m, const gm_vocab *v, int w, int q) {
    const kvlm_grammar *g = m->g;
    if (!m->hits && !(m->hits = calloc((size_t)g->n_trig * (size_t)g->trig_max, sizeof *m->hits))) return false;
    __typeof__(m->hits) h = &m->hits[w * g->trig_max + q];
    if (h->made) return true;
    const char *t = g->trig[w];
    const int32_t *f = g->trig_fail[w];
    int len = (int)strlen(t), cap = 0;
    for (int tok = 0; tok < v->n; tok++) {
        const char *b = v->text + v->off[tok];
        int n = (int)(v->off[tok + 1] - v->off[tok]), s = q;
        for (int i = 0; i < n; i++) {
            while (s >= 0 && (s == len || t[s] != b[i])) s = f[s];
            if (++s == len) break;
        }
        if (s != len) continue;
        if (h->n == cap) {
            int32_t *x = realloc(h->tok, (size_t)(cap = cap ? cap * 2 : 16) * sizeof *x);
            if (!x) return false;
            h->tok = x;
        }
        h->tok[h->n++] = tok;
    }
    h->made = true;
    return true;
}

/* Waiting for a trigger: every token, but one that completes a trigger with
 * text after it that the grammar cannot take. */
static int lazy_allowed(gm *m, const gm_vocab *v, bool *allowed) {
    int n = v->n;
    for (int t = 0; t < v->n; t++) allowed[t] = true;
    for (int w = 0; w < m->g->n_trig; w++) {
        int q = kmp_state(m->g, w, m->pend, m->n_pend);
        if (!hits_of(m, v, w, q)) {
            m->failed = true;
            return 0;
        }
        const __typeof__(*m->hits) *h = &m->hits[w * m->g->trig_max + q];
        for (int k = 0; k < h->n; k++) {
            int32_t t = h->tok[k];
            if (!allowed[t]) continue;
            char buf[KVLM_GRAMMAR_MAX_TRIGGER_LEN + TOKEN_MAX];
            int tl = (int)(v->off[t + 1] - v->off[t]), which = -1;
            memcpy(buf, m->pend, (size_t)m->n_pend);
            memcpy(buf + m->n_pend, v->text + v->off[t], (size_t)tl);
            int at = first_trigger(m, buf, m->n_pend + tl, m->n_pend, &which);
            if (at < 0) continue; /* (an at_start word past the start) */
            int32_t s = m->root;
            for (int j = at; j < m->n_pend + tl && s >= 0; j++) s = step(m, s, (unsigned char)buf[j]);
            if (s < 0) {
                allowed[t] = false;
                n--;
            }
        }
    }
    return n;
}

int gm_allowed(gm *m, bool *allowed) {
    const gm_vocab *v = vocab(m);
    if (!v) return 0;
    if (m->waiting && !m->failed) return lazy_allowed(m, v, allowed);
    /* Tokens in byte order: st[0, valid] are the states along the last token
     * stepped; the next one shares lcp bytes with the one before it, so only
     * its later bytes are stepped. A dead state ends the path (at st[valid]);
     * dead at the first byte, every token that starts with it is skipped. */
    for (int i = 0; i < MASK_CACHE; i++)
        if (m->mc[i].state == m->cur && m->mc[i].bits) {
            const uint64_t *bits = m->mc[i].bits;
            for (int t = 0; t < v->n; t++) allowed[t] = bits[t >> 6] >> (t & 63) & 1;
            return m->mc[i].n;
        }
    int32_t st[TOKEN_MAX + 1];
    st[0] = m->cur;
    m->mask_work = 0;
    int valid = 0, n = 0;
    bool done = gm_done(m);
    memset(allowed, 0, (size_t)v->n * sizeof *allowed);
    for (int k = 0; k < v->n; k++) {
        if (v->lcp[k] < valid) valid = v->lcp[k];
        int len = v->len[k];
        if (len == UINT16_MAX) {
            if (done) allowed[v->order[k]] = true, n++;
            continue;
        }
        if (!len || st[valid] == DEAD || (v->special[v->order[k]] && !m->g->special)) continue;
        const unsigned char *b = (const unsigned char *)v->text + v->soff[k];
        while (valid < len) {
            const gstate *s = &m->st[st[valid]];
            int32_t to = s->tr ? s->tr[b[valid]] : UNKNOWN;
            if (to == UNKNOWN) {
                to = step(m, st[valid], b[valid]);
                if (m->mask_work > MASK_WORK) { /* too slow a grammar: it ends here, nothing allowed */
                    m->failed = true;
                    memset(allowed, 0, (size_t)v->n * sizeof *allowed);
                    return 0;
                }
            }
            st[++valid] = to;
            if (to == DEAD) break;
        }
        if (st[valid] == DEAD) {
            if (valid == 1) { /* every token with this first byte */
                k = v->next1[k] - 1;
                valid = 0;
            }
            continue;
        }
        if (valid == len) allowed[v->order[k]] = true, n++;
    }
    if (!m->failed) { /* kept for the next time the text is in this state */
        int i = m->mc_next;
        if (!m->mc[i].bits) m->mc[i].bits = malloc(((size_t)v->n + 63) / 64 * sizeof(uint64_t));
        if (m->mc[i].bits) {
            memset(m->mc[i].bits, 0, ((size_t)v->n + 63) / 64 * sizeof(uint64_t));
            for (int t = 0; t < v->n; t++)
                if (allowed[t]) m->mc[i].bits[t >> 6] |= 1ull << (t & 63);
            m->mc[i].state = m->cur;
            m->mc[i].n = n;
            m->mc_next = (i + 1) % MASK_CACHE;
        }
    }
    return n;
}
