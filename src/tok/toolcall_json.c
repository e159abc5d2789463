/* tok/toolcall_json: the families whose calls are JSON between markers
 * (Hermes and Qwen, Llama 3, Mistral, DeepSeek R1 and V3.1, Kimi K2,
 * Command R, firefunction, Granite, Apriel, GigaChat, Functionary v3.1 and
 * v3.2, gpt-oss's harmony, and a bare JSON call). */
#include <stdlib.h>
#include <string.h>
#include "tok/chat_parse_impl.h"

typedef int (*call_fn)(tc_parser *p, size_t *i, const void *arg);

/* Content until open; then each call: open, fn's call, close (if written),
 * until no open follows; text between and after calls is content. */
static void wrapped(tc_parser *p, size_t i, const char *open, const char *close, call_fn fn, const void *arg) {
    for (;;) {
        size_t at;
        int r = tc_find(p, i, open, &at);
        tc_text(p, i, at);
        if (r <= 0) {
            if (r < 0) p->stop = true;
            return;
        }
        size_t j = at + strlen(open);
        if (!tc_go(p, fn(p, &j, arg), at)) return;
        if (close && tc_skip(p, &j, close) < 0) {
            p->stop = true;
            return;
        }
        i = j;
    }
}

static int one(tc_parser *p, size_t *i, const void *k) { return tc_json_call(p, i, k); }
static int list(tc_parser *p, size_t *i, const void *k) { return tc_json_call_list(p, i, k); }

void tc_parse_hermes(tc_parser *p, size_t i) { wrapped(p, i, "<tool_call>", "</tool_call>", one, &tc_keys_default); }

void tc_parse_granite(tc_parser *p, size_t i) { wrapped(p, i, "<|tool_call|>", NULL, list, &tc_keys_default); }

void tc_parse_firefunction(tc_parser *p, size_t i) { wrapped(p, i, "functools", NULL, list, &tc_keys_default); }

/* "Action:\n```json\n[...]```" */
static int cr_action(tc_parser *p, size_t *i, const void *k) {
    int r = tc_skip(p, i, "```json");
    if (r <= 0) return r < 0 ? JC_MORE : JC_BAD;
    return tc_json_call_list(p, i, k);
}
static const tc_keys k_cohere = {{"tool_name", "name", NULL}, {"parameters", "arguments", NULL}, {NULL, NULL}, false};
void tc_parse_command_r_plus(tc_parser *p, size_t i) { wrapped(p, i, "Action:", "```", cr_action, &k_cohere); }

static int giga(tc_parser *p, size_t *i, const void *k) {
    int r = tc_skip(p, i, "function call<|role_sep|>");
    if (r <= 0) return r < 0 ? JC_MORE : JC_BAD;
    return tc_json_call(p, i, k);
}
void tc_parse_gigachat(tc_parser *p, size_t i) {
    wrapped(p, i, "<|message_sep|>", "<|message_sep|>", giga, &tc_keys_default);
}

/* Apriel: "<tool_calls>[...]</tool_calls>"; the answer's markers
 * ([BEGIN FINAL RESPONSE] where the prompt did not open the reasoning,
 * [END FINAL RESPONSE]) are not content. */
void tc_parse_apriel(tc_parser *p, size_t i) {
    static const char *const ms[] = {"<tool_calls>", "[END FINAL RESPONSE]", "[BEGIN FINAL RESPONSE]"};
    for (;;) {
        size_t at;
        int w, r = tc_find_any(p, i, ms, 3, &at, &w);
        tc_text(p, i, at);
        if (r <= 0) {
            if (r < 0) p->stop = true;
            return;
        }
        size_t j = at + strlen(ms[w]);
        if (w == 0) {
            if (!tc_go(p, tc_json_call_list(p, &j, &tc_keys_default), at)) return;
            if (tc_skip(p, &j, "</tool_calls>") < 0) {
                p->stop = true;
                return;
            }
        }
        i = j;
    }
}

/* Mistral: "[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}" repeated (Small 3.2,
 * Devstral, Ministral), or "[TOOL_CALLS][{"name", "arguments", "id"}, ...]"
 * (Nemo). */
static int mistral_call(tc_parser *p, size_t *i, const void *k) {
    size_t j = tc_skip_ws(p, *i);
    if (j >= p->n) return JC_MORE;
    if (p->t[j] == '[') return tc_json_call_list(p, i, k);
    static const char *const ms[] = {"[ARGS]", "[CALL_ID]"};
    size_t at;
    int w, r = tc_find_any(p, j, ms, 2, &at, &w);
    if (r <= 0) {
        if (r == 0 && p->partial && !memchr(p->t + j, '[', p->n - j)) return JC_MORE;
        return r < 0 ? JC_MORE : JC_BAD;
    }
    size_t ne = at;
    while (ne > j && tc_ws(p->t[ne - 1])) ne--;
    if (ne == j || memchr(p->t + j, '[', ne - j)) return JC_BAD;
    const char *id = NULL;
    size_t idl = 0, a = at + strlen(ms[w]);
    if (w == 1) { /* [CALL_ID]id[ARGS] */
        size_t e;
        int r2 = tc_find(p, a, "[ARGS]", &e);
        if (r2 <= 0) return r2 < 0 || p->partial ? JC_MORE : JC_BAD;
        id = p->t + a;
        idl = e - a;
        a = e + 6;
    }
    tc_call *c = tc_call_new(p, p->t + j, ne - j, id, idl);
    if (!c) return JC_BAD;
    int rr = tc_call_args(p, &a, &c->args);
    if (rr == JC_DONE) {
        c->done = true;
        *i = a;
    }
    return rr;
}
void tc_parse_mistral(tc_parser *p, size_t i) { wrapped(p, i, "[TOOL_CALLS]", NULL, mistral_call, &tc_keys_default); }
void tc_parse_mistral_nemo(tc_parser *p, size_t i) { tc_parse_mistral(p, i); }

/* DeepSeek: "<｜tool▁calls▁begin｜>" then calls, each "<｜tool▁call▁begin｜>"
 * [type "<｜tool▁sep｜>"] name ... "<｜tool▁call▁end｜>", then
 * "<｜tool▁calls▁end｜>". R1: "function<｜tool▁sep｜>name\n```json\n{...}\n```";
 * V3.1: "name<｜tool▁sep｜>{...}". */
#define DS_CALLS_BEGIN "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_CALLS_END "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_CALL_BEGIN "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_CALL_END "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_SEP "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>"

static int ds_call(tc_parser *p, size_t *i, bool r1) {
    size_t j = *i;
    int r = tc_skip(p, &j, DS_CALL_BEGIN);
    if (r <= 0) return r < 0 ? JC_MORE : JC_BAD;
    size_t sep;
    r = tc_find(p, j, DS_SEP, &sep);
    if (r <= 0) return r < 0 || p->partial ? JC_MORE : JC_BAD;
    const char *name = p->t + j;
    size_t nl = sep - j, a = sep + strlen(DS_SEP);
    if (r1) { /* type<sep>name\n```json\n */
        size_t e;
        r = tc_find(p, a, "```json", &e);
        if (r <= 0) return r < 0 || p->partial ? JC_MORE : JC_BAD;
        name = p->t + a;
        nl = e - a;
        a = e + 7;
    }
    while (nl && tc_ws(name[nl - 1])) nl--;
    while (nl && tc_ws(*name)) name++, nl--;
    if (!nl) return JC_BAD;
    tc_call *c = tc_call_new(p, name, nl, NULL, 0);
    if (!c) return JC_BAD;
    r = tc_call_args(p, &a, &c->args);
    if (r != JC_DONE) return r;
    if (r1 && (r = tc_skip(p, &a, "```")) <= 0) return r < 0 ? JC_MORE : JC_BAD;
    if ((r = tc_skip(p, &a, DS_CALL_END)) < 0) return JC_MORE;
    c->done = true;
    *i = a;
    return JC_DONE;
}

static void deepseek(tc_parser *p, size_t i, bool r1) {
    static const char *const ms[] = {DS_CALLS_BEGIN, DS_CALL_BEGIN};
    size_t at;
    int w, r = tc_find_any(p, i, ms, 2, &at, &w);
    tc_text(p, i, at);
    if (r <= 0) {
        if (r < 0) p->stop = true;
        return;
    }
    size_t j = w == 0 ? at + strlen(DS_CALLS_BEGIN) : at;
    for (int k = 0;; k++) {
        size_t q = tc_skip_ws(p, j);
        if (k && (q >= p->n || tc_at(p, q, DS_CALL_BEGIN) != 1)) {
            int e = tc_skip(p, &j, DS_CALLS_END);
            if (e < 0 || (e == 0 && q < p->n && tc_at(p, q, DS_CALL_BEGIN) < 0)) {
                p->stop = true;
                return;
            }
            tc_text(p, j, p->n); /* anything after the calls */
            return;
        }
        if (!tc_go(p, ds_call(p, &j, r1), at)) return;
    }
}
void tc_parse_deepseek_r1(tc_parser *p, size_t i) { deepseek(p, i, true); }
void tc_parse_deepseek_v31(tc_parser *p, size_t i) { deepseek(p, i, false); }

/* Kimi K2: "<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}<|tool_call_end|>" */
static int kimi_calls(tc_parser *p, size_t *i, const void *unused) {
    (void)unused;
    size_t j = *i;
    for (int k = 0;; k++) {
        int r = tc_skip(p, &j, "<|tool_call_begin|>");
        if (r < 0) return JC_MORE;
        if (!r) {
            if (!k) return JC_BAD;
            *i = j;
            return JC_DONE;
        }
        size_t e;
        r = tc_find(p, j, "<|tool_call_argument_begin|>", &e);
        if (r <= 0) return r < 0 || p->partial ? JC_MORE : JC_BAD;
        size_t il = e - j;
        while (il && tc_ws(p->t[j + il - 1])) il--;
        const char *id = p->t + j, *name = id;
        size_t nl = il;
        if (nl > 10 && !memcmp(name, "functions.", 10)) name += 10, nl -= 10;
        for (size_t q = nl; q > 0; q--)
            if (name[q - 1] == ':') {
                nl = q - 1;
                break;
            }
        if (!nl) return JC_BAD;
        tc_call *c = tc_call_new(p, name, nl, id, il);
        if (!c) return JC_BAD;
        size_t a = e + strlen("<|tool_call_argument_begin|>");
        if ((r = tc_call_args(p, &a, &c->args)) != JC_DONE) return r;
        if (tc_skip(p, &a, "<|tool_call_end|>") < 0) return JC_MORE;
        c->done = true;
        j = a;
    }
}
void tc_parse_kimi(tc_parser *p, size_t i) {
    wrapped(p, i, "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", kimi_calls, NULL);
}

/* Command R7B and Cohere2: "<|START_ACTION|>[{"tool_call_id", "tool_name",
 * "parameters"}]<|END_ACTION|>", the answer in <|START_RESPONSE|> or
 * <|START_TEXT|> (the reasoning in <|START_THINKING|> is split before). */
void tc_parse_command_r7b(tc_parser *p, size_t i) {
    static const char *const ms[] = {"<|START_ACTION|>", "<|START_RESPONSE|>", "<|START_TEXT|>", "<|END_RESPONSE|>",
                                     "<|END_TEXT|>"};
    for (;;) {
        size_t at;
        int w, r = tc_find_any(p, i, ms, 5, &at, &w);
        tc_text(p, i, at);
        if (r <= 0) {
            if (r < 0) p->stop = true;
            return;
        }
        size_t j = at + strlen(ms[w]);
        if (w == 0) {
            if (!tc_go(p, tc_json_call_list(p, &j, &k_cohere), at)) return;
            if (tc_skip(p, &j, "<|END_ACTION|>") < 0) {
                p->stop = true;
                return;
            }
        }
        i = j;
    }
}

/* A bare JSON call, or a list of them, as the whole answer (its name one of
 * the request's tools); else Hermes's <tool_call>. */
static const tc_keys k_bare = {{"name", NULL, NULL}, {"arguments", "parameters", NULL}, {"id", NULL}, true};
static const tc_keys k_llama = {{"name", NULL, NULL}, {"parameters", "arguments", NULL}, {NULL, NULL}, true};

static bool bare_json(tc_parser *p, size_t i, const tc_keys *k, bool semicolons) {
    size_t j = tc_skip_ws(p, i);
    if (j >= p->n) {
        if (p->partial) p->stop = true;
        return j > i || p->partial;
    }
    if (p->t[j] != '{' && p->t[j] != '[') return false;
    int n0 = p->n_calls;
    for (size_t q = j;;) {
        int before = p->n_calls;
        int r = p->t[q] == '[' ? tc_json_call_list(p, &q, k) : tc_json_call(p, &q, k);
        if (r == JC_DONE) {
            size_t e = tc_skip_ws(p, q);
            if (semicolons && e < p->n && p->t[e] == ';') e = tc_skip_ws(p, e + 1);
            if (e < p->n && p->t[e] == '{') {
                q = e;
                continue;
            }
            if (e == p->n && p->partial && e > q) { /* blanks: a next call may follow */
                p->stop = true;
                return true;
            }
            tc_text(p, q, p->n);
            return true;
        }
        if (r == JC_MORE && p->partial) {
            p->stop = true;
            return true;
        }
        tc_calls_truncate(p, before);
        if (p->n_calls == n0) return false; /* an answer, not a call */
        tc_call_fail(p, q);
        return true;
    }
}

void tc_parse_generic(tc_parser *p, size_t i) {
    if (!bare_json(p, i, &k_bare, false)) tc_parse_hermes(p, i);
}

/* Python's built-ins as Llama 3.1 writes them: "<|python_tag|>name.call(k="v")",
 * or code for the interpreter. */
static int python_call(tc_parser *p, size_t *i, bool json_too);

void tc_parse_llama3(tc_parser *p, size_t i) {
    size_t j = tc_skip_ws(p, i);
    int r = tc_at(p, j, "<|python_tag|>");
    if (r < 0 || (j == p->n && p->partial)) {
        p->stop = true;
        return;
    }
    if (r > 0) {
        size_t a = j + strlen("<|python_tag|>");
        tc_text(p, i, j);
        tc_go(p, python_call(p, &a, true), j);
        if (!p->stop) tc_text(p, a, p->n);
        return;
    }
    if (!bare_json(p, i, &k_llama, true)) tc_text(p, i, p->n);
}

/* The interpreter's tool: "python" unless the request names it otherwise. */
static const char *code_tool(const tc_parser *p) {
    static const char *const names[] = {"python", "code_interpreter", "ipython"};
    for (int k = 0; k < 3; k++)
        if (json_is_array(p->tools) && tc_tool_known(p, names[k], strlen(names[k]))) return names[k];
    return "python";
}

static int python_call(tc_parser *p, size_t *i, bool json_too) {
    size_t j = tc_skip_ws(p, *i);
    if (j >= p->n) return JC_MORE;
    if (json_too && p->t[j] == '{') { /* a JSON call, or the arguments of the code tool */
        size_t q = j;
        int r = tc_json_call(p, &q, &tc_keys_default);
        if (r != JC_BAD) {
            if (r == JC_DONE) *i = q;
            return r;
        }
        if (p->partial) {
            size_t e = j;
            tc_buf tmp = {0};
            r = tc_json(p, &e, &tmp);
            free(tmp.s);
            if (r == JC_MORE) return JC_MORE;
        }
        tc_call *c = tc_call_new(p, code_tool(p), strlen(code_tool(p)), NULL, 0);
        if (!c) return JC_BAD;
        q = j;
        r = tc_call_args(p, &q, &c->args);
        if (r == JC_DONE) {
            c->done = true;
            *i = q;
        }
        return r;
    }
    /* name.call(k=v, ...) */
    size_t q = j;
    while (q < p->n && (p->t[q] == '_' || p->t[q] == '-' || (p->t[q] >= 'a' && p->t[q] <= 'z') ||
                        (p->t[q] >= 'A' && p->t[q] <= 'Z') || (p->t[q] >= '0' && p->t[q] <= '9')))
        q++;
    int r = q > j ? tc_at(p, q, ".call(") : 0;
    if (r < 0 || (q == p->n && p->partial)) return JC_MORE;
    if (r > 0) {
        size_t e = q + 6;
        tc_buf args = {0};
        if (tc_python_kwargs(p->t, p->n, &e, &args) == JC_DONE) {
            tc_call *c = tc_call_new(p, p->t + j, q - j, NULL, 0);
            if (c) {
                tc_put(&c->args, args.s, args.n);
                c->done = !c->args.oom;
            }
            free(args.s);
            *i = e;
            return c && c->done ? JC_DONE : JC_BAD;
        }
        free(args.s);
        if (p->partial) return JC_MORE;
    }
    /* code: the rest of the text */
    if (p->partial) return JC_MORE;
    tc_call *c = tc_call_new(p, code_tool(p), strlen(code_tool(p)), NULL, 0);
    if (!c) return JC_BAD;
    size_t e = p->n;
    while (e > j && tc_ws(p->t[e - 1])) e--;
    tc_puts(&c->args, "{\"code\":");
    tc_json_quote(&c->args, p->t + j, e - j);
    tc_putc(&c->args, '}');
    c->done = true;
    *i = p->n;
    return JC_DONE;
}

/* Functionary v3.1: "<function=name>{...}</function>", code after <|python_tag|>. */
void tc_parse_functionary31(tc_parser *p, size_t i) {
    static const char *const ms[] = {"<function=", "<|python_tag|>"};
    for (;;) {
        size_t at;
        int w, r = tc_find_any(p, i, ms, 2, &at, &w);
        tc_text(p, i, at);
        if (r <= 0) {
            if (r < 0) p->stop = true;
            return;
        }
        size_t j = at + strlen(ms[w]);
        if (w == 1) {
            tc_go(p, python_call(p, &j, true), at);
            if (!p->stop) tc_text(p, j, p->n);
            return;
        }
        size_t e;
        r = tc_find(p, j, ">", &e);
        if (r <= 0 || e == j) {
            if (!tc_go(p, r <= 0 && p->partial ? JC_MORE : JC_BAD, at)) return;
        }
        tc_call *c = tc_call_new(p, p->t + j, e - j, NULL, 0);
        if (!c) {
            tc_call_fail(p, at);
            return;
        }
        size_t a = e + 1;
        r = tc_call_args(p, &a, &c->args);
        if (r == JC_DONE) c->done = true;
        if (!tc_go(p, r, at)) return;
        if (tc_skip(p, &a, "</function>") < 0) {
            p->stop = true;
            return;
        }
        i = a;
    }
}

/* Functionary v3.2: ">>>recipient\n..." messages; the generation prompt
 * ends with ">>>". "all": content; "python": code; others: JSON arguments. */
void tc_parse_functionary32(tc_parser *p, size_t i) {
    size_t tl = strlen(p->tail);
    bool opened = tl >= 3 && !memcmp(p->tail + tl - 3, ">>>", 3);
    if (!opened) {
        size_t at;
        int r = tc_find(p, i, ">>>", &at);
        tc_text(p, i, at);
        if (r <= 0) {
            if (r < 0) p->stop = true;
            return;
        }
        i = at + 3;
    }
    for (;;) {
        size_t nl;
        int r = tc_find(p, i, "\n", &nl);
        if (r <= 0) {
            if (p->partial) p->stop = true;
            else tc_text(p, i, p->n);
            return;
        }
        size_t a = nl + 1, at;
        if (nl - i == 3 && !memcmp(p->t + i, "all", 3)) {
            r = tc_find(p, a, ">>>", &at);
            tc_text(p, a, at);
            if (r <= 0) {
                if (r < 0) p->stop = true;
                return;
            }
            i = at + 3;
            continue;
        }
        if (nl - i == 6 && !memcmp(p->t + i, "python", 6)) {
            r = tc_find(p, a, ">>>", &at);
            if (r <= 0 && p->partial) {
                p->stop = true;
                return;
            }
            size_t e = at;
            while (e > a && tc_ws(p->t[e - 1])) e--;
            tc_call *c = tc_call_new(p, "python", 6, NULL, 0);
            if (!c) {
                tc_call_fail(p, i);
                return;
            }
            tc_puts(&c->args, "{\"code\":");
            tc_json_quote(&c->args, p->t + a, e - a);
            tc_putc(&c->args, '}');
            c->done = true;
            if (r <= 0) return;
            i = at + 3;
            continue;
        }
        size_t ne = nl;
        while (ne > i && tc_ws(p->t[ne - 1])) ne--;
        if (ne == i) {
            tc_call_fail(p, i);
            return;
        }
        tc_call *c = tc_call_new(p, p->t + i, ne - i, NULL, 0);
        if (!c) {
            tc_call_fail(p, i);
            return;
        }
        r = tc_call_args(p, &a, &c->args);
        if (r == JC_DONE) c->done = true;
        if (!tc_go(p, r, i)) return;
        r = tc_skip(p, &a, ">>>");
        if (r < 0) {
            p->stop = true;
            return;
        }
        if (!r) {
            tc_text(p, a, p->n);
            return;
        }
        i = a;
    }
}

/* gpt-oss (harmony): messages "<|channel|>analysis<|message|>...<|end|>",
 * "<|start|>assistant<|channel|>final<|message|>...", a call "<|start|>assistant
 * to=functions.name<|channel|>commentary json<|message|>{...}<|call|>" (or
 * "<|channel|>commentary to=functions.name <|constrain|>json<|message|>").
 * The generation prompt ends with "<|start|>assistant". */
void tc_parse_gpt_oss(tc_parser *p, size_t i) {
    static const char *const ends[] = {"<|end|>", "<|call|>", "<|return|>", "<|start|>"};
    for (;;) {
        if (i >= p->n) return;
        int r = tc_at(p, i, "<|start|>");
        if (r < 0) {
            p->stop = true;
            return;
        }
        if (r > 0) {
            i += 9;
            r = tc_at(p, i, "assistant");
            if (r < 0 || (i == p->n && p->partial)) {
                p->stop = true;
                return;
            }
            if (r > 0) i += 9;
        }
        size_t hs = i, he;
        r = tc_find(p, i, "<|message|>", &he);
        if (r <= 0) {
            if (p->partial) p->stop = true;
            else tc_text(p, hs, p->n);
            return;
        }
        /* the header: channel and recipient */
        const char *h = p->t + hs;
        size_t hl = he - hs;
        const char *ch = memmem(h, hl, "<|channel|>", 11), *to = memmem(h, hl, "to=", 3);
        size_t chl = 0, tol = 0;
        if (ch) {
            ch += 11;
            while (ch + chl < h + hl && ch[chl] != ' ' && ch[chl] != '<') chl++;
        }
        if (to) {
            to += 3;
            while (to + tol < h + hl && to[tol] != ' ' && to[tol] != '<') tol++;
        }
        size_t bs = he + 11, be;
        int w;
        r = tc_find_any(p, bs, ends, 4, &be, &w);
        size_t next = r == 1 ? be + (w == 3 ? 0 : strlen(ends[w])) : p->n;
        bool analysis = ch && chl == 8 && !memcmp(ch, "analysis", 8);
        if (to && tol && !(tol == 9 && !memcmp(to, "assistant", 9))) {
            const char *name = to;
            size_t nl = tol;
            if (nl > 10 && !memcmp(name, "functions.", 10)) name += 10, nl -= 10;
            tc_call *c = tc_call_new(p, name, nl, NULL, 0);
            if (!c) {
                tc_call_fail(p, hs);
                return;
            }
            tc_parser sub = *p; /* the arguments end where the message does */
            sub.n = be;
            sub.partial = p->partial && r != 1;
            size_t a = bs;
            int ar = tc_call_args(&sub, &a, &c->args);
            if (ar == JC_DONE && tc_skip_ws(&sub, a) == be) c->done = true;
            else if (ar == JC_DONE) ar = JC_BAD;
            if (!tc_go(p, ar, hs)) return;
            if (r != 1) {
                if (r < 0) p->stop = true;
                return;
            }
        } else if (analysis && p->s->reasoning_format == TOK_REASONING_AUTO) {
            tc_reason(p, p->t + bs, be - bs);
            tc_think_end(p);
        } else if (analysis) {
            tc_text(p, hs, r == 1 ? next : be); /* (as written: with its end marker, not a cut one) */
        } else {
            tc_text(p, bs, be);
        }
        if (r != 1) {
            if (r < 0) p->stop = true;
            return;
        }
        i = next;
    }
}
