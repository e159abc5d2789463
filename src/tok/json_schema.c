/* tok/json_schema: a JSON schema (OpenAI's response_format json_schema,
 * llama.cpp's --json-schema) as a GBNF grammar for engine/grammar. Each
 * schema becomes a rule; objects keep their properties in the schema's order
 * (required ones always there, optional ones maybe), and take no other keys
 * unless the schema has no properties (as llama.cpp does). Keywords that
 * constrain values in ways a grammar here does not express (uniqueItems,
 * not, lookaround in a pattern, a multipleOf other than a power of ten or a
 * small whole number, ...) are refused by name, never ignored; annotations
 * (title, description, default, examples, and formats other than date, time,
 * date-time and uuid) are ignored, as JSON Schema itself treats them. */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kvlm.h"
#include "tok/json_schema.h"
#include "util/utf8.h"
#include "util/error.h"

typedef struct { char *s; size_t n, cap; bool oom; } sbuf;

static void sb_add(sbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) { b->oom = true; return; }
        if (b->s && b->n + (size_t)k < b->cap) { b->n += (size_t)k; return; }
        size_t c = b->cap ? b->cap * 2 : 1024;
        while (c <= b->n + (size_t)k) c *= 2;
        char *p = realloc(b->s, c);
        if (!p) { b->oom = true; return; }
        b->s = p;
        b->cap = c;
    }
}

enum { DEPTH_MAX = KVLM_JSON_SCHEMA_MAX_DEPTH };
enum { R_WS = 1, R_STRING = 2, R_NUMBER = 4, R_INTEGER = 8, R_VALUE = 16, R_DATE = 32, R_TIME = 64, R_UUID = 128 };

typedef struct {
    json_t *root;
    sbuf out;           /* the rules made so far */
    unsigned need;      /* the shared rules used (R_*) */
    int counter;
    /* each $ref's rule, named before its schema is made (so a tree finds its
     * own); nest: the objects and arrays around it then; done once made */
    struct { char *ptr; char name[48]; int nest; bool done; } *refs;
    int n_refs;
    int nest;           /* objects and arrays entered: their subschemas are inside brackets */
    kvlm_error *err;
    bool failed;
} conv;

static bool cfail(conv *c, const char *path, const char *fmt, const char *arg) {
    if (c->failed) return false;
    c->failed = true;
    char m[240];
    snprintf(m, sizeof m, fmt, arg ? arg : "");
    util_err_set(c->err, KVLM_EINVAL, "json_schema at %.200s: %s", *path ? path : "the root", m);
    return false;
}

/* A fresh rule name from a hint (a property's name, ...). */
static void rule_name(conv *c, const char *hint, char *name, size_t cap) {
    char h[24];
    int k = 0;
    for (const char *p = hint; *p && k < 20; p++)
        h[k++] = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ? *p : '-';
    h[k] = 0;
    snprintf(name, cap, "%s%s%d", h, k ? "-" : "s", ++c->counter);
}

/* A JSON value as a GBNF literal: its compact text, quoted. */
static void literal(sbuf *b, json_t *v) {
    char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!t) { b->oom = true; return; }
    sb_add(b, "\"");
    for (const char *p = t; *p; p++) {
        if (*p == '"' || *p == '\\') sb_add(b, "\\%c", *p);
        else sb_add(b, "%c", *p);
    }
    sb_add(b, "\"");
    free(t);
}

static bool gen(conv *c, json_t *s, const char *hint, const char *path, int depth, char *name, size_t cap);

/* Keywords that constrain values in ways this converter does not turn into grammar. */
static const char *const refused[] = {
    "patternProperties", "uniqueItems", "contains", "minContains", "maxContains", "not",
    "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "propertyNames", "minProperties",
    "maxProperties", "unevaluatedProperties",
    "unevaluatedItems", "$dynamicRef", "$recursiveRef", "additionalItems", NULL};

/* The value a JSON pointer ("#/$defs/a") names in the root document, or NULL. */
static json_t *resolve(conv *c, const char *ref) {
    if (ref[0] != '#') return NULL;
    json_t *v = c->root;
    const char *p = ref + 1;
    while (*p == '/' && v) {
        p++;
        char key[256];
        size_t k = 0;
        while (*p && *p != '/' && k + 1 < sizeof key) {
            if (p[0] == '~' && (p[1] == '0' || p[1] == '1')) { key[k++] = p[1] == '0' ? '~' : '/'; p += 2; }
            else key[k++] = *p++;
        }
        key[k] = 0;
        if (json_is_object(v)) v = json_object_get(v, key);
        else if (json_is_array(v)) {
            char *end;
            long i = strtol(key, &end, 10);
            v = *key && !*end ? json_array_get(v, (size_t)i) : NULL;
        } else v = NULL;
    }
    return *p ? NULL : v;
}

/* A $ref is its target's rule, made once. A reference back to a $ref whose
 * rule is still being made is recursion: legal inside an object or array
 * that the first one began (a tree: the brackets are read before it comes
 * back), and otherwise a schema that can only ever come back to itself
 * ({"$ref": "#/$defs/a"} with a: {"$ref": "#/$defs/a"}, or a anyOf itself
 * or null), refused here in the schema's terms. */
static bool gen_ref(conv *c, const char *ref, const char *path, int depth, char *name, size_t cap) {
    for (int i = 0; i < c->n_refs; i++)
        if (!strcmp(c->refs[i].ptr, ref)) {
            if (!c->refs[i].done && c->refs[i].nest == c->nest)
                return cfail(c, path, "'$ref' '%.80s' comes back to itself with no object or array between, so "
                             "it could never end", ref);
            snprintf(name, cap, "%s", c->refs[i].name);
            return true;
        }
    json_t *target = resolve(c, ref);
    if (!target) return cfail(c, path, "$ref '%.80s' names nothing in this schema (only local references, #/...)", ref);
    void *p = realloc(c->refs, ((size_t)c->n_refs + 1) * sizeof *c->refs);
    if (!p) return c->out.oom = true, false;
    c->refs = p;
    if (!(c->refs[c->n_refs].ptr = strdup(ref))) return c->out.oom = true, false;
    const char *last = strrchr(ref, '/');
    /* the name first, so a schema that refers to itself (a tree) finds it */
    int k = c->n_refs++;
    c->refs[k].nest = c->nest;
    c->refs[k].done = false;
    char body[48], rn[48];
    rule_name(c, last ? last + 1 : "ref", rn, sizeof rn);
    snprintf(c->refs[k].name, sizeof c->refs[k].name, "%s", rn);
    if (!gen(c, target, last ? last + 1 : "ref", ref, depth + 1, body, sizeof body)) return false;
    c->refs[k].done = true; /* (c->refs may have moved: indexed again) */
    sb_add(&c->out, "%s ::= %s\n", rn, body);
    snprintf(name, cap, "%s", rn);
    return true;
}

static bool gen_object_in(conv *c, json_t *s, const char *hint, const char *path, int depth, sbuf *b) {
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required"),
           *add = json_object_get(s, "additionalProperties");
    c->need |= R_WS;
    if (props && !json_is_object(props)) return cfail(c, path, "'properties' must be an object", NULL);
    if (req && !json_is_array(req)) return cfail(c, path, "'required' must be an array", NULL);
    if (add && !json_is_boolean(add) && !json_is_object(add))
        return cfail(c, path, "'additionalProperties' must be a boolean or a schema", NULL);
    if (!props || !json_object_size(props)) {
        if (req && json_array_size(req)) return cfail(c, path, "'required' names keys no property describes", NULL);
        if (json_is_false(add)) { sb_add(b, "\"{\" ws \"}\""); return true; }
        char v[48] = "value";
        char sub[300];
        c->need |= R_STRING | (json_is_object(add) ? 0 : R_VALUE);
        snprintf(sub, sizeof sub, "%s/additionalProperties", path);
        if (json_is_object(add) && !gen(c, add, hint, sub, depth + 1, v, sizeof v)) return false;
        sb_add(b, "\"{\" ws ( string ws \":\" ws %s ws ( \",\" ws string ws \":\" ws %s ws )* )? \"}\"", v, v);
        return true;
    }
    if (add && !json_is_false(add))
        return cfail(c, path, "'additionalProperties' beside 'properties' is not supported (only false)", NULL);
    size_t np = json_object_size(props);
    size_t i;
    json_t *r;
    json_array_foreach(req, i, r) {
        if (!json_is_string(r)) return cfail(c, path, "'required' must list strings", NULL);
        if (!json_object_get(props, json_string_value(r)))
            return cfail(c, path, "required '%.60s' is not among the properties", json_string_value(r));
    }
    /* kv_i: a key and its value; then, in the schema's order, first_i / rest_i:
     * the properties from i on, before any was written (first) or after one
     * (rest: each starts with a comma); an optional one may be left out. */
    char (*kv)[48] = calloc(np, sizeof *kv);
    bool *required = calloc(np, sizeof *required);
    char base[48];
    rule_name(c, hint, base, sizeof base);
    if (!kv || !required) {
        free(kv);
        free(required);
        c->out.oom = true;
        return false;
    }
    const char *key;
    json_t *ps;
    size_t k = 0;
    bool ok = true;
    json_object_foreach(props, key, ps) {
        json_array_foreach(req, i, r) if (!strcmp(json_string_value(r), key)) required[k] = true;
        char v[48], sub[300];
        snprintf(sub, sizeof sub, "%s/properties/%.60s", path, key);
        if (!(ok = gen(c, ps, key, sub, depth + 1, v, sizeof v))) break;
        rule_name(c, key, kv[k], sizeof kv[k]);
        sb_add(&c->out, "%s ::= ", kv[k]);
        json_t *kj = json_string(key);
        literal(&c->out, kj);
        json_decref(kj);
        sb_add(&c->out, " ws \":\" ws %s\n", v);
        k++;
    }
    if (ok) {
        for (size_t j = np; j-- > 0;) {
            for (int first = 1; first >= (j ? 0 : 1); first--) { /* (rest_0 would be used by nothing) */
                /* (no empty alternative at a line's end: GBNF reads on past a '|') */
                bool last_opt = !required[j] && j + 1 == np;
                sb_add(&c->out, "%s-%s%zu ::= %s%s%s ws", base, first ? "f" : "r", j, last_opt ? "( " : "",
                       first ? "" : "\",\" ws ", kv[j]);
                if (j + 1 < np) sb_add(&c->out, " %s-r%zu", base, j + 1);
                if (last_opt) sb_add(&c->out, " )?");
                else if (!required[j]) sb_add(&c->out, " | %s-%s%zu", base, first ? "f" : "r", j + 1);
                sb_add(&c->out, "\n");
            }
        }
        sb_add(b, "\"{\" ws %s-f0 \"}\"", base);
    }
    free(kv);
    free(required);
    return ok;
}

static bool count(conv *c, json_t *s, const char *key, const char *path, long *out) {
    json_t *v = json_object_get(s, key);
    *out = -1;
    if (!v) return true;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 4096)
        return cfail(c, path, "'%s' must be an integer from 0 to 4096", key);
    *out = (long)json_integer_value(v);
    return true;
}

/* "x{lo,hi}" as GBNF: lo < 0 means 0, hi < 0 no bound. */
static void repeat(sbuf *b, long lo, long hi) {
    if (lo < 0) lo = 0;
    if (hi < 0) sb_add(b, "{%ld,}", lo);
    else sb_add(b, "{%ld,%ld}", lo, hi);
}

static bool gen_array_in(conv *c, json_t *s, const char *hint, const char *path, int depth, sbuf *b) {
    json_t *items = json_object_get(s, "items");
    long lo, hi;
    if (!count(c, s, "minItems", path, &lo) || !count(c, s, "maxItems", path, &hi)) return false;
    if (hi >= 0 && lo > hi) return cfail(c, path, "'minItems' is above 'maxItems'", NULL);
    c->need |= R_WS;
    json_t *prefix = json_object_get(s, "prefixItems");
    if (prefix && (!json_is_array(prefix) || !json_array_size(prefix) || json_array_size(prefix) > 64))
        return cfail(c, path, "'prefixItems' must be an array of 1 to 64 schemas", NULL);
    char it[48] = "value", sub[300];
    snprintf(sub, sizeof sub, "%s/items", path);
    bool more = !json_is_false(items); /* items: false, after prefixItems: nothing more */
    if (!more && !prefix) return cfail(c, path, "the schema false matches nothing", NULL);
    if (items && more && !gen(c, items, hint, sub, depth + 1, it, sizeof it)) return false;
    if (!items) c->need |= R_VALUE;
    if (prefix) {
        /* a tuple: item k by its own schema, each one after minItems optional (nested), then the rest */
        long n = (long)json_array_size(prefix);
        if (!more && lo > n) return cfail(c, path, "'minItems' is above the items 'prefixItems' and 'items' allow", NULL);
        char (*pk)[48] = calloc((size_t)n, sizeof *pk);
        if (!pk) return c->out.oom = true, false;
        bool ok = true;
        for (long k = 0; k < n && ok; k++) {
            char p2[300];
            snprintf(p2, sizeof p2, "%s/prefixItems/%ld", path, k);
            ok = gen(c, json_array_get(prefix, (size_t)k), hint, p2, depth + 1, pk[k], sizeof pk[k]);
        }
        if (ok) {
            sb_add(b, "\"[\" ws ");
            for (long k = 0; k < n && (hi < 0 || k < hi); k++)
                sb_add(b, "%s%s%s ws ", k >= lo ? "( " : "", k ? "\",\" ws " : "", pk[k]);
            if (more && (hi < 0 || hi > n)) {
                sb_add(b, "( \",\" ws %s ws )", it);
                repeat(b, lo > n ? lo - n : 0, hi >= 0 ? hi - n : -1);
                sb_add(b, " ");
            }
            for (long k = 0; k < n && (hi < 0 || k < hi); k++)
                if (k >= lo) sb_add(b, ")? ");
            sb_add(b, "\"]\"");
        }
        free(pk);
        return ok;
    }
    if (hi == 0) { sb_add(b, "\"[\" ws \"]\""); return true; }
    sb_add(b, "\"[\" ws %s%s ws ( \",\" ws %s ws )", lo > 0 ? "" : "( ", it, it);
    repeat(b, lo > 0 ? lo - 1 : 0, hi > 0 ? hi - 1 : -1);
    sb_add(b, "%s \"]\"", lo > 0 ? "" : " )?");
    return true;
}

/* ---- pattern: an ECMA-262 regular expression as GBNF over the string's raw text ---- */

typedef struct {
    conv *c;
    const char *p, *path;
    sbuf *b;
    int depth;
} rx;

static bool rx_fail(rx *r, const char *what) {
    char m[120];
    snprintf(m, sizeof m, "'pattern': %s", what);
    return cfail(r->c, r->path, "%s", m);
}

/* One code point of the pattern (UTF-8), or -1. */
static long rx_utf8(rx *r) {
    uint32_t cp;
    int n = util_utf8_decode((const uint8_t *)r->p, strnlen(r->p, 4), &cp);
    if (!n) return -1;
    r->p += n;
    return cp;
}

enum { RX_MAX_RANGES = 128 };
typedef struct { uint32_t lo[RX_MAX_RANGES], hi[RX_MAX_RANGES]; int n; } rx_set;

static bool set_add(rx *r, rx_set *s, uint32_t lo, uint32_t hi) {
    if (s->n == RX_MAX_RANGES) return rx_fail(r, "a character class of too many ranges");
    s->lo[s->n] = lo;
    s->hi[s->n++] = hi;
    return true;
}

/* \d \w \s (and their negations, which only stand outside classes) */
static bool set_shorthand(rx *r, rx_set *s, char k) {
    switch (k) {
    case 'd': return set_add(r, s, '0', '9');
    case 'w': return set_add(r, s, '0', '9') && set_add(r, s, 'A', 'Z') && set_add(r, s, '_', '_') && set_add(r, s, 'a', 'z');
    case 's': return set_add(r, s, '\t', '\r') && set_add(r, s, ' ', ' ') && set_add(r, s, 0xa0, 0xa0) &&
                     set_add(r, s, 0x2028, 0x2029) && set_add(r, s, 0xfeff, 0xfeff);
    }
    return false;
}

/* An escape's code point (after the backslash): -1 on error; -2 for a shorthand class, put in *k. */
static long rx_escape(rx *r, char *k) {
    char e = *r->p++;
    switch (e) {
    case 'd': case 'w': case 's': case 'D': case 'W': case 'S': *k = e; return -2;
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    case '0': return 0;
    case 'x': case 'u': {
        int digits = e == 'x' ? 2 : 4;
        long v = 0;
        for (int i = 0; i < digits; i++) {
            char h = *r->p++;
            int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
            if (d < 0) return rx_fail(r, "a malformed \\x or \\u escape"), -1;
            v = v * 16 + d;
        }
        return v;
    }
    case 'b': case 'B': return rx_fail(r, "word boundaries are not supported"), -1;
    case 0: return rx_fail(r, "a backslash at the end"), -1;
    default:
        if (e >= '1' && e <= '9') return rx_fail(r, "back-references are not supported"), -1;
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) return rx_fail(r, "an unknown escape"), -1;
        r->p--;
        return rx_utf8(r); /* an escaped punctuation character stands for itself */
    }
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* Writes set s (negated if neg) as a GBNF class, less what a JSON string cannot hold raw ('"', '\\', controls). */
static bool set_emit(rx *r, rx_set *s, bool neg) {
    uint32_t pairs[2 * RX_MAX_RANGES];
    for (int i = 0; i < s->n; i++) pairs[2 * i] = s->lo[i], pairs[2 * i + 1] = s->hi[i];
    qsort(pairs, (size_t)s->n, 2 * sizeof *pairs, cmp_u32);
    /* merged, then complemented if negated: the characters taken */
    uint32_t lo[RX_MAX_RANGES + 1], hi[RX_MAX_RANGES + 1];
    int n = 0;
    for (int i = 0; i < s->n; i++) {
        if (n && pairs[2 * i] <= hi[n - 1] + 1) {
            if (pairs[2 * i + 1] > hi[n - 1]) hi[n - 1] = pairs[2 * i + 1];
        } else lo[n] = pairs[2 * i], hi[n++] = pairs[2 * i + 1];
    }
    if (neg) {
        uint32_t nl[RX_MAX_RANGES + 1], nh[RX_MAX_RANGES + 1], from = 0;
        int k = 0;
        for (int i = 0; i < n; i++) {
            if (lo[i] > from) nl[k] = from, nh[k++] = lo[i] - 1;
            from = hi[i] + 1;
        }
        if (from <= 0x10ffff) nl[k] = from, nh[k++] = 0x10ffff;
        memcpy(lo, nl, sizeof nl);
        memcpy(hi, nh, sizeof nh);
        n = k;
    }
    sb_add(r->b, "[");
    int kept = 0;
    for (int i = 0; i < n; i++) {
        /* cut out 0-0x1f, '"' (0x22) and '\\' (0x5c) */
        uint32_t cuts[][2] = {{0, 0x1f}, {0x22, 0x22}, {0x5c, 0x5c}};
        uint32_t a = lo[i], z = hi[i];
        for (int j = 0; j < 3 && a <= z; j++) {
            if (z < cuts[j][0] || a > cuts[j][1]) continue;
            if (a < cuts[j][0]) {
                sb_add(r->b, "\\U%08x-\\U%08x", a, cuts[j][0] - 1);
                kept++;
            }
            a = cuts[j][1] + 1;
        }
        if (a <= z) {
            sb_add(r->b, "\\U%08x-\\U%08x", a, z);
            kept++;
        }
    }
    sb_add(r->b, "]");
    if (!kept) return rx_fail(r, "a character class with nothing a JSON string holds unescaped");
    return true;
}

/* A literal character: as it stands in the JSON text (escaped where JSON must escape it). */
static void lit_emit(rx *r, uint32_t ch) {
    if (ch == '"') sb_add(r->b, "\"\\\\\\\"\"");
    else if (ch == '\\') sb_add(r->b, "\"\\\\\\\\\"");
    else if (ch < 0x20) {
        const char *esc = ch == '\n' ? "n" : ch == '\t' ? "t" : ch == '\r' ? "r" : ch == '\b' ? "b" : ch == '\f' ? "f" : NULL;
        if (esc) sb_add(r->b, "\"\\\\%s\"", esc);
        else sb_add(r->b, "\"\\\\u%04x\"", ch);
    } else sb_add(r->b, "[\\U%08x]", ch);
}

static bool rx_alt(rx *r);

static bool rx_atom(rx *r) {
    char c = *r->p;
    if (c == '(') {
        r->p++;
        if (r->p[0] == '?') {
            if (r->p[1] == ':') r->p += 2;
            else if (r->p[1] == '<' && r->p[2] != '=' && r->p[2] != '!') { /* a named group */
                const char *e = strchr(r->p, '>');
                if (!e) return rx_fail(r, "a malformed group name");
                r->p = e + 1;
            } else return rx_fail(r, "lookaround is not supported");
        }
        if (++r->depth > KVLM_PATTERN_MAX_NESTING) return rx_fail(r, "groups nested deeper than 64 levels");
        sb_add(r->b, "( ");
        if (!rx_alt(r)) return false;
        if (*r->p != ')') return rx_fail(r, "a group without its ')'");
        r->p++;
        r->depth--;
        sb_add(r->b, " )");
        return true;
    }
    rx_set set = {0};
    if (c == '[') {
        r->p++;
        bool neg = *r->p == '^';
        if (neg) r->p++;
        bool first = true;
        while (*r->p != ']' || first) {
            first = false;
            if (!*r->p) return rx_fail(r, "a class without its ']'");
            long lo, hi;
            char k = 0;
            if (*r->p == '\\') {
                r->p++;
                if ((lo = rx_escape(r, &k)) == -1) return false;
                if (lo == -2) {
                    if (k < 'a') return rx_fail(r, "\\D, \\W or \\S inside a class is not supported");
                    if (!set_shorthand(r, &set, k)) return false;
                    continue;
                }
            } else if ((lo = rx_utf8(r)) < 0) return rx_fail(r, "invalid UTF-8");
            hi = lo;
            if (r->p[0] == '-' && r->p[1] && r->p[1] != ']') {
                r->p++;
                if (*r->p == '\\') {
                    r->p++;
                    if ((hi = rx_escape(r, &k)) < 0) return hi == -2 ? rx_fail(r, "a range ending in a class") : false;
                } else if ((hi = rx_utf8(r)) < 0) return rx_fail(r, "invalid UTF-8");
                if (hi < lo) return rx_fail(r, "a range whose end is before its start");
            }
            if (!set_add(r, &set, (uint32_t)lo, (uint32_t)hi)) return false;
        }
        r->p++;
        return set_emit(r, &set, neg);
    }
    if (c == '.') { /* any character but a line terminator */
        r->p++;
        return set_add(r, &set, '\n', '\n') && set_add(r, &set, '\r', '\r') && set_add(r, &set, 0x2028, 0x2029) &&
               set_emit(r, &set, true);
    }
    if (c == '\\') {
        r->p++;
        char k = 0;
        long ch = rx_escape(r, &k);
        if (ch == -1) return false;
        if (ch == -2) {
            bool neg = k < 'a';
            return set_shorthand(r, &set, (char)(neg ? k + 32 : k)) && set_emit(r, &set, neg);
        }
        lit_emit(r, (uint32_t)ch);
        return true;
    }
    if (strchr("*+?{", c)) return rx_fail(r, "a quantifier with nothing before it");
    if (c == '^' || c == '$') return rx_fail(r, "'^' and '$' are supported only at the ends");
    long ch = rx_utf8(r);
    if (ch < 0) return rx_fail(r, "invalid UTF-8");
    lit_emit(r, (uint32_t)ch);
    return true;
}

static bool rx_seq(rx *r) {
    while (*r->p && *r->p != '|' && *r->p != ')' && !(r->p[0] == '$' && !r->p[1])) {
        if (!rx_atom(r)) return false;
        char q = *r->p;
        if (q == '*' || q == '+' || q == '?') {
            sb_add(r->b, "%c", q);
            r->p++;
        } else if (q == '{' && r->p[1] >= '0' && r->p[1] <= '9') {
            char *end;
            long lo = strtol(r->p + 1, &end, 10), hi = lo;
            if (*end == ',') hi = end[1] == '}' ? -1 : strtol(end + 1, &end, 10), end += hi < 0;
            if (*end != '}' || (hi >= 0 && hi < lo) || lo > 4096 || hi > 4096)
                return rx_fail(r, "a malformed or too large {m,n} (4096 at most)");
            if (hi < 0) sb_add(r->b, "{%ld,}", lo);
            else sb_add(r->b, "{%ld,%ld}", lo, hi);
            r->p = end + 1;
        } else {
            sb_add(r->b, " ");
            continue;
        }
        if (*r->p == '?') r->p++; /* lazy: the same language */
        if (*r->p == '*' || *r->p == '+' || *r->p == '?' || *r->p == '{') return rx_fail(r, "a quantifier on a quantifier");
        sb_add(r->b, " ");
    }
    return true;
}

static bool rx_alt(rx *r) {
    for (;;) {
        if (!rx_seq(r)) return false;
        if (*r->p != '|') return true;
        r->p++;
        sb_add(r->b, " | ");
    }
}

/* The string's content as a pattern: anchored at each end it is written with
 * '^' and '$', and otherwise any text may stand before or after (JSON Schema
 * matches a pattern anywhere in the string). */
static bool gen_pattern(conv *c, const char *re, const char *path, sbuf *b) {
    rx r = {c, re, path, b, 0};
    bool start = *r.p == '^';
    if (start) r.p++;
    sb_add(b, "\"\\\"\" ");
    if (!start) sb_add(b, "char* ");
    sb_add(b, "( ");
    if (!rx_alt(&r)) return false;
    if (*r.p == ')') return rx_fail(&r, "a ')' without its group");
    bool end = *r.p == '$';
    sb_add(b, " ) ");
    if (!end) sb_add(b, "char* ");
    sb_add(b, "\"\\\"\"");
    c->need |= R_STRING;
    return true;
}

static bool gen_string(conv *c, json_t *s, const char *path, sbuf *b) {
    long lo, hi;
    if (!count(c, s, "minLength", path, &lo) || !count(c, s, "maxLength", path, &hi)) return false;
    if (hi >= 0 && lo > hi) return cfail(c, path, "'minLength' is above 'maxLength'", NULL);
    json_t *pat = json_object_get(s, "pattern");
    if (pat) {
        if (!json_is_string(pat)) return cfail(c, path, "'pattern' must be a string", NULL);
        if (lo >= 0 || hi >= 0 || json_object_get(s, "format"))
            return cfail(c, path, "'pattern' beside 'minLength', 'maxLength' or 'format' is not supported", NULL);
        return gen_pattern(c, json_string_value(pat), path, b);
    }
    json_t *f = json_object_get(s, "format");
    const char *fmt = json_is_string(f) ? json_string_value(f) : "";
    unsigned rule = !strcmp(fmt, "date") ? R_DATE : !strcmp(fmt, "time") ? R_TIME : !strcmp(fmt, "date-time") ? R_DATE | R_TIME
                    : !strcmp(fmt, "uuid") ? R_UUID : 0;
    if (rule) {
        if (lo >= 0 || hi >= 0) return cfail(c, path, "'minLength' or 'maxLength' beside format '%s' is not supported", fmt);
        c->need |= rule;
        sb_add(b, "\"\\\"\" %s \"\\\"\"", rule == R_DATE ? "date" : rule == R_TIME ? "time" : rule == R_UUID ? "uuid"
                                                                                                                  : "date \"T\" time");
        return true;
    }
    c->need |= R_STRING;
    if (lo < 0 && hi < 0) { sb_add(b, "string"); return true; }
    sb_add(b, "\"\\\"\" char");
    repeat(b, lo, hi);
    sb_add(b, " \"\\\"\"");
    return true;
}

/* ---- integer ranges: decimal strings between two bounds, digit by digit ---- */

/* Numbers of x's length from x to y (digit strings of equal length n), as GBNF. */
static void digits_between(sbuf *b, const char *x, const char *y, int n) {
    if (!n) return;
    if (x[0] == y[0]) {
        sb_add(b, "\"%c\" ", x[0]);
        digits_between(b, x + 1, y + 1, n - 1);
        return;
    }
    bool low = true, high = true; /* the rest of x all 0s, of y all 9s */
    for (int i = 1; i < n; i++) low &= x[i] == '0', high &= y[i] == '9';
    if (low && high) {
        sb_add(b, "[%c-%c] ", x[0], y[0]);
        if (n > 1) sb_add(b, "[0-9]{%d} ", n - 1);
        return;
    }
    char nines[24], zeros[24];
    memset(nines, '9', (size_t)n);
    memset(zeros, '0', (size_t)n);
    sb_add(b, "( ");
    if (low) sb_add(b, "\"%c\" [0-9]{%d} ", x[0], n - 1);
    else {
        sb_add(b, "\"%c\" ", x[0]);
        digits_between(b, x + 1, nines, n - 1);
    }
    if (x[0] + 1 <= y[0] - 1) sb_add(b, "| [%c-%c] [0-9]{%d} ", x[0] + 1, y[0] - 1, n - 1);
    sb_add(b, "| ");
    if (high) sb_add(b, "\"%c\" [0-9]{%d} ", y[0], n - 1);
    else {
        sb_add(b, "\"%c\" ", y[0]);
        digits_between(b, zeros, y + 1, n - 1);
    }
    sb_add(b, ") ");
}

enum { INT_DIGITS = 16 };
#define INT_LIMIT 9999999999999999LL /* 16 digits: as far as the JSON grammar's integers go */

/* Non-negative integers from a to b (b < 0: no bound), without leading zeros. */
static void uint_between(sbuf *b, long long a, long long z) {
    char xa[24], xz[24];
    int la = snprintf(xa, sizeof xa, "%lld", a), lz = z < 0 ? INT_DIGITS : snprintf(xz, sizeof xz, "%lld", z);
    sb_add(b, "( ");
    for (int d = la; d <= lz; d++) {
        if (d > la) sb_add(b, "| ");
        if (z < 0 && d > la) { /* every longer number, up to the digit limit */
            sb_add(b, "[1-9] [0-9]{%d,%d} ", d - 1, INT_DIGITS - 1);
            break;
        }
        char lo[24], hi[24];
        if (d == la) memcpy(lo, xa, (size_t)d + 1);
        else { lo[0] = '1'; memset(lo + 1, '0', (size_t)d - 1); lo[d] = 0; }
        if (z >= 0 && d == lz) memcpy(hi, xz, (size_t)d + 1);
        else { memset(hi, '9', (size_t)d); hi[d] = 0; }
        digits_between(b, lo, hi, d);
    }
    sb_add(b, ")");
}

/* A bound of an integer: minimum and exclusiveMinimum (lower), maximum and
 * exclusiveMaximum (upper), the tighter of each pair; *set false if none. */
static bool int_bound(conv *c, json_t *s, const char *path, bool lower, long long *out, bool *set) {
    const char *keys[2] = {lower ? "minimum" : "maximum", lower ? "exclusiveMinimum" : "exclusiveMaximum"};
    *set = false;
    for (int k = 0; k < 2; k++) {
        json_t *v = json_object_get(s, keys[k]);
        if (!v) continue;
        if (!json_is_number(v)) return cfail(c, path, "'%s' must be a number", keys[k]);
        double x = json_number_value(v);
        if (x < -(double)INT_LIMIT || x > (double)INT_LIMIT) return cfail(c, path, "'%s' past 16 digits is not supported", keys[k]);
        double r = lower ? (k ? floor(x) + 1 : ceil(x)) : (k ? ceil(x) - 1 : floor(x));
        long long n = (long long)r;
        if (!*set || (lower ? n > *out : n < *out)) *out = n;
        *set = true;
    }
    return true;
}

/* ---- number ranges: decimals between two bounds -----------------------------
 * A bound is its shortest decimal (the fewest digits that read back as the
 * same double): its integer part and its fraction's digits, and whether it
 * is exclusive. A number between bounds is written without an exponent; its
 * fraction has at most FRAC_MAX digits, as the JSON grammar's. */
enum { FRAC_MAX = 16 };
typedef struct {
    bool set, strict, neg;
    long long ip;             /* integer part of |x| */
    char fp[FRAC_MAX + 1];    /* fraction digits, no trailing zeros */
} dec_bound;

/* x as a bound; false if it needs more than 16 integer or fraction digits. */
static bool dec_of(double x, bool strict, dec_bound *d) {
    memset(d, 0, sizeof *d);
    d->set = true, d->strict = strict, d->neg = x < 0;
    x = fabs(x);
    char buf[64];
    int p = 1;
    for (; p < 17; p++) {
        snprintf(buf, sizeof buf, "%.*e", p - 1, x);
        if (strtod(buf, NULL) == x) break;
    }
    snprintf(buf, sizeof buf, "%.*e", p - 1, x);
    char m[24];
    int nm = 0;
    const char *e = buf;
    for (; *e && *e != 'e'; e++)
        if (*e >= '0' && *e <= '9') m[nm++] = *e;
    int point = atoi(e + 1) + 1; /* integer digits */
    if (point > INT_DIGITS || nm - point > FRAC_MAX) return false;
    for (int i = 0; i < point; i++) d->ip = 10 * d->ip + (i < nm ? m[i] - '0' : 0);
    int nf = 0;
    for (int i = point < 0 ? point : (point < nm ? point : nm); i < nm; i++) d->fp[nf++] = i < 0 ? '0' : m[i];
    while (nf > 0 && d->fp[nf - 1] == '0') nf--;
    d->fp[nf] = 0;
    if (!d->ip && !nf) d->neg = false; /* -0 */
    return true;
}

static int fdig(const dec_bound *d, int i) { return i < (int)strlen(d->fp) ? d->fp[i] - '0' : 0; }
static bool fzero_from(const dec_bound *d, int i) { return i >= (int)strlen(d->fp); }

/* After an integer part equal to lo's (tl) and/or hi's (th), and the
 * fraction digits before position i equal to theirs: may the number end
 * here (its digits so far followed by zeros)? */
static bool frac_eps(const dec_bound *lo, bool tl, const dec_bound *hi, bool th, int i) {
    return (!tl || (fzero_from(lo, i) && !lo->strict)) && (!th || !(fzero_from(hi, i) && hi->strict));
}

/* ... and the non-empty digit strings from position i that keep it within
 * them (at most fm digits in all), as GBNF into b; false if there is none. */
static bool frac_ne(sbuf *b, const dec_bound *lo, bool tl, const dec_bound *hi, bool th, int i, int fm) {
    if (i >= fm) return false;
    if (!tl && !th) {
        sb_add(b, "[0-9]{1,%d}", fm - i);
        return true;
    }
    int dl = tl ? fdig(lo, i) : 0, dh = th ? fdig(hi, i) : 9;
    if (tl && th && dl > dh) return false;
    struct { int from, to; bool tl, th; } g[3];
    int ng = 0;
    if (tl && th && dl == dh) g[ng++] = (__typeof__(g[0])){dl, dl, true, true};
    else {
        if (tl) g[ng++] = (__typeof__(g[0])){dl, dl, true, false};
        if ((tl ? dl + 1 : dl) <= (th ? dh - 1 : dh)) g[ng++] = (__typeof__(g[0])){tl ? dl + 1 : dl, th ? dh - 1 : dh, false, false};
        if (th) g[ng++] = (__typeof__(g[0])){dh, dh, false, true};
    }
    sbuf out = {0};
    int alts = 0;
    for (int k = 0; k < ng; k++) {
        sbuf rest = {0};
        bool ne = frac_ne(&rest, lo, g[k].tl, hi, g[k].th, i + 1, fm), eps = frac_eps(lo, g[k].tl, hi, g[k].th, i + 1);
        if (ne || eps) {
            if (g[k].from == g[k].to) sb_add(&out, "%s\"%d\"", alts ? " | " : "", g[k].from);
            else sb_add(&out, "%s[%d-%d]", alts ? " | " : "", g[k].from, g[k].to);
            if (ne) sb_add(&out, eps ? " ( %s )?" : " %s", rest.s);
            alts++;
        }
        free(rest.s);
    }
    if (alts) sb_add(b, "( %s )", out.s);
    free(out.s);
    return alts > 0;
}

/* Integer part n then a fraction within the tight bounds, as one more
 * alternative of b (counted in *alts); nothing if none fits. */
static void int_frac(sbuf *b, int *alts, long long n, const dec_bound *lo, bool tl, const dec_bound *hi, bool th,
                     int fm) {
    sbuf f = {0};
    bool ne = frac_ne(&f, lo, tl, hi, th, 0, fm), eps = frac_eps(lo, tl, hi, th, 0);
    if (ne || eps) {
        sb_add(b, "%s\"%lld\"", (*alts)++ ? " | " : "", n);
        if (ne) sb_add(b, eps ? " ( \".\" %s )?" : " \".\" %s", f.s);
    }
    free(f.s);
}

/* Non-negative numbers from lo (unset: 0) to hi (unset: none), with at most
 * fm fraction digits, written as GBNF alternatives into b; their count. */
static int nonneg_between(sbuf *b, const dec_bound *lo, const dec_bound *hi, int fm) {
    static const dec_bound zero = {true, false, false, 0, ""};
    if (!lo->set) lo = &zero;
    if (hi->set && hi->ip < lo->ip) return 0;
    int alts = 0;
    bool same = hi->set && hi->ip == lo->ip;
    int_frac(b, &alts, lo->ip, lo, true, hi, same, fm);
    if (same) return alts;
    if (!hi->set || lo->ip + 1 <= hi->ip - 1) {
        sb_add(b, "%s", alts++ ? " | " : "");
        uint_between(b, lo->ip + 1, hi->set ? hi->ip - 1 : -1);
        if (fm > 0) sb_add(b, " ( \".\" [0-9]{1,%d} )?", fm);
    }
    if (hi->set) int_frac(b, &alts, hi->ip, lo, false, hi, true, fm);
    return alts;
}

/* A bound of a number: minimum or exclusiveMinimum (lower; maximum ...
 * upper), the tighter of the two when both are given. */
static bool num_bound(conv *c, json_t *s, const char *path, bool lower, dec_bound *out) {
    const char *keys[2] = {lower ? "minimum" : "maximum", lower ? "exclusiveMinimum" : "exclusiveMaximum"};
    double best = 0;
    memset(out, 0, sizeof *out);
    for (int k = 0; k < 2; k++) {
        json_t *v = json_object_get(s, keys[k]);
        if (!v) continue;
        if (!json_is_number(v)) return cfail(c, path, "'%s' must be a number", keys[k]);
        double x = json_number_value(v);
        bool tighter = !out->set || (lower ? x > best || (x == best && k) : x < best || (x == best && k));
        if (!tighter) continue;
        if (!dec_of(x, k == 1, out)) return cfail(c, path, "'%s' needs more than 16 digits before or after the point", keys[k]);
        best = x;
    }
    return true;
}

/* Integer multiples of k (2 .. MULT_MAX), no bounds, of at most 16 digits
 * as the JSON grammar's integers: "0", or an optional "-", a prefix that is
 * a multiple of m and the j zeros of k = m 10^j. The prefix is read by the
 * automaton of its remainder mod m and its length (one rule per live pair:
 * m 16 at most), which may end where the remainder is 0. */
enum { MULT_MAX = 100 }; /* m, k's digits before its trailing zeros */
static void multiples_of(conv *c, long long k, sbuf *b) {
    int j = 0;
    long long m = k;
    while (m % 10 == 0) m /= 10, j++;
    const int P = INT_DIGITS - j; /* the prefix's digits at most */
    char base[48];
    rule_name(c, "mult", base, sizeof base);
    /* live[n][r]: after n digits with remainder r, a multiple can still end */
    bool live[INT_DIGITS + 1][MULT_MAX];
    for (int n = P; n >= 1; n--)
        for (long long r = 0; r < m; r++) {
            bool l = r == 0;
            for (int d = 0; d < 10 && !l && n < P; d++) l = live[n + 1][(10 * r + d) % m];
            live[n][r] = l;
        }
    /* digits from state (r, n), and the first digit (n = 0, 1-9): grouped by their next state */
    for (int n = 0; n < P; n++)
        for (long long r = 0; r < (n ? m : 1); r++) {
            if (n && !live[n][r]) continue;
            sbuf *o = n ? &c->out : b;
            if (n) sb_add(o, "%s-%lld-%d ::= ( ", base, r, n);
            else sb_add(o, "( \"0\" | \"-\"? ( ");
            int alts = 0;
            for (long long t = 0; t < m; t++) {
                if (!live[n + 1][t]) continue;
                char cls[16];
                int nc = 0;
                for (int d = n ? 0 : 1; d < 10; d++)
                    if ((10 * r + d) % m == t) cls[nc++] = (char)('0' + d);
                if (!nc) continue;
                cls[nc] = 0;
                if (n + 1 < P) sb_add(o, "%s[%s] %s-%lld-%d", alts++ ? " | " : "", cls, base, t, n + 1);
                else sb_add(o, "%s[%s]", alts++ ? " | " : "", cls);
            }
            if (n) sb_add(o, " )%s\n", r == 0 ? "?" : "");
            else if (j) sb_add(o, " ) \"%.*s\" )", j, "0000000000000000");
            else sb_add(o, " ) )");
        }
}

/* multipleOf m: *k an integer m (0: not one), *fm the fraction digits a
 * multiple may have where m is 10^-q (q; 16 for no multipleOf); false with
 * the reason where neither. */
static bool multiple_of(conv *c, json_t *s, const char *path, long long *k, int *fm) {
    *k = 0, *fm = FRAC_MAX;
    json_t *v = json_object_get(s, "multipleOf");
    if (!v) return true;
    if (!json_is_number(v) || !(json_number_value(v) > 0)) return cfail(c, path, "'multipleOf' must be a number above 0", NULL);
    double m = json_number_value(v);
    dec_bound d;
    if (m == floor(m) && m <= 1e15) {
        long long w = (long long)m, r = w;
        while (r % 10 == 0) r /= 10;
        if (r <= MULT_MAX) {
            *k = w, *fm = 0;
            return true;
        }
    }
    if (dec_of(m, false, &d) && d.ip == 0) { /* 10^-q: q - 1 zeros and a 1 */
        size_t q = strlen(d.fp);
        bool pow10 = q > 0 && d.fp[q - 1] == '1';
        for (size_t i = 0; i + 1 < q; i++) pow10 &= d.fp[i] == '0';
        if (pow10) {
            *fm = (int)q;
            return true;
        }
    }
    return cfail(c, path, "'multipleOf' other than a power of ten (0.1, 0.01, ...) or a whole number of up to two "
                 "digits and zeros (7, 25, 360, 1000) is not supported", NULL);
}

static bool gen_number(conv *c, json_t *s, const char *path, bool integer, sbuf *b) {
    long long k;
    int fm;
    if (!multiple_of(c, s, path, &k, &fm)) return false;
    bool bounded = json_object_get(s, "minimum") || json_object_get(s, "maximum") ||
                   json_object_get(s, "exclusiveMinimum") || json_object_get(s, "exclusiveMaximum");
    if (k > 1 && bounded) return cfail(c, path, "'multipleOf' a whole number beside bounds is not supported", NULL);
    if (k > 1) { /* whole multiples, written as integers */
        multiples_of(c, k, b);
        return !c->out.oom && !b->oom;
    }
    if (k == 1 || (integer && fm < FRAC_MAX)) integer = true, fm = 0; /* any integer is a multiple of 10^-q */
    if (!integer) {
        dec_bound lo, hi;
        if (!num_bound(c, s, path, true, &lo) || !num_bound(c, s, path, false, &hi)) return false;
        if (!lo.set && !hi.set) {
            if (fm < FRAC_MAX) { /* at most fm fraction digits, no exponent */
                c->need |= R_INTEGER;
                sb_add(b, "integer ( \".\" [0-9]{1,%d} )?", fm);
                return true;
            }
            c->need |= R_NUMBER;
            sb_add(b, "number");
            return true;
        }
        /* the negative part ("-" and a magnitude above 0 or |hi|, up to |lo|), then the rest */
        sbuf alt = {0};
        int n = 0;
        bool lo_neg = lo.set && lo.neg, hi_neg = hi.set && hi.neg;
        if (!lo.set || lo_neg) {
            static const dec_bound zero_x = {true, true, false, 0, ""}; /* above 0: no "-0" */
            dec_bound mlo = hi_neg ? hi : zero_x, mhi = lo;
            mlo.neg = mhi.neg = false;
            sbuf neg = {0};
            int k = nonneg_between(&neg, &mlo, &mhi, fm);
            if (k) sb_add(&alt, "\"-\" ( %s )", neg.s), n++;
            free(neg.s);
        }
        if (!hi_neg) {
            dec_bound nlo = lo;
            if (lo_neg) nlo.set = false; /* from 0 */
            sbuf pos = {0};
            int k = nonneg_between(&pos, &nlo, &hi, fm);
            if (k) sb_add(&alt, "%s( %s )", n ? " | " : "", pos.s), n++;
            free(pos.s);
        }
        if (n) sb_add(b, "( %s )", alt.s);
        free(alt.s);
        if (!n) return cfail(c, path, "no number lies between its bounds", NULL);
        return !b->oom || cfail(c, path, "out of memory", NULL);
    }
    long long lo = 0, hi = 0;
    bool has_lo, has_hi;
    if (!int_bound(c, s, path, true, &lo, &has_lo) || !int_bound(c, s, path, false, &hi, &has_hi)) return false;
    if (!has_lo && !has_hi) {
        c->need |= R_INTEGER;
        sb_add(b, "integer");
        return true;
    }
    if (has_lo && has_hi && lo > hi) return cfail(c, path, "no integer lies between its bounds", NULL);
    /* the negative part ("-" then its magnitude), then the rest */
    bool neg = !has_lo || lo < 0, pos = !has_hi || hi >= 0;
    sb_add(b, "( ");
    if (neg) {
        long long from = has_hi && hi < 0 ? -hi : 1, to = has_lo ? -lo : -1;
        sb_add(b, "\"-\" ");
        uint_between(b, from, to);
    }
    if (pos) {
        sb_add(b, neg ? " | " : "");
        uint_between(b, has_lo && lo > 0 ? lo : 0, has_hi ? hi : -1);
    }
    sb_add(b, " )");
    return true;
}

/* An object's or an array's subschemas are inside its brackets (c->nest). */
static bool gen_object(conv *c, json_t *s, const char *hint, const char *path, int depth, sbuf *b) {
    c->nest++;
    bool ok = gen_object_in(c, s, hint, path, depth, b);
    c->nest--;
    return ok;
}

static bool gen_array(conv *c, json_t *s, const char *hint, const char *path, int depth, sbuf *b) {
    c->nest++;
    bool ok = gen_array_in(c, s, hint, path, depth, b);
    c->nest--;
    return ok;
}

static bool gen_type(conv *c, json_t *s, const char *type, const char *hint, const char *path, int depth, sbuf *b) {
    if (!strcmp(type, "object")) return gen_object(c, s, hint, path, depth, b);
    if (!strcmp(type, "array")) return gen_array(c, s, hint, path, depth, b);
    if (!strcmp(type, "string")) return gen_string(c, s, path, b);
    if (!strcmp(type, "number") || !strcmp(type, "integer")) return gen_number(c, s, path, !strcmp(type, "integer"), b);
    if (!strcmp(type, "boolean")) { sb_add(b, "( \"true\" | \"false\" )"); return true; }
    if (!strcmp(type, "null")) { sb_add(b, "\"null\""); return true; }
    return cfail(c, path, "unknown type '%.40s'", type);
}

/* Schema s as a rule; its name in name. */
static bool gen(conv *c, json_t *s, const char *hint, const char *path, int depth, char *name, size_t cap) {
    if (c->failed) return false;
    if (depth > DEPTH_MAX) return cfail(c, path, "subschemas nested deeper than 64 levels", NULL);
    if (json_is_true(s) || (json_is_object(s) && !json_object_size(s))) {
        c->need |= R_VALUE;
        snprintf(name, cap, "value");
        return true;
    }
    if (json_is_false(s)) return cfail(c, path, "the schema false matches nothing", NULL);
    if (!json_is_object(s)) return cfail(c, path, "a schema must be an object or a boolean", NULL);
    for (int i = 0; refused[i]; i++)
        if (json_object_get(s, refused[i])) return cfail(c, path, "'%s' is not supported", refused[i]);
    json_t *ty = json_object_get(s, "type");
    if (json_object_get(s, "multipleOf") &&
        !(json_is_string(ty) && (!strcmp(json_string_value(ty), "number") || !strcmp(json_string_value(ty), "integer"))))
        return cfail(c, path, "'multipleOf' is supported in a schema of type number or integer", NULL);
    json_t *ref = json_object_get(s, "$ref");
    if (ref) {
        if (!json_is_string(ref)) return cfail(c, path, "'$ref' must be a string", NULL);
        return gen_ref(c, json_string_value(ref), path, depth, name, cap);
    }
    sbuf b = {0};
    bool ok = true;
    json_t *v, *x;
    size_t i;
    if ((v = json_object_get(s, "const"))) literal(&b, v);
    else if ((v = json_object_get(s, "enum"))) {
        if (!json_is_array(v) || !json_array_size(v)) ok = cfail(c, path, "'enum' must be a non-empty array", NULL);
        json_array_foreach(v, i, x) {
            if (i) sb_add(&b, " | ");
            literal(&b, x);
        }
    } else if ((v = json_object_get(s, "anyOf")) || (v = json_object_get(s, "oneOf")) || (v = json_object_get(s, "allOf"))) {
        bool all = v == json_object_get(s, "allOf");
        if (!json_is_array(v) || !json_array_size(v)) ok = cfail(c, path, "'anyOf', 'oneOf', 'allOf' must be non-empty arrays", NULL);
        else if (all && json_array_size(v) > 1) ok = cfail(c, path, "'allOf' of more than one schema is not supported", NULL);
        json_array_foreach(v, i, x) {
            char sub[48], p[300];
            snprintf(p, sizeof p, "%s/%zu", path, i);
            if (!(ok = ok && gen(c, x, hint, p, depth + 1, sub, sizeof sub))) break;
            sb_add(&b, "%s%s", i ? " | " : "", sub);
        }
    } else {
        json_t *t = json_object_get(s, "type");
        if (json_is_string(t)) ok = gen_type(c, s, json_string_value(t), hint, path, depth, &b);
        else if (json_is_array(t) && json_array_size(t)) {
            json_array_foreach(t, i, x) {
                if (!json_is_string(x)) { ok = cfail(c, path, "'type' must list strings", NULL); break; }
                if (i) sb_add(&b, " | ");
                sb_add(&b, "( ");
                if (!(ok = gen_type(c, s, json_string_value(x), hint, path, depth, &b))) break;
                sb_add(&b, " )");
            }
        } else if (t) ok = cfail(c, path, "'type' must be a string or an array of them", NULL);
        else if (json_object_get(s, "properties") || json_object_get(s, "additionalProperties"))
            ok = gen_object(c, s, hint, path, depth, &b);
        else if (json_object_get(s, "items") || json_object_get(s, "prefixItems")) ok = gen_array(c, s, hint, path, depth, &b);
        else {
            c->need |= R_VALUE;
            sb_add(&b, "value");
        }
    }
    if (b.oom) c->out.oom = true;
    if (ok && !c->failed && b.s) {
        rule_name(c, hint, name, cap);
        sb_add(&c->out, "%s ::= %s\n", name, b.s);
    }
    free(b.s);
    return ok && !c->failed && !c->out.oom;
}

/* JSON's pieces (RFC 8259) the rules made use, once; blanks between tokens
 * held as llama.cpp holds them: nothing, a space, or a newline and up to 20
 * spaces or tabs. */
static void shared_rules(conv *c) {
    unsigned n = c->need;
    if (n & R_VALUE) n |= R_WS | R_STRING | R_NUMBER;
    if (n & R_NUMBER) n |= R_INTEGER;
    sb_add(&c->out, "ws ::= | \" \" | \"\\n\" [ \\t]{0,20}\n");
    if (n & R_STRING) {
        sb_add(&c->out, "string ::= \"\\\"\" char* \"\\\"\"\n");
        sb_add(&c->out, "char ::= [^\"\\\\\\x00-\\x1f] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4} )\n");
    }
    /* digits held as llama.cpp holds them (16 before and after the point), so a
     * weak model cannot run on in one number until max_tokens */
    if (n & R_INTEGER) sb_add(&c->out, "integer ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,15} )\n");
    if (n & R_NUMBER) sb_add(&c->out, "number ::= integer frac\n");
    if (n & R_NUMBER) sb_add(&c->out, "frac ::= ( \".\" [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?\n");
    if (n & R_VALUE) {
        sb_add(&c->out, "value ::= object | array | string | number | \"true\" | \"false\" | \"null\"\n");
        sb_add(&c->out, "object ::= \"{\" ws ( string ws \":\" ws value ws ( \",\" ws string ws \":\" ws value ws )* )? \"}\"\n");
        sb_add(&c->out, "array ::= \"[\" ws ( value ws ( \",\" ws value ws )* )? \"]\"\n");
    }
    if (n & R_DATE)
        sb_add(&c->out, "date ::= [0-9]{4} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | [12] [0-9] | \"3\" [01] )\n");
    if (n & R_TIME)
        sb_add(&c->out, "time ::= ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,9} )? "
                        "( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )\n");
    if (n & R_UUID)
        sb_add(&c->out, "uuid ::= [0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" "
                        "[0-9a-fA-F]{12}\n");
}

char *kvlm_json_schema_to_gbnf(const char *schema, kvlm_error *err) {
    json_error_t je;
    json_t *root = json_loads(schema ? schema : "", JSON_DECODE_ANY, &je);
    if (!root) {
        util_err_set(err, KVLM_EINVAL, "json_schema: line %d, column %d: %s", je.line, je.column, je.text);
        return NULL;
    }
    conv c = {.root = root, .err = err};
    char top[48];
    bool ok = gen(&c, root, "", "", 0, top, sizeof top);
    if (ok) {
        sb_add(&c.out, "root ::= ws %s\n", top);
        shared_rules(&c);
        if (c.out.oom) {
            util_err_set(err, KVLM_ENOMEM, "json_schema: out of memory");
            ok = false;
        }
    } else if (c.out.oom && !c.failed)
        util_err_set(err, KVLM_ENOMEM, "json_schema: out of memory");
    for (int i = 0; i < c.n_refs; i++) free(c.refs[i].ptr);
    free(c.refs);
    json_decref(root);
    if (!ok) {
        free(c.out.s);
        return NULL;
    }
    return c.out.s;
}

char *tok_json_schemas_gbnf(const tok_schema_item *items, int n, kvlm_error *err) {
    conv c = {.err = err};
    bool ok = true;
    for (int i = 0; i < n && ok; i++) {
        for (int k = 0; k < c.n_refs; k++) free(c.refs[k].ptr);
        c.n_refs = 0; /* each schema's $refs point into its own document */
        c.root = items[i].doc;
        c.nest = 0;
        char top[48];
        if ((ok = gen(&c, items[i].schema, items[i].hint ? items[i].hint : "", items[i].path ? items[i].path : "", 0,
                      top, sizeof top)))
            sb_add(&c.out, "%s ::= %s\n", items[i].name, top);
        else if (items[i].what) util_err_prefix(err, "%s", items[i].what);
    }
    if (ok) shared_rules(&c);
    if (ok && c.out.oom) {
        util_err_set(err, KVLM_ENOMEM, "json_schema: out of memory");
        ok = false;
    } else if (!ok && c.out.oom && !c.failed)
        util_err_set(err, KVLM_ENOMEM, "json_schema: out of memory");
    for (int k = 0; k < c.n_refs; k++) free(c.refs[k].ptr);
    free(c.refs);
    if (!ok) {
        free(c.out.s);
        return NULL;
    }
    return c.out.s;
}

kvlm_grammar *kvlm_grammar_from_json_schema(const kvlm_model *model, const char *schema, kvlm_error *err) {
    return kvlm_grammar_build(model, KVLM_GRAMMAR_JSON_SCHEMA, schema, err);
}
