/* tok/chat_parse: the families' table and how a template picks one, the
 * reasoning split, the content and call pieces every parser makes, the JSON
 * scanner that writes a value's certain prefix canonically, and the message
 * a parse returns (chat_parse.h). */
#include "tok/chat_parse_impl.h"
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "util/error.h"

/* ---- buffers ---- */

void tc_put(tc_buf *b, const char *s, size_t n) {
    if (b->oom || !n) return;
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap * 2 : 64;
        while (c < b->n + n + 1) c *= 2;
        char *x = realloc(b->s, c);
        if (!x) { b->oom = true; return; }
        b->s = x;
        b->cap = c;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}
void tc_puts(tc_buf *b, const char *s) { tc_put(b, s, strlen(s)); }
void tc_putc(tc_buf *b, char c) { tc_put(b, &c, 1); }

/* ---- the families ---- */

static const tc_format k_formats[] = {
    {"generic", tc_parse_generic, false, NULL, NULL, false, TC_ID_OPENAI, {"{", "[", NULL}},
    {"hermes", tc_parse_hermes, false, NULL, NULL, false, TC_ID_OPENAI, {"<tool_call>", NULL}},
    {"qwen3-coder", tc_parse_qwen3_coder, false, NULL, NULL, false, TC_ID_OPENAI, {"<tool_call>", "<function=", NULL}},
    {"llama3", tc_parse_llama3, false, NULL, NULL, false, TC_ID_OPENAI, {"<|python_tag|>", "{", NULL}},
    {"mistral", tc_parse_mistral, false, NULL, NULL, false, TC_ID_MISTRAL, {"[TOOL_CALLS]", NULL}},
    {"mistral-nemo", tc_parse_mistral_nemo, false, NULL, NULL, false, TC_ID_MISTRAL, {"[TOOL_CALLS]", NULL}},
    {"deepseek-r1", tc_parse_deepseek_r1, false, NULL, NULL, false, TC_ID_OPENAI,
     {"<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>",
      "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>", NULL}},
    {"deepseek-v3.1", tc_parse_deepseek_v31, false, NULL, NULL, false, TC_ID_OPENAI,
     {"<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>",
      "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>", NULL}},
    {"deepseek-v4", tc_parse_dsml, false, NULL, NULL, false, TC_ID_OPENAI,
     {"<\xef\xbd\x9c" "DSML\xef\xbd\x9ctool_calls>", NULL}},
    {"kimi-k2", tc_parse_kimi, false, NULL, NULL, false, TC_ID_OPENAI, {"<|tool_calls_section_begin|>", NULL}},
    {"command-r-plus", tc_parse_command_r_plus, false, NULL, NULL, false, TC_ID_OPENAI, {"Action:", NULL}},
    {"command-r7b", tc_parse_command_r7b, false, "<|START_THINKING|>", "<|END_THINKING|>", false, TC_ID_OPENAI,
     {"<|START_ACTION|>", "<|START_RESPONSE|>", "<|START_TEXT|>", "<|END_RESPONSE|>", "<|END_TEXT|>", NULL}},
    {"firefunction-v2", tc_parse_firefunction, false, NULL, NULL, false, TC_ID_OPENAI, {"functools[", NULL}},
    {"granite", tc_parse_granite, false, NULL, NULL, false, TC_ID_OPENAI, {"<|tool_call|>", NULL}},
    {"apriel", tc_parse_apriel, false, NULL, "[BEGIN FINAL RESPONSE]", true, TC_ID_OPENAI,
     {"<tool_calls>", "[BEGIN FINAL RESPONSE]", "[END FINAL RESPONSE]", NULL}},
    {"apriel-1.5", tc_parse_apriel, false, NULL, NULL, false, TC_ID_OPENAI,
     {"<tool_calls>", "[BEGIN FINAL RESPONSE]", "[END FINAL RESPONSE]", NULL}},
    {"gigachat3", tc_parse_gigachat, false, NULL, NULL, false, TC_ID_OPENAI, {"<|message_sep|>", NULL}},
    {"functionary-v3.1", tc_parse_functionary31, false, NULL, NULL, false, TC_ID_OPENAI,
     {"<function=", "<|python_tag|>", NULL}},
    {"functionary-v3.2", tc_parse_functionary32, true, NULL, NULL, false, TC_ID_OPENAI, {">>>", NULL}},
    {"gpt-oss", tc_parse_gpt_oss, true, NULL, NULL, false, TC_ID_OPENAI, {"<|", NULL}},
    {"seed-oss", tc_parse_seed, false, "<seed:think>", "</seed:think>", false, TC_ID_OPENAI, {"<seed:tool_call>", NULL}},
    {"glm-4.5", tc_parse_glm, false, NULL, NULL, false, TC_ID_OPENAI, {"<tool_call>", NULL}},
    {"mirothinker", tc_parse_mirothinker, false, NULL, NULL, false, TC_ID_OPENAI, {"<use_mcp_tool>", NULL}},
    {"gemma4", tc_parse_gemma4, false, "<|channel>thought", "<channel|>", false, TC_ID_OPENAI, {"<|tool_call>", NULL}},
    {"pythonic", tc_parse_pythonic, false, NULL, NULL, false, TC_ID_OPENAI, {"[", NULL}},
    {"lfm2", tc_parse_lfm2, false, NULL, NULL, false, TC_ID_OPENAI, {"<|tool_call_start|>", NULL}},
    {"none", NULL, false, NULL, NULL, false, TC_ID_OPENAI, {NULL}},
};
enum { N_FORMATS = sizeof k_formats / sizeof k_formats[0] };

/* vLLM's --tool-call-parser names (and llama.cpp's) for ours. */
static const struct { const char *alias, *name; } k_aliases[] = {
    {"qwen", "hermes"}, {"qwen2.5", "hermes"}, {"qwen3", "hermes"}, {"qwen3-xml", "qwen3-coder"},
    {"qwen3.5", "qwen3-coder"}, {"step3.5", "qwen3-coder"}, {"llama3-json", "llama3"}, {"llama", "llama3"},
    {"llama3.1", "llama3"}, {"llama3.2", "llama3"}, {"deepseek-v3", "deepseek-r1"}, {"deepseek-v31", "deepseek-v3.1"},
    {"deepseek-v3.2", "deepseek-v4"}, {"deepseek-dsml", "deepseek-v4"}, {"kimi", "kimi-k2"}, {"glm45", "glm-4.5"},
    {"glm", "glm-4.5"}, {"glm-4.6", "glm-4.5"}, {"openai", "gpt-oss"}, {"harmony", "gpt-oss"},
    {"command-r", "command-r-plus"}, {"cohere", "command-r7b"}, {"firefunction", "firefunction-v2"},
    {"functionary", "functionary-v3.2"}, {"seed", "seed-oss"}, {"gigachat", "gigachat3"}, {"apriel-1.6", "apriel"},
    {"ministral", "mistral"}, {"magistral", "mistral"}, {"devstral", "mistral"}, {"json", "generic"},
};

static char g_names[512];
static pthread_once_t g_names_once = PTHREAD_ONCE_INIT;
static void make_names(void) {
    size_t n = 0;
    for (int i = 0; i < N_FORMATS; i++)
        n += (size_t)snprintf(g_names + n, sizeof g_names - n, "%s%s", !i ? "" : i + 1 < N_FORMATS ? ", " : " or ",
                              k_formats[i].name);
}
const char *tok_chat_parser_names(void) {
    pthread_once(&g_names_once, make_names);
    return g_names;
}

static const tc_format *format_named(const char *name) {
    char b[40];
    size_t k = 0;
    for (const char *q = name; *q && k + 1 < sizeof b; q++) b[k++] = *q == '_' ? '-' : (char)tolower((unsigned char)*q);
    b[k] = 0;
    for (size_t i = 0; i < sizeof k_aliases / sizeof k_aliases[0]; i++)
        if (!strcmp(b, k_aliases[i].alias)) return format_named(k_aliases[i].name);
    for (int i = 0; i < N_FORMATS; i++)
        if (!strcmp(b, k_formats[i].name)) return &k_formats[i];
    return NULL;
}

static bool has(const char *s, const char *m) { return s && strstr(s, m); }

/* The family a template writes calls in, by the markers in its text (the
 * order matters: Qwen3.5's template has both <tool_call> and <function=). */
static const char *detect(const char *src) {
    if (!src) return "generic";
    if (has(src, "<|channel|>")) return "gpt-oss";
    if (has(src, ">>>all")) return "functionary-v3.2";
    if (has(src, "<|tool_calls_section_begin|>")) return "kimi-k2";
    if (has(src, "<|START_ACTION|>")) return "command-r7b";
    if (has(src, "</use_mcp_tool>")) return "mirothinker";
    if (has(src, "<|tool_list_start|>") || has(src, "<|tool_call_start|>")) return "lfm2";
    if (has(src, "<|role_sep|>") && has(src, "<|message_sep|>")) return "gigachat3";
    if (has(src, "DSML")) return "deepseek-v4";
    if (has(src, "<|tool_call>call:")) return "gemma4";
    if (has(src, "tool\xe2\x96\x81sep")) return has(src, "```json") ? "deepseek-r1" : "deepseek-v3.1";
    if (has(src, "[TOOL_CALLS]")) return has(src, "[ARGS]") ? "mistral" : "mistral-nemo";
    if (has(src, "<arg_key>")) return "glm-4.5";
    if (has(src, "<seed:tool_call>")) return "seed-oss";
    if (has(src, "<function=") && has(src, "<parameter=")) return "qwen3-coder";
    if (has(src, "<function=")) return "functionary-v3.1";
    if (has(src, "<tool_calls>")) return has(src, "<|begin_assistant|>") ? "apriel" : "apriel-1.5";
    if (has(src, "functools[")) return "firefunction-v2";
    if (has(src, "<|tool_call|>")) return "granite";
    if (has(src, "Action:") && has(src, "<|CHATBOT_TOKEN|>")) return "command-r-plus";
    if (has(src, "<tool_call>")) return "hermes";
    if (has(src, "<|start_header_id|>") && (has(src, "\"parameters\"") || has(src, "<|python_tag|>") || has(src, "ipython")))
        return "llama3";
    return "generic";
}

tok_chat_syntax *tok_chat_syntax_new(const char *src, const char *override_name, int reasoning_format,
                                     kvlm_error *err) {
    const tc_format *f = NULL;
    if (override_name && *override_name) {
        if (!(f = format_named(override_name))) {
            util_err_set(err, KVLM_EINVAL, "unknown tool-call parser '%.60s' (use %s)", override_name,
                         tok_chat_parser_names());
            return NULL;
        }
    } else f = format_named(detect(src));
    if (reasoning_format != TOK_REASONING_AUTO && reasoning_format != TOK_REASONING_NONE) {
        util_err_set(err, KVLM_EINVAL, "unknown reasoning format %d (auto or none)", reasoning_format);
        return NULL;
    }
    tok_chat_syntax *s = calloc(1, sizeof *s);
    if (!s) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        return NULL;
    }
    s->f = f;
    s->reasoning_format = reasoning_format;
    if (f->think_end) {
        s->think_start = f->think_start;
        s->think_end = f->think_end;
    } else if (has(src, "<seed:think>")) {
        s->think_start = "<seed:think>";
        s->think_end = "</seed:think>";
    } else if (has(src, "[THINK]")) {
        s->think_start = "[THINK]";
        s->think_end = "[/THINK]";
    } else if ((!src && !f->own_reasoning) || has(src, "<think>") || has(src, "</think>")) {
        s->think_start = "<think>";
        s->think_end = "</think>";
    }
    return s;
}

void tok_chat_syntax_free(tok_chat_syntax *s) { free(s); }
const char *tok_chat_syntax_name(const tok_chat_syntax *s) { return s->f->name; }

/* ---- text ---- */

size_t tc_skip_ws(const tc_parser *p, size_t i) {
    while (i < p->n && tc_ws(p->t[i])) i++;
    return i;
}

int tc_at(const tc_parser *p, size_t i, const char *m) {
    size_t k = strlen(m), have = p->n - i;
    if (i > p->n) return 0;
    if (have >= k) return !memcmp(p->t + i, m, k);
    return memcmp(p->t + i, m, have) ? 0 : p->partial ? -1 : 0;
}

int tc_find_any(const tc_parser *p, size_t i, const char *const *ms, int k, size_t *at, int *which) {
    size_t best = p->n;
    int w = -1;
    for (int j = 0; j < k; j++) {
        size_t ml = strlen(ms[j]);
        if (!ml || i > p->n) continue;
        const char *q = p->n - i >= ml ? memmem(p->t + i, p->n - i, ms[j], ml) : NULL;
        if (q && (size_t)(q - p->t) < best) {
            best = (size_t)(q - p->t);
            w = j;
        }
    }
    if (w >= 0) {
        *at = best;
        if (which) *which = w;
        return 1;
    }
    if (p->partial) /* the text may end inside a marker: the earliest such start */
        for (size_t s = p->n > i + 64 ? p->n - 64 : i; s < p->n; s++)
            for (int j = 0; j < k; j++) {
                size_t ml = strlen(ms[j]), have = p->n - s;
                if (have < ml && !memcmp(p->t + s, ms[j], have)) {
                    *at = s;
                    if (which) *which = j;
                    return -1;
                }
            }
    *at = p->n;
    if (which) *which = -1;
    return 0;
}

int tc_skip(const tc_parser *p, size_t *i, const char *m) {
    size_t j = tc_skip_ws(p, *i);
    if (j == p->n && p->partial) return -1;
    int r = tc_at(p, j, m);
    if (r > 0) *i = j + strlen(m);
    return r;
}

int tc_find(const tc_parser *p, size_t i, const char *m, size_t *at) { return tc_find_any(p, i, &m, 1, at, NULL); }

static bool seg_push(tc_parser *p, int kind, size_t a, size_t b) {
    if (p->n_seg == p->cap_seg) {
        int c = p->cap_seg ? p->cap_seg * 2 : 8;
        tc_seg *x = realloc(p->seg, (size_t)c * sizeof *x);
        if (!x) return p->oom = true, false;
        p->seg = x;
        p->cap_seg = c;
    }
    p->seg[p->n_seg++] = (tc_seg){kind, a, b};
    return true;
}

void tc_text(tc_parser *p, size_t a, size_t b) {
    if (b > p->n) b = p->n;
    if (a < b) seg_push(p, SEG_TEXT, a, b);
}

enum { SEG_MADE = 3 };
void tc_text_made(tc_parser *p, const char *s, size_t n) {
    if (!n) return;
    size_t a = p->extra.n;
    tc_put(&p->extra, s, n);
    seg_push(p, SEG_MADE, a, p->extra.n);
}

void tc_think_end(tc_parser *p) { seg_push(p, SEG_THINK_END, 0, 0); }

void tc_reason(tc_parser *p, const char *s, size_t n) {
    while (n && tc_ws(*s)) s++, n--;
    while (n && tc_ws(s[n - 1])) n--;
    if (n && p->reasoning.n) tc_puts(&p->reasoning, "\n\n");
    tc_put(&p->reasoning, s, n);
    p->has_reasoning = true;
}

/* ---- calls ---- */

tc_call *tc_call_new(tc_parser *p, const char *name, size_t len, const char *id, size_t id_len) {
    /* a name is a word (OpenAI's: at most 64 characters): control characters or
     * an endless run of text are not a call's name */
    if (!len || len > 256) return NULL;
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)name[i] < 0x20 || name[i] == 0x7f) return NULL;
    if (p->n_calls == p->cap_calls) {
        int c = p->cap_calls ? p->cap_calls * 2 : 4;
        tc_call *x = realloc(p->calls, (size_t)c * sizeof *x);
        if (!x) return p->oom = true, NULL;
        p->calls = x;
        p->cap_calls = c;
    }
    tc_call *c = &p->calls[p->n_calls];
    memset(c, 0, sizeof *c);
    c->name = strndup(name, len);
    c->id = id ? strndup(id, id_len) : NULL;
    if (!c->name || (id && !c->id)) {
        free(c->name);
        free(c->id);
        p->oom = true;
        return NULL;
    }
    if (!seg_push(p, SEG_CALL, (size_t)p->n_calls, 0)) {
        free(c->name);
        free(c->id);
        return NULL;
    }
    p->n_calls++;
    return c;
}

void tc_call_drop(tc_parser *p) {
    if (p->n_calls && !p->calls[p->n_calls - 1].done && p->n_seg && p->seg[p->n_seg - 1].kind == SEG_CALL &&
        p->seg[p->n_seg - 1].a == (size_t)p->n_calls - 1) {
        tc_call *c = &p->calls[--p->n_calls];
        free(c->name);
        free(c->id);
        free(c->args.s);
        p->n_seg--;
    }
}

void tc_calls_truncate(tc_parser *p, int n) {
    while (p->n_calls > n) {
        tc_call *c = &p->calls[--p->n_calls];
        free(c->name);
        free(c->id);
        free(c->args.s);
        for (int k = p->n_seg - 1; k >= 0; k--)
            if (p->seg[k].kind == SEG_CALL && p->seg[k].a == (size_t)p->n_calls) {
                memmove(p->seg + k, p->seg + k + 1, (size_t)(p->n_seg - k - 1) * sizeof *p->seg);
                p->n_seg--;
                break;
            }
    }
}

void tc_call_fail(tc_parser *p, size_t from) {
    tc_call_drop(p);
    tc_text(p, from, p->n);
    p->stop = true;
}

bool tc_go(tc_parser *p, int r, size_t from) {
    if (r == JC_DONE) return true;
    if (r == JC_MORE && p->partial) p->stop = true;
    else tc_call_fail(p, from);
    return false;
}

static const json_t *tool_fn(const json_t *t) {
    const json_t *f = json_object_get(t, "function");
    return json_is_object(f) ? f : t;
}

bool tc_tool_known(const tc_parser *p, const char *name, size_t len) {
    if (!json_is_array(p->tools) || !json_array_size(p->tools)) return true;
    size_t i;
    const json_t *t;
    json_array_foreach(p->tools, i, t) {
        const char *nm = json_string_value(json_object_get(tool_fn(t), "name"));
        if (nm && strlen(nm) == len && !memcmp(nm, name, len)) return true;
    }
    return false;
}

const json_t *tc_param_schema(const tc_parser *p, const char *tool, const char *param) {
    size_t i;
    const json_t *t;
    if (!json_is_array(p->tools)) return NULL;
    json_array_foreach(p->tools, i, t) {
        const json_t *f = tool_fn(t);
        const char *nm = json_string_value(json_object_get(f, "name"));
        if (nm && !strcmp(nm, tool)) {
            const json_t *pr = json_object_get(json_object_get(f, "parameters"), "properties");
            return json_object_get(pr, param);
        }
    }
    return NULL;
}

/* ---- JSON ---- */

static int hexv(int c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

static void put_cp(tc_buf *o, uint32_t cp) {
    char u[4];
    int k;
    if (cp < 0x80) u[0] = (char)cp, k = 1;
    else if (cp < 0x800) u[0] = (char)(0xc0 | cp >> 6), u[1] = (char)(0x80 | (cp & 0x3f)), k = 2;
    else if (cp < 0x10000)
        u[0] = (char)(0xe0 | cp >> 12), u[1] = (char)(0x80 | (cp >> 6 & 0x3f)), u[2] = (char)(0x80 | (cp & 0x3f)), k = 3;
    else
        u[0] = (char)(0xf0 | cp >> 18), u[1] = (char)(0x80 | (cp >> 12 & 0x3f)), u[2] = (char)(0x80 | (cp >> 6 & 0x3f)),
        u[3] = (char)(0x80 | (cp & 0x3f)), k = 4;
    tc_put(o, u, (size_t)k);
}

/* A code point inside a JSON string, escaped as little as JSON needs (as
 * Python's json.dumps(ensure_ascii=False) writes it). */
static void put_escaped(tc_buf *o, uint32_t cp) {
    static const char hx[] = "0123456789abcdef";
    switch (cp) {
    case '"': tc_puts(o, "\\\""); return;
    case '\\': tc_puts(o, "\\\\"); return;
    case '\b': tc_puts(o, "\\b"); return;
    case '\f': tc_puts(o, "\\f"); return;
    case '\n': tc_puts(o, "\\n"); return;
    case '\r': tc_puts(o, "\\r"); return;
    case '\t': tc_puts(o, "\\t"); return;
    }
    if (cp < 0x20) {
        char e[7] = {'\\', 'u', '0', '0', hx[cp >> 4], hx[cp & 15], 0};
        tc_puts(o, e);
    } else put_cp(o, cp);
}

/* Length of a valid UTF-8 sequence at s (n bytes there): >0 its length, 0
 * invalid, -1 valid so far but cut. */
static int utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    int l = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    if (l <= 1) return l;
    for (int k = 1; k < l; k++) {
        if ((size_t)k >= n) return -1;
        unsigned lo = 0x80, hi = 0xbf;
        if (k == 1 && c == 0xe0) lo = 0xa0;
        if (k == 1 && c == 0xed) hi = 0x9f;
        if (k == 1 && c == 0xf0) lo = 0x90;
        if (k == 1 && c == 0xf4) hi = 0x8f;
        if (s[k] < lo || s[k] > hi) return 0;
    }
    return l;
}

size_t tc_utf8_whole(const char *s, size_t n) {
    for (size_t st = n > 4 ? n - 4 : 0; st < n; st++)
        if (utf8_seq((const unsigned char *)s + st, n - st) < 0) return st;
    return n;
}

void tc_json_quote(tc_buf *out, const char *s, size_t n) {
    tc_putc(out, '"');
    for (size_t i = 0; i < n;) {
        int l = utf8_seq((const unsigned char *)s + i, n - i);
        if (l <= 0) { /* not UTF-8: U+FFFD (the detokenizer writes none) */
            put_cp(out, 0xfffd);
            i++;
        } else if (l == 1) put_escaped(out, (unsigned char)s[i++]);
        else {
            tc_put(out, s + i, (size_t)l);
            i += (size_t)l;
        }
    }
    tc_putc(out, '"');
}

/* A string literal at t[*pi] == '"'; decoded: its bytes, else its canonical
 * literal (as far as certain). */
static int str_scan(const char *t, size_t n, size_t *pi, tc_buf *out, bool decoded) {
    size_t i = *pi + 1;
    if (out && !decoded) tc_putc(out, '"');
    while (i < n) {
        unsigned char c = (unsigned char)t[i];
        if (c == '"') {
            if (out && !decoded) tc_putc(out, '"');
            *pi = i + 1;
            return JC_DONE;
        }
        if (c < 0x20) return JC_BAD;
        if (c == '\\') {
            if (i + 1 >= n) return JC_MORE;
            uint32_t cp = 0;
            size_t adv = 2;
            switch (t[i + 1]) {
            case '"': cp = '"'; break;
            case '\\': cp = '\\'; break;
            case '/': cp = '/'; break;
            case 'b': cp = '\b'; break;
            case 'f': cp = '\f'; break;
            case 'n': cp = '\n'; break;
            case 'r': cp = '\r'; break;
            case 't': cp = '\t'; break;
            case 'u': {
                size_t k = 2;
                for (; k < 6 && i + k < n; k++) {
                    int h = hexv(t[i + k]);
                    if (h < 0) return JC_BAD;
                    cp = cp << 4 | (uint32_t)h;
                }
                if (k < 6) return JC_MORE;
                adv = 6;
                if (cp >= 0xdc00 && cp <= 0xdfff) return JC_BAD;
                if (cp >= 0xd800 && cp <= 0xdbff) { /* a pair */
                    uint32_t lo = 0;
                    const char *pre = "\\u";
                    for (k = 6; k < 12 && i + k < n; k++) {
                        if (k < 8) {
                            if (t[i + k] != pre[k - 6]) return JC_BAD;
                            continue;
                        }
                        int h = hexv(t[i + k]);
                        if (h < 0) return JC_BAD;
                        lo = lo << 4 | (uint32_t)h;
                    }
                    if (k < 12) return JC_MORE;
                    if (lo < 0xdc00 || lo > 0xdfff) return JC_BAD;
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    adv = 12;
                }
                break;
            }
            default: return JC_BAD;
            }
            if (out) {
                if (decoded) put_cp(out, cp);
                else put_escaped(out, cp);
            }
            i += adv;
            continue;
        }
        if (c < 0x80) {
            if (out) tc_putc(out, (char)c);
            i++;
            continue;
        }
        int l = utf8_seq((const unsigned char *)t + i, n - i);
        if (l == 0) return JC_BAD;
        if (l < 0) return JC_MORE;
        if (out) tc_put(out, t + i, (size_t)l);
        i += (size_t)l;
    }
    return JC_MORE;
}

/* A number's text: 1 whole, -1 a valid beginning, 0 not a number. */
static int num_ok(const char *s, size_t n) {
    size_t i = 0;
    if (i < n && s[i] == '-') i++;
    if (i == n) return -1;
    if (s[i] == '0') i++;
    else if (s[i] >= '1' && s[i] <= '9')
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    else return 0;
    if (i < n && s[i] == '.') {
        i++;
        if (i == n) return -1;
        if (!(s[i] >= '0' && s[i] <= '9')) return 0;
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        if (i == n) return -1;
        if (!(s[i] >= '0' && s[i] <= '9')) return 0;
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    }
    return i == n ? 1 : 0;
}

static bool num_char(char c) { return (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E'; }

static int json_span(const char *t, size_t n, size_t *pi, tc_buf *out, bool partial) {
    char stack[JC_MAX_DEPTH];
    int d = 0;
    enum { V, V_OR_END, K_OR_END, K, COLON, AFTER } st = V;
    size_t i = *pi;
    for (;;) {
        if (st == AFTER && d == 0) {
            *pi = i;
            return JC_DONE;
        }
        while (i < n && tc_ws(t[i])) i++;
        if (i >= n) return JC_MORE;
        char c = t[i];
        int r;
        switch (st) {
        case V_OR_END:
            if (c == ']') {
                if (out) tc_putc(out, ']');
                d--, i++, st = AFTER;
                break;
            }
            /* fallthrough */
        case V:
            if (c == '{' || c == '[') {
                if (d == JC_MAX_DEPTH) return JC_BAD;
                stack[d++] = c;
                if (out) tc_putc(out, c);
                i++;
                st = c == '{' ? K_OR_END : V_OR_END;
            } else if (c == '"') {
                if ((r = str_scan(t, n, &i, out, false)) != JC_DONE) return r;
                st = AFTER;
            } else if (c == '-' || (c >= '0' && c <= '9')) {
                size_t j = i;
                while (j < n && num_char(t[j])) j++;
                if (j == n && partial) return JC_MORE;
                int ok = num_ok(t + i, j - i);
                if (ok != 1) return ok < 0 && j == n ? JC_MORE : JC_BAD;
                if (out) tc_put(out, t + i, j - i);
                i = j;
                st = AFTER;
            } else if (c == 't' || c == 'f' || c == 'n') {
                const char *w = c == 't' ? "true" : c == 'f' ? "false" : "null";
                size_t wl = strlen(w), have = n - i < wl ? n - i : wl;
                if (memcmp(t + i, w, have)) return JC_BAD;
                if (have < wl) return JC_MORE;
                if (out) tc_put(out, w, wl);
                i += wl;
                st = AFTER;
            } else return JC_BAD;
            break;
        case K_OR_END:
            if (c == '}') {
                if (out) tc_putc(out, '}');
                d--, i++, st = AFTER;
                break;
            }
            /* fallthrough */
        case K:
            if (c != '"') return JC_BAD;
            if ((r = str_scan(t, n, &i, out, false)) != JC_DONE) return r;
            st = COLON;
            break;
        case COLON:
            if (c != ':') return JC_BAD;
            if (out) tc_putc(out, ':');
            i++;
            st = V;
            break;
        case AFTER:
            if (c == ',') st = stack[d - 1] == '{' ? K : V;
            else if ((c == '}' && stack[d - 1] == '{') || (c == ']' && stack[d - 1] == '[')) d--;
            else return JC_BAD;
            if (out) tc_putc(out, c);
            i++;
            break;
        }
    }
}

int tc_json(const tc_parser *p, size_t *i, tc_buf *out) { return json_span(p->t, p->n, i, out, p->partial); }

int tc_json_str(const char *s, size_t n, tc_buf *out) {
    size_t i = 0;
    int r = json_span(s, n, &i, out, false);
    while (r == JC_DONE && i < n && tc_ws(s[i])) i++;
    return r == JC_DONE && i != n ? JC_BAD : r;
}

int tc_json_string(const tc_parser *p, size_t *i, tc_buf *out) {
    if (*i >= p->n) return JC_MORE;
    if (p->t[*i] != '"') return JC_BAD;
    return str_scan(p->t, p->n, i, out, true);
}

/* ---- Python literals (pythonic calls, Python-typed XML values) ---- */

int tc_python_value(const char *s, size_t n, size_t *used, tc_buf *out, int depth) {
    size_t i = *used;
    while (i < n && tc_ws(s[i])) i++;
    if (i >= n || depth > JC_MAX_DEPTH) return JC_BAD;
    char c = s[i];
    if (c == '\'' || c == '"') {
        tc_buf v = {0};
        size_t j = i + 1;
        bool ok = false;
        while (j < n) {
            if (s[j] == c) { ok = true; j++; break; }
            if (s[j] == '\\' && j + 1 < n) {
                char e = s[j + 1];
                uint32_t cp = 0;
                size_t adv = 2;
                switch (e) {
                case 'n': cp = '\n'; break;
                case 't': cp = '\t'; break;
                case 'r': cp = '\r'; break;
                case 'b': cp = '\b'; break;
                case 'f': cp = '\f'; break;
                case '0': cp = 0; break;
                case 'x': case 'u': case 'U': {
                    size_t k = e == 'x' ? 2 : e == 'u' ? 4 : 8;
                    if (j + 2 + k > n) goto bad;
                    for (size_t q = 0; q < k; q++) {
                        int h = hexv(s[j + 2 + q]);
                        if (h < 0) goto bad;
                        cp = cp << 4 | (uint32_t)h;
                    }
                    if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) goto bad;
                    adv = 2 + k;
                    break;
                }
                default: cp = (unsigned char)e; break;
                }
                put_cp(&v, cp);
                j += adv;
                continue;
            }
            tc_putc(&v, s[j++]);
        }
        if (!ok || v.oom) goto bad;
        tc_json_quote(out, v.s ? v.s : "", v.n);
        free(v.s);
        *used = j;
        return JC_DONE;
    bad:
        free(v.s);
        return JC_BAD;
    }
    if (c == '[' || c == '(' || c == '{') {
        char close = c == '[' ? ']' : c == '(' ? ')' : '}';
        tc_putc(out, c == '{' ? '{' : '[');
        size_t j = i + 1;
        for (int k = 0;; k++) {
            while (j < n && tc_ws(s[j])) j++;
            if (j < n && s[j] == close) break;
            if (k) tc_putc(out, ',');
            if (c == '{') {
                size_t kb = out->n;
                if (tc_python_value(s, n, &j, out, depth + 1) != JC_DONE) return JC_BAD;
                if (out->s[kb] != '"') { /* a JSON key is a string */
                    char *key = strndup(out->s + kb, out->n - kb);
                    if (!key) return JC_BAD;
                    out->n = kb;
                    tc_json_quote(out, key, strlen(key));
                    free(key);
                }
                while (j < n && tc_ws(s[j])) j++;
                if (j >= n || s[j] != ':') return JC_BAD;
                j++;
                tc_putc(out, ':');
            }
            if (tc_python_value(s, n, &j, out, depth + 1) != JC_DONE) return JC_BAD;
            while (j < n && tc_ws(s[j])) j++;
            if (j < n && s[j] == ',') j++;
            else if (!(j < n && s[j] == close)) return JC_BAD;
        }
        tc_putc(out, c == '{' ? '}' : ']');
        *used = j + 1;
        return JC_DONE;
    }
    static const struct { const char *py, *js; } words[] = {{"True", "true"}, {"False", "false"}, {"None", "null"},
                                                            {"true", "true"}, {"false", "false"}, {"null", "null"}};
    for (size_t w = 0; w < sizeof words / sizeof words[0]; w++) {
        size_t l = strlen(words[w].py);
        if (n - i >= l && !memcmp(s + i, words[w].py, l) && (i + l == n || !isalnum((unsigned char)s[i + l]))) {
            tc_puts(out, words[w].js);
            *used = i + l;
            return JC_DONE;
        }
    }
    /* a number: Python's forms made JSON's (+1, 1., .5, 1_000) */
    size_t j = i;
    tc_buf num = {0};
    if (j < n && (s[j] == '-' || s[j] == '+')) {
        if (s[j] == '-') tc_putc(&num, '-');
        j++;
    }
    size_t ds = j;
    bool dot = false;
    while (j < n && ((s[j] >= '0' && s[j] <= '9') || s[j] == '_' || s[j] == '.' || s[j] == 'e' || s[j] == 'E' ||
                     ((s[j] == '-' || s[j] == '+') && (s[j - 1] == 'e' || s[j - 1] == 'E')))) {
        if (s[j] == '_') { j++; continue; }
        if (s[j] == '.') {
            if (j == ds) tc_putc(&num, '0');
            dot = true;
            tc_putc(&num, '.');
            if (!(j + 1 < n && s[j + 1] >= '0' && s[j + 1] <= '9')) tc_putc(&num, '0');
            j++;
            continue;
        }
        tc_putc(&num, s[j++]);
    }
    (void)dot;
    /* leading zeros (007) are not JSON */
    size_t z = num.n && num.s[0] == '-' ? 1 : 0;
    while (num.n > z + 1 && num.s[z] == '0' && num.s[z + 1] >= '0' && num.s[z + 1] <= '9') {
        memmove(num.s + z, num.s + z + 1, num.n - z - 1);
        num.n--;
    }
    int ok = num.n && !num.oom ? num_ok(num.s, num.n) : 0;
    if (ok == 1) tc_put(out, num.s, num.n);
    free(num.s);
    if (ok != 1) return JC_BAD;
    *used = j;
    return JC_DONE;
}

int tc_python_kwargs(const char *s, size_t n, size_t *used, tc_buf *out) {
    size_t e = *used;
    tc_putc(out, '{');
    for (int k = 0;; k++) {
        while (e < n && tc_ws(s[e])) e++;
        if (e < n && s[e] == ')') break;
        size_t ks = e;
        while (e < n && (isalnum((unsigned char)s[e]) || s[e] == '_' || s[e] == '-')) e++;
        size_t ke = e;
        while (e < n && tc_ws(s[e])) e++;
        if (ke == ks || e >= n || s[e] != '=') return JC_BAD;
        if (k) tc_putc(out, ',');
        tc_json_quote(out, s + ks, ke - ks);
        tc_putc(out, ':');
        e++;
        if (tc_python_value(s, n, &e, out, 0) != JC_DONE) return JC_BAD;
        while (e < n && tc_ws(s[e])) e++;
        if (e < n && s[e] == ',') e++;
        else if (!(e < n && s[e] == ')')) return JC_BAD;
    }
    tc_putc(out, '}');
    *used = e + 1;
    return out->oom ? JC_BAD : JC_DONE;
}

/* ---- call objects ---- */

/* A call object's own "id" comes after its arguments (Mistral Nemo, Apriel):
 * too late for a stream, which shows the id with the name; the models make
 * them up anyway, so ids are always generated for these. */
const tc_keys tc_keys_default = {{"name", "tool_name", NULL}, {"arguments", "parameters", NULL}, {NULL, NULL}, false};

static bool key_in(const char *const *ks, int k, const char *key, size_t len) {
    for (int i = 0; i < k && ks[i]; i++)
        if (strlen(ks[i]) == len && !memcmp(ks[i], key, len)) return true;
    return false;
}

/* The arguments at t[*i] into args: an object as far as certain, or a
 * string holding an object (whole only: its text changes meaning at the
 * closing quote); null: {}. */
int tc_call_args(tc_parser *p, size_t *i, tc_buf *args) {
    *i = tc_skip_ws(p, *i);
    if (*i >= p->n) return JC_MORE;
    char c = p->t[*i];
    if (c == '{') return tc_json(p, i, args);
    if (c == '"') {
        tc_buf s = {0};
        int r = tc_json_string(p, i, &s);
        if (r == JC_DONE) {
            size_t k = 0;
            while (k < s.n && tc_ws(s.s[k])) k++;
            r = k < s.n && s.s[k] == '{' && tc_json_str(s.s, s.n, NULL) == JC_DONE ? JC_DONE : JC_BAD;
        }
        if (r == JC_DONE) tc_json_str(s.s, s.n, args);
        free(s.s);
        return s.oom ? JC_BAD : r;
    }
    if (c == 'n') {
        tc_buf tmp = {0};
        int r = tc_json(p, i, &tmp);
        free(tmp.s);
        if (r == JC_DONE) tc_puts(args, "{}");
        return r;
    }
    return JC_BAD;
}

int tc_json_call(tc_parser *p, size_t *pi, const tc_keys *k) {
    size_t i = tc_skip_ws(p, *pi);
    if (i >= p->n) return JC_MORE;
    if (p->t[i] != '{') return JC_BAD;
    i++;
    tc_buf name = {0}, id = {0}, pend = {0}; /* arguments before the name: held until it comes */
    tc_call *c = NULL;
    bool have_args = false, have_name = false, first = true;
    int r = JC_MORE;
    for (;;) {
        i = tc_skip_ws(p, i);
        if (i >= p->n) break;
        if (p->t[i] == '}') {
            if (first && !have_name) { r = JC_BAD; break; }
            i++;
            r = have_name ? JC_DONE : JC_BAD;
            break;
        }
        if (!first) {
            if (p->t[i] != ',') { r = JC_BAD; break; }
            i = tc_skip_ws(p, i + 1);
        }
        first = false;
        tc_buf key = {0};
        int kr = tc_json_string(p, &i, &key);
        if (kr != JC_DONE) { free(key.s); r = kr; break; }
        i = tc_skip_ws(p, i);
        if (i >= p->n) { free(key.s); break; }
        if (p->t[i] != ':') { free(key.s); r = JC_BAD; break; }
        i = tc_skip_ws(p, i + 1);
        const char *ks = key.s ? key.s : "";
        int vr;
        if (key_in(k->name, 3, ks, key.n) && !have_name) {
            vr = tc_json_string(p, &i, &name);
            if (vr == JC_DONE) {
                if (k->known && !tc_tool_known(p, name.s ? name.s : "", name.n)) vr = JC_BAD;
                else if (!name.n) vr = JC_BAD;
                else {
                    have_name = true;
                    c = tc_call_new(p, name.s, name.n, id.n ? id.s : NULL, id.n);
                    if (!c) vr = JC_BAD;
                    else if (pend.n) tc_put(&c->args, pend.s, pend.n);
                }
            }
        } else if (key_in(k->args, 3, ks, key.n) && !have_args) {
            have_args = true;
            vr = tc_call_args(p, &i, c ? &c->args : &pend);
        } else if (key_in(k->id, 2, ks, key.n) && !id.n) {
            vr = tc_json_string(p, &i, &id); /* kept only when it comes before the name (a stream shows both at once) */
        } else if (k->known && !(key.n == 4 && !memcmp(ks, "type", 4))) {
            vr = JC_BAD; /* a bare JSON object with other keys is an answer, not a call */
        } else vr = tc_json(p, &i, NULL);
        free(key.s);
        if (vr != JC_DONE) { r = vr; break; }
    }
    if (r == JC_DONE && c && !c->args.n) tc_puts(&c->args, "{}");
    if (r == JC_DONE && c) c->done = true;
    if (r == JC_DONE) *pi = i;
    if (r == JC_BAD && c) tc_call_drop(p); /* the caller decides what the text becomes */
    free(name.s);
    free(id.s);
    free(pend.s);
    return r;
}

int tc_json_call_list(tc_parser *p, size_t *pi, const tc_keys *k) {
    size_t i = tc_skip_ws(p, *pi);
    if (i >= p->n) return JC_MORE;
    if (p->t[i] != '[') return JC_BAD;
    i++;
    for (int q = 0;; q++) {
        i = tc_skip_ws(p, i);
        if (i >= p->n) return JC_MORE;
        if (p->t[i] == ']') {
            if (!q) return JC_BAD; /* an empty list is not a call */
            *pi = i + 1;
            return JC_DONE;
        }
        if (q) {
            if (p->t[i] != ',') return JC_BAD;
            i++;
        }
        int r = tc_json_call(p, &i, k);
        if (r != JC_DONE) return r;
    }
}

/* ---- the driver ---- */

/* Whether the prompt left the reasoning open (its generation prompt ends
 * with the start marker, blanks aside). */
static bool tail_opened(const char *tail, const char *start) {
    if (!tail || !start) return false;
    size_t n = strlen(tail), k = strlen(start);
    while (n && tc_ws(tail[n - 1])) n--;
    return n >= k && !memcmp(tail + n - k, start, k);
}

/* The reasoning at the text's start (or from its very beginning when the
 * prompt opened it); returns where the rest begins. */
static size_t reasoning(tc_parser *p, const char *tail) {
    const tok_chat_syntax *s = p->s;
    if (!s->think_end) return 0;
    bool open = s->f->think_open || tail_opened(tail, s->think_start);
    size_t i = 0;
    if (!open) {
        if (!s->think_start) return 0;
        size_t j = tc_skip_ws(p, 0);
        int r = tc_at(p, j, s->think_start);
        if (r < 0 || (j == p->n && p->partial)) { /* maybe its start: wait */
            p->stop = true;
            return p->n;
        }
        if (!r) return 0;
        open = true;
        i = j + strlen(s->think_start);
    }
    size_t at;
    int r = tc_find(p, i, s->think_end, &at);
    size_t el = strlen(s->think_end);
    if (s->reasoning_format == TOK_REASONING_NONE) { /* as written, in content */
        tc_text(p, 0, r == 1 ? at + el : at);
        if (r != 1) {
            p->stop = r < 0;
            return p->n;
        }
        return at + el;
    }
    tc_reason(p, p->t + i, at - i);
    if (r == 1) {
        tc_think_end(p);
        return at + el;
    }
    if (r < 0) p->stop = true;
    return p->n;
}

/* What no family's content may end with while cut, and what a whole text
 * may end with that is not content: the end-of-turn markers. */
static const char *const k_ends[] = {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<|endoftext|>",
                                     "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
                                     "<|END_OF_TURN_TOKEN|>", "<|end|>", "<|return|>", "<|call|>", "<turn|>",
                                     "<|im_end|>", "<end_of_turn>", "<|end_of_text|>", NULL};

/* n without the whole end-of-turn markers (and the space between them) at
 * its very end. */
static size_t strip_ends(const char *s, size_t n) {
    for (int rep = 0; rep < 4; rep++) {
        size_t m = n;
        while (m && tc_ws(s[m - 1])) m--;
        bool cut = false;
        for (int k = 0; k_ends[k]; k++) {
            size_t l = strlen(k_ends[k]);
            if (m >= l && !memcmp(s + m - l, k_ends[k], l)) {
                n = m - l;
                cut = true;
                break;
            }
        }
        if (!cut) break;
    }
    return n;
}

/* Where a cut text's last piece may be a marker's beginning, or n. */
static size_t marker_start(const tc_parser *p, const char *s, size_t n) {
    for (size_t st = n > 64 ? n - 64 : 0; st < n; st++) {
        size_t have = n - st;
        for (int k = 0; k_ends[k]; k++)
            if (strlen(k_ends[k]) > have && !memcmp(s + st, k_ends[k], have)) return st;
        for (int k = 0; p->s->f->markers[k]; k++)
            if (strlen(p->s->f->markers[k]) > have && !memcmp(s + st, p->s->f->markers[k], have)) return st;
    }
    return n;
}

/* The length of a cut text's last piece without what may be a marker's
 * beginning (partial), and without a whole end marker at its very end
 * (partial: also one before such a beginning, "<|end|> <|", which the
 * whole text may yet strip). */
static size_t tail_cut(const tc_parser *p, const char *s, size_t n, bool at_end) {
    if (!at_end) return n;
    n = strip_ends(s, n);
    if (!p->partial) return n;
    for (int rep = 0; rep < 8; rep++) {
        size_t st = marker_start(p, s, n);
        if (st == n) break;
        n = strip_ends(s, st);
    }
    /* a cut UTF-8 sequence waits for its end */
    for (size_t st = n > 4 ? n - 4 : 0; st < n; st++)
        if (utf8_seq((const unsigned char *)s + st, n - st) < 0) return st;
    return n;
}

/* s (n bytes) to b with bytes that are not UTF-8 as U+FFFD (a JSON string);
 * runs of valid text copied at once. */
static void put_clean(tc_buf *b, const char *s, size_t n) {
    size_t run = 0, i = 0;
    while (i < n) {
        uint64_t w8;
        if (i + 8 <= n && (memcpy(&w8, s + i, 8), !(w8 & 0x8080808080808080ull))) { /* ASCII: 8 at once */
            i += 8;
            continue;
        }
        unsigned char c = (unsigned char)s[i];
        int l = c < 0x80 ? 1 : utf8_seq((const unsigned char *)s + i, n - i);
        if (l > 0) {
            i += (size_t)l;
            continue;
        }
        tc_put(b, s + run, i - run);
        put_cp(b, 0xfffd);
        run = ++i;
    }
    tc_put(b, s + run, n - run);
}

static void gen_id(char *out, uint64_t seed, int idx, int style) {
    static const char al[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    uint64_t x = seed + 0x9e3779b97f4a7c15ull * (uint64_t)(idx + 1);
    int k = 0, len = style == TC_ID_MISTRAL ? 9 : 24;
    if (style != TC_ID_MISTRAL) k = (int)(stpcpy(out, "call_") - out);
    for (int i = 0; i < len; i++) {
        if (!(i % 8)) { /* splitmix64 */
            x += 0x9e3779b97f4a7c15ull;
        }
        uint64_t z = x + (uint64_t)i * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        out[k++] = al[z % 62];
    }
    out[k] = 0;
}

static json_t *finish(tc_parser *p, kvlm_error *err) {
    tc_buf content = {0};
    for (int k = 0; k < p->n_seg; k++) {
        const tc_seg *g = &p->seg[k];
        if (g->kind != SEG_TEXT && g->kind != SEG_MADE) continue;
        const char *s = g->kind == SEG_TEXT ? p->t + g->a : p->extra.s + g->a;
        size_t n = g->b - g->a;
        bool after = k > 0 && (p->seg[k - 1].kind == SEG_CALL || p->seg[k - 1].kind == SEG_THINK_END);
        bool before = k + 1 < p->n_seg && p->seg[k + 1].kind == SEG_CALL;
        bool last = k + 1 == p->n_seg;
        /* (cut: whatever follows the last piece shown is held back, so its end is held as the text's end is) */
        if (last) n = tail_cut(p, s, n, (g->kind == SEG_TEXT && g->b == p->n) || p->partial);
        if (after || (!content.n && !p->n_calls && p->has_reasoning))
            while (n && tc_ws(*s)) s++, n--;
        if (before || (last && p->partial))
            while (n && tc_ws(s[n - 1])) n--;
        put_clean(&content, s, n);
    }
    json_t *m = json_object();
    if (m) json_object_set_new(m, "role", json_string("assistant"));
    /* (every string here is UTF-8 already: put_clean and the JSON scanner made it so) */
    if (m)
        json_object_set_new(m, "content", !content.n && p->n_calls ? json_null()
                                          : json_stringn_nocheck(content.s ? content.s : "", content.n));
    if (m && p->has_reasoning && p->reasoning.n && p->s->reasoning_format == TOK_REASONING_AUTO) {
        tc_buf r = {0};
        size_t rn = p->reasoning.n;
        if (p->partial) /* a cut UTF-8 sequence waits for its end */
            for (size_t st = rn > 4 ? rn - 4 : 0; st < rn; st++)
                if (utf8_seq((const unsigned char *)p->reasoning.s + st, rn - st) < 0) {
                    rn = st;
                    break;
                }
        put_clean(&r, p->reasoning.s, rn);
        json_object_set_new(m, "reasoning_content", json_stringn_nocheck(r.s ? r.s : "", r.n));
        if (r.oom) p->oom = true;
        free(r.s);
    }
    if (m && p->n_calls) {
        json_t *a = json_array();
        json_object_set_new(m, "tool_calls", a);
        for (int i = 0; i < p->n_calls && a; i++) {
            tc_call *c = &p->calls[i];
            char id[160];
            tc_buf cid = {0}; /* the format's own id: any bytes the model wrote there, made UTF-8 */
            if (c->id && *c->id) put_clean(&cid, c->id, strlen(c->id) < 150 ? strlen(c->id) : 150);
            if (cid.n && !cid.oom) /* as much as fits, whole characters */
                snprintf(id, sizeof id, "%.*s", (int)tc_utf8_whole(cid.s, cid.n < sizeof id - 1 ? cid.n : sizeof id - 1), cid.s);
            else gen_id(id, p->seed, i, p->s->f->id_style);
            free(cid.s);
            tc_buf nm = {0};
            put_clean(&nm, c->name, strlen(c->name));
            json_t *fn = json_object(), *tc = json_object();
            if (fn) {
                json_object_set_new(fn, "name", json_stringn_nocheck(nm.s ? nm.s : "", nm.n));
                json_object_set_new(fn, "arguments", json_stringn_nocheck(c->args.s ? c->args.s : "", c->args.n));
            }
            if (tc) {
                json_object_set_new(tc, "id", json_string(id));
                json_object_set_new(tc, "type", json_string("function"));
                json_object_set_new(tc, "function", fn);
            } else json_decref(fn);
            if (!tc || json_array_append_new(a, tc)) p->oom = true;
            if (nm.oom || c->args.oom) p->oom = true;
            free(nm.s);
        }
    }
    if (content.oom || p->reasoning.oom || p->extra.oom) p->oom = true;
    free(content.s);
    if (!m || p->oom) {
        json_decref(m);
        util_err_set(err, KVLM_ENOMEM, "tool-call parser: out of memory");
        return NULL;
    }
    return m;
}

json_t *tok_chat_parse(const tok_chat_syntax *s, const tok_chat_parse_opts *o, const char *text, size_t len,
                       kvlm_error *err) {
    tok_chat_parse_opts none = {0};
    if (!o) o = &none;
    tc_parser p = {.s = s, .t = text ? text : "", .n = text ? len : 0, .partial = o->partial, .tools = o->tools,
                   .seed = o->id_seed, .tail = o->prompt_tail ? o->prompt_tail : ""};
    if (s->f->own_reasoning) {
        if (s->f->parse) s->f->parse(&p, 0);
    } else {
        size_t body = reasoning(&p, o->prompt_tail);
        if (!p.stop) {
            if (s->f->parse && !o->no_calls) s->f->parse(&p, body);
            else tc_text(&p, body, p.n);
        }
    }
    json_t *m = finish(&p, err);
    for (int i = 0; i < p.n_calls; i++) {
        free(p.calls[i].name);
        free(p.calls[i].id);
        free(p.calls[i].args.s);
    }
    free(p.calls);
    free(p.seg);
    free(p.reasoning.s);
    free(p.extra.s);
    return m;
}
