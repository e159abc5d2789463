/* tok/toolcall_xml: the families whose calls are tags around each parameter
 * (Qwen3-Coder and Qwen3.5, Seed-OSS, GLM 4.5+, DeepSeek's DSML), MCP tags
 * (MiroThinker), Gemma 4's own value syntax, and Python calls (pythonic,
 * LFM2). A parameter's text becomes a JSON value by its schema's type: a
 * string as written, other types as JSON (or Python) wrote them. */
#include <stdlib.h>
#include <string.h>
#include "tok/chat_parse_impl.h"

enum { T_STRING = 1, T_INTEGER = 2, T_NUMBER = 4, T_BOOLEAN = 8, T_NULL = 16, T_OBJECT = 32, T_ARRAY = 64 };

static unsigned type_bit(const char *t) {
    static const char *const names[] = {"string", "integer", "number", "boolean", "null", "object", "array"};
    for (int k = 0; k < 7; k++)
        if (t && !strcmp(t, names[k])) return 1u << k;
    return 0;
}

/* The types a parameter's schema allows (0: not known, any). */
static unsigned schema_types(const json_t *sch, int depth) {
    if (!json_is_object(sch) || depth > 4) return 0;
    unsigned m = 0;
    const json_t *t = json_object_get(sch, "type"), *x;
    size_t i;
    if (json_is_string(t)) m |= type_bit(json_string_value(t));
    else if (json_is_array(t))
        json_array_foreach(t, i, x) m |= type_bit(json_string_value(x));
    const char *alts[] = {"anyOf", "oneOf"};
    for (int k = 0; k < 2; k++) {
        const json_t *a = json_object_get(sch, alts[k]);
        json_array_foreach(a, i, x) {
            unsigned b = schema_types(x, depth + 1);
            if (!b) return 0;
            m |= b;
        }
    }
    const json_t *e = json_object_get(sch, "enum");
    if (!m && json_is_array(e)) {
        json_array_foreach(e, i, x) m |= json_is_string(x) ? T_STRING : 0;
        if (m && json_array_size(e) && !(m == T_STRING)) m = 0;
        json_array_foreach(e, i, x) if (!json_is_string(x)) m = 0;
    }
    return m;
}

static unsigned kind_of(const char *j) {
    switch (j[0]) {
    case '"': return T_STRING;
    case '{': return T_OBJECT;
    case '[': return T_ARRAY;
    case 't': case 'f': return T_BOOLEAN;
    case 'n': return T_NULL;
    }
    return strpbrk(j, ".eE") ? T_NUMBER : T_INTEGER;
}

/* A parameter's whole text as a JSON value: strings as they are; other
 * types as JSON or Python wrote them ("True", "None", "[1, 2]"); text that is
 * none of the types allowed stays a string (types 0: JSON if it is). */
static void typed_value(unsigned types, const char *v, size_t n, tc_buf *out) {
    if (types == T_STRING) {
        tc_json_quote(out, v, n);
        return;
    }
    const char *s = v;
    size_t l = n;
    while (l && tc_ws(*s)) s++, l--;
    while (l && tc_ws(s[l - 1])) l--;
    tc_buf j = {0};
    unsigned kind = 0;
    if (l && tc_json_str(s, l, &j) == JC_DONE && j.s) kind = kind_of(j.s);
    else {
        j.n = 0;
        size_t u = 0;
        if (l && tc_python_value(s, l, &u, &j, 0) == JC_DONE && u == l && j.s) kind = kind_of(j.s);
    }
    if (kind && (!types || (types & kind) || (kind == T_INTEGER && (types & T_NUMBER)) || !(types & T_STRING)))
        tc_put(out, j.s, j.n);
    else tc_json_quote(out, v, n);
    if (j.oom) out->oom = true;
    free(j.s);
}

typedef struct {
    const char *open, *close;         /* around each call (or the block of calls) */
    const char *fn_open, *fn_name_end, *fn_close;
    const char *par_open, *par_name_end, *val_open, *par_close;
    bool strip_nl;                    /* a value's first and last newline are the format's */
    bool attrs;                       /* DSML: string="true|false" before '>' */
    bool many;                        /* several calls in one block */
} xml_spec;

/* Parameters until fn_close, into c's arguments (its "{" written). */
static int xml_params(tc_parser *p, size_t *pi, tc_call *c, const char *tool, const xml_spec *x) {
    size_t j = *pi;
    for (bool first = true;;) {
        int r = tc_skip(p, &j, x->fn_close);
        if (r < 0) return JC_MORE;
        if (r > 0) {
            tc_putc(&c->args, '}');
            *pi = j;
            return JC_DONE;
        }
        if ((r = tc_skip(p, &j, x->par_open)) <= 0) return r < 0 ? JC_MORE : JC_BAD;
        size_t e;
        if ((r = tc_find(p, j, x->par_name_end, &e)) <= 0) return r < 0 || p->partial ? JC_MORE : JC_BAD;
        size_t ks = j, ke = e;
        while (ke > ks && tc_ws(p->t[ke - 1])) ke--;
        while (ks < ke && tc_ws(p->t[ks])) ks++;
        if (ks == ke) return JC_BAD;
        j = e + strlen(x->par_name_end);
        unsigned types;
        if (x->attrs) { /* string="true">: raw; "false": JSON */
            size_t gt;
            if ((r = tc_find(p, j, ">", &gt)) <= 0) return r < 0 || p->partial ? JC_MORE : JC_BAD;
            types = memmem(p->t + j, gt - j, "string=\"true\"", 13) ? T_STRING : 0;
            j = gt + 1;
        } else {
            char *key = strndup(p->t + ks, ke - ks);
            if (!key) return JC_BAD;
            types = schema_types(tc_param_schema(p, tool, key), 0);
            free(key);
        }
        if (x->val_open && (r = tc_skip(p, &j, x->val_open)) <= 0) return r < 0 ? JC_MORE : JC_BAD;
        if (!first) tc_putc(&c->args, ',');
        first = false;
        tc_json_quote(&c->args, p->t + ks, ke - ks);
        tc_putc(&c->args, ':');
        size_t at;
        r = tc_find(p, j, x->par_close, &at);
        size_t vs = j, ve = at;
        if (x->strip_nl && vs < ve && p->t[vs] == '\n') vs++;
        if (r <= 0) {
            if (!p->partial) return JC_BAD;
            if (types == T_STRING) { /* a string goes out as it comes */
                if (x->strip_nl && ve > vs && p->t[ve - 1] == '\n') ve--;
                ve = vs + tc_utf8_whole(p->t + vs, ve - vs);
                tc_buf q = {0};
                tc_json_quote(&q, p->t + vs, ve - vs);
                if (q.n) tc_put(&c->args, q.s, q.n - 1); /* no closing quote yet */
                free(q.s);
            }
            return JC_MORE;
        }
        if (x->strip_nl && ve > vs && p->t[ve - 1] == '\n') ve--;
        typed_value(types, p->t + vs, ve - vs, &c->args);
        j = at + strlen(x->par_close);
    }
}

/* One call at t[*pi] (after open): fn_open name fn_name_end params. */
static int xml_call(tc_parser *p, size_t *pi, const xml_spec *x) {
    size_t j = *pi;
    int r = tc_skip(p, &j, x->fn_open);
    if (r <= 0) return r < 0 ? JC_MORE : JC_BAD;
    size_t e;
    if ((r = tc_find(p, j, x->fn_name_end, &e)) <= 0) return r < 0 || p->partial ? JC_MORE : JC_BAD;
    size_t ns = j, ne = e;
    while (ne > ns && tc_ws(p->t[ne - 1])) ne--;
    while (ns < ne && tc_ws(p->t[ns])) ns++;
    if (ns == ne || memchr(p->t + ns, '<', ne - ns) || memchr(p->t + ns, '\n', ne - ns)) return JC_BAD;
    tc_call *c = tc_call_new(p, p->t + ns, ne - ns, NULL, 0);
    if (!c) return JC_BAD;
    tc_putc(&c->args, '{');
    j = e + strlen(x->fn_name_end);
    r = xml_params(p, &j, c, c->name, x);
    if (r == JC_DONE) {
        c->done = true;
        *pi = j;
    }
    return r;
}

static void xml_parse(tc_parser *p, size_t i, const xml_spec *x) {
    for (;;) {
        size_t at;
        int r = tc_find(p, i, x->open, &at);
        tc_text(p, i, at);
        if (r <= 0) {
            if (r < 0) p->stop = true;
            return;
        }
        size_t j = at + strlen(x->open);
        for (int k = 0;; k++) {
            if (k) {
                int more = tc_skip(p, &(size_t){j}, x->fn_open);
                if (more < 0) {
                    p->stop = true;
                    return;
                }
                if (!more || !x->many) break;
            }
            if (!tc_go(p, xml_call(p, &j, x), at)) return;
        }
        if (tc_skip(p, &j, x->close) < 0) {
            p->stop = true;
            return;
        }
        i = j;
    }
}

static const xml_spec k_qwen = {"<tool_call>", "</tool_call>", "<function=", ">", "</function>",
                                "<parameter=", ">", NULL, "</parameter>", true, false, false};
void tc_parse_qwen3_coder(tc_parser *p, size_t i) { xml_parse(p, i, &k_qwen); }

static const xml_spec k_seed = {"<seed:tool_call>", "</seed:tool_call>", "<function=", ">", "</function>",
                                "<parameter=", ">", NULL, "</parameter>", true, false, false};
void tc_parse_seed(tc_parser *p, size_t i) { xml_parse(p, i, &k_seed); }

#define DSML "\xef\xbd\x9c" "DSML\xef\xbd\x9c"
static const xml_spec k_dsml = {"<" DSML "tool_calls>", "</" DSML "tool_calls>", "<" DSML "invoke name=\"", "\">",
                                "</" DSML "invoke>", "<" DSML "parameter name=\"", "\"", NULL, "</" DSML "parameter>",
                                false, true, true};
void tc_parse_dsml(tc_parser *p, size_t i) { xml_parse(p, i, &k_dsml); }

/* GLM 4.5+: "<tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>"
 * (5.2 without the newlines). */
static const xml_spec k_glm_params = {NULL, NULL, NULL, NULL, "</tool_call>",
                                      "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", false, false, false};
static int glm_call(tc_parser *p, size_t *pi) {
    static const char *const ends[] = {"\n", "<arg_key>", "</tool_call>"};
    size_t e;
    int w, r = tc_find_any(p, *pi, ends, 3, &e, &w);
    if (r <= 0) return r < 0 || p->partial ? JC_MORE : JC_BAD;
    size_t ns = *pi, ne = e;
    while (ne > ns && tc_ws(p->t[ne - 1])) ne--;
    while (ns < ne && tc_ws(p->t[ns])) ns++;
    if (ns == ne) return JC_BAD;
    tc_call *c = tc_call_new(p, p->t + ns, ne - ns, NULL, 0);
    if (!c) return JC_BAD;
    tc_putc(&c->args, '{');
    size_t j = e;
    r = xml_params(p, &j, c, c->name, &k_glm_params);
    if (r == JC_DONE) {
        c->done = true;
        *pi = j;
    }
    return r;
}
void tc_parse_glm(tc_parser *p, size_t i) {
    for (;;) {
        size_t at;
        int r = tc_find(p, i, "<tool_call>", &at);
        tc_text(p, i, at);
        if (r <= 0) {
            if (r < 0) p->stop = true;
            return;
        }
        size_t j = at + 11;
        if (!tc_go(p, glm_call(p, &j), at)) return;
        i = j;
    }
}

/* MiroThinker: "<use_mcp_tool>\n<server_name>s</server_name>\n<tool_name>n</tool_name>\n<arguments>\n{...}\n</arguments>\n</use_mcp_tool>" */
static int mcp_call(tc_parser *p, size_t *pi) {
    size_t j = *pi, e;
    int r;
    if ((r = tc_skip(p, &j, "<server_name>")) <= 0) return r < 0 ? JC_MORE : JC_BAD;
    if ((r = tc_find(p, j, "</server_name>", &e)) <= 0) return r < 0 || p->partial ? JC_MORE : JC_BAD;
    j = e + 14;
    if ((r = tc_skip(p, &j, "<tool_name>")) <= 0) return r < 0 ? JC_MORE : JC_BAD;
    if ((r = tc_find(p, j, "</tool_name>", &e)) <= 0) return r < 0 || p->partial ? JC_MORE : JC_BAD;
    size_t ns = j, ne = e;
    while (ne > ns && tc_ws(p->t[ne - 1])) ne--;
    while (ns < ne && tc_ws(p->t[ns])) ns++;
    if (ns == ne) return JC_BAD;
    j = e + 12;
    if ((r = tc_skip(p, &j, "<arguments>")) <= 0) return r < 0 ? JC_MORE : JC_BAD;
    tc_call *c = tc_call_new(p, p->t + ns, ne - ns, NULL, 0);
    if (!c) return JC_BAD;
    if ((r = tc_call_args(p, &j, &c->args)) != JC_DONE) return r;
    if ((r = tc_skip(p, &j, "</arguments>")) <= 0) return r < 0 ? JC_MORE : JC_BAD;
    c->done = true;
    *pi = j;
    return JC_DONE;
}
void tc_parse_mirothinker(tc_parser *p, size_t i) {
    for (;;) {
        size_t at;
        int r = tc_find(p, i, "<use_mcp_tool>", &at);
        tc_text(p, i, at);
        if (r <= 0) {
            if (r < 0) p->stop = true;
            return;
        }
        size_t j = at + 14;
        for (int k = 0;; k++) {
            if (k) {
                size_t q = j;
                int more = tc_skip(p, &q, "<server_name>");
                if (more < 0) {
                    p->stop = true;
                    return;
                }
                if (!more) break;
            }
            if (!tc_go(p, mcp_call(p, &j), at)) return;
        }
        if (tc_skip(p, &j, "</use_mcp_tool>") < 0) {
            p->stop = true;
            return;
        }
        i = j;
    }
}

/* Gemma 4: "<|tool_call>call:name{key:<|"|>text<|"|>,n:3,b:true,o:{...},l:[...]}<tool_call|>" */
#define GQ "<|\"|>"
static int gemma_value(const char *s, size_t n, size_t *pi, tc_buf *out, int depth) {
    size_t i = *pi;
    while (i < n && tc_ws(s[i])) i++;
    if (i >= n || depth > JC_MAX_DEPTH) return JC_BAD;
    if (n - i >= 5 && !memcmp(s + i, GQ, 5)) {
        const char *e = memmem(s + i + 5, n - i - 5, GQ, 5);
        if (!e) return JC_BAD;
        tc_json_quote(out, s + i + 5, (size_t)(e - (s + i + 5)));
        *pi = (size_t)(e - s) + 5;
        return JC_DONE;
    }
    if (s[i] == '{' || s[i] == '[') {
        bool obj = s[i] == '{';
        char close = obj ? '}' : ']';
        tc_putc(out, s[i]);
        i++;
        for (int k = 0;; k++) {
            while (i < n && tc_ws(s[i])) i++;
            if (i < n && s[i] == close) break;
            if (k) tc_putc(out, ',');
            if (obj) {
                if (n - i >= 5 && !memcmp(s + i, GQ, 5)) {
                    if (gemma_value(s, n, &i, out, depth + 1) != JC_DONE) return JC_BAD;
                } else {
                    size_t ks = i;
                    while (i < n && s[i] != ':' && s[i] != '}') i++;
                    size_t ke = i;
                    while (ke > ks && tc_ws(s[ke - 1])) ke--;
                    if (ke == ks) return JC_BAD;
                    tc_json_quote(out, s + ks, ke - ks);
                }
                while (i < n && tc_ws(s[i])) i++;
                if (i >= n || s[i] != ':') return JC_BAD;
                i++;
                tc_putc(out, ':');
            }
            if (gemma_value(s, n, &i, out, depth + 1) != JC_DONE) return JC_BAD;
            while (i < n && tc_ws(s[i])) i++;
            if (i < n && s[i] == ',') i++;
            else if (!(i < n && s[i] == close)) return JC_BAD;
        }
        tc_putc(out, close);
        *pi = i + 1;
        return JC_DONE;
    }
    size_t e = i;
    while (e < n && s[e] != ',' && s[e] != '}' && s[e] != ']') e++;
    size_t l = e - i;
    while (l && tc_ws(s[i + l - 1])) l--;
    if (!l) return JC_BAD;
    size_t u = i;
    tc_buf v = {0};
    if ((tc_json_str(s + i, l, &v) == JC_DONE && v.s && v.s[0] != '"') ||
        (v.n = 0, u = i, tc_python_value(s, i + l, &u, &v, 0) == JC_DONE && u == i + l && v.s))
        tc_put(out, v.s, v.n);
    else tc_json_quote(out, s + i, l);
    free(v.s);
    *pi = e;
    return JC_DONE;
}

void tc_parse_gemma4(tc_parser *p, size_t i) {
    for (;;) {
        size_t at;
        int r = tc_find(p, i, "<|tool_call>", &at);
        tc_text(p, i, at);
        if (r <= 0) {
            if (r < 0) p->stop = true;
            return;
        }
        size_t j = at + 12, e;
        r = tc_skip(p, &j, "call:");
        if (r <= 0) {
            tc_go(p, r < 0 ? JC_MORE : JC_BAD, at);
            return;
        }
        r = tc_find(p, j, "{", &e);
        if (r <= 0 || e == j || memchr(p->t + j, '<', e - j)) {
            tc_go(p, r <= 0 && p->partial ? JC_MORE : JC_BAD, at);
            return;
        }
        tc_call *c = tc_call_new(p, p->t + j, e - j, NULL, 0);
        if (!c) {
            tc_call_fail(p, at);
            return;
        }
        size_t close;
        r = tc_find(p, e, "<tool_call|>", &close);
        if (r <= 0 && p->partial) {
            p->stop = true;
            return;
        }
        size_t end = r == 1 ? close : p->n, q = e;
        tc_buf args = {0};
        int gr = gemma_value(p->t, end, &q, &args, 0);
        while (q < end && tc_ws(p->t[q])) q++;
        if (gr == JC_DONE && q == end && args.s && args.s[0] == '{') {
            tc_put(&c->args, args.s, args.n);
            c->done = true;
        }
        free(args.s);
        if (!tc_go(p, c->done ? JC_DONE : JC_BAD, at)) return;
        i = r == 1 ? close + 12 : p->n;
    }
}

/* Python calls: "[name(k=v, ...), ...]" (vLLM's pythonic; Llama 4, LFM2). */
static int py_list(tc_parser *p, const char *s, size_t n) {
    size_t i = 0;
    while (i < n && tc_ws(s[i])) i++;
    if (i >= n || s[i] != '[') return JC_BAD;
    i++;
    int n0 = p->n_calls;
    for (int k = 0;; k++) {
        while (i < n && tc_ws(s[i])) i++;
        if (i < n && s[i] == ']') {
            i++;
            break;
        }
        if (k) {
            if (i >= n || s[i] != ',') goto bad;
            i++;
            while (i < n && tc_ws(s[i])) i++;
        }
        size_t ns = i;
        while (i < n && s[i] != '(' && !tc_ws(s[i]) && s[i] != ']' && s[i] != ',') i++;
        size_t ne = i;
        while (i < n && tc_ws(s[i])) i++;
        if (ne == ns || i >= n || s[i] != '(') goto bad;
        i++;
        tc_buf args = {0};
        if (tc_python_kwargs(s, n, &i, &args) != JC_DONE) {
            free(args.s);
            goto bad;
        }
        tc_call *c = tc_call_new(p, s + ns, ne - ns, NULL, 0);
        if (c) {
            tc_put(&c->args, args.s, args.n);
            c->done = true;
        }
        free(args.s);
        if (!c) goto bad;
    }
    while (i < n && tc_ws(s[i])) i++;
    if (i == n) return JC_DONE;
bad:
    tc_calls_truncate(p, n0);
    return JC_BAD;
}

void tc_parse_pythonic(tc_parser *p, size_t i) {
    size_t j = tc_skip_ws(p, i);
    if (j < p->n && p->t[j] == '[') {
        if (p->partial) { /* whole only */
            p->stop = true;
            return;
        }
        if (py_list(p, p->t + j, p->n - j) == JC_DONE) return;
    } else if (j == p->n && p->partial) {
        p->stop = true;
        return;
    }
    tc_text(p, i, p->n);
}

void tc_parse_lfm2(tc_parser *p, size_t i) {
    for (;;) {
        size_t at, e;
        int r = tc_find(p, i, "<|tool_call_start|>", &at);
        tc_text(p, i, at);
        if (r <= 0) {
            if (r < 0) p->stop = true;
            return;
        }
        size_t j = at + 19;
        r = tc_find(p, j, "<|tool_call_end|>", &e);
        if (r <= 0 && p->partial) {
            p->stop = true;
            return;
        }
        if (py_list(p, p->t + j, e - j) != JC_DONE) {
            tc_call_fail(p, at);
            return;
        }
        i = r == 1 ? e + 17 : p->n;
    }
}
