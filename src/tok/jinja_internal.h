/* tok/jinja_internal: what the Jinja interpreter's files share: the arena,
 * tokens, the syntax tree, values and the render state. */
#ifndef KVLM_TOK_JINJA_INTERNAL_H
#define KVLM_TOK_JINJA_INTERNAL_H
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include "tok/jinja.h"

/* ---- arena: every allocation of a parse or a render, freed at once ---- */
typedef struct jarena_chunk jarena_chunk;
typedef struct jarena {
    jarena_chunk *head;
    size_t total, limit; /* bytes taken from malloc, and the most allowed */
    bool over;           /* an allocation was refused for the limit (not by malloc) */
} jarena;
void *ja_alloc(jarena *a, size_t n); /* 16-byte aligned; NULL past the limit or out of memory */
/* Grows the block p (old bytes) to n bytes: in place when it is the chunk's last. */
void *ja_grow(jarena *a, void *p, size_t old, size_t n);
void ja_free(jarena *a);

/* Limits the parser holds templates to. */
#define JINJA_MAX_NEST 200        /* nested expressions and blocks */
#define JINJA_MAX_SOURCE (4u << 20) /* bytes of template */
#define JINJA_MAX_VALUE_NEST 1000 /* nested lists and dicts walked (printing, tojson, comparing, input) */
#define JINJA_MAX_RANGE 100000    /* range() items (Jinja2's sandbox: MAX_RANGE) */

/* ---- values ---- */
typedef enum {
    JV_UNDEF, JV_NONE, JV_BOOL, JV_INT, JV_FLOAT, JV_STR, JV_LIST, JV_TUPLE, JV_DICT,
    JV_NS,     /* namespace(): a dict whose attributes `set ns.x = ...` assigns */
    JV_RANGE,  /* range(): lazy */
    JV_MACRO,  /* a macro, or a call block's caller */
    JV_FUNC,   /* a global function (id: JF_*) */
    JV_METHOD, /* a bound method of a value (id: the method) */
    JV_LOOP,   /* a for loop's `loop` */
    JV_CYCLER, JV_JOINER,
    JV_MISSING /* an argument not given (never a template value) */
} jv_type;

enum {
    JVF_MARKUP = 1,   /* a string marked safe (markupsafe.Markup): + escapes the other side */
    JVF_GEN = 2,      /* a list that is a Python iterator (map, select, ...): truthy, no len, consumed once */
    JVF_UNSAFE = 4,   /* an undefined standing for an attribute the sandbox refuses */
    JVF_VIEW = 8,     /* dict.items()/keys()/values() (id: which) */
};

typedef struct jv {
    uint8_t t, fl;
    uint16_t id;
    union {
        int64_t i;
        double f;
        bool b;
        struct { const char *p; size_t n; } s; /* strings; an undefined's name */
        struct jlist *l;
        struct jdict *d;
        struct jrange *r;
        struct jmacro *m;
        struct jmethod *me;
        struct jloop *lp;
        struct jcycler *cy;
    } u;
} jv;

typedef struct jlist {
    jv *v;
    size_t n, cap, pos; /* pos: items an iterator has given */
    const char *err;    /* an iterator that fails when iterated (Python's lazy generators) */
} jlist;
typedef struct jdict { jv *k, *v; size_t n, cap; } jdict;
typedef struct jrange { int64_t start, stop, step; } jrange;
typedef struct jmethod { jv self; const char *name; } jmethod;
typedef struct jcycler { jlist items; size_t pos; const char *sep; size_t sep_n; bool used; } jcycler;

/* ---- tokens ---- */
typedef enum {
    JT_EOF, JT_DATA, JT_VAR_BEGIN, JT_VAR_END, JT_BLOCK_BEGIN, JT_BLOCK_END,
    JT_NAME, JT_STRING, JT_INT, JT_FLOAT, JT_OP
} jtok_type;
enum {
    JO_ADD = 1, JO_SUB, JO_MUL, JO_DIV, JO_FLOORDIV, JO_MOD, JO_POW, JO_TILDE, JO_LBRACKET, JO_RBRACKET,
    JO_LPAREN, JO_RPAREN, JO_LBRACE, JO_RBRACE, JO_EQ, JO_NE, JO_GT, JO_GTEQ, JO_LT, JO_LTEQ, JO_ASSIGN,
    JO_DOT, JO_COLON, JO_PIPE, JO_COMMA, JO_SEMICOLON,
    /* compare operators beyond the tokens */
    JO_IN, JO_NOTIN
};
typedef struct jtok {
    uint8_t t, op;
    int line;
    const char *s; /* text (a string literal: its value) */
    size_t n;
    int64_t i;
    double f;
} jtok;

/* ---- syntax tree ---- */
typedef enum {
    /* expressions */
    JN_CONST, JN_NAME, JN_GETATTR, JN_GETITEM, JN_SLICE, JN_CALL, JN_FILTER, JN_TEST, JN_NOT, JN_NEG,
    JN_POS, JN_BINOP, JN_CONCAT, JN_COMPARE, JN_AND, JN_OR, JN_CONDEXPR, JN_LIST, JN_TUPLE, JN_DICT,
    JN_KEYWORD, JN_NSREF,
    /* statements */
    JN_OUTPUT, JN_DATA, JN_IF, JN_FOR, JN_SET, JN_SETBLOCK, JN_MACRO, JN_CALLBLOCK, JN_FILTERBLOCK,
    JN_BREAK, JN_CONTINUE,
    JN_BODY, /* statements (v) run in the current scope */
    JN_SCOPE /* with, block, generation: a body (d) in a scope of its own; with: op 1, v its assignments */
} jnode_kind;

enum { /* jnode.fl */
    JNF_RECURSIVE = 1,   /* for ... recursive */
    JNF_VARARGS = 2,     /* macro body reads varargs */
    JNF_KWARGS = 4,      /* ... kwargs */
    JNF_CALLER = 8,      /* ... caller */
};

typedef struct jnode jnode;
struct jnode {
    uint8_t k, op;
    uint16_t fl;
    int line;
    jnode *a, *b, *c, *d;
    jnode **v; /* list: arguments, items, body, compare operands */
    jnode **w; /* second list: keyword arguments, else body */
    int nv, nw;
    const char *name; /* identifier, attribute, filter/test name, macro name */
    size_t name_n;
    int fid;          /* a filter's or test's table index (-1: unknown, an error when reached) */
    jv cv;            /* JN_CONST, JN_DATA: the value */
};

struct jinja_template {
    jarena arena;
    jnode *root; /* JN_SCOPE-like: v/nv the top-level statements */
    char *src;   /* the normalised source the tree points into */
};

/* ---- lexer and parser ---- */
/* Tokens of src (normalised: \n line ends, one trailing newline dropped) into
 * *out (arena); 0, or -1 with msg ("line N: ..."). */
int jinja_lex(jarena *a, const char *src, size_t len, jtok **out, size_t *n, char *msg, size_t cap);

/* ---- filters and tests known to the parser ---- */
int jinja_filter_find(const char *name, size_t n); /* index, -1 if Jinja2 has no such filter */
int jinja_test_find(const char *name, size_t n);

/* ---- render state ---- */
typedef struct jframe jframe;
struct jframe {
    jframe *parent;
    const char **names;
    size_t *name_n;
    jv *vals;
    int n, cap;
};

typedef struct jbuf { char *p; size_t n, cap; } jbuf;

typedef struct jloop {
    jlist *items;      /* what is iterated (after the loop's if); NULL: range r */
    const jrange *r;
    size_t i, n;
    jv changed_last;   /* loop.changed()'s last arguments (JV_MISSING: none yet) */
    int depth0;
    const jnode *node; /* the for loop (for recursive calls) */
    jframe *frame;     /* where it runs */
} jloop;

typedef struct jmacro {
    const jnode *def;  /* JN_MACRO or JN_CALLBLOCK */
    jframe *closure;
    jv caller;         /* a call block's: the caller to pass */
} jmacro;

typedef struct jstate {
    jmp_buf jb;
    jarena arena;
    const jinja_template *t;
    const jdict *vars; /* the variables given */
    jbuf *out;
    long steps, max_steps;
    size_t max_output;
    int depth, max_depth;
    time_t now;
    int line;          /* the statement running (for errors without a node at hand) */
    int err_code;
    char msg[512];
} jstate;

/* Fails the render: "line N: message" (line 0: the message alone). */
_Noreturn void jr_fail(jstate *st, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
_Noreturn void jr_fail_raw(jstate *st, int code, const char *msg, size_t n); /* the message as given */
_Noreturn void jr_fail_undef(jstate *st, int line, const jv *u); /* what using an undefined raises */
_Noreturn void jr_oom(jstate *st); /* the memory limit (or malloc) said no */
void *jr_alloc(jstate *st, size_t n);
void jr_steps(jstate *st, int line, long k); /* counts k steps against the limit */
static inline void jr_step(jstate *st, int line) { jr_steps(st, line, 1); }

/* values (jinja_value.c) */
extern const jv jv_undef, jv_none;
static inline jv jv_bool(bool b) { jv v = {.t = JV_BOOL}; v.u.b = b; return v; }
static inline jv jv_int(int64_t i) { jv v = {.t = JV_INT}; v.u.i = i; return v; }
static inline jv jv_float(double f) { jv v = {.t = JV_FLOAT}; v.u.f = f; return v; }
static inline jv jv_strn(const char *p, size_t n) { jv v = {.t = JV_STR}; v.u.s.p = p; v.u.s.n = n; return v; }
jv jv_undef_named(const char *p, size_t n);
jv jv_str_dup(jstate *st, const char *p, size_t n);
jv jv_cstr(const char *s); /* a static string */
jlist *jl_new(jstate *st, size_t cap);
void jl_push(jstate *st, jlist *l, jv v);
jv jv_list(jlist *l);
jv jv_tuple(jlist *l);
jdict *jd_new(jstate *st, size_t cap);
void jd_set(jstate *st, jdict *d, jv k, jv v);       /* replaces an equal key's value */
jv *jd_get(jstate *st, const jdict *d, jv k);        /* NULL if absent */
jv *jd_get_str(const jdict *d, const char *k, size_t n);
jv jv_dict(jdict *d);
jv jv_from_json(jstate *st, const json_t *j, int depth);

bool jv_truthy(const jv *v);
const char *jv_type_name(const jv *v); /* Python's: 'str', 'int', 'dict', ... */
bool jv_eq(jstate *st, const jv *a, const jv *b, int depth);
int jv_cmp(jstate *st, int line, const jv *a, const jv *b, int depth); /* <0, 0, >0; fails for unorderable */
bool jv_hashable(const jv *v);

/* str(), repr() and json.dumps into a buffer */
void jb_put(jstate *st, jbuf *b, const char *p, size_t n);
static inline void jb_puts(jstate *st, jbuf *b, const char *s) { jb_put(st, b, s, strlen(s)); }
void jb_str(jstate *st, jbuf *b, const jv *v, int line); /* str(v) */
void jb_repr(jstate *st, jbuf *b, const jv *v, int depth, int line);
jv jv_to_str(jstate *st, const jv *v, int line);       /* str(v) as a value (a string stays itself) */
typedef struct jjson_opts {
    const char *indent; size_t indent_n; bool has_indent;
    const char *item_sep, *key_sep; size_t item_sep_n, key_sep_n;
    bool sort_keys, ensure_ascii;
} jjson_opts;
void jb_json(jstate *st, jbuf *b, const jv *v, const jjson_opts *o, int level, int line);
void py_float_repr(double x, char *buf, size_t cap); /* Python's repr(float) */

/* iteration: the items of an iterable as a list (strings: characters; dicts: keys) */
jlist *jv_iter(jstate *st, jv *v, int line);
int64_t jv_len(jstate *st, const jv *v, int line);
int64_t jv_range_len(const jrange *r);
/* item i of a range (i < its length): computed in unsigned arithmetic, which
 * wraps where the partial product would overflow but the item fits */
static inline int64_t jv_range_at(const jrange *r, uint64_t i) {
    return (int64_t)((uint64_t)r->start + i * (uint64_t)r->step);
}

/* UTF-8 and Python's str semantics (jinja_str.c) */
size_t u8_count(const char *p, size_t n);              /* code points */
size_t u8_offset(const char *p, size_t n, size_t cp);  /* byte offset of code point cp (n if past) */
uint32_t u8_next(const char *p, size_t n, size_t *i);  /* decodes at *i, advances */
bool u8_valid(const char *p, size_t n, size_t *bad);
int u8_put(uint32_t cp, char *out);
bool py_isspace(uint32_t c);
bool py_isprintable(uint32_t c);
uint32_t py_lower(uint32_t c);
uint32_t py_upper(uint32_t c);
bool py_isalpha(uint32_t c);
bool py_isdigit(uint32_t c);
bool py_isalnum(uint32_t c);
bool py_islower_c(uint32_t c);
bool py_isupper_c(uint32_t c);
size_t py_wordcount(const char *p, size_t n);
jv py_str_lower(jstate *st, jv s);
jv py_str_upper(jstate *st, jv s);
jv py_str_strip(jstate *st, jv s, const jv *chars, int which /* 1 left, 2 right, 3 both */);
jv py_str_replace(jstate *st, jv s, jv old, jv new_, int64_t count);
jlist *py_str_split(jstate *st, jv s, const jv *sep, int64_t maxsplit, bool right, int line);
jv py_str_slice(jstate *st, jv s, int64_t start, int64_t stop, int64_t step);
jv py_escape(jstate *st, jv s); /* markupsafe.escape of a string: marked safe */
jv py_str_title(jstate *st, jv s);      /* str.title() */
jv py_str_capitalize(jstate *st, jv s); /* str.capitalize() */
bool py_str_cased_test(jv s, bool upper); /* str.islower() / isupper() */
bool py_str_class_test(jv s, int which); /* 0 isdigit 1 isalpha 2 isalnum 3 isspace 4 isnumeric 5 isdecimal */
size_t py_linebreak(const char *p, size_t n, size_t i); /* length of a str.splitlines() boundary at i, 0 if none */

/* builtins (jinja_builtins.c) */
typedef struct jargs {
    jv *pos;
    int npos;
    const char **kn;
    size_t *knl;
    jv *kv;
    int nkw;
} jargs;
jv jinja_call_filter(jstate *st, int line, int fid, const char *name, size_t name_n, jv in, const jargs *a);
bool jinja_call_test(jstate *st, int line, int tid, const char *name, size_t name_n, jv in, const jargs *a);
jv jinja_call_method(jstate *st, int line, const jmethod *m, const jargs *a);
jv jinja_call_func(jstate *st, int line, int id, const jargs *a);
jv jinja_getattr(jstate *st, int line, jv obj, const char *name, size_t n);
jv jinja_getitem(jstate *st, int line, jv obj, jv key);
jv jinja_global(const char *name, size_t n); /* a global function, or JV_MISSING */
jv jinja_binop(jstate *st, int line, int op, jv a, jv b);
bool jinja_in(jstate *st, int line, jv x, jv seq);

/* evaluator entry points the builtins use */
jv jinja_call_value(jstate *st, int line, jv fn, const jargs *a);
jv jinja_loop_attr(jstate *st, int line, jloop *lp, const char *name, size_t n);

#endif
