/* tok/chat_grammar: each family's calls as GBNF (tool_choice required or a
 * named function: the whole answer; auto: a lazy grammar from a call's
 * first word on), the arguments held to the tools' schemas through rules
 * the caller makes from them (tok/tool_grammar). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tok/chat_parse_impl.h"
#include "util/error.h"

typedef struct {
    tc_buf out, tail;                  /* the rules; the until-rules, written after */
    const tok_chat_syntax *s;
    const tok_chat_gbnf_tool *tools;
    int n;
    bool parallel, lazy;
    const char *ptail;                 /* the prompt's end */
    struct { char *stop; int id; char name[16]; } until[24];
    int n_until;
    kvlm_grammar_trigger trig[KVLM_GRAMMAR_MAX_TRIGGERS];
    int n_trig;
    bool failed;
} gw;

static void put(gw *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(gw *w, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (k < 0 || (size_t)k >= sizeof buf) w->failed = true;
    else tc_put(&w->out, buf, (size_t)k);
}

/* s as a GBNF literal. */
static void lit_to(tc_buf *b, const char *s, size_t n) {
    static const char hx[] = "0123456789ABCDEF";
    tc_putc(b, '"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') tc_putc(b, '\\'), tc_putc(b, (char)c);
        else if (c == '\n') tc_puts(b, "\\n");
        else if (c == '\t') tc_puts(b, "\\t");
        else if (c == '\r') tc_puts(b, "\\r");
        else if (c < 0x20 || c == 0x7f) {
            char e[5] = {'\\', 'x', hx[c >> 4], hx[c & 15], 0};
            tc_puts(b, e);
        } else tc_putc(b, (char)c);
    }
    tc_putc(b, '"');
}
static void lit(gw *w, const char *s) {
    tc_putc(&w->out, ' ');
    lit_to(&w->out, s, strlen(s));
    tc_putc(&w->out, ' ');
}
/* A tool's name as a JSON string, as a GBNF literal ("\"get_weather\""). */
static void name_json(gw *w, const char *name) {
    tc_buf q = {0};
    tc_json_quote(&q, name, strlen(name));
    tc_putc(&w->out, ' ');
    lit_to(&w->out, q.s ? q.s : "", q.n);
    tc_putc(&w->out, ' ');
    if (q.oom) w->failed = true;
    free(q.s);
}

static void trigger(gw *w, const char *word, bool at_start) {
    for (int i = 0; i < w->n_trig; i++)
        if (!strcmp(w->trig[i].word, word) && w->trig[i].at_start == at_start) return;
    if (w->n_trig == KVLM_GRAMMAR_MAX_TRIGGERS) {
        w->failed = true;
        return;
    }
    char *d = strdup(word);
    if (!d) w->failed = true;
    else w->trig[w->n_trig++] = (kvlm_grammar_trigger){d, at_start};
}

/* The code points of s. */
static int cps_of(const char *s, uint32_t *cp, int cap) {
    int k = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p && k < cap;) {
        uint32_t c = *p;
        int l = c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
        c = l == 1 ? c : l == 2 ? c & 0x1f : l == 3 ? c & 0x0f : c & 0x07;
        for (int i = 1; i < l && p[i]; i++) c = c << 6 | (p[i] & 0x3f);
        cp[k++] = c;
        p += l;
    }
    return k;
}

static void cp_escaped(tc_buf *b, uint32_t c, bool in_class) {
    char e[16];
    if (c == '\n') tc_puts(b, "\\n");
    else if (c == '\t') tc_puts(b, "\\t");
    else if (c == '\r') tc_puts(b, "\\r");
    else if (c < 0x20 || c == 0x7f || c == '"' || c == '\\' || (in_class && (c == ']' || c == '^' || c == '-' || c == '['))) {
        snprintf(e, sizeof e, "\\x%02X", c);
        tc_puts(b, e);
    } else if (c >= 0x80) {
        snprintf(e, sizeof e, c > 0xffff ? "\\U%08X" : "\\u%04X", c);
        tc_puts(b, e);
    } else tc_putc(b, (char)c);
}

/* The rule of any text without stop in it (empty too): a KMP automaton over
 * stop's code points, a rule per state; reaching stop's end is not a way. */
static const char *until(gw *w, const char *stop) {
    for (int i = 0; i < w->n_until; i++)
        if (!strcmp(w->until[i].stop, stop)) return w->until[i].name;
    if (w->n_until == 24) {
        w->failed = true;
        return "tc_u0";
    }
    int id = w->n_until;
    uint32_t cp[64];
    int k = cps_of(stop, cp, 64), f[65];
    if (!(w->until[id].stop = strdup(stop))) w->failed = true;
    w->until[id].id = id;
    w->n_until++;
    snprintf(w->until[id].name, sizeof w->until[id].name, "tc_u%d", id);
    f[0] = -1;
    for (int i = 1; i <= k; i++) {
        int b = f[i - 1];
        while (b >= 0 && cp[b] != cp[i - 1]) b = f[b];
        f[i] = b + 1;
    }
    f[0] = 0;
    for (int st = 0; st < k; st++) {
        char head[40];
        snprintf(head, sizeof head, "tc_u%d%s%d ::= | [^", id, "_", st);
        tc_puts(&w->tail, head);
        for (int j = 0; j < k; j++) {
            bool seen = false;
            for (int q = 0; q < j; q++) seen |= cp[q] == cp[j];
            if (!seen) cp_escaped(&w->tail, cp[j], true);
        }
        snprintf(head, sizeof head, "] tc_u%d_0", id);
        tc_puts(&w->tail, head);
        for (int j = 0; j < k; j++) {
            bool seen = false;
            for (int q = 0; q < j; q++) seen |= cp[q] == cp[j];
            if (seen) continue;
            int to = st; /* where stop's character j leads from state st */
            while (to > 0 && cp[to] != cp[j]) to = f[to];
            if (cp[to] == cp[j]) to++;
            if (to == k) continue; /* stop would be whole */
            tc_puts(&w->tail, " | \"");
            cp_escaped(&w->tail, cp[j], false);
            snprintf(head, sizeof head, "\" tc_u%d_%d", id, to);
            tc_puts(&w->tail, head);
        }
        tc_putc(&w->tail, '\n');
    }
    char alias[48];
    snprintf(alias, sizeof alias, "tc_u%d ::= tc_u%d_0\n", id, id);
    tc_puts(&w->tail, alias);
    return w->until[id].name;
}

/* A property whose value the XML formats write as it is (a string). */
static bool raw_string(const json_t *sch) {
    const char *t = json_string_value(json_object_get(sch, "type"));
    const json_t *e = json_object_get(sch, "enum");
    if (t && !strcmp(t, "string")) return true;
    if (!t && json_is_array(e) && json_array_size(e)) {
        size_t i;
        json_t *x;
        json_array_foreach(e, i, x) if (!json_is_string(x)) return false;
        return true;
    }
    return false;
}

/* A raw string value: its enum's texts, or any text up to stop. */
static void raw_value(gw *w, const json_t *sch, const char *stop) {
    const json_t *e = json_object_get(sch, "enum");
    if (!json_is_array(e) && json_is_string(json_object_get(sch, "const"))) {
        lit(w, json_string_value(json_object_get(sch, "const")));
        return;
    }
    if (json_is_array(e) && json_array_size(e)) {
        size_t i;
        json_t *x;
        put(w, " (");
        json_array_foreach(e, i, x) {
            if (i) put(w, " |");
            lit(w, json_string_value(x) ? json_string_value(x) : "");
        }
        put(w, ") ");
        return;
    }
    put(w, " %s ", until(w, stop));
}

/* {"name": N, "<args key>": A} with JSON's blanks. */
static void json_obj(gw *w, const tok_chat_gbnf_tool *t, const char *name_key, const char *args_key, const char *pre,
                     const char *post) {
    put(w, " \"{\" ws");
    if (pre) put(w, " %s ws \",\" ws", pre);
    put(w, " \"\\\"%s\\\"\" ws \":\" ws", name_key);
    name_json(w, t->name);
    put(w, " ws \",\" ws \"\\\"%s\\\"\" ws \":\" ws %s ws", args_key, t->args_rule);
    if (post) put(w, " %s", post);
    put(w, " \"}\" ");
}

/* XML parameters in the schema's order, the required ones always there:
 * open K mid VALUE close, a string as written up to close, others JSON. */
static void xml_params(gw *w, const tok_chat_gbnf_tool *t, const char *open, const char *mid_str, const char *mid_json,
                       const char *close, const char *val_stop) {
    if (!t->n_props) { /* a schema without properties: any parameters */
        put(w, " ( ");
        lit(w, open);
        put(w, " [a-zA-Z0-9_.-]+ ");
        lit(w, mid_json ? mid_json : mid_str);
        put(w, " tc_any ");
        lit(w, close);
        put(w, " )* ");
        return;
    }
    for (int k = 0; k < t->n_props; k++) {
        bool str = raw_string(t->prop_schemas[k]);
        put(w, " ( ");
        char *o = malloc(strlen(open) + strlen(t->prop_names[k]) + 1);
        if (!o) {
            w->failed = true;
            return;
        }
        strcpy(stpcpy(o, open), t->prop_names[k]);
        lit(w, o);
        free(o);
        lit(w, str || !mid_json ? mid_str : mid_json);
        if (str) raw_value(w, t->prop_schemas[k], val_stop);
        else put(w, " %s ", t->prop_rules[k]);
        lit(w, close);
        put(w, " )%s ", t->prop_required[k] ? "" : "?");
    }
}

#define DS_CB "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_CE "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_B "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_E "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_SEP "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>"
#define DSML "\xef\xbd\x9c" "DSML\xef\xbd\x9c"

/* tc_call_i for each tool, tc_call the choice of them; false: the family
 * has no grammar here. */
static bool calls(gw *w, const char *fam) {
    for (int i = 0; i < w->n; i++) {
        const tok_chat_gbnf_tool *t = &w->tools[i];
        put(w, "tc_call%d ::=", i);
        if (!strcmp(fam, "hermes")) {
            put(w, " \"<tool_call>\" ws");
            json_obj(w, t, "name", "arguments", NULL, NULL);
            put(w, " ws \"</tool_call>\"");
        } else if (!strcmp(fam, "generic") || !strcmp(fam, "firefunction-v2") || !strcmp(fam, "granite") ||
                   !strcmp(fam, "apriel") || !strcmp(fam, "apriel-1.5") || !strcmp(fam, "gigachat3")) {
            json_obj(w, t, "name", "arguments", NULL, NULL);
        } else if (!strcmp(fam, "llama3")) {
            json_obj(w, t, "name", "parameters", NULL, NULL);
        } else if (!strcmp(fam, "mistral-nemo")) {
            json_obj(w, t, "name", "arguments", NULL,
                     "( \",\" ws \"\\\"id\\\"\" ws \":\" ws \"\\\"\" [a-zA-Z0-9]{9} \"\\\"\" ws )?");
        } else if (!strcmp(fam, "command-r-plus")) {
            json_obj(w, t, "tool_name", "parameters", NULL, NULL);
        } else if (!strcmp(fam, "command-r7b")) {
            json_obj(w, t, "tool_name", "parameters", "\"\\\"tool_call_id\\\"\" ws \":\" ws \"\\\"\" [0-9]{1,4} \"\\\"\"",
                     NULL);
        } else if (!strcmp(fam, "mistral")) {
            put(w, " \"[TOOL_CALLS]\"");
            lit(w, t->name);
            put(w, " ( \"[CALL_ID]\" [a-zA-Z0-9]{9} )? \"[ARGS]\" %s", t->args_rule);
        } else if (!strcmp(fam, "deepseek-r1")) {
            put(w, " \"" DS_B "function" DS_SEP "\"");
            lit(w, t->name);
            put(w, " \"\\n```json\\n\" %s \"\\n```" DS_E "\"", t->args_rule);
        } else if (!strcmp(fam, "deepseek-v3.1")) {
            put(w, " \"" DS_B "\"");
            lit(w, t->name);
            put(w, " \"" DS_SEP "\" %s \"" DS_E "\"", t->args_rule);
        } else if (!strcmp(fam, "kimi-k2")) {
            put(w, " \"<|tool_call_begin|>functions.\"");
            lit(w, t->name);
            put(w, " \":\" [0-9]{1,4} \"<|tool_call_argument_begin|>\" %s \"<|tool_call_end|>\"", t->args_rule);
        } else if (!strcmp(fam, "functionary-v3.1")) {
            put(w, " \"<function=\"");
            lit(w, t->name);
            put(w, " \">\" %s \"</function>\"", t->args_rule);
        } else if (!strcmp(fam, "functionary-v3.2")) {
            lit(w, t->name);
            put(w, " \"\\n\" %s", t->args_rule);
        } else if (!strcmp(fam, "mirothinker")) {
            put(w, " \"<use_mcp_tool>\\n<server_name>\" [^<\\n]{1,64} \"</server_name>\\n<tool_name>\"");
            lit(w, t->name);
            put(w, " \"</tool_name>\\n<arguments>\\n\" %s \"\\n</arguments>\\n</use_mcp_tool>\"", t->args_rule);
        } else if (!strcmp(fam, "qwen3-coder") || !strcmp(fam, "seed-oss")) {
            bool seed = !strcmp(fam, "seed-oss");
            put(w, seed ? " \"<seed:tool_call>\\n<function=\"" : " \"<tool_call>\\n<function=\"");
            lit(w, t->name);
            put(w, " \">\\n\"");
            xml_params(w, t, "<parameter=", ">\n", NULL, "\n</parameter>\n", "\n</parameter>");
            put(w, seed ? " \"</function>\\n</seed:tool_call>\"" : " \"</function>\\n</tool_call>\"");
        } else if (!strcmp(fam, "glm-4.5")) {
            put(w, " \"<tool_call>\"");
            lit(w, t->name);
            put(w, " \"\\n\"?");
            xml_params(w, t, "<arg_key>", "</arg_key>\n<arg_value>", NULL, "</arg_value>\n", "</arg_value>");
            put(w, " \"</tool_call>\"");
        } else if (!strcmp(fam, "deepseek-v4")) {
            put(w, " \"<" DSML "invoke name=\\\"\"");
            lit(w, t->name);
            put(w, " \"\\\">\\n\"");
            xml_params(w, t, "<" DSML "parameter name=\"", "\" string=\"true\">", "\" string=\"false\">",
                       "</" DSML "parameter>\n", "</" DSML "parameter>");
            put(w, " \"</" DSML "invoke>\\n\"");
        } else if (!strcmp(fam, "gpt-oss")) {
            /* the recipient in the role ("<|start|>assistant to=functions.f<|channel|>commentary json")
             * or in the channel ("<|channel|>commentary to=functions.f <|constrain|>json") */
            put(w, " ( \" to=functions.\"");
            lit(w, t->name);
            put(w, " \"<|channel|>commentary\" | \"<|channel|>commentary to=functions.\"");
            lit(w, t->name);
            put(w, " ) ( \" json\" | \" <|constrain|>json\" )? \"<|message|>\" %s", t->args_rule);
        } else return false;
        put(w, "\n");
    }
    put(w, "tc_call ::=");
    for (int i = 0; i < w->n; i++) put(w, "%s tc_call%d", i ? " |" : "", i);
    put(w, "\n");
    return true;
}

/* tc_block: the calls as the family writes them, and the words they start with. */
static void block(gw *w, const char *fam) {
    const char *more = w->parallel ? "( ws \",\" ws tc_call )*" : "";
    bool list = false;
    const char *open = NULL, *close = NULL;
    if (!strcmp(fam, "hermes")) {
        put(w, "tc_block ::= tc_call %s\n", w->parallel ? "( ws tc_call )*" : "");
        trigger(w, "<tool_call>", false);
    } else if (!strcmp(fam, "qwen3-coder") || !strcmp(fam, "glm-4.5")) {
        put(w, "tc_block ::= tc_call %s\n", w->parallel ? "( ws tc_call )*" : "");
        trigger(w, "<tool_call>", false);
    } else if (!strcmp(fam, "seed-oss")) {
        put(w, "tc_block ::= tc_call %s\n", w->parallel ? "( ws tc_call )*" : "");
        trigger(w, "<seed:tool_call>", false);
    } else if (!strcmp(fam, "mirothinker")) {
        put(w, "tc_block ::= tc_call %s\n", w->parallel ? "( ws tc_call )*" : "");
        trigger(w, "<use_mcp_tool>", false);
    } else if (!strcmp(fam, "mistral")) {
        put(w, "tc_block ::= tc_call%s\n", w->parallel ? " tc_call*" : "");
        trigger(w, "[TOOL_CALLS]", false);
    } else if (!strcmp(fam, "functionary-v3.1")) {
        put(w, "tc_block ::= tc_call%s\n", w->parallel ? " tc_call*" : "");
        trigger(w, "<function=", false);
    } else if (!strcmp(fam, "kimi-k2")) {
        put(w, "tc_block ::= \"<|tool_calls_section_begin|>\" tc_call%s \"<|tool_calls_section_end|>\"\n",
            w->parallel ? " tc_call*" : "");
        trigger(w, "<|tool_calls_section_begin|>", false);
    } else if (!strcmp(fam, "deepseek-r1")) {
        put(w, "tc_block ::= \"" DS_CB "\" tc_call %s \"" DS_CE "\"\n", w->parallel ? "( \"\\n\" tc_call )*" : "");
        trigger(w, DS_CB, false);
    } else if (!strcmp(fam, "deepseek-v3.1")) {
        put(w, "tc_block ::= \"" DS_CB "\" tc_call%s \"" DS_CE "\"\n", w->parallel ? " tc_call*" : "");
        trigger(w, DS_CB, false);
    } else if (!strcmp(fam, "deepseek-v4")) {
        put(w, "tc_block ::= \"<" DSML "tool_calls>\\n\" tc_call%s \"</" DSML "tool_calls>\"\n",
            w->parallel ? " tc_call*" : "");
        trigger(w, "<" DSML "tool_calls>", false);
    } else if (!strcmp(fam, "functionary-v3.2")) {
        /* the generation prompt ends with ">>>": a required call's name comes first */
        size_t tl = w->ptail ? strlen(w->ptail) : 0;
        bool after = tl >= 3 && !memcmp(w->ptail + tl - 3, ">>>", 3);
        put(w, "tc_block ::= %s tc_call %s\n", w->lazy ? "\">>>\"?" : after ? "" : "\">>>\"",
            w->parallel ? "( \">>>\" tc_call )*" : "");
        for (int i = 0; i < w->n; i++) {
            char word[KVLM_GRAMMAR_MAX_TRIGGER_LEN + 1];
            if (snprintf(word, sizeof word, ">>>%s\n", w->tools[i].name) < (int)sizeof word) trigger(w, word, false);
            if (snprintf(word, sizeof word, "%s\n", w->tools[i].name) < (int)sizeof word) trigger(w, word, true);
        }
    } else if (!strcmp(fam, "gpt-oss")) {
        put(w, "tc_block ::= tc_call\n");
        trigger(w, " to=functions.", false);
        trigger(w, "<|channel|>commentary to=functions.", false);
    } else if (!strcmp(fam, "llama3")) {
        put(w, "tc_block ::= tc_call\n");
        trigger(w, "{", true);
    } else if (!strcmp(fam, "generic")) {
        put(w, "tc_block ::= tc_call | \"[\" ws tc_call %s ws \"]\"\n", more);
        trigger(w, "{", true);
        trigger(w, "[", true);
    } else if (!strcmp(fam, "gigachat3")) {
        put(w, "tc_block ::= \"<|message_sep|>\\n\\nfunction call<|role_sep|>\\n\" tc_call\n");
        trigger(w, "<|message_sep|>\n\nfunction call<|role_sep|>\n", false);
    } else {
        list = true;
        if (!strcmp(fam, "mistral-nemo")) open = "[TOOL_CALLS][", close = "]";
        else if (!strcmp(fam, "firefunction-v2")) open = "functools[", close = "]";
        else if (!strcmp(fam, "granite")) open = "<|tool_call|>[", close = "]";
        else if (!strcmp(fam, "apriel") || !strcmp(fam, "apriel-1.5")) open = "<tool_calls>[", close = "]</tool_calls>";
        else if (!strcmp(fam, "command-r7b")) open = "<|START_ACTION|>[", close = "]<|END_ACTION|>";
        else open = "Action:\n```json\n[", close = "]\n```"; /* command-r-plus */
    }
    if (list) {
        put(w, "tc_block ::=");
        lit(w, open);
        put(w, "ws tc_call %s ws", more);
        lit(w, close);
        put(w, "\n");
        char word[32]; /* the opening, without its list's "[" */
        snprintf(word, sizeof word, "%.*s", (int)strlen(open) - 1, open);
        if (!strcmp(fam, "command-r-plus")) snprintf(word, sizeof word, "Action:");
        trigger(w, word, false);
    }
}

/* Whether the prompt left the reasoning open. */
static bool opened(const tok_chat_syntax *s, const char *tail) {
    if (s->f->think_open) return true;
    if (!tail || !s->think_start) return false;
    size_t n = strlen(tail), k = strlen(s->think_start);
    while (n && tc_ws(tail[n - 1])) n--;
    return n >= k && !memcmp(tail + n - k, s->think_start, k);
}

char *tok_chat_syntax_gbnf(const tok_chat_syntax *s, const tok_chat_gbnf_tool *tools, int n_tools, bool parallel,
                           bool lazy, const char *prompt_tail, kvlm_grammar_trigger **triggers, int *n_triggers,
                           kvlm_error *err) {
    *triggers = NULL;
    *n_triggers = 0;
    const char *fam = s->f->name;
    gw w = {.s = s, .tools = tools, .n = n_tools, .parallel = parallel, .lazy = lazy, .ptail = prompt_tail};
    if (n_tools <= 0) {
        util_err_set(err, KVLM_EINVAL, "a tool-call grammar needs at least one tool");
        return NULL;
    }
    if (!calls(&w, fam)) {
        free(w.out.s);
        util_err_set(err, KVLM_EUNSUPPORTED,
                     "the %s tool-call syntax has no grammar here (its calls are parsed, not held to the tools' schemas)",
                     fam);
        return NULL;
    }
    block(&w, fam);
    if (lazy) put(&w, "root ::= tc_block\n");
    else if (!strcmp(fam, "gpt-oss")) {
        put(&w, "root ::= ( \"<|channel|>analysis<|message|>\" %s \"<|end|><|start|>assistant\" )? tc_block\n",
            until(&w, "<|end|>"));
    } else if (s->think_end && !s->f->own_reasoning) { /* (what the model writes, whatever the answer shows of it) */
        const char *u = until(&w, s->think_end);
        if (opened(s, prompt_tail)) put(&w, "root ::= %s", u);
        else {
            put(&w, "root ::= ( [ \\n]{0,2}");
            lit(&w, s->think_start);
            put(&w, "%s", u);
        }
        lit(&w, s->think_end);
        put(&w, "[ \\n]{0,4} %s tc_block\n", opened(s, prompt_tail) ? "" : ")?");
    } else put(&w, "root ::= tc_block\n");
    tc_put(&w.out, w.tail.s ? w.tail.s : "", w.tail.n);
    for (int i = 0; i < w.n_until; i++) free(w.until[i].stop);
    free(w.tail.s);
    if (w.failed || w.out.oom || w.tail.oom) {
        for (int i = 0; i < w.n_trig; i++) free((char *)w.trig[i].word);
        free(w.out.s);
        util_err_set(err, KVLM_ENOMEM, "tool-call grammar: out of memory (or a tool name too long)");
        return NULL;
    }
    if (lazy && w.n_trig) {
        *triggers = malloc((size_t)w.n_trig * sizeof **triggers);
        if (!*triggers) {
            for (int i = 0; i < w.n_trig; i++) free((char *)w.trig[i].word);
            free(w.out.s);
            util_err_set(err, KVLM_ENOMEM, "tool-call grammar: out of memory");
            return NULL;
        }
        memcpy(*triggers, w.trig, (size_t)w.n_trig * sizeof **triggers);
        *n_triggers = w.n_trig;
    } else
        for (int i = 0; i < w.n_trig; i++) free((char *)w.trig[i].word);
    return w.out.s;
}

static const json_t *fn_of(const json_t *t) {
    const json_t *f = json_object_get(t, "function");
    return json_is_object(f) ? f : t;
}

int tok_chat_tools_check(const json_t *tools, kvlm_error *err) {
    if (!json_is_array(tools)) return util_err_set(err, KVLM_EINVAL, "'tools' must be an array");
    size_t i;
    const json_t *t;
    json_array_foreach(tools, i, t) {
        if (!json_is_object(t)) return util_err_set(err, KVLM_EINVAL, "'tools[%zu]' must be an object", i);
        const char *type = json_string_value(json_object_get(t, "type"));
        if (json_object_get(t, "type") && (!type || strcmp(type, "function")))
            return util_err_set(err, KVLM_EINVAL, "'tools[%zu].type' must be \"function\"", i);
        const json_t *f = json_object_get(t, "function");
        if (!json_is_object(f)) return util_err_set(err, KVLM_EINVAL, "'tools[%zu].function' must be an object", i);
        const char *name = json_string_value(json_object_get(f, "name"));
        size_t nl = name ? strlen(name) : 0;
        if (!nl || nl > 64) /* OpenAI's rule: a-z, A-Z, 0-9, underscores and dashes, at most 64 */
            return util_err_set(err, KVLM_EINVAL, "'tools[%zu].function.name' must be a string of 1 to 64 characters", i);
        for (size_t k = 0; k < nl; k++) {
            char c = name[k];
            if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.'))
                return util_err_set(err, KVLM_EINVAL,
                                    "'tools[%zu].function.name' '%s' may only have letters, digits, '_', '-' and '.'", i, name);
        }
        for (size_t j = 0; j < i; j++)
            if (!strcmp(json_string_value(json_object_get(fn_of(json_array_get(tools, j)), "name")), name))
                return util_err_set(err, KVLM_EINVAL, "'tools[%zu].function.name' '%s' is the name of tools[%zu] too", i, name, j);
        const json_t *p = json_object_get(f, "parameters");
        if (p && !json_is_object(p))
            return util_err_set(err, KVLM_EINVAL, "'tools[%zu].function.parameters' must be an object (a JSON schema)", i);
    }
    return KVLM_OK;
}

void tok_chat_triggers_free(kvlm_grammar_trigger *t, int n) {
    if (!t) return;
    for (int i = 0; i < n; i++) free((char *)t[i].word);
    if (n) free(t);
}
